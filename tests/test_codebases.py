"""Codebase images from directories and git revisions, built and inspected for real."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import docker
import pytest
from docker.errors import ImageNotFound

from orchestrator.config import Settings
from orchestrator.images.base import BaseBuildResult, image_store_lock
from orchestrator.images.codebases import (
    LABEL_COMMIT,
    LABEL_NAME,
    LABEL_REV,
    LABEL_SOURCE,
    CodebaseExists,
    CodebaseSourceError,
    InvalidCodebaseName,
    UnknownCodebase,
    add_codebase,
    codebase_image,
    get_codebase,
    list_codebases,
    remove_codebase,
    validate_name,
)

GIT_ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.com",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.com",
}


@pytest.fixture
def new_name(
    settings: Settings, client: docker.DockerClient, base: BaseBuildResult
) -> Iterator[Callable[[], str]]:
    """Hands out unique codebase names and removes their images afterwards."""
    made: list[str] = []

    def make() -> str:
        name = f"test-{uuid.uuid4().hex[:8]}"
        made.append(name)
        return name

    yield make
    for name in made:
        # The product's removal: it takes the image store from the other worker's builds.
        with contextlib.suppress(UnknownCodebase):
            remove_codebase(settings, name)


def run(
    client: docker.DockerClient, image: str, script: str, volume: str | None = None
) -> tuple[int, str]:
    """Run ``script`` as uid 1000 in /workspace of a networkless container; always remove it."""
    container = client.containers.create(
        image,
        ["bash", "-c", script],
        user="1000:1000",
        network_mode="none",
        working_dir="/workspace",
        volumes={volume: {"bind": "/workspace", "mode": "rw"}} if volume else None,
    )
    try:
        container.start()
        status = container.wait(timeout=60)
        output = container.logs(stdout=True, stderr=True).decode()
        return int(status["StatusCode"]), output
    finally:
        container.remove(force=True)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, env=GIT_ENV, check=True, capture_output=True, text=True
    ).stdout.strip()


def commit_file(repo: Path, name: str, message: str) -> str:
    (repo / name).write_text(f"{message}\n")
    git(repo, "add", name)
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


@pytest.fixture
def history(tmp_path: Path) -> dict[str, str]:
    """A repo with A, B (tag v1), C on main, D on branch feature, a stash and a remote."""
    repo = tmp_path / "src"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    shas = {"repo": str(repo)}
    shas["A"] = commit_file(repo, "a.txt", "A")
    shas["B"] = commit_file(repo, "b.txt", "B")
    git(repo, "tag", "-a", "v1", "-m", "release v1")
    shas["C"] = commit_file(repo, "c.txt", "C")
    git(repo, "checkout", "-q", "-b", "feature")
    shas["D"] = commit_file(repo, "d.txt", "D")
    git(repo, "checkout", "-q", "main")
    (repo / "a.txt").write_text("stashed change\n")
    git(repo, "stash", "-q")
    git(repo, "remote", "add", "origin", "https://example.invalid/repo.git")
    return shas


def image_exists(client: docker.DockerClient, ref: str) -> bool:
    try:
        client.images.get(ref)
    except ImageNotFound:
        return False
    return True


def reachable_objects(repo: Path, rev: str) -> set[str]:
    return {line.split()[0] for line in git(repo, "rev-list", "--objects", rev).splitlines()}


def test_valid_and_invalid_names() -> None:
    for ok in ("a", "0", "my-repo_1.2", "x" * 64):
        assert validate_name(ok) == ok
    for bad in ("", "Upper", "-lead", ".lead", "_lead", "a/b", "a:b", "x" * 65, "sp ace"):
        with pytest.raises(InvalidCodebaseName, match="invalid codebase name"):
            validate_name(bad)


def test_invalid_name_builds_nothing(tmp_path: Path, settings: Settings) -> None:
    with pytest.raises(InvalidCodebaseName):
        add_codebase(settings, "Not-Valid", tmp_path)


def test_codebase_from_directory(
    tmp_path: Path,
    settings: Settings,
    client: docker.DockerClient,
    new_name: Callable[[], str],
) -> None:
    src = tmp_path / "tree"
    (src / "pkg" / "deep").mkdir(parents=True)
    (src / "README.md").write_text("hello\n")
    (src / ".hidden").write_text("dot\n")
    (src / "pkg" / "deep" / "mod.py").write_text("X = 1\n")
    (src / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "run.sh").chmod(0o755)
    (src / "link").symlink_to("README.md")
    name = new_name()

    info = add_codebase(settings, name, src)

    assert info.name == name
    assert info.image == f"{settings.codebase_image_repo}:{name}"
    assert (info.rev, info.commit, info.source) == ("", "", str(src.resolve()))
    assert info.size_bytes > 0 and info.created is not None
    labels = client.images.get(info.image).labels
    assert labels[LABEL_NAME] == name and labels[LABEL_SOURCE] == str(src.resolve())
    assert codebase_image(settings, name) == info.image

    script = (
        "cat README.md .hidden pkg/deep/mod.py && ./run.sh && readlink link && "
        "find . -not -user 1000 -o -not -group 1000 | sed 's/^/notmine:/'; "
        "test -e .git || echo nogit; touch new && echo writable"
    )
    code, out = run(client, info.image, script)
    assert code == 0, out
    for expected in ("hello", "dot", "X = 1", "ran", "README.md", "nogit", "writable"):
        assert expected in out
    assert "notmine:" not in out

    # The sandbox backend mounts a fresh volume at /workspace; Docker seeds it from the image.
    volume = client.volumes.create(f"test-{uuid.uuid4().hex[:8]}")
    try:
        code, out = run(
            client, info.image, "stat -c %u:%g . pkg && touch x && cat README.md", volume.name
        )
        assert code == 0, out
        assert out.split() == ["1000:1000", "1000:1000", "hello"]
    finally:
        volume.remove(force=True)


def test_codebase_from_git_at_old_revision(
    history: dict[str, str],
    settings: Settings,
    client: docker.DockerClient,
    new_name: Callable[[], str],
) -> None:
    repo = Path(history["repo"])
    a = history["A"]
    name = new_name()

    info = add_codebase(settings, name, repo, rev=a[:10])

    assert info.commit == a
    assert info.rev == a[:10]
    labels = client.images.get(info.image).labels
    assert labels[LABEL_COMMIT] == a and labels[LABEL_REV] == a[:10]

    script = """
        echo "log:$(git log --all --format=%H | tr '\\n' ' ')"
        echo "tags:$(git tag | tr '\\n' ' ')"
        echo "branches:$(git branch -a --format='%(refname)' | tr '\\n' ' ')"
        echo "refs:$(git for-each-ref --format='%(refname)' | tr '\\n' ' ')"
        echo "reflog:$(git reflog | tr '\\n' ' ')"
        echo "stash:$(git stash list | tr '\\n' ' ')"
        echo "remotes:$(git remote | tr '\\n' ' ')"
        echo "unreachable:$(git fsck --unreachable --no-reflogs 2>&1 | tr '\\n' ' ')"
        echo "files:$(ls -A | tr '\\n' ' ')"
        echo "gitdir:$(ls -A .git | tr '\\n' ' ')"
        echo "status:$(git status --porcelain | tr '\\n' ' ')"
        echo "head:$(git symbolic-ref HEAD) $(git rev-parse HEAD)"
        echo "owner:$(find . -not -user 1000 | head -3 | tr '\\n' ' ')"
        git cat-file --batch-all-objects --batch-check='%(objectname)' | sed 's/^/object:/'
    """
    code, out = run(client, info.image, script)
    assert code == 0, out
    fields: dict[str, str] = {}
    objects: set[str] = set()
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key == "object":
            objects.add(value)
        else:
            fields[key] = value.strip()

    assert fields["log"] == a
    assert fields["tags"] == ""
    assert fields["branches"] == "refs/heads/main"
    assert fields["refs"] == "refs/heads/main"
    assert fields["reflog"] == ""
    assert fields["stash"] == ""
    assert fields["remotes"] == ""
    assert fields["unreachable"] == ""
    assert fields["files"].split() == [".git", "a.txt"]
    for leak in ("logs", "FETCH_HEAD", "ORIG_HEAD", "packed-refs", "hooks"):
        assert leak not in fields["gitdir"].split()
    assert fields["status"] == ""
    assert fields["head"] == f"refs/heads/main {a}"
    assert fields["owner"] == ""
    assert objects == reachable_objects(repo, a)


def test_codebase_from_git_tag_head_and_bare_repo(
    history: dict[str, str],
    tmp_path: Path,
    settings: Settings,
    client: docker.DockerClient,
    new_name: Callable[[], str],
) -> None:
    repo = Path(history["repo"])
    probe = "git log --all --format=%H | tr '\\n' ' '; echo; ls; git tag"

    at_tag = add_codebase(settings, new_name(), repo, rev="v1")
    assert at_tag.commit == history["B"]
    code, out = run(client, at_tag.image, probe)
    assert code == 0, out
    assert out.split() == [history["B"], history["A"], "a.txt", "b.txt"]

    at_head = add_codebase(settings, new_name(), repo)
    assert (at_head.commit, at_head.rev) == (history["C"], "")
    code, out = run(client, at_head.image, probe)
    assert code == 0, out
    # HEAD is main; the stash changed a.txt only in refs/stash, which must not leak.
    assert out.split() == [history["C"], history["B"], history["A"], "a.txt", "b.txt", "c.txt"]
    code, out = run(client, at_head.image, "cat a.txt")
    assert out.strip() == "A"

    # A linked work tree has a .git file, not a directory; it is still a git source.
    worktree = tmp_path / "wt"
    git(repo, "worktree", "add", "-q", str(worktree), "feature")
    from_worktree = add_codebase(settings, new_name(), worktree)
    assert from_worktree.commit == history["D"]

    # A directory inside a work tree, without a .git of its own, is copied as a plain tree.
    (repo / "sub").mkdir()
    (repo / "sub" / "inner.txt").write_text("inner\n")
    nested = add_codebase(settings, new_name(), repo / "sub")
    assert nested.commit == ""
    code, out = run(client, nested.image, "ls -A")
    assert out.split() == ["inner.txt"]

    bare = tmp_path / "bare.git"
    git(tmp_path, "clone", "-q", "--bare", str(repo), str(bare))
    from_bare = add_codebase(settings, new_name(), bare, rev="feature")
    assert from_bare.commit == history["D"]
    code, out = run(client, from_bare.image, probe)
    assert code == 0, out
    assert out.split()[:4] == [history["D"], history["C"], history["B"], history["A"]]
    assert "d.txt" in out.split()


def test_unknown_revision_builds_nothing(
    history: dict[str, str],
    settings: Settings,
    client: docker.DockerClient,
    new_name: Callable[[], str],
) -> None:
    name = new_name()
    for rev in ("no-such-branch", "0" * 40, "--all"):
        with pytest.raises(CodebaseSourceError, match=r"revision"):
            add_codebase(settings, name, history["repo"], rev=rev)
    assert not image_exists(client, f"{settings.codebase_image_repo}:{name}")


def test_bad_sources_build_nothing(
    tmp_path: Path,
    settings: Settings,
    client: docker.DockerClient,
    new_name: Callable[[], str],
) -> None:
    name = new_name()
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    for source in (tmp_path / "missing", a_file):
        with pytest.raises(CodebaseSourceError, match="not a directory"):
            add_codebase(settings, name, source)
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(CodebaseSourceError, match="plain directory"):
        add_codebase(settings, name, plain, rev="main")
    assert not image_exists(client, f"{settings.codebase_image_repo}:{name}")


def test_add_existing_needs_replace_and_ls_rm(
    tmp_path: Path,
    settings: Settings,
    client: docker.DockerClient,
    new_name: Callable[[], str],
) -> None:
    (tmp_path / "f.txt").write_text("one\n")
    name, other = new_name(), new_name()
    first = add_codebase(settings, name, tmp_path)
    add_codebase(settings, other, tmp_path)

    with pytest.raises(CodebaseExists, match="--replace"):
        add_codebase(settings, name, tmp_path)
    (tmp_path / "f.txt").write_text("two\n")
    second = add_codebase(settings, name, tmp_path, replace=True)
    assert second.image_id != first.image_id
    # The replaced image had no other tag and no users, so it is gone, not left dangling.
    assert not image_exists(client, first.image_id)

    listed = {info.name: info for info in list_codebases(settings)}
    assert listed[name].image_id == second.image_id
    assert other in listed

    remove_codebase(settings, name)
    assert name not in {info.name for info in list_codebases(settings)}
    with pytest.raises(UnknownCodebase):
        get_codebase(settings, name)
    with pytest.raises(UnknownCodebase):
        codebase_image(settings, name)
    with pytest.raises(UnknownCodebase, match="unknown codebase"):
        remove_codebase(settings, name)
    assert get_codebase(settings, other).name == other


def test_image_without_codebase_label_is_not_a_codebase(
    settings: Settings,
    client: docker.DockerClient,
    base: BaseBuildResult,
    new_name: Callable[[], str],
) -> None:
    name = new_name()
    client.images.get(base.image).tag(settings.codebase_image_repo, tag=name)
    with pytest.raises(UnknownCodebase):
        get_codebase(settings, name)
    assert name not in {info.name for info in list_codebases(settings)}


def test_cli_add_ls_rm(
    tmp_path: Path,
    settings: Settings,
    client: docker.DockerClient,
    new_name: Callable[[], str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from typer.testing import CliRunner

    from orchestrator.cli import app
    from orchestrator.config import get_settings

    # The CLI reads settings from the environment; keep its build scratch in the test's dir.
    monkeypatch.setenv("ORCH_STATE_DIR", str(settings.state_dir))
    get_settings.cache_clear()
    monkeypatch.setattr("orchestrator.cli.codebase.get_settings", get_settings)

    (tmp_path / "f.txt").write_text("x\n")
    name = new_name()
    runner = CliRunner()

    result = runner.invoke(app, ["codebase", "add", name, str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert name in result.output

    result = runner.invoke(app, ["codebase", "ls"])
    assert result.exit_code == 0, result.output
    header, *rows = result.output.splitlines()
    assert header.split() == ["NAME", "IMAGE", "ID", "COMMIT", "SOURCE", "SIZE"]
    assert any(row.split()[0] == name and str(tmp_path) in row for row in rows)

    result = runner.invoke(app, ["codebase", "add", "Bad/Name", str(tmp_path)])
    assert result.exit_code == 1
    assert "invalid codebase name" in result.output

    result = runner.invoke(app, ["codebase", "rm", name])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["codebase", "rm", name])
    assert result.exit_code == 1
    assert "unknown codebase" in result.output
    assert not image_exists(client, f"{settings.codebase_image_repo}:{name}")
    get_settings.cache_clear()


def _look_alike_tree(tmp_path: Path) -> Path:
    """A tree every caller makes the same: its codebases share every build step's cache."""
    tree = tmp_path / "same"
    (tree / "src").mkdir(parents=True)
    (tree / "README.md").write_text("look-alike\n")
    (tree / "src" / "a.py").write_text("x = 1\n")
    return tree


def test_look_alike_codebases_added_and_removed_at_once_all_succeed(
    tmp_path: Path, settings: Settings, new_name: Callable[[], str]
) -> None:
    """Two trainers adding and removing codebases of the same contents at the same time:
    a removal prunes its image's untagged parents, which are the cached layers the other
    build is taking. Without the image store's lock, 3 of 24 adds failed here ("failed to
    get digest ...: no such file")."""
    tree = _look_alike_tree(tmp_path)
    errors: list[str] = []

    def add_and_remove() -> None:
        for _ in range(4):
            name = new_name()
            try:
                add_codebase(settings, name, tree)
                remove_codebase(settings, name)
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                errors.append(f"{name}: {exc}")

    threads = [threading.Thread(target=add_and_remove) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


def test_a_removal_waits_for_the_builds_under_way(
    tmp_path: Path, settings: Settings, client: docker.DockerClient, new_name: Callable[[], str]
) -> None:
    """Deterministically, what the test above finds by chance: while a build holds the image
    store (shared), a removal does not start; it ends once the build is done."""
    name = new_name()
    add_codebase(settings, name, _look_alike_tree(tmp_path))
    removed = threading.Event()

    def remove() -> None:
        remove_codebase(settings, name)
        removed.set()

    with image_store_lock(client, exclusive=False):  # as run_build holds it
        remover = threading.Thread(target=remove)
        remover.start()
        # Long enough for an unlocked removal to finish many times over (about 0.1 s).
        time.sleep(1.0)
        assert not removed.is_set(), "the removal ran while a build held the image store"
    remover.join(timeout=60)
    assert removed.is_set()
    with pytest.raises(UnknownCodebase):
        get_codebase(settings, name)
