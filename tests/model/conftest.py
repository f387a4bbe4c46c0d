"""Shared fixtures for the model tests: tiny HF checkpoints, built once per session."""
import pytest

from tests.helpers_models import make_tiny_hf_model


@pytest.fixture(scope="session")
def tiny_model_paths(tmp_path_factory):
    """arch -> path of a tiny random HF checkpoint (llama, qwen2, qwen3)."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_hf_model(root, arch) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def tiny_model_paths_with_mistral(tiny_model_paths, tmp_path_factory):
    """tiny_model_paths plus "mistral" (plain rope: what llama.cpp stores as GGUF arch "llama")."""
    return {**tiny_model_paths, "mistral": make_tiny_hf_model(tmp_path_factory.mktemp("tiny_mistral"), "mistral")}
