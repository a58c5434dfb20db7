"""`make flake-hunt`: repeat what a change touched, under load, before it lands.

Picks the test modules to repeat:

- every test module the change touched (added or edited, committed or not);
- every test module that imports a product module the change touched
  (``orchestrator.a.b`` or ``from orchestrator.a import b``);
- the concurrency-heavy modules, always (:data:`ALWAYS`): where races have hidden before.

then runs them ``FLAKE_COUNT`` times each (pytest-repeat), on ``FLAKE_WORKERS`` xdist
workers with groups honoured, beside one busy-looping process per core: a race that needs
a descheduled process shows up here, not one CI run in ten. The change is measured against
``FLAKE_BASE`` (default: the merge base with the upstream branch; on main itself, ``HEAD``
when there are uncommitted changes, else ``HEAD~1``).
``FLAKE_TESTS`` (space-separated paths or node ids) replaces the pick. Extra arguments go to
pytest. Exits with pytest's status.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

ALWAYS = [
    "tests/test_run_as.py",
    "tests/test_isolation.py",
    "tests/test_sandbox_backend.py",
    "tests/test_admission_order.py",
    "tests/test_recycle_wait.py",
    "tests/e2e/test_recycling.py",
    "tests/e2e/test_pools_admission.py",
]
"""Run by every hunt: the modules where concurrency lives (sandboxes made and destroyed
in parallel, slots and pools raced for, the agent's processes)."""


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=False
    ).stdout.strip()


def base_revision() -> str:
    configured = os.environ.get("FLAKE_BASE")
    if configured:
        return configured
    upstream = _git("rev-parse", "--abbrev-ref", "--symbolic-full-name", "@{upstream}")
    if upstream:
        merge_base = _git("merge-base", "HEAD", upstream)
        if merge_base and merge_base != _git("rev-parse", "HEAD"):
            return merge_base
    # Work on main itself: uncommitted changes are the change; else the last commit is.
    return "HEAD" if _git("status", "--porcelain") else "HEAD~1"


def changed_files(base: str) -> list[str]:
    """Files the change touched: committed since ``base``, staged, unstaged, untracked."""
    tracked = _git("diff", "--name-only", base).splitlines()
    untracked = _git("ls-files", "--others", "--exclude-standard").splitlines()
    return sorted({path for path in tracked + untracked if (REPO / path).exists()})


def _test_modules() -> list[Path]:
    return sorted(p for p in (REPO / "tests").rglob("test_*.py") if ".venv" not in p.parts)


def _importers(module: str, modules: list[Path]) -> list[str]:
    """Test modules that import the dotted ``module``, by either spelling."""
    package, _, name = module.rpartition(".")
    spelled = [re.escape(module) + r"\b"]
    if package:
        spelled.append(rf"from {re.escape(package)} import [^\n]*\b{re.escape(name)}\b")
    pattern = re.compile("|".join(spelled))
    return [str(p.relative_to(REPO)) for p in modules if pattern.search(p.read_text())]


def pick(changed: list[str]) -> dict[str, str]:
    """Test module -> why it is picked."""
    modules = _test_modules()
    picked: dict[str, str] = {}
    for path in changed:
        name = Path(path).name
        if path.startswith("tests/") and name.startswith("test_") and path.endswith(".py"):
            picked.setdefault(path, "touched")
        elif path.startswith("orchestrator/") and path.endswith(".py"):
            dotted = path[: -len(".py")].replace("/", ".").removesuffix(".__init__")
            for test in _importers(dotted, modules):
                picked.setdefault(test, f"imports {dotted}")
    for test in ALWAYS:
        picked.setdefault(test, "concurrency-heavy")
    return picked


def by_directory(targets: Iterable[str]) -> list[str]:
    """Each directory's targets together: given tests/e2e/a.py tests/b.py tests/e2e/c.py,
    pytest 9.1 collects c.py without tests/e2e/conftest.py's fixtures ("fixture 'stack'
    not found")."""
    return sorted(targets, key=lambda target: (str(Path(target.split("::")[0]).parent), target))


def main() -> int:
    count = os.environ.get("FLAKE_COUNT", "10")
    workers = os.environ.get("FLAKE_WORKERS", "3")
    chosen = by_directory(os.environ.get("FLAKE_TESTS", "").split())
    if chosen:
        print(f"flake hunt: FLAKE_TESTS names {len(chosen)} targets")
    else:
        base = base_revision()
        changed = changed_files(base)
        picked = pick(changed)
        print(f"flake hunt: {len(changed)} files changed since {base}; repeating:")
        for test, why in sorted(picked.items()):
            print(f"  {test}  ({why})")
        chosen = by_directory(picked)
    cores = os.cpu_count() or 1
    # One busy loop per core, niced so they take what the tests leave rather than starve
    # the daemons outright: the tests' processes get descheduled, as on a loaded CI host.
    hogs = [
        subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", "while True: pass"])
        for _ in range(cores)
    ]
    try:
        command = [
            str(REPO / ".venv" / "bin" / "pytest"),
            "-n",
            workers,
            "--dist",
            "loadgroup",
            "-p",
            "no:cacheprovider",
            "-m",
            "not solo",
            f"--count={count}",
            *chosen,
            *sys.argv[1:],
        ]
        print(f"flake hunt: {count} times each, {workers} workers, {cores} CPU hogs")
        return subprocess.run(command, cwd=REPO, check=False).returncode
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


if __name__ == "__main__":
    sys.exit(main())
