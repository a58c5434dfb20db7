"""The control API (FastAPI): Agent RFT tool and grader endpoints, the rollout API, health."""
