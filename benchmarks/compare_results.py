"""Turn a `pdserve bench compare` directory into what is committed: each sweep JSON without the
per-token inter-token latencies (17 MB → under 1 MB per configuration; every request keeps its TTFT,
TPOT, E2E, token counts and errors), summary.json/md, the instance logs and compare.png (skipped
where matplotlib is missing, as on the GPU image: run it again here on the slimmed copy).

  .venv/bin/python benchmarks/compare_results.py SRC_DIR DEST_DIR
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from pdserve.bench.compare import CONFIG_NAMES
from pdserve.bench.plots import plot_sweeps


def run_names(src: Path) -> list[str]:
    """The runs of a compare directory in its summary's order (colocated-chunked-<B> once per chunk
    budget when several were run), or the configuration names when there is no summary."""
    summary = src / "summary.json"
    if summary.exists():
        return [c["config"] for c in json.loads(summary.read_text())["configs"]]
    return list(CONFIG_NAMES)


def main(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    sweeps = []
    for name in run_names(src):
        path = src / f"{name}.json"
        if not path.exists():
            continue
        sweep = json.loads(path.read_text())
        for entry in sweep["results"]:
            for request in entry["requests"]:
                request.pop("itls", None)
        (dest / path.name).write_text(json.dumps(sweep, indent=1))
        sweeps.append((name, sweep))
    for name in ("summary.json", "summary.md"):
        if (src / name).exists() and src != dest:
            shutil.copy(src / name, dest / name)
    if (src / "logs").exists() and src != dest:
        shutil.copytree(src / "logs", dest / "logs", dirs_exist_ok=True)
    try:
        if sweeps:
            plot_sweeps(sweeps, dest / "compare.png")
    except ValueError as e:  # no matplotlib
        print(f"no plot: {e}")
    print(f"wrote {dest}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
