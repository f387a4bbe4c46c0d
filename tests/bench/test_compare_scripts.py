"""benchmarks/compare_results.py and compare_slo_table.py find every run of a compare directory,
the chunked runs named per budget included (they used to miss colocated-chunked-<B>)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", ["compare_results", "compare_slo_table"])
def test_runs_come_from_the_summary(tmp_path, script):
    runs = ["colocated", "colocated-chunked-2048", "colocated-chunked-4096", "disaggregated"]
    (tmp_path / "summary.json").write_text(json.dumps({"configs": [{"config": r} for r in runs]}))
    module = _load(script)
    assert module.run_names(tmp_path) == runs
    (tmp_path / "summary.json").unlink()
    assert module.run_names(tmp_path) == ["colocated", "colocated-chunked", "disaggregated"]
