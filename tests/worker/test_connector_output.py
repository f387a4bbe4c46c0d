"""The worker half's per-step report (worker/model_runner.connector_output): P's first tokens pass only for
requests reported loaded in the same step, and only inside the vocabulary (a token outside it would fail the
step that computes it)."""
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


def test_first_tokens_pass_for_loaded_requests_inside_the_vocabulary():
    out = connector_output(Reporting({"a", "b", "c"}, {"a": [5], "b": [100], "c": [-1], "gone": [3]}), 100)
    assert out.finished_recving == {"a", "b", "c"}
    assert out.first_token_ids == {"a": [5]}


def test_a_connector_without_first_tokens_reports_none():
    class Plain(Reporting):
        get_first_token_ids = KVConnectorWorker.get_first_token_ids
    assert connector_output(Plain({"a"}, {}), 100).first_token_ids == {}
