"""API keys: one or more per tenant, stored hashed; an ``admin`` role for the admin routes.

A key reads ``xr_<key id>_<secret>``: the key id (public, 8 hex digits) finds the record, the
secret (32 random bytes, URL-safe base64) is checked against ``sha256(salt || secret)`` with a
per-key random salt, compared in constant time. A fast hash is enough because the secret is
random with 256 bits of entropy (nothing to brute-force, unlike a password); the salt keeps equal
secrets from sharing a hash. The plaintext key is printed once by ``add`` and never stored or
logged; the store reloads the file when it changes, so keys added or revoked take effect without a
restart.

Manage keys with ``xroute keys add --tenant acme [--admin] --keys-file PATH``,
``list`` and ``revoke KEY_ID``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from xroute.errors import ConfigError
from xroute.schema.access import NAME_PATTERN, Principal
from xroute.schema.access import KeyRole as Role

PREFIX = "xr_"
_ROLE = re.compile(NAME_PATTERN)


def _hash(salt: bytes, secret: str) -> str:
    return hashlib.sha256(salt + secret.encode()).hexdigest()


def _split(key: str) -> tuple[str, str] | None:
    if not key.startswith(PREFIX) or len(key) > 200:
        return None
    key_id, sep, secret = key[len(PREFIX):].partition("_")
    if not sep or len(key_id) != 8 or not secret:
        return None
    return key_id, secret


_VERIFIED_MAX = 1024  # distinct valid keys remembered (every valid key of a deployment, in practice)


class KeyStore:
    """Hashed keys in a JSON file, reloaded (at most every ``check_s``) when the file changes."""

    def __init__(self, path: Path, check_s: float = 2.0):
        self.path = Path(path)
        self.check_s = check_s
        self._records: dict[str, dict[str, Any]] = {}
        self._ready: dict[str, tuple[dict[str, Any], bytes, Principal]] = {}
        # keys already verified -> (their record, principal): a service presents the same key on every
        # request, and hashing it each time cost the route's event loop (docs/results.md). Held only in
        # this process's memory (never written or logged), checked against the current record so a
        # revoked or replaced key fails at the next reload, bounded so random keys cannot grow it.
        self._verified: dict[str, tuple[dict[str, Any], Principal]] = {}
        self._mtime: float | None = None
        self._checked = 0.0
        self._lock = threading.Lock()
        self.reload()

    def reload(self) -> None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._records, self._mtime = {}, None
            return
        if self._mtime == st.st_mtime_ns:
            return
        try:
            data = json.loads(self.path.read_text())
            records = {r["key_id"]: r for r in data.get("keys", [])}
            for r in records.values():
                bytes.fromhex(r["salt"])
                if not isinstance(r["role"], str) or not _ROLE.match(r["role"]) or not isinstance(r["tenant"], str):
                    raise ValueError(f"key {r['key_id']}: bad role or tenant")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            if self._mtime is None and not self._records:
                raise ConfigError(f"{self.path}: not a valid keys file ({type(e).__name__}: {e}); "
                                  "to fix: recreate it with xroute keys add") from None
            return  # keep the last good keys; a half-written file must not lock everyone out
        self._records, self._mtime = records, st.st_mtime_ns

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked >= self.check_s:
            with self._lock:
                if now - self._checked >= self.check_s:
                    self._checked = now
                    self.reload()

    def verify(self, key: str) -> Principal | None:
        """The principal owning ``key``, or ``None`` for an unknown, revoked or malformed key."""
        self._maybe_reload()
        hit = self._verified.get(key)
        if hit is not None and self._records.get(hit[1].key_id) is hit[0]:
            return hit[1]
        parts = _split(key)
        if parts is None:
            return None
        rec = self._records.get(parts[0])
        if rec is None:
            return None
        ready = self._ready.get(parts[0])
        if ready is None or ready[0] is not rec:  # per record, once: its salt as bytes, its principal
            ready = self._ready[parts[0]] = (rec, bytes.fromhex(rec["salt"]),
                                             Principal(tenant=rec["tenant"], role=rec["role"], key_id=rec["key_id"]))
        if not hmac.compare_digest(_hash(ready[1], parts[1]), rec["hash"]):
            return None
        if len(self._verified) >= _VERIFIED_MAX:
            self._verified.clear()
        self._verified[key] = (rec, ready[2])
        return ready[2]

    @property
    def empty(self) -> bool:
        return not self._records


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {"keys": []}
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("keys", []), list):
        raise ConfigError(f"{path}: expected an object with a 'keys' list")
    data.setdefault("keys", [])
    return data


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def add_key(path: Path, tenant: str, role: Role = "tenant", note: str = "") -> str:
    """Create a key for ``tenant`` in the keys file and return the plaintext key (shown once)."""
    if not tenant or len(tenant) > 64 or not all(c.isalnum() or c in "-_." for c in tenant):
        raise ConfigError(f"--tenant: '{tenant}' must be 1-64 letters, digits, '-', '_' or '.'")
    if not _ROLE.match(role):
        raise ConfigError(f"--role: '{role}' is not a role name (letters, digits, '.', '_', '-'; at most 64)")
    data = _read(path)
    existing = {r["key_id"] for r in data["keys"]}
    key_id = secrets.token_hex(4)
    while key_id in existing:
        key_id = secrets.token_hex(4)
    secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=").replace("_", "-")
    salt = secrets.token_bytes(16)
    data["keys"].append({"key_id": key_id, "tenant": tenant, "role": role, "salt": salt.hex(),
                         "hash": _hash(salt, secret), "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                         "note": note})
    _write(path, data)
    return f"{PREFIX}{key_id}_{secret}"


def revoke_key(path: Path, key_id: str) -> bool:
    data = _read(path)
    keep = [r for r in data["keys"] if r["key_id"] != key_id]
    if len(keep) == len(data["keys"]):
        return False
    data["keys"] = keep
    _write(path, data)
    return True


def list_keys(path: Path) -> list[dict[str, Any]]:
    return [{k: r.get(k, "") for k in ("key_id", "tenant", "role", "created_at", "note")} for r in _read(path)["keys"]]


cli = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Manage the router's API keys.")
KeysFile = Annotated[Path, typer.Option("--keys-file", envvar="XROUTE_ROUTER_KEYS_FILE",
                                        help="keys file (the router's keys_file setting)")]
DEFAULT_KEYS_FILE = Path("runs/router/keys.json")


@cli.command()
def add(tenant: Annotated[str, typer.Option(help="tenant the key belongs to")],
        admin: Annotated[bool, typer.Option(help="admin role (admin routes, every tenant's decisions)")] = False,
        note: Annotated[str, typer.Option(help="free text, e.g. who holds the key")] = "",
        role: Annotated[str | None, typer.Option(help="the key's role: tenant (default), admin, or a role defined "
                                                      "with PUT /v1/admin/roles/{name} (e.g. auditor)")] = None,
        keys_file: KeysFile = DEFAULT_KEYS_FILE) -> None:
    """Create a key; it is printed once and stored only hashed."""
    typer.echo(add_key(keys_file, tenant, role or ("admin" if admin else "tenant"), note))


@cli.command(name="list")
def list_(keys_file: KeysFile = DEFAULT_KEYS_FILE) -> None:
    """List key ids, tenants and roles (never secrets)."""
    for r in list_keys(keys_file):
        typer.echo(f"{r['key_id']}  {r['tenant']:<20} {r['role']:<7} {r['created_at']}  {r['note']}")


@cli.command()
def revoke(key_id: str, keys_file: KeysFile = DEFAULT_KEYS_FILE) -> None:
    """Delete a key by id; running routers stop accepting it within seconds."""
    if not revoke_key(keys_file, key_id):
        raise ConfigError(f"no key with id '{key_id}' in {keys_file}")
    typer.echo(f"revoked {key_id}")


if __name__ == "__main__":
    import sys

    try:
        cli()
    except ConfigError as e:
        print(f"xroute keys: error: {e}", file=sys.stderr)
        sys.exit(2)
