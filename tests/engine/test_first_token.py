"""P's first token on D at the engine level (tiny model, loopback P/D, EngineCore driven step by step):
identical to colocated (greedy, seeded, stop strings), a first token that ends the request, an abort or a
failed load right after it, and a bystander on D that never notices (docs/architecture.md, "P's first
token")."""
import itertools
import pytest

from pdserve.config import EngineConfig, KVTransferConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.outputs import FinishReason
from pdserve.sampling_params import SamplingParams
from tests.helpers_models import make_tiny_hf_model

_ids = itertools.count()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("ft"), "llama")


def core(path, role=None, async_scheduling=False, policy="fail", extra=None, caching=True):
    kv = KVTransferConfig()
    if role:
        kv = KVTransferConfig(kv_connector="loopback", kv_role=role, engine_id=f"{role}-{next(_ids)}",
                              kv_load_failure_policy=policy, extra=extra or {})
    cfg = EngineConfig(model=ModelConfig(model=path), kv_transfer=kv,
                       scheduler=SchedulerConfig(max_num_seqs=4, async_scheduling=async_scheduling),
                       num_threads=1)
    cfg.cache.enable_prefix_caching = caching
    return EngineCore(cfg, num_blocks=64)


def drain(c, max_steps=300, until=None):
    res = {}
    for _ in range(max_steps):
        if not c.has_work() or (until and all(res.get(r, {}).get("fin") for r in until)):
            return res
        for o in c.step():
            r = res.setdefault(o.request_id, {"ids": [], "text": "", "fin": None, "err": None, "out": []})
            r["ids"] += o.new_token_ids
            r["text"] += o.new_text
            r["out"].append(o)
            if o.finished:
                r["fin"], r["err"], r["kv"], r["usage"] = o.finish_reason, o.error, o.kv_transfer_params, (
                    o.num_prompt_tokens, o.num_output_tokens, o.num_cached_tokens)
    raise AssertionError("not drained")


def prefill(p, rid, prompt, sp):
    sp = SamplingParams(**{**sp.__dict__, "max_tokens": 1})
    p.add_request(rid, prompt, sp, {"do_remote_decode": True})
    for _ in range(100):
        for o in p.step():
            if o.request_id == rid and o.finished:
                return o.kv_transfer_params
    raise AssertionError("P did not finish")


def held(c):
    s = c.scheduler
    return (len(s.requests), len(s.held_for_transfer), len(s.aborted_while_loading),
            s.kv.num_free_blocks, c.connector_worker.num_pending_requests() if c.connector_worker else 0)


PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 65, 66, 67]


def with_bystander(d):
    """A request decoding on D beside the one under test: a failure that takes its step down shows on it."""
    d.add_request("other", PROMPT, SamplingParams(max_tokens=20, temperature=0))
    for _ in range(3):
        d.step()


@pytest.mark.parametrize("async_d", [False, True])
def test_abort_right_after_add_with_first_token(model, async_d):
    """Client disconnect (or request timeout) between D's add and its next step."""
    p, d = core(model, "producer"), core(model, "consumer", async_scheduling=async_d)
    try:
        with_bystander(d)
        params = prefill(p, "r", PROMPT, SamplingParams(max_tokens=8, temperature=0))
        d.add_request("r", PROMPT, SamplingParams(max_tokens=8, temperature=0), params)
        d.abort(["r"])            # same drain of the engine inbox
        res = drain(d)
        assert res["other"]["err"] is None and res["other"]["fin"] == FinishReason.LENGTH, res["other"]
        assert res["r"]["fin"] == FinishReason.ABORT
        for _ in range(5):   # D's release reaches P
            p.step()
        assert held(d)[:3] == (0, 0, 0) and held(p) == (0, 0, 0, 64, 0), (held(d), held(p))
        assert p.connector_worker.stats["kv_lease_expirations_total"] == 0
    finally:
        p.connector_worker.shutdown(), d.connector_worker.shutdown()


@pytest.mark.parametrize("async_d", [False, True])
def test_failed_load_reported_in_the_first_step(model, async_d):
    """Policy fail, and the load fails in the step that starts it (loopback reports it at once)."""
    p = core(model, "producer")
    d = core(model, "consumer", async_scheduling=async_d, extra={"inject_read_failure": "all"})
    try:
        with_bystander(d)
        params = prefill(p, "r", PROMPT, SamplingParams(max_tokens=8, temperature=0))
        d.add_request("r", PROMPT, SamplingParams(max_tokens=8, temperature=0), params)
        res = drain(d)
        assert res["other"]["err"] is None, res["other"]
        assert res["r"]["fin"] == FinishReason.ERROR and res["r"]["ids"] == params["first_token_ids"]
    finally:
        p.connector_worker.shutdown(), d.connector_worker.shutdown()


SPS = [dict(temperature=0), dict(temperature=0.9, top_p=0.95, seed=7), dict(temperature=0, stop=["o"]),
       dict(temperature=0.8, seed=5, stop=["l"])]


@pytest.mark.parametrize("async_d", [False, True])
@pytest.mark.parametrize("sp", SPS)
@pytest.mark.parametrize("plen", [1, 16, 17])
def test_identity_to_colocated(model, sp, plen, async_d):
    prompt = PROMPT[:plen] if plen <= len(PROMPT) else PROMPT
    colo = core(model)
    p, d = core(model, "producer"), core(model, "consumer", async_scheduling=async_d)
    try:
        params = SamplingParams(max_tokens=12, **sp)
        colo.add_request("r", prompt, params)
        want = drain(colo)["r"]
        kv = prefill(p, "r", prompt, params)
        d.add_request("r", prompt, SamplingParams(max_tokens=12, **sp), kv)
        got = drain(d, until=["r"])["r"]
        assert (got["ids"], got["text"], got["fin"]) == (want["ids"], want["text"], want["fin"])
        assert got["usage"] == want["usage"]   # cached tokens too: P's KV is not cached (it was 0 vs the prompt)
        for _ in range(5):
            p.step(); d.step()
        assert held(d)[:3] == (0, 0, 0) and held(p)[:3] == (0, 0, 0), (held(d), held(p))
    finally:
        p.connector_worker.shutdown(), d.connector_worker.shutdown()


def test_cached_tokens_through_p_and_d_are_what_colocated_reports(model):
    """usage.prompt_tokens_details.cached_tokens counted the KV D read from P as cached: every prompt
    through the cluster reported all of itself cached (a new-user check). It is P's prefix hits now, as a
    colocated instance reports its own; not D's, which may hold the prompt's last block (D takes P's
    first token, a colocated instance recomputes that block) or a prompt P computed anyway (review)."""
    long = PROMPT * 3   # 51 tokens
    sequence = [long, long, long[:32], long[:32], long[:16], long[:16]]   # and whole blocks only
    colo = core(model)
    p, d = core(model, "producer"), core(model, "consumer")
    try:
        sp = SamplingParams(max_tokens=4, temperature=0)
        seen = []
        for i, prompt in enumerate(sequence):
            rid = f"r{i}"
            colo.add_request(rid, prompt, sp)
            want = drain(colo)[rid]
            d.add_request(rid, prompt, sp, prefill(p, rid, prompt, sp))
            got = drain(d, until=[rid])[rid]
            assert got["usage"] == want["usage"], (i, len(prompt))
            seen.append(want["usage"][2])
        assert seen == [0, 48, 16, 16, 0, 0]
    finally:
        p.connector_worker.shutdown(), d.connector_worker.shutdown()


def test_a_forged_remote_cached_count_means_nothing_to_an_instance_that_is_not_a_consumer(model):
    """A colocated instance without a router key takes kv_transfer_params from anyone: their count of P's
    hits must not reach its usage (review: 40 of 40 reported)."""
    colo = core(model)
    colo.add_request("x", PROMPT, SamplingParams(max_tokens=2, temperature=0), {
        "do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h",
        "remote_port": 1, "remote_cached_tokens": 10 ** 9})
    assert drain(colo)["x"]["usage"][2] == 0


def first_of(model, prompt, sp):
    c = core(model)
    c.add_request("x", prompt, SamplingParams(**{**sp, "max_tokens": 1}))
    r = drain(c)["x"]
    return r["ids"][0], r["text"]


@pytest.mark.parametrize("async_d", [False, True])
@pytest.mark.parametrize("how", ["stop_ids", "stop_str", "max1", "eos"])
def test_first_token_ends_request(model, how, async_d):
    tok, text = first_of(model, PROMPT, dict(temperature=0))
    sp = dict(temperature=0, max_tokens=6)
    if how == "stop_ids":
        sp["stop_token_ids"] = [tok]
    elif how == "stop_str":
        sp["stop"] = [text] if text else ["\ufffd"]
    elif how == "max1":
        sp["max_tokens"] = 1
    colo = core(model)
    p, d = core(model, "producer"), core(model, "consumer", async_scheduling=async_d)
    if how == "eos":
        d.eos_token_ids = colo.eos_token_ids = (tok,)
    try:
        colo.add_request("r", PROMPT, SamplingParams(**sp))
        want = drain(colo)["r"]
        kv = prefill(p, "r", PROMPT, SamplingParams(**sp))
        d.add_request("r", PROMPT, SamplingParams(**sp), kv)
        got = drain(d, until=["r"])["r"]
        assert (got["ids"], got["text"], got["fin"]) == (want["ids"], want["text"], want["fin"])
        for _ in range(5):
            p.step(); d.step()
        assert p.connector_worker.stats["kv_lease_expirations_total"] == 0
        assert held(d) == (0, 0, 0, 64, 0) and held(p) == (0, 0, 0, 64, 0), (held(d), held(p))
    finally:
        p.connector_worker.shutdown(), d.connector_worker.shutdown()


@pytest.mark.parametrize("async_d", [False, True])
def test_d_computes_ps_token_and_the_second_ends_the_request_in_one_step(model, async_d):
    """D's prefix cache holds the whole (block-aligned) prompt: D computes P's token in the step that admits
    the request, and the token it samples there ends it. P's token must go out first, once, and a
    bystander must not notice (two updates of one request in one step used to fail the step: KeyError)."""
    prompt = (PROMPT * 2)[:32]
    p, d, colo = core(model, "producer"), core(model, "consumer", async_scheduling=async_d), core(model)
    try:
        d.add_request("warm", prompt + [1], SamplingParams(max_tokens=1))
        drain(d)
        d.add_request("bystander", PROMPT, SamplingParams(max_tokens=30, temperature=0))
        d.step(), d.step()
        colo.add_request("r", prompt, SamplingParams(max_tokens=2, temperature=0))
        want = drain(colo)["r"]
        params = prefill(p, "r", prompt, SamplingParams(max_tokens=2, temperature=0))
        d.add_request("r", prompt, SamplingParams(max_tokens=2, temperature=0), params)
        res = drain(d)
        assert res["bystander"]["err"] is None and res["bystander"]["fin"] == FinishReason.LENGTH
        assert (res["r"]["ids"], res["r"]["fin"]) == (want["ids"], want["fin"])
        assert [o.new_token_ids for o in res["r"]["out"]][0] == params["first_token_ids"]
        for _ in range(5):
            p.step()
        assert held(d)[:3] == (0, 0, 0) and held(p) == (0, 0, 0, 64, 0), (held(d), held(p))
    finally:
        p.connector_worker.shutdown(), d.connector_worker.shutdown()


def test_a_producer_ignores_a_first_token(model):
    """Only a D takes P's token: an instance that does not load KV computes the request itself."""
    p, colo = core(model, "producer"), core(model)
    try:
        colo.add_request("r", PROMPT, SamplingParams(max_tokens=3, temperature=0))
        want = drain(colo)["r"]["ids"]
        p.add_request("r", PROMPT, SamplingParams(max_tokens=3, temperature=0),
                      {"do_remote_prefill": True, "remote_engine_id": "x", "remote_request_id": "y",
                       "remote_host": "127.0.0.1", "remote_port": 1, "first_token_ids": [(want[0] + 1) % 200]})
        assert drain(p)["r"]["ids"] == want
    finally:
        p.connector_worker.shutdown()
