"""Messages between two ranks: JSON headers in the rendezvous store, tensors point to point over gloo; heartbeats.

    python transport.py    # two processes: rank 1 sends a header and a tensor, rank 0 answers; both print

`Channel(store, group, me, peer)`: send() never blocks (the tensor goes out with isend, kept alive until the peer
acknowledges it); poll() returns the peer's messages already announced, each receive posted only once its data is
there, so it completes at once. `heartbeat` writes a rank's time into the store every second, `silent_for` reads
how long a rank has been silent: async_loop.py's liveness checks (a peer that vanishes is named, not waited for).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
from collections import deque

import torch
import torch.distributed as dist

from common import dist_store, setup_dist


class Channel:
    """Messages from rank `me` to rank `peer` and back. send() never blocks: the tensor goes out with isend and
    is kept alive until the peer acknowledges it; poll() returns the peer's messages that are already announced
    (each receive is posted only then, so it completes at once)."""

    def __init__(self, store, group, me: int, peer: int):
        self.store, self.group, self.me, self.peer = store, group, me, peer
        self.sent, self.seen, self.tensors = 0, 0, 0  # messages sent, messages received, tensors sent
        self.pending = deque()  # (tensor index, work, tensor) until the peer acknowledges the tensor

    @contextlib.contextmanager
    def _named(self):
        """Name the peer in an error: gloo and the store name an address, not a rank."""
        try:
            yield
        except RuntimeError as e:
            raise RuntimeError(f"rank {self.me}: talking to rank {self.peer} failed (did it die?): {e}") from e

    def send(self, header: dict, tensor: torch.Tensor | None = None) -> None:
        """Announce a message (its tensor goes out with isend, kept alive until acknowledged); never blocks."""
        key = f"async/{self.me}>{self.peer}"
        with self._named():
            if tensor is not None:
                header = {**header, "shape": list(tensor.shape), "dtype": str(tensor.dtype).split(".")[1]}
                self.pending.append((self.tensors, dist.isend(tensor, self.peer, group=self.group), tensor))
                self.tensors += 1
            self.store.set(f"{key}/{self.sent}", json.dumps(header))
            self.sent += 1
            self.store.add(f"{key}/n", 1)  # announced only once the header (and the tensor's isend) are out
            acked = self.store.add(f"{key}/ack", 0)
            while self.pending and self.pending[0][0] < acked:
                self.pending.popleft()[1].wait()  # already received: returns at once

    def poll(self) -> list[tuple[dict, torch.Tensor | None]]:
        """The peer's messages announced so far: (header, tensor or None) in order."""
        key, out = f"async/{self.peer}>{self.me}", []
        with self._named():
            n = self.store.add(f"{key}/n", 0)
            while self.seen < n:
                header = json.loads(self.store.get(f"{key}/{self.seen}"))
                self.store.delete_key(f"{key}/{self.seen}")
                tensor = None
                if "shape" in header:
                    tensor = torch.empty(header["shape"], dtype=getattr(torch, header["dtype"]))
                    dist.recv(tensor, self.peer, group=self.group)
                    self.store.add(f"{key}/ack", 1)
                out.append((header, tensor))
                self.seen += 1
        return out


def heartbeat(store, rank: int, stop: threading.Event) -> threading.Thread:
    """A daemon thread writing this rank's time into the store every second (the peers' liveness check)."""

    def beat():
        """Write the time every second until stopped, or until the store is gone."""
        while not stop.is_set():
            try:
                store.set(f"async/beat/{rank}", repr(time.time()))
            except Exception:  # the store's host (the trainer) is gone: the main loop notices and stops
                return
            stop.wait(1.0)

    t = threading.Thread(target=beat, daemon=True, name=f"heartbeat-{rank}")
    t.start()
    return t


def silent_for(store, rank: int) -> float:
    """Seconds since rank's last heartbeat (inf before the first one)."""
    return time.time() - float(store.get(f"async/beat/{rank}")) if store.check([f"async/beat/{rank}"]) else math.inf


def _demo_rank(rank: int, init_method: str) -> None:
    """One rank of main(): rank 1 sends a header and a tensor and waits for the reply; rank 0 answers it."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0")
    setup_dist(device="cpu", init_method=init_method)
    stop = threading.Event()
    heartbeat(dist_store(), rank, stop)
    chan = Channel(dist_store(), dist.new_group(backend="gloo"), rank, 1 - rank)
    if rank == 1:
        chan.send({"kind": "numbers", "from": rank}, torch.arange(4.0))
    while not (got := chan.poll()):  # poll never blocks: the peer's messages announced so far
        time.sleep(0.01)
    header, tensor = got[0]
    print(
        f"rank {rank} got {header} with {tensor}; rank {1 - rank} silent for {silent_for(dist_store(), 1 - rank):.1f}s"
    )
    if rank == 0:
        chan.send({"kind": "sum", "value": float(tensor.sum())})
    dist.barrier()
    stop.set()
    dist.destroy_process_group()


def main() -> None:
    """`python transport.py`: a world of two processes on this host trades one message each way."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:  # a free port on this host for the rendezvous
        sock.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    mp.spawn(_demo_rank, args=(init_method,), nprocs=2)


if __name__ == "__main__":
    main()
