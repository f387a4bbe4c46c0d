"""The GGUF conversion cache: a second load reads the cached safetensors, not the GGUF (the default
model's tokenizer goes through the same cache in test_gguf.py)."""
import gguf
import torch

from pdserve.model import loader
from tests.helpers_models import make_tiny_hf_model, write_tiny_gguf


def test_second_load_comes_from_the_cache_and_is_identical(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = write_tiny_gguf(make_tiny_hf_model(tmp_path, "mistral"), tmp_path / "tiny.gguf", "Q8_0")
    first, info1 = loader.load_model(str(gguf_file), torch.float32, torch.device("cpu"))
    assert (loader.gguf_cache_dir(str(gguf_file)) / "weights" / "model.safetensors").is_file()

    def no_parsing(*args, **kwargs):
        raise AssertionError("the GGUF was parsed again")
    monkeypatch.setattr(gguf, "GGUFReader", no_parsing)
    second, info2 = loader.load_model(str(gguf_file), torch.float32, torch.device("cpu"))
    assert info1 == info2
    assert len(first.state_dict()) == len(second.state_dict())
    for (n1, p1), (n2, p2) in zip(first.state_dict().items(), second.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_cache_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", "off")
    assert loader.gguf_cache_dir(str(tmp_path)) is None
