"""A scripted agent for file localisation: no model, just the moves a model makes.

It picks identifiers and salient words from the request, searches the codebase with
`rg`, reads the top hit, and names the files that matched the most words. Good enough to
exercise every endpoint on a real codebase and to show a score that means something.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

STOPWORDS = frozenset(
    [
        "a",
        "an",
        "and",
        "are",
        "as",
        "be",
        "before",
        "by",
        "carry",
        "clear",
        "default",
        "does",
        "for",
        "from",
        "give",
        "given",
        "goes",
        "header",
        "in",
        "include",
        "is",
        "it",
        "its",
        "matching",
        "missing",
        "none",
        "number",
        "of",
        "on",
        "or",
        "points",
        "raise",
        "response",
        "should",
        "surrounding",
        "that",
        "the",
        "their",
        "them",
        "this",
        "to",
        "unknown",
        "uses",
        "variable",
        "was",
        "when",
        "which",
        "with",
    ]
)


Tool = Callable[[str, dict[str, object]], str]


def keywords(request: str) -> list[str]:
    """Identifiers first (snake_case, CamelCase, dotted names), then long plain words."""
    words = re.findall(r"[A-Za-z_][A-Za-z0-9_.]*", request)
    identifiers = [w.split(".")[-1] for w in words if "_" in w or re.search(r"[a-z][A-Z]", w)]
    plain = [w.lower() for w in words if w.lower() not in STOPWORDS and len(w) > 4]
    ordered = list(dict.fromkeys(identifiers + plain))
    return ordered[:6]


def localise(request: str, call: Tool) -> tuple[list[str], int]:
    """Returns (the files named as the answer, how many tool calls it made)."""
    calls = 0
    hits: Counter[str] = Counter()
    for word in keywords(request):
        calls += 1
        output = call(
            "shell", {"command": f"rg -l -i --glob '*.py' -- {_quote(word)} . | head -20"}
        )
        for line in output.splitlines():
            path = line.strip().removeprefix("./")
            if path.endswith(".py"):
                hits[path] += 1
    if not hits:
        return [], calls
    ranked = [path for path, _ in hits.most_common()]
    calls += 1
    call("read_file", {"path": ranked[0], "start_line": 1, "end_line": 40})
    best = hits[ranked[0]]
    answer = [path for path in ranked if hits[path] >= best - 1][:2]
    return answer, calls


def _quote(word: str) -> str:
    return "'" + word.replace("'", "") + "'"
