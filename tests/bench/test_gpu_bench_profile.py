"""benchmarks/gpu_bench.py's kernel families: cuBLAS's split-K reduction is a matmul (a name match on
"reduce_kernel" once counted it as attention, 0.08-0.15 ms of a decode step)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_bench.py"


@pytest.fixture(scope="module")
def gpu_bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kernel, family", [
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16", "matmul"),
    ("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_splitK_TNT", "matmul"),
    ("_gemv_kernel", "matmul"),
    ("_attn_kernel", "attention"),
    ("_reduce_kernel", "attention"),
    ("_rope_write_kv_kernel", "write_kv"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "other"),
])
def test_kernel_family(gpu_bench, kernel, family):
    assert gpu_bench.kernel_family(kernel) == family
