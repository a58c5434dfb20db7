"""sandbox/repos.py on real git history and this host's real overlay mounts (the suite
runs as root): each commit's stack of layers, mounted as a sandbox's /workspace is, is
exactly that commit's tree with exactly its history, whatever order commits are
materialised in; concurrent materialisations build once; the disk budget evicts the least
recently used; sources are checked. End to end through rollouts: tests/e2e/test_repos.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.sandbox.docker import mounts
from orchestrator.sandbox.repos import (
    HostRepos,
    RepoSourceError,
    UnknownCommit,
    check_commit,
    check_source,
)
from tests import repo_history
from tests.repo_history import SECRET, History

NAME = "history"


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> History:
    return repo_history.build(tmp_path_factory.mktemp("source"))


@pytest.fixture()
def repos(tmp_path: Path) -> HostRepos:
    return HostRepos(tmp_path / "repos", budget_bytes=1 << 30, allowed_urls=[])


@pytest.fixture()
def view(tmp_path: Path) -> Iterator[Path]:
    """A directory a commit's stack is mounted on, as a sandbox's /workspace is (with a
    writable upper layer: git may refresh its index)."""
    point = tmp_path / "workspace"
    for part in ("workspace", "upper", "work"):
        (tmp_path / part).mkdir()
    yield point
    mounts.unmount_all(point)


def _mounted(repos: HostRepos, commit: str, point: Path) -> Path:
    mounts.unmount_all(point)
    upper, work = point.parent / "upper", point.parent / "work"
    for layer in (upper, work):
        shutil.rmtree(layer)
        layer.mkdir()
    mounts.mount_overlay(point, repos.lowers(NAME, commit), upper, work)
    return point


def _git(tree: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "safe.directory=*", *args],
        cwd=tree,
        check=True,
        capture_output=True,
        text=True,
        errors="replace",  # tree objects are binary
        env={
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null",
            "PATH": os.environ["PATH"],
        },
    ).stdout


def _listing(root: Path) -> dict[str, tuple[str, str]]:
    """Every path under ``root`` but .git: its kind and mode, and contents or target."""
    found: dict[str, tuple[str, str]] = {}
    for directory, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(directory, root)
        if rel == ".git" or rel.startswith(".git/"):
            continue
        for name in dirnames + filenames:
            path = Path(directory) / name
            key = os.path.normpath(os.path.join(rel, name))
            if key == ".git":
                continue
            if path.is_symlink():
                found[key] = ("link", os.readlink(path))
            elif path.is_dir():
                found[key] = ("dir", "")
            else:
                mode = "x" if os.access(path, os.X_OK) and path.stat().st_mode & 0o100 else "-"
                found[key] = (f"file{mode}", path.read_text())
    return found


def _checkout(history: History, commit: str, into: Path) -> Path:
    """The commit as `git archive` gives it: what the sandbox must see."""
    into.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(history.repo), "archive", commit], check=True, capture_output=True
    ).stdout
    archive_path = into.parent / f"{into.name}.tar"
    archive_path.write_bytes(archive)
    with tarfile.open(archive_path) as tar:
        tar.extractall(into, filter="tar")
    return into


def _check_exact(history: History, commit: str, tree: Path, scratch: Path) -> None:
    expected = _listing(_checkout(history, commit, scratch / f"expected-{commit[:8]}"))
    assert _listing(tree) == expected
    assert _git(tree, "rev-parse", "HEAD").strip() == commit
    assert _git(tree, "for-each-ref", "--format=%(refname)").split() == ["refs/heads/main"]
    wanted = _git(history.repo, "rev-list", commit).split()
    assert _git(tree, "rev-list", "--all", "--reflog").split() == wanted
    reachable = {
        line.split()[0] for line in _git(history.repo, "rev-list", "--objects", commit).splitlines()
    }
    stored = set(
        _git(tree, "cat-file", "--batch-all-objects", "--batch-check=%(objectname)").split()
    )
    assert stored == reachable
    everything = _git(tree, "cat-file", "--batch-all-objects", "--batch=%(objectname)")
    assert SECRET not in everything
    assert _git(tree, "status", "--porcelain") == ""
    _git(tree, "fsck", "--strict")
    for leftover in ("logs", "hooks", "FETCH_HEAD", "ORIG_HEAD", "packed-refs"):
        assert not (tree / ".git" / leftover).exists(), leftover


def test_each_commit_is_its_tree_and_its_history_only(
    repos: HostRepos, history: History, view: Path, tmp_path: Path
) -> None:
    """Materialised oldest first, each commit is a layer on the one before (files that
    changed, whiteouts for those gone, a pack of the new objects): stacks 1 to 4 deep."""
    for depth, commit in enumerate(history.commits, start=1):
        done = repos.materialise(NAME, str(history.repo), commit)
        assert done.built and done.layer.depth == depth
        assert len(done.lowers) == depth
        _check_exact(history, commit, _mounted(repos, commit, view), tmp_path)
    again = repos.materialise(NAME, str(history.repo), history.commits[-1])
    assert not again.built
    # Later layers hold what changed only (the first holds the whole tree and pack).
    layers = [repos.layer_record(NAME, c) for c in history.commits]
    assert all(layer is not None for layer in layers)
    assert max(layer.files for layer in layers[1:] if layer) < layers[0].files  # type: ignore[union-attr]


def test_commits_out_of_order_get_their_own_bases(
    repos: HostRepos, history: History, view: Path, tmp_path: Path
) -> None:
    """A commit whose ancestors are not here yet gets a base layer; an ancestor made
    after a descendant is no layer on the descendant (whose objects are later history)."""
    newest, oldest = history.commits[-1], history.commits[0]
    assert repos.materialise(NAME, str(history.repo), newest).layer.base is None
    assert repos.materialise(NAME, str(history.repo), oldest).layer.base is None
    middle = repos.materialise(NAME, str(history.repo), history.commits[2])
    assert middle.layer.base == oldest
    for commit in (newest, oldest, history.commits[2]):
        _check_exact(history, commit, _mounted(repos, commit, view), tmp_path)


def test_the_stack_is_capped_by_what_the_mount_options_hold(repos: HostRepos) -> None:
    depth = repos.max_depth(NAME)
    longest = len(str(repos.layer_dir(NAME, "0" * 40) / "tree")) + 1
    assert depth >= 2 and depth * longest <= 3000


def test_concurrent_materialisations_of_one_commit_build_it_once(
    repos: HostRepos, history: History
) -> None:
    results = []
    start = threading.Barrier(8)

    def materialise() -> None:
        start.wait()
        results.append(repos.materialise(NAME, str(history.repo), history.commits[1]))

    threads = [threading.Thread(target=materialise) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8
    assert sum(r.built for r in results) == 1
    assert len({tuple(r.lowers) for r in results}) == 1


def test_a_commit_the_source_lacks_is_unknown_and_a_new_one_is_fetched(
    repos: HostRepos, history: History, tmp_path: Path
) -> None:
    source = tmp_path / "moving"
    shutil.copytree(history.repo, source, symlinks=True)
    moving = History(repo=source, commits=history.commits, later="", branch="")
    repos.fetch(NAME, str(source))
    assert not repos.has_commit(NAME, str(source), "0" * 40)
    with pytest.raises(UnknownCommit):
        repos.materialise(NAME, str(source), "1" * 40)
    assert not (repos.root / NAME / "layers" / ("1" * 40)).exists()
    added = repo_history.add_commit(moving, "late.txt", "late\n")
    assert repos.has_commit(NAME, str(source), added)  # fetched again on the miss
    assert repos.materialise(NAME, str(source), added).built


def test_the_budget_evicts_the_least_recently_used_and_never_a_base_or_a_sandbox_s(
    tmp_path: Path, history: History
) -> None:
    repos = HostRepos(tmp_path / "repos", budget_bytes=1, allowed_urls=[])
    made = [repos.materialise(NAME, str(history.repo), c) for c in history.commits]
    # Used within the grace period: nothing goes, over budget or not.
    assert {r.commit for r in repos.usage(NAME)[NAME]} == set(history.commits)
    long_ago = time.time() - 3600
    for commit in history.commits:
        path = repos.root / NAME / "commits" / f"{commit}.json"
        os.utime(path, (long_ago, long_ago))
    top = made[-1].lowers[0]
    # The newest commit's layer is in a sandbox: its stack stays, being its bases.
    assert repos.evict(NAME, in_use=lambda: {top}) == []
    evicted = repos.evict(NAME)
    assert evicted == list(reversed(history.commits))  # each leaf, then its base
    assert repos.usage(NAME)[NAME] == []
    assert not any((repos.root / NAME / "layers").iterdir())


def test_sources_and_commits_are_checked(tmp_path: Path, history: History) -> None:
    assert check_source(str(history.repo), []) == str(history.repo.resolve())
    with pytest.raises(RepoSourceError, match="ORCH_REPO_ALLOWED_URLS"):
        check_source("https://example.com/x.git", [])
    with pytest.raises(RepoSourceError, match="ORCH_REPO_ALLOWED_URLS"):
        check_source("https://evil.example.com/x.git", ["https://example.com/"])
    assert check_source("https://example.com/x.git", ["https://example.com/"])
    with pytest.raises(RepoSourceError):
        check_source("ext::sh -c touch% /tmp/pwned", ["ext::"])
    with pytest.raises(RepoSourceError, match="not a directory"):
        check_source(str(tmp_path / "missing"), [])
    with pytest.raises(ValueError, match="40-character"):
        check_commit("HEAD")
    with pytest.raises(ValueError, match="40-character"):
        check_commit(history.commits[0][:12])
    repos = HostRepos(tmp_path / "repos", budget_bytes=1 << 30, allowed_urls=[])
    with pytest.raises(RepoSourceError, match="invalid repository name"):
        repos.store("../etc")


def test_another_source_under_the_same_name_starts_a_new_store(
    repos: HostRepos, history: History, tmp_path: Path
) -> None:
    # (another title: built in the same second as ``history``, it would be the same commits)
    other = repo_history.build(tmp_path / "other", title="other")
    repos.fetch(NAME, str(history.repo))
    assert repos.has_commit(NAME, str(history.repo), history.later)
    assert not repos.has_commit(NAME, str(other.repo), history.later)
    assert repos.has_commit(NAME, str(other.repo), other.later)


def test_a_sandbox_s_pristine_workspace_is_its_whole_stack(
    repos: HostRepos, history: History, tmp_path: Path
) -> None:
    """What the SWE-style grader restores from (sandbox/testrun.py): a stack of layers is
    mounted read-only for the length of the block, and gone after it."""
    from orchestrator.sandbox.docker.workspace import Workspaces

    for commit in history.commits:
        lowers = repos.materialise(NAME, str(history.repo), commit).lowers
    workspaces = Workspaces(None, tmp_path / "state", "t")  # type: ignore[arg-type]
    workspaces.volume_options(lowers, "sbx-0123")
    assert workspaces.lowers_of("sbx-0123") == lowers and len(lowers) == 4
    expected = _listing(_checkout(history, history.commits[-1], tmp_path / "expected"))
    with workspaces.pristine("sbx-0123") as tree:
        assert _listing(tree) == expected
        assert mounts.mounted_at(tree) == 1
    assert not tree.exists()
    workspaces.remove("sbx-0123")
