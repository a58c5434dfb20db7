#!/usr/bin/env bash
# Build .venv-harbor: stock Harbor (pinned) and the e2b SDK, for tests/e2e/test_harbor.py.
# Harbor needs Python >= 3.12 and the product runs on Debian bookworm's 3.11, so this
# takes the first 3.12+ interpreter it finds (3.12, the one tested, before 3.13; on PATH,
# then pyenv's). Without one it says so loudly and builds nothing: the Harbor test then
# skips, saying how to build it.
# Built once per machine and pin set, outside the checkout, and linked in
# (scripts/shared_venv.py): idempotent, and fast on a machine that has built it.
#
# usage: scripts/harbor-venv.sh VENV_DIR
set -euo pipefail

PINS=('harbor[e2b]==0.26.0' 'e2b==2.63.0')

venv="${1:?usage: $0 VENV_DIR}"
python=""
for candidate in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 python3.13 \
    /root/.pyenv/versions/3.13*/bin/python3.13; do
  if command -v "$candidate" >/dev/null 2>&1 \
      && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    python="$(command -v "$candidate")"
    break
  fi
done
if [[ -z "$python" ]]; then
  echo "[harbor-venv] WARNING: no Python >= 3.12 on this machine: Harbor is not installed" \
       "and tests/e2e/test_harbor.py will skip" >&2
  exit 0
fi

exec python3 "$(dirname "$0")/shared_venv.py" "$venv" "$python" "${PINS[*]}"
