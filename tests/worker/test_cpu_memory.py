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
