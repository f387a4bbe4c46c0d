"""The GPU comparison of issue 5: colocated vs chunked-prefill colocated vs 1P1D, on 2 H200s each.

Llama-3.1-8B shape, bfloat16, random weights (`--load-format dummy`, one seed for every instance).
SLO: TTFT <= 2 s and TPOT <= 30 ms; a configuration's figure is the highest swept rate at which >= 90%
of requests meet both (and every lower rate did too). Two workloads:

  prefill-heavy  input 2,048-8,192 tokens, output 128-512 (uniform), 60 prompts per rate
  decode-heavy   input 256-1,024, output 512-1,024, 360 prompts per rate (fewer never fill a decode GPU),
                 every instance with --max-num-seqs 512 (at 256 a lone decode GPU queues requests long
                 before its memory or TPOT is the limit)
The rates are chosen from the first runs (2026-11-29, docs/benchmarks.md) so that each configuration's
limit falls inside the sweep; the chunked configuration runs once per --chunked-budget.

Each workload is one `pdserve bench compare --device cuda --num-devices 2` over the GPUs it is given.
With 4 GPUs visible the two workloads run side by side (GPUs 0,1 and 2,3: separate GPUs, separate
ports; they share the host's CPUs, which the engines barely use); with 2 they run one after the other.
Every workload's compare is stopped (SIGTERM: it still writes the summary of what ran) after
--time-limit seconds. Outputs: <out>/<workload>.tar.gz (the compare directory: per-configuration
sweep JSON with every request but without per-token latencies, summary.json/md, logs) and
<out>/<workload>-summary.md. Plots: benchmarks/compare_results.py DIR DIR where matplotlib is.

  PYTHONPATH=$PWD python3 benchmarks/gpu_compare.py --out-dir $OUT
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

SLO = ["--slo-ttft-ms", "2000", "--slo-tpot-ms", "30"]
MODEL = ["--model", "llama-3.1-8b", "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "9216"]
WORKLOADS = {
    # Without chunked prefill a whole sequence must fit one step's budget (a preempted request is
    # recomputed in one step): 8,192 + 512 tokens need a 9,216-token budget.
    "prefill-heavy": ["--input-len", "5120", "--range-ratio", "0.6", "--output-len", "320",
                      "--num-prompts", "60", "--request-rates", "6,8,10,12,14",
                      "--max-num-batched-tokens", "9216"],
    "decode-heavy": ["--input-len", "640", "--range-ratio", "0.6", "--output-len", "768",
                     "--output-range-ratio", "0.33333334", "--num-prompts", "360",
                     "--request-rates", "20,30,40", "--max-num-batched-tokens", "9216",
                     "--max-num-seqs", "512"],
}


def visible_gpus() -> list[str]:
    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        return [g for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g]
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return [str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU ")]


def compare_command(workload: str, out_dir: Path, base_port: int, args: argparse.Namespace) -> list[str]:
    overrides = []  # argparse keeps the last of a repeated flag
    if args.num_prompts:
        overrides += ["--num-prompts", args.num_prompts]
    if args.request_rates:
        overrides += ["--request-rates", args.request_rates]
    if args.configs:
        overrides += ["--configs", args.configs]
    if args.router_args:
        overrides += [f"--router-args={args.router_args}"]   # (= : flags without a space parse too)
    return [sys.executable, "-m", "pdserve", "bench", "compare", "--device", "cuda", "--num-devices", "2",
            *MODEL, *WORKLOADS[workload], *overrides, *SLO, "--ignore-eos", "--seed", "0",
            "--chunked-budget", str(args.chunked_budget), "--kv-connector", args.kv_connector,
            "--num-warmup", "4", "--start-timeout", "300", "--base-port", str(base_port),
            "--out-dir", str(out_dir), "--no-plot", "--no-progress"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="prefill-heavy,decode-heavy")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--time-limit", type=float, default=480.0, help="seconds per workload before SIGTERM")
    p.add_argument("--chunked-budget", default="2048,4096", help="one budget, or several (B,B,...): one run each")
    p.add_argument("--kv-connector", default="cuda_ipc", choices=("cuda_ipc", "nixl"))
    p.add_argument("--num-prompts", default=None, help="override the workload's prompts per rate")
    p.add_argument("--request-rates", default=None, help="override the workload's rates")
    p.add_argument("--configs", default=None, help="only these configurations (bench compare --configs)")
    p.add_argument("--router-args", default="", metavar="'FLAGS'",
                   help="the disaggregated configuration's router flags, e.g. '--policy cost "
                        "--pd-min-prompt-tokens 256' (bench compare --router-args)")
    args = p.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    gpus = visible_gpus()
    if len(gpus) < 2:
        sys.exit(f"needs 2 GPUs per workload, found {len(gpus)}")
    slots = [gpus[i:i + 2] for i in range(0, len(gpus) - 1, 2)]
    out = Path(args.out_dir)
    work = Path("/tmp/gpu-compare")
    env = {**os.environ, "PDSERVE_LOG_SLOW_STEP_MS": os.environ.get("PDSERVE_LOG_SLOW_STEP_MS", "500")}

    pending = list(enumerate(workloads))
    running: dict[str, tuple[subprocess.Popen, float, list[str]]] = {}
    free = list(slots)
    while pending or running:
        while pending and free:
            i, workload = pending.pop(0)
            slot = free.pop(0)
            cmd = compare_command(workload, work / workload, 8100 + 100 * i, args)
            print(f"[{time.strftime('%H:%M:%S')}] {workload} on GPUs {slot}: {' '.join(cmd[1:])}", flush=True)
            log = open(out / f"{workload}.log", "w")
            running[workload] = (subprocess.Popen(cmd, env={**env, "CUDA_VISIBLE_DEVICES": ",".join(slot)},
                                                  stdout=log, stderr=subprocess.STDOUT), time.monotonic(), slot)
        time.sleep(2)
        for workload, (proc, started, slot) in list(running.items()):
            if proc.poll() is None and time.monotonic() - started > args.time_limit:
                print(f"{workload}: over {args.time_limit:.0f} s, stopping it", flush=True)
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(90)
                except subprocess.TimeoutExpired:
                    proc.kill()
            if proc.poll() is not None:
                print(f"[{time.strftime('%H:%M:%S')}] {workload}: exit {proc.returncode} after "
                      f"{time.monotonic() - started:.0f} s", flush=True)
                del running[workload]
                free.append(slot)
                directory = work / workload
                if directory.exists():
                    # per-token latencies make a sweep JSON ~17 MB: over what a device call returns
                    subprocess.run([sys.executable, str(Path(__file__).with_name("compare_results.py")),
                                    str(directory), str(directory)], check=False)
                    with tarfile.open(out / f"{workload}.tar.gz", "w:gz") as tar:
                        tar.add(directory, arcname=workload)
                    summary = directory / "summary.md"
                    if summary.exists():
                        (out / f"{workload}-summary.md").write_text(summary.read_text())
                        print(summary.read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
