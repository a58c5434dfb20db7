"""Rows at a repository's commit (docs/datasets.md) against one image per commit, on a real
repository of thousands of commits, in one run on one stack:

1. ``orchestrator repo add`` of the repository, then ``orchestrator dataset prepare`` of
   N rows (default 256) over C distinct commits (default 64, evenly spaced over the newest
   ``--span`` first-parent commits): wall time, CPU seconds by process, disk (the layers,
   and the object store), and disk per extra commit against the repository's checkout
   (its tree, and its tree with its ancestors-only history);
2. today's path on the same commits: one codebase image per commit
   (``orchestrator codebase add NAME REPO --rev COMMIT``): wall, host CPU, disk;
3. the first burst after preparing and the ones after it (``--rounds``): the N rows'
   rollouts started within one second through ``/v1/rollouts`` (each checks its HEAD,
   then ends; warm pools and recycling as the product's defaults have them), rows at
   commits on one stack, then rows on the images on another (together their pools would
   not fit one host's slots): acquisition p50/p99/max;
4. an unseen commit of the prepared repository: ``--unseen`` first rollouts of commits no
   host has, one at a time, each beside a rollout of a prepared commit: the extra wall
   time p50/p99 and the worker's CPU seconds for it.

    .venv/bin/python -m bench.datasets --repo /path/to/a/clone/of/requests [--commits 64]
        [--rows 256] [--span 2000] [--rounds 2] [--unseen 16] [--skip-images]

Writes bench/results/datasets.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import docker
import httpx

from bench.burst import stack_processes
from bench.common import (
    host_busy_s,
    proc_cpu_s,
    summary,
    throwaway_stack_settings,
    write_report,
)
from orchestrator.config import Settings
from orchestrator.images.codebases import add_codebase, remove_codebase
from orchestrator.local import local_stack, settings_env
from orchestrator.sandbox.repos import HostRepos

ENVIRONMENTS = """\
environments:
  - name: bench
    tools: [shell, read_file]
    grader: {name: file_f1}
    idle_timeout_s: 1800
"""
REPO = "bench-repo"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout


def pick_commits(repo: Path, count: int, span: int | None) -> tuple[list[str], list[str]]:
    """``count`` first-parent commits evenly spaced over the newest ``span`` (oldest
    first), and the commit halfway between each pair (unseen candidates)."""
    line = git(repo, "rev-list", "--first-parent", "HEAD").split()
    if span:
        line = line[:span]
    step = max(1, len(line) // count)
    chosen = [line[i * step] for i in range(count)]
    between = [line[i * step + step // 2] for i in range(count - 1) if step > 1]
    return list(reversed(chosen)), between


def cli(settings: Settings, *args: str) -> tuple[float, str]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        env=settings_env(settings),
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"orchestrator {' '.join(args)} failed: {done.stderr[-2000:]}")
    return time.monotonic() - started, done.stdout


def cpu_by_role() -> dict[str, float]:
    return {role: sum(proc_cpu_s(pid) for pid in pids) for role, pids in stack_processes().items()}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before.get(k, 0.0), 2) for k in after}


def du(path: Path) -> int:
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True).stdout
    return int(out.split()[0]) if out else 0


def disk_blocks(path: Path) -> int:
    """Bytes the files under ``path`` take on disk (blocks, as the layers' records count)."""
    out = subprocess.run(["du", "-s", "--block-size=1", str(path)], capture_output=True, text=True)
    return int(out.stdout.split()[0]) if out.stdout else 0


def checkout_size(repo: Path, commit: str, scratch: Path) -> dict[str, int]:
    """The commit's tree, and its ancestors-only pack, in bytes (apparent and on disk)."""
    tree = scratch / "checkout"
    tree.mkdir(parents=True)
    subprocess.run(f"git -C {repo} archive {commit} | tar -x -C {tree}", shell=True, check=True)
    pack = subprocess.run(
        ["git", "-C", str(repo), "pack-objects", "--revs", "--stdout", "-q"],
        input=f"{commit}\n".encode(),
        capture_output=True,
        check=True,
    ).stdout
    return {"tree": du(tree), "tree_disk": disk_blocks(tree), "history_pack": len(pack)}


async def burst(
    base: str, token: str, rows: list[dict[str, Any]], window_s: float
) -> dict[str, Any]:
    """Start every row's rollout within ``window_s``; each checks its HEAD and ends."""
    headers = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=len(rows) + 8)
    latencies: list[float] = []
    failures: list[str] = []
    async with httpx.AsyncClient(
        base_url=base, headers=headers, timeout=600, limits=limits
    ) as http:

        async def one(index: int, row: dict[str, Any]) -> None:
            await asyncio.sleep(window_s * index / len(rows))
            rollout_id = f"ro-bench-{uuid.uuid4().hex}"
            started = time.monotonic()
            body = {"environment": "bench", "item": row, "id": rollout_id}
            for _ in range(5):
                created = await http.post("/v1/rollouts", json=body)
                if created.status_code != 429:
                    break
                await asyncio.sleep(float(created.headers.get("retry-after", "1")))
            if created.status_code != 201:
                failures.append(f"{created.status_code}: {created.text[:200]}")
                return
            latencies.append(time.monotonic() - started)
            try:
                ran = await http.post(
                    f"/v1/rollouts/{rollout_id}/tools/shell",
                    json={"arguments": {"command": "git rev-parse HEAD"}},
                )
                head = ran.json().get("output", "").strip()
                if head != row["expect"]:
                    failures.append(f"HEAD {head[:12]} is not {row['expect'][:12]}")
            finally:
                await http.delete(f"/v1/rollouts/{rollout_id}")

        started = time.monotonic()
        await asyncio.gather(*(one(i, r) for i, r in enumerate(rows)))
        wall = time.monotonic() - started
    return {
        "acquire_s": summary(latencies),
        "max_s": round(max(latencies, default=0), 3),
        "failures": failures[:10],
        "failed": len(failures),
        "wall_s": round(wall, 2),
    }


def single(base: str, token: str, row: dict[str, Any]) -> float:
    with httpx.Client(
        base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=600
    ) as http:
        rollout_id = f"ro-bench-{uuid.uuid4().hex}"
        started = time.monotonic()
        created = http.post(
            "/v1/rollouts", json={"environment": "bench", "item": row, "id": rollout_id}
        )
        took = time.monotonic() - started
        if created.status_code != 201:
            raise RuntimeError(f"{created.status_code}: {created.text[:300]}")
        http.delete(f"/v1/rollouts/{rollout_id}")
    return took


def prepare_phase(
    settings: Settings, repo: Path, rows: list[dict[str, Any]], report: dict[str, Any]
) -> None:
    took, _ = cli(settings, "repo", "add", REPO, str(repo))
    report["repo_add_s"] = round(took, 2)
    dataset = settings.state_dir / "rows.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cpu0, busy0 = cpu_by_role(), host_busy_s()
    took, out = cli(settings, "dataset", "prepare", str(dataset))
    host_repos = HostRepos.of(settings)
    records = host_repos.usage(REPO)[REPO]
    per_extra = summary([float(r.bytes) for r in records if r.base is not None])
    tree = report["checkout"]["tree_disk"]
    report["prepare"] = {
        "wall_s": round(took, 2),
        "host_cpu_s": round(host_busy_s() - busy0, 2),
        "cpu_s": delta(cpu_by_role(), cpu0),
        "output": out.strip().splitlines()[-1],
        "layers_disk": sum(r.bytes for r in records),
        "store_disk": disk_blocks(host_repos.store(REPO)),
        "bases": sum(1 for r in records if r.base is None),
        "max_depth": max(r.depth for r in records),
        "per_extra_commit": per_extra,
        "per_extra_vs_tree": per_extra["mean"] / tree,
        "per_extra_vs_checkout": per_extra["mean"] / (tree + report["checkout"]["history_pack"]),
        "build_ms": summary([r.ms for r in records]),
    }
    print(json.dumps(report["prepare"], indent=1), flush=True)


def unseen_phase(
    settings: Settings,
    base: str,
    token: str,
    commits: list[str],
    between: list[str],
    count: int,
) -> dict[str, Any]:
    host_repos = HostRepos.of(settings)
    unseen, prepared, extra, worker_cpu, build_ms = [], [], [], [], []
    for index, commit in enumerate(between[:count]):
        cpu0 = cpu_by_role()
        took_unseen = single(base, token, {"repo": REPO, "commit": commit})
        cpu1 = cpu_by_role()
        took_prepared = single(base, token, {"repo": REPO, "commit": commits[index]})
        unseen.append(took_unseen)
        prepared.append(took_prepared)
        extra.append(took_unseen - took_prepared)
        worker_cpu.append(cpu1.get("worker", 0.0) - cpu0.get("worker", 0.0))
        record = host_repos.layer_record(REPO, commit)
        build_ms.append(record.ms if record else float("nan"))
    return {
        "n": len(unseen),
        "unseen_s": summary(unseen),
        "prepared_s": summary(prepared),
        "extra_s": summary(extra),
        "worker_cpu_s": summary(worker_cpu),
        "build_ms": summary(build_ms),
    }


def images_phase(
    settings: Settings,
    client: docker.DockerClient,
    repo: Path,
    commits: list[str],
    images: list[str],
) -> dict[str, Any]:
    base_size = client.images.get(settings.base_image).attrs["Size"]
    busy0, started = host_busy_s(), time.monotonic()
    for index, commit in enumerate(commits):
        name = f"bench-ds-{index}-{commit[:8]}"
        add_codebase(settings, name, repo, rev=commit, replace=True)
        images.append(name)
    sizes = [client.images.get(f"{settings.codebase_image_repo}:{n}").attrs["Size"] for n in images]
    result = {
        "wall_s": round(time.monotonic() - started, 2),
        "host_cpu_s": round(host_busy_s() - busy0, 2),
        "layer_bytes": sum(s - base_size for s in sizes),
    }
    print(json.dumps(result), flush=True)
    return result


def markdown(report: dict[str, Any]) -> str:
    p = report["prepare"]
    i = report.get("images")
    lines = [
        f"# Rows at a commit vs one image per commit ({report['repository']['name']}, "
        f"{report['repository']['commits']} commits)",
        "",
        f"{report['rows']} rows over {len(report['commits'])} commits (evenly spaced over the "
        f"newest {report['span'] or 'all'} first-parent commits); 2 cores; one run.",
        "",
        "| | rows at a commit (`dataset prepare`) | one image per commit (`codebase add`) |",
        "|---|---|---|",
        f"| wall time | {p['wall_s']:.1f} s | {i['wall_s']:.1f} s |"
        if i
        else f"| wall time | {p['wall_s']:.1f} s | (skipped) |",
        f"| host CPU | {p['host_cpu_s']:.1f} s | {i['host_cpu_s']:.1f} s |" if i else "",
        f"| disk | {p['layers_disk'] / 1e6:.1f} MB of layers + "
        f"{p['store_disk'] / 1e6:.1f} MB store | "
        + (f"{i['layer_bytes'] / 1e6:.1f} MB of image layers |" if i else "|"),
        "",
        f"Checkout of the newest chosen commit: tree {report['checkout']['tree'] / 1e6:.2f} MB "
        f"({report['checkout']['tree_disk'] / 1e6:.2f} MB on disk), ancestors-only history "
        f"{report['checkout']['history_pack'] / 1e6:.2f} MB. Per extra commit (layers on a base): "
        f"mean {p['per_extra_commit']['mean'] / 1e6:.2f} MB, median "
        f"{p['per_extra_commit']['p50'] / 1e6:.2f} MB, i.e. "
        f"{p['per_extra_vs_tree']:.1%} of the tree on disk, {p['per_extra_vs_checkout']:.1%} of "
        f"tree + history. Base layers: {p['bases']}; deepest stack {p['max_depth']}.",
        "",
        "| first burst after preparing | round | acquire p50 s | p99 s | max s | failed | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for b in report["bursts"]:
        a = b["acquire_s"]
        lines.append(
            f"| {b['mode']} | {b['round']} | {a['p50']:.2f} | {a['p99']:.2f} | {b['max_s']:.2f} "
            f"| {b['failed']} | {b['wall_s']:.1f} |"
        )
    u = report["unseen"]
    lines += [
        "",
        f"Unseen commit of the prepared repository, {u['n']} first rollouts one at a time, each "
        f"beside one on a prepared commit: create p50 {u['unseen_s']['p50']:.2f} s / p99 "
        f"{u['unseen_s']['p99']:.2f} s vs prepared p50 {u['prepared_s']['p50']:.2f} s / p99 "
        f"{u['prepared_s']['p99']:.2f} s; extra p50 {u['extra_s']['p50']:.2f} s, p99 "
        f"{u['extra_s']['p99']:.2f} s; the worker's CPU per unseen commit p50 "
        f"{u['worker_cpu_s']['p50']:.2f} s (layer build p50 {u['build_ms']['p50']:.0f} ms).",
        "",
    ]
    return "\n".join(line for line in lines if line is not None) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, required=True, help="a clone of a real repository")
    parser.add_argument("--commits", type=int, default=64)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--span", type=int, default=None, help="newest first-parent commits")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--unseen", type=int, default=16)
    parser.add_argument("--window", type=float, default=1.0)
    parser.add_argument("--skip-images", action="store_true")
    args = parser.parse_args()
    repo = args.repo.resolve()
    settings = throwaway_stack_settings(f"bench-ds-{uuid.uuid4().hex[:6]}", ENVIRONMENTS)
    settings = settings.model_copy(update={"admission_wait_s": 600.0})
    token = settings.tokens[0]
    state = settings.state_dir
    commits, between = pick_commits(repo, args.commits, args.span)
    rows = [
        {"repo": REPO, "commit": commits[i % len(commits)], "expect": commits[i % len(commits)]}
        for i in range(args.rows)
    ]
    report: dict[str, Any] = {
        "repository": {
            "name": repo.name if repo.name != "repo" else repo.parent.name,
            "commits": int(git(repo, "rev-list", "--all", "--count")),
        },
        "rows": args.rows,
        "span": args.span,
        "commits": commits,
        "checkout": checkout_size(repo, commits[-1], state / "checkout"),
    }
    client = docker.from_env()
    images: list[str] = []
    report["bursts"] = []

    def bursts(base: str, mode: str, burst_rows: list[dict[str, Any]]) -> None:
        for number in range(1, args.rounds + 1):
            result = asyncio.run(burst(base, token, burst_rows, args.window))
            report["bursts"].append({"mode": mode, "round": number, **result})
            print(mode, number, result["acquire_s"], result["failed"], flush=True)

    try:
        # Each kind on a stack of its own, one after the other: the warm pools each kind's
        # first burst sizes (64 pools of ~5 sandboxes) do not fit one host's 512 slots
        # together, and a rollout with no pool waits for a slot no idle pool gives up.
        with local_stack(settings, log=state / "stack.log", forget=True) as base:
            prepare_phase(settings, repo, rows, report)
            bursts(base, "rows at a commit", rows)
            report["unseen"] = unseen_phase(settings, base, token, commits, between, args.unseen)
        if not args.skip_images:
            report["images"] = images_phase(settings, client, repo, commits, images)
            other = throwaway_stack_settings(f"bench-im-{uuid.uuid4().hex[:6]}", ENVIRONMENTS)
            other = other.model_copy(update={"admission_wait_s": 600.0, "api_tokens": token})
            image_rows = [
                {"codebase": images[i % len(images)], "expect": commits[i % len(commits)]}
                for i in range(args.rows)
            ]
            with local_stack(other, log=other.state_dir / "stack.log", forget=True) as base:
                bursts(base, "one image per commit", image_rows)
    finally:
        for name in images:
            try:
                remove_codebase(settings, name)
            except Exception as exc:  # noqa: BLE001 (a bench's cleanup goes on)
                print(f"could not remove {name}: {exc}", file=sys.stderr)
    text = markdown(report)
    print(text)
    write_report("datasets", report, text)


if __name__ == "__main__":
    os.environ.setdefault("ORCH_LOG_LEVEL", "WARNING")
    main()
