"""CURVE encryption and client authentication for every ZMQ socket (--omni-curve-keys).

One key directory, made by ``omnistage curve-keys DIR``:
  server.key / server.key_secret   the head's keypair (the secret stays on the head)
  client.key / client.key_secret   the replicas' keypair (copy both to replica hosts)
plus any other ``*.key`` public keys the head should accept from replicas.

The head is the CURVE server on all its sockets and accepts only clients whose public
key is in the directory (ZAP); replicas are CURVE clients pinned to the head's public
key. The roles do not depend on who binds, so replicas that bind their own sockets
work the same. Options are set as context defaults, so every socket made afterwards
(registration, handshake, heartbeats, data) is covered without per-socket plumbing.
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from omnistage.protocol.errors import ConfigError

SERVER = "server"
CLIENT = "client"


def generate(directory: str | os.PathLike[str]) -> list[Path]:
    """Create the server and client keypairs in ``directory`` (refusing to overwrite)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    existing = [root / f"{n}.key{s}" for n in (SERVER, CLIENT) for s in ("", "_secret")]
    taken = [p for p in existing if p.exists()]
    if taken:
        raise ConfigError("", f"{taken[0]} already exists; not overwriting keys")
    for name in (SERVER, CLIENT):
        zmq.auth.create_certificates(root, name)
    for path in root.glob("*.key_secret"):
        path.chmod(0o600)
    return existing


def _load(root: Path, name: str, secret: bool) -> tuple[bytes, bytes | None]:
    path = root / (f"{name}.key_secret" if secret else f"{name}.key")
    if not path.is_file():
        raise ConfigError(
            "--omni-curve-keys", f"{path} not found (make keys with `omnistage curve-keys DIR`)"
        )
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise ConfigError("--omni-curve-keys", f"cannot read {path}: {exc}") from None
    if secret and not secret_key:
        raise ConfigError("--omni-curve-keys", f"{path} holds no secret key")
    return public, secret_key


def secure_head(ctx: zmq.Context, directory: str) -> ThreadAuthenticator:
    """Make ``ctx`` a CURVE server that admits only the directory's client keys.

    Call before creating any socket. Returns the running authenticator (stop it when
    the context is done)."""
    root = Path(directory)
    public, secret = _load(root, SERVER, secret=True)
    # The authenticator's own (inproc) socket is created before the CURVE defaults.
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(root))
    ctx.setsockopt(zmq.CURVE_SERVER, 1)
    ctx.setsockopt(zmq.CURVE_PUBLICKEY, public)
    ctx.setsockopt(zmq.CURVE_SECRETKEY, secret)
    return auth


def secure_replica(ctx: zmq.Context, directory: str) -> None:
    """Make ``ctx`` a CURVE client of the head whose public key is in the directory."""
    root = Path(directory)
    server_public, _ = _load(root, SERVER, secret=False)
    public, secret = _load(root, CLIENT, secret=True)
    ctx.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    ctx.setsockopt(zmq.CURVE_PUBLICKEY, public)
    ctx.setsockopt(zmq.CURVE_SECRETKEY, secret)


def check_head_dir(directory: str) -> None:
    """Fail early (a usage error) when the head's keys are missing."""
    _load(Path(directory), SERVER, secret=True)


def check_replica_dir(directory: str) -> None:
    _load(Path(directory), SERVER, secret=False)
    _load(Path(directory), CLIENT, secret=True)
