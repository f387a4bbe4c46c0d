"""GPU tests: opt-in (`-m gpu`), skipped where torch sees no CUDA device. Kernel tests also run on
CPU under Triton's interpreter (TRITON_INTERPRET=1 PDSERVE_ATTENTION_BACKEND=triton), slowly."""
import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_collection_modifyitems(items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        path = str(item.fspath).replace("\\", "/")
        if "tests/gpu/" not in path or torch.cuda.is_available():
            continue
        if INTERPRET and "interpret_ok" in item.keywords:
            continue
        item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line("markers", "interpret_ok: a GPU test that also runs under TRITON_INTERPRET=1")
