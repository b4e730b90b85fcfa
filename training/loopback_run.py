"""torchrun for one node with its rendezvous bound to loopback:
`python -m training.loopback_run [torchrun args] -m training.train ...`.

`torchrun --standalone` starts its rendezvous and worker stores (TCPStore servers) on every
interface (`*:PORT`), so a local training run listened on the machine's public addresses
while it ran. A TCPStore server can be handed a socket already bound (`master_listen_fd`);
this module registers a rendezvous backend, `ballast-loopback`, whose one store is that of a
socket bound to 127.0.0.1, and runs torchrun with it. One node only: every agent and worker
is on this machine. The store is the agent's (`use_agent_store`), which the workers join as
clients, so no other listening socket is opened.
"""

from __future__ import annotations

import datetime
import socket
import sys
import uuid

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

BACKEND = "ballast-loopback"
HOST = "127.0.0.1"
TIMEOUT_S = 600  # torchrun's default for a static rendezvous


class LoopbackRendezvous(RendezvousHandler):
    """One node's rendezvous: this agent is the only one (rank 0 of 1); the store listens
    on 127.0.0.1 only. Restarts (max_restarts) reuse the same store."""

    def __init__(self, run_id: str, timeout_s: int = TIMEOUT_S) -> None:
        self.run_id = run_id
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._sock: socket.socket | None = None
        self._store: Store | None = None
        self._port = 0

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((HOST, 0))
            self._sock.listen(128)
            self._port = self._sock.getsockname()[1]
            self._store = TCPStore(
                HOST,
                self._port,
                1,
                True,
                self.timeout,
                multi_tenant=True,
                master_listen_fd=self._sock.fileno(),
            )
        return RendezvousInfo(
            PrefixStore(self.run_id, self._store), 0, 1, RendezvousStoreInfo(HOST, self._port)
        )

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        if self._sock is not None:
            self._sock.close()
        return True


def _create(params: RendezvousParameters) -> RendezvousHandler:
    if params.max_nodes != 1:
        raise ValueError(
            f"the {BACKEND} rendezvous is for one node (--nnodes=1), "
            f"got --nnodes={params.min_nodes}:{params.max_nodes}"
        )
    return LoopbackRendezvous(params.run_id, int(params.config.get("timeout", TIMEOUT_S)))


def rendezvous_args() -> list[str]:
    """torchrun's rendezvous arguments for one node on loopback."""
    return [
        f"--rdzv-backend={BACKEND}",
        f"--rdzv-endpoint={HOST}:0",
        f"--rdzv-id={uuid.uuid4()}",
        "--nnodes=1",
    ]


def main() -> None:
    from torch.distributed.run import main as torchrun

    rendezvous_handler_registry.register(BACKEND, _create)
    torchrun(sys.argv[1:])


if __name__ == "__main__":
    main()
