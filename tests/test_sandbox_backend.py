"""The Docker backend's contract, against the real daemon: exec results, concurrency,
encodings, signals, lifecycle (destroy, list, probe, gc, sweep) and read_file."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import docker
import pytest
from docker.errors import NotFound

from orchestrator.config import Runtime, Settings
from orchestrator.sandbox import labels
from orchestrator.sandbox.agent import agent_protocol as protocol
from orchestrator.sandbox.agent import client as agent
from orchestrator.sandbox.backend import (
    ExecResult,
    FileError,
    SandboxError,
    SandboxHandle,
    SandboxLimits,
    SandboxSpec,
    SandboxUnavailable,
)
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.sandbox.docker.mounts import mounted_at
from orchestrator.sandbox.gc import collect_expired
from tests.sandbox_scripts import PIDS_FILLER

pytestmark = pytest.mark.xdist_group("sandbox_backend")


def run(backend: DockerBackend, handle: SandboxHandle, command: str, **kw: Any) -> ExecResult:
    return backend.exec(
        handle,
        command,
        timeout_s=kw.get("timeout_s", 20),
        output_budget_bytes=kw.get("budget", 64 * 1024),
        cwd=kw.get("cwd", "/workspace"),
    )


def out(result: ExecResult) -> str:
    return result.stdout.head + result.stdout.tail


def err(result: ExecResult) -> str:
    return result.stderr.head + result.stderr.tail


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture()
def short_dir() -> Iterator[Path]:
    """A state dir with a short path: agent sockets live under it, and a Unix socket's
    path is limited to 107 bytes (pytest's tmp_path under xdist is too long)."""
    path = Path(tempfile.mkdtemp(prefix="orch-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture()
def private_backend(
    settings: Settings, base_image: str, short_dir: Path
) -> Iterator[DockerBackend]:
    """A backend of a deployment of its own, so gc and sweeps cannot touch the worker's
    shared sandbox; everything it owns is destroyed afterwards."""
    own = settings.model_copy(
        update={"deployment": unique(settings.deployment[:24]), "state_dir": short_dir}
    )
    backend = DockerBackend(own)
    yield backend
    collect_expired(backend, everything=True)


@pytest.fixture()
def workdir(backend: DockerBackend, shared_sandbox: SandboxHandle) -> Iterator[str]:
    """A fresh directory under /workspace of the shared sandbox, removed afterwards."""
    path = f"/workspace/{unique('t')}"
    assert run(backend, shared_sandbox, f"mkdir {path}").exit_code == 0
    yield path
    run(backend, shared_sandbox, f"chmod -R u+rwX {path}; rm -rf {path}")


def owned_volumes(client: docker.DockerClient, deployment: str) -> list[str]:
    found = client.api.volumes(filters={"label": labels.deployment_filter(deployment)})
    return [v["Name"] for v in found.get("Volumes") or []]


def owned_containers(client: docker.DockerClient, deployment: str) -> list[str]:
    found = client.api.containers(all=True, filters={"label": labels.deployment_filter(deployment)})
    return [str(c["Id"]) for c in found]


# -- exec ------------------------------------------------------------------------------------


def test_exec_reports_exit_code_stdout_and_stderr_apart(
    backend: DockerBackend, shared_sandbox: SandboxHandle
) -> None:
    result = run(backend, shared_sandbox, "echo to-out; echo to-err >&2; exit 3")
    assert result.exit_code == 3
    assert result.signal is None and not result.timed_out
    assert out(result) == "to-out\n"
    assert err(result) == "to-err\n"
    assert result.stdout.total_bytes == result.stdout.kept_bytes == 7
    assert not result.truncated
    assert result.duration_ms > 0
    ok = run(backend, shared_sandbox, "true")
    assert ok.exit_code == 0 and out(ok) == "" and err(ok) == ""


def test_streamed_output_arrives_as_it_is_printed(
    backend: DockerBackend, shared_sandbox: SandboxHandle
) -> None:
    """With ``on_output``, each piece comes while the command runs (the first long before it
    ends), stdout and stderr apart, up to the budget a stream; the result is as without."""
    pieces: list[tuple[float, str, bytes]] = []
    started = time.monotonic()
    result = backend.exec(
        shared_sandbox,
        "echo one; sleep 1; echo two >&2; sleep 1; head -c 3000 /dev/zero | tr '\\0' x",
        timeout_s=30,
        output_budget_bytes=1000,
        on_output=lambda stream, data: pieces.append((time.monotonic(), stream, data)),
    )
    ended = time.monotonic()
    assert result.exit_code == 0
    assert pieces[0][1:] == ("stdout", b"one\n") and pieces[0][0] - started < ended - started - 1.5
    assert ("stderr", b"two\n") in [(s, d) for _, s, d in pieces]
    streamed = b"".join(d for _, s, d in pieces if s == "stdout")
    assert streamed == b"one\n" + b"x" * 996  # the budget, as much as is kept
    assert result.stdout.total_bytes == 3004 and result.stdout.kept_bytes == 1000


def test_default_working_directory_is_workspace(
    backend: DockerBackend, shared_sandbox: SandboxHandle
) -> None:
    assert out(run(backend, shared_sandbox, "pwd")) == "/workspace\n"
    assert out(run(backend, shared_sandbox, "pwd", cwd="/tmp")) == "/tmp\n"
    # Each command starts afresh: a cd does not carry over.
    assert out(run(backend, shared_sandbox, "cd /tmp && pwd")) == "/tmp\n"
    assert out(run(backend, shared_sandbox, "pwd")) == "/workspace\n"


def test_missing_working_directory_is_a_bash_error_not_an_agent_failure(
    make_sandbox: Any, backend: DockerBackend
) -> None:
    handle = make_sandbox()
    run(backend, handle, "mkdir -p /workspace/sub && echo x > /workspace/sub/f")
    # The workspace itself is a mount point: only its contents can go.
    wiped = run(backend, handle, "cd /; rm -rf /workspace")
    assert wiped.exit_code != 0 and "/workspace" in err(wiped), wiped
    assert out(run(backend, handle, "pwd; ls -A")) == "/workspace\n"

    gone = run(backend, handle, "echo never", cwd="/workspace/sub")
    assert gone.exit_code == 1 and out(gone) == ""
    assert "cd: /workspace/sub: No such file or directory" in err(gone), gone

    # The agent locks itself out of its own workspace: a plain bash error every time.
    assert run(backend, handle, "chmod 000 /workspace").exit_code == 0
    for _ in range(2):
        locked = run(backend, handle, "echo never")
        assert locked.exit_code == 1 and out(locked) == ""
        assert "cd: /workspace: Permission denied" in err(locked), locked
    # Elsewhere, commands still run; the agent can undo its own mistake.
    assert out(run(backend, handle, "chmod 755 /workspace && echo back", cwd="/")) == "back\n"
    assert out(run(backend, handle, "pwd")) == "/workspace\n"


def test_probe_is_not_fooled_by_an_unusable_workspace(
    make_sandbox: Any, backend: DockerBackend
) -> None:
    handle = make_sandbox()
    assert run(backend, handle, "chmod 000 /workspace").exit_code == 0
    probe = backend.probe(handle)
    assert probe.alive and probe.agent_ok, probe


def test_concurrent_execs_run_in_parallel(
    backend: DockerBackend, shared_sandbox: SandboxHandle
) -> None:
    results: dict[int, ExecResult] = {}
    errors: list[BaseException] = []

    def one(n: int) -> None:
        try:
            results[n] = run(backend, shared_sandbox, f"sleep 0.3; echo {n}; echo e{n} >&2")
        except Exception as exc:  # noqa: BLE001 - collected, asserted below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(n,)) for n in range(16)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    elapsed = time.monotonic() - started
    assert not errors, errors
    assert sorted(results) == list(range(16))
    for n, result in results.items():
        assert result.exit_code == 0
        assert out(result) == f"{n}\n" and err(result) == f"e{n}\n"
    assert elapsed < 3, f"16 x 0.3 s commands took {elapsed:.2f} s: not run concurrently"


UNICODE_SAMPLES = ["héllo wörld", "✓ 日本語のテキスト", "emoji 🎉🐍 mixed ǅ ß", "ab日cd", "x🐍"]


def test_unicode_output_round_trips(backend: DockerBackend, shared_sandbox: SandboxHandle) -> None:
    for text in UNICODE_SAMPLES:
        size = len(text.encode())
        whole = run(backend, shared_sandbox, f"printf %s {shlex.quote(text)}")
        assert out(whole) == text and whole.stdout.total_bytes == size
        # A budget of exactly the output's size splits it into head and tail somewhere in
        # the middle of a character for some samples; nothing is dropped, so it survives.
        for budget in (size, size + 1):
            exact = run(
                backend, shared_sandbox, f"printf %s {shlex.quote(text)} >&2", budget=budget
            )
            assert not exact.stderr.truncated
            assert exact.stderr.head == text and exact.stderr.tail == "", (text, budget, exact)


def test_unicode_split_at_the_seam_when_bytes_are_dropped(
    backend: DockerBackend, shared_sandbox: SandboxHandle
) -> None:
    text = "日" * 10  # 30 bytes; a 10-byte budget keeps 5 + 5, cutting characters
    result = run(backend, shared_sandbox, f"printf %s {text}", budget=10)
    assert result.stdout.truncated
    assert result.stdout.total_bytes == 30 and result.stdout.kept_bytes == 10
    assert result.stdout.omitted_bytes == 20
    assert result.stdout.head.startswith("日") and result.stdout.tail.endswith("日")


def test_invalid_utf8_output_is_replaced_not_fatal(
    backend: DockerBackend, shared_sandbox: SandboxHandle
) -> None:
    result = run(backend, shared_sandbox, r"printf '\xff\xfe ok \xc3'; printf 'a\x80b' >&2")
    assert result.exit_code == 0
    assert out(result) == "\ufffd\ufffd ok \ufffd"
    assert err(result) == "a\ufffdb"
    assert result.stdout.total_bytes == 7 and result.stderr.total_bytes == 3
    # Binary noise in volume, and the agent goes on answering.
    noise = run(backend, shared_sandbox, "head -c 200000 /dev/urandom", budget=4096)
    assert noise.exit_code == 0 and noise.stdout.total_bytes == 200_000
    assert out(run(backend, shared_sandbox, "echo fine")) == "fine\n"


def test_exit_by_signal(backend: DockerBackend, shared_sandbox: SandboxHandle) -> None:
    killed = run(backend, shared_sandbox, "echo before; kill -9 $$; echo after")
    assert killed.signal == 9 and killed.exit_code == 128 + 9
    assert not killed.timed_out
    assert out(killed) == "before\n"
    terminated = run(backend, shared_sandbox, "kill -TERM $$")
    assert terminated.signal == 15 and terminated.exit_code == 128 + 15
    # A child killed by a signal is bash's ordinary exit status, not a signal of the command.
    child = run(backend, shared_sandbox, "sh -c 'kill -9 $$'")
    assert child.signal is None and child.exit_code == 137


def test_timeout_is_reported_without_an_exit_code(
    backend: DockerBackend, shared_sandbox: SandboxHandle
) -> None:
    started = time.monotonic()
    result = run(backend, shared_sandbox, "echo early; sleep 30", timeout_s=0.5)
    assert time.monotonic() - started < 5
    assert result.timed_out and result.exit_code is None
    assert out(result) == "early\n"


# -- lifecycle -------------------------------------------------------------------------------


def test_destroy_is_idempotent(
    backend: DockerBackend, base_image: str, client: docker.DockerClient
) -> None:
    spec = SandboxSpec(image=base_image, rollout_id="destroy-twice")
    handle = backend.create(spec)
    try:
        assert (backend.sockets_dir / handle.sandbox_id).is_dir()
        backend.destroy(handle)
        backend.destroy(handle)
        assert backend.probe(handle).state == "missing"
    finally:
        backend.destroy(handle)

    # Removed behind the backend's back: its /workspace (mounted by the host) and the
    # socket dir stay, and destroy still cleans them up without complaint.
    handle = backend.create(spec)
    merged = backend.workspaces.uppers / handle.sandbox_id / "merged"
    try:
        client.api.remove_container(handle.native_id, force=True)
        assert mounted_at(merged) == 2, "the mount point's bind and the overlay on it"
        backend.destroy(handle)
        backend.destroy(handle)
        assert mounted_at(merged) == 0 and not merged.exists()
        assert not (backend.sockets_dir / handle.sandbox_id).exists()
    finally:
        backend.destroy(handle)


def test_list_owned_finds_labelled_sandboxes_of_this_deployment_only(
    backend: DockerBackend,
    private_backend: DockerBackend,
    base_image: str,
    runtime: Runtime,
) -> None:
    rollout = unique("rollout")
    spec = SandboxSpec(image=base_image, rollout_id=rollout, runtime=runtime, lifetime_s=120)
    mine = backend.create(spec)
    theirs = private_backend.create(spec.model_copy(update={"rollout_id": rollout + "-other"}))
    try:
        listed = {h.sandbox_id: h for h in backend.list_owned()}
        assert mine.sandbox_id in listed and theirs.sandbox_id not in listed
        found = listed[mine.sandbox_id]
        assert found.rollout_id == rollout
        assert found.runtime == runtime
        assert found.host == backend.host == mine.host and found.host
        assert found.native_id == mine.native_id
        assert found.backend == "docker"
        assert found.created_at < found.expires_at
        assert found.expires_at - found.created_at == timedelta(seconds=120)
        assert abs(found.created_at - mine.created_at) < timedelta(seconds=1)
        # The handle from the labels works like the one create returned.
        assert out(run(backend, found, "echo via-label")) == "via-label\n"

        others = private_backend.list_owned()
        assert [h.sandbox_id for h in others] == [theirs.sandbox_id]
        assert others[0].rollout_id == rollout + "-other"
        assert private_backend.settings.deployment != backend.settings.deployment
    finally:
        backend.destroy(mine)
        private_backend.destroy(theirs)
    assert mine.sandbox_id not in {h.sandbox_id for h in backend.list_owned()}


def test_probe_tells_running_paused_exited_and_missing_apart(
    make_sandbox: Any, backend: DockerBackend, client: docker.DockerClient
) -> None:
    handle = make_sandbox()
    healthy = backend.probe(handle)
    assert healthy.alive and healthy.agent_ok and healthy.state == "running"
    assert healthy.latency_ms is not None and healthy.latency_ms > 0

    client.api.pause(handle.native_id)
    try:
        paused = backend.probe(handle)
        assert paused.state == "paused" and not paused.alive and not paused.agent_ok
    finally:
        client.api.unpause(handle.native_id)
    assert backend.probe(handle).agent_ok

    client.api.kill(handle.native_id)
    client.api.wait(handle.native_id, timeout=20)
    exited = backend.probe(handle)
    assert exited.state == "exited" and not exited.alive and not exited.agent_ok
    with pytest.raises(SandboxUnavailable):
        run(backend, handle, "echo unreachable")
    with pytest.raises(SandboxUnavailable):
        backend.read_file(handle, "x", max_bytes=100)

    client.api.remove_container(handle.native_id, force=True)
    missing = backend.probe(handle)
    assert missing.state == "missing" and not missing.alive and not missing.agent_ok
    with pytest.raises(SandboxUnavailable):
        run(backend, handle, "echo unreachable")


def _agent_host_pid(client: docker.DockerClient, handle: SandboxHandle) -> int:
    """The exec agent's pid on the host (the container's PID 1 is docker-init)."""
    top = client.api.top(handle.native_id, ps_args="-eo pid,args")
    found = [
        int(pid)
        for pid, args in top["Processes"]
        if "exec_agent" in args and not args.startswith(("docker-init", "/sbin/docker-init"))
    ]
    return min(found)  # the agent itself; its commands' shells come later


def test_a_starved_agent_is_slow_not_dead(
    make_sandbox: Any, backend: DockerBackend, client: docker.DockerClient
) -> None:
    """An agent that gets no CPU for 18 s (stopped from the host: the extreme of a host at
    load average 47) answers late; the probe asks again with growing timeouts while the
    sandbox runs, instead of calling it dead when one 15 s wait ran out, as it did."""
    handle = make_sandbox()
    pid = _agent_host_pid(client, handle)
    os.kill(pid, signal.SIGSTOP)
    resumed = threading.Timer(18, os.kill, args=(pid, signal.SIGCONT))
    resumed.start()
    try:
        started = time.monotonic()
        probe = backend.probe(handle)
        took = time.monotonic() - started
    finally:
        resumed.join()
    assert probe.alive and probe.agent_ok and probe.agent_caused is None, probe
    assert 17 < took < agent.PROBE_BUDGET_S, took
    assert backend.probe(handle).latency_ms is not None


def test_a_healthy_sandbox_s_probe_does_not_wait_on_the_daemon(
    make_sandbox: Any, settings: Settings, tmp_path: Path
) -> None:
    """A probe asks the agent first: one that answers runs, so a healthy sandbox's probe
    never asks the daemon, which on a saturated host under a low CPU weight answers late
    (tests/e2e/test_overloaded_host.py lost a rollout to a probe that asked it first). The
    daemon here accepts connections and never answers."""
    handle = make_sandbox()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "frozen-docker.sock"))
    listener.listen(16)
    listener.settimeout(0)
    frozen = docker.DockerClient(
        base_url=f"unix://{tmp_path / 'frozen-docker.sock'}", version="1.41", timeout=3
    )
    try:
        probe = DockerBackend(settings, client=frozen).probe(handle)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody called the daemon
    finally:
        frozen.close()
        listener.close()
    assert probe.alive and probe.agent_ok and probe.state == "running", probe


def test_exec_on_a_killed_sandbox_is_an_infrastructure_error(
    make_sandbox: Any, backend: DockerBackend, client: docker.DockerClient
) -> None:
    handle = make_sandbox()
    client.api.kill(handle.native_id)
    client.api.wait(handle.native_id, timeout=20)
    with pytest.raises(SandboxError) as caught:
        run(backend, handle, "echo unreachable")
    assert isinstance(caught.value, SandboxUnavailable)
    assert not isinstance(caught.value, FileError)


def test_exec_on_a_handle_of_another_host_is_refused(
    backend: DockerBackend, shared_sandbox: SandboxHandle
) -> None:
    elsewhere = shared_sandbox.model_copy(update={"host": "some-other-host"})
    with pytest.raises(SandboxUnavailable, match="some-other-host"):
        run(backend, elsewhere, "true")


def test_collect_expired_destroys_only_expired_sandboxes(
    private_backend: DockerBackend, base_image: str
) -> None:
    short = private_backend.create(SandboxSpec(image=base_image, lifetime_s=10))
    long = private_backend.create(SandboxSpec(image=base_image, lifetime_s=3600))

    report = collect_expired(private_backend)
    assert report.examined == 2 and report.destroyed == []

    report = collect_expired(private_backend, now=datetime.now(UTC) + timedelta(seconds=60))
    assert report.examined == 2
    assert report.destroyed == [short.sandbox_id]
    assert [h.sandbox_id for h in private_backend.list_owned()] == [long.sandbox_id]
    assert private_backend.probe(short).state == "missing"
    assert private_backend.probe(long).agent_ok

    report = collect_expired(private_backend, everything=True)
    assert report.destroyed == [long.sandbox_id]
    assert private_backend.list_owned() == []


def test_sweep_leftovers_removes_orphans_only(
    private_backend: DockerBackend,
    base_image: str,
    client: docker.DockerClient,
) -> None:
    deployment = private_backend.settings.deployment
    live = private_backend.create(SandboxSpec(image=base_image))
    orphan_id = "sbx-" + uuid.uuid4().hex[:16]
    # Long ago: a young volume may belong to a sandbox being created right now.
    then = datetime.now(UTC) - timedelta(hours=1)

    def stamp(of: str) -> dict[str, str]:
        return labels.sandbox_labels(
            deployment=of,
            sandbox_id=orphan_id,
            rollout_id="crashed",
            host=private_backend.host,
            runtime="runc",
            created_at=then,
            expires_at=then + timedelta(hours=2),
        )

    orphan_volume = client.volumes.create(
        name=f"orch-{deployment}-{orphan_id}", labels=stamp(deployment)
    )
    foreign_volume = client.volumes.create(
        name=unique("orch-foreign"), labels=stamp(deployment + "-foreign")
    )
    young_stamp = {**stamp(deployment), labels.CREATED: datetime.now(UTC).isoformat()}
    young_volume = client.volumes.create(name=unique(f"orch-{deployment}-"), labels=young_stamp)
    orphan_dir = private_backend.sockets_dir / orphan_id
    orphan_dir.mkdir()
    (orphan_dir / "agent.sock").write_text("stale")
    os.utime(orphan_dir, (0, 0))  # long ago: not a sandbox being created right now
    orphan_upper = private_backend.workspaces.uppers / orphan_id
    (orphan_upper / "upper").mkdir(parents=True)
    os.utime(orphan_upper, (0, 0))
    young_dir = private_backend.sockets_dir / ("sbx-" + uuid.uuid4().hex[:16])
    young_dir.mkdir()
    unrelated = private_backend.sockets_dir / "not-a-sandbox"
    unrelated.mkdir()
    try:
        removed = private_backend.sweep_leftovers()
        assert removed == 3
        volumes = {v.name for v in client.volumes.list()}
        assert orphan_volume.name not in volumes
        assert foreign_volume.name in volumes
        assert young_volume.name in volumes, "a fresh volume may be a sandbox being created"
        assert mounted_at(private_backend.workspaces.uppers / live.sandbox_id / "merged") == 2
        assert not orphan_dir.exists()
        assert not orphan_upper.exists()
        assert (private_backend.workspaces.uppers / live.sandbox_id).is_dir()
        assert young_dir.is_dir(), "a fresh socket dir may be a sandbox being created"
        assert unrelated.is_dir()
        assert (private_backend.sockets_dir / live.sandbox_id).is_dir()
        assert out(run(private_backend, live, "echo still-here")) == "still-here\n"
        assert private_backend.sweep_leftovers() == 0
    finally:
        foreign_volume.remove(force=True)
        young_volume.remove(force=True)
        with contextlib.suppress(NotFound):
            client.api.remove_volume(str(orphan_volume.name), force=True)
        private_backend.destroy(live)


def test_sweep_leaves_other_deployments_sockets_in_a_shared_state_dir(
    private_backend: DockerBackend, base_image: str
) -> None:
    neighbour = DockerBackend(
        private_backend.settings.model_copy(
            update={"deployment": private_backend.settings.deployment + "-n"}
        )
    )
    handle = neighbour.create(SandboxSpec(image=base_image))
    try:
        private_backend.sweep_leftovers()
        assert out(run(neighbour, handle, "echo alive")) == "alive\n"
    finally:
        neighbour.destroy(handle)


def test_create_with_a_missing_image_leaves_nothing_behind(
    private_backend: DockerBackend, client: docker.DockerClient
) -> None:
    image = f"orchestrator/no-such-image:{uuid.uuid4().hex[:8]}"
    with pytest.raises(SandboxError, match="no-such-image") as caught:
        private_backend.create(SandboxSpec(image=image))
    assert not isinstance(caught.value, SandboxUnavailable)
    deployment = private_backend.settings.deployment
    assert owned_containers(client, deployment) == []
    assert owned_volumes(client, deployment) == []
    assert list(private_backend.sockets_dir.iterdir()) == []
    assert private_backend.list_owned() == []


def test_a_too_long_state_dir_is_reported_as_such(
    settings: Settings, base_image: str, short_dir: Path
) -> None:
    deep = short_dir / ("d" * 80)
    own = settings.model_copy(
        update={
            "deployment": unique(settings.deployment[:24]),
            "state_dir": deep,
            "sandbox_start_timeout_s": 3.0,
        }
    )
    try:
        backend = DockerBackend(own)
    except SandboxError as exc:  # refusing the state dir up front is a fine answer too
        assert "too long" in str(exc)
        return
    try:
        with pytest.raises(SandboxError, match="too long"):
            backend.create(SandboxSpec(image=base_image))
    finally:
        collect_expired(backend, everything=True)


# -- read_file -------------------------------------------------------------------------------


def test_read_file_lines_ranges_and_byte_cap(
    backend: DockerBackend, shared_sandbox: SandboxHandle, workdir: str
) -> None:
    name = workdir.removeprefix("/workspace/")
    run(backend, shared_sandbox, f"printf 'l1\\nl2\\nl3\\nl4\\nl5\\n' > {workdir}/f.txt")

    whole = backend.read_file(shared_sandbox, f"{name}/f.txt", max_bytes=1000)
    assert whole.text == "l1\nl2\nl3\nl4\nl5\n"
    assert (whole.start_line, whole.end_line, whole.total_lines) == (1, 5, 5)
    assert not whole.truncated and whole.size_bytes == 15
    assert whole.path == f"{name}/f.txt"

    middle = backend.read_file(
        shared_sandbox, f"{name}/f.txt", start_line=2, end_line=3, max_bytes=1000
    )
    assert middle.text == "l2\nl3\n"
    assert (middle.start_line, middle.end_line, middle.total_lines) == (2, 3, 5)

    rest = backend.read_file(shared_sandbox, f"{name}/f.txt", start_line=4, max_bytes=1000)
    assert rest.text == "l4\nl5\n" and rest.end_line == 5

    past = backend.read_file(shared_sandbox, f"{name}/f.txt", start_line=9, max_bytes=1000)
    assert past.text == "" and past.end_line < past.start_line and past.total_lines == 5

    capped = backend.read_file(shared_sandbox, f"{name}/f.txt", max_bytes=7)
    assert capped.text == "l1\nl2\n" and capped.truncated
    assert capped.end_line == 2 and capped.total_lines == 5

    absolute = backend.read_file(shared_sandbox, f"{workdir}/f.txt", end_line=1, max_bytes=1000)
    assert absolute.text == "l1\n" and absolute.path == f"{workdir}/f.txt"

    run(backend, shared_sandbox, f"printf 'no newline' > {workdir}/ne; : > {workdir}/empty")
    no_eol = backend.read_file(shared_sandbox, f"{name}/ne", max_bytes=1000)
    assert no_eol.text == "no newline" and no_eol.total_lines == 1
    empty = backend.read_file(shared_sandbox, f"{name}/empty", max_bytes=1000)
    assert empty.text == "" and empty.total_lines == 0 and empty.size_bytes == 0

    run(backend, shared_sandbox, f"printf 'caf\\xc3\\xa9 \\xff\\n' > {workdir}/latin")
    mixed = backend.read_file(shared_sandbox, f"{name}/latin", max_bytes=1000)
    assert mixed.text == "café \ufffd\n"


def test_read_file_errors_are_the_agents(
    backend: DockerBackend, shared_sandbox: SandboxHandle, workdir: str
) -> None:
    name = workdir.removeprefix("/workspace/")
    setup = (
        f"cd {workdir} && cp /bin/true bin && printf 'a\\0b' > nul"
        " && mkdir dir && ln -s /etc/passwd link && ln -s ../../etc link-up"
        " && echo secret > locked && chmod 000 locked"
        " && mkdir closed && echo x > closed/f && chmod 000 closed"
    )
    assert run(backend, shared_sandbox, setup).exit_code == 0
    cases = {
        f"{name}/bin": "binary",
        f"{name}/nul": "binary",
        f"{name}/dir": "is_directory",
        name: "is_directory",
        "/workspace": "is_directory",
        f"{name}/missing": "not_found",
        f"{name}/dir/../missing": "not_found",
        "../../etc/passwd": "outside_workspace",
        f"{name}/../../etc/passwd": "outside_workspace",
        "/workspace/../etc/passwd": "outside_workspace",
        "/etc/passwd": "outside_workspace",
        "/workspacex/f": "outside_workspace",
        f"{name}/link": "outside_workspace",
        f"{name}/link-up/passwd": "outside_workspace",
        f"{name}/locked": "permission",
        f"{name}/closed/f": "permission",
    }
    for path, kind in cases.items():
        with pytest.raises(FileError) as caught:
            result = backend.read_file(shared_sandbox, path, max_bytes=1000)
            pytest.fail(f"{path}: expected {kind}, read {result}")
        assert caught.value.kind == kind, (path, caught.value.kind, caught.value.message)
        assert caught.value.message
    # The same files through the shell, as the agent sees them.
    assert run(backend, shared_sandbox, f"cat {workdir}/locked").exit_code != 0


def test_read_file_follows_symlinks_inside_the_workspace(
    backend: DockerBackend, shared_sandbox: SandboxHandle, workdir: str
) -> None:
    name = workdir.removeprefix("/workspace/")
    run(backend, shared_sandbox, f"cd {workdir} && echo target > real && ln -s real alias")
    result = backend.read_file(shared_sandbox, f"{name}/alias", max_bytes=100)
    assert result.text == "target\n"


def test_read_file_of_a_fifo_is_the_agents_error(make_sandbox: Any, backend: DockerBackend) -> None:
    handle = make_sandbox()
    assert run(backend, handle, "mkfifo /workspace/pipe").exit_code == 0
    # The agent's protocol directly, with a short wait instead of the backend's 30 s.
    sock = str(backend.sockets_dir / handle.sandbox_id / "agent.sock")
    request = protocol.read_file_request("pipe", 1, None, 1000)
    with pytest.raises(FileError):
        agent.read_file_result(agent.call_unix(sock, request, 3.0))


def test_sweep_removes_workspace_layers_of_images_that_are_gone(
    private_backend: DockerBackend, base_image: str
) -> None:
    live = private_backend.create(SandboxSpec(image=base_image))
    try:
        layers = private_backend.workspaces.layers
        kept = {p.name for p in layers.iterdir()}
        assert kept, "creating a sandbox extracts its image's /workspace layer"
        gone = layers / ("0" * 32)
        (gone / "workspace").mkdir(parents=True)
        private_backend.sweep_leftovers()
        assert not gone.exists()
        assert {p.name for p in layers.iterdir()} == kept
        assert out(run(private_backend, live, "ls -d /workspace")) == "/workspace\n"
    finally:
        private_backend.destroy(live)


# -- the /workspace disk cap -----------------------------------------------------------------


def loop_devices_of(image: Path) -> list[str]:
    """Loop devices backed by ``image`` (even once it is deleted)."""
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            if backing.read_text().strip().removesuffix(" (deleted)") == str(image):
                found.append(backing.parts[3])
    return found


def test_workspace_is_a_filesystem_of_its_own_gone_with_the_sandbox(
    backend: DockerBackend, base_image: str, runtime: Runtime
) -> None:
    handle = backend.create(
        SandboxSpec(image=base_image, runtime=runtime, limits=SandboxLimits(disk_mb=64))
    )
    top = backend.workspaces.uppers / handle.sandbox_id
    image = backend.workspaces.image_path(handle.sandbox_id)
    try:
        assert top.is_mount() and image.is_file()
        assert image.stat().st_size == 64 << 20
        assert loop_devices_of(image)
        size_kb = int(out(run(backend, handle, "df -k --output=size /workspace | tail -1")))
        assert 50_000 < size_kb <= 64 * 1024, size_kb
        fill = run(
            backend, handle, "head -c 100M /dev/zero > /workspace/fill; echo rc=$?; ls /workspace"
        )
        assert "No space left on device" in err(fill), fill
        # The host's file holds the sandbox's writes and never more than the cap.
        assert image.stat().st_blocks * 512 <= 65 << 20
    finally:
        backend.destroy(handle)
    assert not top.exists() and not image.exists()
    assert loop_devices_of(image) == []


def test_disk_mb_zero_leaves_the_workspace_uncapped(
    make_sandbox: Any, backend: DockerBackend
) -> None:
    handle = make_sandbox(limits={"disk_mb": 0})
    top = backend.workspaces.uppers / handle.sandbox_id
    assert top.is_dir() and not top.is_mount()
    assert not backend.workspaces.image_path(handle.sandbox_id).exists()
    assert out(run(backend, handle, "echo x > /workspace/f && cat /workspace/f")) == "x\n"


def test_sweep_unmounts_the_workspace_of_a_sandbox_lost_in_a_crash(
    private_backend: DockerBackend, base_image: str, client: docker.DockerClient
) -> None:
    lost = private_backend.create(SandboxSpec(image=base_image))
    top = private_backend.workspaces.uppers / lost.sandbox_id
    image = private_backend.workspaces.image_path(lost.sandbox_id)
    assert run(private_backend, lost, "echo x > /workspace/f").exit_code == 0
    # A worker that crashed after its container went: mounts, image and loop device stay
    # (the host's overlay and mount point too: the host mounts a runc sandbox's
    # /workspace, and Docker made no volume).
    client.api.remove_container(lost.native_id, force=True)
    assert not client.api.volumes(filters={"name": lost.native_id}).get("Volumes")
    merged = top / "merged"
    assert top.is_mount() and mounted_at(merged) == 2
    os.utime(image, (0, 0))
    os.utime(top, (0, 0))
    live = private_backend.create(SandboxSpec(image=base_image))
    try:
        assert private_backend.sweep_leftovers() >= 1
        assert not top.exists() and not image.exists()
        assert loop_devices_of(image) == [] and mounted_at(merged) == 0
        live_top = private_backend.workspaces.uppers / live.sandbox_id
        assert live_top.is_mount(), "a live sandbox's filesystem stays"
        assert out(run(private_backend, live, "echo still-here")) == "still-here\n"
    finally:
        private_backend.destroy(live)


# -- evidence for the worker: limits, probe, host health -------------------------------------


def test_paused_sandbox_is_infrastructure_and_can_be_destroyed(
    make_sandbox: Any, backend: DockerBackend, client: docker.DockerClient, runtime: Runtime
) -> None:
    handle = make_sandbox(runtime=runtime)
    image = backend.workspaces.image_path(handle.sandbox_id)
    client.api.pause(handle.native_id)
    started = time.monotonic()
    probe = backend.probe(handle)
    assert time.monotonic() - started < 2, "a probe never waits on a paused sandbox"
    assert probe.state == "paused" and not probe.alive and not probe.agent_ok
    assert probe.agent_caused is None and not probe.oom_killed and probe.exit_code is None
    started = time.monotonic()
    with pytest.raises(SandboxUnavailable, match="paused"):
        run(backend, handle, "echo frozen", timeout_s=0.5)
    assert time.monotonic() - started < 0.5 + agent.REPLY_SLACK_S + 2
    started = time.monotonic()
    backend.destroy(handle)
    assert time.monotonic() - started < 5
    assert backend.probe(handle).state == "missing"
    assert not image.exists()


def test_pids_filled_by_the_agent_is_the_agents_doing(
    make_sandbox: Any, backend: DockerBackend
) -> None:
    handle = make_sandbox(limits={"pids": 32})
    # A process that escaped its command (setsid) keeps every free slot of the pids limit
    # taken, so the agent itself cannot fork the next command.
    filler = PIDS_FILLER
    run(backend, handle, filler)
    time.sleep(1)
    result = run(backend, handle, "echo never")
    assert result.exit_code is None and result.limits_hit == ["pids"], result
    assert "could not start the command" in err(result)
    hit = result.limit("pids")
    assert hit is not None and hit.limit == 32 and hit.unit == "processes"
    with pytest.raises(FileError) as caught:
        backend.read_file(handle, "anything", max_bytes=100)
    assert caught.value.kind == "pids_limit"
    probe = backend.probe(handle)
    assert probe.alive and not probe.agent_ok and probe.agent_caused == "pids_limit", probe


def test_whole_sandbox_oom_is_the_agents_doing(
    make_sandbox: Any, backend: DockerBackend, runtime: Runtime
) -> None:
    if runtime != "runsc":
        pytest.skip("under runc the OOM killer takes a command, never the whole sandbox")
    handle = make_sandbox(runtime=runtime, limits={"memory_mb": 256, "pids": 64})
    # Each process stays under its RLIMIT_AS (3/4 of the limit); together they pass the
    # sandbox's memory limit, and under gVisor that kills the whole sandbox.
    hogs = (
        "for i in 1 2 3 4; do python3 -c 'import time; x = bytearray(150 << 20); "
        "time.sleep(20)' & done; wait"
    )
    with pytest.raises(SandboxUnavailable):
        run(backend, handle, hogs, timeout_s=30)
    # At once, as the worker does: the probe waits for the dying sandbox to be seen exited.
    probe = backend.probe(handle)
    assert probe.state == "exited" and not probe.alive, probe
    # 137 when the kernel took gVisor's sentry; 2 when it took its gofer (docker.py).
    assert probe.oom_killed and probe.exit_code in (137, 2), probe
    assert probe.agent_caused == "memory_limit", probe


def test_a_killed_sandbox_is_not_the_agents_doing(
    make_sandbox: Any, backend: DockerBackend, client: docker.DockerClient
) -> None:
    handle = make_sandbox()
    client.api.kill(handle.native_id)
    client.api.wait(handle.native_id, timeout=20)
    probe = backend.probe(handle)
    assert probe.state == "exited" and probe.exit_code == 137 and not probe.oom_killed
    assert probe.agent_caused is None


def test_host_health_reports_daemon_disk_and_sandboxes(
    backend: DockerBackend, shared_sandbox: SandboxHandle
) -> None:
    health = backend.host_health()
    assert health.backend_ok and health.error is None
    assert health.backend_ping_ms is not None and health.backend_ping_ms > 0
    assert health.disk_free_bytes > 0
    assert health.sandboxes >= 1


def test_host_health_reports_an_unreachable_daemon(settings: Settings, short_dir: Path) -> None:
    unreachable = DockerBackend(
        settings.model_copy(update={"state_dir": short_dir}),
        # An explicit API version: the client then does not ask the daemon at construction.
        client=docker.DockerClient(base_url="unix:///nonexistent/docker.sock", version="1.41"),
    )
    health = unreachable.host_health()
    assert not health.backend_ok and health.error
    assert health.backend_ping_ms is None and health.disk_free_bytes > 0
