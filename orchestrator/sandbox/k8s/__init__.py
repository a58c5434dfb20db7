"""Sandboxes as Kubernetes pods (docs/kubernetes-backend.md).

``pods`` renders a sandbox's Pod and Secret from its spec (pure), ``states`` reads a pod's
status as evidence and an outcome (pure), ``watch`` waits on a pod with a deadline, and
``backend`` is the :class:`~orchestrator.sandbox.backend.SandboxBackend` that drives them.
"""
