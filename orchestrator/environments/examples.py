"""The FinQA-style example: its corpus as codebase ``finqa-corpus``.

The corpus lives in the source tree at ``examples/finqa/corpus`` (synthetic reports) with a
small dataset beside it (``examples/finqa/dataset.jsonl``). The ``finqa-demo`` environment
runs it as a fixed codebase; :func:`ensure_finqa_corpus` builds that codebase when it is
missing or older than the corpus files.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from orchestrator.config import Settings
from orchestrator.images.base import Progress
from orchestrator.images.codebases import (
    CodebaseError,
    CodebaseExists,
    UnknownCodebase,
    add_codebase,
    get_codebase,
)

_LABEL_PRECISION = timedelta(seconds=1)

FINQA_CODEBASE = "finqa-corpus"
"""The codebase name the ``finqa-demo`` environment runs."""

# orchestrator/environments/examples.py -> the repository root holds examples/.
_REPO_ROOT = Path(__file__).resolve().parents[2]


def finqa_example_dir() -> Path:
    """``examples/finqa`` in the source tree (corpus/ and dataset.jsonl)."""
    return _REPO_ROOT / "examples" / "finqa"


def _newest_mtime(tree: Path) -> datetime:
    newest = max((p.stat().st_mtime for p in tree.rglob("*") if p.is_file()), default=0.0)
    return datetime.fromtimestamp(newest, UTC)


def ensure_finqa_corpus(
    settings: Settings,
    *,
    corpus_dir: Path | None = None,
    progress: Progress | None = None,
) -> str:
    """Make sure codebase ``finqa-corpus`` exists and is current; return its image.

    Built from ``corpus_dir`` (default ``examples/finqa/corpus``) when missing, and rebuilt
    when a corpus file is newer than the image, so an edited corpus is never served stale.
    Safe to call from several processes at once: whoever loses the race to build a missing
    codebase uses the winner's.
    """
    source = corpus_dir if corpus_dir is not None else finqa_example_dir() / "corpus"
    if not source.is_dir():
        raise CodebaseError(f"the FinQA corpus is missing: {source} is not a directory")
    try:
        info = get_codebase(settings, FINQA_CODEBASE)
    except UnknownCodebase:
        info = None
    if info is not None:
        # The label stores the build's start to the second (rounded down): a file older
        # than created + 1 s was already in the build. Only an edit within that same second
        # after the build could be missed.
        if info.created is not None and _newest_mtime(source) <= info.created + _LABEL_PRECISION:
            return info.image
        return add_codebase(settings, FINQA_CODEBASE, source, replace=True, progress=progress).image
    try:
        return add_codebase(settings, FINQA_CODEBASE, source, progress=progress).image
    except CodebaseExists:
        return get_codebase(settings, FINQA_CODEBASE).image


REQUESTS_CODEBASE = "requests"
"""The codebase of the file-localisation example: the `requests` library's source."""


def planning_example_dir() -> Path:
    """``examples/codebase_planning`` in the source tree (dataset.jsonl, agent.py)."""
    return _REPO_ROOT / "examples" / "codebase_planning"


def ensure_requests_codebase(settings: Settings, name: str = REQUESTS_CODEBASE) -> str:
    """Make sure a codebase holding the real `requests` library exists; return its image.

    The source is the `requests` package installed beside this orchestrator (offline, real
    code), committed as a git repository under ``src/requests`` so the agent can use git too.
    """
    import shutil
    import subprocess
    import tempfile

    import requests

    try:
        return get_codebase(settings, name).image
    except UnknownCodebase:
        pass
    with tempfile.TemporaryDirectory(prefix="orch-requests-") as tmp:
        repo = Path(tmp) / "requests"
        shutil.copytree(
            Path(requests.__file__).parent,
            repo / "src" / "requests",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        (repo / "README.md").write_text(f"requests {requests.__version__}, for the examples\n")
        env = {
            "GIT_AUTHOR_NAME": "orchestrator",
            "GIT_AUTHOR_EMAIL": "orchestrator@localhost",
            "GIT_COMMITTER_NAME": "orchestrator",
            "GIT_COMMITTER_EMAIL": "orchestrator@localhost",
            "HOME": tmp,
            "PATH": "/usr/bin:/bin",
        }
        for args in (
            ["init", "-q", "-b", "main"],
            ["add", "-A"],
            ["commit", "-qm", f"requests {requests.__version__}"],
        ):
            subprocess.run(["git", "-C", str(repo), *args], check=True, env=env)
        try:
            return add_codebase(settings, name, repo).image
        except CodebaseExists:
            return get_codebase(settings, name).image
