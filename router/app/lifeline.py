"""A worker of ``xroute serve --workers N`` dies with its supervisor, however the supervisor died.

uvicorn's supervisor stops its workers when it is asked to (SIGTERM, SIGINT), but a supervisor
that is SIGKILLed (or OOM-killed, or crashes) cannot: its workers were left running -- answering
requests, holding the port, their decision-log writers and multiprocessing's resource tracker with
them -- and the next ``xroute serve`` on that port failed with "Address already in use".

So each worker, as it builds its app (:func:`follow_supervisor`, from
``router.app.factory.app_from_environment``), ties itself to the supervisor whose pid ``xroute serve``
put in ``XROUTE_SUPERVISOR_PID``:

* on Linux, ``prctl(PR_SET_PDEATHSIG, SIGTERM)``: the kernel sends the worker SIGTERM the moment
  the supervisor's thread that started it exits (uvicorn starts and restarts workers from its main
  thread), and uvicorn's usual graceful shutdown follows: no new connections, the requests in
  flight answered, the decision log's pending rows committed. (``ctypes`` on the C library's
  ``prctl`` rather than a package for one call.)
* everywhere, a watchdog thread that checks every ``poll_s`` whether the worker's parent is still
  the supervisor (a dead parent's children are re-parented): if not, the same SIGTERM -- the
  fallback where ``prctl`` does not exist, and for a supervisor that died before the ``prctl``.

Either way, a worker whose graceful shutdown has not ended ``grace_s`` after it began exits
(``os._exit``). What the worker started ends with it: its SQLite writer process exits when its pipe
closes, and multiprocessing's resource tracker when the last process holding its pipe is gone.
Tested by SIGKILLing the supervisor of a real ``xroute serve --workers 2``
(``tests/test_router_drill.py``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

from router.core.logs import LOG, flush_logs

#: the environment variable ``xroute serve --workers N`` sets to its own pid for its workers
SUPERVISOR_ENV = "XROUTE_SUPERVISOR_PID"
#: ``<linux/prctl.h>``
_PR_SET_PDEATHSIG = 1


def _death_signal(sig: int) -> bool:
    """Ask the kernel for ``sig`` when the parent (thread) exits; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _watch(supervisor: int, poll_s: float, grace_s: float) -> None:
    while os.getppid() == supervisor:
        time.sleep(poll_s)
    LOG.warning("the xroute serve supervisor is gone; this worker stops", extra={"fields": {
        "supervisor_pid": supervisor, "worker_pid": os.getpid()}})
    flush_logs()
    os.kill(os.getpid(), signal.SIGTERM)  # (a second one after prctl's is harmless to uvicorn)
    time.sleep(grace_s)
    LOG.error("graceful shutdown did not end in time after the supervisor died; exiting",
              extra={"fields": {"grace_s": grace_s}})
    flush_logs()
    os._exit(1)


def follow_supervisor(poll_s: float = 0.5, grace_s: float = 15.0) -> bool:
    """In a worker of ``xroute serve --workers N`` (``$XROUTE_SUPERVISOR_PID`` names its parent):
    die with the supervisor (module docstring). Returns whether this process is such a worker. A
    worker whose supervisor died before this call stops at once (the watchdog's first check)."""
    try:
        supervisor = int(os.environ.get(SUPERVISOR_ENV, ""))
    except ValueError:
        return False
    if supervisor == os.getpid():  # the supervisor itself (it serves one worker in-process)
        return False
    _death_signal(signal.SIGTERM)
    threading.Thread(target=_watch, args=(supervisor, poll_s, grace_s), name="supervisor-watch",
                     daemon=True).start()
    return True
