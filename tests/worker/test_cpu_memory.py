"""worker/cpu_memory.py: a CPU engine's steps stop faulting their activations' pages in again."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from pdserve.worker import cpu_memory

# Three prefill steps of 512 tokens of the default model; prints the minor page faults of the last.
# Before the fix (glibc's defaults), 60,000-100,000 of them a step on the 2-core machine; after, none.
STEPS = textwrap.dedent("""
    import random, resource
    from pdserve.engine.llm import LLM
    from pdserve.sampling_params import SamplingParams
    llm = LLM("default", enable_prefix_caching=False, max_num_batched_tokens=512, max_num_seqs=16)
    rng = random.Random(0)
    for _ in range(12):
        llm.add([rng.randrange(1000, 20000) for _ in range(128)],
                SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    engine = llm.engine
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        out = engine.scheduler.schedule()
        engine.scheduler.update_from_output(out, engine.runner.execute_model(out))
        assert out.num_scheduled_tokens == 512
    print("FAULTS", resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def test_a_prefill_step_faults_no_pages_in_after_the_first():
    env = dict(os.environ, PDSERVE_CPU_KEEP_FREED_MEMORY="1")
    result = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    faults = int(result.stdout.split("FAULTS")[1])
    assert faults < 2000, f"{faults} minor page faults in the third 512-token step"


def test_it_is_set_once_and_can_be_switched_off(monkeypatch):
    assert cpu_memory.keep_freed_memory() is True     # glibc here (CI's machine too)
    assert cpu_memory.keep_freed_memory() is True
    monkeypatch.setattr(cpu_memory, "ENABLED", False)
    monkeypatch.setattr(cpu_memory, "_done", False)
    assert cpu_memory.keep_freed_memory() is False


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def test_the_cpu_kv_cache_asks_for_huge_pages(monkeypatch):
    """The CPU KV cache is advised onto 2 MiB pages before it is zeroed (where the kernel's transparent
    huge pages are not "never"), and PDSERVE_CPU_HUGE_PAGES=0 leaves it on 4 KiB pages."""
    import pytest
    import torch

    from pdserve.config import CacheConfig
    from pdserve.model.loader import ModelInfo
    from pdserve.worker.kv_cache import allocate_kv_cache

    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages on this kernel")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this machine")
    info = ModelInfo(architecture="llama", num_layers=4, hidden_size=128, num_heads=2, num_kv_heads=2, head_dim=64,
                     vocab_size=256, max_model_len=128, eos_token_ids=(0,), identity="test", num_params=0)
    cache = CacheConfig(block_size=16, kv_cache_memory=64 << 20)
    before = _anon_huge_kib()
    kv = allocate_kv_cache(info, cache, torch.float32, torch.device("cpu"))
    assert _anon_huge_kib() - before >= 32 << 10   # most of the 64 MiB
    assert kv.abs().sum().item() == 0.0
    del kv
    monkeypatch.setattr(cpu_memory, "HUGE_PAGES_ENABLED", False)
    before = _anon_huge_kib()
    kv = allocate_kv_cache(info, cache, torch.float32, torch.device("cpu"))
    assert _anon_huge_kib() - before < 4 << 10
