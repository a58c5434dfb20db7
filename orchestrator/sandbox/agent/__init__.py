"""The exec agent that runs inside every sandbox (``exec_agent.py``, standard library only)."""

from pathlib import Path

EXEC_AGENT_PATH = Path(__file__).with_name("exec_agent.py")
