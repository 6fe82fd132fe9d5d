#!/usr/bin/env bash
# Set up dtk in ./.venv: torch, dtk and its dependencies (and, with --dev, the test tools,
# the Hugging Face extra and the Slurm packages the lab cluster needs). Safe to run again; fast when done before.
#
#   bash scripts/setup.sh          # to train
#   bash scripts/setup.sh --dev    # to run the tests too
set -euo pipefail
cd "$(dirname "$0")/.."

dev=0
[ "${1:-}" = "--dev" ] && dev=1
PY=${PYTHON:-python3}
TORCH=${DTK_TORCH:-torch==2.13.0}   # a GPU cluster brings its own: DTK_TORCH='torch' or a CUDA wheel

apt_install() {
  [ "$(id -u)" = 0 ] || { echo "setup: need root to install $* (or install them yourself)" >&2; return 1; }
  command -v apt-get >/dev/null || { echo "setup: no apt-get to install $*" >&2; return 1; }
  [ -n "$(find /var/lib/apt/lists -maxdepth 1 -name '*Packages*' -mmin -1440 2>/dev/null | head -n 1)" ] || apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

if [ ! -x .venv/bin/python ]; then
  if ! "$PY" -m venv .venv 2>/dev/null; then
    rm -rf .venv
    apt_install python3-venv
    "$PY" -m venv .venv
  fi
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }

# torch first and pinned: a bare range would pull a multi-GB CUDA build on a CPU machine.
.venv/bin/python -c "import torch" 2>/dev/null || pip install "$TORCH"
if [ "$dev" = 1 ]; then
  pip install -e ".[dev,hf]"   # the tests of Hugging Face models need the hf extra
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt_install slurm-wlm munge || echo "setup: Slurm not installed; lab tests will be skipped (or fail under CI=true)" >&2
  fi
else
  pip install -e .
fi
echo "setup: ready ($(.venv/bin/python -c 'import torch, dtk; print("dtk", dtk.__version__, "torch", torch.__version__)'))"
