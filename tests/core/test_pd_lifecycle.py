"""P/D lifecycle at the scheduler level with the loopback connector (no torch)."""
import pytest

from pdserve.config import KVTransferConfig
from pdserve.core.request import Request, RequestStatus
from pdserve.kv_transfer.factory import create_connector
from pdserve.sampling_params import SamplingParams

from tests.core.helpers import FakeRunner, assert_no_leaks, fake_token, make_scheduler, run_to_completion

BS = 4


class Instance:
    def __init__(self, role, name, num_blocks=64, clock=None, **cfg):
        config = KVTransferConfig(kv_connector="loopback", kv_role=role, engine_id=name, **cfg)
        self.conn_s, self.conn_w = create_connector(config, BS, {})
        if clock is not None:
            self.conn_w.clock = clock
        self.s = make_scheduler(num_blocks=num_blocks, block_size=BS, connector=self.conn_s,
                                policy=config.kv_load_failure_policy)
        self.runner = FakeRunner(num_blocks, self.conn_w)

    def step(self):
        out = self.s.schedule()
        return out, self.s.update_from_output(out, self.runner.execute(out))

    def drain(self):
        return run_to_completion(self.s, self.runner)

    def close(self):
        self.conn_w.shutdown()


@pytest.fixture
def pd():
    p, d = Instance("producer", "P"), Instance("consumer", "D")
    yield p, d
    p.close(), d.close()


def run_p(p, rid, prompt):
    p.s.add_request(Request(rid, prompt, SamplingParams(max_tokens=1),
                            kv_transfer_params={"do_remote_decode": True}))
    while True:
        _, updates = p.step()
        for u in updates:
            if u.finished:
                assert u.request.status == RequestStatus.FINISHED_LENGTH_CAPPED
                return u.kv_transfer_params


@pytest.mark.parametrize("prompt_len", [1, 4, 8, 13])
def test_pull_handoff_identical_to_colocated(pd, prompt_len):
    p, d = pd
    prompt = list(range(100, 100 + prompt_len))
    params = run_p(p, "req", prompt)
    assert params["do_remote_prefill"] and params["remote_engine_id"] == "P"
    assert len(params["remote_block_ids"]) == -(-prompt_len // BS)
    assert p.s.num_blocks_held_for_transfer == len(params["remote_block_ids"])
    d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=6), kv_transfer_params=params))
    out = d.s.schedule()
    assert out.is_empty and d.s.num_waiting_for_remote_kvs == 1  # parked: no compute
    d.s.update_from_output(out, d.runner.execute(out))
    results, _ = d.drain()
    assert results["req"] == [fake_token(prompt_len - 1 + i) for i in range(6)]
    # D's loaded blocks hold P's content (the fake KV is whatever P's runner left there: None here),
    # and P frees its held blocks once D's read is done.
    p.drain()
    assert d.conn_w.stats["kv_transfer_descriptors_total"] == len(params["remote_block_ids"])
    assert_no_leaks(p.s)
    assert_no_leaks(d.s)


def test_d_prefix_cache_hit_loads_only_the_rest(pd):
    p, d = pd
    prompt = list(range(50, 63))  # 13 tokens: 3 full blocks + 1
    d.s.add_request(Request("warm", prompt[:9], SamplingParams(max_tokens=1)))
    d.drain()
    params = run_p(p, "req", prompt)
    d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=3), kv_transfer_params=params))
    d.step()
    results, _ = d.drain()
    assert results["req"] == [fake_token(12 + i) for i in range(3)]
    assert d.conn_w.stats["kv_transfer_descriptors_total"] == 2  # blocks 2 and 3 only
    p.drain()
    assert_no_leaks(p.s), assert_no_leaks(d.s)


def test_lease_expiry_frees_p_blocks():
    now = [0.0]
    p = Instance("producer", "P2", clock=lambda: now[0], lease_seconds=5)
    try:
        run_p(p, "req", list(range(10)))
        p.step()
        assert p.s.num_blocks_held_for_transfer == 3
        now[0] = 4.0
        p.step()
        assert p.s.num_blocks_held_for_transfer == 3
        now[0] = 5.5
        p.step()
        assert p.conn_w.stats["kv_lease_expirations_total"] == 1
        assert_no_leaks(p.s)
    finally:
        p.close()


@pytest.mark.parametrize("policy,injected", [("fail", "all"), ("fail", "last_block"),
                                             ("recompute", "all"), ("recompute", "last_block")])
def test_load_failure_policies(policy, injected):
    p = Instance("producer", "P3")
    d = Instance("consumer", "D3", kv_load_failure_policy=policy, extra={"inject_read_failure": injected})
    try:
        prompt = list(range(7, 20))
        params = run_p(p, "req", prompt)
        d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=4), kv_transfer_params=params))
        results, statuses = d.drain()
        if policy == "fail":
            assert statuses["req"][0] == RequestStatus.FINISHED_ERROR
            assert results["req"] == []
        else:
            assert results["req"] == [fake_token(12 + i) for i in range(4)]
        p.drain()
        assert_no_leaks(p.s), assert_no_leaks(d.s)
        # Bad blocks never enter D's prefix cache: under `fail` nothing of the load is cached; under
        # `recompute` the blocks hold recomputed (or correctly loaded) KV and are cached.
        hit = d.s.kv.get_computed_blocks(Request("x", prompt, SamplingParams()))[1]
        assert hit == (0 if policy == "fail" else 12)
    finally:
        p.close(), d.close()


def test_a_failed_load_the_connector_marks_for_recompute_is_computed_here_under_policy_fail():
    """The push handoff's abandoned transfer (the router says P failed): D computes the prompt itself,
    with the output a load would have given, though its policy is `fail`."""
    p = Instance("producer", "P4")
    d = Instance("consumer", "D4", kv_load_failure_policy="fail", extra={"inject_read_failure": "all"})
    try:
        prompt = list(range(7, 20))
        params = run_p(p, "req", prompt)
        get_finished = d.conn_w.get_finished
        marked = set()

        def finished_and_marked():
            sending, recving = get_finished()
            marked.update(recving)
            return sending, recving
        d.conn_w.get_finished = finished_and_marked
        d.conn_w.get_recompute_request_ids = lambda: {marked.pop()} if marked else set()
        d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=4), kv_transfer_params=params))
        results, statuses = d.drain()
        assert results["req"] == [fake_token(12 + i) for i in range(4)]
        assert statuses["req"][0] != RequestStatus.FINISHED_ERROR
        p.drain()
        assert_no_leaks(p.s), assert_no_leaks(d.s)
    finally:
        p.close(), d.close()


def test_abort_while_waiting_for_remote_kvs_frees_after_load(pd):
    p, d = pd
    prompt = list(range(30))
    params = run_p(p, "req", prompt)
    d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=4), kv_transfer_params=params))
    out = d.s.schedule()  # allocates and parks; the load is handed to the worker half
    assert d.s.num_waiting_for_remote_kvs == 1
    d.s.abort_requests(["req"])
    assert d.s.kv.num_free_blocks < 64  # blocks stay while a read may still write
    d.s.update_from_output(out, d.runner.execute(out))
    results, statuses = d.drain()
    p.drain()
    assert_no_leaks(p.s), assert_no_leaks(d.s)


def test_abort_before_the_load_starts_releases_p(pd):
    p, d = pd
    prompt = list(range(30))
    params = run_p(p, "req", prompt)
    d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=4), kv_transfer_params=params))
    out = d.s.schedule()
    d.s.abort_requests(["req"])
    out2 = d.s.schedule()  # the cancel reaches the worker in the same meta flow
    d.runner.connector.start_load_kv(out.connector_meta)
    d.runner.connector.start_load_kv(out2.connector_meta)
    d.drain()
    p.drain()
    assert d.conn_w.stats["kv_transfer_descriptors_total"] == 0
    assert_no_leaks(p.s), assert_no_leaks(d.s)


def test_nothing_left_to_load_computes_locally_instead_of_parking(pd):
    """P's params cover only what D's prefix cache already holds: D must not park the request
    waiting for a load that will never be posted (it used to hang in WAITING_FOR_REMOTE_KVS)."""
    p, d = pd
    prompt = list(range(40, 53))
    d.s.add_request(Request("warm", prompt[:9], SamplingParams(max_tokens=1)))
    d.drain()  # D caches blocks 0 and 1 (8 tokens)
    params = run_p(p, "req", prompt)
    params["num_remote_tokens"] = 8  # P claims only the first two blocks
    d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=3), kv_transfer_params=params))
    out = d.s.schedule()
    assert d.s.num_waiting_for_remote_kvs == 0 and out.scheduled[0].num_computed_tokens == 8
    d.s.update_from_output(out, d.runner.execute(out))
    results, _ = d.drain()
    assert len(results["req"]) == 2
    assert_no_leaks(d.s)
    p.step()
    assert p.s.num_blocks_held_for_transfer == 0  # D told P nobody will read its copy
    assert_no_leaks(p.s)


def test_request_queued_on_d_longer_than_the_lease_still_loads_from_p():
    """D heartbeats P for a request that queues in its scheduler (no free blocks yet), not only once
    its load starts: P keeps the blocks past the lease, and D loads them instead of recomputing."""
    now = [0.0]
    p = Instance("producer", "P-wait", clock=lambda: now[0], lease_seconds=10)
    d = Instance("consumer", "D-wait", num_blocks=4)
    try:
        d.s.add_request(Request("busy", list(range(5)), SamplingParams(max_tokens=10)))  # 4 blocks by the end
        d.step()
        prompt = list(range(60, 73))  # 4 blocks: must wait for "busy"
        params = run_p(p, "req", prompt)
        d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=3), kv_transfer_params=params))
        while "busy" in d.s.requests:
            now[0] += 2.0  # 18 s in all: well past P's 10 s lease
            d.step()
            p.step()
            assert p.s.num_blocks_held_for_transfer == 4
        results, _ = d.drain()
        assert results["req"] == [fake_token(12 + i) for i in range(3)]
        assert d.conn_w.stats["kv_transfer_descriptors_total"] == 4  # loaded, not recomputed
        assert p.conn_w.stats["kv_lease_expirations_total"] == 0
        p.drain()
        assert_no_leaks(p.s), assert_no_leaks(d.s)
    finally:
        p.close(), d.close()


def test_request_aborted_while_queued_on_d_releases_p_at_once(pd):
    p, d = pd
    d.s.add_request(Request("busy", list(range(200)), SamplingParams(max_tokens=2)))
    d.step()
    prompt = list(range(30))
    params = run_p(p, "req", prompt)
    assert p.s.num_blocks_held_for_transfer > 0
    d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=4), kv_transfer_params=params))
    d.s.abort_requests(["req"])  # before any step let it load
    d.step()
    p.step()
    assert p.s.num_blocks_held_for_transfer == 0 and p.conn_w.stats["kv_lease_expirations_total"] == 0
    d.drain(), p.drain()
    assert d.conn_w.stats["kv_transfer_descriptors_total"] == 0
    assert_no_leaks(p.s), assert_no_leaks(d.s)


def test_request_id_of_an_aborted_load_cannot_be_reused_until_it_ends(pd):
    p, d = pd
    prompt = list(range(30))
    params = run_p(p, "req", prompt)
    d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=4), kv_transfer_params=params))
    out = d.s.schedule()
    d.s.abort_requests(["req"])
    with pytest.raises(ValueError, match="already in use"):
        d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=4)))
    d.s.update_from_output(out, d.runner.execute(out))
    d.drain()
    p.drain()
    assert_no_leaks(d.s), assert_no_leaks(p.s)


def test_reused_d_request_id_releases_the_old_p_copy_not_the_new_one(pd):
    """A queued D request is aborted and its id reused at once for another request with KV on P:
    the release must free the first P copy, never the one the new request is about to read."""
    p, d = pd
    d.s.add_request(Request("busy", list(range(200)), SamplingParams(max_tokens=2)))
    d.step()
    first = run_p(p, "p1", list(range(30)))
    prompt = list(range(40, 70))
    second = run_p(p, "p2", prompt)
    d.s.add_request(Request("x", list(range(30)), SamplingParams(max_tokens=4), kv_transfer_params=first))
    d.s.abort_requests(["x"])
    d.s.add_request(Request("x", prompt, SamplingParams(max_tokens=3), kv_transfer_params=second))
    d.step()
    p.step()
    assert "p1" not in p.s.held_for_transfer and "p2" in p.s.held_for_transfer
    results, _ = d.drain()
    assert results["x"] == [fake_token(29 + i) for i in range(3)]
    assert d.conn_w.stats["kv_transfer_descriptors_total"] == 8  # p2's 8 blocks, read while held
    p.drain()
    assert p.conn_w.stats["kv_lease_expirations_total"] == 0
    assert_no_leaks(p.s), assert_no_leaks(d.s)


# ----------------------------------------------------------------------------- P's first token on D

def drive(instance, max_steps=100):
    """Step until the instance is idle: (every token sent in order, tokens each step computed)."""
    tokens, computed = [], []
    for _ in range(max_steps):
        if not instance.s.has_unfinished():
            return tokens, computed
        out, updates = instance.step()
        computed.append(sum(len(item.token_ids) for item in out.scheduled))
        tokens += [t for u in updates for t in u.new_token_ids]
    raise AssertionError("not idle")


@pytest.mark.parametrize("prompt_len", [1, 4, 13])
def test_ps_first_token_goes_out_before_the_load_and_d_decodes_from_it(pd, prompt_len):
    p, d = pd
    prompt = list(range(100, 100 + prompt_len))
    params = run_p(p, "req", prompt)
    assert params["first_token_ids"] == [fake_token(prompt_len - 1)]
    first = d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=6), kv_transfer_params=params),
                            params["first_token_ids"])
    assert first.new_token_ids == params["first_token_ids"] and not first.finished   # out before any step
    out, updates = d.step()
    assert out.is_empty and updates == []   # the load is under way
    tokens, computed = drive(d)
    assert params["first_token_ids"] + tokens == [fake_token(prompt_len - 1 + i) for i in range(6)]
    # the whole prompt loaded, none of it computed again: one token per step, the first P's
    assert [n for n in computed if n] == [1] * 5
    assert d.conn_w.stats["kv_transfer_descriptors_total"] == len(params["remote_block_ids"])
    p.drain()
    assert_no_leaks(p.s), assert_no_leaks(d.s)


@pytest.mark.parametrize("how", ["max_tokens", "eos"])
def test_a_first_token_that_ends_the_request_finishes_it_on_d_and_p_lets_go(pd, how):
    p, d = pd
    prompt = list(range(30))
    params = run_p(p, "req", prompt)
    first = params["first_token_ids"]
    max_tokens, eos = (1, ()) if how == "max_tokens" else (5, tuple(first))
    update = d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=max_tokens), eos,
                                     kv_transfer_params=params), first)
    assert (update.new_token_ids, update.finished) == (first, True)
    assert update.request.status == (RequestStatus.FINISHED_LENGTH_CAPPED if how == "max_tokens"
                                     else RequestStatus.FINISHED_STOPPED)
    d.step()
    p.step()   # D's release reached P: its blocks are free now, not at lease expiry
    assert p.s.num_blocks_held_for_transfer == 0 and p.conn_w.stats["kv_lease_expirations_total"] == 0
    d.drain(), p.drain()
    assert d.conn_w.stats["kv_transfer_descriptors_total"] == 0
    assert_no_leaks(p.s), assert_no_leaks(d.s)


def connector_brings_first_token(d, request_id, token_ids, ahead=False, load_reports_at=3):
    """D's worker half reports P's token as the push handoff does (the loopback connector stands in for the
    transport): with the load (in P's WRITE notification), or ahead of it (P's side-channel message) in its
    first step, the load then reported only from its load_reports_at-th."""
    get_finished, calls, held, reported = d.conn_w.get_finished, [0], set(), {}

    def finished():
        sending, recving = get_finished()
        calls[0] += 1
        held.update(recving)
        if ahead and calls[0] < load_reports_at:
            recving = set()
        else:
            recving = set(held)
            held.clear()
        reported.clear()
        if (calls[0] == 1) if ahead else request_id in recving:
            reported[request_id] = list(token_ids)
        return sending, recving
    d.conn_w.get_finished = finished
    d.conn_w.get_first_token_ids = lambda: dict(reported)


@pytest.mark.parametrize("prompt_len", [1, 4, 13])
def test_a_first_token_the_load_brings_goes_out_first_and_d_decodes_from_it(pd, prompt_len):
    """Push: P's token arrives with the KV (not over HTTP before it). D computed the prompt's last position
    again instead, which on a GPU in bfloat16 gave another token than P's prefill on a near-tie (session 47).
    P's token here is one D would never sample, so that only taking it passes."""
    p, d = pd
    prompt = list(range(100, 100 + prompt_len))
    params = run_p(p, "req", prompt)
    del params["first_token_ids"]
    ps_token = (fake_token(prompt_len - 1) + 1) % 1000
    connector_brings_first_token(d, "req", [ps_token])
    d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=6), kv_transfer_params=params))
    first_update = next(u for _ in range(20) for u in d.step()[1] if u.new_token_ids)
    assert first_update.new_token_ids == [ps_token] and first_update.is_remote   # (not counted as D's output)
    tokens, computed = drive(d)
    tokens = first_update.new_token_ids + tokens
    assert tokens == [ps_token] + [fake_token(prompt_len + i) for i in range(5)]
    assert [n for n in computed if n] == [1] * 5   # nothing of the prompt computed again
    p.drain()
    assert_no_leaks(p.s), assert_no_leaks(d.s)


@pytest.mark.parametrize("how", ["max_tokens", "eos"])
def test_a_first_token_the_load_brings_can_end_the_request(pd, how):
    p, d = pd
    prompt = list(range(30))
    params = run_p(p, "req", prompt)
    first = params.pop("first_token_ids")
    max_tokens, eos = (1, ()) if how == "max_tokens" else (5, tuple(first))
    connector_brings_first_token(d, "req", first)
    d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=max_tokens), eos, kv_transfer_params=params))
    updates = []
    for _ in range(20):
        updates += d.step()[1]
        if any(u.finished for u in updates):
            break
    assert [(u.new_token_ids, u.finished) for u in updates if u.new_token_ids or u.finished] == [(first, True)]
    assert updates[-1].request.status == (RequestStatus.FINISHED_LENGTH_CAPPED if how == "max_tokens"
                                          else RequestStatus.FINISHED_STOPPED)
    d.drain(), p.drain()
    assert_no_leaks(p.s), assert_no_leaks(d.s)


def test_a_first_token_sent_ahead_of_the_kv_goes_out_while_the_load_is_under_way(pd):
    """Push's D sent P's token only once the KV was in; a pull D sends it on admission, before its READ
    (session 48). Now P sends it to D as soon as it has it, and D sends it on."""
    p, d = pd
    prompt = list(range(100, 113))
    params = run_p(p, "req", prompt)
    del params["first_token_ids"]
    ps_token = (fake_token(12) + 1) % 1000
    connector_brings_first_token(d, "req", [ps_token], ahead=True)
    d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=6), kv_transfer_params=params))
    _, updates = d.step()
    assert [(u.new_token_ids, u.is_remote) for u in updates] == [([ps_token], True)]
    assert d.s.requests["req"].status == RequestStatus.WAITING_FOR_REMOTE_KVS   # the KV is not in yet
    tokens, computed = drive(d)
    assert tokens == [fake_token(13 + i) for i in range(5)]   # from P's token, which is not sent twice
    assert [n for n in computed if n] == [1] * 5
    p.drain()
    assert_no_leaks(p.s), assert_no_leaks(d.s)


def test_a_first_token_sent_ahead_that_ends_the_request_frees_its_blocks_once_the_load_reports(pd):
    p, d = pd
    prompt = list(range(40, 60))
    params = run_p(p, "req", prompt)
    first = params.pop("first_token_ids")
    connector_brings_first_token(d, "req", first, ahead=True)
    d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=1), kv_transfer_params=params))
    _, updates = d.step()
    assert [(u.new_token_ids, u.finished) for u in updates] == [(first, True)]
    assert "req" in d.s.aborted_while_loading   # a load under way: its blocks wait for it
    d.drain(), p.drain()
    assert not d.s.aborted_while_loading
    assert_no_leaks(p.s), assert_no_leaks(d.s)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_first_token_then_a_failed_load(policy):
    p = Instance("producer", "P3")
    d = Instance("consumer", "D3", kv_load_failure_policy=policy, extra={"inject_read_failure": "last_block"})
    try:
        prompt = list(range(13))
        params = run_p(p, "req", prompt)
        first = d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=4), kv_transfer_params=params),
                                params["first_token_ids"])
        tokens, computed = drive(d)
        tokens = first.new_token_ids + tokens
        if policy == "fail":   # the client has P's token, then the error
            assert tokens == params["first_token_ids"] and not any(computed)
        else:
            assert tokens == [fake_token(12 + i) for i in range(4)]
            assert [n for n in computed if n] == [2, 1, 1]   # the bad block's prompt token and P's token
        p.drain()
        assert_no_leaks(p.s), assert_no_leaks(d.s)
    finally:
        p.close(), d.close()


class KVRunner(FakeRunner):
    """FakeRunner that keeps the KV: a block is the list of the token ids written at its slots. Each step
    checks that a request's context (its positions before the new tokens) reads back its own tokens
    through its block table, then writes the new ones."""

    def __init__(self, num_blocks, connector_worker, prompts):
        super().__init__(num_blocks, connector_worker)
        self.prompts = prompts   # request id → prompt; outputs are fake_token(position - 1)

    def token_at(self, request_id, pos):
        prompt = self.prompts[request_id]
        return prompt[pos] if pos < len(prompt) else fake_token(pos - 1)

    def execute(self, out):
        for item in out.scheduled:
            for pos in range(item.num_computed_tokens):
                block = self.kv_caches[item.block_ids[pos // BS]]
                assert block is not None and block[pos % BS] == self.token_at(item.request_id, pos), (
                    f"{item.request_id} reads position {pos} from block {item.block_ids[pos // BS]} ({block})")
            for pos in range(item.num_computed_tokens, item.num_computed_tokens + len(item.token_ids)):
                block_id = item.block_ids[pos // BS]
                block = list(self.kv_caches[block_id] or [None] * BS)   # (a loaded block may be P's list)
                block[pos % BS] = self.token_at(item.request_id, pos)
                self.kv_caches[block_id] = block
        return super().execute(out)


@pytest.mark.parametrize("how", ["policy recompute", "marked for recompute (push: P's hop failed)"])
def test_a_failed_load_recomputed_from_scratch_takes_prefix_hits_into_a_clean_block_table(how):
    """A load that fails from its first block is recomputed from position 0. Meanwhile another request with
    the same prefix filled D's prefix cache, so the recompute takes those hits: they must become the first
    blocks of its block table. Appended after the blocks the failed load left (never written), the request
    read garbage as context, and its decode wrote into the cached prefix blocks: every later request with
    that prefix got wrong answers from D's cache (the push handoff, P killed mid-push, hostile-s47)."""
    p = Instance("producer", "P5")
    d = Instance("consumer", "D5", kv_load_failure_policy="recompute" if how == "policy recompute" else "fail",
                 extra={"inject_read_failure": "all"})
    try:
        prompt = list(range(7, 20))   # 13 tokens: 4 blocks
        warm = prompt[:9]             # caches blocks 0 and 1 on D while "req" waits for its load
        probe = prompt[:9] + [500]
        d.runner = KVRunner(64, d.conn_w, {"req": prompt, "warm": warm, "probe": probe})
        if how != "policy recompute":
            get_finished, marked = d.conn_w.get_finished, set()

            def finished_and_marked():
                sending, recving = get_finished()
                marked.update(recving)
                return sending, recving
            d.conn_w.get_finished = finished_and_marked
            d.conn_w.get_recompute_request_ids = lambda: {marked.pop()} if marked else set()
        params = run_p(p, "req", prompt)
        d.s.add_request(Request("req", prompt, SamplingParams(max_tokens=12), kv_transfer_params=params))
        d.s.add_request(Request("warm", warm, SamplingParams(max_tokens=1)))
        results, statuses = d.drain()   # (12 tokens: the decode runs past the prompt's 4 blocks)
        assert results["req"] == [fake_token(12 + i) for i in range(12)]
        assert statuses["req"][0] == RequestStatus.FINISHED_LENGTH_CAPPED
        # D's cached prefix still holds the prompt: a later request with it reads it back (KVRunner checks).
        d.s.add_request(Request("probe", probe, SamplingParams(max_tokens=2)))
        assert d.s.kv.get_computed_blocks(d.s.requests["probe"])[1] == 8
        results, _ = d.drain()
        assert results["probe"] == [fake_token(9 + i) for i in range(2)]
        p.drain()
        assert_no_leaks(p.s), assert_no_leaks(d.s)
    finally:
        p.close(), d.close()
