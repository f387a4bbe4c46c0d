"""Small configuration dataclasses shared by every layer.

Validation raises ValueError naming the field, so the CLI can print it as is.
"""
from __future__ import annotations

import os

import json
from dataclasses import dataclass, field
from typing import Any

from pdserve.cli_types import parse_bytes

DEFAULT_MODEL = "default"


@dataclass
class ModelConfig:
    model: str = DEFAULT_MODEL        # "default", a HF directory, or a .gguf file
    dtype: str = "auto"               # auto | float32 | bfloat16 | float16
    device: str = "auto"              # auto | cpu | cuda
    load_format: str = "auto"         # auto | dummy (random weights of the model's shape)
    max_model_len: int | None = None  # None: the model's own limit
    served_model_name: str | None = None
    seed: int = 0

    def validate(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: expected auto|float32|bfloat16|float16, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: expected auto|cpu|cuda, got {self.device!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format: expected auto|dummy, got {self.load_format!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len: must be >= 1, got {self.max_model_len}")


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None         # bytes (CPU; on CUDA it wins over the fraction)
    gpu_memory_utilization: float = 0.9        # CUDA: this instance's share of its GPU

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size: must be in [1, 1024], got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory: must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int = 2048   # filled from the model by the engine
    # Schedule step N+1 while the device runs step N. None: on where steps run asynchronously (CUDA).
    async_scheduling: bool | None = None

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")


MAX_TENSOR_PARALLEL_SIZE = 64


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1    # ranks (processes) one instance's model is split over

    def validate(self) -> None:
        if not 1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL_SIZE:
            raise ValueError(f"tensor_parallel_size: must be in [1, {MAX_TENSOR_PARALLEL_SIZE}], "
                             f"got {self.tensor_parallel_size}")


KV_ROLES = ("producer", "consumer", "both")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")
# Connectors whose requests the router sends to P and D at once (kv_transfer/push.py); the rest pull.
PUSH_KV_CONNECTORS = ("nixl-push",)
# Connectors that move a tensor-parallel instance's KV (every rank's heads), between sizes of which one divides
# the other: kv_transfer/nixl_tp.py (pull) and nixl_tp_push.py (push); the store's pool holds the whole
# model's layout, which every size reads and writes (store_tp.py).
TP_KV_CONNECTORS = ("nixl", "nixl-push", "store")


def parse_host_port(text: str, name: str) -> tuple[str, int]:
    """'HOST:PORT' → (host, port); ValueError naming the field and the value otherwise."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name}: expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


@dataclass
class KVTransferConfig:
    """How an instance takes part in P/D disaggregation; None connector means colocated only."""
    kv_connector: str | None = None       # None | "nixl" | "nixl-push" | "cuda_ipc" | "store" | "loopback"
    kv_role: str = "both"                 # producer (P) | consumer (D) | both
    engine_id: str | None = None          # filled at start-up when not given
    lease_seconds: float = 30.0           # P holds blocks for D this long without a heartbeat
    heartbeat_seconds: float = 5.0        # D extends leases this often while it waits
    kv_load_failure_policy: str = "fail"  # fail | recompute
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0            # 0: pick a free port
    enable_prog_thread: bool = False      # NIXL progress thread busy-polls a core; off by default on CPU
    kv_store: str | None = None           # "HOST:PORT" of `pdserve kv-store` (kv_connector "store")
    # Per rank: the buffer that transfers regrouping KV heads (peers of another TP size) move through.
    staging_bytes: int = 512 << 20
    # The router key, when the instance has one: signs every side-channel message (never from JSON or argv).
    auth_key: str | None = field(default=None, repr=False)
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role: expected one of {KV_ROLES}, got {self.kv_role!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy: expected one of {KV_LOAD_FAILURE_POLICIES}, "
                             f"got {self.kv_load_failure_policy!r}")
        if self.lease_seconds <= 0:
            raise ValueError(f"lease_seconds: must be > 0, got {self.lease_seconds}")
        if self.heartbeat_seconds <= 0:
            raise ValueError(f"heartbeat_seconds: must be > 0, got {self.heartbeat_seconds}")
        if self.lease_seconds <= self.heartbeat_seconds:
            raise ValueError(f"lease_seconds ({self.lease_seconds}) must be greater than heartbeat_seconds "
                             f"({self.heartbeat_seconds}): D extends P's lease once per heartbeat, so a lease "
                             "no longer than that runs out while D waits")
        if self.kv_store and self.kv_connector != "store":
            raise ValueError(f"kv_store: only for kv_connector store (got {self.kv_connector!r})")
        if self.kv_connector == "store":
            if not self.kv_store:
                raise ValueError("kv_store: kv_connector store needs the store's HOST:PORT (--kv-store)")
            parse_host_port(self.kv_store, "kv_store")
        if isinstance(self.staging_bytes, bool) or not isinstance(self.staging_bytes, int) \
                or self.staging_bytes < 256:   # (one aligned range: kv_transfer/staging.py)
            raise ValueError(f"staging_bytes: must be an integer of at least 256, got {self.staging_bytes!r}")
        if not 0 <= self.side_channel_port < 65536:
            raise ValueError(f"side_channel_port: must be in [0, 65535], got {self.side_channel_port}")

    @classmethod
    def from_json(cls, text: str | None, **overrides: Any) -> "KVTransferConfig":
        data: dict[str, Any] = {}
        if text:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv_transfer_config: not valid JSON ({e})") from None
            if not isinstance(data, dict):
                raise ValueError("kv_transfer_config: must be a JSON object")
        known = {f for f in cls.__dataclass_fields__ if f not in ("extra", "auth_key")}
        kwargs = {k: v for k, v in data.items() if k in known}
        if isinstance(kwargs.get("staging_bytes"), str):   # "256MiB" as well as 268435456
            kwargs["staging_bytes"] = parse_bytes(kwargs["staging_bytes"], "staging_bytes")
        extra = {k: v for k, v in data.items() if k not in known}
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        cfg = cls(**kwargs, extra=extra)
        cfg.validate()
        return cfg

    @property
    def is_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("producer", "both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("consumer", "both")



def check_cpu_cores(cores) -> list[int]:
    """cpu_affinity (--cpu-cores): cores of this machine, as a list; else ValueError naming them (a core
    that does not exist fails sched_setaffinity with a bare EINVAL deep in the engine's start). Not
    checked against this process's current affinity: a process may widen it (taskset -c 0 pdserve serve
    --cpu-cores 1); one its cpuset forbids fails at the pin (EngineCore names the flag there)."""
    cores = list(cores)
    count = os.cpu_count() or 1
    allowed = os.sched_getaffinity(0)   # (ids past the count where some CPUs are offline)
    bad = [c for c in cores if not isinstance(c, int) or isinstance(c, bool) or not (0 <= c < count or c in allowed)]
    if not cores or bad:
        raise ValueError(f"cpu_affinity (--cpu-cores): {', '.join(map(str, bad)) or 'none given'}: not a core of "
                         f"this machine (0-{count - 1})")
    return cores

@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    num_threads: int | None = None        # torch CPU threads (per TP rank); None: one per allowed core
    cpu_affinity: list[int] | None = None  # pin the engine process (its TP ranks: a share each) to these cores
    # A group file shared with the other engines of this host (worker/core_lending.py): cpu_affinity is
    # then this engine's home, and the idle engines' cores are borrowed step by step.
    core_lending: str | None = None

    def validate(self) -> None:
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        self.kv_transfer.validate()
        self.parallel.validate()
        connector = self.kv_transfer.kv_connector
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads (--num-threads): must be at least 1, got {self.num_threads}; leave it out "
                             f"for one thread per allowed core")
        if self.cpu_affinity is not None:
            check_cpu_cores(self.cpu_affinity)
        if self.core_lending and not self.cpu_affinity:
            raise ValueError("core_lending: needs cpu_affinity, the cores this engine owns (--cpu-cores)")
        if self.core_lending and self.parallel.tensor_parallel_size > 1:
            raise ValueError("core_lending: not for tensor-parallel instances (each rank would need its own share)")
        if self.parallel.tensor_parallel_size > 1 and connector is not None and connector not in TP_KV_CONNECTORS:
            raise ValueError(f"tensor_parallel_size: {self.parallel.tensor_parallel_size} with kv_connector "
                             f"{connector!r} is not supported yet; {', '.join(TP_KV_CONNECTORS)} hands over a "
                             f"tensor-parallel instance's KV")


# Secrets reach processes through the environment, never argv: argv is readable by every local user (ps).
API_KEY_ENV = "PDSERVE_API_KEY"
ROUTER_KEY_ENV = "PDSERVE_ROUTER_KEY"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass
class ServerConfig:
    """The HTTP front door of one instance: who may call it, and how much one request may take."""
    api_key: str | None = None            # clients send "Authorization: Bearer <api_key>"
    # The router's secret ("X-PDServe-Router-Key"): it passes the api-key check and is the only caller
    # allowed to send kv_transfer_params or POST /v1/kv/release once set.
    router_key: str | None = None
    max_queued_requests: int = 1024       # beyond max_num_seqs running + this many: 503 + Retry-After
    request_timeout_s: float = 3600.0     # a request still unfinished this long after arrival is ended
    body_timeout_s: float = 30.0          # a client must finish sending its body within this
    # On SIGTERM / Ctrl-C: requests in flight get this long to finish; the rest then end with an error
    # (an error event on a stream) before the server stops.
    drain_timeout_s: float = 10.0          # under `pdserve up`'s 25 s between SIGTERM and SIGKILL
    # None: sized to the model's context (see resolve_limits)
    max_body_bytes: int | None = None
    max_prompt_chars: int | None = None

    def validate(self) -> None:
        for name in ("api_key", "router_key"):
            value = getattr(self, name)
            if value is not None and (not value or not value.isprintable() or not value.isascii()):
                raise ValueError(f"{name}: must be a non-empty printable ASCII string")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests: must be >= 0, got {self.max_queued_requests}")
        if not 0 <= self.drain_timeout_s <= 3600:
            raise ValueError(f"drain_timeout_s: must be in [0, 3600] seconds, got {self.drain_timeout_s}")
        for name in ("request_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("max_body_bytes", "max_prompt_chars"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")

    def resolve_limits(self, max_model_len: int) -> tuple[int, int]:
        """(max_body_bytes, max_prompt_chars) for a model of this context length.

        A token is a few characters of text on average; 32 leaves room for long runs (whitespace,
        repeated symbols) while a 20 MB prompt for a 2k-token model is refused before the tokenizer
        spends seconds on it. A body holds the prompt JSON-escaped (up to 6 bytes a character) or as
        token ids (up to 12 bytes each), plus the rest of the request: 1 MiB is the floor.
        """
        max_prompt_chars = self.max_prompt_chars or 32 * max_model_len
        max_body_bytes = self.max_body_bytes or max(1 << 20, 6 * max_prompt_chars + (64 << 10))
        return max_body_bytes, max_prompt_chars
