#!/usr/bin/env bash
# Set up .venv for opendiloco-stream on a fresh machine: a virtual environment, torch 2.13.0 if no
# torch is installed yet (never the multi-GB CUDA default on a CPU box), the package in editable mode.
# Idempotent: a second run only checks. Set ODS_VENV to use another venv path.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${ODS_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV" >&2
  "$PY" -m venv "$VENV"
fi
V="$VENV/bin/python"
"$V" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! "$V" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch==2.13.0" >&2
  "$V" -m pip install -q "torch==2.13.0" >"$VENV/pip-torch.log" 2>&1 || true
  "$V" -c "import torch" 2>/dev/null || { cat "$VENV/pip-torch.log" >&2; echo "[setup] torch install failed" >&2; exit 1; }
fi
if ! "$V" -c "import opendiloco_stream, hivemind, transformers, datasets, pytest, pytest_timeout, matplotlib, prometheus_client, tensorboard, wandb, compose" >/dev/null 2>&1; then
  echo "[setup] installing opendiloco-stream (editable) and its dependencies" >&2
  # pip's output goes to a log (shown only on failure): it is long and mostly build warnings
  "$V" -m pip install -q -e ".[test,bench,loggers]" >"$VENV/pip-install.log" 2>&1 || true
  "$V" -c "import opendiloco_stream, hivemind, pytest_timeout" 2>/dev/null || {
    cat "$VENV/pip-install.log" >&2; echo "[setup] package install failed" >&2; exit 1; }
fi
# promtool (Prometheus's exposition-format linter) for tests/test_prometheus.py, and the prometheus
# server for benchmarks/prometheus_scrape.py: Debian's package, when missing and we may install it
if ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing Debian's prometheus package (promtool)" >&2
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; } \
      >"$VENV/apt-prometheus.log" 2>&1 || { cat "$VENV/apt-prometheus.log" >&2; echo "[setup] prometheus install failed" >&2; exit 1; }
  else
    echo "[setup] promtool is missing: install Prometheus (Debian/Ubuntu: apt-get install prometheus)" >&2
  fi
fi
# nft (Debian's nftables) for the NAT topology of tests/test_nat.py (routers that masquerade):
# installed when missing and we may, like prometheus above
if ! command -v nft >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing Debian's nftables package (nft)" >&2
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nftables \
      || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends nftables; }; } \
      >"$VENV/apt-nftables.log" 2>&1 || { cat "$VENV/apt-nftables.log" >&2; echo "[setup] nftables install failed" >&2; exit 1; }
  else
    echo "[setup] nft is missing (tests/test_nat.py is skipped): apt-get install nftables" >&2
  fi
fi
echo "[setup] ready: $("$V" -c 'import torch, hivemind; print("torch", torch.__version__, "/ hivemind", hivemind.__version__)')" >&2
