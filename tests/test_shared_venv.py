"""scripts/shared_venv.py: the trainers' and Harbor's venvs, built once per machine and
linked into each checkout. The build itself (a venv and pip) runs in every cold
``make test``; these pin what makes the warm path right: the key, the link, eviction."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "shared_venv.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("shared_venv", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_extra_is_the_projects_dependencies_and_the_extra_not_the_project() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    resolved = _module().resolve("extra:trainers")
    assert resolved == [*project["dependencies"], *project["optional-dependencies"]["trainers"]]
    assert not any(r.startswith("orchestrator") for r in resolved)
    assert _module().resolve("harbor[e2b]==0.26.0 e2b==2.63.0") == [
        "harbor[e2b]==0.26.0",
        "e2b==2.63.0",
    ]


def test_the_key_changes_with_a_pin_and_the_interpreter() -> None:
    shared = _module()
    key = shared.key_of(sys.executable, [["torch==2.13.0"], ["trl==1.16.0"]])
    assert key == shared.key_of(sys.executable, [["torch==2.13.0"], ["trl==1.16.0"]])
    assert key != shared.key_of(sys.executable, [["torch==2.13.0"], ["trl==1.17.0"]])
    assert key != shared.key_of(sys.executable, [["torch==2.13.0", "trl==1.16.0"]])


def test_a_built_venv_is_linked_in_place_of_an_old_directory_and_stale_ones_go(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    steps = [["not-installed-here==1.0"]]
    shared = _module()
    built = cache / f"venv-x-{shared.key_of(sys.executable, steps)}"
    (built / "bin").mkdir(parents=True)
    (built / shared.DONE).write_text("built\n")
    month_ago = time.time() - 31 * 24 * 3600
    stale = cache / "venv-x-0000000000000000"
    (stale / "bin").mkdir(parents=True)
    (stale / shared.DONE).write_text("built\n")
    os.utime(stale / shared.DONE, (month_ago, month_ago))
    recent = cache / "venv-x-1111111111111111"
    (recent / "bin").mkdir(parents=True)
    (recent / shared.DONE).write_text("built\n")
    unfinished = cache / "venv-x-2222222222222222"
    unfinished.mkdir()
    other_name = cache / "venv-y-0000000000000000"
    other_name.mkdir()
    checkout = tmp_path / "checkout"
    (checkout / ".venv-x" / "lib").mkdir(parents=True)

    for _ in range(2):  # the second run finds the link in place
        done = subprocess.run(
            [sys.executable, str(SCRIPT), str(checkout / ".venv-x"), sys.executable, *steps[0]],
            env={**os.environ, "ORCH_VENV_CACHE": str(cache)},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "building" not in done.stdout, "a built venv is not built again"
        assert (checkout / ".venv-x").is_symlink()
        assert (checkout / ".venv-x").resolve() == built

    assert not stale.exists() and not unfinished.exists()
    assert recent.exists() and other_name.exists()
    assert time.time() - (built / shared.DONE).stat().st_mtime < 60, "a link marks it used"
