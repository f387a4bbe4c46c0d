"""The Llama family in one model: Llama 2/3.x (incl. Llama-3 rope scaling), SmolLM2, Mistral-style
dense, Qwen2/2.5 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm); GQA; tied or untied embeddings.

forward() takes a flattened batch (no padding, no batch dim) plus the paged KV cache and its
AttentionMetadata as arguments: the model knows nothing of requests or scheduling.
Parameter names follow HF with two fusions: qkv_proj = [q; k; v] rows, gate_up_proj = [gate; up] rows.

Tensor parallelism (parallel/sharding.py): built with a TPGroup of T ranks, each rank holds 1/T of the
heads, of the MLP's intermediate rows and of the vocabulary; the attention output and MLP down
projections all-reduce their partial sums, the embedding all-reduces its rows (exactly one rank holds
each token's), and the logits are all-gathered. With T = 1 every collective is the identity.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.model.attention import AttentionMetadata, paged_attention, rope_and_write_kv
from pdserve.model.layers import (Embedding, Linear, RMSNorm, RotaryEmbedding, drop_packed_weights, linear,
                                  silu_and_mul)
from pdserve.parallel.group import SINGLE, TPGroup
from pdserve.parallel.sharding import check_tp_size, local_vocab_size, shard, shard_spec

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None        # None, or {"rope_type": "linear" | "llama3", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool                   # Qwen2: q/k/v projections carry a bias
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool                    # Qwen3: RMSNorm over each head of q and k, before rope

    @classmethod
    def from_hf(cls, hf: dict) -> LlamaConfig:
        """From a HF config.json dict (transformers 4 `rope_scaling` + `rope_theta` or 5 `rope_parameters`)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type: {model_type!r} is not supported (one of {SUPPORTED_MODEL_TYPES})")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act: only silu is supported, got {hf['hidden_act']!r}")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        num_heads = hf["num_attention_heads"]
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
        )


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup):
        super().__init__()
        self.tp = tp  # this rank's heads only
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp.size, cfg.num_kv_heads // tp.size
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, dtype, device)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.o_bias, dtype, device, small_batch_triton=True)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)     # [T, heads, head_dim]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, kv_heads, head_dim]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope_and_write_kv(q, k, v, cos, sin, kv_layer, attn_metadata.slot_mapping, attn_metadata.block_size)
        out = paged_attention(q, kv_layer, attn_metadata, self.scale)  # [T, heads, head_dim]
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))  # [T, hidden]


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup):
        super().__init__()
        self.tp = tp
        inter = cfg.intermediate_size // tp.size  # this rank's rows
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, cfg.mlp_bias, dtype, device)
        self.down_proj = Linear(inter, cfg.hidden_size, cfg.mlp_bias, dtype, device, small_batch_triton=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, 2 * inter] -> [T, inter] -> [T, hidden], summed over the ranks
        return self.tp.all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(x))))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(cfg, dtype, device, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(cfg, dtype, device, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_layer: torch.Tensor, attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings for layer 0, with residual None).
        Returns (this layer's MLP output, the residual stream before it): each residual add is done
        by the next norm, in one kernel with it."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv_layer, attn_metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, dtype: torch.dtype, device: torch.device, tp: TPGroup = SINGLE):
        super().__init__()
        check_tp_size(tp.size, config.num_heads, config.num_kv_heads, config.intermediate_size)
        self.config, self.tp = config, tp
        self.vocab_per_rank = local_vocab_size(config.vocab_size, tp.size)
        self.embed_tokens = Embedding(self.vocab_per_rank, config.hidden_size, dtype, device)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, dtype, device, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = (None if config.tie_word_embeddings
                        else Linear(config.hidden_size, self.vocab_per_rank, False, dtype, device))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] long; kv_cache: [blocks, layers, 2, slots, kv_heads, head_dim].
        Returns the final-normed hidden states [T, hidden]."""
        hidden = self.embed(input_ids)         # [T, hidden]
        cos, sin = self.rotary(positions)      # each [T, 1, head_dim/2]
        residual = None
        for layer_id, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache[:, layer_id], attn_metadata)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        # This rank's rows are the vocabulary's [first, first + vocab_per_rank); other ids give zeros,
        # so the sum over the ranks is each token's one row, exactly.
        local_ids = input_ids - self.tp.rank * self.vocab_per_rank
        outside = (local_ids < 0) | (local_ids >= self.vocab_per_rank)
        hidden = self.embed_tokens(local_ids.masked_fill(outside, 0))
        return self.tp.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] float32 (every rank gets all of them)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, weight).float()  # [N, vocab_per_rank]
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last_dim(logits)[:, :self.config.vocab_size]

    def shard_spec(self, name: str):
        """How the full weight `name` (HF's or ours) is split over this model's ranks (None: not split)."""
        cfg = self.config
        return shard_spec(name, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                          cfg.intermediate_size, cfg.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (any dtype/device) into the parameters, filling the fused ones by rows.
        Raises ValueError on an unknown name or when a parameter is left unfilled."""
        cfg, tp = self.config, self.tp
        # This rank's rows of each fused part (all of them with one rank).
        q, kv = cfg.num_heads * cfg.head_dim // tp.size, cfg.num_kv_heads * cfg.head_dim // tp.size
        inter = cfg.intermediate_size // tp.size
        fused = {  # HF part -> (our fused module, its first row, its number of rows)
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
            "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
            "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
        }
        params = dict(self.named_parameters())
        rows_left = {name: p.shape[0] for name, p in params.items()}  # rows still to fill per parameter
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
                continue  # recomputed / tied to embed_tokens
            first_row, num_rows = 0, None
            for part, (fused_name, part_first_row, part_num_rows) in fused.items():
                if f".{part}." in name:
                    name = name.replace(part, fused_name)
                    first_row, num_rows = part_first_row, part_num_rows
                    break
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for model_type {cfg.model_type!r}")
            tensor = shard(tensor, self.shard_spec(hf_name), tp.rank, tp.size)
            target = params[name].data
            if num_rows is not None:
                target = target[first_row:first_row + num_rows]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {hf_name!r}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            drop_packed_weights(params[name])
            rows_left[name] -= target.shape[0]
        missing = [name for name, rows in rows_left.items() if rows != 0]  # (or filled twice)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
