"""Real servers for the tests and benchmarks, on free loopback ports, with every file in a temporary
directory: PostgreSQL (Debian's ``postgresql`` package: ``initdb`` + ``pg_ctl``), Redis
(``redis-server``), and the router itself -- uvicorn in a thread of this process
(:class:`ServerThread`) or ``xroute serve`` as a subprocess (:func:`start_subprocess`).

``scripts/setup.sh`` installs PostgreSQL and Redis when they are missing (what CI runs). No fake
stands in: when a server cannot start, :class:`ServerError` says why and the tests that need it fail.

PostgreSQL refuses to run as root, and CI runs as root: there the server runs as the ``postgres``
user that Debian's package creates (``runuser``), in a directory that user owns. Debian's server
rather than a Python package shipping a PostgreSQL build: it is the server production runs, it is
one apt package, and the packages that ship binaries are thin, irregularly maintained wrappers.

Credentials: the cluster's password is random, made at start and never written into code or
configs; clients find it through a ``pgpass`` file named in the URL (``passfile=``), so the URL
holds none, and the tests check that no log line shows it.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerThread:
    """``with ServerThread(app) as url:`` — uvicorn serving ``app`` on 127.0.0.1 in a daemon thread."""

    def __init__(self, app: Any, port: int | None = None, startup_timeout: float = 60.0):
        import uvicorn

        self.port = port or free_port()
        self.config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_config=None, access_log=False,
                                     lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)
        self.startup_timeout = startup_timeout
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the router failed to start (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError("the router did not start in time")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_subprocess(args: list[str], env: dict[str, str], port: int, log: Path,
                     timeout: float = 90.0) -> subprocess.Popen[bytes]:
    """``python -m xroute_app serve --port PORT ARGS`` with ``env`` added; returns once /readyz answers."""
    full_env = {**os.environ, **env}
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "xroute_app", "serve", "--port", str(port), *args],
                                cwd=REPO_ROOT, env=full_env, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}; log: {log.read_text()[-2000:]}")
        try:
            if (httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1.0).status_code == 200
                    and listens(proc.pid, port)):  # (ours: not another process that took the port meanwhile)
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError(f"router did not become ready; log: {log.read_text()[-2000:]}")


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` now (children, theirs, ...), from ``/proc`` (Linux)."""
    parent: dict[int, int] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(stat).read_text()
        except OSError:  # gone meanwhile
            continue
        fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        parent[int(stat.split("/")[2])] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier and p not in found}
        found |= frontier
    return found


def listens(pid: int, port: int) -> bool:
    """Whether ``pid`` or a process below it holds the socket listening on 127.0.0.1:``port``
    (from ``/proc/net/tcp`` and the processes' file descriptors; Linux)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:  # (0A: LISTEN)
            inodes.add(f"socket:[{fields[9]}]")
    for p in {pid} | descendants(pid):
        for fd in glob.glob(f"/proc/{p}/fd/*"):
            try:
                if os.readlink(fd) in inodes:
                    return True
            except OSError:  # gone meanwhile, or the fd closed while read
                continue
    return False


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2:].split()[0] != "Z"


def port_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:``port`` now (as uvicorn binds: SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
        except OSError:
            return False
    return True


class ServerError(RuntimeError):
    """A test server could not be found or started (the message says which and why)."""


def _as_root() -> bool:
    return os.geteuid() == 0


def postgres_bin(name: str) -> str:
    """A PostgreSQL server program: on PATH, else Debian's newest ``/usr/lib/postgresql/<v>/bin``."""
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                      key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    if versions:
        return versions[-1]
    raise ServerError(f"PostgreSQL's {name} not found (on PATH or /usr/lib/postgresql/*/bin): "
                      "install Debian's postgresql package (scripts/setup.sh does)")


class PostgresServer:
    """One PostgreSQL cluster: ``initdb`` into a temporary directory, ``pg_ctl`` on 127.0.0.1:port."""

    USER = "xroute"

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="xroute-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self.passfile = self.root / "pgpass"
        self._password = secrets.token_urlsafe(24)
        self._initialized = False

    @property
    def url(self) -> str:
        """The admin database's URL (no password: ``passfile`` names where libpq finds it)."""
        return self.database_url("postgres")

    def database_url(self, name: str) -> str:
        return f"postgresql://{self.USER}@127.0.0.1:{self.port}/{name}?passfile={self.passfile}"

    @property
    def password(self) -> str:
        """For tests that check it never reaches a log; never put it in a URL or a file of the repo."""
        return self._password

    def _run(self, args: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        if _as_root():
            args = ["runuser", "-u", "postgres", "--", *args]
        return subprocess.run(args, capture_output=True, text=True, timeout=120, **kw)

    def start(self) -> PostgresServer:
        if not self._initialized:
            self._init()
        opts = f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories='' -c fsync=on"
        res = self._run([postgres_bin("pg_ctl"), "-D", str(self.data), "-o", opts, "-l", str(self.log), "-w",
                         "-t", "60", "start"])
        if res.returncode != 0:
            log = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise ServerError(f"PostgreSQL did not start on 127.0.0.1:{self.port}: {res.stdout}{res.stderr}{log}")
        return self

    def _init(self) -> None:
        pwfile = self.root / "pw"
        pwfile.write_text(self._password + "\n")
        pwfile.chmod(0o600)
        if _as_root():
            import pwd

            try:
                pg = pwd.getpwnam("postgres")
            except KeyError:
                raise ServerError("running as root needs the 'postgres' user (Debian's postgresql package "
                                  "creates it) to run the test server") from None
            os.chown(self.root, pg.pw_uid, pg.pw_gid)
            os.chown(pwfile, pg.pw_uid, pg.pw_gid)
        res = self._run([postgres_bin("initdb"), "-D", str(self.data), "-U", self.USER, "--pwfile", str(pwfile),
                         "--auth=scram-sha-256", "--encoding=UTF8", "--locale=C", "--no-sync"])
        pwfile.unlink()
        if res.returncode != 0:
            raise ServerError(f"initdb failed: {res.stdout}{res.stderr}")
        # the client's password file: only this user reads it (libpq refuses a laxer one)
        self.passfile.write_text(f"127.0.0.1:{self.port}:*:{self.USER}:{self._password}\n")
        self.passfile.chmod(0o600)
        if _as_root():
            os.chown(self.passfile, 0, 0)
        self._initialized = True

    def create_database(self, name: str) -> str:
        """A new empty database; returns its URL."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.database_url(name)

    def stop(self, mode: str = "fast") -> None:
        if self._initialized and (self.data / "postmaster.pid").exists():
            self._run([postgres_bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"])

    def close(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


class RedisServer:
    """One ``redis-server`` on 127.0.0.1:port, nothing persisted (no RDB, no AOF), files in a
    temporary directory."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="xroute-redis-"))
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        exe = shutil.which("redis-server") or shutil.which("valkey-server")
        if exe is None:
            raise ServerError("redis-server not found on PATH: install Debian's redis-server package "
                              "(scripts/setup.sh does)")
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.root), "--protected-mode", "yes",
                                      "--daemonize", "no"], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        import redis

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"redis-server exited with {self.proc.returncode}: "
                                  f"{(self.root / 'server.log').read_text()[-2000:]}")
            try:
                with redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=1) as r:
                    if r.ping():
                        return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise ServerError(f"redis-server did not answer on 127.0.0.1:{self.port} within 30 s")

    def kill(self) -> None:
        """SIGKILL: the server dies at once, and (nothing persisted) comes back empty from :meth:`start`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def chromium(log_browser: bool = True) -> Any:
    """A headless Chromium driven by Selenium through Debian's ``chromium`` and ``chromium-driver``
    (never a browser Selenium downloads itself), with the browser's console log readable
    (``driver.get_log("browser")``). Raises :class:`ServerError` saying how to install them."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_bin = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists()
                                                   else None)
    if browser is None or driver_bin is None:
        raise ServerError("Chromium or its driver not found (chromium, chromedriver on PATH): install Debian's "
                          "chromium and chromium-driver packages (scripts/setup.sh does with XROUTE_TEST_SERVERS=1)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1000",
                "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    if log_browser:
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(executable_path=driver_bin), options=opts)
