"""``file_f1``: F1 of the files the agent names against the files the real change edited.

Reading the answer (the first rule that applies wins):

1. The whole answer is JSON: a list of paths, an object with ``"files"`` and/or
   ``"paths"`` (a list, or a string read as text by rule 3), or a JSON string (decoded and
   read again). List items are strings taken whole, objects with a ``path``/``file``/
   ``filename``/``name`` string, or nested lists; numbers, booleans and nulls are skipped.
2. Otherwise, fenced code blocks whose body is such JSON (e.g. a ```json fence): the union
   of all of them is the answer, and prose around them is commentary.
3. Otherwise the text: lines, markdown lists, prose, fences that are not JSON. It is split
   on whitespace and on ``, ; | ( ) [ ] { } < > " ' ` *``; a markdown link ``[t](target)``
   counts once, as its target when the target is a path. A token is a path when, after
   trimming wrapping quotes and trailing punctuation and a ``:42`` / ``#L42`` line suffix:

   * it is not a URL (``scheme://...``, ``www.``, ``mailto:``, ``host.com/...``), and
   * its last component is a known extensionless file name (``Makefile``, ``Dockerfile``,
     ``LICENSE``, ...), or a dotfile (``.gitignore``), or ``stem.ext`` where ``ext`` has
     1-10 letters/digits including a letter; without a ``/`` in the token the extension must
     also be a known source/config/doc extension (so ``e.g.`` or ``3.x`` are not paths) and
     the token not a framework name like ``Node.js``.

   So paths containing spaces can only be given as JSON, and a directory (``src/utils/``)
   or an extensionless file outside the known names is not picked up from prose.

Normalising (the gold list is normalised the same way): Unicode NFC, wrapping quotes,
backticks and trailing punctuation trimmed, a ``:42``/``#L42`` suffix dropped, backslashes
become ``/``, a leading ``/workspace`` (the sandbox's codebase root) or ``/`` and every
``./`` are dropped, ``//`` collapses, a trailing ``/`` goes. A path with a ``..`` component
(or nothing left) is *rejected*. Case is kept (Linux file systems are case-sensitive).

Scoring: predictions are deduplicated after normalising. Every prediction counts in the
precision denominator, rejected ones included: nothing the agent names is free, and
predictions are never filtered against the repository, so naming every file scores low.
precision = |pred & gold| / |pred|, recall = |pred & gold| / |gold|, score = their harmonic
mean (0 when nothing matches). Both empty: 1.0 (correctly "no file needs editing"); exactly
one empty: 0.0. More than ``max_predictions`` predictions: 0.0, with ``details["reason"]``.
If the item lists the repository (``repo_files_field``), false positives that are not in it
are reported as ``details["unknown"]`` (diagnostic only; they already cost precision).
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from pydantic import Field

from orchestrator.grading.base import Grader, GradeResult, GraderOptions, ItemError
from orchestrator.state.models import TrajectoryStep


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


#: Extensions that make a slash-less prose token a file name (``setup.py``, ``README.md``).
KNOWN_EXTENSIONS = _words(
    """
    py pyi pyx pxd ipynb js jsx mjs cjs ts tsx mts cts vue svelte astro go rs java kt kts
    scala clj cljs groovy rb erb php cs fs fsx vb swift c h cc cpp cxx hpp hh hxx inl cu
    ex exs erl hrl hs lhs ml mli elm dart lua pl pm jl sh bash zsh fish ps1 psm1 bat cmd sql
    graphql gql proto thrift avsc html htm jinja j2 hbs ejs css scss sass less styl json
    jsonc json5 yaml yml toml ini cfg conf env xml xsd md markdown mdx rst txt adoc csv
    tsv lock gradle mk cmake bazel bzl nix tf tfvars hcl dockerfile properties plist gemspec
    podspec sbt csproj fsproj sln vcxproj pbxproj svg tex bib rkt zig nim sol asm ld diff
    patch po pot cabal mod sum gitignore editorconfig
    """
)

#: Extensionless names that are files, matched exactly (case-sensitive).
KNOWN_FILENAMES = _words(
    """
    Makefile makefile GNUmakefile Dockerfile Containerfile Jenkinsfile Vagrantfile Procfile
    Gemfile Rakefile Pipfile Brewfile Justfile justfile Caddyfile Berksfile Podfile Fastfile
    Snakefile Tiltfile Earthfile Guardfile Capfile LICENSE LICENCE COPYING README CHANGELOG
    AUTHORS CONTRIBUTORS CODEOWNERS NOTICE OWNERS BUILD WORKSPACE MANIFEST VERSION
    """
)

# Slash-less tokens that look like files but in prose name frameworks.
_NOT_FILES = frozenset(
    f"{name}.js"
    for name in _words(
        "node angular vue next nuxt react express ember backbone d3 three chart p5 "
        "socket.io moment knockout handlebars alpine solid preact"
    )
)

_WORKSPACE = "/workspace"
_LEAD_CHARS = "'\"`([{<*"
_TRAIL_CHARS = "'\"`)]}>*.,;:!?"
_SPLIT_RE = re.compile(r"[\s,;|()\[\]{}<>\"'`*]+")
_FENCE_RE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)
# Bounded and bracket-free, so that "[[[[" or "[a](" repeated cannot make matching quadratic.
_MD_LINK_RE = re.compile(r"\[([^\[\]\n]{0,300})\]\(([^()\s]{1,500})\)")
_URL_RE = re.compile(r"^(?:[a-z][a-z0-9+.-]*://|www\.|mailto:)", re.IGNORECASE)
_HOST_RE = re.compile(
    r"^[a-z0-9-]+(?:\.[a-z0-9-]+)*\.(?:com|org|net|io|dev|ai|co|edu|gov|app)/", re.IGNORECASE
)
_LINE_SUFFIX_RE = re.compile(r"(?::\d{1,9}(?:[-:]\d{1,9}){0,3}|#L\d{1,9}(?:-L?\d{1,9})?)$")
_EXT_RE = re.compile(r"^(.+)\.([A-Za-z0-9]{1,10})$")
_DOTFILE_RE = re.compile(r"^\.[A-Za-z][\w.-]*$")
_BARE_DOTFILE_RE = re.compile(r"^\.[a-z][\w.-]*$")  # lowercase only: ".NET" is not a file
_JSON_ITEM_KEYS = ("path", "file", "filename", "name")
_MAX_JSON_DEPTH = 3


class FileF1Options(GraderOptions):
    """Options of :class:`FileF1Grader`."""

    max_predictions: int | None = Field(
        50, ge=1, description="More distinct predictions than this score 0; None: no limit."
    )
    gold_field: str = Field("gold_files", min_length=1, description="Item field: gold paths.")
    repo_files_field: str = Field(
        "repo_files",
        min_length=1,
        description="Optional item field listing the repository's files, for `unknown`.",
    )


class FileF1Grader(Grader):
    """F1 of the named files against ``item["gold_files"]``; see the module docstring."""

    name: ClassVar[str] = "file_f1"
    options_model: ClassVar[type[GraderOptions]] = FileF1Options
    options: FileF1Options

    def grade(
        self, answer: str, item: Mapping[str, Any], trajectory: Sequence[TrajectoryStep]
    ) -> GradeResult:
        """Score ``answer``; the trajectory is not needed (the answer alone is graded)."""
        gold = _gold_paths(item, self.options.gold_field)
        candidates, answer_format = extract_paths(answer)
        predicted, rejected = _normalise_all(candidates)
        n_predicted = len(predicted) + len(rejected)

        true_positives = predicted & gold
        false_positives = predicted - gold
        details: dict[str, Any] = {
            "format": answer_format,
            "predicted": sorted(predicted),
            "rejected": sorted(rejected),
            "gold": sorted(gold),
            "true_positives": sorted(true_positives),
            "false_positives": sorted(false_positives),
            "false_negatives": sorted(gold - predicted),
            "unknown": _unknown(false_positives, item.get(self.options.repo_files_field)),
        }

        limit = self.options.max_predictions
        if limit is not None and n_predicted > limit:
            details.update(precision=0.0, recall=0.0, f1=0.0)
            details["reason"] = (
                f"{n_predicted} distinct paths named, more than max_predictions={limit}"
            )
            return GradeResult(score=0.0, details=details)

        if n_predicted == 0 and not gold:
            precision = recall = 1.0
        else:
            precision = len(true_positives) / n_predicted if n_predicted else 0.0
            recall = len(true_positives) / len(gold) if gold else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        details.update(precision=precision, recall=recall, f1=f1)
        return GradeResult(score=f1, details=details)


def normalise_path(raw: str) -> str | None:
    """The canonical repo-relative form of ``raw``, or None if it is empty or has ``..``."""
    text = unicodedata.normalize("NFC", raw).strip().replace("\\", "/")
    text = _strip_wrapping(_LINE_SUFFIX_RE.sub("", _strip_wrapping(text)))
    if text == _WORKSPACE or text.startswith(_WORKSPACE + "/"):
        text = text[len(_WORKSPACE) :]
    # Dropping empty and "." parts collapses "//", strips "./" and leading/trailing "/".
    parts = [part for part in text.split("/") if part not in ("", ".")]
    if not parts or ".." in parts:
        return None
    return "/".join(parts)


def extract_paths(answer: str) -> tuple[list[str], str]:
    """The raw path strings named in ``answer`` and how they were found.

    The second item is ``"json"``, ``"fenced_json"``, ``"text"`` or ``"empty"``.
    """
    return _extract(answer, depth=0)


def _extract(answer: str, depth: int) -> tuple[list[str], str]:
    stripped = answer.strip()
    if not stripped:
        return [], "empty"
    whole = _from_json_text(stripped, depth)
    if whole is not None:
        return whole, "json"
    fenced: list[str] | None = None
    for body in _FENCE_RE.findall(stripped):
        found = _from_json_text(body.strip(), depth)
        if found is not None:
            fenced = (fenced or []) + found
    if fenced is not None:
        return fenced, "fenced_json"
    return paths_in_text(stripped), "text"


def _from_json_text(text: str, depth: int) -> list[str] | None:
    """Paths from ``text`` if it is JSON of a shape we read, else None."""
    if depth >= _MAX_JSON_DEPTH or not text or text[0] not in '[{"':
        return None
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if isinstance(value, list):
        return _json_items(value, depth)
    if isinstance(value, dict):
        keys = [key for key in ("files", "paths") if key in value]
        if not keys:
            return None
        found: list[str] = []
        for key in keys:
            entry = value[key]
            if isinstance(entry, list):
                found.extend(_json_items(entry, depth))
            elif isinstance(entry, str):
                found.extend(paths_in_text(entry))
        return found
    if isinstance(value, str):
        # A JSON-encoded answer ("[\"a.py\"]" as a string): read what it decodes to.
        return _extract(value, depth + 1)[0]
    return None


def _json_items(items: list[Any], depth: int) -> list[str]:
    found: list[str] = []
    for item in items:
        if isinstance(item, str):
            if item.strip():
                found.append(item)
        elif isinstance(item, dict):
            for key in _JSON_ITEM_KEYS:
                if isinstance(item.get(key), str):
                    found.append(item[key])
                    break
        elif isinstance(item, list) and depth + 1 < _MAX_JSON_DEPTH:
            found.extend(_json_items(item, depth + 1))
    return found


def paths_in_text(text: str) -> list[str]:
    """The path-like tokens of free text, in order (rules in the module docstring)."""
    text = _MD_LINK_RE.sub(_link_replacement, text)
    found: list[str] = []
    for raw in _SPLIT_RE.split(text):
        token = _strip_wrapping(raw.replace("\\", "/"))
        if not token or _is_url(token):
            continue
        token = _strip_wrapping(_LINE_SUFFIX_RE.sub("", token))
        if _looks_like_path(token):
            found.append(token)
    return found


def _link_replacement(match: re.Match[str]) -> str:
    text, target = match.group(1), match.group(2)
    cleaned = _strip_wrapping(_LINE_SUFFIX_RE.sub("", target.replace("\\", "/")))
    if not _is_url(cleaned) and _looks_like_path(cleaned):
        return f" {target} "
    return f" {text} "


def _strip_wrapping(token: str) -> str:
    """Trim wrapping quotes/brackets and trailing punctuation, but never a ``..`` part:
    ``src/..`` must stay rejectable rather than become ``src``."""
    while True:
        stripped = token.strip().lstrip(_LEAD_CHARS)
        end = len(stripped)  # an index, not repeated slicing: "....." * 10**5 stays linear
        while end and stripped[end - 1] in _TRAIL_CHARS and not _dotdot_ends_at(stripped, end):
            end -= 1
        if end == len(token) and stripped == token:
            return token
        token = stripped[:end]


def _dotdot_ends_at(text: str, end: int) -> bool:
    """``text[:end]`` ends with a ``..`` component (is ``..`` or ends with ``/..``)."""
    return text[end - 2 : end] == ".." and (end == 2 or text[end - 3] == "/")


def _is_url(token: str) -> bool:
    return bool(_URL_RE.match(token) or _HOST_RE.match(token))


def _looks_like_path(token: str) -> bool:
    base = token.rstrip("/").rsplit("/", 1)[-1]
    if not any(char.isalnum() for char in base):
        return False
    has_slash = "/" in token
    if base in KNOWN_FILENAMES:
        return True
    if (_DOTFILE_RE if has_slash else _BARE_DOTFILE_RE).match(base):
        return True
    match = _EXT_RE.match(base)
    if match is None or match.group(1) in ("", ".") or match.group(1).endswith("."):
        return False
    extension = match.group(2)
    if not any(char.isalpha() for char in extension):
        return False  # 3.14, v1.2
    if has_slash:
        return True
    return extension.lower() in KNOWN_EXTENSIONS and token.lower() not in _NOT_FILES


def _normalise_all(candidates: Iterable[str]) -> tuple[set[str], set[str]]:
    predicted: set[str] = set()
    rejected: set[str] = set()
    for raw in candidates:
        path = normalise_path(raw)
        if path is not None:
            predicted.add(path)
        elif raw.strip():
            rejected.add(raw.strip())
    return predicted, rejected


def _gold_paths(item: Mapping[str, Any], field: str) -> set[str]:
    if field not in item or item[field] is None:
        raise ItemError(field, "missing: the dataset row must list the files the change edited")
    value = item[field]
    if isinstance(value, str):
        # Some datasets store lists as JSON text.
        try:
            value = json.loads(value)
        except ValueError:
            raise ItemError(field, "must be a list of paths (or its JSON text)") from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
        raise ItemError(field, "must be a list of path strings")
    gold: set[str] = set()
    for raw in value:
        path = normalise_path(raw)
        if path is None:
            raise ItemError(field, f"invalid gold path {raw!r} (empty or has '..')")
        gold.add(path)
    return gold


def _unknown(false_positives: set[str], repo_files: Any) -> list[str] | None:
    """False positives absent from the item's repository listing; None without a listing."""
    if not isinstance(repo_files, (list, tuple, set, frozenset)):
        return None
    known = {path for raw in repo_files if isinstance(raw, str) and (path := normalise_path(raw))}
    return sorted(false_positives - known)
