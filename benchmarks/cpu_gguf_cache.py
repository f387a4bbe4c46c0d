"""Loading the default model (a GGUF file) with the conversion cache cold, then warm.

  .venv/bin/python benchmarks/cpu_gguf_cache.py [--out F.json]

The first load parses and dequantizes the GGUF and writes safetensors + tokenizer under a fresh
PDSERVE_CACHE_DIR; the second reads them back (what every later instance start does).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["PDSERVE_CACHE_DIR"] = cache
        from pdserve.model.loader import load_model, resolve_model_path
        path = resolve_model_path("default")
        seconds = []
        for _ in ("cold", "warm"):
            start = time.perf_counter()
            load_model(path, torch.float32, torch.device("cpu"))
            seconds.append(time.perf_counter() - start)
    result = {"model": path, "cold_s": seconds[0], "warm_s": seconds[1]}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
