"""Resident memory of one engine on the default model with and without the packed linear weights
(layers.CPU_PACKED_LINEAR: MKL on Intel, oneDNN elsewhere), each in a fresh process after a short generate.

    .venv/bin/python benchmarks/cpu_packed_memory.py [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
from pdserve.engine.llm import LLM
from pdserve.sampling_params import SamplingParams
def rss_kib():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS'))
llm = LLM("default", num_threads=2, kv_cache_memory=256 << 20)
before = rss_kib()
llm.generate([[1000 + i for i in range(40)]] * 4, SamplingParams(max_tokens=8, temperature=0))
print(before, rss_kib())
"""


def measure(packed: bool) -> dict:
    env = dict(os.environ, PDSERVE_CPU_PACKED_LINEAR="1" if packed else "0")
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    before, after = map(int, out.stdout.split()[-2:])
    return {"packed": packed, "rss_after_load_mib": before / 1024, "rss_after_generate_mib": after / 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    runs = [measure(True), measure(False)]
    for r in runs:
        print(f"packed={r['packed']}: {r['rss_after_load_mib']:.0f} MiB after load, "
              f"{r['rss_after_generate_mib']:.0f} MiB after a generate")
    print(f"packed weights: +{runs[0]['rss_after_generate_mib'] - runs[1]['rss_after_generate_mib']:.0f} MiB")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
