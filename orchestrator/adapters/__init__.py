"""Thin adapters that let open-source trainers drive rollouts through the client, shaped
for each trainer without importing it: TRL (:mod:`orchestrator.adapters.trl`) and verl
(:mod:`orchestrator.adapters.verl`). See docs/trainers.md."""
