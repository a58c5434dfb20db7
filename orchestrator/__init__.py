"""Sandboxed rollout orchestrator for agent reinforcement learning."""

__version__ = "0.1.0"
