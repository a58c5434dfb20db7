"""A client of the rollout API (``/v1/rollouts``) for trainers, sync and async.

```python
from orchestrator.client import RolloutClient, InfraFailure

with RolloutClient("http://127.0.0.1:8000", token) as client:
    with client.rollout(environment="codebase-planning", item=row) as r:
        r.call("shell", {"command": "rg -l Session"})
        score = r.grade(answer='["src/requests/sessions.py"]').score
```

An :class:`InfraFailure` means: drop this sample, it was our fault (docs/trainers.md).
"""

from orchestrator.client.aio import AsyncRollout, AsyncRolloutClient
from orchestrator.client.errors import (
    AtCapacity,
    Conflict,
    InfraFailure,
    InvalidRequest,
    OrchestratorError,
    RolloutNotFound,
    Unauthorized,
    Unavailable,
)
from orchestrator.client.retry import RetryPolicy
from orchestrator.client.sync import Rollout, RolloutClient

__all__ = [
    "AsyncRollout",
    "AsyncRolloutClient",
    "AtCapacity",
    "Conflict",
    "InfraFailure",
    "InvalidRequest",
    "OrchestratorError",
    "RetryPolicy",
    "Rollout",
    "RolloutClient",
    "RolloutNotFound",
    "Unauthorized",
    "Unavailable",
]
