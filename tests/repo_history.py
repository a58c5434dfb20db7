"""A small git repository whose history has every kind of change a commit's layer must get
right (tests/test_repos.py, tests/e2e/test_repos.py): files changed, added and deleted, a
whole directory deleted, a directory that becomes a file, an executable bit dropped, a
symlink; and after the commits rows name, history no sandbox may see: a later commit on
main, a branch and a tag, each holding :data:`SECRET`.

Built here, not vendored: ``build(root)`` writes and commits it (about 100 ms).
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

SECRET = "the-answer-is-in-a-later-commit-4242"
"""Text only commits after the ones rows name hold."""


@dataclass(frozen=True)
class History:
    repo: Path
    commits: list[str]
    """Oldest first: the commits rows name."""
    later: str
    """A commit on main after them (holds SECRET)."""
    branch: str
    """The tip of another branch (holds SECRET), tagged ``v-secret`` too."""


def git(repo: Path, *args: str) -> str:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
    }
    done = subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env
    )
    return done.stdout


def commit_all(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", message)
    return git(repo, "rev-parse", "HEAD").strip()


def build(root: Path, title: str = "history") -> History:
    """The history under ``root``. Commits take the clock's second: two built in one second
    with one ``title`` are the same commits (give another ``title`` for another history)."""
    repo = root / "history"
    (repo / "src").mkdir(parents=True)
    (repo / "docs").mkdir()
    (repo / "data").mkdir()
    (repo / "scripts").mkdir()
    (repo / "README.md").write_text(f"# {title}\n")
    (repo / ".config").mkdir()
    (repo / ".config" / "old.toml").write_text("old = true\n")
    (repo / ".config" / "kept.toml").write_text("kept = true\n")
    (repo / "src" / "app.py").write_text("print('v1')\n")
    (repo / "src" / "util.py").write_text("def util():\n    return 1\n")
    (repo / "docs" / "a.md").write_text("a\n")
    (repo / "docs" / "b.md").write_text("b\n")
    (repo / "data" / "x.txt").write_text("x\n")
    run = repo / "scripts" / "run.sh"
    run.write_text("#!/bin/sh\necho run\n")
    run.chmod(0o755)
    (repo / "readme-link").symlink_to("README.md")
    git(repo, "init", "-q", "-b", "main")
    first = commit_all(repo, "first")

    (repo / "src" / "app.py").write_text("print('v2')\n")
    (repo / "docs" / "b.md").unlink()
    (repo / ".config" / "old.toml").unlink()  # under a dot directory: its whiteout too
    (repo / "data" / "y.txt").write_text("y\n")
    second = commit_all(repo, "second: app v2, docs/b gone, data/y")

    for path in (repo / "docs").iterdir():
        path.unlink()
    (repo / "docs").rmdir()
    for path in (repo / "data").iterdir():
        path.unlink()
    (repo / "data").rmdir()
    (repo / "data").write_text("data is a file now\n")
    run.chmod(0o644)
    third = commit_all(repo, "third: docs gone, data a file, run.sh not executable")

    (repo / "src" / "new.py").write_text("NEW = True\n")
    (repo / "README.md").write_text("# history\n\nfour commits\n")
    (repo / "readme-link").unlink()
    (repo / "readme-link").symlink_to("src/new.py")
    fourth = commit_all(repo, "fourth: src/new.py, README, the link moved")

    git(repo, "checkout", "-qb", "future")
    (repo / "ANSWER.txt").write_text(f"{SECRET} (branch)\n")
    branch = commit_all(repo, "a branch after them")
    git(repo, "tag", "v-secret")
    git(repo, "checkout", "-q", "main")
    (repo / "src" / "app.py").write_text(f"print('{SECRET}')\n")
    later = commit_all(repo, "later on main")
    return History(repo=repo, commits=[first, second, third, fourth], later=later, branch=branch)


def add_commit(history: History, path: str, text: str) -> str:
    """A new commit on main (the source moved on after a host fetched it)."""
    (history.repo / path).write_text(text)
    return commit_all(history.repo, f"add {path}")
