"""Wrong invocations end in one line naming the value, before anything starts (new-user check, session 50):
a port past 65535 wrapped round (`up --port 65535` put an instance on port 1 and never became ready), a
role without a connector was ignored, a size with a unit was refused, a bad model path failed once per child."""
from __future__ import annotations

import pytest

from pdserve.cli import main


def usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv", [["serve", "--port", "99999"], ["serve", "--port", "0"], ["up", "--port", "65536"],
                                  ["proxy", "--colocated", "http://127.0.0.1:1", "--port", "-1"],
                                  ["kv-store", "--port", "70000"], ["bench", "compare", "--base-port", "x"]])
def test_a_port_outside_the_range_is_a_usage_error(capsys, argv):
    assert "a port is" in usage_error(capsys, argv)


def test_a_cluster_whose_ports_run_past_65535_is_refused_before_it_starts(capsys):
    assert main(["up", "--port", "65535"]) == 2
    assert "the cluster takes ports 65535-65537" in capsys.readouterr().err


def test_a_missing_model_is_named_once_before_any_instance_starts(capsys, tmp_path):
    assert main(["up", "--model", str(tmp_path / "none.gguf"), "--port", "18190"]) == 2
    err = capsys.readouterr().err
    assert err.count("none.gguf") == 1 and err.startswith("pdserve up: model")


def test_a_role_without_a_connector_is_refused(capsys):
    assert main(["serve", "--kv-role", "producer", "--port", "18191"]) == 2
    assert "--kv-role producer: only with --kv-connector" in capsys.readouterr().err


def test_sizes_take_units(capsys):
    from pdserve.cli import build_parser
    args = build_parser().parse_args(["serve", "--kv-cache-memory", "1GiB"])
    assert args.kv_cache_memory == 1 << 30
    assert build_parser().parse_args(["up", "--kv-cache-memory", "500000"]).kv_cache_memory == 500000
    assert "expected bytes like 4GiB" in usage_error(capsys, ["serve", "--kv-cache-memory", "1e9"])


def test_an_unknown_flag_shows_the_subcommands_usage(capsys):
    err = usage_error(capsys, ["serve", "--bogus-flag"])
    assert err.startswith("usage: pdserve serve") and "unrecognized arguments: --bogus-flag" in err
    assert usage_error(capsys, ["bench", "sweep", "--nope"]).startswith("usage: pdserve bench sweep")


def test_no_command_prints_the_help_and_version_is_known(capsys):
    assert main([]) == 2
    out = capsys.readouterr().err
    assert "pdserve up" in out and "pdserve scale" in out and "pdserve bench compare" in out
    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == 0 and capsys.readouterr().out.startswith("pdserve ")


def test_the_role_in_the_kv_transfer_config_counts_unless_the_flag_sets_one(capsys):
    """--kv-role's default ("both") always overrode the JSON's kv_role (code review, session 50)."""
    from pdserve.cli import build_parser, engine_config_from_args
    kv = '{"kv_connector": "nixl", "kv_role": "producer"}'
    config = engine_config_from_args(build_parser().parse_args(["serve", "--kv-transfer-config", kv]))
    assert config.kv_transfer.kv_role == "producer"
    config = engine_config_from_args(build_parser().parse_args(["serve", "--kv-transfer-config", kv,
                                                                "--kv-role", "consumer"]))
    assert config.kv_transfer.kv_role == "consumer"
    assert main(["serve", "--kv-transfer-config", '{"kv_role": "consumer"}', "--port", "18192"]) == 2
    assert "--kv-role consumer: only with --kv-connector" in capsys.readouterr().err
