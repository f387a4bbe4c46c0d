"""Repack the nixl-cu13 wheel in .whl without what pdserve never loads (its expert-parallel libraries,
three builds of ~31 MB each uncompressed, and UCX's perftest), so that it travels to the GPU machine with
the tree inside the 64 MiB a device call may carry (the wheel: 59 MB -> 28 MB).

    ../shared/tools/device-wheels.sh nixl-cu13==1.5.1 && python benchmarks/slim_nixl_wheel.py
"""
from __future__ import annotations

import glob
import os
import zipfile


def dropped(name: str) -> bool:
    return name.startswith("nixl_ep_cu13/") or "perftest" in name


def slim(path: str) -> None:
    tmp = path + ".tmp"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if dropped(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):   # pip installs what RECORD lists
                data = b"\n".join(line for line in data.split(b"\n") if not dropped(line.decode()))
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    before = os.path.getsize(path)
    os.replace(tmp, path)
    print(f"{path}: {before / 1e6:.1f} MB -> {os.path.getsize(path) / 1e6:.1f} MB")


if __name__ == "__main__":
    wheels = glob.glob(".whl/nixl_cu13-*.whl")
    if not wheels:
        raise SystemExit("no .whl/nixl_cu13-*.whl: run ../shared/tools/device-wheels.sh nixl-cu13==1.5.1 first")
    for wheel in wheels:
        slim(wheel)
