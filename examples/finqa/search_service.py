"""The FinQA example's ``search`` as the operator's own service (docs/tenancy.md, "HTTP
tools"): POST {"query": ..., "k": ...} with ``Authorization: Bearer <token>``, answered
with the matching lines of the reports, ``file:line:text``, at most ``k`` per report.

Run it beside a deployment and use ``search-environment.yaml``'s environment, whose
``search`` tool is this service instead of ``rg`` in the sandbox::

    FINQA_SEARCH_TOKEN=... python examples/finqa/search_service.py --port 8088

Standard library only: it is an example of the shape, not a search engine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).parent / "corpus"
MAX_BODY = 64 * 1024


def search(corpus: Path, query: str, per_report: int) -> list[str]:
    """Lines of every report matching ``query`` (case-insensitive), ``file:line:text``."""
    pattern = re.compile(re.escape(query), re.IGNORECASE)
    found: list[str] = []
    for report in sorted(corpus.glob("*.txt")):
        matches = [
            f"{report.name}:{n}:{line.strip()[:300]}"
            for n, line in enumerate(report.read_text().splitlines(), start=1)
            if pattern.search(line)
        ]
        found += matches[:per_report]
    return found


def handler(corpus: Path, token: str) -> type[BaseHTTPRequestHandler]:
    class Search(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.headers.get("authorization") != f"Bearer {token}":
                # Our credentials, not the agent's question: the orchestrator reads a 401
                # as the tool's failure, never the agent's.
                return self._answer(401, {"error": "unauthorized"})
            size = int(self.headers.get("content-length", "0"))
            if size > MAX_BODY:
                return self._answer(413, {"error": "request too large"})
            try:
                body: Any = json.loads(self.rfile.read(size))
                query = str(body["query"]).strip()
                per_report = int(body.get("k") or 5)
            except (ValueError, KeyError, TypeError):
                return self._answer(400, {"error": 'send {"query": text, "k": number}'})
            if not query:
                return self._answer(422, {"error": "query: empty"})
            lines = search(corpus, query, per_report)
            if not lines:
                return self._answer(404, {"error": f"no report mentions {query!r}"})
            return self._answer(200, {"matches": lines})

        def _answer(self, status: int, body: dict[str, Any]) -> None:
            respond(self, status, json.dumps(body).encode())

    return Search


def respond(request: BaseHTTPRequestHandler, status: int, data: bytes) -> None:
    """Answer ``request`` with ``status`` and the JSON ``data``."""
    request.send_response(status)
    request.send_header("content-type", "application/json")
    request.send_header("content-length", str(len(data)))
    request.end_headers()
    request.wfile.write(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8088)
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    args = parser.parse_args()
    token = os.environ["FINQA_SEARCH_TOKEN"]
    server = ThreadingHTTPServer((args.host, args.port), handler(args.corpus, token))
    print(f"finqa search on http://{args.host}:{args.port}/search", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
