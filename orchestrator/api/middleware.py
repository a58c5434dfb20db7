"""HTTP metrics: every request counted by route template, method and status, and timed.

The label is the matched route's path template (``/v1/rollouts/{rollout_id}``), never the
raw path, so rollout ids cannot become label values. A path no route matches is
``unmatched`` (404); a request refused before routing (401, 413) is ``unrouted``. This is
the outermost middleware, so the guard's refusals are counted too; the route is the one
the router notes in the request's scope (the guard edits that scope in place, never a
copy, so the note reaches this middleware).
"""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.observability import metrics

UNMATCHED = "unmatched"
UNROUTED = "unrouted"


class HttpMetrics:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an exception that escapes every handler

        async def noting(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, noting)
        finally:
            route = route_template(scope, status)
            metrics.HTTP_REQUESTS.labels(route, scope["method"], str(status)).inc()
            metrics.HTTP_REQUEST_SECONDS.labels(route).observe(time.perf_counter() - started)


def route_template(scope: Scope, status: int) -> str:
    """The path template of the route the router matched (a route matching the path but
    not the method counts: that 405 is still about that route)."""
    route = scope.get("route")
    if route is None:
        return UNMATCHED if status == 404 else UNROUTED
    return str(getattr(route, "path", UNMATCHED))
