"""Set up once, branch many (docs/snapshots.md): a GRPO group of G sandboxes that all need one
set-up step, made by forking one set-up sandbox against G × (create + set-up); and the
fork of a sandbox with a large /workspace change against a cold create, side by side.

Through the stock ``e2b`` SDK against a local stack (``orchestrator up``, no warm pool: every
create is cold, as a fork's sandboxes are), as a harness would: ``Sandbox.create``,
``commands.run`` (the set-up), ``fork(count=G)``.

- ``group``: per round, in an order turned by one each round, (a) fork: create one
  sandbox, run the set-up in it, fork it G ways, until every fork answers a command; (b)
  each: G sandboxes created at once, each running the set-up, until the last is done; (c)
  one after the other: the same G × (create + set-up) in sequence, the arithmetic the
  target names. The set-up burns
  ``--setup-cpu`` seconds of CPU (one process) and writes a small tree to /workspace.
- ``large``: a sandbox writes ``--mb`` MB to /workspace; then, interleaved ``--forks``
  times, ``fork(count=1)`` and a cold ``Sandbox.create`` (each until it answers): wall
  p50/p99, and the host's CPU seconds per operation (/proc/stat, the whole host: the
  machine is shared, read medians).
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.common import (
    BENCH_CODEBASE,
    STACK_ENVIRONMENTS,
    ensure_bench_codebase,
    host_busy_s,
    summary,
    throwaway_stack_settings,
    write_report,
)
from orchestrator.local import local_stack

SET_UP = (
    "python3 -c 'import time\nt = time.process_time()\n"
    "while time.process_time() - t < {cpu}: pass' "
    "&& mkdir -p /workspace/.venv/lib && seq 1 20000 > /workspace/.venv/lib/installed "
    "&& echo ready > /workspace/.setup-done"
)
READY = "cat /workspace/.setup-done"
TEMPLATE = BENCH_CODEBASE
"""The benchmark codebase (this Python's standard library) on the bench environment."""


def _sdk(base: str, token: str) -> Any:
    os.environ.update(
        {"E2B_API_URL": base, "E2B_SANDBOX_URL": base, "E2B_API_KEY": token, "NO_PROXY": "*"}
    )
    import e2b  # the SDK reads its settings when a call is made

    return e2b


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    cpu, wall = host_busy_s(), time.perf_counter()
    result = fn()
    return time.perf_counter() - wall, host_busy_s() - cpu, result


def group_round(e2b: Any, size: int, setup: str, number: int) -> dict[str, float]:
    made: list[Any] = []
    try:

        def by_fork() -> None:
            parent = e2b.Sandbox.create(TEMPLATE, timeout=600)
            made.append(parent)
            parent.commands.run(setup, timeout=120)
            forks = parent.fork(count=size, timeout=600)
            for fork in forks:
                if not isinstance(fork, e2b.Sandbox):
                    raise RuntimeError(f"a fork failed: {fork}")
                made.append(fork)
            with ThreadPoolExecutor(size) as pool:
                assert all(r.stdout == "ready\n" for r in pool.map(_ready, forks))

        def one() -> Any:
            sandbox = e2b.Sandbox.create(TEMPLATE, timeout=600)
            made.append(sandbox)
            sandbox.commands.run(setup, timeout=300)
            return _ready(sandbox)

        def each_at_once() -> None:
            with ThreadPoolExecutor(size) as pool:
                assert all(r.stdout == "ready\n" for r in pool.map(lambda _: one(), range(size)))

        def one_after_another() -> None:
            for _ in range(size):
                assert one().stdout == "ready\n"

        out: dict[str, float] = {}
        modes = [("fork", by_fork), ("each", each_at_once), ("serial", one_after_another)]
        for mode, fn in modes[number % 3 :] + modes[: number % 3]:
            wall, cpu, _ = _timed(fn)
            out[f"{mode}_s"] = round(wall, 2)
            out[f"{mode}_cpu_s"] = round(cpu, 2)
            _kill(made)
        return out
    finally:
        _kill(made)


def _ready(sandbox: Any) -> Any:
    return sandbox.commands.run(READY)


def _kill(made: list[Any]) -> None:
    while made:
        try:
            made.pop().kill()
        except Exception as exc:  # noqa: BLE001 (a bench's cleanup goes on)
            print(f"kill failed: {exc}")


def large_phase(e2b: Any, mb: int, forks: int) -> dict[str, Any]:
    parent = e2b.Sandbox.create(TEMPLATE, timeout=1800)
    made: list[Any] = []
    try:
        parent.commands.run(f"head -c {mb}M /dev/urandom > /workspace/blob", timeout=300)
        samples: dict[str, list[tuple[float, float]]] = {"fork": [], "create": []}

        def fork_one() -> None:
            (child,) = parent.fork(count=1, timeout=600)
            if not isinstance(child, e2b.Sandbox):
                raise RuntimeError(f"the fork failed: {child}")
            made.append(child)
            size = child.commands.run("stat -c %s /workspace/blob").stdout.strip()
            assert int(size) == mb << 20, size

        def create_one() -> None:
            sandbox = e2b.Sandbox.create(TEMPLATE, timeout=600)
            made.append(sandbox)
            sandbox.commands.run("true")

        for i in range(forks):
            order = (("fork", fork_one), ("create", create_one))
            for mode, fn in order if i % 2 == 0 else reversed(order):
                wall, cpu, _ = _timed(fn)
                samples[mode].append((wall, cpu))
                _kill(made)
        return {
            mode: {
                "wall_s": summary([w for w, _ in pairs]),
                "host_cpu_s": summary([c for _, c in pairs]),
            }
            for mode, pairs in samples.items()
        }
    finally:
        _kill(made)
        parent.kill()


def markdown(report: dict[str, Any]) -> str:
    g = report["group"]
    size, cpu = report["group_size"], report["setup_cpu_s"]
    lines = [
        f"## fork ({report['when_local']})",
        "",
        f"A group of {size} whose set-up burns {cpu} s of CPU, median of "
        f"{len(report['group_rounds'])} rounds (wall s until every sandbox of the group "
        "answers, host CPU s):",
        "",
        "| how | wall s | host CPU s | vs fork |",
        "|---|---|---|---|",
    ]
    for mode, label in (
        ("fork", "create + set-up once, fork ×" + str(size)),
        ("each", f"{size} × (create + set-up), at once"),
        ("serial", f"{size} × (create + set-up), one after the other"),
    ):
        lines.append(
            f"| {label} | {g[mode + '_s']:.2f} | {g[mode + '_cpu_s']:.1f} | "
            f"{g[mode + '_s'] / g['fork_s']:.1f}× |"
        )
    large = report["large"]
    lines += [
        "",
        f"A fork of a sandbox with {report['mb']} MB written to /workspace, against a cold "
        f"create, interleaved, {report['forks']} each (wall until it answers; host CPU):",
        "",
        "| operation | p50 s | p99 s | host CPU s p50 |",
        "|---|---|---|---|",
    ]
    for mode in ("fork", "create"):
        w, c = large[mode]["wall_s"], large[mode]["host_cpu_s"]
        lines.append(f"| {mode} | {w['p50']:.2f} | {w['p99']:.2f} | {c['p50']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--setup-cpu", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--forks", type=int, default=10)
    args = parser.parse_args()
    settings = throwaway_stack_settings(f"bench-fork-{uuid.uuid4().hex[:6]}", STACK_ENVIRONMENTS)
    # No warm pool: every create here is cold, as a fork's sandboxes are.
    settings = settings.model_copy(update={"e2b_default_timeout_s": 1800, "pool_autosize": False})
    setup = SET_UP.format(cpu=args.setup_cpu)
    ensure_bench_codebase(settings)
    with local_stack(settings, log=settings.state_dir / "stack.log", forget=True) as base:
        e2b = _sdk(base, settings.tokens[0])
        rounds = []
        for number in range(args.rounds):
            rounds.append(group_round(e2b, args.group, setup, number))
            print("group round", number + 1, rounds[-1], flush=True)
        large = large_phase(e2b, args.mb, args.forks)
    group = {key: summary([r[key] for r in rounds])["p50"] for key in rounds[0]}
    report = {
        "when_local": time.strftime("%Y-%m-%d"),
        "group_size": args.group,
        "setup_cpu_s": args.setup_cpu,
        "group_rounds": rounds,
        "group": group,
        "mb": args.mb,
        "forks": args.forks,
        "large": large,
    }
    text = markdown(report)
    print(text)
    write_report("fork", report, text)


if __name__ == "__main__":
    main()
