"""Finding a grader by name: the built-ins, or any :class:`Grader` subclass by dotted path.

An environment's YAML names its grader and options, e.g.::

    grader: file_f1                        # a built-in, see grader_names()
    grader_options: {max_predictions: 30}

    grader: my_pkg.graders:ExactMatch      # or my_pkg.graders.ExactMatch

Every failure here is a :class:`GraderConfigError`: a deployment mistake, reported when the
environment is loaded rather than on the first grade call.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from orchestrator.grading.base import Grader, GraderConfigError
from orchestrator.grading.file_f1 import FileF1Grader
from orchestrator.grading.judge import ScoreModelGrader
from orchestrator.grading.multi import MultiGrader
from orchestrator.grading.numeric_match import NumericMatchGrader
from orchestrator.grading.sandbox_tests import SandboxTestsGrader

BUILTIN_GRADERS: Mapping[str, type[Grader]] = {
    grader.name: grader
    for grader in (
        FileF1Grader,
        MultiGrader,
        NumericMatchGrader,
        SandboxTestsGrader,
        ScoreModelGrader,
    )
}


def grader_names() -> list[str]:
    """The names of the built-in graders, sorted."""
    return sorted(BUILTIN_GRADERS)


def resolve_grader(name_or_path: str) -> type[Grader]:
    """The grader class a built-in name or a ``module:Class`` / ``module.Class`` path names."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise GraderConfigError(f"grader must be a non-empty name, got {name_or_path!r}")
    spec = name_or_path.strip()
    if spec in BUILTIN_GRADERS:
        return BUILTIN_GRADERS[spec]
    if ":" in spec:
        module_name, _, attribute = spec.partition(":")
    elif "." in spec:
        module_name, _, attribute = spec.rpartition(".")
    else:
        raise GraderConfigError(
            f"unknown grader {spec!r}: built-ins are {', '.join(grader_names())}; "
            "a custom grader is named by its path, package.module:ClassName"
        )
    if not module_name or not attribute:
        raise GraderConfigError(f"grader path {spec!r} must look like package.module:ClassName")

    module = _import(module_name, spec)
    target: Any = module
    for part in attribute.split("."):  # module:Outer.Inner is allowed
        try:
            target = getattr(target, part)
        except AttributeError:
            raise GraderConfigError(
                f"grader {spec!r}: module {module_name!r} has no attribute {attribute!r}"
            ) from None
    if not (inspect.isclass(target) and issubclass(target, Grader)):
        raise GraderConfigError(
            f"grader {spec!r} is not a subclass of orchestrator.grading.Grader: {target!r}"
        )
    if inspect.isabstract(target):
        raise GraderConfigError(f"grader {spec!r} is abstract (grade() not implemented)")
    if not isinstance(getattr(target, "name", None), str):
        raise GraderConfigError(f"grader {spec!r} must set the class attribute `name: str`")
    return target


def get_grader(name_or_path: str, options: Mapping[str, Any] | None = None) -> Grader:
    """A ready grader: resolved by :func:`resolve_grader`, built with validated ``options``."""
    cls = resolve_grader(name_or_path)
    if options is None:
        options = {}
    if not isinstance(options, Mapping) or not all(isinstance(key, str) for key in options):
        raise GraderConfigError(
            f"grader {name_or_path!r}: options must be a mapping of names to values"
        )
    try:
        return cls(**options)
    except GraderConfigError:
        raise
    except (TypeError, ValueError) as exc:
        # A custom grader that validates its options itself.
        raise GraderConfigError(f"grader {name_or_path!r}: invalid options: {exc}") from exc


def _import(module_name: str, spec: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise GraderConfigError(f"grader {spec!r}: module {module_name!r} not found") from None
        # The module exists but something it imports does not.
        raise GraderConfigError(
            f"grader {spec!r}: importing {module_name!r} failed: {exc}"
        ) from exc
    except Exception as exc:
        raise GraderConfigError(
            f"grader {spec!r}: importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
