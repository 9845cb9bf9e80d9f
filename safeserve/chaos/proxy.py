"""A TCP proxy that can cut a link the way a network partition does (chaos fault `partition`).

A node agent that connects to the frontend through it (its `--frontend` is the proxy's port)
can be cut off: `partition()` stops forwarding in both directions without closing anything (no
FIN, no RST: the bytes are dropped, as a broken switch or a firewall would), and connections made
meanwhile are accepted and dropped likewise. Neither end learns of it except by silence, so the
frontend's lease and the agent's lease are what notice. `heal()` closes the connections that
lost bytes (their streams cannot resume mid-frame) and forwards again, so the agent reconnects.
`dropped` counts the bytes a partition dropped, by the side that sent them ("client": the agent,
"upstream": the frontend): a partition that dropped nothing cut nothing.
"""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpProxy:
    def __init__(self, target: tuple[str, int], listen_host: str = "127.0.0.1") -> None:
        self.target = target
        self._listener = socket.create_server((listen_host, 0))
        self.port = self._listener.getsockname()[1]
        self.cut = False
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._closed = False
        self.dropped = {"client": 0, "upstream": 0}
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def partition(self) -> None:
        """Drop every byte both ways from now on (connections stay open)."""
        self.cut = True

    def heal(self) -> None:
        """Forward again: the connections cut mid-stream are closed, new ones go through."""
        with self._lock:
            conns, self._conns = self._conns, []
            self.cut = False
        for c in conns:
            _close(c)

    def close(self) -> None:
        self._closed = True
        _close(self._listener)
        self.heal()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            if self_connected(upstream):
                # nothing listens at the target yet, and the kernel gave this connection the
                # target's own port: held open, it would keep the frontend from binding it
                _close(upstream)
                _close(client)
                continue
            with self._lock:
                self._conns += [client, upstream]
            for src, dst, side in ((client, upstream, "client"), (upstream, client, "upstream")):
                threading.Thread(target=self._pump, args=(src, dst, side), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, side: str) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                break
            if not data:
                break
            if self.cut:
                self.dropped[side] += len(data)  # partitioned: the bytes go nowhere
                continue
            try:
                dst.sendall(data)
            except OSError:
                break
        _close(src)
        _close(dst)


def self_connected(s: socket.socket) -> bool:
    """A TCP self-connect: a connection to a local port nothing listens on whose source port
    the kernel picked equal to it (both ends are this socket). An agent reconnecting through the
    proxy while the frontend starts makes many such attempts, and one in some tens of thousands
    lands on the port the frontend is about to bind."""
    try:
        return s.getsockname() == s.getpeername()
    except OSError:
        return False


def _close(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()
