"""The stock ``e2b`` SDK (pinned in the ``sdk-tests`` extra) against the real stack, on a
deployment of its own (API, worker, reaper), configured only as docs/e2b.md says: its API URL
and its sandbox URL are the orchestrator's, its API key one of the deployment's tokens.

Covered: create (a codebase or an environment as the template), commands (foreground with
stdout, stderr, exit code, timeout, cwd, envs; background with wait and kill), files (read,
write, list, exists, remove, make_dir), set_timeout, get_info, list, connect, kill; an E2B
sandbox as an orchestrator rollout (listed, its commands as its trajectory, ended by the
reaper at its timeout); the failures a harness must tell from a command's own: a
sandbox killed or paused from outside, a stopped worker; and the ``harbor`` environment's
user ``root``, the sandbox user under another name (Harbor's calls; no privilege gained).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    FileNotFoundException,
    FileType,
    PtySize,
    Sandbox,
    SandboxException,
    SandboxNotRunningException,
    SandboxQuery,
    SandboxUnreachableException,
    TimeoutException,
)

from orchestrator.state.keys import Keys
from orchestrator.tls import tls
from tests.conftest import runsc_available
from tests.e2e.helpers import sandboxes_of, wait_for
from tests.stacks import TOKEN, Stack

pytestmark = pytest.mark.xdist_group("e2b")


@pytest.fixture()
def sbx(e2b_stack: Stack) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(template=e2b_stack.codebase, timeout=300)
    try:
        yield sandbox
    finally:
        sandbox.kill()


def test_commands_run_in_the_codebase_with_cwd_envs_and_exit_codes(sbx: Sandbox) -> None:
    listed = sbx.commands.run("ls src/requests | head -3; id -u")
    assert listed.exit_code == 0 and listed.stderr == ""
    assert listed.stdout.split()[-1] == "1000"  # the unprivileged user
    assert len(listed.stdout.split()) == 4
    there = sbx.commands.run("pwd; echo $GREETING", cwd="/tmp", envs={"GREETING": "hello"})
    assert there.stdout.split() == ["/tmp", "hello"]
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo out; echo err >&2; exit 3")
    assert failed.value.exit_code == 3
    assert failed.value.stdout == "out\n" and failed.value.stderr == "err\n"
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=2)
    assert sbx.commands.run("echo still fine").stdout == "still fine\n"


def test_background_commands_wait_and_kill(sbx: Sandbox) -> None:
    quick = sbx.commands.run("sleep 1; echo done", background=True)
    assert quick.pid > 0
    assert quick.wait().stdout == "done\n"
    slow = sbx.commands.run("sleep 60", background=True, timeout=120)
    assert any(p.pid == slow.pid for p in sbx.commands.list())
    started = time.monotonic()
    assert slow.kill() is True
    with pytest.raises(CommandExitException) as killed:
        slow.wait()
    assert killed.value.exit_code == -1
    assert time.monotonic() - started < 20
    assert sbx.commands.kill(slow.pid) is False  # gone already


def test_output_streams_as_it_is_printed(sbx: Sandbox) -> None:
    """on_stdout/on_stderr get each piece while the command runs (the first long before it
    ends); the result holds it once; a client that reattaches reads it from the start."""
    seen: list[tuple[float, str, str]] = []
    started = time.monotonic()
    result = sbx.commands.run(
        "echo first; sleep 2; echo oops >&2; echo second",
        on_stdout=lambda text: seen.append((time.monotonic(), "out", text)),
        on_stderr=lambda text: seen.append((time.monotonic(), "err", text)),
    )
    ended = time.monotonic()
    assert result.stdout == "first\nsecond\n" and result.stderr == "oops\n"
    assert seen[0][1:] == ("out", "first\n") and seen[0][0] - started < ended - started - 1.5
    assert [(kind, text) for _, kind, text in seen[1:]] == [("err", "oops\n"), ("out", "second\n")]
    handle = sbx.commands.run("echo early; sleep 2; echo late", background=True)
    again = sbx.commands.connect(handle.pid)
    assert again.wait().stdout == "early\nlate\n"
    assert handle.wait().stdout == "early\nlate\n"
    # Whole, far past a model's output budget (16 KB), up to ORCH_E2B_OUTPUT_MB.
    big = sbx.commands.run("head -c 300000 /dev/zero | tr '\\0' x")
    assert big.stdout == "x" * 300_000


def test_a_background_command_whose_client_leaves_at_once_still_runs(sbx: Sandbox) -> None:
    """A handle dropped right after its start event closes its stream: the command runs
    all the same (its call is started before the stream waits on anything), and ends."""
    for n in range(5):
        handle = sbx.commands.run(f"sleep 0.3; echo {n} > /tmp/ran-{n}", background=True)
        del handle
        gc.collect()
    wait_for(
        lambda: all(sbx.files.exists(f"/tmp/ran-{n}") for n in range(5)),
        timeout_s=30,
        what="every dropped command to have run",
    )
    wait_for(lambda: sbx.commands.list() == [], timeout_s=30, what="every command over")


def test_stdin_is_sent_and_closed(sbx: Sandbox) -> None:
    """send_stdin writes to a command started with stdin=True, close_stdin is its EOF; a
    command started without stdin refuses input, saying so."""
    handle = sbx.commands.run("cat; echo done", background=True, stdin=True, timeout=60)
    sbx.commands.send_stdin(handle.pid, "first line\n")
    sbx.commands.send_stdin(handle.pid, b"second\n")
    sbx.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "first line\nsecond\ndone\n"
    plain = sbx.commands.run("sleep 30", background=True, timeout=60)
    with pytest.raises(SandboxException, match="not started with stdin"):
        sbx.commands.send_stdin(plain.pid, "x")
    plain.kill()
    # Without stdin, a command reading its input finds it empty at once (not a hang).
    assert sbx.commands.run("cat; echo eof").stdout == "eof\n"


@pytest.mark.parametrize("template", ["base", "acts-runsc/{codebase}"])
def test_a_pty_runs_an_interactive_shell(e2b_stack: Stack, template: str) -> None:
    """pty.create: an interactive login shell on a terminal of the size asked, its output
    streamed as typed (on_pty), its size changed by resize, ended by its own exit."""
    if "runsc" in template and not runsc_available():
        pytest.skip("gVisor (runsc) is not registered with dockerd")
    sbx = Sandbox.create(template=template.format(codebase=e2b_stack.codebase), timeout=120)
    try:
        seen: list[bytes] = []
        terminal = sbx.pty.create(PtySize(rows=24, cols=80), timeout=60)
        sbx.pty.send_stdin(
            terminal.pid, b"tty; stty size > /tmp/before; echo sum=$((40+2)); read x\n"
        )
        wait_for(lambda: sbx.files.exists("/tmp/before"), timeout_s=30, what="the shell ran")
        sbx.pty.resize(terminal.pid, PtySize(rows=40, cols=100))
        sbx.pty.send_stdin(terminal.pid, b"\nstty size; id -u; exit 7\n")
        with pytest.raises(CommandExitException) as ended:
            terminal.wait(on_pty=seen.append)
        text = b"".join(seen).decode()
        assert sbx.files.read("/tmp/before") == "24 80\n"
        assert "/dev/pts/" in text and "sum=42" in text and "40 100" in text, text
        assert "1000" in text and ended.value.exit_code == 7, text
    finally:
        sbx.kill()


def test_a_directory_is_watched(sbx: Sandbox) -> None:
    """files.watch_dir: what was made, written, removed or had its mode changed under a
    directory since the last look, recursively when asked; a stopped watcher is gone."""
    sbx.files.make_dir("/tmp/watched/deep")
    sbx.files.write("/tmp/watched/old.txt", "old")
    watcher = sbx.files.watch_dir("/tmp/watched", recursive=True)
    assert watcher.get_new_events() == []
    sbx.commands.run(
        "cd /tmp/watched && echo new > new.txt && echo more >> old.txt && "
        "echo inner > deep/inner.txt && chmod 751 deep"
    )
    seen = {(e.name, e.type.value) for e in watcher.get_new_events()}
    assert seen == {
        ("new.txt", "create"), ("deep/inner.txt", "create"), ("old.txt", "write"),
        ("deep", "chmod"),
    }, seen  # fmt: skip
    sbx.files.remove("/tmp/watched/new.txt")
    assert [(e.name, e.type.value) for e in watcher.get_new_events()] == [("new.txt", "remove")]
    watcher.stop()
    with pytest.raises(SandboxException):
        watcher.get_new_events()


def test_a_directory_is_watched_as_a_stream(e2b_stack: Stack) -> None:
    """The async SDK's watch_dir: a stream of events as they are seen."""

    async def watch() -> list[tuple[str, str]]:
        sbx = await AsyncSandbox.create(template=e2b_stack.codebase, timeout=120)
        try:
            seen: list[tuple[str, str]] = []
            handle = await sbx.files.watch_dir(
                "/workspace", lambda e: seen.append((e.name, e.type.value))
            )
            await sbx.commands.run("echo x > streamed.txt")
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.05)
            await handle.stop()  # type: ignore[no-untyped-call]  # (the SDK leaves it untyped)
            return seen
        finally:
            await sbx.kill()

    assert asyncio.run(watch()) == [("streamed.txt", "create")]


def test_files(sbx: Sandbox) -> None:
    payload = bytes(range(256)) * 40
    info = sbx.files.write("notes/data.bin", payload)
    assert info.path == "/workspace/notes/data.bin"
    assert sbx.files.read("notes/data.bin", format="bytes") == payload
    sbx.files.write("/tmp/hello.txt", "hi there\n")
    assert sbx.files.read("/tmp/hello.txt") == "hi there\n"
    assert sbx.commands.run("cat /tmp/hello.txt").stdout == "hi there\n"
    assert sbx.files.exists("/tmp/hello.txt") and not sbx.files.exists("/tmp/nope")
    names = {e.name for e in sbx.files.list("/workspace")}
    assert {"src", "notes", "README.md"} <= names, names
    assert sbx.files.make_dir("/tmp/a/b") is True
    assert sbx.files.make_dir("/tmp/a/b") is False
    moved = sbx.files.rename("/tmp/hello.txt", "/tmp/a/b/hello.txt")
    assert moved.path == "/tmp/a/b/hello.txt"
    assert sbx.files.get_info("/tmp/a/b/hello.txt").size == len("hi there\n")
    sbx.files.remove("/tmp/a")
    assert not sbx.files.exists("/tmp/a")
    with pytest.raises(FileNotFoundException):
        sbx.files.read("/no/such/file")


def test_timeout_info_list_connect_and_kill(e2b_stack: Stack) -> None:
    sandbox = Sandbox.create(template="base", timeout=120, metadata={"run": "e2b-test"})
    try:
        info = sandbox.get_info()
        assert info.sandbox_id == sandbox.sandbox_id and info.template_id == "base"
        assert info.metadata == {"run": "e2b-test"}
        sandbox.set_timeout(600)
        assert (Sandbox.get_info(sandbox.sandbox_id).end_at - info.end_at).total_seconds() > 400
        listed = Sandbox.list(query=_query({"run": "e2b-test"})).next_items()
        assert [s.sandbox_id for s in listed] == [sandbox.sandbox_id]
        other = Sandbox.connect(sandbox.sandbox_id)
        assert other.commands.run("ls /workspace | wc -l").stdout.strip() == "0"
    finally:
        assert sandbox.kill() is True
    assert Sandbox.kill(sandbox.sandbox_id) is False
    with pytest.raises(SandboxNotRunningException):
        sandbox.commands.run("true")
    assert not sandbox.is_running()


def _query(metadata: dict[str, str]) -> SandboxQuery:
    return SandboxQuery(metadata=metadata)


def test_an_e2b_sandbox_is_a_rollout(e2b_stack: Stack) -> None:
    """Listed with the orchestrator's own tools, its commands its trajectory; its sandbox
    is an ordinary one (labelled with its id); the reaper ends it at its timeout."""
    sandbox = Sandbox.create(template=e2b_stack.codebase, timeout=6)
    sandbox.commands.run("echo first")
    sandbox.commands.run("rg -l 'def request' src | head -1")
    assert sandboxes_of(e2b_stack.settings, sandbox.sandbox_id)
    shown = _orchestrator(e2b_stack, "rollouts", "show", sandbox.sandbox_id, "--json")
    record = json.loads(shown)
    assert record["summary"]["source"] == "e2b"
    steps = record["trajectory"]
    assert [s["tool"] for s in steps] == ["sandbox.command", "sandbox.command"]
    assert "echo first" in json.dumps(steps[0]["arguments"])
    listed = _orchestrator(e2b_stack, "rollouts", "ls", "--json")
    assert sandbox.sandbox_id in listed
    wait_for(
        lambda: not sandboxes_of(e2b_stack.settings, sandbox.sandbox_id),
        timeout_s=30,
        what="the reaper to end the sandbox at its timeout",
    )
    with pytest.raises(SandboxNotRunningException):
        sandbox.commands.run("true")


def _orchestrator(stack: Stack, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


# -- failures a harness must tell from a command's own ------------------------------------------


def test_a_sandbox_killed_from_outside_is_not_a_command_failure(sbx: Sandbox) -> None:
    client = docker.from_env()
    (container,) = client.containers.list(filters={"label": f"orchestrator.sandbox={_sid(sbx)}"})
    container.kill()
    with pytest.raises(SandboxUnreachableException) as unreachable:
        sbx.commands.run("echo hello")
    assert "infrastructure" in str(unreachable.value)
    assert not isinstance(unreachable.value, CommandExitException)
    # The sandbox stays failed: every later call says so too.
    with pytest.raises(SandboxUnreachableException):
        sbx.files.list("/workspace")


def test_a_sandbox_paused_from_outside_is_not_a_command_failure(sbx: Sandbox) -> None:
    client = docker.from_env()
    (container,) = client.containers.list(filters={"label": f"orchestrator.sandbox={_sid(sbx)}"})
    container.pause()
    try:
        with pytest.raises(SandboxUnreachableException) as unreachable:
            sbx.commands.run("echo hello", timeout=3)
        assert "paused" in str(unreachable.value)
    finally:
        # The orchestrator may have thawed it already, destroying the failed sandbox (its
        # removal unpauses first): then it is no longer paused, or gone.
        try:
            container.unpause()
        except docker.errors.APIError:
            with contextlib.suppress(docker.errors.NotFound):
                container.reload()
                assert container.status != "paused", container.status


def test_a_stopped_worker_is_not_a_command_failure(e2b_stack: Stack, sbx: Sandbox) -> None:
    assert sbx.commands.run("echo before").stdout == "before\n"
    e2b_stack.stop("worker", signal.SIGTERM)
    try:
        wait_for(lambda: not _heartbeat(e2b_stack), timeout_s=30, what="the worker to retire")
        with pytest.raises(SandboxUnreachableException) as unreachable:
            sbx.commands.run("echo during")
        assert "retry" in str(unreachable.value)
    finally:
        e2b_stack.restart_worker()
    # Nothing was lost: the sandbox lives on, the call was never run, it runs now.
    assert sbx.commands.run("echo after").stdout == "after\n"


def test_refused_with_a_clear_error(sbx: Sandbox) -> None:
    with pytest.raises(SandboxException, match=r"e2b\.root_user: alias"):
        sbx.commands.run("id", user="root")
    with pytest.raises(SandboxException, match="refused"):
        sbx.files.write("/tmp/x", "x", user="root")
    with pytest.raises(SandboxException, match="refused"):
        sbx.commands.run("id", user="nobody")
    with pytest.raises(SandboxException, match="mode='filesystem'"):
        sbx.pause(mode="full")
    with pytest.raises(SandboxException, match="autoPause is not supported"):
        Sandbox.create(template=sbx.get_info().template_id, lifecycle={"on_timeout": "pause"})


# -- the harbor environment: user root as an alias, Harbor's fixed paths -------------------------


@pytest.fixture()
def harbor_sbx(e2b_stack: Stack) -> Iterator[Sandbox]:
    sandbox = Sandbox.create(template="harbor", timeout=300)
    try:
        yield sandbox
    finally:
        sandbox.kill()


def test_root_is_the_sandbox_user_where_the_environment_says_so(harbor_sbx: Sandbox) -> None:
    """What Harbor's provider does, each as user root: commands, writes (form upload and
    tar extract), reads, stat, chmod, in its fixed directories; all as uid 1000."""
    sbx = harbor_sbx
    assert sbx.commands.run("id -u; id -un", user="root").stdout.split() == ["1000", "agent"]
    made = sbx.commands.run(
        "mkdir -p /logs/verifier /logs/agent /logs/artifacts && chmod 777 /logs/verifier "
        "/logs/agent /logs/artifacts && stat -c %u /logs/agent",
        user="root",
        background=True,
    ).wait()
    assert made.stdout == "1000\n"
    test_sh = "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n"
    sbx.files.write("/tests/test.sh", test_sh, user="root")
    sbx.commands.run("chmod 755 /tests/test.sh && /tests/test.sh", user="root", cwd="/")
    assert sbx.files.read("/logs/verifier/reward.txt", user="root") == "1\n"
    assert sbx.files.get_info("/logs/artifacts", user="root").type == FileType.DIR
    sbx.commands.run(
        "mkdir -p /solution && cd /tmp && printf 'echo solved' > solve.sh && tar -czf s.tgz "
        "solve.sh && tar -xzf s.tgz --no-same-owner -C /solution && stat -c %u /solution/solve.sh",
        user="root",
    )
    assert sbx.files.read("/solution/solve.sh", user="root") == "echo solved"
    # Another user is still refused here; only the name root is aliased.
    with pytest.raises(SandboxException, match="refused"):
        sbx.commands.run("id", user="nobody")


def test_root_gets_no_privilege(e2b_stack: Stack, harbor_sbx: Sandbox) -> None:
    """Everything the sandbox user cannot do, root cannot either: the system's files, the
    exec agent (PID 1's child, its socket and its environment), the read-only image."""
    sbx = harbor_sbx
    for attack in (
        "kill -9 1",
        "ls /run/orchestrator",
        "cat /proc/1/environ",
        "touch /etc/passwd",
        "mkdir /newdir",
        "cp /bin/true /opt/orchestrator/exec_agent.py",
        "apt-get install -y cowsay",
    ):
        done = sbx.commands.run(f"{attack} 2>&1; echo rc=$?", user="root", timeout=10)
        assert done.stdout.rstrip().split("rc=")[-1] != "0", (attack, done.stdout)
    with pytest.raises(SandboxException):
        sbx.files.write("/etc/profile.d/00-harbor.sh", "export X=1", user="root")
    with pytest.raises(SandboxException):
        sbx.files.read("/etc/shadow", user="root")
    assert sbx.commands.run("echo alive", user="root").stdout == "alive\n"
    assert sandboxes_of(e2b_stack.settings, sbx.sandbox_id)


def _sid(sbx: Sandbox) -> str:
    """The orchestrator's sandbox id of an E2B sandbox (its rollout's sandbox)."""
    import httpx

    env = {"Authorization": f"Bearer {TOKEN}"}
    base = sbx.connection_config.api_url
    view = httpx.get(
        f"{base}/v1/rollouts/{sbx.sandbox_id}", headers=env, timeout=30, verify=tls()
    ).json()
    sandbox_id: str = view["sandbox_id"]
    return sandbox_id


def _heartbeat(stack: Stack) -> bool:
    import redis

    client = redis.Redis.from_url(stack.settings.redis_url)
    try:
        return bool(
            client.exists(Keys.of(stack.settings.deployment).heartbeat(stack.settings.host_id))
        )
    finally:
        client.close()


def test_docs_export_lines_are_what_the_tests_set() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "e2b.md").read_text()
    for line in (
        "export E2B_API_URL=http://127.0.0.1:8000",
        "export E2B_SANDBOX_URL=http://127.0.0.1:8000",
        'export E2B_API_KEY="$ORCH_API_TOKEN"',
    ):
        assert line in doc


def test_bad_requests_get_clear_errors_in_the_sdks_dialect(e2b_stack: Stack, sbx: Sandbox) -> None:
    """Refusals on both planes, in the shapes the SDK parses, and nothing made by them."""
    import httpx

    base = e2b_stack.base_url
    with httpx.Client(base_url=base, timeout=30, verify=tls()) as raw:
        before = len(Sandbox.list().next_items())
        no_key = raw.post("/v2/sandboxes", json={"templateID": "base"})
        assert (no_key.status_code, no_key.json()["code"]) == (401, 401)
        key = {"X-API-KEY": TOKEN}
        for body, status in ((b"{not json", 400), (b'{"timeout": -5}', 400)):
            bad = raw.post("/v2/sandboxes", content=body, headers=key)
            assert bad.status_code == status and bad.json()["code"] == status, bad.text
        unknown = raw.post("/v2/sandboxes", json={"templateID": "no-such-template"}, headers=key)
        assert unknown.status_code == 400 and "no-such-template" in unknown.json()["message"]
        assert raw.get("/sandboxes/e2bnosuchsandbox", headers=key).status_code == 404
        assert len(Sandbox.list().next_items()) == before
        envd = {"E2b-Sandbox-Id": sbx.sandbox_id, "Content-Type": "application/json"}
        refused = raw.post("/filesystem.Filesystem/Stat", json={"path": "/"}, headers=envd)
        assert (refused.status_code, refused.json()["code"]) == (401, "unauthenticated")
        wrong = raw.post(
            "/filesystem.Filesystem/Stat",
            json={"path": "/"},
            headers={**envd, "X-Access-Token": "guess"},
        )
        assert (wrong.status_code, wrong.json()["code"]) == (401, "unauthenticated")
        gone = raw.get(
            "/health", headers={"E2b-Sandbox-Id": "e2bnosuchsandbox", "X-Access-Token": "x"}
        )
        assert gone.status_code == 502 and "was not found" in gone.json()["message"]
