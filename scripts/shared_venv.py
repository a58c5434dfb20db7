"""A virtualenv built once per machine and per requirement set, kept outside the checkout
and linked into it: ``make test`` from a fresh clone then finds the trainers' 2 GB of
torch, TRL and verl (and Harbor's venv) already installed instead of spending two minutes
unpacking wheels.

usage: scripts/shared_venv.py LINK PYTHON STEP [STEP ...]

Each STEP is one ``pip install`` run, in order: requirement specifiers separated by spaces,
or ``extra:NAME`` for this project's own dependencies plus its optional extra NAME (read
from pyproject.toml; the project itself is not installed: its scripts run from the
repository root, ``python -m ...``, where ``orchestrator`` is importable). The venv lives
in ``$ORCH_VENV_CACHE`` (default /var/cache/orchestrator/venvs) under ``NAME-KEY``, KEY a
hash of the interpreter's version and the resolved steps, so a changed pin builds a new
one and a checkout on another branch keeps its own. A build holds a lock on its NAME, so
two checkouts set up at once build it once (and two names build side by side). Venvs of
the same name unused for 30 days are removed. LINK becomes a symlink to the venv (a
directory left there by an older layout is replaced).

Only the standard library: it runs before any venv exists.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("ORCH_VENV_CACHE", "/var/cache/orchestrator/venvs"))
DONE = ".complete"
UNUSED_S = 30 * 24 * 3600


def resolve(step: str) -> list[str]:
    """The requirement specifiers one STEP installs."""
    if not step.startswith("extra:"):
        return step.split()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extra = step.removeprefix("extra:")
    return [*project["dependencies"], *project["optional-dependencies"][extra]]


def key_of(python: str, steps: list[list[str]]) -> str:
    version = subprocess.run(
        [python, "-c", "import sys; print(sys.version)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    digest = hashlib.sha256(repr((version, steps)).encode())
    return digest.hexdigest()[:16]


def build(venv: Path, python: str, steps: list[list[str]]) -> None:
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "pip"), "install", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    for requirements in steps:
        subprocess.run([*pip, *requirements], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "check"], check=True)
    (venv / DONE).write_text(repr(steps) + "\n")


def evict(name: str, keep: Path) -> None:
    """Remove venvs of NAME no checkout has linked for UNUSED_S (each link touches DONE)."""
    now = time.time()
    for other in CACHE.glob(f"{name}-*"):
        done = other / DONE
        if other != keep and (not done.exists() or now - done.stat().st_mtime > UNUSED_S):
            shutil.rmtree(other, ignore_errors=True)


def link(target: Path, at: Path) -> None:
    if at.is_symlink() and at.resolve() == target:
        return
    if at.is_symlink() or at.is_file():
        at.unlink()
    elif at.exists():
        shutil.rmtree(at)
    at.symlink_to(target)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    at, python, raw_steps = Path(argv[0]).absolute(), argv[1], argv[2:]
    steps = [resolve(step) for step in raw_steps]
    name = at.name.lstrip(".")
    venv = CACHE / f"{name}-{key_of(python, steps)}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / DONE).exists():
            print(f"[shared-venv] building {venv} (once per machine)", flush=True)
            build(venv, python, steps)
        os.utime(venv / DONE)
        evict(name, venv)
    link(venv, at)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
