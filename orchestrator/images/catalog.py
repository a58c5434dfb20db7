"""The codebase catalogue: codebases named in a file instead of found in a Docker daemon.

On Kubernetes the API and the workers have no Docker daemon to ask which codebases exist,
and sandbox pods pull their image from a registry. There, ``ORCH_CODEBASES_FILE`` names a
YAML map from codebase name to image reference (relative to ``k8s_image_registry``,
pinned by digest: ``orchestrator/codebase@sha256:...``), which the Helm chart renders from
its ``codebases`` value and ``orchestrator codebase publish`` prints a line of. It is
declarative on purpose: what a training job can ask for is reviewed with the deployment,
and a dataset row naming anything else is refused (422) instead of failing as an image
pull on a node, which would be scored as our fault.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import yaml
from pydantic import RootModel, ValidationError, field_validator

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
"""A codebase name; it is also an image tag, so it must be one."""
# An image reference as a registry takes it: repository path, then a tag or a digest.
_REF_RE = re.compile(
    r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}|@sha256:[0-9a-f]{64})$"
)


class CatalogError(ValueError):
    """The catalogue file is missing or not a valid map of codebases."""


class Catalog(RootModel[dict[str, str]]):
    """Codebase name -> image reference, relative to the deployment's registry."""

    @field_validator("root")
    @classmethod
    def _valid_entries(cls, entries: dict[str, str]) -> dict[str, str]:
        for name, ref in entries.items():
            if not NAME_RE.fullmatch(name):
                raise ValueError(f"invalid codebase name {name!r}")
            if not _REF_RE.fullmatch(ref):
                raise ValueError(
                    f"codebase {name!r}: {ref!r} is not an image reference "
                    "(repository[:tag] or repository@sha256:<digest>, without the registry)"
                )
        return entries


_cache: dict[Path, tuple[int, Catalog]] = {}
_cache_lock = threading.Lock()


def read_catalog(path: Path) -> Catalog:
    """The catalogue in ``path``, re-read only when the file changes (a ConfigMap update
    swaps the file under a running process)."""
    try:
        mtime = path.stat().st_mtime_ns
    except OSError as exc:
        raise CatalogError(f"codebase catalogue {path}: {exc.strerror}") from exc
    with _cache_lock:
        cached = _cache.get(path)
        if cached is not None and cached[0] == mtime:
            return cached[1]
    try:
        raw = yaml.safe_load(path.read_text()) or {}
        catalog = Catalog.model_validate(raw)
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        raise CatalogError(f"codebase catalogue {path} is invalid: {exc}") from exc
    with _cache_lock:
        _cache[path] = (mtime, catalog)
    return catalog


def catalog_line(name: str, ref: str) -> str:
    """One entry as it goes into the catalogue file (or the chart's ``codebases`` value)."""
    return yaml.safe_dump({name: ref}, default_flow_style=False).strip()
