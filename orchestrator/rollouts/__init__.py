"""Rollouts: state in Redis, lifecycle, idempotency, budget, trajectory, reaping."""
