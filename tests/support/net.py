"""A loopback TCP proxy with an off switch, for network outages between a client and a
server started by the tests (moto)."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time


class TcpProxy:
    """A loopback TCP forwarder with an off switch.

    One accept thread; per connection, one thread per direction. `pause()` closes the
    listener (new connections are refused) and shuts down every live connection (requests in
    flight break); `resume()` listens again on the same port (SO_REUSEADDR). `pause_after(n)`
    arms an automatic pause once n more client->server bytes went through, so a test can cut
    the network in the middle of an upload deterministically instead of racing a timer.
    """

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._pause_at: int | None = None
        self.bytes_up = 0
        self.paused = threading.Event()
        self.port = 0
        self._listen()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listen(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        # Non-blocking: a connection reset between select() and accept() must not hang us.
        s.setblocking(False)
        self.port = s.getsockname()[1]
        self._listener = s

    def pause(self) -> None:
        with self._lock:
            self.paused.set()
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            conns = list(self._conns)
        # shutdown (not close) wakes the pump threads blocked in recv; they close their own
        # sockets, so no fd is closed under a thread still using it.
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def resume(self) -> None:
        with self._lock:
            self._listen()
            self.paused.clear()

    def pause_after(self, nbytes: int) -> None:
        with self._lock:
            self._pause_at = self.bytes_up + nbytes

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.pause()
        self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                listener = self._listener
            if listener is None:
                time.sleep(0.01)
                continue
            try:
                ready, _, _ = select.select([listener], [], [], 0.05)
                if not ready:
                    continue
                client, _ = listener.accept()
            except (OSError, ValueError):  # closed under us by pause(): loop and re-check
                continue
            client.setblocking(True)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=5)
            upstream.settimeout(None)
        except OSError:
            client.close()
            return
        with self._lock:
            if self.paused.is_set():  # accepted just as pause() ran
                client.close()
                upstream.close()
                return
            self._conns |= {client, upstream}
        down = threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True)
        down.start()
        self._pump(client, upstream, True)
        down.join()
        with self._lock:
            self._conns -= {client, upstream}
        client.close()
        upstream.close()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if count:
                    with self._lock:
                        self.bytes_up += len(data)
                        trip = self._pause_at is not None and self.bytes_up >= self._pause_at
                        if trip:
                            self._pause_at = None
                    if trip:
                        self.pause()
                        break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
