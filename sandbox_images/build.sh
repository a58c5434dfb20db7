#!/bin/sh
# Build the sandbox images; the logic (caching, making the OS image) lives in
# `orchestrator image build`. Arguments pass through, e.g. --force.
set -eu
exec "$(dirname "$0")/../.venv/bin/orchestrator" image build "$@"
