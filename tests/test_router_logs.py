"""The router's stderr is JSON lines only: what libraries and the interpreter say there too (issue 21,
finding 7: psycopg's "error ignored terminating <psycopg.AsyncPipeline [BAD]>" came out as plain
text during a PostgreSQL outage). A fresh interpreter configures the router's logging, then makes
every kind of such output happen; each line it wrote must be a JSON object, and each must be there."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.servers import REPO_ROOT

_SCRIPT = r'''
import asyncio, gc, logging, threading, warnings
from router.core.logs import configure_logging, flush_logs

configure_logging("INFO")
logging.getLogger("psycopg").warning("error ignored terminating %r: %s", "<psycopg.AsyncPipeline [BAD]>", "gone")
logging.getLogger("redis").error("a redis client error")
warnings.warn("a library's deprecation", DeprecationWarning)
warnings.warn("a runtime warning")

class Leaky:
    def __del__(self):
        raise RuntimeError("raised in __del__")

Leaky()
gc.collect()

def boom():
    raise ValueError("raised in a thread")

t = threading.Thread(target=boom, name="worker-thread")
t.start()
t.join()

async def main():
    async def fails():
        raise KeyError("never retrieved")
    task = asyncio.ensure_future(fails())
    await asyncio.sleep(0.01)
    del task
    gc.collect()
    asyncio.get_running_loop().call_exception_handler({"message": "a loop callback failed"})

asyncio.run(main())
gc.collect()
flush_logs()
'''


def test_everything_written_to_stderr_is_a_json_line() -> None:
    res = subprocess.run([sys.executable, "-W", "default", "-c", _SCRIPT], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}\nall of stderr:\n{res.stderr}") from None
    text = "\n".join(json.dumps(r) for r in records)
    for said in ("error ignored terminating", "a redis client error", "a library's deprecation", "a runtime warning",
                 "raised in __del__", "raised in a thread", "never retrieved", "a loop callback failed"):
        assert said in text, (said, res.stderr)
    assert all(isinstance(r, dict) and r["level"] and r["logger"] for r in records)
    assert res.stdout == ""
