#!/usr/bin/env bash
# Set up .venv for opendiloco-stream's main job: a virtual environment, torch, this package in
# editable mode with what `local` / `peer` need, and nothing else: no system package, no test tool
# (scripts/test.sh adds those). Idempotent: a second run only checks. ODS_VENV: another venv path.
#
# torch: an installed torch is kept. Otherwise torch 2.13.0, the build chosen by ODS_TORCH:
#   auto (default)  cuda where an NVIDIA driver is present (nvidia-smi or /proc/driver/nvidia), else cpu
#   cpu             the CPU build from the PyTorch CPU index (never the multi-GB CUDA default), falling
#                   back to what pip's own configuration provides (a mirror, a local wheel)
#   cuda            a CUDA build from the PyTorch CUDA index ODS_TORCH_CUDA (default cu128), falling
#                   back to pip's default build
#   pip             plain `pip install torch==2.13.0` with pip's configuration
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${ODS_VENV:-.venv}"
PY="${PYTHON:-python3}"
TORCH_VERSION=2.13.0
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV" >&2
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
fi
V="$VENV/bin/python"

pip_torch() {  # pip_torch LOG [pip args...]: install torch quietly into the venv, output to LOG
  local log="$1"; shift
  "$V" -m pip install -q "torch==$TORCH_VERSION" "$@" >"$log" 2>&1 && "$V" -c "import torch" >/dev/null 2>&1
}

if ! "$V" -c "import torch" >/dev/null 2>&1; then
  choice="${ODS_TORCH:-auto}"
  if [ "$choice" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 || [ -e /proc/driver/nvidia ]; then choice=cuda; else choice=cpu; fi
  fi
  log="$VENV/pip-torch.log"
  case "$choice" in
    cpu)
      echo "[setup] installing torch==$TORCH_VERSION, CPU build (no NVIDIA driver here; ODS_TORCH=cuda for a CUDA build)" >&2
      pip_torch "$log" --index-url https://download.pytorch.org/whl/cpu --retries 1 --timeout 20 \
        || { echo "[setup] the PyTorch CPU index did not serve it: trying pip's own configuration" >&2; pip_torch "$log"; } ;;
    cuda)
      cu="${ODS_TORCH_CUDA:-cu128}"
      echo "[setup] installing torch==$TORCH_VERSION, CUDA build $cu (an NVIDIA driver is present; ODS_TORCH=cpu for the CPU build)" >&2
      pip_torch "$log" --index-url "https://download.pytorch.org/whl/$cu" --retries 1 --timeout 20 \
        || { echo "[setup] the PyTorch $cu index did not serve it: trying pip's default build" >&2; pip_torch "$log"; } ;;
    pip)
      echo "[setup] installing torch==$TORCH_VERSION with pip's configuration (ODS_TORCH=pip)" >&2
      pip_torch "$log" ;;
    *)
      echo "[setup] ODS_TORCH=$choice: use auto, cpu, cuda or pip" >&2; exit 2 ;;
  esac || { cat "$log" >&2; echo "[setup] torch install failed" >&2; exit 1; }
fi
if ! "$V" -c "import opendiloco_stream, hivemind, transformers, datasets, prometheus_client, safetensors, tokenizers" >/dev/null 2>&1; then
  echo "[setup] installing opendiloco-stream (editable) and its dependencies" >&2
  # pip's output goes to a log (shown only on failure): it is long and mostly build warnings
  "$V" -m pip install -q -e . >"$VENV/pip-install.log" 2>&1 || true
  "$V" -c "import opendiloco_stream, hivemind, transformers" 2>/dev/null || {
    cat "$VENV/pip-install.log" >&2; echo "[setup] package install failed" >&2; exit 1; }
fi
echo "[setup] ready: $("$V" -c 'import torch, hivemind; print("torch", torch.__version__, "(CUDA " + torch.version.cuda + ")" if torch.version.cuda else "(CPU build)", "/ hivemind", hivemind.__version__)')" >&2
