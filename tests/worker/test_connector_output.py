"""The worker half's per-step report (worker/model_runner.connector_output): P's first tokens pass only inside
the vocabulary (a token outside it would fail the step that computes it), for loaded requests and for those
still loading (push sends P's token ahead of the KV; the scheduler decides what to do with each)."""
from pdserve.kv_transfer.base import KVConnectorWorker
from pdserve.worker.model_runner import connector_output


class Reporting(KVConnectorWorker):
    def __init__(self, recving, tokens):
        self.recving, self.tokens = recving, tokens

    def register_kv_caches(self, kv_caches):
        pass

    def start_load_kv(self, meta):
        pass

    def get_finished(self):
        return set(), set(self.recving)

    def get_first_token_ids(self):
        return self.tokens


def test_first_tokens_pass_inside_the_vocabulary():
    out = connector_output(Reporting({"a", "b", "c"}, {"a": [5], "b": [100], "c": [-1], "loading": [3]}), 100)
    assert out.finished_recving == {"a", "b", "c"}
    assert out.first_token_ids == {"a": [5], "loading": [3]}


def test_a_connector_without_first_tokens_reports_none():
    class Plain(Reporting):
        get_first_token_ids = KVConnectorWorker.get_first_token_ids
    assert connector_output(Plain({"a"}, {}), 100).first_token_ids == {}
