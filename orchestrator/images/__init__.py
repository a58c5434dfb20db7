"""Sandbox images: the base image (with the OS image under it) and codebase images."""

from orchestrator.images.base import (
    BaseBuildResult,
    ImageBuildError,
    build_base_image,
    ensure_os_image,
    sandbox_images_dir,
)
from orchestrator.images.codebases import (
    CodebaseError,
    CodebaseExists,
    CodebaseInfo,
    CodebaseSourceError,
    InvalidCodebaseName,
    UnknownCodebase,
    add_codebase,
    codebase_image,
    get_codebase,
    list_codebases,
    remove_codebase,
    validate_name,
)

__all__ = [
    "BaseBuildResult",
    "CodebaseError",
    "CodebaseExists",
    "CodebaseInfo",
    "CodebaseSourceError",
    "ImageBuildError",
    "InvalidCodebaseName",
    "UnknownCodebase",
    "add_codebase",
    "build_base_image",
    "codebase_image",
    "ensure_os_image",
    "get_codebase",
    "list_codebases",
    "remove_codebase",
    "sandbox_images_dir",
    "validate_name",
]
