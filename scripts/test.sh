#!/usr/bin/env bash
# Set up (scripts/setup.sh), add what the tests need, and run the test suite on CPU. Extra
# arguments go to pytest.
#   scripts/test.sh           everything (CI)
#   scripts/test.sh --fast    the in-process tier: no test marked `network` (starts peer processes)
#                             or `slow`; a few minutes, for everyday work
# Two pytest-xdist workers run the tests (ODS_TEST_WORKERS=N for N, 0 for one process), a file at a
# time each (`--dist loadfile`), except the files of peer swarms (tests/conftest.py SWARM_FILES):
# one worker runs those first, one test at a time, while the other takes the other files. (Three
# were faster on a machine loaded by other work, 31 against 41 min, but not on an idle one: 31:35.)
# What the tests add to the main job's setup: the test extra (pytest, the loggers, the Compose
# validator, the Grafana SDK) and, when run as root on Debian/Ubuntu, Debian's `prometheus`
# (promtool and the server: tests/test_prometheus.py, benchmarks/prometheus_scrape.py) and
# `nftables` (nft: the NAT topology of tests/test_nat.py). Without them those tests are skipped with
# the install line as the reason, or fail under CI=true.
set -uo pipefail
cd "$(dirname "$0")/.."
SELECT=()
if [ "${1:-}" = "--fast" ]; then
  shift
  SELECT=(-m "not network and not slow")
fi
bash scripts/setup.sh || exit 1
VENV="${ODS_VENV:-.venv}"
V="$VENV/bin/python"
if ! "$V" -c "import pytest, pytest_timeout, xdist, yaml, compose, tensorboard, wandb, matplotlib, grafana_foundation_sdk" >/dev/null 2>&1; then
  echo "[test] installing the test extras" >&2
  "$V" -m pip install -q -e ".[test,bench]" >"$VENV/pip-test.log" 2>&1 || {
    cat "$VENV/pip-test.log" >&2; echo "[test] test extras install failed" >&2; exit 1; }
fi
# system tools of the tests (Debian packages), when missing and we may install them
missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v nft >/dev/null 2>&1 || missing+=(nftables)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[test] installing Debian packages: ${missing[*]}" >&2
    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" \
      || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"; }; } \
      >"$VENV/apt-test.log" 2>&1 || { cat "$VENV/apt-test.log" >&2; echo "[test] apt-get install ${missing[*]} failed" >&2; exit 1; }
  else
    echo "[test] missing: ${missing[*]} (as root: apt-get install ${missing[*]}); their tests are skipped" >&2
  fi
fi
# The suite starts many Python processes (peers, bootstraps, benchmarks, the command line),
# each importing ~100 of the package's modules: with PYTHONDONTWRITEBYTECODE set (as in many container
# images) each of them compiles those from source again (~0.35 s of CPU a process). The bytecode goes to
# __pycache__/ (git-ignored) as without that variable.
unset PYTHONDONTWRITEBYTECODE
WORKERS=(-n "${ODS_TEST_WORKERS:-2}")
[ "${ODS_TEST_WORKERS:-2}" = 0 ] || WORKERS+=(--dist loadfile --no-loadscope-reorder)
"$V" -m pytest -q -p no:cacheprovider --durations=30 "${WORKERS[@]}" "${SELECT[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests (exit 5): treating as success" >&2
  rc=0
fi
exit "$rc"
