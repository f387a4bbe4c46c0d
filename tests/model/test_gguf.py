"""GGUF loading: tiny checkpoints converted the way llama.cpp does (each tensor type, the Q/K row
permutation), then the default model (SmolLM2-135M-Instruct Q4_1) against transformers' own GGUF loader."""
import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.model.loader import load_model, load_tokenizer, resolve_model_path
from tests.helpers_models import PagedRunner, write_tiny_gguf

PROMPT = [(i * 53 + 7) % 256 for i in range(29)]


def lossy_round_trip(hf_model, tensor_type):
    """Give the HF model the weights a GGUF of `tensor_type` stores: 2-D tensors quantized and back."""
    qtype = gguf.GGMLQuantizationType[tensor_type]
    with torch.no_grad():
        for param in hf_model.parameters():
            if param.ndim == 2:
                stored = gguf.quants.quantize(param.numpy().copy(), qtype)
                param.copy_(torch.from_numpy(np.array(gguf.quants.dequantize(stored, qtype), dtype=np.float32)))


@pytest.mark.parametrize("arch, tensor_type", [
    ("mistral", "F32"), ("mistral", "F16"), ("mistral", "BF16"), ("mistral", "Q8_0"),
    ("qwen2", "F16"), ("qwen3", "Q8_0"),
])
def test_tiny_gguf_matches_hf(tmp_path, tiny_model_paths_with_mistral, arch, tensor_type):
    hf_path = tiny_model_paths_with_mistral[arch]
    gguf_file = write_tiny_gguf(hf_path, tmp_path / f"{arch}-{tensor_type}.gguf", tensor_type)
    ours, info = load_model(gguf_file, torch.float32, torch.device("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(hf_path, local_files_only=True, dtype=torch.float32).eval()
    if tensor_type != "F32":
        lossy_round_trip(theirs, tensor_type)
    runner = PagedRunner(ours)
    logits = runner.step([PROMPT], [len(PROMPT)], [runner.blocks_for(len(PROMPT))])
    with torch.inference_mode():
        expected = theirs(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert info.eos_token_ids == (258,)


# --- the default model ---

@pytest.fixture(scope="module")
def default_model():
    model, info = load_model(resolve_model_path("default"), torch.float32, torch.device("cpu"))
    return model, info


@pytest.fixture(scope="module")
def default_tokenizer():
    return load_tokenizer("default")


def test_default_model_info(default_model):
    _, info = default_model
    assert (info.architecture, info.num_layers, info.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (info.num_heads, info.num_kv_heads, info.head_dim, info.vocab_size) == (9, 3, 64, 49152)
    assert info.max_model_len == 8192 and info.eos_token_ids == (2,)
    assert info.num_params == 134_515_008  # tied embeddings counted once


def test_default_model_logits_match_transformers(default_model, default_tokenizer, hf_default_model):
    """hf_default_model (tests/conftest.py): transformers' own GGUF path, its config mapping and its
    Q/K un-permutation, an independent reference (only gguf's dequantize is shared)."""
    model, _ = default_model
    assert hf_default_model.lm_head.weight is hf_default_model.model.embed_tokens.weight  # tied
    chat = default_tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                                 tokenize=False, add_generation_prompt=True)
    for text in ["The capital of France is", "def fibonacci(n):", chat]:
        token_ids = default_tokenizer(text)["input_ids"]
        runner = PagedRunner(model, num_blocks=8, block_size=16)
        logits = runner.step([token_ids], [len(token_ids)], [runner.blocks_for(len(token_ids))])
        with torch.inference_mode():
            expected = hf_default_model(torch.tensor([token_ids])).logits[0]
        torch.testing.assert_close(logits, expected, atol=1e-3, rtol=1e-3)
        if text.startswith("The capital"):
            assert default_tokenizer.decode(logits[-1].argmax()).strip() == "Paris"


def test_default_tokenizer_round_trip_and_chat_template(default_tokenizer):
    tok = default_tokenizer
    text = "Hello, world! Ünïcödé and code: x = [1, 2]"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
