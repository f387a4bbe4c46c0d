"""A model's shape without its weights: config.json and the tokenizer's files, for a device run that builds
random weights of that shape (`--load-format dummy`) but needs the real tokenizer (text prompts, stream
recovery's token ids). tokenizer.json is gzipped: what travels to the GPU machine is capped at 64 MiB.

  python benchmarks/export_model_shape.py .gpu-model             # the default model (SmolLM2-135M-Instruct)
  there: gunzip .gpu-model/tokenizer.json.gz, then --model .gpu-model --load-format dummy
"""
from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path

from pdserve.model.loader import _gguf_checkpoint, load_tokenizer, resolve_model_path


def export(model: str, out: Path) -> None:
    path = resolve_model_path(model)
    if not path.endswith(".gguf"):
        raise SystemExit(f"{model}: a HF directory already is its own shape: copy its config.json and tokenizer")
    hf_config, _, _ = _gguf_checkpoint(path, need_weights=False)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=1))
    load_tokenizer(path).save_pretrained(str(out))
    with open(out / "tokenizer.json", "rb") as src, gzip.open(out / "tokenizer.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    (out / "tokenizer.json").unlink()
    print(f"wrote {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="default")
    args = parser.parse_args()
    export(args.model, args.out)
