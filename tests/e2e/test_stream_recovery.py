"""Stream recovery with real processes: 1P2D over NIXL behind the proxy; the D serving two streams (one
greedy chat, one seeded completion) is killed with SIGKILL after a few tokens of each. The proxy resumes
both on the other D and each client reads one ordinary stream whose whole output equals an uninterrupted
run's on a colocated instance (the surviving D, asked directly)."""
from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request

import pytest

from tests.e2e.cluster import ROUTER_KEY, Process, serve, wait_until

KV = '{"lease_seconds": 4, "heartbeat_seconds": 1}'
# The greedy stream must still be running once the seeded one (started after a short request) has three
# tokens out: at 64 tokens a fast core finished it first (CI, 2026-12-03), so it is given four times that.
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Tell me about the history of Paris."}],
        "max_tokens": 256, "temperature": 0, "ignore_eos": True}
SEEDED = {"model": "default", "prompt": "Once upon a time, in a small village by the sea,", "max_tokens": 64,
          "temperature": 0.9, "top_p": 0.95, "seed": 4321, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster():
    started: list[Process] = []
    try:
        prefill = serve("rec-prefill", "--kv-connector", "nixl", "--kv-role", "producer",
                        "--engine-id", "rec-prefill", "--kv-transfer-config", KV)
        decodes = [serve(f"rec-decode-{i}", "--kv-connector", "nixl", "--kv-role", "consumer",
                         "--engine-id", f"rec-decode-{i}", "--kv-transfer-config", KV) for i in range(2)]
        started += [prefill, *decodes]
        for p in started:
            p.wait_healthy()
        # round-robin, not the default cost: the test kills the D it knows two streams are on
        proxy = Process(["proxy", "--policy", "round-robin", "--prefill", prefill.url,
                         "--decode", *(d.url for d in decodes)], "rec-proxy",
                        env={"PDSERVE_ROUTER_KEY": ROUTER_KEY})
        started.append(proxy)
        proxy.wait_healthy(60)
        yield {"prefill": prefill, "decodes": decodes, "proxy": proxy}
    finally:
        for p in reversed(started):
            p.stop()


class Stream(threading.Thread):
    """One streamed request through the proxy, read on its own thread: its events as they come."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.path = url, path
        self.body = dict(body, stream=True, stream_options={"include_usage": True})
        self.events: list = []
        self.error: BaseException | None = None

    def run(self) -> None:
        request = urllib.request.Request(self.url + self.path, data=json.dumps(self.body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as resp:
                for line in resp:
                    line = line.strip()
                    if line.startswith(b"data: "):
                        data = line[6:]
                        self.events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    @property
    def num_content_events(self) -> int:
        return sum(1 for e in list(self.events) if isinstance(e, dict) and e.get("choices")
                   and (e["choices"][0].get("text") or e["choices"][0].get("delta", {}).get("content")))

    def text(self) -> str:
        choices = [e["choices"][0] for e in self.events[:-1] if e.get("choices")]
        return "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in choices)


def children_of(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def test_a_decode_killed_mid_stream_is_resumed_on_the_other_with_identical_output(cluster):
    proxy, (victim, survivor) = cluster["proxy"], cluster["decodes"]
    # Round-robin over the Ds: the 1st and 3rd streams go to decode-0, the 2nd (a short one) to decode-1.
    greedy = Stream(proxy.url, "/v1/chat/completions", CHAT)
    greedy.start()
    assert wait_until(lambda: greedy.num_content_events >= 1 or greedy.error, timeout=60) and not greedy.error
    assert proxy.post("/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": 1})[0] == 200
    seeded = Stream(proxy.url, "/v1/completions", SEEDED)
    seeded.start()
    assert wait_until(lambda: seeded.num_content_events >= 3 or seeded.error, timeout=60) and not seeded.error
    assert greedy.num_content_events >= 3 and "[DONE]" not in greedy.events and "[DONE]" not in seeded.events
    engine_pids = children_of(victim.proc.pid)
    os.kill(victim.proc.pid, signal.SIGKILL)   # mid-stream, both streams
    streamed_before = (greedy.num_content_events, seeded.num_content_events)
    try:
        greedy.join(120)
        seeded.join(120)
    finally:
        for pid in engine_pids:   # the engine process ends with its server (its pipe closes); make sure
            if wait_until(lambda: not os.path.exists(f"/proc/{pid}"), timeout=10) is False:
                os.kill(pid, signal.SIGKILL)
    assert greedy.error is None and seeded.error is None
    # the kill landed before either stream ended
    assert streamed_before[0] < CHAT["max_tokens"] and streamed_before[1] < SEEDED["max_tokens"]

    for stream, path, body in ((greedy, "/v1/chat/completions", CHAT), (seeded, "/v1/completions", SEEDED)):
        events = stream.events
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert not any("error" in e for e in events[:-1]), events
        assert len({(e["id"], e["created"], e["model"]) for e in events[:-1]}) == 1
        assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]].count("length") == 1
        assert not any("token_ids" in e or "router_token_ids" in e for e in events[:-1])
        status, want = survivor.post(path, body)   # uninterrupted, on one (colocated) instance
        assert status == 200
        want_text = want["choices"][0]["message"]["content"] if "chat" in path else want["choices"][0]["text"]
        assert stream.text() == want_text, path
        usage = events[-2]["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (want["usage"]["prompt_tokens"],
                                                                      body["max_tokens"])
    metrics = proxy.metrics()
    assert metrics["proxy_recoveries_total"] == 2 and metrics["proxy_request_errors_total"] == 0
    # the survivor and P end idle
    assert wait_until(lambda: all(p.metrics().get("num_requests_running") == 0
                                  and p.metrics().get("kv_cache_usage_perc") == 0
                                  for p in (survivor, cluster["prefill"])), timeout=15)
