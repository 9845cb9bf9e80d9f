"""CurveZMQ keys and the sockets they protect: frontend <-> node agents.

A key directory (`safeserve keys DIR` writes one) holds the frontend's key pair
(`frontend.key`, `frontend.key_secret`), a node key pair (`node.key`, `node.key_secret`) and
`authorized/`, the public keys of the nodes the frontend lets in (`node.key` to begin with; add
one file per node key). The frontend needs its secret key and `authorized/`; a node needs its
secret key and `frontend.key` (the frontend's public key, so it knows whom it talks to). Both
ends are authenticated and the traffic is encrypted; a peer without an authorized key never
completes the handshake, so nothing it sends is read. Refused handshakes are counted.
"""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

FRONTEND, NODE = "frontend", "node"

# Handshake failures a server socket's monitor reports (counted as refused connections).
HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "handshake_auth",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_protocol",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake",
}


class KeyError_(ValueError):
    """A key directory that cannot serve the role asked; the message is one line."""


@dataclass(frozen=True)
class CurveKeys:
    """One end's keys: its own pair, and the frontend's public key (a node) or the directory of
    authorized node keys (the frontend)."""

    public: bytes
    secret: bytes
    server_public: bytes | None = None  # a node: the frontend's public key
    authorized: Path | None = None  # the frontend: authorized node public keys


def generate(directory: Path) -> None:
    """Writes a fresh frontend key pair, a node key pair and `authorized/node.key`."""
    directory.mkdir(parents=True, exist_ok=True)
    for role in (FRONTEND, NODE):
        zmq.auth.create_certificates(str(directory), role)
    authorized = directory / "authorized"
    authorized.mkdir(exist_ok=True)
    shutil.copy(directory / f"{NODE}.key", authorized / f"{NODE}.key")
    for secret in directory.glob("*.key_secret"):
        secret.chmod(0o600)


def load(directory: Path, role: str) -> CurveKeys:
    """The keys of `role` (FRONTEND or NODE) from `directory`; KeyError_ names what is missing."""
    own = directory / f"{role}.key_secret"
    if not own.is_file():
        raise KeyError_(f"{own} not found (write a key directory with `safeserve keys DIR`)")
    public, secret = zmq.auth.load_certificate(str(own))
    if secret is None:
        raise KeyError_(f"{own} holds no secret key")
    if role == FRONTEND:
        authorized = directory / "authorized"
        if not authorized.is_dir() or not any(authorized.glob("*.key")):
            raise KeyError_(f"{authorized} holds no node public key (*.key)")
        return CurveKeys(public, secret, authorized=authorized)
    server = directory / f"{FRONTEND}.key"
    if not server.is_file():
        raise KeyError_(f"{server} not found: a node needs the frontend's public key")
    server_public, _ = zmq.auth.load_certificate(str(server))
    return CurveKeys(public, secret, server_public=server_public)


def secure_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Makes `sock` (before it binds) a CurveZMQ server: only authorized keys get through
    (the ZAP handler `start_authenticator` runs decides)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Makes `sock` (before it connects) a CurveZMQ client of the frontend."""
    assert keys.server_public is not None
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public


def start_authenticator(ctx: zmq.Context, keys: CurveKeys):  # type: ignore[no-untyped-def]
    """The ZAP handler of `ctx` (a thread): lets in the public keys of `keys.authorized`."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(keys.authorized))
    return auth


class HandshakeCounter:
    """Counts the refused handshakes of a server socket from its monitor (call `poll` often;
    it never blocks)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._mon = sock.get_monitor_socket(sum(HANDSHAKE_FAILED))
        self.refused: Counter[str] = Counter()

    def poll(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._mon, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            reason = HANDSHAKE_FAILED.get(event["event"])
            if reason is not None:
                self.refused[reason] += 1

    def close(self) -> None:
        self._mon.close(linger=0)
