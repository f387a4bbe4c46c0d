"""Tiny real checkpoints for tests: a HF directory (config.json, model.safetensors, generation_config.json,
a byte-level tokenizer with a ChatML template) made with transformers from a seed, in milliseconds.

    path = make_tiny_hf_model(tmp_path, arch="llama")   # or "mistral", "qwen2", "qwen3"
    model, info = load_model(path, torch.float32, torch.device("cpu"))
    logits = PagedRunner(model).step([[104, 105]], [2], [[0]])        # one step over a paged KV cache
    gguf_file = write_tiny_gguf(path, tmp_path / "tiny.gguf", "Q8_0")  # the same weights as llama.cpp stores them

Every arch uses the same tokenizer: token id = byte value for 0..255, then the specials below
(vocab_size 264, eos <|im_end|> = 258).
"""
from __future__ import annotations

from pathlib import Path

import torch

from pdserve.model.attention import AttentionMetadata

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|reserved_{i}|>" for i in range(5)]
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # 264
EOS_TOKEN_ID = 256 + SPECIAL_TOKENS.index("<|im_end|>")  # 258
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5,
               bos_token_id=None, eos_token_id=EOS_TOKEN_ID, pad_token_id=256)


def tiny_hf_config(arch: str):
    """The transformers config of each tiny arch (each exercises a different branch of LlamaModel)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
    if arch == "llama":  # untied, GQA 2:1, Llama-3.1 rope scaling with smoothed medium frequencies
        return LlamaConfig(**_COMMON, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "mistral":  # untied, GQA 2:1, plain rope (so llama.cpp can store it as arch "llama")
        return MistralConfig(**_COMMON, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0,
                             sliding_window=None)
    if arch == "qwen2":  # tied, q/k/v bias
        return Qwen2Config(**_COMMON, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0)
    if arch == "qwen3":  # untied, GQA 4:1, head_dim (32) != hidden / heads (16), q/k norm
        return Qwen3Config(**_COMMON, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False,
                           rope_theta=1000000.0)
    raise ValueError(f"arch: expected llama | mistral | qwen2 | qwen3, got {arch!r}")


def make_tiny_hf_model(tmp_path: Path | str, arch: str = "llama", seed: int = 0, **overrides) -> str:
    """Write a tiny random fp32 model of `arch` (+ tokenizer) into tmp_path/<arch>-<seed>; return the path.
    `overrides` change its config (e.g. vocab_size=267: rows no token id reaches).

    Weights are scaled up from HF's init (std 0.02 gives near-uniform logits, so greedy decoding
    would hinge on rounding); norms and biases are randomised too, so loading them is tested.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig
    suffix = "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
    path = Path(tmp_path) / f"{arch}-{seed}{suffix}"
    torch.manual_seed(seed)
    config = tiny_hf_config(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.8, 1.2)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.2)
            else:
                param.normal_(0.0, 0.15)
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=[EOS_TOKEN_ID, 256], pad_token_id=256).save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return str(path)


def make_tiny_tokenizer():
    """A byte-level tokenizer (every string encodes, no merges) with ChatML specials and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}  # token id == byte value
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML_TEMPLATE)


GGUF_BLOCK_NAMES = {  # HF name inside a layer -> llama.cpp's
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def write_tiny_gguf(hf_path: str, gguf_path: Path | str, tensor_type: str = "F32") -> str:
    """Convert a tiny HF checkpoint to GGUF the way llama.cpp's convert_hf_to_gguf.py does: arch "llama"
    for llama/mistral with Q and K rows permuted, qwen2/qwen3 unpermuted, 1-D tensors kept F32, 2-D
    tensors in `tensor_type` (F32 | F16 | BF16 | Q8_0). No tokenizer. Returns the path."""
    import json

    import gguf
    import numpy as np
    from safetensors.torch import load_file
    hf = json.loads((Path(hf_path) / "config.json").read_text())
    arch = "llama" if hf["model_type"] in ("llama", "mistral") else hf["model_type"]
    if (hf.get("rope_parameters") or {}).get("rope_type", "default") != "default":
        raise ValueError("rope scaling goes to a rope_freqs tensor in GGUF: not written here")
    num_heads, num_kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    qtype = gguf.GGMLQuantizationType[tensor_type]
    writer = gguf.GGUFWriter(str(gguf_path), arch)
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_vocab_size(hf["vocab_size"])
    writer.add_eos_token_id(hf["eos_token_id"])
    for name, tensor in load_file(str(Path(hf_path) / "model.safetensors")).items():
        data = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)  # model.layers.<i>.<rest>
            base, suffix = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{GGUF_BLOCK_NAMES[base]}.{suffix}"
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = num_heads if ".attn_q." in gguf_name else num_kv_heads
            data = (data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:])  # llama.cpp permute()
                    .swapaxes(1, 2).reshape(data.shape))
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(data), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(gguf_path)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the one the ByteLevel pre-tokenizer uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def make_attn_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                       block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
    """AttentionMetadata for a flattened batch: sequence i brings query_lens[i] new tokens ending at
    seq_lens[i], its blocks listed in block_tables[i] (padded with 0 to the longest)."""
    width = max(len(table) for table in block_tables)
    slots = []
    for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
        for position in range(seq_len - query_len, seq_len):
            slots.append(table[position // block_size] * block_size + position % block_size)
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32,
                                  device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens), block_size=block_size)


def positions_for(query_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
    """The [T] positions of a flattened batch (the same layout as make_attn_metadata)."""
    return torch.tensor([p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)], dtype=torch.long)


class PagedRunner:
    """Drives a LlamaModel over its own KV cache (on the model's device): each step() is one step of a
    flattened batch, as the model runner would build it; blocks_for() hands out fresh block ids."""

    def __init__(self, model, num_blocks: int = 64, block_size: int = 8):
        cfg = model.config
        weight = model.embed_tokens.weight
        self.model, self.block_size, self.device = model, block_size, weight.device
        self.kv_cache = torch.zeros(num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim,
                                    dtype=weight.dtype, device=weight.device)
        self.next_block = 0

    def blocks_for(self, num_tokens: int) -> list[int]:
        num_blocks = -(-num_tokens // self.block_size)
        self.next_block += num_blocks
        return list(range(self.next_block - num_blocks, self.next_block))

    @torch.inference_mode()
    def step(self, token_ids: list[list[int]], seq_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """token_ids[i]: sequence i's new tokens, ending at seq_lens[i]. Returns logits [T, vocab]."""
        query_lens = [len(ids) for ids in token_ids]
        md = make_attn_metadata(query_lens, seq_lens, block_tables, self.block_size, self.device)
        input_ids = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long, device=self.device)
        positions = positions_for(query_lens, seq_lens).to(self.device)
        hidden = self.model(input_ids, positions, md, self.kv_cache)
        return self.model.compute_logits(hidden)
