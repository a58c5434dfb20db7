"""Sandboxes as hardened containers on this host's Docker daemon.

``backend`` is the :class:`~orchestrator.sandbox.backend.SandboxBackend` that drives them
through their exec agents; ``containers`` renders a sandbox's container (pure: mounts in
it, tmpfs trees, the agent's command line, its process limit); ``states`` reads a
container's state and a sandbox's manifests (pure); ``workspace`` is /workspace as an
overlay over lower layers, ``mounts`` the host's mount calls under it; ``snapshots`` a
sandbox's filesystem kept on this host; ``run_as`` the base image's setuid helper on this
host; ``kernel_log`` the kernel's word on what a limit killed.
"""
