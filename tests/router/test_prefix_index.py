"""PrefixIndex: events (reset, batches, replays, gaps), predictions and their expiry, match, forget, purge;
and a property test against a simulated instance whose answers get lost, reordered and replayed."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.router.prefix_index import PREDICTION_TTL_S, PrefixIndex, parse_kv_events


def reset(snapshot, last_seq, batches=()):
    return {"last_seq": last_seq, "reset": True, "snapshot": list(snapshot), "batches": [list(b) for b in batches]}


def events(last_seq, batches):
    return {"last_seq": last_seq, "reset": False, "snapshot": None, "batches": [list(b) for b in batches]}


def test_reset_loads_the_snapshot_and_batches_continue_from_it():
    index = PrefixIndex()
    assert index.last_seq("p0") is None
    assert index.apply_report("p0", reset([1, 2, 3], 7), now=0.0) == 7
    assert index.confirmed("p0") == {1, 2, 3}
    assert index.apply_report("p0", events(9, [(8, "stored", [4]), (9, "removed", [1])]), now=0.0) == 9
    assert index.confirmed("p0") == {2, 3, 4}
    assert index.last_seq("p0") == 9


def test_replayed_batches_are_skipped():
    index = PrefixIndex()
    index.apply_report("p0", reset([1], 2), 0.0)
    index.apply_report("p0", events(3, [(3, "removed", [1])]), 0.0)
    # the same answer again, and an older one: nothing changes (a replayed "stored" would resurrect 1)
    index.apply_report("p0", events(3, [(3, "removed", [1])]), 0.0)
    assert index.apply_report("p0", events(2, [(2, "stored", [1])]), 0.0) == 3
    assert index.confirmed("p0") == set()


def test_a_gap_leaves_sync_so_the_next_poll_asks_for_a_reset():
    index = PrefixIndex()
    index.apply_report("p0", reset([1], 2), 0.0)
    assert index.apply_report("p0", events(5, [(3, "stored", [2]), (5, "stored", [3])]), 0.0) is None
    assert index.last_seq("p0") is None
    assert 2 in index.confirmed("p0")     # kept as a hint until the reset
    # out of sync, plain batches are ignored: they continue a state the index does not have
    assert index.apply_report("p0", events(6, [(6, "stored", [9])]), 0.0) is None
    assert 9 not in index.confirmed("p0")
    assert index.apply_report("p0", reset([3, 9], 6), 0.0) == 6
    assert index.confirmed("p0") == {3, 9}


def test_batches_missing_at_the_end_are_asked_for_again():
    index = PrefixIndex()
    index.apply_report("p0", reset([], 0), 0.0)
    assert index.apply_report("p0", events(3, [(1, "stored", [1])]), 0.0) == 1
    # ... but a snapshot whose batches stop short of its last_seq is no known state
    assert index.apply_report("p0", reset([1, 2], 5, [(4, "stored", [2])]), 0.0) is None


def test_an_older_reset_overtaken_by_newer_events_is_ignored():
    index = PrefixIndex()
    index.apply_report("p0", reset([1], 2), 0.0)
    index.apply_report("p0", events(4, [(3, "stored", [2]), (4, "removed", [1])]), 0.0)
    assert index.apply_report("p0", reset([1], 2), 0.0) == 4
    assert index.confirmed("p0") == {2}


def test_a_reset_with_batches_applies_them_on_the_snapshot():
    index = PrefixIndex()
    # the snapshot is the state at last_seq 5; batches 4 and 5 come along: applying them again is harmless
    assert index.apply_report("p0", reset([1, 3], 5, [(4, "removed", [2]), (5, "stored", [3])]), 0.0) == 5
    assert index.confirmed("p0") == {1, 3}


@pytest.mark.parametrize("bad", [
    None, [], {"reset": "yes"}, {"reset": True, "snapshot": ["x"]}, {"last_seq": 1.5},
    {"reset": False, "last_seq": 3, "batches": [[3, "evicted", [1]]]},
    {"reset": False, "last_seq": 3, "batches": [[3, "stored"]]},
    {"reset": False, "last_seq": 3, "batches": [[True, "stored", [1]]]},
])
def test_a_malformed_object_applies_nothing_and_leaves_sync(bad):
    index = PrefixIndex()
    index.apply_report("p0", reset([1], 2), 0.0)
    with pytest.raises(ValueError):
        parse_kv_events(bad)
    assert index.apply_report("p0", bad, 0.0) is None
    assert index.last_seq("p0") is None
    assert index.confirmed("p0") == {1}


def test_match_counts_leading_blocks_per_instance():
    index = PrefixIndex()
    index.apply_report("a", reset([10, 11, 12], 1), 0.0)
    index.apply_report("b", reset([10, 12, 13], 1), 0.0)   # lacks 11: only the first block counts
    index.apply_report("c", reset([11, 12], 1), 0.0)       # lacks the first: nothing
    assert index.match([10, 11, 12, 13], now=0.0) == {"a": 3, "b": 1}
    assert index.match([10, 11, 12, 13], names=["b", "c"], now=0.0) == {"b": 1}
    assert index.match([], now=0.0) == {}
    assert index.match([99, 10], now=0.0) == {}
    assert index.match([10, 11], names=["never-seen"], now=0.0) == {}


def test_match_on_a_long_prompt_over_many_instances():
    index = PrefixIndex()
    prompt = list(range(1000, 3000))     # 2,000 blocks
    for i in range(300):
        index.apply_report(f"d{i}", reset(prompt[: i * 5], 1), 0.0)
    counts = index.match(prompt, now=0.0)
    assert counts == {f"d{i}": i * 5 for i in range(1, 300)}


def test_a_prediction_matches_until_it_expires():
    index = PrefixIndex(prediction_ttl_s=30.0)
    index.predict("p0", [1, 2], now=100.0)
    assert index.match([1, 2, 3], now=129.9) == {"p0": 2}
    assert index.match([1, 2, 3], now=130.0) == {}
    index.predict("p0", [1], now=100.0)
    index.predict("p0", [1], now=120.0)       # renewed
    assert index.match([1], now=140.0) == {"p0": 1}


def test_a_stored_event_confirms_a_prediction_and_a_removed_one_drops_it():
    index = PrefixIndex(prediction_ttl_s=30.0)
    index.apply_report("p0", reset([], 0), 0.0)
    index.predict("p0", [1, 2], now=0.0)
    index.apply_report("p0", events(1, [(1, "stored", [1])]), 1.0)
    assert index.num_predicted("p0") == 1
    assert index.match([1, 2], now=10.0) == {"p0": 2}
    assert index.match([1, 2], now=100.0) == {"p0": 1}   # 1 confirmed, 2's prediction expired
    index.predict("p0", [3], now=100.0)
    index.apply_report("p0", events(2, [(2, "removed", [3])]), 101.0)
    assert index.match([3], now=101.0) == {}


def test_a_reset_and_forget_drop_predictions():
    index = PrefixIndex()
    index.apply_report("p0", reset([1], 1), 0.0)
    index.predict("p0", [2], now=0.0)
    index.apply_report("p0", reset([1], 1), 0.0)
    assert index.match([2], now=0.0) == {}
    index.predict("p0", [2], now=0.0)
    index.forget("p0")
    assert index.match([1], now=0.0) == {} and index.match([2], now=0.0) == {}
    assert index.last_seq("p0") is None


def test_purge_keeps_memory_bounded_by_live_predictions():
    index = PrefixIndex(prediction_ttl_s=10.0)
    for t in range(1000):                     # the same prompt predicted 1,000 times: one entry per block
        index.predict("p0", [1, 2, 3], now=float(t) * 0.01)
    assert len(index._expiries) == 3
    for t in range(100):                      # a new prompt every second over 100 s
        index.predict("p0", [1000 + t], now=20.0 + t)
    index.purge(200.0)
    assert index.num_predicted("p0") == 0 and not index._expiries and not index._predicted


def test_purge_keeps_renewed_predictions():
    index = PrefixIndex(prediction_ttl_s=30.0)
    index.predict("p0", [1, 2], now=0.0)
    index.predict("p0", [1], now=20.0)
    assert index.purge(35.0) == 1              # 2 expired at 30; 1 lives until 50
    assert index.match([1], now=35.0) == {"p0": 1}
    assert index.purge(50.0) == 1 and index.num_predicted("p0") == 0


def test_predicting_a_confirmed_block_adds_nothing():
    index = PrefixIndex()
    index.apply_report("p0", reset([1], 1), 0.0)
    index.predict("p0", [1], now=0.0)
    assert index.num_predicted("p0") == 0


# --- property: a simulated instance, its answers lost, reordered and replayed ------------------------------

UNIVERSE = range(12)
BUFFER = 5            # batches the instance keeps; an older events_after gets a reset
TTL = 10.0

# one or more batches between two polls
event_ops = st.tuples(st.just("events"), st.lists(st.tuples(st.sampled_from(["stored", "removed"]),
                                                            st.lists(st.sampled_from(UNIVERSE), min_size=1,
                                                                     max_size=4)), min_size=1, max_size=4))
poll_ops = st.tuples(st.just("poll"), st.sampled_from(["clean", "clean", "lose", "shuffle", "duplicate", "drop",
                                                       "stale", "replay", "reset_with_batches"]))
op_kinds = {"events": event_ops, "poll": poll_ops,
            "predict": st.tuples(st.just("predict"), st.lists(st.sampled_from(UNIVERSE), max_size=4)),
            "advance": st.tuples(st.just("advance"), st.floats(0.0, 15.0)), "restart": st.tuples(st.just("restart"))}
# Events and polls most of the time; a restart rarely, else the index would seldom get past its first reset.
ops = st.sampled_from(["events"] * 8 + ["poll"] * 8 + ["predict"] * 3 + ["advance"] * 3 + ["restart"]).flatmap(
    op_kinds.__getitem__)


class SimulatedInstance:
    def __init__(self) -> None:
        self.seq, self.cached, self.log, self.states = 0, set(), [], {0: frozenset()}

    def event(self, kind, hashes) -> None:
        hashes = [h for h in dict.fromkeys(hashes) if (h in self.cached) == (kind == "removed")]
        if not hashes:
            return
        self.seq += 1
        self.cached = self.cached | set(hashes) if kind == "stored" else self.cached - set(hashes)
        self.log.append([self.seq, kind, hashes])
        self.states[self.seq] = frozenset(self.cached)

    def answer(self, events_after, with_batches: int = 0) -> dict:
        """As GET /v1/load?events_after=...: batches after it, or a reset when it is absent, too old or new."""
        oldest = self.seq - len(self.log[-BUFFER:])
        if events_after is None or events_after < oldest or events_after > self.seq:
            tail = self.log[-with_batches:] if with_batches else []
            return reset(self.cached, self.seq, tail)
        return events(self.seq, [b for b in self.log if b[0] > events_after])


@settings(max_examples=200, deadline=None)
@given(st.lists(ops, min_size=20, max_size=60), st.randoms(use_true_random=False))
def test_the_index_tracks_an_instance_through_lost_reordered_and_replayed_answers(steps, rng):
    index, inst, now = PrefixIndex(prediction_ttl_s=TTL), SimulatedInstance(), 0.0
    saved = []                      # answers sent earlier: delivered again later (stale, reordered)
    predicted_at = {}               # hash → when last predicted since the last reset the index applied
    for step in steps:
        if step[0] == "events":
            for kind, hashes in step[1]:
                inst.event(kind, hashes)
        elif step[0] == "predict":
            index.predict("p0", step[1], now)
            predicted_at.update(dict.fromkeys(step[1], now))
        elif step[0] == "advance":
            now += step[1]
        elif step[0] == "restart":   # a new boot: the poller forgets the old one and drops its answers
            inst, saved = SimulatedInstance(), []
            index.forget("p0")
            predicted_at.clear()
        else:
            mode = step[1]
            answer = inst.answer(index.last_seq("p0"), with_batches=2 if mode == "reset_with_batches" else 0)
            saved.append(answer)
            if mode == "drop":
                continue
            if mode == "stale":
                answer = rng.choice(saved)
            elif mode == "lose" and answer["batches"]:
                lost = rng.randrange(len(answer["batches"]))
                answer = dict(answer, batches=answer["batches"][:lost] + answer["batches"][lost + 1:])
            elif mode == "shuffle":
                answer = dict(answer, batches=rng.sample(answer["batches"], len(answer["batches"])))
            elif mode == "duplicate":
                answer = dict(answer, batches=answer["batches"] + answer["batches"])
            index.apply_report("p0", answer, now)
            if mode == "replay" and len(saved) >= 2:   # the previous answer comes again, after this one
                index.apply_report("p0", saved[-2], now)
            applied_reset = answer["reset"] and index.last_seq("p0") == answer["last_seq"]
            if applied_reset:
                predicted_at.clear()
                # Right after a reset: exactly the instance's set at that point, no older prediction left.
                held = {h for h in UNIVERSE if index.holds("p0", h, now)}
                assert held == inst.states[answer["last_seq"]]
            if mode in ("clean", "shuffle", "duplicate", "replay", "reset_with_batches"):
                assert index.last_seq("p0") == inst.seq, "an intact answer brings the index in sync"
        last = index.last_seq("p0")
        if last is not None:
            # In sync at seq L: the confirmed entries are the instance's true set at L.
            assert index.confirmed("p0") == inst.states[last]
        for h in UNIVERSE:
            if index.holds("p0", h, now) and h not in index.confirmed("p0"):
                assert h in predicted_at and now < predicted_at[h] + TTL, (h, now, predicted_at)
    # Predictions expire: past the TTL only confirmed entries remain, and purge frees them all.
    later = now + TTL
    assert {h for h in UNIVERSE if index.holds("p0", h, later)} == set(index.confirmed("p0"))
    index.purge(later)
    assert index.num_predicted("p0") == 0


def test_the_simulation_resyncs_after_losses():
    rng = random.Random(0)
    index, inst = PrefixIndex(), SimulatedInstance()
    for _ in range(200):
        inst.event(rng.choice(["stored", "removed"]), rng.sample(UNIVERSE, 3))
        answer = inst.answer(index.last_seq("p0"))
        if answer["batches"] and rng.random() < 0.3:
            answer = dict(answer, batches=answer["batches"][1:])
        index.apply_report("p0", answer, 0.0)
        index.apply_report("p0", inst.answer(index.last_seq("p0")), 0.0)   # the next poll heals it
        assert index.last_seq("p0") == inst.seq
        assert index.confirmed("p0") == inst.cached


def test_default_ttl_is_documented_value():
    assert PREDICTION_TTL_S == 30.0
