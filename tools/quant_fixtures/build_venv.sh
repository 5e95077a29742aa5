#!/usr/bin/env bash
# Build the quantization *tool* venv used to (re)generate tests/fixtures/quant/.
#
# It is deliberately separate from the main venv: llmcompressor 0.14.0.1 pins
# transformers<=5.17 and compressed-tensors 0.19, while the engine/tests use
# transformers 5.2x and compressed-tensors 0.20.1.
#
# Usage: tools/quant_fixtures/build_venv.sh [VENV_DIR]   (default: <repo>/.tool-venvs/quant)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${1:-${REPO_ROOT}/.tool-venvs/quant}"
PYTHON="${PYTHON:-python3}"

TORCH_VERSION="2.13.0"
LLMCOMPRESSOR_VERSION="0.14.0.1"
MSMODELSLIM_VERSION="26.1.0"

echo "[build_venv] creating ${VENV}"
"${PYTHON}" -m venv "${VENV}"
PIP="${VENV}/bin/pip"

# A constraint file keeps pip from ever replacing the CPU torch wheel (anything asking for
# torch>=2.14 would otherwise pull a multi-GB CUDA wheel from the extra index).
CONSTRAINTS="$(mktemp)"
trap 'rm -f "${CONSTRAINTS}"' EXIT
echo "torch==${TORCH_VERSION}" > "${CONSTRAINTS}"

# 1) torch FIRST (the local CPU wheel from pip's find-links).
"${PIP}" install "torch==${TORCH_VERSION}"
# 2) llmcompressor (pulls transformers<=5.17, compressed-tensors 0.19, datasets, ...).
"${PIP}" install -c "${CONSTRAINTS}" "llmcompressor==${LLMCOMPRESSOR_VERSION}"
# 3) msmodelslim (Ascend's quantization tool; its legacy PTQ API runs on CPU).
"${PIP}" install -c "${CONSTRAINTS}" "msmodelslim==${MSMODELSLIM_VERSION}"

echo "[build_venv] installed versions:"
"${PIP}" list 2>/dev/null | grep -Ei '^(torch|transformers|compressed-tensors|llmcompressor|msmodelslim|safetensors|datasets) '

TORCH_INSTALLED="$("${VENV}/bin/python" -c 'import torch; print(torch.__version__)')"
case "${TORCH_INSTALLED}" in
  "${TORCH_VERSION}+cpu"|"${TORCH_VERSION}") echo "[build_venv] torch OK: ${TORCH_INSTALLED}" ;;
  *) echo "[build_venv] ERROR: torch is ${TORCH_INSTALLED}, expected ${TORCH_VERSION}+cpu" >&2; exit 1 ;;
esac
