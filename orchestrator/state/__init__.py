"""Shared state: the one package that talks to Redis. Every key (keys.py), every Lua script
beside the state machine it moves (tickets, records, admission, pools), heartbeats, the
queue's wire (wire.py) and its Celery app (broker.py), and the one read model of the
deployment's state (snapshot.py) that the state gauges (collector.py) and ``orchestrator
status`` (views/state.py) both show. The API side (rollouts/) and the worker side (queue/)
both sit on it and never import each other (docs/architecture.md)."""
