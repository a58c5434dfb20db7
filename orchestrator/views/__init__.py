"""The operators' read model: what `orchestrator status` and `orchestrator rollouts` show.

Read-only. State comes from Redis through the store's and the queue's own key helpers
(``state.py``, ``rollouts.py``); call rates and latencies come from two scrapes of the API's
``/metrics`` (``scrape.py``). Models in ``models.py``.
"""
