"""``orchestrator repo ...`` (register, list and remove repositories rows name at a
commit) and ``orchestrator dataset prepare`` (every row's commit made ready on every host
before a run): docs/datasets.md."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from pydantic import ValidationError
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from orchestrator.cli import audit
from orchestrator.config import Settings, get_settings
from orchestrator.environments.loader import row_commit
from orchestrator.sandbox.backend import RepoSetup
from orchestrator.sandbox.repos import HostRepos, RepoError, check_source
from orchestrator.state.audit import AuditEvent
from orchestrator.state.broker import celery_app
from orchestrator.state.records import RolloutStore
from orchestrator.state.replies import QueueTimeout, WorkerClient
from orchestrator.state.repos import RepoRecord, RepoRegistry
from orchestrator.state.wire import CheckCommit, CommitChecked, Tasks

app = typer.Typer(
    help="Register repositories that dataset rows name at a commit.", no_args_is_help=True
)
dataset_app = typer.Typer(help="Bring a dataset's rows up before a run.", no_args_is_help=True)

T = TypeVar("T")


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(1)


def _with_registry(settings: Settings, run: Callable[[RepoRegistry], Awaitable[T]]) -> T:
    async def main() -> T:
        store = RolloutStore.connect(settings, role="cli")
        try:
            return await run(RepoRegistry(store.redis, store.keys))
        finally:
            await store.close()

    return asyncio.run(main())


@app.command("add")
def add(
    name: Annotated[str, typer.Argument(help="Its name in rows: [a-z0-9][a-z0-9._-]{0,63}.")],
    source: Annotated[
        str,
        typer.Argument(help="A local git repository, or a URL ORCH_REPO_ALLOWED_URLS allows."),
    ],
    replace: Annotated[bool, typer.Option(help="Register it again (another source).")] = False,
    setup_command: Annotated[
        list[str] | None,
        typer.Option(help="A set-up command (repeat for more), run as root in /opt/setup."),
    ] = None,
    dockerfile: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="A set-up Dockerfile instead."),
    ] = None,
    deps: Annotated[
        list[str] | None,
        typer.Option(help="A file whose contents decide the set-up (repeat for more)."),
    ] = None,
    wheelhouse: Annotated[
        Path | None,
        typer.Option(file_okay=False, help="A directory of wheels, the same on every host."),
    ] = None,
) -> None:
    """Register a repository: fetched once on this host to check it, then by every host
    the first time a row names one of its commits (or at `orchestrator dataset prepare`).
    With a set-up (--setup-command or --dockerfile, --deps, --wheelhouse), its
    dependencies are installed once per fingerprint into the image its sandboxes run."""
    settings = get_settings()
    setup = None
    if setup_command or dockerfile or deps or wheelhouse:
        if wheelhouse is not None and not wheelhouse.is_dir():
            raise _fail(f"the wheelhouse {wheelhouse} is not a directory")
        try:
            setup = RepoSetup(
                commands=setup_command or [],
                dockerfile=dockerfile.read_text() if dockerfile else "",
                deps=deps or [],
                wheelhouse=str(wheelhouse.resolve()) if wheelhouse else "",
            )
        except ValidationError as exc:
            raise _fail(f"the set-up: {exc.errors()[0]['msg']}") from exc
    try:
        checked = check_source(source, settings.repo_url_prefixes)
        repos = HostRepos.of(settings)
        started = time.monotonic()
        head, commits = repos.fetch(name, checked)
    except RepoError as exc:
        raise _fail(str(exc)) from exc
    record = RepoRecord(name=name, source=checked, commits=commits, head=head, setup=setup)
    if not _with_registry(settings, lambda r: r.add(record, replace=replace)):
        raise _fail(f"repository {name!r} is registered already; --replace to change its source")
    typer.echo(
        f"repository {name}: {checked} ({commits} commits, HEAD {head[:12]}; fetched in "
        f"{time.monotonic() - started:.1f} s)"
    )
    audit.record(
        settings,
        AuditEvent.REPOSITORY_ADDED,
        repository=name,
        source=checked,
        head=head,
        replaced=replace,
    )


@app.command("ls")
def ls(json_: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """The registered repositories."""
    records = _with_registry(get_settings(), lambda r: r.registered())
    if json_:
        typer.echo(json.dumps([r.model_dump(mode="json") for r in records], indent=2))
        return
    for record in records:
        typer.echo(f"{record.name}\t{record.commits} commits\t{record.source}")


@app.command("rm")
def rm(name: Annotated[str, typer.Argument(help="A registered repository.")]) -> None:
    """Forget a repository (rollouts already on it go on; its layers stay on the hosts
    until the disk budget evicts them)."""
    settings = get_settings()
    if not _with_registry(settings, lambda r: r.remove(name)):
        raise _fail(f"no repository {name!r} is registered")
    typer.echo(f"repository {name} removed")
    audit.record(settings, AuditEvent.REPOSITORY_REMOVED, repository=name)


# --- dataset prepare -------------------------------------------------------------------------


@dataclass
class RowProblem:
    line: int
    reason: str


@dataclass
class Plan:
    """What a dataset needs: its distinct (repository, commit) pairs and the rows of each."""

    pairs: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    problems: list[RowProblem] = field(default_factory=list)
    rows: int = 0


def read_dataset(path: Path) -> Plan:
    """The rows of a JSONL dataset that name a repository at a commit (others are not
    this command's), and each row that cannot be read, by line."""
    plan = Plan()
    with path.open() as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            plan.rows += 1
            try:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"not JSON: {exc}") from None
                if not isinstance(row, dict):
                    raise ValueError("a row is a JSON object")
                wanted = row_commit(row)
            except ValueError as exc:
                plan.problems.append(RowProblem(number, str(exc)))
                continue
            if wanted is not None:
                plan.pairs.setdefault(wanted, []).append(number)
    return plan


async def _prepare(
    settings: Settings, plan: Plan, parallel: int, progress: Progress
) -> tuple[list[RowProblem], int]:
    store = RolloutStore.connect(settings, role="cli")
    queue = WorkerClient(settings, celery_app(), store)
    registry = RepoRegistry(store.redis, store.keys)
    problems: list[RowProblem] = []
    try:
        hosts = [h.host for h in await queue.heartbeats.live()]
        if not hosts:
            raise RepoError("no live worker host to prepare the rows on")
        records: dict[str, RepoRecord | None] = {}
        for name, _ in plan.pairs:
            if name not in records:
                records[name] = await registry.get(name)
        pairs: list[tuple[RepoRecord, str, list[int]]] = []
        for (name, commit), lines in plan.pairs.items():
            record = records[name]
            if record is None:
                problems += [RowProblem(n, f"unknown repository {name!r}") for n in lines]
                continue
            pairs.append((record, commit, lines))
        found: dict[tuple[str, str], CommitChecked] = {}
        built = 0

        async def ask(host: str, record: RepoRecord, commit: str, build: bool) -> CommitChecked:
            request = CheckCommit(workspace=record.at(commit), materialise=build)
            try:
                return await queue.call(
                    Tasks.CHECK_COMMIT,
                    request,
                    host=host,
                    timeout_s=settings.sandbox_create_timeout_s * 10,
                )
            except QueueTimeout as exc:
                return CommitChecked(host=host, error=f"no answer: {exc}")

        def problem(checked: CommitChecked, record: RepoRecord, commit: str) -> str | None:
            if checked.error is not None:
                return f"host {checked.host}: {checked.error}"
            if not checked.found:
                return f"repository {record.name!r} has no commit {commit}"
            if checked.setup_error is not None:
                return f"host {checked.host}: {checked.setup_error[-1000:]}"
            return None

        # First each commit looked up once (its set-up image built there), then built on
        # every host oldest first: a commit built after its ancestors is a small layer on
        # them, one built before them a base of its own (sandbox/repos.py).
        looking = progress.add_task("looking commits up", total=len(pairs))
        gate = asyncio.Semaphore(parallel * len(hosts))

        async def look(record: RepoRecord, commit: str, lines: list[int]) -> None:
            async with gate:
                checked = await ask(hosts[0], record, commit, build=False)
            progress.advance(looking)
            why = problem(checked, record, commit)
            if why is None:
                found[(record.name, commit)] = checked
            else:
                problems.extend(RowProblem(n, why) for n in lines)

        await asyncio.gather(*(look(*pair) for pair in pairs))
        ready = sorted(
            (p for p in pairs if (p[0].name, p[1]) in found),
            key=lambda p: found[(p[0].name, p[1])].committed_at,
        )
        building = progress.add_task("materialising", total=len(ready) * len(hosts))
        gates = {host: asyncio.Semaphore(parallel) for host in hosts}
        failed: set[tuple[str, str]] = set()

        async def build(host: str, record: RepoRecord, commit: str, lines: list[int]) -> None:
            nonlocal built
            async with gates[host]:
                checked = await ask(host, record, commit, build=True)
            progress.advance(building)
            built += checked.built
            why = problem(checked, record, commit)
            if why is not None:
                failed.add((record.name, commit))
                problems.extend(RowProblem(n, why) for n in lines)

        await asyncio.gather(*(build(host, *pair) for pair in ready for host in hosts))
        for name in {n for n, _ in found}:
            images = {
                c: checked.setup_image
                for (n, c), checked in found.items()
                if n == name and (n, c) not in failed
            }
            await registry.remember(name, images)
    finally:
        await store.close()
    return problems, built


@dataset_app.command("prepare")
def prepare(
    dataset: Annotated[Path, typer.Argument(help="A JSONL file of rows.", exists=True)],
    parallel: Annotated[
        int, typer.Option(min=1, max=64, help="Commits built at once per host.")
    ] = 2,
) -> None:
    """Make every row's repository at its commit ready on every live host, so no
    rollout pays for it at a step boundary. Resumable: a commit ready on a host is not
    built again, and a second run is a no-op. Exit 1 naming each row that failed."""
    settings = get_settings()
    plan = read_dataset(dataset)
    started = time.monotonic()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, transient=True) as progress:
        try:
            problems, built = asyncio.run(_prepare(settings, plan, parallel, progress))
        except RepoError as exc:
            raise _fail(str(exc)) from exc
    unique = {(p.line, p.reason): p for p in [*plan.problems, *problems]}
    problems = sorted(unique.values(), key=lambda p: p.line)
    for problem in problems:
        typer.echo(f"{dataset}:{problem.line}: {problem.reason}", err=True)
    bad = {p.line for p in problems}
    typer.echo(
        f"{plan.rows} rows, {len(plan.pairs)} commits: {plan.rows - len(bad)} rows ready, "
        f"{len(bad)} failed; {built} built on the hosts, the rest ready already "
        f"({time.monotonic() - started:.1f} s)"
    )
    if bad:
        raise typer.Exit(1)
