"""Per request: whether to disaggregate, which P computes the prompt and which D generates (docs/router.md,
"Deciding"). Pure and deterministic: the instances' state comes in through `Instance` and `PrefixIndex`
(router/instances.py, router/prefix_index.py), the time through `now`.

`Router.route(req, exclude, now)` answers a `Route` (P or None for a direct route, D, the decider's reason)
or None when no instance can take the request (the caller answers 503 with Retry-After);
`Router.replacement(req, exclude, now)` a D (or colocated instance) to resume a failed stream on. The caller
brackets each hop with `Router.begin` / `Router.end`: the router's own accounting of requests in flight,
and its predictions of which instance will cache the prompt.
"""
from __future__ import annotations

import heapq
import random
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pdserve.hashing import hash_prompt_blocks
from pdserve.router.instances import DEFAULT_BLOCK_SIZE, Instance, Ticket
from pdserve.router.prefix_index import PrefixIndex

# --- requests, settings, answers ---------------------------------------------------------------------------

# What an instance does with the request, which decides what its load and cost mean.
PREFILL = "prefill"   # a P: computes the prompt, holds its KV for a D
DECODE = "decode"     # a D fed by a P: reads the KV it lacks, then generates
DIRECT = "direct"     # a D or colocated instance that computes the prompt itself, then generates

REASONS = ("short_prompt", "decode_has_prefix", "prefill_saturated", "prefill_backlog", "disaggregated",
           "colocated")

DEFAULT_PD_MIN_PROMPT_TOKENS = 0
DEFAULT_MAX_HELD_FRACTION = 0.9
DEFAULT_BALANCE_TOKENS = 8192      # prefix-affinity: a P may be this many queued prompt tokens above the least
DEFAULT_BALANCE_REQUESTS = 16      # ... a D this many requests in flight above the least
DEFAULT_AFFINITY_MIN_CACHED = 0.5  # prefix-affinity: a cached prefix under this share of the prompt is a miss
DEFAULT_DIRECT_PREFILL_HEADROOM_S = 1.0
DEFAULT_COST_TOLERANCE = 0.2       # cost: estimates within this fraction of the best are a tie (round-robin)
# Past this many instances of a pool, a request under a load-aware policy looks at a sample of them
# (Router._sample): at 500 instances a full scan cost 1.6 ms a request under cost, in Python (found on CPU,
# benchmarks/cpu_router_scale.py route), where a sample of 32 keeps the choice close to the full one's (the
# power of d choices) and the cost flat.
DEFAULT_MAX_CANDIDATES = 32


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows of a request. token_ids and block_hashes are None when the router did not
    tokenize (a policy and decider that need no prefix): then nothing counts as cached anywhere."""
    num_prompt_tokens: int
    max_tokens: int | None = None
    token_ids: Sequence[int] | None = None
    block_hashes: Sequence[int] | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens: must be >= 0, got {self.num_prompt_tokens}")

    @classmethod
    def from_token_ids(cls, token_ids: Sequence[int], max_tokens: int | None, block_size: int = DEFAULT_BLOCK_SIZE,
                       hash_extra: str = "") -> RouteRequest:
        return cls(len(token_ids), max_tokens, token_ids, hash_prompt_blocks(token_ids, block_size, hash_extra))


@dataclass(frozen=True)
class RouterConfig:
    """pd_min_prompt_tokens: T of the decider (0: always disaggregate when a P can take the request).
    max_per_instance: requests in flight on one instance (None: no cap). max_held_fraction: a P's KV share
    held for transfer past which it takes no more prompts. balance_*: prefix-affinity's spill thresholds.
    direct_prefill_headroom_s: a D takes a prompt itself, with every P at a cap or more than this many seconds
    of prompts queued (prefill_backlog), only while its prefill work (queued + this prompt) stays under this
    many seconds: its running streams stall meanwhile. 0: no backlog rule, and no D prefills while a P is up.
    cost_tolerance: cost's estimates within this fraction of the lowest count as equal (see CostPolicy).
    max_candidates: past this many instances in a pool, each request considers a sample of them (0: all)."""
    pd_min_prompt_tokens: int = DEFAULT_PD_MIN_PROMPT_TOKENS
    max_per_instance: int | None = None
    max_held_fraction: float = DEFAULT_MAX_HELD_FRACTION
    balance_tokens: int = DEFAULT_BALANCE_TOKENS
    balance_requests: int = DEFAULT_BALANCE_REQUESTS
    direct_prefill_headroom_s: float = DEFAULT_DIRECT_PREFILL_HEADROOM_S
    affinity_min_cached: float = DEFAULT_AFFINITY_MIN_CACHED
    cost_tolerance: float = DEFAULT_COST_TOLERANCE
    max_candidates: int = DEFAULT_MAX_CANDIDATES

    def __post_init__(self) -> None:
        if self.pd_min_prompt_tokens < 0:
            raise ValueError(f"pd_min_prompt_tokens: must be >= 0, got {self.pd_min_prompt_tokens}")
        if self.max_per_instance is not None and self.max_per_instance < 1:
            raise ValueError(f"max_per_instance: must be >= 1, got {self.max_per_instance}")
        if not 0.0 < self.max_held_fraction <= 1.0:
            raise ValueError(f"max_held_fraction: must be in (0, 1], got {self.max_held_fraction}")
        if not self.direct_prefill_headroom_s >= 0.0:
            raise ValueError(f"direct_prefill_headroom_s: must be >= 0, got {self.direct_prefill_headroom_s}")
        if not 0.0 <= self.affinity_min_cached <= 1.0:
            raise ValueError(f"affinity_min_cached: must be in [0, 1], got {self.affinity_min_cached}")
        if not 0.0 <= self.cost_tolerance <= 1.0:
            raise ValueError(f"cost_tolerance: must be in [0, 1], got {self.cost_tolerance}")
        if self.max_candidates != 0 and self.max_candidates < 2:
            raise ValueError(f"max_candidates: 0 (all) or at least 2, got {self.max_candidates}")


@dataclass(frozen=True)
class Route:
    prefill: Instance | None   # None: direct, the decode (or colocated) instance prefills itself
    decode: Instance
    reason: str                # one of REASONS


@dataclass
class Choice:
    """What a policy sees besides the candidates."""
    req: RouteRequest
    cached: Mapping[str, int]       # instance name → prompt tokens it holds (absent: none)
    position: Mapping[str, int]     # instance name → its place in the router's order (round-robin)
    now: float

    def uncached(self, inst: Instance) -> int:
        return max(0, self.req.num_prompt_tokens - self.cached.get(inst.name, 0))


# --- the estimates -----------------------------------------------------------------------------------------

def load(stage: str, inst: Instance) -> int:
    """least-load's measure: a P's work is its queued prompt tokens; a D's (fed or direct) its requests,
    since each one holds a slot of its batch and its step time until it finishes."""
    return inst.queued_prefill_tokens if stage == PREFILL else inst.num_in_flight


def prefill_seconds(inst: Instance, uncached_tokens: int, rate: float | None = None) -> float:
    """When the prompt's last token is computed there: the prompt tokens queued ahead of it plus its own
    uncached ones, at the instance's measured prefill rate (or `rate`). A cached prefix is skipped entirely,
    which is what makes a busy P holding the prefix beat an idle one without it."""
    return (inst.queued_prefill_tokens + uncached_tokens) / (rate or inst.prefill_tokens_per_s)


def decode_wait_seconds(inst: Instance) -> float:
    """Until a D's first step for the request: the requests waiting for a batch slot, one step time each,
    then the request's own step, each at the batch it will run in (its requests in flight and this one, up
    to max_num_seqs). A lower bound (a slot frees when a running request finishes, which takes more than
    one step), but monotone in the queue, the batch and the step time, which is what ranking Ds needs; the
    batch term is also what every stream already on that D pays per token for the new one."""
    batch = inst.num_in_flight + 1
    if inst.max_num_seqs:
        batch = min(batch, inst.max_num_seqs)
    return (inst.num_queued_requests + 1) * inst.decode_step_s_at(batch)


def transfer_seconds(inst: Instance, uncached_tokens: int) -> float:
    """A D reads from the P only the blocks it lacks (its own prefix cache covers the rest)."""
    return uncached_tokens * inst.kv_bytes_per_token / inst.transfer_bytes_per_s


def estimated_seconds(stage: str, inst: Instance, choice: Choice) -> float:
    """The instance's part of the request's time to first token. TTFT = P's part + D's part, and neither
    depends on the other's choice, so the best pair is the best P and the best D: O(P + D) per request."""
    uncached = choice.uncached(inst)
    if stage == PREFILL:
        return prefill_seconds(inst, uncached)
    if stage == DECODE:
        return decode_wait_seconds(inst) + transfer_seconds(inst, uncached)
    return decode_wait_seconds(inst) + prefill_seconds(inst, uncached)


# --- the policies ------------------------------------------------------------------------------------------

class RoutingPolicy:
    """Picks one of the candidates (never empty) of one stage; answers (instance, outcome), the outcome a
    label for the counters. Holds a round-robin cursor per stage: ties go round, so equal instances share."""
    name: ClassVar[str] = ""
    uses_prefix: ClassVar[bool] = False   # needs the prompt's block hashes
    samples: ClassVar[bool] = True        # may choose among a sample of a large pool (Router._sample)

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self._cursor: dict[str, int] = {}

    def choose(self, stage: str, candidates: Sequence[Instance], choice: Choice) -> tuple[Instance, str]:
        raise NotImplementedError

    def cursor(self, stage: str) -> int:
        """The stage's round-robin cursor: the router's order position the next rotation starts at."""
        return self._cursor.get(stage, 0)

    def rotate(self, stage: str, candidates: Sequence[Instance], choice: Choice, commit: bool = True) -> Instance:
        """The first candidate at or after the stage's cursor in the router's order; commit: move the cursor
        past it (else only look)."""
        cursor, position = self._cursor.get(stage, 0), choice.position
        best = min(candidates, key=lambda inst: (position[inst.name] < cursor, position[inst.name]))
        if commit:
            self._cursor[stage] = position[best.name] + 1
        return best

    def least(self, stage: str, candidates: Sequence[Instance], choice: Choice, key,
              commit: bool = True, tolerance: float = 1e-9) -> Instance:
        """The candidate with the lowest key; among equals (within `tolerance` of the lowest, as a fraction),
        the next in round-robin order."""
        scores = [key(inst) for inst in candidates]
        low = min(scores)
        tolerance = tolerance * abs(low) + 1e-12
        return self.rotate(stage, [inst for inst, s in zip(candidates, scores) if s <= low + tolerance], choice,
                           commit)


class RoundRobinPolicy(RoutingPolicy):
    name = "round-robin"
    samples = False   # its sample is the window after its cursors (Router._window_after), not a random one

    def choose(self, stage, candidates, choice):
        return self.rotate(stage, candidates, choice), "next"


class LeastLoadPolicy(RoutingPolicy):
    name = "least-load"

    def choose(self, stage, candidates, choice):
        return self.least(stage, candidates, choice, lambda inst: load(stage, inst)), "least"


class PrefixAffinityPolicy(RoutingPolicy):
    """The longest cached prefix (the least loaded among equals), unless that instance's load is more than
    the balance threshold above the least loaded candidate's: then least-load, so that one hot prefix
    cannot pile every request onto one instance. A prefix under affinity_min_cached of the prompt is a miss:
    every chat prompt shares its template's first block, which is no reason to send them all to one place
    (found on CPU: 3.4× round-robin's TTFT on independent chat prompts)."""
    name = "prefix-affinity"
    uses_prefix = True

    def choose(self, stage, candidates, choice):
        by_load = lambda inst: load(stage, inst)  # noqa: E731
        longest = max(choice.cached.get(inst.name, 0) for inst in candidates)
        if longest == 0 or longest < self.config.affinity_min_cached * choice.req.num_prompt_tokens:
            return self.least(stage, candidates, choice, by_load), "miss"
        holders = [inst for inst in candidates if choice.cached.get(inst.name, 0) == longest]
        best = self.least(stage, holders, choice, by_load, commit=False)
        threshold = self.config.balance_tokens if stage == PREFILL else self.config.balance_requests
        if load(stage, best) - min(map(by_load, candidates)) > threshold:
            return self.least(stage, candidates, choice, by_load), "spill"
        return self.least(stage, holders, choice, by_load), "hit"


class CostPolicy(RoutingPolicy):
    """The least estimated time to first token (estimated_seconds): queue, uncached prompt and transfer,
    each at the instance's learned rates, in one unit, so that a cached prefix and a queue trade off.
    Estimates within cost_tolerance of the lowest are a tie: the rates are learned from noisy polls, and
    equal instances whose rates differ by that noise must share the load, not send every idle-time
    request to the one measured a hair faster (found on CPU: 1.18x round-robin's TTFT on independent short
    prompts). Among tied instances the longest cached prefix wins, and only equal ones take turns: the
    cache is known, not measured, and on a loaded cluster a history's prefix saves less than the
    tolerance of a multi-second estimate (found on CPU: multi-turn TTFT 0.64x round-robin's with turns
    among all tied instances, where ignoring ties had given 0.48x)."""
    name = "cost"
    uses_prefix = True

    def choose(self, stage, candidates, choice):
        scores = [estimated_seconds(stage, inst, choice) for inst in candidates]
        low = min(scores)
        tied = [inst for inst, s in zip(candidates, scores) if s <= low * (1 + self.config.cost_tolerance) + 1e-12]
        longest = max(choice.cached.get(inst.name, 0) for inst in tied)
        return self.rotate(stage, [inst for inst in tied if choice.cached.get(inst.name, 0) == longest],
                           choice), "least"


POLICIES: dict[str, type[RoutingPolicy]] = {cls.name: cls for cls in (RoundRobinPolicy, LeastLoadPolicy,
                                                                       PrefixAffinityPolicy, CostPolicy)}


# --- the router --------------------------------------------------------------------------------------------

class Router:
    def __init__(self, instances: Iterable[Instance], policy: str | RoutingPolicy = "round-robin",
                 config: RouterConfig | None = None, index: PrefixIndex | None = None, *,
                 dynamic: bool = False) -> None:
        """dynamic: the pools are followed as instances come and go (`add` / `remove`, e.g. a Ray
        cluster's): the router may start empty, and a request meeting no decode or colocated instance is
        answered 503 rather than the configuration refused."""
        self.instances: list[Instance] = []
        self.by_name: dict[str, Instance] = {}
        self.position: dict[str, int] = {}   # tie-break order: the order instances joined in
        self._next_position = 0
        self.has_prefill_pool = False
        self._rng = random.Random(0)   # where _sample's windows start: seeded, so that a route can be replayed
        self.index = index if index is not None else PrefixIndex()
        for inst in instances:
            self.add(inst)
        if not dynamic:
            if not self.instances:
                raise ValueError("instances: the router needs at least one")
            if self.has_prefill_pool and not any(inst.role == "decode" for inst in self.instances):
                raise ValueError("instances: prefill instances need decode instances to hand their KV to")
            if not any(inst.role in ("decode", "colocated") for inst in self.instances):
                raise ValueError("instances: the router needs decode or colocated instances")
        self.config = config or RouterConfig()
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ValueError(f"policy: one of {', '.join(POLICIES)}, got {policy!r}")
            policy = POLICIES[policy](self.config)
        self.policy = policy
        # Plain counters for /metrics and /cluster.
        self.decisions: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.picks: dict[str, int] = {}           # "stage:outcome" → count, e.g. "prefill:spill"
        self.num_no_candidate = self.num_replacements = self.num_no_replacement = 0

    # --- membership ---------------------------------------------------------------------------------------

    def add(self, inst: Instance) -> None:
        """A new instance joins its pool (routable at once; its first poll brings its load)."""
        if inst.name in self.by_name:
            raise ValueError(f"instances: names must be unique, {inst.name!r} is already routed to")
        self.instances.append(inst)   # in place: the monitor polls this very list
        self.by_name[inst.name] = inst
        self.position[inst.name] = self._next_position
        self._next_position += 1
        self.has_prefill_pool = self.has_prefill_pool or inst.role == "prefill"

    def remove(self, name: str) -> Instance | None:
        """No new request goes to `name`; the hops it has finish on their own (they hold its record).
        Its cached blocks are forgotten. None when it was not routed to."""
        inst = self.by_name.pop(name, None)
        if inst is None:
            return None
        self.instances.remove(inst)
        inst.removed = True   # a poll of it still in flight must not bring it back into the index
        inst.removed_at = time.monotonic()
        del self.position[name]
        self.index.release(name)
        self.has_prefill_pool = any(i.role == "prefill" for i in self.instances)
        return inst

    @property
    def mode(self) -> str:
        return "pd" if self.has_prefill_pool else "colocated"

    @property
    def needs_tokens(self) -> bool:
        """Whether route() needs the prompt's token ids and block hashes (else num_prompt_tokens suffices,
        and the caller can skip tokenizing)."""
        return self.policy.uses_prefix or (self.has_prefill_pool and self.config.pd_min_prompt_tokens > 0)

    def hash_params(self) -> tuple[int, str]:
        """(block_size, hash_extra) to hash prompts with: as the instances report them. A pool is meant to
        share one model and block size; an instance that differs simply never matches."""
        for inst in self.instances:
            if inst.report is not None and inst.report.block_size is not None:
                return inst.block_size, inst.hash_extra
        return DEFAULT_BLOCK_SIZE, ""

    def request(self, num_prompt_tokens: int, max_tokens: int | None,
                token_ids: Sequence[int] | None = None) -> RouteRequest:
        if token_ids is None:
            return RouteRequest(num_prompt_tokens, max_tokens)
        block_size, hash_extra = self.hash_params()
        return RouteRequest.from_token_ids(token_ids, max_tokens, block_size, hash_extra)

    # --- deciding -----------------------------------------------------------------------------------------

    def route(self, req: RouteRequest, exclude: Collection[str] = (), now: float = 0.0) -> Route | None:
        """Where the request goes; None when no instance can take it. exclude: names that failed it."""
        matched = self._matched(req, now)
        prefills, prefills_sampled = self._candidates(("prefill",), req, exclude, now, matched, (PREFILL,))
        # Decode and colocated instances apart: a sample of the two together could hold no D while Ds are free
        # (the request then served colocated: review).
        directs = (self._candidates(("decode",), req, exclude, now, matched, (DECODE, DIRECT))[0]
                   + self._candidates(("colocated",), req, exclude, now, matched, (DIRECT,))[0])
        if not directs:
            self.num_no_candidate += 1
            return None
        choice = self._choice(req, prefills + directs, now, matched)
        if not self.has_prefill_pool:
            return self._direct(directs, choice, "colocated")
        threshold = self.config.pd_min_prompt_tokens
        if req.num_prompt_tokens < threshold:
            return self._direct(directs, choice, "short_prompt")
        holders = [inst for inst in directs if choice.uncached(inst) < threshold]
        if holders:   # a follow-up turn: the D computes the few new tokens sooner than a P hop would take
            return self._direct(holders, choice, "decode_has_prefix")
        decodes = [inst for inst in directs if inst.role == "decode"]
        if not prefills:
            return self._saturated(directs, choice, exclude)
        if not decodes:   # no D can take a P's KV now, but colocated instances can serve on their own
            return self._direct(directs, choice, "colocated")
        if prefills_sampled and self._backlogged(prefills):
            # Every sampled P backlogged is not every P: a D must not prefill while one outside is idle (review).
            prefills, _ = self._candidates(("prefill",), req, exclude, now, None, (PREFILL,), whole=True)
            choice = self._choice(req, prefills + directs, now, matched)
        if self._backlogged(prefills):
            candidates = self._with_headroom(directs, choice)
            if candidates:
                return self._direct(candidates, choice, "prefill_backlog")
        prefill, outcome = self.policy.choose(PREFILL, prefills, choice)
        self._count_pick(PREFILL, outcome)
        decode, outcome = self.policy.choose(DECODE, decodes, choice)
        self._count_pick(DECODE, outcome)
        self.decisions["disaggregated"] += 1
        return Route(prefill, decode, "disaggregated")

    def replacement(self, req: RouteRequest, exclude: Collection[str] = (), now: float = 0.0,
                    within_caps: bool = False) -> Instance | None:
        """A decode or colocated instance to resume a failed stream on: it computes the prompt (and the tokens
        already sent) itself. Under the caps when one is; else, unless within_caps, any available one, since
        losing a stream the client is reading costs more than one request over a cap (the instance's
        admission still decides)."""
        available = [inst for inst in self.instances if inst.role in ("decode", "colocated")
                     and inst.is_available and inst.name not in exclude]
        candidates = [inst for inst in available if self._admits(inst, req, exclude, now)]
        if not candidates and within_caps:
            return None
        candidates = candidates or available
        if not candidates:
            self.num_no_replacement += 1
            return None
        inst, outcome = self.policy.choose(DIRECT, candidates, self._choice(req, candidates, now))
        self._count_pick(DIRECT, outcome)
        self.num_replacements += 1
        return inst

    def another_decode(self, req: RouteRequest, handoff: str, exclude: Collection[str] = (),
                       now: float = 0.0) -> Instance | None:
        """A decode instance for a prompt a P has computed, when the one chosen with it left the cluster
        meanwhile; None when no other (handing KV over as the P does) can take it: the caller then goes on
        with the one that left, which may still take it while it drains."""
        candidates = [inst for inst in self.instances if inst.role == "decode" and inst.handoff == handoff
                      and self._admits(inst, req, exclude, now)]
        if not candidates:
            return None
        inst, outcome = self.policy.choose(DECODE, candidates, self._choice(req, candidates, now))
        self._count_pick(DECODE, outcome)
        return inst

    def _admits(self, inst: Instance, req: RouteRequest, exclude: Collection[str], now: float) -> bool:
        """The hard caps of docs/router.md, step 1."""
        if not inst.is_available or inst.name in exclude or inst.is_full(now):
            return False
        cap = self.config.max_per_instance
        if cap is not None and inst.num_in_flight >= cap:
            return False
        if inst.role == "prefill":
            held = inst.held_fraction
            return held is None or held < self.config.max_held_fraction
        free = inst.free_blocks
        if free is None:
            return True
        needed = inst.blocks_for(req.num_prompt_tokens + (req.max_tokens or 1))
        # A request larger than the whole cache is the instance's to refuse (with a 400 naming the limit),
        # not the router's to turn into a 503 the client would retry forever.
        return free >= needed or needed > (inst.num_blocks or 0)

    def _matched(self, req: RouteRequest, now: float) -> dict[str, int] | None:
        """Per instance, the leading blocks of the prompt it holds (only those holding some); None when nothing
        looks at what is cached."""
        if not (req.block_hashes and self.needs_tokens):
            return None
        return self.index.match(req.block_hashes, None, now)

    def _candidates(self, roles: tuple[str, ...], req: RouteRequest, exclude: Collection[str], now: float,
                    matched: dict[str, int] | None, stages: tuple[str, ...],
                    whole: bool = False) -> tuple[list[Instance], bool]:
        """(The instances of these roles that may take the request (_admits), whether they are a sample's): all
        of them, or past max_candidates (unless whole) a sample, and all of them again when no sampled one
        may. stages: those that choose among them (round-robin's sample starts at their cursors)."""
        pool = [inst for inst in self.instances if inst.role in roles]
        k = self.config.max_candidates
        if whole or not k or len(pool) <= k:
            sample = pool
        elif self.policy.samples:
            sample = self._sample(pool, roles, matched)
        else:
            sample = self._window_after(pool, stages, k, req, matched)
        admitted = [inst for inst in sample if self._admits(inst, req, exclude, now)]
        if len(sample) == len(pool):
            return admitted, False
        if not admitted:
            return [inst for inst in pool if self._admits(inst, req, exclude, now)], False
        return admitted, True

    def _window_after(self, pool: list[Instance], stages: tuple[str, ...], k: int, req: RouteRequest,
                      matched: dict[str, int] | None) -> list[Instance]:
        """Round-robin's sample: the k instances of the pool at and after each stage's cursor, in the router's
        order (wrapping), and every instance holding all but fewer than pd_min_prompt_tokens of the prompt
        (the decider sends the request to one of those: decode_has_prefix). Its answer is then a full
        scan's: the first admitted instance at or after the cursor lies in the window unless none there is
        admitted, and then the whole pool is scanned."""
        picked: dict[str, Instance] = {}
        threshold = self.config.pd_min_prompt_tokens
        if matched and threshold:
            roles = {inst.role for inst in pool}
            for name, num_blocks in matched.items():
                inst = self.by_name.get(name)
                if inst is not None and inst.role in roles and \
                        req.num_prompt_tokens - min(req.num_prompt_tokens, num_blocks * inst.block_size) < threshold:
                    picked[name] = inst
        for stage in stages:
            cursor = self.policy.cursor(stage)
            start = next((i for i, inst in enumerate(pool) if self.position[inst.name] >= cursor), 0)
            for i in range(k):
                inst = pool[(start + i) % len(pool)]
                picked.setdefault(inst.name, inst)
        return list(picked.values())

    def _sample(self, pool: list[Instance], roles: tuple[str, ...], matched: dict[str, int] | None) -> list[Instance]:
        """For a policy that weighs load (round-robin's is _window_after), at most
        max_candidates of a larger pool: the available instances holding more of the prompt than most of the
        pool does (up to half the sample; ties taken in turn), then a window of the pool in the router's
        order from a random place (the router's own seeded generator): every instance is in as many windows
        as any other, on average, whatever was picked and whatever the traffic's pattern (a window that
        followed the picks stayed on 32 of 100 instances while a hot prefix drew half the requests, one that
        moved by a fixed step locked onto every other instance under alternating traffic: review)."""
        k = self.config.max_candidates
        cursor = self._rng.randrange(len(pool))
        picked: dict[str, Instance] = {}
        if matched:
            counts = [n for name, n in matched.items()
                      if (inst := self.by_name.get(name)) is not None and inst.role in roles]
            # Held by (nearly) the whole pool, a block tells instances apart no more than none does: a chat
            # template's first block is on every instance.
            baseline = min(counts) if len(counts) >= len(pool) else 0
            holders = [inst for name, n in matched.items() if n > baseline and (inst := self.by_name.get(name))
                       is not None and inst.role in roles and inst.is_available]
            if holders:
                order = {inst.name: i for i, inst in enumerate(pool)}
                for inst in heapq.nsmallest(k // 2, holders, key=lambda i: (-matched[i.name],
                                                                            (order[i.name] - cursor) % len(pool))):
                    picked[inst.name] = inst
        for i in range(len(pool)):
            if len(picked) >= k:
                break
            inst = pool[(cursor + i) % len(pool)]
            picked.setdefault(inst.name, inst)
        return list(picked.values())

    def _choice(self, req: RouteRequest, candidates: Sequence[Instance], now: float,
                matched: dict[str, int] | None = None) -> Choice:
        cached: dict[str, int] = {}
        if req.block_hashes and self.needs_tokens:   # else nothing looks at what is cached
            names = {inst.name for inst in candidates}
            if matched is None:
                matched = self.index.match(req.block_hashes, names, now)
            for name, num_blocks in matched.items():
                if name in names:
                    cached[name] = min(req.num_prompt_tokens, num_blocks * self.by_name[name].block_size)
        return Choice(req, cached, self.position, now)

    def _direct(self, candidates: Sequence[Instance], choice: Choice, reason: str) -> Route:
        inst, outcome = self.policy.choose(DIRECT, candidates, choice)
        self._count_pick(DIRECT, outcome)
        self.decisions[reason] += 1
        return Route(None, inst, reason)

    def _saturated(self, directs: Sequence[Instance], choice: Choice, exclude: Collection[str]) -> Route | None:
        """No P can take the prompt. While some P is up but at a cap, a D prefills only with headroom: the
        load is better refused (a 503, retried) than stalling the D's streams; colocated instances prefill
        as their job. When every P is down or has failed this request, any D: serving slower beats not
        serving."""
        some_prefill_up = any(inst.role == "prefill" and inst.is_available and inst.name not in exclude
                              for inst in self.instances)
        candidates = self._with_headroom(directs, choice) if some_prefill_up else directs
        if not candidates:
            self.num_no_candidate += 1
            return None
        return self._direct(candidates, choice, "prefill_saturated")

    def _backlogged(self, prefills: Sequence[Instance]) -> bool:
        """Every P has more than direct_prefill_headroom_s of prompts queued ahead of a new one: a D with
        that headroom computes this prompt sooner than any P would start it (found on CPU, 1P1D at rate inf:
        the D decoded small batches on its own while every prompt queued on the P)."""
        headroom = self.config.direct_prefill_headroom_s
        return headroom > 0 and all(prefill_seconds(inst, 0) > headroom for inst in prefills)

    def _with_headroom(self, directs: Sequence[Instance], choice: Choice) -> list[Instance]:
        """The direct candidates that may prefill this prompt now: colocated instances (their job), and Ds whose
        prefill work, queued and this prompt's, stays under direct_prefill_headroom_s, since their running
        streams stall meanwhile. A D that has not prefilled yet has no measured rate: it is taken at the
        slowest rate measured on a P (the same model), not at the default, which may be far off either way."""
        headroom = self.config.direct_prefill_headroom_s
        fallback = None
        if any(inst.role == "decode" and not inst.rates_measured["prefill_tokens_per_s"] for inst in directs):
            measured = [inst.prefill_tokens_per_s for inst in self.instances
                        if inst.role == "prefill" and inst.rates_measured["prefill_tokens_per_s"]]
            fallback = min(measured, default=None)
        return [inst for inst in directs if inst.role == "colocated" or prefill_seconds(
            inst, choice.uncached(inst),
            None if inst.rates_measured["prefill_tokens_per_s"] else fallback) <= headroom]

    def _count_pick(self, stage: str, outcome: str) -> None:
        key = f"{stage}:{outcome}"
        self.picks[key] = self.picks.get(key, 0) + 1

    # --- the caller's accounting --------------------------------------------------------------------------

    def begin(self, inst: Instance, req: RouteRequest, now: float, *, computes_prompt: bool) -> Ticket:
        """The caller sends the request to `inst` now. computes_prompt: it prefills (a P, a direct route or
        a replacement), else it reads the prompt's KV from a P. Counts it in flight there and predicts
        that the instance will hold the prompt's blocks."""
        cached_blocks = 0
        if req.block_hashes:
            cached_blocks = self.index.match(req.block_hashes, [inst.name], now).get(inst.name, 0)
        cached_tokens = min(req.num_prompt_tokens, cached_blocks * inst.block_size)
        num_tokens = req.num_prompt_tokens if inst.role == "prefill" else req.num_prompt_tokens + (req.max_tokens or 1)
        ticket = inst.begin(num_prompt_tokens=req.num_prompt_tokens - cached_tokens if computes_prompt else 0,
                            num_blocks=max(0, inst.blocks_for(num_tokens) - cached_blocks))
        if req.block_hashes and not inst.removed:   # (a removed one's bit is free for the next instance)
            self.index.predict(inst.name, req.block_hashes, now)
        return ticket

    @staticmethod
    def end(inst: Instance, ticket: Ticket) -> None:
        inst.end(ticket)

    # --- reporting ----------------------------------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        return {"policy": self.policy.name, "decisions": dict(self.decisions), "picks": dict(self.picks),
                "no_candidate": self.num_no_candidate, "replacements": self.num_replacements,
                "no_replacement": self.num_no_replacement}

    def cluster_status(self) -> dict[str, Any]:
        """For GET /cluster (the caller adds what it alone knows, e.g. its requests in flight)."""
        instances = []
        for inst in self.instances:
            entry = inst.status()
            entry["cached_blocks"] = self.index.num_confirmed(inst.name)
            entry["predicted_blocks"] = self.index.num_predicted(inst.name)
            instances.append(entry)
        return {"mode": self.mode, **self.counters(), "instances": instances}
