"""The agent's transport: a Unix socket (Docker) or TCP with the sandbox's token
(Kubernetes); one JSON request per connection, answered by its op's handler; threads that
wait in accept() and answer what they accept. Part of the exec agent (exec_agent.py):
standard library only, Python 3.9+, put beside it in every sandbox."""

from __future__ import annotations

import json
import os
import socketserver
import threading
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from orchestrator.sandbox.agent import agent_protocol as protocol
    from orchestrator.sandbox.agent.agent_processes import log
    from orchestrator.sandbox.agent.exec_agent import Agent
else:
    try:  # in a sandbox: the files beside this one (their directory is first on sys.path)
        import agent_protocol as protocol
        from agent_processes import log
    except ImportError:  # imported on the host (run-as's constants, tests)
        from orchestrator.sandbox.agent import agent_protocol as protocol
        from orchestrator.sandbox.agent.agent_processes import log

# A request is one JSON line: a file written through the "files" op travels in it (base64).
MAX_REQUEST_BYTES = 48 << 20


class Handler(socketserver.StreamRequestHandler):
    server: Server | TcpServer

    def handle(self) -> None:
        line = self.rfile.readline(MAX_REQUEST_BYTES)
        if not line.strip():
            return  # a port check (the kubelet's readiness probe), not a request
        try:
            req = json.loads(line)
            if not authorized(req, self.server.token, self.client_address):
                self.wfile.write(protocol.refused(protocol.Refusal.UNAUTHORIZED, "bad token"))
                return
            op = req["op"]
            if op == protocol.Op.EXEC and req.get("stream"):
                # The command's output as it is printed, a line per piece, before the reply.
                reply = protocol.ok(self.server.agent.exec(req, emit=self._emit))
            else:
                reply = protocol.ok(self.server.methods[op](req))
        except Exception as exc:  # noqa: BLE001 - every failure must reach the caller
            reply = protocol.refused(protocol.Refusal.FAILED, f"{type(exc).__name__}: {exc}")
        self.wfile.write(reply)

    def _emit(self, stream: str, data: bytes) -> None:
        self.wfile.write(protocol.chunk(stream, data))
        self.wfile.flush()


def answers(agent: Agent) -> dict[str, Any]:
    """What answers each request, by its op (made once, at the start)."""
    op = protocol.Op
    return {
        op.PING: agent.ping,
        op.EXEC: agent.exec,
        op.READ_FILE: agent.read_file,
        op.SIGNAL: agent.signal,
        op.FILES: agent.files,
        op.MANIFEST: agent.manifest,
        op.SCRUB: agent.scrub,
        op.STAGE: agent.stage,
        op.PACK: agent.pack,
        op.INPUT: agent.input,
        op.UNPACK: agent.unpack,
    }


def authorized(req: object, token: bytes | None, client_address: object) -> bool:
    """Whether a request carries the sandbox's ``token`` (always, when none is required:
    None over a Unix socket, whose directory only the host can reach)."""
    if token is None:
        return True
    given = req.get("token") if isinstance(req, dict) else None
    import hmac

    if isinstance(given, str) and hmac.compare_digest(given.encode(), token):
        return True
    log(f"refused a request from {client_address}: {'wrong' if given else 'missing'} token")
    return False


class ServerMixin:
    """What every request's handler reaches through its server: the agent, its answers by
    op (:func:`answers`), and the token requests must carry (None: none)."""

    request_queue_size = 256
    agent: Agent
    methods: dict[str, Any]
    token: bytes | None = None


class Server(ServerMixin, socketserver.UnixStreamServer):
    """The agent over a Unix socket (Docker: a host directory mounted into one sandbox)."""


class TcpServer(ServerMixin, socketserver.TCPServer):
    """The agent over TCP (Kubernetes: the pod network, every request carrying the token)."""

    allow_reuse_address = True


# Threads kept waiting in accept() between requests. Each accepts a connection and answers
# it itself (leader/follower): socketserver's thread per connection cost 0.45 ms a request
# in a runc sandbox and 1.2 ms under gVisor, a thread start before the request was read;
# from accept() to the request's handler is now 0.10 ms (runc; the agent timed inside with
# perf_counter marks, p50 of 200 `true` execs). Two wait, so a request that comes
# while one answers (a "signal" during an exec) finds the other: the agent holds as many
# tasks while a command runs as it did (its main thread and one answering), one more at
# rest, none of the agent's user's.
IDLE_ACCEPTORS = 2
# How long an accept() waits before its thread looks around: SIGTERM's handler runs in the
# main thread only, and within this (serve_forever's poll interval was the same).
ACCEPT_POLL_S = 0.5


class Acceptors:
    """The threads that accept and answer the agent's connections."""

    def __init__(self, server: socketserver.BaseServer) -> None:
        self.server = server
        self.socket: Any = server.socket  # type: ignore[attr-defined]
        self.socket.settimeout(ACCEPT_POLL_S)
        self.lock = threading.Lock()
        self.idle = 0

    def serve_forever(self) -> None:
        """Accept and answer in this (the main) thread, which never leaves, and in others."""
        self.spawn()
        self.accept_loop(main=True)

    def spawn(self) -> bool:
        try:
            threading.Thread(target=self.accept_loop, daemon=True).start()
            return True
        except RuntimeError:
            # No thread to be had: the pids limit counts threads, and the agent's user may
            # fill it. The thread that found this answers its request anyway, so the host
            # hears why (a reply that says pids_limit), then accepts again.
            return False

    def accept_loop(self, main: bool = False) -> None:
        while True:
            with self.lock:
                if not main and self.idle >= IDLE_ACCEPTORS:
                    return  # enough wait without this one (it was spawned for a busy moment)
                self.idle += 1
            try:
                request, address = self.socket.accept()
            except OSError as exc:
                # A timeout (3.9's socket.timeout is no TimeoutError) has no errno; EMFILE
                # and the like do: try again, without spinning.
                if exc.errno is not None:
                    time.sleep(0.01)
                continue
            finally:
                with self.lock:
                    self.idle -= 1
                    alone = self.idle == 0
            if alone:
                self.spawn()  # someone must accept while this thread answers
            self.answer(request, address)

    def answer(self, request: Any, address: Any) -> None:
        """What socketserver's process_request_thread does with one connection."""
        request.settimeout(None)
        try:
            self.server.finish_request(request, address)
        except Exception:  # noqa: BLE001 - one broken connection must not end the thread
            self.server.handle_error(request, address)
        finally:
            self.server.shutdown_request(request)


def listen(address: str, agent: Agent, token: bytes | None) -> Server | TcpServer:
    """``agent``'s server on ``unix:PATH`` or ``tcp:HOST:PORT``, its requests carrying
    ``token`` (None: none)."""
    kind, _, where = address.partition(":")
    host, _, port = where.rpartition(":")
    server: Server | TcpServer
    if kind == "unix" and where:
        try:
            os.unlink(where)
        except FileNotFoundError:
            pass
        os.umask(0o077)
        server = Server(where, Handler)
    elif kind == "tcp" and host and port.isdigit():
        server = TcpServer((host.strip("[]"), int(port)), Handler)
    else:
        raise SystemExit(f"exec-agent: --listen wants unix:PATH or tcp:HOST:PORT, not {address!r}")
    server.agent, server.methods, server.token = agent, answers(agent), token
    return server
