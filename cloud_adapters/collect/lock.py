"""One collector per bundle directory: an exclusive, non-blocking ``flock`` on ``.collect.lock``."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

from xroute.errors import ConfigError

LOCK = ".collect.lock"


@contextlib.contextmanager
def dir_lock(root: Path) -> Iterator[None]:
    fh = open(root / LOCK, "a+")
    try:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another collector is writing {root} (lock {LOCK})") from None
        yield
    finally:
        fh.close()
