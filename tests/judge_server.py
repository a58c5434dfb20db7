"""A real OpenAI-compatible judge server for the tests: ``transformers serve`` (the trainers'
venv, extra ``serving``) on loopback, serving the tiny steered models tests/judge_models.py
builds. It can be stopped, slowed (SIGSTOP: it takes connections and answers none) and
started again on its port, as a real judge deployment goes down and comes back."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from tests.e2e.trainers import QUIET, trainers_python


class JudgeServer:
    """``transformers serve`` on ``127.0.0.1:port``; models under ``models``."""

    def __init__(self, port: int, models: Path, logs: Path) -> None:
        self.port = port
        self.models = models
        self.log_path = logs / "judge-server.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def model(self, name: str) -> str:
        """The model ``name`` (an entry of tests/judge_models.VERDICTS), as requests name it."""
        return str(self.models / name)

    def build_models(self) -> None:
        """The steered judge models, once (built in the trainers' venv)."""
        if (self.models / "fair" / "config.json").exists():
            return
        built = subprocess.run(
            [trainers_python(), str(Path(__file__).with_name("judge_models.py")), str(self.models)],
            env={**os.environ, **QUIET},
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert built.returncode == 0, built.stderr[-3000:]

    def start(self, timeout_s: float = 120) -> None:
        """Serve, and return once a chat completion is answered (the first loads a model)."""
        python = Path(trainers_python())
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    str(python.with_name("transformers")),
                    "serve",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--device",
                    "cpu",
                    "--log-level",
                    "info",
                ],
                env={**os.environ, **QUIET, "HF_HUB_OFFLINE": "1"},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log_path.read_text()[-3000:]
            try:
                reply = httpx.post(
                    f"{self.base_url}/chat/completions",
                    json={
                        "model": self.model("fair"),
                        "messages": [{"role": "user", "content": "ready?"}],
                        "max_tokens": 32,
                        "temperature": 0,
                    },
                    timeout=30,
                )
                if reply.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise AssertionError(f"the judge server did not answer in {timeout_s:g} s")

    def stop(self) -> None:
        """Down: the port refuses connections."""
        if self.process is None:
            return
        self.resume()
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(15)
        self.process = None
        _wait_closed(self.port)

    def pause(self) -> None:
        """Slow past any bound: the kernel still takes connections, nothing answers."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGCONT)

    def requests(self) -> int:
        """How many chat completions the server has answered, from its access log."""
        text = self.log_path.read_text(errors="replace")
        return text.count('"POST /v1/chat/completions HTTP/1.1" 200')


def _wait_closed(port: int, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"port {port} still takes connections")
