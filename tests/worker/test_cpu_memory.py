"""worker/cpu_memory.py: a CPU engine's steps stop faulting their activations' pages in again."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from pdserve.worker import cpu_memory

# Three prefill steps of 512 tokens of the default model; prints the minor page faults of the last.
# Before the fix (glibc's defaults), 60,000-100,000 of them a step on the 2-core machine; after, none.
# The KV cache is touched whole first: the third step writes blocks no step wrote before, and where no
# free 2 MiB pages were at hand they faulted in 4 KiB at a time (3,072 faults once in the suite).
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
    engine.runner.kv_cache.fill_(0.0)   # the cache's own first touch is not the steps' (see above)
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


# Allocates a CPU KV cache in a fresh process and prints whether the kernel marked its mapping for huge
# pages ("THPeligible" in /proc/self/smaps): the advice itself, which does not depend on whether free 2 MiB
# pages happened to be at hand, nor on memory an earlier allocation in the process left faulted in.
ELIGIBLE = textwrap.dedent("""
    import torch
    from pdserve.config import CacheConfig
    from pdserve.model.loader import ModelInfo
    from pdserve.worker.kv_cache import allocate_kv_cache
    info = ModelInfo(architecture="llama", num_layers=4, hidden_size=128, num_heads=2, num_kv_heads=2, head_dim=64,
                     vocab_size=256, max_model_len=128, eos_token_ids=(0,), identity="test", num_params=0)
    kv = allocate_kv_cache(info, CacheConfig(block_size=16, kv_cache_memory=64 << 20), torch.float32,
                           torch.device("cpu"))
    middle = kv.data_ptr() + kv.numel() * kv.element_size() // 2
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= middle < high
        elif inside and head == "THPeligible:":
            print("ELIGIBLE", line.split()[1])
            break
""")


def test_the_cpu_kv_cache_asks_for_huge_pages():
    """The CPU KV cache's mapping is advised for transparent huge pages; PDSERVE_CPU_HUGE_PAGES=0 leaves it
    to the system's default, which on "madvise" machines (the common one) is 4 KiB pages."""
    import pytest
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages on this kernel")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this machine")

    def eligible(switch: str) -> str:
        env = dict(os.environ, PDSERVE_CPU_HUGE_PAGES=switch)
        result = subprocess.run([sys.executable, "-c", ELIGIBLE], capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout.split("ELIGIBLE")[1].strip()

    assert eligible("1") == "1"
    if "[madvise]" in mode:
        assert eligible("0") == "0"
