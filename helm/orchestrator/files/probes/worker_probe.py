"""Exec probe of a worker pod: is this pod's worker beating?

The worker publishes its heartbeat (``orch:<deployment>:worker:<host>``, TTL three beats)
from a thread of the Celery worker process once Celery is consuming, so the key's presence
says the process is alive, connected to Redis and past its start. It does not prove the
Celery consumer is unwedged; ``celery inspect ping`` would, but takes a broadcast round
trip through Redis and seconds of CPU per probe.

``ready``: the heartbeat is there. ``alive``: the heartbeat is there, or Redis cannot be
reached at all (restarting the worker would not bring Redis back, and a Redis outage
must not restart every worker at once).
"""

import sys

from orchestrator.config import get_settings
from orchestrator.state.errors import StateError
from orchestrator.state.heartbeat import is_beating


def main(mode: str) -> int:
    settings = get_settings()
    try:
        beating = is_beating(settings)
    except StateError as exc:
        print(f"redis unreachable: {exc!r}")
        return 0 if mode == "alive" else 1
    if not beating:
        print(f"no heartbeat for host {settings.host_id!r}")
    return 0 if beating else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "ready"))
