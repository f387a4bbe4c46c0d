"""One pull handoff over NIXL between a P and a D worker in one process: bandwidth and descriptors.

    python benchmarks/cpu_nixl_handoff.py [--num-blocks 256] [--block-bytes 262144] [--device cpu|cuda]

Each run does one warm-up handoff (handshake + UCX wireup), then `repeats` timed handoffs of
num_blocks blocks: contiguous (1 descriptor) or every other remote block (num_blocks descriptors).
Time is start_load_kv → D's finished_recving, both workers stepped in a loop as two engines would.
It also reports process CPU seconds per handoff and per idle second: the progress thread's price.
Every case runs in a process of its own.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
import uuid

import torch

from pdserve.config import KVTransferConfig
from pdserve.kv_transfer.nixl import NixlConnectorWorker
from pdserve.kv_transfer.pull import PullConnectorMeta, RecvSpec, SendSpec

COMPAT = {"model": "bench", "dtype": "uint8", "block_size": 16, "kv_layout": "blocks,bytes"}


def _handoff(p, d, local, remote, n) -> float:
    p.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec(f"p{n}", remote)]))
    start = time.perf_counter()
    d.start_load_kv(PullConnectorMeta(reqs_to_recv=[RecvSpec(
        f"d{n}", local, remote, p.engine_id, f"p{n}", "127.0.0.1", p.side_channel_port, p.boot_id)]))
    is_sent = is_received = False
    while not (is_sent and is_received):
        is_sent |= f"p{n}" in p.get_finished()[0]
        if not is_received and f"d{n}" in d.get_finished()[1]:
            is_received, seconds = True, time.perf_counter() - start
    if d.get_block_ids_with_load_errors():
        raise RuntimeError(d.get_load_error(f"d{n}"))
    return seconds


def measure_handoff(num_blocks: int, block_bytes: int, contiguous: bool,
                    enable_prog_thread: bool = False, repeats: int = 5, device: str = "cpu") -> dict:
    """Times `repeats` handoffs of num_blocks blocks of block_bytes; prints and returns a summary."""
    workers = []
    try:
        for role in ("producer", "consumer"):
            config = KVTransferConfig(kv_connector="nixl", kv_role=role, enable_prog_thread=enable_prog_thread)
            worker = NixlConnectorWorker(config, f"{role}-{uuid.uuid4().hex[:8]}", COMPAT)
            kv_cache = torch.zeros(2 * num_blocks, block_bytes, dtype=torch.uint8, device=device)
            if role == "producer":
                kv_cache.random_(0, 256)
            worker.register_kv_caches(kv_cache)
            workers.append((worker, kv_cache))
        (p, p_cache), (d, d_cache) = workers
        local = list(range(num_blocks))
        remote = local if contiguous else list(range(0, 2 * num_blocks, 2))
        _handoff(p, d, local, remote, "warm")
        before = d.get_stats()
        cpu_start = time.process_time()
        seconds = [_handoff(p, d, local, remote, n) for n in range(repeats)]
        cpu_per_handoff = (time.process_time() - cpu_start) / repeats
        cpu_start = time.process_time()
        time.sleep(1.0)
        cpu_idle = time.process_time() - cpu_start
        assert torch.equal(d_cache[local], p_cache[remote])
        after = d.get_stats()
        num_bytes = num_blocks * block_bytes
        result = {
            "device": device, "num_blocks": num_blocks, "block_bytes": block_bytes, "contiguous": contiguous,
            "enable_prog_thread": enable_prog_thread, "repeats": repeats,
            "descriptors": (after["kv_transfer_descriptors_total"] - before["kv_transfer_descriptors_total"])
            // repeats,
            "median_s": statistics.median(seconds), "min_s": min(seconds),
            "gb_per_s": num_bytes / statistics.median(seconds) / 1e9,
            "cpu_s_per_handoff": cpu_per_handoff, "cpu_s_per_idle_s": cpu_idle,
        }
        print(f"{device} {num_blocks} x {block_bytes} B {'contiguous' if contiguous else 'scattered '} "
              f"prog_thread={'on ' if enable_prog_thread else 'off'}: {result['gb_per_s']:6.2f} GB/s "
              f"(median {result['median_s'] * 1e3:7.2f} ms), {result['descriptors']} descriptors, "
              f"CPU {cpu_per_handoff * 1e3:.1f} ms/handoff, {cpu_idle:.2f} CPU-s per idle s", flush=True)
        return result
    finally:
        for worker, _ in workers:
            worker.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--block-bytes", type=int, default=256 << 10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    # Each case in a fresh process: a progress thread outlives its agent's shutdown and would keep a
    # core busy (and its CPU time counted) through every later case of the same process.
    ctx = multiprocessing.get_context("spawn")
    results = []
    for contiguous in (True, False):
        for prog in (False, True):
            with ctx.Pool(1) as pool:
                results.append(pool.apply(measure_handoff, (args.num_blocks, args.block_bytes, contiguous, prog,
                                                            args.repeats, args.device)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
