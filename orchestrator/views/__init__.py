"""The operators' read model: what `orchestrator status` and `orchestrator rollouts` show.

Read-only. The deployment's state comes from the read model the API's state gauges show
too (state/snapshot.py), plus the few reads only the status view needs (``state.py``);
rollouts from the store's records (``rollouts.py``); call rates and latencies from two
scrapes of the API's ``/metrics`` (``scrape.py``). Models in ``models.py``.
"""
