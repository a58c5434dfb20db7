"""Rows that name a repository at a commit, end to end on the side deployment (API, worker,
beat, Redis, real sandboxes): registered with `orchestrator repo add`, each rollout's
/workspace is its commit with that commit's history only; concurrent first rollouts of
an unseen commit build it once; `orchestrator dataset prepare` makes a dataset's commits
ready ahead and reports each row it cannot; the SWE-style grader scores such a row; a row
naming what is not there is a 422 that changes nothing. The layers themselves:
tests/test_repos.py."""

from __future__ import annotations

import json
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from orchestrator.sandbox.repos import HostRepos
from tests import repo_history, swe_project
from tests.e2e.conftest import SWE_TESTS
from tests.e2e.helpers import assert_no_rollout, cli, error_code, function_call, new_trace
from tests.repo_history import SECRET, History
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("e2e")

PLANNING = "codebase-planning"


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> History:
    return repo_history.build(tmp_path_factory.mktemp("history"))


@pytest.fixture(scope="module")
def repo(side: Stack, history: History) -> str:
    name = f"hist-{uuid.uuid4().hex[:6]}"
    added = cli(side, "repo", "add", name, str(history.repo))
    assert f"repository {name}: {history.repo}" in added.stdout
    assert "6 commits" in added.stdout  # the four rows name, the later one, the branch's
    return name


def _create(client: httpx.Client, row: dict[str, Any], rollout_id: str) -> httpx.Response:
    return client.post(
        "/v1/rollouts", json={"environment": PLANNING, "item": row, "id": rollout_id}
    )


def _shell(client: httpx.Client, rollout_id: str, command: str) -> str:
    ran = client.post(
        f"/v1/rollouts/{rollout_id}/tools/shell", json={"arguments": {"command": command}}
    )
    assert ran.status_code == 200, ran.text
    assert ran.json()["outcome"] == "ok", ran.json()
    output: str = ran.json()["output"]
    return output


def test_a_row_at_a_commit_sees_that_commit_and_its_history_only(
    side: Stack, repo: str, history: History
) -> None:
    listed = json.loads(cli(side, "repo", "ls", "--json").stdout)
    assert any(r["name"] == repo and r["source"] == str(history.repo) for r in listed)
    commit = history.commits[2]  # docs/ gone, data a file, run.sh not executable
    rollout_id = f"ro-repo-{uuid.uuid4().hex}"
    with side.client() as client:
        created = _create(client, {"repo": repo, "commit": commit, "request": "x"}, rollout_id)
        assert created.status_code == 201, created.text
        assert created.json()["codebase"] == f"{repo}@{commit}"
        try:
            assert _shell(client, rollout_id, "git rev-parse HEAD").strip() == commit
            assert _shell(client, rollout_id, "git rev-list --all --reflog").split() == list(
                reversed(history.commits[:3])
            )
            assert _shell(client, rollout_id, "git for-each-ref --format='%(refname)'").split() == [
                "refs/heads/main"
            ]
            objects = _shell(
                client,
                rollout_id,
                f"git cat-file --batch-all-objects --batch | grep -c {SECRET} || true",
            )
            assert objects.strip() == "0"
            assert _shell(client, rollout_id, "git status --porcelain") == "(no output)"
            assert set(_shell(client, rollout_id, "ls -A").split()) == {
                ".config",
                ".git",
                "README.md",
                "data",
                "readme-link",
                "scripts",
                "src",
            }
            assert _shell(client, rollout_id, "ls .config").strip() == "kept.toml"
            assert _shell(client, rollout_id, "cat data src/app.py").split("\n")[:2] == [
                "data is a file now",
                "print('v2')",
            ]
            assert (
                _shell(client, rollout_id, "test -x scripts/run.sh && echo x || echo -").strip()
                == "-"
            )
            # The agent's own changes are its sandbox's: written, committed, and gone with it.
            _shell(
                client,
                rollout_id,
                "echo mine > src/app.py && git -c user.name=a -c user.email=a@b "
                "commit -qam mine && git log --oneline | wc -l",
            )
        finally:
            client.delete(f"/v1/rollouts/{rollout_id}")
        # Another rollout of the same commit starts from the commit again.
        again = f"ro-repo-{uuid.uuid4().hex}"
        assert _create(client, {"repo": repo, "commit": commit}, again).status_code == 201
        try:
            assert _shell(client, again, "cat src/app.py").strip() == "print('v2')"
            assert _shell(client, again, "git rev-parse HEAD").strip() == commit
        finally:
            client.delete(f"/v1/rollouts/{again}")


def test_concurrent_first_rollouts_of_an_unseen_commit_build_it_once(
    side: Stack, repo: str, history: History
) -> None:
    # A commit no host has seen, made now (a repeated run of this test gets its own).
    commit = repo_history.add_commit(history, "unseen.txt", f"{uuid.uuid4().hex}\n")
    repos = HostRepos.of(side.settings)
    assert repos.layer_record(repo, commit) is None
    ids = [f"ro-repo-{uuid.uuid4().hex}" for _ in range(6)]
    with side.client() as client:
        try:
            with ThreadPoolExecutor(len(ids)) as pool:
                created = list(
                    pool.map(lambda i: _create(client, {"repo": repo, "commit": commit}, i), ids)
                )
            assert [r.status_code for r in created] == [201] * len(ids), [r.text for r in created]
            heads = {_shell(client, i, "git rev-parse HEAD && cat src/new.py") for i in ids}
            assert heads == {f"{commit}\nNEW = True"}
        finally:
            for rollout_id in ids:
                client.delete(f"/v1/rollouts/{rollout_id}")
    built = [
        line
        for log in side.logs.glob("*.log")
        for line in log.read_text(errors="replace").splitlines()
        if "repo.materialised" in line and commit in line
    ]
    assert len(built) == 1, built


def test_rows_naming_what_is_not_there_are_422_and_change_nothing(
    side: Stack, repo: str, history: History
) -> None:
    cases = [
        ({"repo": "no-such-repo", "commit": history.commits[0]}, "unknown_repository"),
        ({"repo": repo, "commit": "0" * 40}, "unknown_commit"),
        ({"repo": repo, "commit": "main"}, "invalid_item"),
        ({"repo": repo}, "invalid_item"),
        ({"repo": repo, "commit": history.commits[0], "codebase": side.codebase}, "invalid_item"),
    ]
    with side.client() as client:
        for row, code in cases:
            rollout_id = f"ro-repo-{uuid.uuid4().hex}"
            refused = _create(client, row, rollout_id)
            assert refused.status_code == 422, refused.text
            assert error_code(refused) == code, refused.text
            assert_no_rollout(client, side.settings, rollout_id)
            # Agent RFT's first call on such a row: refused the same way, nothing made.
            trace = new_trace()
            call = client.post(
                "/agent-rft/tools", json=function_call(trace, row, "shell", {"command": "true"})
            )
            assert call.status_code == 422, call.text
            assert_no_rollout(client, side.settings, trace)
    not_allowed = cli(side, "repo", "add", "elsewhere", "https://example.com/x.git", check=False)
    assert not_allowed.returncode == 1 and "ORCH_REPO_ALLOWED_URLS" in not_allowed.stderr
    listed = json.loads(cli(side, "repo", "ls", "--json").stdout)
    assert "elsewhere" not in {r["name"] for r in listed}


def test_dataset_prepare_makes_every_commit_ready_and_names_each_bad_row(
    side: Stack, repo: str, history: History, tmp_path: Path
) -> None:
    # Unseen by any host (a repeated run of this test makes its own).
    fresh = repo_history.add_commit(history, "prepared.txt", f"ready {uuid.uuid4().hex}\n")
    rows = [
        {"repo": repo, "commit": fresh, "request": "a"},
        {"repo": repo, "commit": history.commits[1], "request": "b"},
        {"repo": repo, "commit": fresh, "request": "c"},
        {"repo": repo, "commit": "f" * 40},
        {"repo": "not-registered", "commit": fresh},
        {"codebase": side.codebase, "request": "not a repository row"},
    ]
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    first = cli(side, "dataset", "prepare", str(dataset), check=False)
    assert first.returncode == 1, first.stdout + first.stderr
    assert f"{dataset}:4: repository {repo!r} has no commit {'f' * 40}" in first.stderr
    assert f"{dataset}:5: unknown repository 'not-registered'" in first.stderr
    assert f"{dataset}:7: not JSON: " in first.stderr
    assert "7 rows, 4 commits: 4 rows ready, 3 failed" in first.stdout, first.stdout
    repos = HostRepos.of(side.settings)
    assert repos.layer_record(repo, fresh) is not None
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    second = cli(side, "dataset", "prepare", str(dataset))
    assert "3 rows, 2 commits: 3 rows ready, 0 failed" in second.stdout
    assert "0 built" in second.stdout
    rollout_id = f"ro-repo-{uuid.uuid4().hex}"
    with side.client() as client:
        assert _create(client, rows[0], rollout_id).status_code == 201
        try:
            assert _shell(client, rollout_id, "cat prepared.txt").startswith("ready ")
        finally:
            client.delete(f"/v1/rollouts/{rollout_id}")


def test_the_swe_style_grader_scores_a_row_at_a_commit(side: Stack, tmp_path: Path) -> None:
    project = swe_project.build(tmp_path)
    name = f"calc-{uuid.uuid4().hex[:6]}"
    cli(side, "repo", "add", name, str(project.repo))
    row = {**project.row("unused", SWE_TESTS), "repo": name, "commit": project.base_commit}
    del row["codebase"]
    with side.client() as client:
        scores = []
        for command in (f"cat > calc/__init__.py <<'EOF'\n{swe_project.FIXED}EOF\n", "true"):
            trace = new_trace()
            call = client.post(
                "/agent-rft/tools", json=function_call(trace, row, "shell", {"command": command})
            )
            assert call.status_code == 200, call.text
            try:
                graded = client.post(
                    "/agent-rft/grade",
                    json={"sample": {"output_text": "done"}, "item": row, "trace_id": trace},
                    timeout=180,
                )
                assert graded.status_code == 200, graded.text
                scores.append(graded.json()["score"])
            finally:
                client.delete(f"/v1/rollouts/{trace}")
    assert scores == [1.0, pytest.approx(0.4)]


EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "repo_tasks"


@pytest.fixture(scope="module")
def six(side: Stack) -> str:
    """The example repository (examples/repo_tasks/six.bundle: six's real history) under the
    name its rows use."""
    cli(side, "repo", "add", "six", str(EXAMPLES / "six.bundle"), "--replace")
    return "six"


def _preflight(
    side: Stack, dataset: Path, *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """`orchestrator preflight --rows` of ``dataset`` against the side stack's API."""
    command = ["preflight", "--dataset", str(dataset), "--rows", "--base-url", side.base_url]
    return cli(side, *command, *args, check=check)


def test_the_example_rows_are_ready_and_pass_their_preflight(
    side: Stack, six: str, tmp_path: Path
) -> None:
    """Every planning row's gold files exist at its commit; SWE rows' tests fail untouched
    and pass with their gold patch, in the sandboxes (examples/repo_tasks/build.py found
    all ten so in the base image; three of them here, for the suite's time: the ten take
    40 s more, `orchestrator preflight --rows` on the file checks them all)."""
    swe = tmp_path / "swe.jsonl"
    swe.write_text("".join((EXAMPLES / "swe.jsonl").read_text().splitlines(keepends=True)[:3]))
    for dataset in (EXAMPLES / "planning.jsonl", swe):
        prepared = cli(side, "dataset", "prepare", str(dataset))
        assert " 0 failed" in prepared.stdout, prepared.stdout
        checked = _preflight(side, dataset, "--parallel", "6")
        rows = len(dataset.read_text().splitlines())
        assert f"{rows} rows: {rows} ready, 0 failed" in checked.stdout, checked.stdout


def test_preflight_names_each_row_that_cannot_work(side: Stack, six: str, tmp_path: Path) -> None:
    planning = json.loads((EXAMPLES / "planning.jsonl").read_text().splitlines()[0])
    swe = json.loads((EXAMPLES / "swe.jsonl").read_text().splitlines()[0])
    rows = [
        {**planning, "gold_files": ["six.py", "no/such/file.py"]},
        {**planning, "commit": "e" * 40},
        # A test that passes before the fix listed as failing before it.
        {**swe, "FAIL_TO_PASS": swe["PASS_TO_PASS"][:1]},
        {**swe, "gold_patch": swe["test_patch"]},  # applies nothing that fixes it
        swe,
    ]
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    checked = _preflight(side, dataset, check=False)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    out = checked.stdout
    assert "missing: no/such/file.py" in out
    assert f"has no commit {'e' * 40}" in out
    assert "FAIL_TO_PASS passing already" in out
    assert "5 rows: 1 ready, 4 failed" in out, out


def _wheel(house: Path, version: str) -> None:
    """A pure-Python wheel of ``tinydep`` made by hand (a wheel is a zip): no index, no pip."""
    import zipfile

    house.mkdir(exist_ok=True)
    with zipfile.ZipFile(house / f"tinydep-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr("tinydep/__init__.py", f"VALUE = 'from the wheelhouse {version}'\n")
        info = f"tinydep-{version}.dist-info"
        wheel.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: tinydep\nVersion: {version}\n"
        )
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")


INSTALL = (
    "cp requirements.txt /opt/installed-requirements && for w in /opt/wheelhouse/*.whl; "
    'do python3 -m zipfile -e "$w" /usr/local/lib/python3.11/dist-packages/; done'
)


def test_a_repository_s_set_up_runs_once_per_dependency_fingerprint(
    side: Stack, tmp_path: Path
) -> None:
    source = tmp_path / "withdeps"
    source.mkdir()
    (source / "requirements.txt").write_text("tinydep==1.0\n")
    (source / "app.py").write_text("import tinydep\n")
    repo_history.git(source, "init", "-q", "-b", "main")
    first = repo_history.commit_all(source, "first")
    (source / "app.py").write_text("import tinydep\nprint(tinydep.VALUE)\n")
    same_deps = repo_history.commit_all(source, "app only")
    (source / "requirements.txt").write_text("tinydep==1.0\n# pinned again\n")
    new_deps = repo_history.commit_all(source, "requirements changed")
    house = tmp_path / "house"
    _wheel(house, "1.0")
    name = f"deps-{uuid.uuid4().hex[:6]}"
    cli(
        side,
        "repo",
        "add",
        name,
        str(source),
        "--setup-command",
        INSTALL,
        "--deps",
        "requirements.txt",
        "--wheelhouse",
        str(house),
    )
    broken = f"broken-{uuid.uuid4().hex[:6]}"
    cli(side, "repo", "add", broken, str(source), "--setup-command", "echo no luck >&2; exit 3")
    client = docker.from_env()
    images: dict[str, int] = {}
    try:
        with side.client() as api:
            for commit in (first, same_deps, new_deps):
                rollout_id = f"ro-repo-{uuid.uuid4().hex}"
                created = _create(api, {"repo": name, "commit": commit}, rollout_id)
                assert created.status_code == 201, created.text
                try:
                    ran = _shell(
                        api, rollout_id, "python3 -c 'import tinydep; print(tinydep.VALUE)'"
                    )
                    assert ran.strip() == "from the wheelhouse 1.0"
                    installed = _shell(api, rollout_id, "cat /opt/installed-requirements")
                    wanted = repo_history.git(source, "show", f"{commit}:requirements.txt")
                    assert installed == wanted.rstrip("\n")
                finally:
                    api.delete(f"/v1/rollouts/{rollout_id}")
                made = client.images.list(filters={"label": f"orchestrator.repo={name}"})
                images[commit] = len(made)
            # The set-up failing is the repository's fault: a 422 naming it, nothing made.
            rollout_id = f"ro-repo-{uuid.uuid4().hex}"
            refused = _create(api, {"repo": broken, "commit": first}, rollout_id)
            assert refused.status_code == 422, refused.text
            assert error_code(refused) == "setup_failed"
            assert "no luck" in refused.json()["error"]["message"]
            assert_no_rollout(api, side.settings, rollout_id)
        # One image for the two commits that agree on requirements.txt, one more after.
        assert images == {first: 1, same_deps: 1, new_deps: 2}
    finally:
        for image in client.images.list(filters={"label": f"orchestrator.repo={name}"}):
            client.images.remove(str(image.id), force=True)
