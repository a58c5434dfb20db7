"""Print the shape of the last `make test`: each phase's wall time (set-up, lint, the two
pytest phases) and the slowest tests, from what tests/timings.py and the Makefile wrote
under .venv/test-times. Also written there as summary.txt.

usage: python scripts/test_times.py [DIR] [--slowest N]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{seconds % 60:04.1f}"


def summary(directory: Path, slowest: int) -> list[str]:
    lines = ["phase            wall      tests   test time"]
    total = 0.0
    phases = directory / "phases.tsv"
    if phases.exists():
        for row in phases.read_text().splitlines():
            name, seconds, status = row.split("\t")
            total += float(seconds)
            failed = "" if status == "0" else f"   (exit {status})"
            lines.append(f"{name:<16} {_clock(float(seconds)):>8}{failed}")
    runs = [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]
    for run in runs:
        total += run["wall_s"]
        lines.append(
            f"pytest {run['phase']:<9} {_clock(run['wall_s']):>8}  {run['tests']:>6}"
            f"  {_clock(run['test_s']):>9}"
        )
    lines.append(f"{'all of these':<16} {_clock(total):>8}")
    for run in runs:
        lines.append("")
        busy = ", ".join(f"{w} {_clock(t)}" for w, t in run.get("busy_s_by_worker", {}).items())
        lines.append(f"{run['phase']}: time in tests by worker: {busy}")
        lines.append(f"slowest modules in {run['phase']}:")
        for module in run.get("modules", [])[:slowest]:
            workers = ",".join(module["workers"])
            lines.append(f"  {module['total_s']:7.1f}s {workers:>8}  {module['module']}")
        lines.append(f"slowest tests in {run['phase']} (setup + call + teardown; setup holds the")
        lines.append("fixtures the test was first to need):")
        for test in run["slowest"][:slowest]:
            parts = " ".join(
                f"{when}={test[f'{when}_s']:.1f}"
                for when in ("setup", "call", "teardown")
                if f"{when}_s" in test
            )
            mark = "" if test["outcome"] == "passed" else f" {test['outcome'].upper()}"
            lines.append(
                f"  {test['total_s']:7.1f}s {test['worker']:>4}  {test['nodeid']}  ({parts}){mark}"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default=".venv/test-times", type=Path)
    parser.add_argument("--slowest", type=int, default=15)
    args = parser.parse_args()
    if not args.directory.is_dir():
        raise SystemExit(f"no test times in {args.directory}: run make test")
    lines = summary(args.directory, args.slowest)
    (args.directory / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
