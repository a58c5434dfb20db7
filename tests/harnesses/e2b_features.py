"""What a harness on an e2b SDK of its own does with the sandbox features of issue 32, run in
that SDK's interpreter (tests/e2e/test_e2b_floor.py runs it with the oldest SDK Harbor
accepts): output streamed, stdin, a PTY, metrics, a directory watched, a snapshot and a
sandbox from it, a fork, a pause and a resume by connect. Prints one JSON object: what each
step saw. Only the SDK and the standard library; the SDK's settings from the environment
(E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY).

usage: e2b_features.py TEMPLATE
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import time
from typing import Any

from e2b import CommandExitException, PtySize, Sandbox


def main(template: str) -> dict[str, Any]:
    seen: dict[str, Any] = {"sdk": importlib.metadata.version("e2b")}
    made: list[Sandbox] = []
    try:
        sbx = Sandbox.create(template=template, timeout=300)
        made.append(sbx)
        pieces: list[tuple[float, str]] = []
        started = time.monotonic()
        result = sbx.commands.run(
            "echo first; sleep 1.5; echo second",
            on_stdout=lambda text: pieces.append((time.monotonic() - started, text)),
        )
        seen["streamed"] = {
            "stdout": result.stdout,
            "first_at_s": pieces[0][0] if pieces else None,
            "took_s": time.monotonic() - started,
        }
        handle = sbx.commands.run("cat", background=True, stdin=True, timeout=60)
        sbx.commands.send_stdin(handle.pid, "typed\n")
        sbx.commands.close_stdin(handle.pid)
        seen["stdin"] = handle.wait().stdout

        typed: list[bytes] = []
        terminal = sbx.pty.create(PtySize(rows=30, cols=90), timeout=60)
        sbx.pty.send_stdin(terminal.pid, b"stty size; exit 3\n")
        try:
            terminal.wait(on_pty=typed.append)
            seen["pty_exit"] = 0
        except CommandExitException as exc:
            seen["pty_exit"] = exc.exit_code
        seen["pty"] = b"".join(typed).decode(errors="replace")

        (metric,) = sbx.get_metrics()
        seen["metrics"] = {"cpu_count": metric.cpu_count, "mem_total": metric.mem_total}

        watcher = sbx.files.watch_dir("/workspace")
        sbx.files.write("/workspace/watched.txt", "x")
        seen["watched"] = [(e.name, e.type.value) for e in watcher.get_new_events()]
        watcher.stop()

        sbx.commands.run("echo set-up > /workspace/state && echo warm > /tmp/state")
        snapshot = sbx.create_snapshot()
        child = Sandbox.create(snapshot.snapshot_id, timeout=120)
        made.append(child)
        seen["from_snapshot"] = child.commands.run("cat /workspace/state /tmp/state").stdout
        forks = sbx.fork(count=2, timeout=120)
        made += [f for f in forks if isinstance(f, Sandbox)]
        seen["forks"] = [
            f.commands.run("cat /workspace/state").stdout if isinstance(f, Sandbox) else repr(f)
            for f in forks
        ]
        seen["deleted"] = Sandbox.delete_snapshot(snapshot.snapshot_id)

        seen["paused"] = sbx.pause()
        seen["state_paused"] = str(sbx.get_info().state.value)
        again = Sandbox.connect(sbx.sandbox_id)
        seen["resumed"] = again.commands.run("cat /workspace/state /tmp/state").stdout
    finally:
        for sandbox in made:
            try:
                sandbox.kill()
            except Exception as exc:  # noqa: BLE001 (what is left, the test counts)
                print(f"kill failed: {exc}", file=sys.stderr)
    return seen


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
