"""Benchmark 4: the KV handoff of one prompt from P (GPU 0) to D (GPU 1), two processes, pdserve's
worker halves (NixlConnectorWorker, CudaIpcConnectorWorker) built by the connector factory.

    PYTHONPATH=$PWD python benchmarks/gpu_handoff.py --json out.json            # on a 2-GPU machine
    PYTHONPATH=$PWD python benchmarks/gpu_handoff.py --device cpu --num-layers 2 # a CPU dry run

Shape: Llama-3.1-8B by default: 32 layers × 8 KV heads × 128 dim × K/V × bf16 = 128 KiB per token,
block_size 16 → 2 MiB blocks; each engine's cache is one block-major tensor, allocated as
worker/kv_cache.py does. Per handoff: P's worker gets the SendSpecs (blocks held), then D records
t0 = monotonic() and calls start_load_kv(RecvSpecs); both processes busy-poll get_finished, as an
engine with nothing else to do; P records t1 when finished_sending names the request. The figure
is bytes / (t1 - t0): D's READ start to P's finished_sending (CLOCK_MONOTONIC is one clock for all
processes of a host). recv_s is t0 → D's finished_recving (the copy alone, without the notice to P).

Block layouts (descriptors = runs consecutive on both sides):
  contiguous  P's and D's blocks consecutive: one descriptor per request
  realistic   both sides allocated from a used pool: runs of 8–64 blocks between gaps of 1–4
  fragmented  P's blocks every other block, D's consecutive: one descriptor per block
Each case: one verified handoff (D's target blocks zeroed first, then per-block int64 checksums
compared with P's), then `repeats` timed ones. The first case of a config also pays the handshake.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback

LINK_GBPS = 397.0  # GPU0 → GPU1 tensor.copy_ of 4 GiB on nvidia-h200-x2 (shared/GPU.md)


# ---- block layouts -------------------------------------------------------------------------------

class BlockAllocator:
    """Hands out block ids from one engine's pool: consecutive, or in runs with gaps (a used pool)."""

    def __init__(self, num_blocks: int, rng: random.Random) -> None:
        self.next = 0
        self.num_blocks = num_blocks
        self.rng = rng

    def take(self, n: int, layout: str) -> list[int]:
        if layout == "contiguous":
            ids = list(range(self.next, self.next + n))
        elif layout == "every_other":
            ids = list(range(self.next, self.next + 2 * n, 2))
        else:  # realistic: runs of 8-64 blocks, gaps of 1-4 (blocks other requests hold)
            ids, block = [], self.next
            while len(ids) < n:
                run = min(self.rng.randint(8, 64), n - len(ids))
                ids.extend(range(block, block + run))
                block += run + self.rng.randint(1, 4)
        self.next = ids[-1] + 1
        if self.next > self.num_blocks:
            raise ValueError(f"layout needs {self.next} blocks, the cache has {self.num_blocks}")
        return ids


def make_requests(num_tokens: int, layout: str, concurrency: int, block_size: int, num_blocks: int,
                  seed: int) -> list[tuple[list[int], list[int]]]:
    """[(p_block_ids, d_block_ids)] for `concurrency` requests of num_tokens each."""
    rng = random.Random(seed)
    p_pool, d_pool = BlockAllocator(num_blocks, rng), BlockAllocator(num_blocks, rng)
    n = -(-num_tokens // block_size)
    p_layout = {"contiguous": "contiguous", "realistic": "realistic", "fragmented": "every_other"}[layout]
    d_layout = "realistic" if layout == "realistic" else "contiguous"
    return [(p_pool.take(n, p_layout), d_pool.take(n, d_layout)) for _ in range(concurrency)]


# ---- the two engines, each in its own process ----------------------------------------------------

def _setup(role: str, transport: str, device: str, shape: dict, env: dict, extra: dict):
    os.environ.update(env)
    import torch

    from pdserve.config import KVTransferConfig
    from pdserve.kv_transfer.factory import create_connector

    dtype = getattr(torch, shape["dtype"])
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # a CPU dry run: two busy-polling engines already take the cores
    # [blocks, layers, k/v, slots, heads, dim], as worker/kv_cache.py allocates it
    kv_cache = torch.zeros(shape["num_blocks"], shape["num_layers"], 2, shape["block_size"],
                           shape["num_kv_heads"], shape["head_dim"], dtype=dtype, device=device)
    if role == "producer":
        kv_cache.normal_()
    compat = {"model": "bench", "dtype": shape["dtype"], "block_size": shape["block_size"],
              "kv_layout": "blocks,layers,kv,slots,heads,dim",
              "kv_shape": "x".join(map(str, kv_cache.shape[1:]))}
    config = KVTransferConfig(kv_connector=transport, kv_role=role, engine_id=f"{role}-{transport}-{os.getpid()}",
                              lease_seconds=120.0, extra=dict(extra))
    _, worker = create_connector(config, shape["block_size"], compat)
    worker.register_kv_caches(kv_cache)
    return torch, kv_cache, worker


def _checksums(torch, kv_cache, block_ids: list[int]) -> list[int]:
    """Exact per-block checksums: the int16 words of each block summed in int64."""
    sums = []
    for i in range(0, len(block_ids), 128):
        index = torch.tensor(block_ids[i:i + 128], device=kv_cache.device)
        words = kv_cache.index_select(0, index).view(torch.int16).view(len(index), -1)
        sums.extend(words.sum(dim=1, dtype=torch.int64).tolist())
    return sums


def producer_main(conn, transport: str, device: str, shape: dict, env: dict, extra: dict) -> None:
    try:
        torch, kv_cache, worker = _setup("producer", transport, device, shape, env, extra)
        from pdserve.kv_transfer.pull import PullConnectorMeta, SendSpec
        conn.send(("ready", (worker.engine_id, worker.boot_id), worker.side_channel_port,  # (id, boot nonce)
                   _checksums(torch, kv_cache, list(range(shape["num_blocks"])))))
        while True:
            if conn.poll():
                message = conn.recv()
                if message[0] == "stop":
                    break
                if message[0] == "send":
                    worker.start_load_kv(PullConnectorMeta(reqs_to_send=[SendSpec(r, b) for r, b in message[1]]))
                    conn.send(("held",))
            sending, _ = worker.get_finished()
            if sending:
                now = time.monotonic()
                conn.send(("sent", {request_id: now for request_id in sending}))
        conn.send(("stats", worker.get_stats()))
        worker.shutdown()
    except Exception:
        conn.send(("error", traceback.format_exc()))


def consumer_main(conn, transport: str, device: str, shape: dict, env: dict, extra: dict) -> None:
    try:
        torch, kv_cache, worker = _setup("consumer", transport, device, shape, env, extra)
        from pdserve.kv_transfer.pull import PullConnectorMeta, RecvSpec
        conn.send(("ready", worker.engine_id, worker.side_channel_port, getattr(worker, "copy_path", None)))
        while True:
            if not conn.poll():
                worker.get_finished()  # an idle engine still steps: heartbeats, a transport's progress
                continue
            message = conn.recv()
            if message[0] == "stop":
                break
            if message[0] == "zero":
                kv_cache[torch.tensor(message[1], device=kv_cache.device)] = 0
                if kv_cache.is_cuda:  # a transport's own streams are not ordered after ours
                    torch.cuda.synchronize(kv_cache.device)
                conn.send(("zeroed",))
            elif message[0] == "checksums":
                conn.send(("checksums", _checksums(torch, kv_cache, message[1])))
            elif message[0] == "recv":
                _, (p_engine_id, p_boot_id), p_port, requests, timeout = message
                specs = [RecvSpec(d_request_id, local, remote, p_engine_id, p_request_id, "127.0.0.1", p_port,
                                  p_boot_id)
                         for d_request_id, p_request_id, local, remote in requests]
                before = worker.get_stats()["kv_transfer_descriptors_total"]
                done: dict[str, float] = {}
                t0 = time.monotonic()
                worker.start_load_kv(PullConnectorMeta(reqs_to_recv=specs))
                post_s = time.monotonic() - t0
                while len(done) < len(specs) and time.monotonic() - t0 < timeout:
                    _, recving = worker.get_finished()
                    if recving:
                        now = time.monotonic()
                        done.update({request_id: now for request_id in recving})
                errors = {r: worker.get_load_error(r) for r in done}
                errors = {r: e for r, e in errors.items() if e}
                worker.get_block_ids_with_load_errors()
                descriptors = worker.get_stats()["kv_transfer_descriptors_total"] - before
                conn.send(("recvd", t0, done, errors, descriptors, post_s))
        worker.shutdown()
    except Exception:
        conn.send(("error", traceback.format_exc()))


def link_main(conn, src: str, dst: str) -> None:
    """Reference: one tensor.copy_ from src to dst GPU in one process (what the link gives)."""
    try:
        import torch
        result = {"can_device_access_peer": torch.cuda.can_device_access_peer(0, 1)}
        for num_bytes in (256 << 20, 4 << 30):
            a = torch.empty(num_bytes, dtype=torch.uint8, device=src).random_()
            b = torch.empty(num_bytes, dtype=torch.uint8, device=dst)
            for _ in range(3):
                b.copy_(a)
            torch.cuda.synchronize(src), torch.cuda.synchronize(dst)
            times = []
            for _ in range(10):
                start = time.perf_counter()
                b.copy_(a)
                torch.cuda.synchronize(dst)
                times.append(time.perf_counter() - start)
            result[f"copy_{num_bytes >> 20}MiB_GBps"] = num_bytes / statistics.median(times) / 1e9
            del a, b
        conn.send(("link", result))
    except Exception:
        conn.send(("error", traceback.format_exc()))


# ---- the parent: orchestrates one config (a P and a D process) at a time --------------------------

class Child:
    def __init__(self, ctx, target, args, env: dict) -> None:
        self.conn, child_conn = ctx.Pipe()
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # a spawned child reads CUDA_VISIBLE_DEVICES and UCX_* at start
        try:
            self.proc = ctx.Process(target=target, args=(child_conn, *args), daemon=True)
            self.proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def expect(self, kind: str, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no {kind!r} within {timeout:.0f} s (child alive: {self.proc.is_alive()})")
        message = self.conn.recv()
        if message[0] == "error":
            raise RuntimeError(f"child failed:\n{message[1]}")
        if message[0] != kind:
            raise RuntimeError(f"expected {kind!r}, got {message[0]!r}")
        return message

    def stop(self) -> None:
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        deadline = time.monotonic() + 10
        while self.proc.exitcode is None and time.monotonic() < deadline:  # not join(): see tests
            time.sleep(0.05)
        if self.proc.exitcode is None:
            self.proc.kill()


def run_case(p: Child, d: Child, p_info, d_info, case: dict, shape: dict, repeats: int, timeout: float,
             tag: str) -> dict:
    _, p_engine_id, p_port, p_sums = p_info
    requests = make_requests(case["tokens"], case["layout"], case["concurrency"], shape["block_size"],
                             shape["num_blocks"], seed=case["tokens"] + case["concurrency"])
    num_bytes = sum(len(p_ids) for p_ids, _ in requests) * shape["block_bytes"]
    handoff_s, recv_s, posts_s, descriptors, verified = [], [], [], None, None
    for rep in range(1 + repeats):
        if rep == 0:
            d.conn.send(("zero", [b for _, d_ids in requests for b in d_ids]))
            d.expect("zeroed", timeout)
        ids = [(f"{tag}-{rep}-{i}-d", f"{tag}-{rep}-{i}-p") for i in range(len(requests))]
        p.conn.send(("send", [(p_id, p_ids) for (_, p_id), (p_ids, _) in zip(ids, requests)]))
        p.expect("held", timeout)
        d.conn.send(("recv", p_engine_id, p_port,
                     [(d_id, p_id, d_ids, p_ids) for (d_id, p_id), (p_ids, d_ids) in zip(ids, requests)], timeout))
        _, t0, done, errors, num_descriptors, post_s = d.expect("recvd", timeout + 10)
        if errors or len(done) < len(ids):
            raise RuntimeError(f"{len(done)} of {len(ids)} loads finished; errors: {errors}")
        sent: dict[str, float] = {}
        while len(sent) < len(ids):
            sent.update(p.expect("sent", timeout)[1])
        if rep == 0:
            d.conn.send(("checksums", [b for _, d_ids in requests for b in d_ids]))
            got = d.expect("checksums", timeout)[1]
            want = [p_sums[b] for p_ids, _ in requests for b in p_ids]
            verified = got == want
            if not verified:
                raise RuntimeError(f"{sum(g != w for g, w in zip(got, want))} of {len(want)} blocks differ")
            descriptors = num_descriptors / len(requests)
            continue
        handoff_s.append(max(sent.values()) - t0)
        recv_s.append(max(done.values()) - t0)
        posts_s.append(post_s)
    median = statistics.median(handoff_s)
    return {**case, "bytes": num_bytes, "descriptors_per_request": descriptors, "verified": verified,
            "handoff_s": handoff_s, "recv_s": recv_s, "post_s": posts_s, "median_ms": median * 1e3,
            "post_median_us": statistics.median(posts_s) * 1e6,
            "GBps": num_bytes / median / 1e9, "best_GBps": num_bytes / min(handoff_s) / 1e9,
            "recv_GBps": num_bytes / statistics.median(recv_s) / 1e9,
            "link_fraction": num_bytes / median / 1e9 / LINK_GBPS}


FULL_CASES = ([{"tokens": t, "layout": layout, "concurrency": 1}
               for t in (2048, 128, 512, 8192) for layout in ("contiguous", "realistic", "fragmented")]
              + [{"tokens": 2048, "layout": "realistic", "concurrency": 32},
                 {"tokens": 2048, "layout": "contiguous", "concurrency": 32}])
PROBE_CASE = {"tokens": 2048, "layout": "contiguous", "concurrency": 1}


def run_config(ctx, config: dict, shape: dict, args) -> dict:
    result = {**config, "cases": [], "error": None}
    start = time.monotonic()
    p = d = None
    try:
        p = Child(ctx, producer_main, (config["transport"], config["p_device"], shape, config["p_env"],
                                       config.get("extra", {})),
                  {**config["env"], **config["p_env"]})
        d = Child(ctx, consumer_main, (config["transport"], config["d_device"], shape, config["d_env"],
                                       config.get("extra", {})),
                  {**config["env"], **config["d_env"]})
        p_info, d_info = p.expect("ready", 120), d.expect("ready", 120)
        result["startup_s"] = time.monotonic() - start
        result["copy_path"] = d_info[3]
        probe = run_case(p, d, p_info, d_info, PROBE_CASE, shape, args.repeats, args.timeout, "probe")
        result["cases"].append(probe)
        print_row(config["name"], probe)
        if config["mode"] == "full" and probe["GBps"] >= args.probe_min_gbps:
            for n, case in enumerate(FULL_CASES):
                if case == PROBE_CASE:
                    continue
                if time.monotonic() - args.started > args.time_budget:
                    result["error"] = "time budget spent: later cases skipped"
                    break
                row = run_case(p, d, p_info, d_info, case, shape,
                               args.repeats if case["tokens"] * case["concurrency"] <= 8192 else 3,
                               args.timeout, f"c{n}")
                result["cases"].append(row)
                print_row(config["name"], row)
        elif config["mode"] == "full":
            result["error"] = f"probe below {args.probe_min_gbps} GB/s: a slow path; other cases skipped"
        p.conn.send(("stop",))
        result["p_stats"] = p.expect("stats", 30)[1]
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        print(f"{config['name']}: {result['error']}", flush=True)
    finally:
        for child in (d, p):
            if child is not None:
                child.stop()
    result["wall_s"] = time.monotonic() - start
    return result


def print_row(name: str, row: dict) -> None:
    print(f"{name:<22} {row['tokens']:>6} {row['layout']:<11} {row['concurrency']:>3} "
          f"{row['descriptors_per_request']:>8.1f} {row['bytes'] / 2**20:>9.0f} {row['median_ms']:>9.3f} "
          f"{row['GBps']:>8.1f} {row['link_fraction'] * 100:>6.1f}% {row['recv_GBps']:>9.1f} "
          f"{row['post_median_us']:>8.0f}", flush=True)


def machine_info() -> dict:
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "hostname": platform.node(), "python": platform.python_version()}
    for key, cmd in (("gpus", ["nvidia-smi", "--query-gpu=index,name,uuid,driver_version,memory.total",
                               "--format=csv,noheader"]), ("topology", ["nvidia-smi", "topo", "-m"])):
        try:
            info[key] = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            info[key] = f"unavailable: {e}"
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--transports", nargs="+", default=["cuda_ipc", "nixl"])
    parser.add_argument("--extras", nargs="*", default=["copy_torch", "map_owner", "nixl_tls", "split_visible"],
                        help="copy_torch: cuda_ipc with cuda_ipc_copy=torch (full); "
                             "map_owner: cuda_ipc with cuda_ipc_map_on=owner (full); "
                             "nixl_tls: NIXL with UCX_TLS=cuda_ipc,cuda_copy,tcp,self (full); "
                             "split_visible: each process sees only its GPU (probe per transport)")
    parser.add_argument("--num-layers", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-blocks", type=int, default=5120)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per handoff step")
    parser.add_argument("--time-budget", type=float, default=400.0, help="seconds for the whole run")
    parser.add_argument("--probe-min-gbps", type=float, default=20.0,
                        help="a transport slower than this on the probe runs the probe only (a slow path)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    args.started = time.monotonic()
    import multiprocessing as mp
    ctx = mp.get_context("spawn")

    elem = {"bfloat16": 2, "float16": 2, "float32": 4}[args.dtype]
    shape = {"num_layers": args.num_layers, "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim,
             "block_size": args.block_size, "dtype": args.dtype, "num_blocks": args.num_blocks}
    shape["bytes_per_token"] = args.num_layers * 2 * args.num_kv_heads * args.head_dim * elem
    shape["block_bytes"] = shape["bytes_per_token"] * args.block_size
    gpu = args.device == "cuda"
    p_dev, d_dev = ("cuda:0", "cuda:1") if gpu else ("cpu", "cpu")
    proto_info = {"UCX_PROTO_INFO": "y"} if gpu else {}
    configs = []
    for transport in args.transports:
        configs.append({"name": transport, "transport": transport, "mode": "full", "p_device": p_dev,
                        "d_device": d_dev, "env": proto_info if transport == "nixl" else {},
                        "p_env": {}, "d_env": {}})
    if gpu and "cuda_ipc" in args.transports:
        for extra, name, mode, options in (
                ("copy_torch", "cuda_ipc copy=torch", "full", {"cuda_ipc_copy": "torch"}),
                ("map_owner", "cuda_ipc map_on=owner", "full", {"cuda_ipc_map_on": "owner"})):
            if extra in args.extras:
                configs.insert(1, {"name": name, "transport": "cuda_ipc", "mode": mode, "p_device": p_dev,
                                   "d_device": d_dev, "env": {}, "p_env": {}, "d_env": {}, "extra": options})
    if "nixl" in args.transports and "nixl_tls" in args.extras:
        configs.append({"name": "nixl UCX_TLS=ipc,copy,tcp", "transport": "nixl", "mode": "full",
                        "p_device": p_dev, "d_device": d_dev, "p_env": {}, "d_env": {},
                        "env": {**proto_info, "UCX_TLS": "cuda_ipc,cuda_copy,tcp,self"}})
    if gpu and "split_visible" in args.extras:
        for transport in args.transports:
            configs.append({"name": f"{transport} split-visible", "transport": transport, "mode": "probe",
                            "p_device": "cuda:0", "d_device": "cuda:0", "env": {},
                            "p_env": {"CUDA_VISIBLE_DEVICES": "0"}, "d_env": {"CUDA_VISIBLE_DEVICES": "1"}})

    results = {"benchmark": "gpu-handoff", "machine": machine_info(), "shape": shape, "link_GBps_assumed": LINK_GBPS,
               "command": " ".join(sys.argv), "configs": []}

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    if gpu:
        link = Child(ctx, link_main, ("cuda:0", "cuda:1"), {})
        try:
            results["link"] = link.expect("link", 120)[1]
            print(f"link: {results['link']}", flush=True)
        except Exception as e:
            results["link"] = {"error": str(e)}
        link.stop()
        save()
    print(f"{'config':<22} {'tokens':>6} {'layout':<11} {'req':>3} {'desc/req':>8} {'MiB':>9} "
          f"{'median ms':>9} {'GB/s':>8} {'link':>7} {'recv GB/s':>9} {'post µs':>8}", flush=True)
    for config in configs:
        if time.monotonic() - args.started > args.time_budget:
            results["configs"].append({**config, "error": "time budget spent: not run"})
            continue
        results["configs"].append(run_config(ctx, config, shape, args))
        save()
    save()
    print("\nsummary (GB/s = bytes / median(D's READ start → P's finished_sending); link = "
          f"{LINK_GBPS:.0f} GB/s)", flush=True)
    for config in results["configs"]:
        for row in config.get("cases", []):
            print_row(config["name"], row)
        if config.get("error"):
            print(f"{config['name']}: {config['error'][:300]}", flush=True)


if __name__ == "__main__":
    main()
