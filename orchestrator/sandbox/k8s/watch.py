"""Waiting on one pod with a deadline, by watching it rather than polling the API server.

lightkube's own ``Client.watch`` re-opens the watch whenever the server closes it, so it
never ends on its own and cannot be bounded by a deadline from the thread iterating it.
This makes one watch request whose ``timeoutSeconds`` is the deadline (the API server
closes it then), using lightkube's request building and typed decoding.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx2
from lightkube import Client
from lightkube.core.generic_client import WatchDriver
from lightkube.resources.core_v1 import Pod

# On top of the server's own timeout: a server that never closes the watch still cannot
# hold the caller past its deadline by more than this.
READ_SLACK_S = 5.0


def watch_pod(
    client: Client,
    *,
    namespace: str,
    name: str,
    resource_version: str | None,
    timeout_s: float,
) -> Iterator[tuple[str, Pod]]:
    """Events (ADDED, MODIFIED, DELETED) of pod ``name`` after ``resource_version``, for
    at most ``timeout_s``. Raises ``httpx2.HTTPError`` (410 Gone: the version is too old,
    start again from a fresh read; as an ERROR event in the stream, it is an ``ApiError``
    without a response)."""
    seconds = max(1, math.ceil(timeout_s))
    # lightkube's generic client: the public watch has no deadline (see the module doc).
    generic: Any = client._client
    request = generic.prepare_request(
        "list",
        res=Pod,
        namespace=namespace,
        watch=True,
        params={
            "timeoutSeconds": seconds,
            "fieldSelector": f"metadata.name={name}",
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "false",
        },
    )
    driver: Any = WatchDriver(request, generic._client.build_request)
    timeout = httpx2.Timeout(10.0, read=seconds + READ_SLACK_S)
    response = generic.send(driver.get_request(timeout=timeout), stream=True)
    try:
        if response.is_error:
            # A refusal's Status body, read before it is raised: the error names the
            # API server's reason (a streamed response is otherwise unread, and reading
            # its text later raises ResponseNotRead instead of the refusal).
            response.read()
        response.raise_for_status()
        for line in response.iter_lines():
            if line.strip():
                kind, obj = driver.process_one_line(line)
                yield str(kind), obj
    except httpx2.ReadTimeout:
        return  # the deadline passed with nothing new: the caller re-reads the pod
    finally:
        response.close()
