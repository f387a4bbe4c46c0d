"""benchmarks/gpu_tp.py: its roofline against figures worked by hand for the Llama-3.1-8B shape, and a smoke run
of the script on CPU (the default model, one rank), so that the two-GPU run meets no trivial failure."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_tp.py"


@pytest.fixture(scope="module")
def gpu_tp():
    spec = importlib.util.spec_from_file_location("gpu_tp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_roofline_of_two_ranks_worked_by_hand(gpu_tp):
    s = gpu_tp.shape_of("llama-3.1-8b")
    # per layer: q, k, v, o = 4096 x (32 + 8 + 8) x 128 + 32 x 128 x 4096; gate, up, down = 3 x 4096 x 14336
    assert s["layer_params"] == 32 * (41_943_040 + 176_160_768) and s["lm_head_params"] == 128_256 * 4096
    bound = gpu_tp.decode_roofline(s, 2, [2048], 2)
    weights = (6_979_321_856 + 525_336_576) * 2 / 2          # half of every layer and of the LM head
    kv = 2048 * 32 * 2 * 8 * 128 * 2 / 2                      # half of the KV heads
    sent = 2 * 32 * 4096 * 2 * 2 * 0.5 + 128_256 * 2 * 0.5   # 64 all-reduces of [1, 4096], the logits' gather
    assert bound["hbm_s"] == pytest.approx((weights + kv) / 4.3e12)
    assert bound["link_s"] == pytest.approx(sent / 397e9)
    assert gpu_tp.decode_roofline(s, 1, [2048], 2)["link_s"] == 0
    prefill = gpu_tp.prefill_roofline(s, 2, 8192, 2)
    assert prefill["compute_s"] == pytest.approx(prefill["flops"] / 1.6e15)
    assert prefill["flops"] == 2 * s["layer_params"] * 8192 + 2 * s["lm_head_params"] + 4 * 32 * 32 * 128 * 8192 * 8193 // 2


def test_a_smoke_run_on_cpu(tmp_path):
    out = tmp_path / "tp.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--model", "default", "--dtype", "float32",
                           "--tp", "1", "--batches", "1,2", "--context", "40", "--prefill-tokens", "64", "--steps", "2",
                           "--prefill-repeats", "1", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["sizes"][0]["rows"]
    assert [r["kind"] for r in rows] == ["decode", "decode", "prefill"] and all(r["step_ms"] > 0 for r in rows)
