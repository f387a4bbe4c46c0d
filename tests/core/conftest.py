import pytest

from tests.core import helpers


@pytest.fixture(autouse=True, params=["sync", "async"])
def scheduling_mode(request, monkeypatch):
    """Every core test runs with the synchronous engine loop and with async scheduling (step N+1
    scheduled before step N's outputs land): the outputs and the no-leak checks must not change."""
    monkeypatch.setattr(helpers, "ASYNC_SCHEDULING", request.param == "async")
    return request.param
