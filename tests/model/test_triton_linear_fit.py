"""The small-batch Triton matmul is used only on GPUs whose shared memory holds its tiles (elsewhere a
launch would fail with "out of resources" at the first small step, i.e. at start-up), and only for
projections wide enough to give every SM a program."""
from pdserve.model import triton_linear


def test_fits_hopper_and_a100_not_99_kib_parts():
    # shared_memory_bytes() against the compiler: tests/model/test_triton_compile.py (needs Triton)
    assert triton_linear.fits(232_448)      # H100 / H200: 227 KiB opt-in
    assert triton_linear.fits(166_912)      # A100: 163 KiB
    assert not triton_linear.fits(101_376)  # 99 KiB: most consumer and L-series GPUs
    small = {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    assert triton_linear.fits(101_376, small)


def test_enough_programs_for_the_8b_projections_not_small_models():
    assert triton_linear.enough_programs(4096, 132)      # Llama-3.1-8B o/down: 128 programs
    assert not triton_linear.enough_programs(896, 132)   # a 0.5B model's hidden size: 28 programs
    assert not triton_linear.enough_programs(2048, 132)
