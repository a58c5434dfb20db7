#!/usr/bin/env bash
# Build the chart's images on this machine's dockerd (nothing is pushed): the orchestrator's
# own (the Dockerfile at the root, from a wheelhouse made here) and Redis from Debian's
# packages (images/redis.Dockerfile). `make test` runs it; the suite's `helm install`
# (tests/k8s/test_helm_install.py) uses both. Prints the two references, one per line.
#
# usage: scripts/service-images.sh   (with the virtualenv in .venv, or PIP=...)
set -euo pipefail
cd "$(dirname "$0")/.."

pip="${PIP:-.venv/bin/pip}"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n1)"
service="orchestrator/orchestrator:${version}"
redis="orchestrator/redis:7.0"

# The wheels must suit the image's Python (bookworm's 3.11.2), not only this venv's:
# redis-py asks for async-timeout below 3.11.3, which `pip wheel` here (3.11.7) skips.
rm -rf build/wheelhouse
"$pip" wheel --quiet --disable-pip-version-check --wheel-dir build/wheelhouse . \
  'async-timeout>=4.0.3' 2> >(grep -v "^WARNING: Location" >&2)

docker build --quiet --force-rm -t "$service" . > /dev/null
docker build --quiet --force-rm -t "$redis" -f images/redis.Dockerfile images > /dev/null
echo "$service"
echo "$redis"
