"""`pdserve up`: each side can be tuned on its own (--prefill-args / --decode-args)."""
from __future__ import annotations

import sys

from pdserve import cli
from pdserve.cluster import instance_command


def test_role_flags_come_last_so_they_win():
    cmd = instance_command("consumer", 0, 8002, model="default", host="127.0.0.1",
                           serve_args=["--max-num-seqs", "256"], role_args=["--max-num-seqs", "512"],
                           kv_connector="nixl", kv_transfer_config=None, cores=[1])
    assert cmd[:4] == [sys.executable, "-m", "pdserve", "serve"]
    assert cmd[-2:] == ["--max-num-seqs", "512"] and "--engine-id" in cmd and "decode-0" in cmd
    args = cli.build_parser().parse_args(cmd[3:])
    assert args.max_num_seqs == 512 and args.kv_role == "consumer" and args.cpu_cores == "1"


def test_up_passes_role_flags_to_their_side_and_refuses_bad_ones(monkeypatch, capsys):
    calls = {}
    monkeypatch.setattr("pdserve.cluster.run_cluster", lambda **kw: calls.update(kw) or 0)
    argv = ["up", "--max-num-seqs", "128", "--prefill-args", "--max-num-batched-tokens 8192",
            "--decode-args", "--max-num-seqs 512 --no-prefix-caching"]
    assert cli.main(argv) == 0
    shared = calls["serve_args"]
    assert shared[shared.index("--max-num-seqs") + 1] == "128"  # every instance
    assert calls["prefill_args"] == ["--max-num-batched-tokens", "8192"]
    assert calls["decode_args"] == ["--max-num-seqs", "512", "--no-prefix-caching"]
    assert cli.main(["up", "--prefill-args=--no-prefix-caching"]) == 0  # a lone flag, with '='
    assert calls["prefill_args"] == ["--no-prefix-caching"]
    assert cli.main(["up", "--decode-args", "--max-num-sqes 512"]) == 2
    assert "--decode-args" in capsys.readouterr().err
