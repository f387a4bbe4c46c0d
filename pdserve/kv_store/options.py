"""`pdserve kv-store`'s flags and defaults, apart from the server so that `pdserve --help` does not load
torch and NIXL to list them."""
from __future__ import annotations

import argparse

from pdserve.cli_types import port_or_zero

DEFAULT_LEASE_S = 30.0
DEFAULT_INSERT_TTL_S = 90.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address of the store's side channel")
    p.add_argument("--port", type=port_or_zero, default=8700, help="the side channel's port (0: a free one)")
    p.add_argument("--capacity", default="1GiB",
                   help="bytes of KV the pool holds (DRAM, allocated at the first client's handshake): "
                        "e.g. 8GiB, 512MiB; least recently used blocks are evicted beyond it")
    p.add_argument("--lease-seconds", type=float, default=DEFAULT_LEASE_S,
                   help="a lookup's blocks stay pinned this long unless released (a crashed reader's pins go then)")
    p.add_argument("--insert-ttl-seconds", type=float, default=DEFAULT_INSERT_TTL_S,
                   help="slots given to a writer are reused this long after, if it never commits")
    p.add_argument("--pool-device", default="cpu", metavar="cpu|cuda[:N]",
                   help="where the pool lives: host memory (default), or one GPU's memory, which instances "
                        "on this host reach GPU to GPU (CUDA IPC through NIXL) instead of through the host")
    p.add_argument("--no-shared-memory", dest="shared_memory", action="store_false",
                   help="keep the pool out of shared memory: clients on this host then move KV over NIXL "
                        "(CMA or TCP loopback), a CPU handoff taking 2.4x as long (default: clients on this "
                        "host map the pool and copy)")
    p.add_argument("--metrics-port", type=port_or_zero, default=None,
                   help="also serve Prometheus metrics at http://HOST:PORT/metrics (HOST: --host): the pool's "
                        "slots (stored, free), leases and inserts in flight, blocks inserted, evicted and hit, "
                        "lookups, expirations, refusals for want of space (default: off; `stats` over the side "
                        "channel says the same)")
