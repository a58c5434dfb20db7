"""The agent-caused table: every act an agent can commit against its own sandbox, run as a
real Agent RFT rollout on each backend (Docker runc, Docker runsc, Kubernetes), must be
scored, never discarded: its calls are 200s (whatever the act did, the output says so) and
its grade is a score. A rollout discarded for what its own agent did would teach the policy
that breaking its sandbox avoids a low reward.

Each rollout: a first call, the act, a call after it, then the grade. The rows are written
as JSON lines (``AGENT_CAUSED_REPORT``, set by tests/conftest.py) and printed at the end of
the run as one table: an act per line, a backend per column.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from orchestrator.tls import tls

REPORT_ENV = "AGENT_CAUSED_REPORT"
ANSWER = "src/requests/api.py"
GOLD = [ANSWER]

# What the acts' sandboxes are limited to (each backend's environment sets these).
LIMITS = {"memory_mb": 256, "pids": 64, "tmp_mb": 32, "disk_mb": 64, "output_mb": 8}

# Root's processes only: the loop's own shell (uid 1000) has "exec_agent" in its command
# line too, and would stop or kill itself.
_EACH_AGENT_PID = (
    'for p in /proc/[0-9]*; do [ "$(stat -c %u $p 2>/dev/null)" = 0 ] && '
    "grep -qa exec_agent $p/cmdline 2>/dev/null && kill {signal} ${{p#/proc/}} 2>&1; "
    "done; echo tried"
)
_MEMORY_HOGS = (
    "for i in 1 2 3 4 5 6; do python3 -c 'import time; x = bytearray(120 << 20); "
    "time.sleep(4)' & done; wait; echo done"
)
_FD_HOG = (
    "python3 -c \"import os\nfds = []\ntry:\n    while True: fds.append(os.open('/dev/null', "
    "os.O_RDONLY))\nexcept OSError as e: print('opened', len(fds), e.strerror)\""
)


@dataclass(frozen=True)
class Act:
    """One thing an agent does to its own sandbox, and what its call or the call after it
    says about it (one of ``shows``, case-insensitive; empty: anything)."""

    name: str
    command: str
    timeout_s: float = 10.0
    shows: tuple[str, ...] = ()


ACTS: list[Act] = [
    Act("kill -9 -1", "kill -9 -1; echo after"),
    Act("kill the exec agent", _EACH_AGENT_PID.format(signal="-9"), shows=("not permitted",)),
    Act("stop the exec agent", _EACH_AGENT_PID.format(signal="-STOP"), shows=("not permitted",)),
    Act("signal PID 1", "kill -9 1 2>&1; kill -TERM 1 2>&1; echo tried", shows=("not permitted",)),
    Act(
        "fork bomb",
        ":(){ :|:& };:; sleep 5",
        timeout_s=3,
        shows=("process limit", "timed out"),
    ),
    Act("exhaust memory", _MEMORY_HOGS, timeout_s=20, shows=("memory",)),
    # Docker's workspace is a disk of its own: ENOSPC. A Kubernetes node lets the write
    # through and evicts the pod at its next look (a real kubelet's eviction manager looks
    # every 10 s): the agent that overfilled works on, and its sandbox ends under it.
    Act(
        "fill the disk",
        "dd if=/dev/zero of=/workspace/fill bs=1M count=200 2>&1 | tail -n 4; "
        '[ "$(du -sm /workspace/fill | cut -f1)" -lt 64 ] || sleep 50',
        timeout_s=60,
        shows=("no space left", "disk limit"),
    ),
    Act(
        "fill /tmp",
        "dd if=/dev/zero of=/tmp/fill bs=1M count=200 2>&1 | tail -n 4",
        shows=("no space left",),
    ),
    Act("close stdout and stderr", "exec 1>&- 2>&-; sleep 1; echo lost"),
    Act("flood stdout", "yes flood", shows=("output",)),
    Act("exhaust file descriptors", _FD_HOG, shows=("too many open files",)),
    Act(
        "binary and invalid UTF-8 output",
        "head -c 2000 /dev/urandom; printf 'bad \\xff\\xfe utf-8\\n'",
    ),
    Act("sleep past its timeout", "sleep 30", timeout_s=2, shows=("timed out",)),
    Act(
        "rm -rf /",
        "rm -rf / --no-preserve-root 2>&1 | tail -n 2",
        timeout_s=20,
        shows=("read-only file system", "permission denied"),
    ),
]


@dataclass
class Row:
    """One act on one backend."""

    act: str
    backend: str
    statuses: list[int] = field(default_factory=list)
    """The HTTP status of each request: first call, the act, the call after, the grade."""
    score: float | None = None
    state: str | None = None
    cause: str | None = None
    shown: str = ""
    """A line of the act's outputs (what it did, as the agent saw it)."""
    expected_shown: bool = True
    seconds: float = 0.0

    def problems(self) -> list[str]:
        found = []
        if any(s != 200 for s in self.statuses):
            found.append(f"non-200 answers {self.statuses}")
        if self.state == "infra_failed" or self.cause:
            found.append(f"discarded as {self.cause or self.state}")
        if self.score is None:
            found.append("not scored")
        if not self.expected_shown:
            found.append(f"the outputs do not say what happened: {self.shown!r}")
        return found

    @property
    def verdict(self) -> str:
        return "scored" if not self.problems() else "WRONG"


def run_act(base_url: str, token: str, item: dict[str, Any], act: Act, backend: str) -> Row:
    """Run ``act`` as one Agent RFT rollout on the stack at ``base_url``; its row."""
    trace = f"trace_{uuid.uuid4().hex}"
    row = Row(act=act.name, backend=backend)
    started = time.monotonic()
    outputs: list[str] = []
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=180, verify=tls()) as client:
        for arguments in (
            {"command": "echo ready"},
            {"command": act.command, "timeout_s": act.timeout_s},
            {"command": "echo alive"},
        ):
            reply = client.post(
                "/agent-rft/tools",
                json={
                    "type": "function_call",
                    "id": f"fc_{uuid.uuid4().hex[:12]}",
                    "call_id": f"call_{uuid.uuid4().hex[:16]}",
                    "name": "shell",
                    "arguments": json.dumps(arguments),
                    "trace_id": trace,
                    "item": item,
                },
            )
            row.statuses.append(reply.status_code)
            outputs.append(reply.json().get("output", "") if reply.status_code == 200 else "")
        graded = client.post(
            "/agent-rft/grade",
            json={"sample": {"output_text": ANSWER}, "item": item, "trace_id": trace},
        )
        row.statuses.append(graded.status_code)
        if graded.status_code == 200:
            row.score = float(graded.json()["score"])
        record = client.get(f"/v1/rollouts/{trace}").json()
        row.state = record.get("state")
        row.cause = (record.get("infra_failure") or {}).get("cause")
        client.delete(f"/v1/rollouts/{trace}")
    said = "\n".join(outputs[1:]).lower()
    row.expected_shown = not act.shows or any(s in said for s in act.shows)
    lines = [line for line in outputs[1].splitlines() if line.strip()] or ["(no output)"]
    match = next((line for line in lines if any(s in line.lower() for s in act.shows)), None)
    shown = (match or lines[-1])[:90]
    # Printable for the table: what binary output the act made is not worth a terminal's.
    row.shown = "".join(c if c.isprintable() and c.isascii() else "?" for c in shown)
    row.seconds = round(time.monotonic() - started, 1)
    write_row(row)
    return row


def write_row(row: Row) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        with Path(path).open("a") as out:
            out.write(json.dumps(asdict(row)) + "\n")


def read_rows(path: Path) -> list[Row]:
    if not path.exists():
        return []
    return [Row(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


BACKENDS = ["docker runc", "docker runsc", "kubernetes"]


def table(rows: list[Row]) -> list[str]:
    """An act per line, a backend per column (``scored`` or ``WRONG``), then the notes."""
    by = {(r.act, r.backend): r for r in rows}
    acts = [a.name for a in ACTS if any(a.name == r.act for r in rows)]
    backends = [b for b in BACKENDS if any(b == r.backend for r in rows)]
    headers = ["act against its own sandbox", *backends]
    cells = [
        [act, *(by[(act, b)].verdict if (act, b) in by else "-" for b in backends)] for act in acts
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]

    def line(values: list[str]) -> str:
        return " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True))

    out = [line(headers), "-+-".join("-" * w for w in widths), *(line(c) for c in cells), ""]
    for row in rows:
        problems = row.problems()
        status = "WRONG: " + "; ".join(problems) if problems else "scored"
        out.append(f"{row.backend} / {row.act}: {status}; {row.shown!r} ({row.seconds:.0f} s)")
    return out
