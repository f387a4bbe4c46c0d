"""Which path does NIXL/UCX take between two processes, and how fast is it, for each pair of memories the
handoffs use: VRAM → VRAM on one GPU (pull or push with P and D sharing a GPU), VRAM ↔ a host pool in
another process (the store handoff: P WRITEs into `pdserve kv-store`'s DRAM, D READs from it), the pool
pageable or pinned, and DRAM → DRAM (the CPU machines). Each UCX setting runs in a fresh pair of processes
(UCX reads its environment once), with UCX_PROTO_INFO=y so that its log names the protocol it chose.

    PYTHONPATH=$PWD python benchmarks/gpu_nixl_paths.py --out $OUT/nixl-paths.json      # GPU machine
    PYTHONPATH=$PWD python benchmarks/gpu_nixl_paths.py --device cpu --out /tmp/p.json   # DRAM only

--target-poll-ms N: the target progresses its agent only every N ms (an engine between long steps);
BENCH_NOTIF= (empty) posts transfers without a NIXL notification (default: one, "x"), which completes only
as the target progresses: compare the two to see what waits for the target.

Per case: one verified transfer (the destination filled with a byte the source holds, checked after),
then --repeats timed ones; GB/s = bytes / (post → DONE), the initiator busy-polling, the target
progressing its agent meanwhile (as an engine's loop does). Descriptors: the whole buffer as one, or
as many of --desc-mib each (a handoff's coalesced block runs).
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import sys
import time
import traceback

CONFIGS = {   # name → UCX environment; every one also gets UCX_PROTO_INFO=y
    "default": {},
    "tls_cuda_sm_tcp": {"UCX_TLS": "cuda_copy,cuda_ipc,sm,self,tcp"},
    "rndv_frag_8m": {"UCX_RNDV_FRAG_SIZE": "host:8m,cuda:8m"},
    "memtype_direct_inf": {"UCX_RNDV_MEMTYPE_DIRECT_SIZE": "inf"},
    "cuda_ipc_same_process": {"UCX_CUDA_IPC_ENABLE_SAME_PROCESS": "y"},
    "cuda_ipc_get_zcopy": {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"},
    "tcp_seg_1m": {"UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"},
    "get_zcopy_tcp_seg_1m": {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y", "UCX_TCP_TX_SEG_SIZE": "1m",
                             "UCX_TCP_RX_SEG_SIZE": "1m"},
}
# Not here: UCX_PROTO_ENABLE=n (NIXL's RMA ops are unsupported) and UCX_TLS without tcp (NIXL wants a peer failure
# handler, which the shared-memory transports lack: its backend does not start).
NOTIF = os.environ.get("BENCH_NOTIF", "x").encode()
DEADLINE_S = 30.0   # one transfer; past it the case is recorded as stuck and the pair restarted


def _nixl():
    """NIXL's own agent class, not pdserve's new_agent: each config sets UCX's environment itself."""
    from pdserve.kv_transfer.nixl import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def _redirect_stderr(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.dup2(fd, 1)


def _buffers(torch, device: str, size: int) -> dict:
    bufs = {"dram": torch.zeros(size, dtype=torch.uint8)}
    if device == "cuda":
        bufs["vram"] = torch.zeros(size, dtype=torch.uint8, device="cuda")
        bufs["dram_pinned"] = torch.zeros(size, dtype=torch.uint8, pin_memory=True)
    return bufs


def _describe(bufs: dict) -> dict:
    return {k: (t.data_ptr(), t.numel(), "VRAM" if t.is_cuda else "DRAM", t.device.index or 0)
            for k, t in bufs.items()}


def target_main(conn, device: str, size: int, log_path: str, poll_s: float) -> None:
    _redirect_stderr(log_path)
    import torch
    nixl_agent, nixl_agent_config = _nixl()
    agent = nixl_agent("target", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    bufs = _buffers(torch, device, size)
    regs = [agent.register_memory(t) for t in bufs.values()]
    conn.send({"metadata": agent.get_agent_metadata(), "bufs": _describe(bufs)})
    while True:
        if not conn.poll(poll_s):
            agent.get_new_notifs()   # progresses UCX: a protocol that needs the target's help gets it
            continue
        op, name, value = conn.recv()
        if op == "stop":
            break
        if op == "fill":
            bufs[name].fill_(value)
            conn.send(True)
        elif op == "check":
            conn.send(bool((bufs[name] == value).all().item()))
    for r in regs:
        agent.deregister_memory(r)


def _descs(agent, base: int, size: int, desc_bytes: int, mem_type: str, dev: int):
    import numpy as np
    n = size // desc_bytes
    rows = np.empty((n, 3), dtype=np.uint64)
    rows[:, 0] = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(desc_bytes)
    rows[:, 1] = desc_bytes
    rows[:, 2] = dev
    return agent.get_xfer_descs(rows, mem_type)


def _transfer(agent, op: str, local, remote, remote_name: str) -> float:
    """Seconds from post to DONE; raises on ERR or past the deadline."""
    handle = agent.initialize_xfer(op, local, remote, remote_name, NOTIF)
    try:
        t0 = time.perf_counter()
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            if time.perf_counter() - t0 > DEADLINE_S:
                raise TimeoutError(f"{op} not done in {DEADLINE_S} s")
            state = agent.check_xfer_state(handle)
        if state == "ERR":
            raise RuntimeError(f"{op} ended in ERR")
        return time.perf_counter() - t0
    finally:
        try:
            agent.release_xfer_handle(handle)
        except Exception:
            pass


def initiator_main(conn, device: str, size: int, log_path: str, remote_info: dict, desc_sizes: list[int],
                   repeats: int) -> None:
    _redirect_stderr(log_path)
    import torch
    nixl_agent, nixl_agent_config = _nixl()
    agent = nixl_agent("initiator", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    bufs = _buffers(torch, device, size)
    bufs.pop("dram_pinned", None)
    regs = [agent.register_memory(t) for t in bufs.values()]
    remote_name = agent.add_remote_agent(remote_info["metadata"])
    local_desc, remote_desc = _describe(bufs), remote_info["bufs"]
    pairs = [("vram", t) for t in ("vram", "dram", "dram_pinned")] if device == "cuda" else []
    pairs.append(("dram", "dram"))
    value = 0
    for src, dst in pairs:
        for op in ("WRITE", "READ"):   # WRITE: local → remote; READ: remote → local
            for desc_bytes in desc_sizes:
                case = {"local": src, "remote": dst, "op": op, "descriptors": size // desc_bytes,
                        "bytes": size}
                try:
                    lb, ln, lt, ld = local_desc[src]
                    rb, rn, rt, rd = remote_desc[dst]
                    local = _descs(agent, lb, size, desc_bytes, lt, ld)
                    remote = _descs(agent, rb, size, desc_bytes, rt, rd)
                    value = value % 250 + 1
                    if op == "WRITE":
                        bufs[src].fill_(value)
                        conn.send(("fill", dst, 0)) or conn.recv()
                    else:
                        bufs[src].zero_()
                        conn.send(("fill", dst, value)) or conn.recv()
                    if device == "cuda":
                        torch.cuda.synchronize()
                    first = _transfer(agent, op, local, remote, remote_name)
                    if op == "WRITE":
                        conn.send(("check", dst, value))
                        ok = conn.recv()
                    else:
                        ok = bool((bufs[src] == value).all().item())
                    times = [_transfer(agent, op, local, remote, remote_name) for _ in range(repeats)]
                    case.update(verified=ok, first_s=first, seconds=times, gbps_best=size / min(times) / 1e9,
                                gbps_median=size / sorted(times)[len(times) // 2] / 1e9)
                except Exception as e:
                    case["error"] = f"{type(e).__name__}: {e}"
                conn.send(("case", case, None))
    conn.send(("done", None, None))
    for r in regs:
        agent.deregister_memory(r)


def run_config(ctx, name: str, env: dict, args, log_dir: str) -> dict:
    saved = dict(os.environ)
    os.environ.update({"UCX_PROTO_INFO": "y", **env})   # a spawned child reads UCX_* at start
    log_path = os.path.join(log_dir, f"ucx-{name}.log")
    out = {"env": env, "log": os.path.basename(log_path), "cases": []}
    t_conn, t_child = ctx.Pipe()
    i_conn, i_child = ctx.Pipe()
    target = ctx.Process(target=target_main, args=(t_child, args.device, args.size, log_path,
                                                                  args.target_poll_ms / 1e3), daemon=True)
    initiator = None
    try:
        target.start()
        started = time.monotonic()
        while not t_conn.poll(0.1):
            if not target.is_alive() or time.monotonic() - started > 120:
                raise RuntimeError(f"the target did not start (exit code {target.exitcode}): see the log")
        info = t_conn.recv()
        desc_sizes = [args.size, args.desc_mib << 20]
        initiator = ctx.Process(target=initiator_main, daemon=True, args=(
            i_child, args.device, args.size, log_path, info, desc_sizes, args.repeats))
        initiator.start()
        deadline = time.monotonic() + args.config_timeout
        while time.monotonic() < deadline:
            if i_conn.poll(0.01):
                kind, a, b = i_conn.recv()
                if kind == "done":
                    break
                if kind == "case":
                    out["cases"].append(a)
                    print(f"  {name:15s} {a['local']:>5s} {a['op']:5s} {a['remote']:11s} x{a['descriptors']:<4d} "
                          + (f"{a['gbps_median']:8.2f} GB/s  verified={a['verified']}" if "error" not in a
                             else a["error"]), flush=True)
                else:   # the initiator asks the target to fill or check a buffer
                    t_conn.send((kind, a, b))
                    i_conn.send(t_conn.recv() if t_conn.poll(60) else False)
            elif not initiator.is_alive():
                raise RuntimeError(f"the initiator exited ({initiator.exitcode})")
        else:
            raise TimeoutError(f"not done in {args.config_timeout} s")
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"  {name}: {out['error']}", flush=True)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        try:
            t_conn.send(("stop", None, None))
        except Exception:
            pass
        for p in (initiator, target):
            if p is not None:
                p.join(10)
                if p.is_alive():
                    p.kill()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--size-mib", type=int, default=256, help="bytes per transfer (256 MiB: a 2,048-token "
                    "Llama-3.1-8B prompt's KV)")
    ap.add_argument("--desc-mib", type=int, default=2, help="the many-descriptor case's descriptor size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--target-poll-ms", type=float, default=0.2, help="the target progresses its agent this "
                    "often (an engine does between its steps: a long step is a long gap)")
    ap.add_argument("--config-timeout", type=float, default=240.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    args.size = args.size_mib << 20
    log_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(log_dir, exist_ok=True)
    result = {"date": datetime.date.today().isoformat(), "argv": sys.argv, "size_bytes": args.size,
              "configs": {}}
    try:
        import torch
        result["torch"] = torch.__version__
        if args.device == "cuda":
            result["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        result["torch_error"] = traceback.format_exc()
    ctx = mp.get_context("spawn")
    for name in args.configs.split(","):
        print(f"{name}: {CONFIGS[name]}", flush=True)
        result["configs"][name] = run_config(ctx, name, CONFIGS[name], args, log_dir)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
