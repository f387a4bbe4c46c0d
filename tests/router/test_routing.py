"""The router against fake instances (no model): conditional disaggregation, prefix-affinity and cost with
token-id prompts (the router hashes those itself), least-load, ejection and re-admission, restarts,
backpressure, GET /cluster and `pdserve status`, the start-up checks, and a failed prefill routed again."""
from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve import cli
from pdserve.hashing import hash_prompt_blocks
from pdserve.router.monitor import StartupError
from pdserve.router.policy import REASONS, RouterConfig
from pdserve.router.proxy import PROXY_KEY
from pdserve.router.status import COLUMNS, format_cluster

from .conftest import MODEL, NEVER_EJECT, PIECES, dead_url, post_raw

PREFIX = list(range(1000, 1064))          # 64 token ids: 4 blocks of 16
BLOCK_HASHES = hash_prompt_blocks(PREFIX, 16, "")
POLL = 0.05


def tail(start: int, n: int = 8) -> list[int]:
    return list(range(start, start + n))


def complete(url: str, prompt, *, stream: bool = False, headers: dict | None = None):
    """POST /v1/completions; (status, headers, raw body)."""
    return post_raw(url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 16, "stream": stream},
                    headers=headers)


def get_json(url: str, path: str, api_key: str | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url + path)
    if api_key is not None:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def cluster(url: str, api_key: str | None = None) -> dict:
    status, body = get_json(url, "/cluster", api_key)
    assert status == 200, body
    return body


def instance(status: dict, name: str) -> dict:
    [entry] = [inst for inst in status["instances"] if inst["name"] == name]
    return entry


def metrics(url: str) -> dict[tuple[str, frozenset], float]:
    """(name, {label: value}) → value, whatever order the labels are written in."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    out = {}
    for line in lines:
        if line.startswith("#") or not line:
            continue
        series, value = line.rsplit(" ", 1)
        name, _, labels = series.partition("{")
        pairs = frozenset(tuple(p.split("=", 1)) for p in labels.rstrip("}").replace('"', "").split(",") if p)
        out[(name, pairs)] = float(value)
    return out


def metric(m: dict, name: str, **labels: str) -> float:
    return m[(name, frozenset(labels.items()))]


def decisions(url: str) -> dict[str, float]:
    m = metrics(url)
    return {reason: metric(m, "pdserve:proxy_routing_decisions_total", reason=reason) for reason in REASONS}


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def wait_polled(*backends) -> None:
    """Until the monitor's first poll round has been applied (the second has begun): a request sent before
    it could see its predictions dropped by the first poll's snapshot."""
    assert wait_for(lambda: all(b.num_polls >= 2 for b in backends))


def nothing_in_flight(url: str) -> bool:
    status = cluster(url)
    return (status["num_in_flight"], status["num_queued"], [i["own_in_flight"] for i in status["instances"]]) == (
        0, 0, [0] * len(status["instances"]))


def only_decisions(**counts: int) -> dict[str, float]:
    return {reason: float(counts.get(reason, 0)) for reason in REASONS}


# --- 1. conditional disaggregation -------------------------------------------------------------------------

def test_conditional_pd_sends_short_prompts_and_follow_ups_straight_to_decode(harness):
    p, d = harness.backend("prefill"), harness.backend("decode")
    url = harness.proxy([p], [d], router_config=RouterConfig(pd_min_prompt_tokens=32), poll_interval=POLL)
    wait_polled(p, d)

    assert complete(url, tail(100, 31))[0] == 200               # 31 < T tokens: D prefills it itself
    assert p.received == [] and len(d.received) == 1
    assert "kv_transfer_params" not in d.received[0].body and d.received[0].body["prompt"] == tail(100, 31)

    assert complete(url, PREFIX)[0] == 200                       # 64 >= T: disaggregated
    assert [r.body["prompt"] for r in p.received] == [PREFIX]
    assert d.received[1].body["kv_transfer_params"] == p.kv_transfer_params

    # a follow-up turn: D holds the 64 tokens of the last prompt (the router's prediction), 8 are new < T
    assert complete(url, PREFIX + tail(7000))[0] == 200
    assert len(p.received) == 1 and "kv_transfer_params" not in d.received[2].body

    assert complete(url, tail(9000, 40))[0] == 200               # unrelated and long: disaggregated again
    assert len(p.received) == 2 and "kv_transfer_params" in d.received[3].body
    assert decisions(url) == only_decisions(short_prompt=1, disaggregated=2, decode_has_prefix=1)


# --- 2. prefix affinity and cost ---------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["prefix-affinity", "cost"])
def test_a_shared_prefix_follows_the_prefill_predicted_to_hold_it(harness, policy):
    p0, p1, d = harness.backend("prefill"), harness.backend("prefill"), harness.backend("decode")
    url = harness.proxy([p0, p1], [d], policy=policy, poll_interval=POLL)
    wait_polled(p0, p1, d)

    def counts():
        return len(p0.received), len(p1.received)

    assert complete(url, PREFIX + tail(5000))[0] == 200
    assert counts() == (1, 0)                  # nothing cached anywhere: the first in order
    assert complete(url, PREFIX + tail(6000))[0] == 200
    assert counts() == (2, 0)                  # same prefix: the same P (round-robin would say prefill-1)
    assert complete(url, tail(8000, 64))[0] == 200
    assert counts() == (2, 1)                  # unrelated: the other P
    assert complete(url, PREFIX + tail(7000))[0] == 200
    assert counts() == (3, 1)                  # and the prefix still goes where it is
    status = cluster(url)
    assert [instance(status, name)["predicted_blocks"] for name in ("prefill-0", "prefill-1")] == [4, 4]
    if policy == "prefix-affinity":
        assert {k: v for k, v in status["picks"].items() if k.startswith("prefill:")} == {"prefill:miss": 2,
                                                                                         "prefill:hit": 2}


@pytest.mark.parametrize("policy", ["prefix-affinity", "cost"])
def test_kv_events_steer_a_prompt_to_the_prefill_that_reports_its_prefix(harness, policy):
    p0, p1, d = harness.backend("prefill"), harness.backend("prefill"), harness.backend("decode")
    p1.load["kv_events"] = {"last_seq": 1, "reset": True, "snapshot": BLOCK_HASHES, "batches": []}
    url = harness.proxy([p0, p1], [d], policy=policy, poll_interval=POLL)
    assert wait_for(lambda: instance(cluster(url), "prefill-1")["cached_blocks"] == 4)
    assert instance(cluster(url), "prefill-0")["cached_blocks"] == 0

    assert complete(url, PREFIX + tail(5000))[0] == 200
    assert (len(p0.received), len(p1.received)) == (0, 1)
    assert d.received[0].body["kv_transfer_params"]["remote_engine_id"] == p1.url
    if policy == "prefix-affinity":
        assert cluster(url)["picks"]["prefill:hit"] == 1


# --- 3. least load -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["least-load", "prefix-affinity", "cost"])
def test_instances_reporting_long_queues_are_avoided(harness, policy):
    p0, p1 = harness.backend("prefill"), harness.backend("prefill")
    d0, d1 = harness.backend("decode"), harness.backend("decode")
    p0.load["num_prefill_tokens_waiting"] = 100000
    d0.load.update(num_requests_running=40, num_requests_waiting=8)
    url = harness.proxy([p0, p1], [d0, d1], policy=policy, poll_interval=POLL)

    def reported():
        status = cluster(url)
        return (instance(status, "prefill-0")["prefill_tokens_waiting"], instance(status, "decode-0")["in_flight"])
    assert wait_for(lambda: reported() == (100000, 48))

    for i in range(3):
        assert complete(url, tail(100 * i, 40))[0] == 200
    assert (len(p0.received), len(p1.received), len(d0.received), len(d1.received)) == (0, 3, 0, 3)


# --- 4. ejection, re-admission, restarts -------------------------------------------------------------------

def test_an_instance_whose_load_report_fails_is_ejected_then_readmitted(harness):
    a, b = harness.backend("colocated"), harness.backend("colocated")
    a.load_mode = "http500"
    url = harness.proxy(colocated=[a, b], poll_interval=POLL, eject_after=2)

    seen = []

    def ejected():
        entry = instance(cluster(url), "colocated-0")
        seen.append((entry["state"], entry["consecutive_failures"]))
        return entry["state"] == "ejected"
    assert wait_for(ejected)
    assert all((state == "ejected") == (failures >= 2) for state, failures in seen), seen
    status, health = get_json(url, "/health")
    assert status == 200 and health["backends"]["colocated"] == [
        {"name": "colocated-0", "healthy": False, "detail": "/v1/load answered HTTP 500"},
        {"name": "colocated-1", "healthy": True, "detail": "ok"}]
    m = metrics(url)
    assert metric(m, "pdserve:proxy_instance_available", role="colocated", backend="colocated-0") == 0
    assert metric(m, "pdserve:proxy_instance_available", role="colocated", backend="colocated-1") == 1
    assert metric(m, "pdserve:proxy_instance_ejections_total", role="colocated", backend="colocated-0") == 1

    for i in range(2):
        assert complete(url, tail(10 * i, 4))[0] == 200
    assert (len(a.received), len(b.received)) == (0, 2)

    a.load_mode = "ok"
    assert wait_for(lambda: get_json(url, "/health")[1]["backends"]["colocated"][0]["healthy"])
    assert metric(metrics(url), "pdserve:proxy_instance_available", role="colocated", backend="colocated-0") == 1
    for i in range(2):
        assert complete(url, tail(10 * i, 4))[0] == 200
    assert (len(a.received), len(b.received)) == (1, 3)   # both in turn again


def test_a_restarted_instance_loses_its_prefix_entries(harness):
    """A new boot_id: the router forgets the instance's cache and event cursor. Here the new process happens
    to be at the old sequence number, so only the boot_id tells the router its cache is not the old one."""
    p, d = harness.backend("prefill"), harness.backend("decode")
    p.kv_cached, p.kv_seq = BLOCK_HASHES, 1
    url = harness.proxy([p], [d], poll_interval=POLL)
    assert wait_for(lambda: instance(cluster(url), "prefill-0")["cached_blocks"] == 4)

    p.kv_cached = BLOCK_HASHES[:1]
    p.boot_id = "boot-2"
    assert wait_for(lambda: instance(cluster(url), "prefill-0")["cached_blocks"] == 1)
    assert instance(cluster(url), "prefill-0")["state"] == "healthy"


# --- 5. backpressure ---------------------------------------------------------------------------------------

def test_past_max_per_instance_a_request_waits_for_the_one_in_flight(harness):
    c = harness.backend("colocated", "slow_stream")
    url = harness.proxy(colocated=[c], router_config=RouterConfig(max_per_instance=1))
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(complete, url, "first", stream=True)
        assert wait_for(lambda: len(c.received) == 1)
        second = pool.submit(complete, url, "second", stream=True)
        assert wait_for(lambda: cluster(url)["num_queued"] == 1)
        assert len(c.received) == 1
        answers = [first.result(10), second.result(10)]
    for status, _, raw in answers:
        assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
        assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in raw.split(b"\n\n")[:-2]) == "".join(PIECES)
    assert [r.body["prompt"] for r in c.received] == ["first", "second"]
    assert c.received[1].at - c.received[0].at >= 0.44     # the first stream's length: 3 tokens, 0.15 s each
    assert wait_for(lambda: nothing_in_flight(url), 2.0)   # the handler ends just after the answer


def test_a_client_that_gives_up_while_queued_leaves_nothing_behind(harness):
    c = harness.backend("colocated", "slow_stream")
    url = harness.proxy(colocated=[c], router_config=RouterConfig(max_per_instance=1))
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(complete, url, "first", stream=True)
        assert wait_for(lambda: len(c.received) == 1)
        with pytest.raises(OSError):   # urllib's timeout: the client hangs up while its request waits
            post_raw(url, "/v1/completions", {"model": MODEL, "prompt": "second", "stream": True}, timeout=0.2)
        assert wait_for(lambda: cluster(url)["num_queued"] == 0)
        assert first.result(10)[0] == 200
    assert wait_for(lambda: nothing_in_flight(url), 2.0)   # the handler ends just after the answer
    assert [r.body["prompt"] for r in c.received] == ["first"]
    assert metric(metrics(url), "pdserve:proxy_client_disconnects_total") == 1


@pytest.mark.parametrize("limit", ["queue_timeout", "max_queued"])
def test_past_max_per_instance_a_request_that_cannot_wait_gets_503(harness, limit):
    c = harness.backend("colocated", "slow_stream")
    kwargs = {"queue_timeout": 0.2} if limit == "queue_timeout" else {"max_queued": 0}
    url = harness.proxy(colocated=[c], router_config=RouterConfig(max_per_instance=1), **kwargs)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(complete, url, "first", stream=True)
        assert wait_for(lambda: len(c.received) == 1)
        start = time.monotonic()
        status, headers, raw = complete(url, "second", stream=True)
        waited = time.monotonic() - start
        assert first.result(10)[0] == 200
    assert status == 503 and headers["Retry-After"] == "1"
    message = json.loads(raw)["error"]["message"]
    if limit == "queue_timeout":
        assert message == "no instance had room for the request within 0.2 s; retry later"
        assert 0.2 <= waited < 0.4
    else:
        assert message == "every instance is at capacity and 0 requests wait for one; retry later"
        assert waited < 0.3                                  # the first stream alone takes 0.45 s
    assert [r.body["prompt"] for r in c.received] == ["first"]
    assert wait_for(lambda: nothing_in_flight(url), 2.0)   # the handler ends just after the answer
    m = metrics(url)
    assert metric(m, "pdserve:proxy_requests_rejected_total") == 1
    assert metric(m, "pdserve:proxy_requests_queued") == 0


# --- 6. GET /cluster and `pdserve status` ------------------------------------------------------------------

def test_cluster_lists_every_instance_by_name_and_needs_the_api_key(harness):
    p, d = harness.backend("prefill"), harness.backend("decode")
    d.load.update(num_requests_running=3, num_requests_waiting=1)
    url = harness.proxy([p, dead_url()], [d], api_key="sekret", poll_interval=POLL)
    assert get_json(url, "/cluster")[0] == 401
    assert get_json(url, "/cluster", "wrong")[0] == 401
    assert wait_for(lambda: instance(cluster(url, "sekret"), "prefill-1")["state"] == "ejected")
    assert wait_for(lambda: instance(cluster(url, "sekret"), "decode-0")["running"] == 3)
    assert complete(url, "hi", headers={"Authorization": "Bearer sekret"})[0] == 200

    status, body = get_json(url, "/cluster", "sekret")
    assert status == 200 and "127.0.0.1" not in json.dumps(body)
    assert [(i["name"], i["role"], i["state"]) for i in body["instances"]] == [
        ("prefill-0", "prefill", "healthy"), ("prefill-1", "prefill", "ejected"), ("decode-0", "decode", "healthy")]
    for entry in body["instances"]:
        assert {"detail", "in_flight", "running", "waiting", "prefill_tokens_waiting", "kv_usage",
                "blocks_held_for_transfer", "rates", "cached_blocks", "predicted_blocks"} <= entry.keys()
    decode = instance(body, "decode-0")
    assert (decode["running"], decode["waiting"], decode["in_flight"], decode["kv_usage"]) == (3, 1, 4, 0.0)
    assert instance(body, "prefill-1")["detail"] == "is unreachable"
    assert instance(body, "prefill-1")["kv_usage"] is None
    assert body["decisions"] == only_decisions(disaggregated=1)
    assert (body["policy"], body["mode"], body["num_in_flight"], body["num_queued"],
            body["pd_min_prompt_tokens"]) == ("round-robin", "pd", 0, 0, 0)

    text = format_cluster(body)
    lines = text.splitlines()
    assert lines[0] == "policy: round-robin   mode: pd   requests in flight: 0"
    assert lines[1].split()[:3] == ["instance", "role", "state"]
    rows = [line.split() for line in lines if line.split()[0] in ("prefill-0", "prefill-1", "decode-0")]
    assert [row[:3] for row in rows] == [["prefill-0", "prefill", "healthy"], ["prefill-1", "prefill", "ejected"],
                                         ["decode-0", "decode", "healthy"]]
    assert rows[2][4:7] == ["4", "3", "1"]         # in flight, running, waiting (after "sent")
    assert "prefill-1: is unreachable" in lines and "decisions: " + ", ".join(
        f"{r} {1 if r == 'disaggregated' else 0}" for r in sorted(REASONS)) in lines
    assert "127.0.0.1" not in text
    # decode-0 never prefilled: its prefill rate is the router's default, marked so (a new-user check: it
    # read as a measured 4,000 tok/s)
    assert not decode["rates"]["measured"]["prefill_tokens_per_s"]
    assert rows[2][[title for title, _ in COLUMNS].index("prefill tok/s")].endswith("*")   # one cell a column
    assert "* the router's default: not measured on this instance yet" in lines


def test_status_names_the_missing_key_and_ends_quietly_when_its_reader_does(harness, capsys):
    """New-user check (session 50): a 401 said only "Unauthorized", and `pdserve status | head -3` ended
    in a BrokenPipeError traceback."""
    import subprocess
    import sys
    from pdserve.cli import main
    url = harness.proxy([harness.backend("prefill")], [harness.backend("decode")], api_key="sekret")
    assert main(["status", url, "--api-key", ""]) == 1
    assert "the router has a client key: pass --api-key or set $PDSERVE_API_KEY" in capsys.readouterr().err
    assert main(["status", url, "--api-key", "wrong"]) == 1
    assert "the key given is not the router's" in capsys.readouterr().err
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "status", url, "--api-key", "sekret"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()   # gone before a line is written, as `head` is once it has its lines
    assert proc.wait(60) == 0
    assert b"Traceback" not in proc.stderr.read()


# --- 7. start-up checks ------------------------------------------------------------------------------------

@pytest.mark.parametrize("pool,role,needed", [("prefill", "consumer", "producer"), ("decode", "producer", "consumer")])
def test_startup_refuses_an_instance_of_the_wrong_role(harness, pool, role, needed):
    p, d = harness.backend("prefill"), harness.backend("decode")
    wrong = p if pool == "prefill" else d
    wrong.load["kv_role"] = role
    with pytest.raises(StartupError) as caught:
        harness.proxy([p], [d], startup_timeout=2)
    assert str(caught.value) == (f"{wrong.url} was given as --{pool} but is a {role} (--kv-role {role}); a {pool} "
                                 f"instance needs --kv-role {needed} or both")
    assert harness.proxy_app[PROXY_KEY].session.closed    # nothing left open by the failed start


def test_startup_check_passes_and_takes_the_first_reports(harness):
    p, d, c = harness.backend("prefill"), harness.backend("decode"), harness.backend("colocated")
    url = harness.proxy([p], [d], [c], startup_timeout=2, poll_interval=10)
    status = cluster(url)   # the check's reports are applied before the first request
    assert [i["kv_usage"] for i in status["instances"]] == [0.0, 0.0, 0.0]
    assert complete(url, PREFIX)[0] == 200


@pytest.mark.parametrize("failure", ["dead", "hang"])
def test_startup_gives_up_on_a_silent_instance_within_the_timeout(harness, failure):
    d = harness.backend("decode")
    if failure == "dead":
        bad = dead_url()
    else:
        hanging = harness.backend("prefill")
        hanging.load_mode, bad = "hang", hanging.url
    start = time.monotonic()
    with pytest.raises(StartupError) as caught:
        harness.proxy([bad], [d], startup_timeout=0.5)
    assert time.monotonic() - start < 0.9
    assert str(caught.value).startswith(f"{bad} (--prefill) did not answer within 0.5 s: ")
    assert harness.proxy_app[PROXY_KEY].session.closed


def test_cli_proxy_exits_2_naming_an_instance_that_never_answers(capsys):
    dead, dead2 = dead_url(), dead_url()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.monotonic()
    assert cli.main(["proxy", "--prefill", dead, "--decode", dead2, "--startup-timeout", "0.5",
                     "--port", str(port)]) == 2
    assert time.monotonic() - start < 3
    err = capsys.readouterr().err
    assert f"pdserve proxy: {dead} (--prefill) did not answer within 0.5 s: " in err


# --- 8. a failed prefill -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["http500", "http503"])
def test_a_failed_prefill_is_routed_to_the_other_prefill(harness, mode):
    bad, good, d = harness.backend("prefill", mode), harness.backend("prefill"), harness.backend("decode")
    url = harness.proxy([bad, good], [d])
    assert complete(url, PREFIX)[0] == 200
    assert (len(bad.received), len(good.received), len(d.received)) == (1, 1, 1)
    assert d.received[0].body["kv_transfer_params"] == good.kv_transfer_params
    m = metrics(url)
    assert metric(m, "pdserve:proxy_prefill_retries_total") == 1
    assert decisions(url) == only_decisions(disaggregated=2)   # each routing counts: the first and the retry


@pytest.mark.parametrize("mode", ["http500", "http503"])
def test_a_failed_only_prefill_sends_the_request_straight_to_decode(harness, mode):
    """Even to a D without prefill headroom (2.5 s of prompts queued): with a P merely at a cap that D would
    be spared, but every P has failed this request, and serving slower beats not serving."""
    p, d = harness.backend("prefill", mode), harness.backend("decode")
    d.load["num_prefill_tokens_waiting"] = 10000
    url = harness.proxy([p], [d], poll_interval=POLL, queue_timeout=0.3)
    assert wait_for(lambda: instance(cluster(url), "decode-0")["prefill_tokens_waiting"] == 10000)
    status, _, raw = complete(url, PREFIX)
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == "".join(PIECES)
    assert len(p.received) == 1 and len(d.received) == 1 and "kv_transfer_params" not in d.received[0].body
    assert metric(metrics(url), "pdserve:proxy_prefill_retries_total") == 1
    assert decisions(url) == only_decisions(disaggregated=1, prefill_saturated=1)


def test_a_snapshot_larger_than_one_read_arrives_whole(harness):
    """A large cache's snapshot comes in many chunks; the monitor read only the first once, so the report
    was not JSON, the poll failed, and the instance was ejected."""
    c = harness.backend("colocated")
    c.kv_cached = list(range(1, 200_001))     # ~1.4 MB of JSON
    c.kv_seq = 7
    url = harness.proxy(colocated=[c], poll_interval=0.05)
    assert wait_for(lambda: instance(cluster(url), "colocated-0")["cached_blocks"] == 200_000, timeout=10)
    assert instance(cluster(url), "colocated-0")["state"] == "healthy"


def test_an_unexpected_error_in_one_poll_does_not_stop_the_monitor(harness):
    c1, c2 = harness.backend("colocated"), harness.backend("colocated")
    url = harness.proxy(colocated=[c1, c2], poll_interval=0.05)
    proxy = harness.proxy_app[PROXY_KEY]
    first = proxy.router.instances[0]
    real_update, calls = first.update, []

    def broken_once(report, now):
        calls.append(now)
        if len(calls) == 1:
            raise RuntimeError("a bug in reading the report")
        return real_update(report, now)

    first.update = broken_once
    polls = c2.num_polls
    assert wait_for(lambda: len(calls) >= 3 and c2.num_polls >= polls + 3)   # both go on being polled
    assert instance(cluster(url), "colocated-0")["state"] == "healthy"


def test_an_instance_whose_load_report_hangs_does_not_slow_the_others_polls(harness):
    """A hostile test: one hung GET /v1/load made every poll round last the poll timeout (2 s), so the
    healthy instance was polled 5 times in 10 s instead of ~100, and a dead one took 6 s to eject."""
    hung, healthy = harness.backend("colocated"), harness.backend("colocated")
    hung.load_mode = "hang"
    harness.proxy(colocated=[hung, healthy], poll_interval=POLL)
    time.sleep(0.3)
    before = healthy.num_polls
    time.sleep(1.0)
    assert healthy.num_polls - before >= 8      # ~20 at one poll per 50 ms; before the fix 0 or 1
    assert hung.num_polls <= 2                  # its poll still in flight: not asked again meanwhile


def test_an_instance_at_capacity_is_not_asked_again_until_its_retry_after(harness):
    """A hostile test: with one instance answering 503 forever, two waiting requests woke each other at
    every hop's end and sent it ~1,300 requests a second. Now its Retry-After (capped at 2 s) holds new
    hops back, for every waiting request at once."""
    full = harness.backend("colocated", "http503")   # Retry-After: 7, held 2 s
    url = harness.proxy(colocated=[full], poll_interval=POLL, queue_timeout=1.0, eject_after=NEVER_EJECT)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: complete(url, tail(i)), range(8)))
    # A 503 with Retry-After each: the instance's own (it was asked) or the router's (it came after the
    # instance was marked full, waited in the router's queue and timed out there).
    assert all(status == 503 and headers["Retry-After"] in ("7", "1") for status, headers, _ in answers)
    assert 1 <= len(full.received) <= 8          # at most once each, then held past the queue timeout


# --- 9. the push handoff -----------------------------------------------------------------------------------

def push(backend, port: int):
    backend.load["kv_connector"] = {"name": "nixl-push", "engine_id": backend.url, "host": "127.0.0.1",
                                    "port": port, "boot_id": f"boot-{port}"}
    return backend


@pytest.mark.parametrize("stream", [False, True])
def test_push_sends_prefill_and_decode_at_once_with_one_transfer_id(harness, stream):
    p, d = push(harness.backend("prefill", "slow_0.5s"), 7001), push(harness.backend("decode"), 7002)
    url = harness.proxy([p], [d], startup_timeout=2)
    status, _, raw = complete(url, PREFIX, stream=stream)
    assert status == 200 and (b"[DONE]" in raw) == stream
    [p_hop], [d_hop] = p.received, d.received
    assert abs(d_hop.at - p_hop.at) < 0.3  # D did not wait for P's answer (P took 0.5 s to give it)
    transfer_id = p_hop.body["kv_transfer_params"]["transfer_id"]
    assert d_hop.body["kv_transfer_params"] == {
        "do_remote_prefill": True, "transfer_id": transfer_id, "remote_engine_id": p.url,
        "remote_request_id": transfer_id, "remote_host": "127.0.0.1", "remote_port": 7001, "remote_boot_id": "boot-7001"}
    assert p.problems == d.problems == [] and not p.releases and not d.releases
    assert cluster(url)["decisions"]["disaggregated"] == 1


def test_push_prefill_failure_releases_the_transfer_on_decode(harness):
    p, d = push(harness.backend("prefill", "http500"), 7011), push(harness.backend("decode", "slow_0.5s"), 7012)
    url = harness.proxy([p], [d], startup_timeout=2)
    status, _, _ = complete(url, PREFIX)
    assert status == 200   # D's answer (a pdserve D would fail the load, or recompute, on the release)
    transfer_id = p.received[0].body["kv_transfer_params"]["transfer_id"]
    assert d.releases == [{"kv_transfer_params": {"remote_engine_id": d.url, "remote_request_id": transfer_id}}]
    assert not p.releases


def test_push_decode_never_taking_it_releases_the_transfer_on_prefill(harness):
    p, d = push(harness.backend("prefill"), 7021), push(harness.backend("decode", "http500"), 7022)
    url = harness.proxy([p], [d], startup_timeout=2, max_recoveries=0)
    status, _, _ = complete(url, PREFIX)
    assert status == 502
    transfer_id = p.received[0].body["kv_transfer_params"]["transfer_id"]
    assert wait_for(lambda: p.releases == [{"kv_transfer_params": {"remote_engine_id": p.url,
                                                                    "remote_request_id": transfer_id}}])


def test_startup_refuses_push_and_pull_instances_together(harness):
    p, d = push(harness.backend("prefill"), 7031), harness.backend("decode")
    d.load["kv_connector"] = {"name": "nixl", "engine_id": "d", "host": "127.0.0.1", "port": 7032, "boot_id": "b"}
    with pytest.raises(StartupError) as caught:
        harness.proxy([p], [d], startup_timeout=2)
    assert str(caught.value) == (f"{p.url} (--prefill) hands its KV over by push but {d.url} (--decode) by pull: "
                                 f"every prefill and decode instance needs the same handoff (--kv-connector nixl "
                                 f"or cuda_ipc: pull; nixl-push: push; store)")


def test_startup_refuses_store_and_pull_instances_together(harness):
    """A pull D given a store P's answer would try to READ from the store's address as if it were P."""
    p, d = harness.backend("prefill"), harness.backend("decode")
    p.load["kv_connector"] = {"name": "store", "engine_id": "p", "host": "127.0.0.1", "port": 7041, "boot_id": "b"}
    d.load["kv_connector"] = {"name": "nixl", "engine_id": "d", "host": "127.0.0.1", "port": 7042, "boot_id": "b"}
    with pytest.raises(StartupError, match=r"\(--prefill\) hands its KV over by store but .* \(--decode\) by pull"):
        harness.proxy([p], [d], startup_timeout=2)


def test_startup_refuses_tensor_parallel_sizes_that_cannot_pair(harness):
    """Before, a P of 2 ranks and a D of 3 started, and every request was prefilled, then refused at the
    handshake (review, 2026-12-04)."""
    p, d, d2 = harness.backend("prefill"), harness.backend("decode"), harness.backend("decode")
    for backend, name, tp, port in ((p, "p", 2, 7051), (d, "d", 3, 7052), (d2, "d2", 1, 7053)):
        backend.load["kv_connector"] = {"name": "nixl", "engine_id": name, "host": "127.0.0.1", "port": port,
                                        "boot_id": "b", "tp_size": tp}
    with pytest.raises(StartupError, match=r"\(--prefill\) has 2 tensor-parallel ranks and .* \(--decode\) 3"):
        harness.proxy([p], [d, d2], startup_timeout=2)
    harness.proxy([p], [d2], startup_timeout=2)   # 2 and 1 pair


def wait_for(predicate, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_startup_pairs_push_instances_of_sizes_of_which_one_divides_the_other(harness):
    """A push writes each P rank's heads into the D ranks holding them, between sizes too (session 48): sizes 2
    and 1 pair, 2 and 3 do not."""
    p, d, d2 = harness.backend("prefill"), harness.backend("decode"), harness.backend("decode")
    for backend, name, tp, port in ((p, "p", 2, 7061), (d, "d", 1, 7062), (d2, "d2", 3, 7063)):
        backend.load["kv_connector"] = {"name": "nixl-push", "engine_id": name, "host": "127.0.0.1", "port": port,
                                        "boot_id": "b", "tp_size": tp}
    with pytest.raises(StartupError, match=r"\(--prefill\) has 2 tensor-parallel ranks and .* \(--decode\) 3: "
                                           r"of the two sizes one must divide the other"):
        harness.proxy([p], [d, d2], startup_timeout=2)
    harness.proxy([p], [d], startup_timeout=2)


def test_startup_pairs_store_instances_of_any_sizes(harness):
    """The store's pool holds the whole model's layout, which every size reads and writes (session 49)."""
    p, d = harness.backend("prefill"), harness.backend("decode")
    for backend, name, tp, port in ((p, "p", 2, 7064), (d, "d", 3, 7065)):
        backend.load["kv_connector"] = {"name": "store", "engine_id": name, "host": "127.0.0.1", "port": port,
                                        "boot_id": "b", "tp_size": tp}
    harness.proxy([p], [d], startup_timeout=2)


def test_a_prompt_no_instance_would_take_is_refused_before_the_router_tokenizes_or_hashes_it(harness):
    """Before, the router tokenized a 30 MB prompt for a minute (its memory at 8 GB) or hashed 15 M token ids
    on its event loop (every request stalled 3 s), and only then did the instance answer 413 (hostile
    review, session 47). The instances' limits come with their load reports."""
    p, d = harness.backend("prefill"), harness.backend("decode")
    for backend in (p, d):
        backend.load.update(max_model_len=64, max_prompt_chars=2048)
    url = harness.proxy([p], [d], startup_timeout=2)
    status, _, raw = complete(url, list(range(1, 65)))
    assert status == 400 and "64 tokens; this model's maximum context length is 64 tokens" in raw.decode()
    status, _, raw = complete(url, "x" * 2049)
    assert status == 400 and "2049 characters, more than the instances take (2048" in raw.decode()
    status, _, raw = post_raw(url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": "y" * 3000}]})
    assert status == 400 and json.loads(raw)["error"]["param"] == "messages"
    assert not p.received and not d.received
    assert complete(url, list(range(1, 60)))[0] == 200   # within the limits: served


def test_a_limit_some_instance_has_not_reported_is_not_checked(harness):
    """An instance that has not said (an older pdserve, another server) may take a longer prompt."""
    p, d, other = harness.backend("prefill"), harness.backend("decode"), harness.backend("decode")
    for backend in (p, d):
        backend.load.update(max_model_len=64, max_prompt_chars=2048)
    other.load.update(max_model_len=64)
    url = harness.proxy([p], [d, other], startup_timeout=2)
    assert complete(url, "x" * 2049)[0] == 200
    assert complete(url, list(range(1, 65)))[0] == 400   # every instance said 64 tokens
