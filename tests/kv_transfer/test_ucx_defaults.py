"""new_agent: pdserve's UCX settings apply where the environment is silent, and never over a user's."""
import os

import pytest
import torch

from pdserve.kv_transfer import nixl


@pytest.mark.skipif(nixl.nixl_agent is None, reason="nixl is not installed")
def test_new_agent_fills_in_ucx_defaults_without_overriding_the_environment(monkeypatch):
    for key in nixl.UCX_DEFAULTS:
        monkeypatch.setenv(key, "x")      # (recorded, so that what new_agent sets is undone after the test)
        monkeypatch.delenv(key)
    monkeypatch.setenv("UCX_TCP_TX_SEG_SIZE", "64kb")   # the user's choice stands
    agent = nixl.new_agent("ucx-defaults-test", False, "test")
    assert agent.get_agent_metadata()
    assert os.environ["UCX_TCP_TX_SEG_SIZE"] == "64kb"
    # a CUDA transport's setting only where CUDA is (UCX warns of a variable nothing reads)
    assert os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY") == ("y" if torch.cuda.is_available() else None)
    assert "UCX_TCP_RX_SEG_SIZE" not in os.environ     # the two are set together, or not at all


def test_new_agent_names_the_caller_when_nixl_is_missing(monkeypatch):
    monkeypatch.setattr(nixl, "nixl_agent", None)
    with pytest.raises(ImportError, match="kv_connector store: neither nixl nor nixl_cu13"):
        nixl.new_agent("x", False, "kv_connector store")


@pytest.mark.skipif(nixl.nixl_agent is None, reason="nixl is not installed")
def test_a_receive_segment_set_alone_is_not_undercut_by_a_default_send_segment(monkeypatch):
    """Before, the send segment defaulted to 1 MiB beside a user's 64 KiB receive segment: UCX refuses a send
    segment larger than the receive one, and the agent did not start."""
    for key in nixl.UCX_DEFAULTS:
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "64kb")
    assert nixl.new_agent("ucx-rx-only-test", False, "test").get_agent_metadata()
    assert "UCX_TCP_TX_SEG_SIZE" not in os.environ
    assert nixl.ucx_tcp_segments() == "ucx-default/64kb"
