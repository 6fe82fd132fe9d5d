#!/usr/bin/env bash
# Set up dtk in ./.venv: torch, dtk and its dependencies (and, with --dev, the test tools,
# the Hugging Face extra and the Slurm packages the lab cluster needs). Safe to run again; fast when done before.
#
#   bash scripts/setup.sh            # to train
#   bash scripts/setup.sh --dev      # to run the tests too
#   bash scripts/setup.sh --shared   # a team's install: every user can run .venv/bin/python
#   PYTHON=/usr/bin/python3.11 bash scripts/setup.sh   # the interpreter the venv is made from
set -euo pipefail
cd "$(dirname "$0")/.."

dev=0 shared=0
for arg in "$@"; do
  case "$arg" in
    --dev) dev=1 ;;
    --shared) shared=1 ;;
    *) echo "error: setup.sh: unknown option $arg; options: --dev, --shared" >&2; exit 2 ;;
  esac
done

# A shared install: the venv's interpreter, the one it was made from and the checkout must
# be readable by every user. A python in a private home (pyenv in /root, mode 0700) is not:
# every other user would get "Permission denied".
shareable() { "$1" scripts/check_python.py "$PWD" "${2:-}" 2>/dev/null; }
suggest() {
  local candidate
  for candidate in /usr/bin/python3 /usr/local/bin/python3; do
    if [ -x "$candidate" ] && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null \
        && shareable "$candidate"; then
      echo "$candidate"; return
    fi
  done
}
if [ "$shared" = 1 ]; then
  if [ -z "${PYTHON:-}" ]; then
    PYTHON=$(command -v python3 || true)
    if [ -z "$PYTHON" ] || ! shareable "$PYTHON"; then PYTHON=$(suggest); fi
    PYTHON=${PYTHON:-python3}
  fi
  if [ -x .venv/bin/python ] && ! shareable .venv/bin/python; then
    echo "error: .venv was made from an interpreter other users cannot run ($(.venv/bin/python -c \
'import sys; print(sys._base_executable)')); remove it (rm -rf .venv) and run PYTHON=$(suggest) bash scripts/setup.sh --shared" >&2
    exit 2
  fi
  "$PYTHON" scripts/check_python.py "$PWD" "$(suggest)" || exit 2
  umask 022  # what the venv gets is readable by every user
fi
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
if [ "$shared" = 0 ] && [ "$(id -u)" = 0 ] && ! shareable .venv/bin/python; then
  echo "setup: note: other users cannot run .venv/bin/python; for a team's install: bash scripts/setup.sh --shared" >&2
fi
echo "setup: ready ($(.venv/bin/python -c 'import torch, dtk; print("dtk", dtk.__version__, "torch", torch.__version__)'))"
