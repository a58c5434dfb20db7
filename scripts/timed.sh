#!/usr/bin/env bash
# Run a command and record its wall time as one phase of `make test`:
# appends "NAME<TAB>SECONDS<TAB>EXIT" to DIR/phases.tsv (scripts/test_times.py prints it).
# Exits with the command's status.
#
# usage: scripts/timed.sh DIR NAME COMMAND...
set -uo pipefail
dir="$1" name="$2"
shift 2
mkdir -p "$dir"
start=$EPOCHREALTIME
"$@"
status=$?
awk -v n="$name" -v a="$start" -v b="$EPOCHREALTIME" -v s="$status" \
  'BEGIN { printf "%s\t%.1f\t%s\n", n, b - a, s }' >> "$dir/phases.tsv"
exit "$status"
