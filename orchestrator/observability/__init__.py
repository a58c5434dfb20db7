"""Logging and metrics: one setup each, used by every process."""
