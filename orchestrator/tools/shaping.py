"""Output shaping shared by every tool: make text clean for a model, and make it fit.

Two steps, always in this order:

1. :func:`clean_text` removes what a terminal would interpret rather than show: ANSI escape
   sequences (CSI such as colours, OSC such as window titles and hyperlinks, DCS/SOS/PM/APC
   strings, two-byte escapes) and every control character except ``\\n`` and ``\\t``.
   ``\\r\\n`` becomes ``\\n``. A lone ``\\r`` depends on the mode (see :data:`CarriageReturn`):
   for command output a line rewritten with ``\\r`` (progress bars) keeps only its last
   non-empty segment, which is what a terminal shows at the end for whole-line rewrites and
   keeps a 10,000-step progress bar from eating the budget; for file content it becomes a
   space, so that no text is lost and line numbers stay those of the file. A backspace erases
   the character before it on the same line (``man``-style overstrike ``_\\bx`` shows ``x``).

2. :func:`truncate_middle` (a whole string) or :func:`shape_capture` (a stream the sandbox
   already cut to head + tail) keep the start and the end of the text and put a marker in the
   middle saying how much was cut and how to see more.

The bound, exactly: the shaped text's UTF-8 encoding is at most ``budget`` bytes, marker
included. The marker's room is taken out of the budget (so a truncated output shows slightly
less than ``budget`` bytes of the original text); the marker itself is at most
:data:`MARKER_MAX_BYTES` plus the length of the hint. When the budget is too small for a
marker with its hint (under twice its size), a short marker without the hint is used; when
even that does not fit, the text is cut at the budget without a marker. Cuts never split a
UTF-8 character, and prefer line boundaries when one is near (within an eighth of the kept
part), so the marker's line count is exact when it is given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from orchestrator.sandbox.backend import StreamCapture

CarriageReturn = Literal["overwrite", "space"]
"""How a lone ``\\r`` is rendered: ``overwrite`` keeps the last non-empty segment of the
line (command output); ``space`` replaces it with a space (file content)."""

SHELL_HINT = (
    "narrow the command, e.g. pipe it through head, tail or grep, or redirect it to a file "
    "and read_file it with start_line/end_line"
)
"""What the marker tells the model to do about truncated command output."""

# Upper bound of the marker without its hint: the fixed words plus two 26-digit numbers
# with thousands separators (far beyond any real byte count).
MARKER_MAX_BYTES = 120
"""Bytes a marker may take besides its hint (see the module docstring for the bound)."""

# ESC-introduced sequences, per ECMA-48:
#   CSI: ESC [ parameters (0x30-0x3F)* intermediates (0x20-0x2F)* final (0x40-0x7E)
#   OSC: ESC ] ... terminated by BEL or ST (ESC \)
#   DCS, SOS, PM, APC: ESC P / X / ^ / _ ... terminated by ST
#   other: ESC intermediates (0x20-0x2F)* final (0x30-0x7E), e.g. ESC ( B, ESC 7, ESC c
# The 8-bit forms (U+009B CSI, U+009D OSC, ...) are C1 controls and are dropped as such;
# an unterminated string sequence is not matched (so it cannot swallow the rest of the
# output): its ESC is dropped as a control character and its text stays.
_ESCAPE = re.compile(
    r"""
    \x1b\[[0-?]*[ -/]*[@-~]
    | \x1b\][^\x07\x1b]*(?:\x07|\x1b\\)
    | \x1b[PX^_][^\x1b]*\x1b\\
    | \x1b[ -/]*[0-~]
    """,
    re.VERBOSE,
)
# An escape sequence cut off by the end of a stream's kept head: nothing after it can
# complete it, so it is dropped whole rather than leaving "[31" behind.
_PARTIAL_ESCAPE_AT_END = re.compile(r"\x1b(?:\[[0-?]*[ -/]*|[\]PX^_][^\x07\x1b]*|[ -/]*)\Z")
# Lone surrogates (from JSON "\\ud800" escapes) cannot be encoded as UTF-8 at all.
_SURROGATE = re.compile(r"[\ud800-\udfff]")
# Every C0 control except \t (0x09) and \n (0x0A), DEL, and the C1 controls.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_REPLACEMENT = "\ufffd"


def clean_text(text: str, *, carriage_return: CarriageReturn = "overwrite") -> str:
    """Strip escape sequences and control characters (keeping ``\\n`` and ``\\t``).

    Idempotent: cleaning cleaned text changes nothing. Lone surrogates, which no UTF-8
    encoding can carry, become U+FFFD.
    """
    text = without_surrogates(text)
    if _ESCAPE.search(text) or "\x1b" in text:
        text = _ESCAPE.sub("", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n")
        if carriage_return == "overwrite":
            text = "\n".join(_last_segment(line) for line in text.split("\n"))
        else:
            text = text.replace("\r", " ")
    if "\b" in text:
        text = _apply_backspaces(text)
    return _CONTROL.sub("", text)


def without_surrogates(text: str) -> str:
    """``text`` with lone surrogates replaced by U+FFFD, so that it encodes as UTF-8."""
    return _SURROGATE.sub(_REPLACEMENT, text) if _SURROGATE.search(text) else text


def _last_segment(line: str) -> str:
    if "\r" not in line:
        return line
    segments = [s for s in line.split("\r") if s]
    return segments[-1] if segments else ""


def _apply_backspaces(text: str) -> str:
    # Linear, unlike repeatedly deleting "x\b" pairs with a regex.
    out: list[str] = []
    for char in text:
        if char == "\b":
            if out and out[-1] != "\n":
                out.pop()
        else:
            out.append(char)
    return "".join(out)


@dataclass(frozen=True)
class Shaped:
    """Text made to fit a budget, with what was cut."""

    text: str
    truncated: bool
    omitted_bytes: int = 0
    omitted_lines: int | None = 0
    """Newlines in the omitted part; None when unknown (the sandbox cut it unseen)."""

    @property
    def size_bytes(self) -> int:
        return len(self.text.encode())


def marker(omitted_bytes: int, omitted_lines: int | None, hint: str | None) -> str:
    """The line put where text was cut, without surrounding newlines.

    >>> marker(12345, 67, "narrow it")
    '... [12,345 bytes (67 lines) omitted; narrow it] ...'
    """
    what = f"{omitted_bytes:,} bytes"
    if omitted_lines is not None:
        what += f" ({omitted_lines:,} line{'' if omitted_lines == 1 else 's'})"
    advice = f"; {hint}" if hint else ""
    return f"... [{what} omitted{advice}] ..."


def utf8_prefix(data: bytes, limit: int) -> int:
    """The largest cut ``<= limit`` that does not split a UTF-8 character of ``data``."""
    cut = min(limit, len(data))
    while 0 < cut < len(data) and data[cut] & 0xC0 == 0x80:
        cut -= 1
    return cut


def utf8_suffix(data: bytes, limit: int) -> int:
    """The smallest start ``>= len(data) - limit`` not inside a UTF-8 character."""
    start = max(len(data) - limit, 0)
    while start < len(data) and data[start] & 0xC0 == 0x80:
        start += 1
    return start


def _head_cut(data: bytes, quota: int) -> int:
    cut = utf8_prefix(data, quota)
    if cut == len(data):
        return cut
    newline = data.rfind(b"\n", cut - cut // 8, cut)
    return newline + 1 if newline >= 0 else cut


def _tail_start(data: bytes, quota: int) -> int:
    start = utf8_suffix(data, quota)
    if start == 0:
        return start
    kept = len(data) - start
    # A boundary exactly at ``start`` (the byte before it is a newline) needs no moving.
    if data[start - 1 : start] == b"\n":
        return start
    newline = data.find(b"\n", start, start + kept // 8)
    return newline + 1 if newline >= 0 else start


def _choose_marker(total_bytes: int, total_lines: int, budget: int, hint: str | None) -> str | None:
    """The marker template whose worst case fits, or None when none does.

    Sized with the totals in place of the omitted counts: an omitted count never exceeds
    its total and a formatted number never gets shorter as it grows, so the real marker is
    never longer than the one reserved.
    """
    full = "\n" + marker(total_bytes, total_lines, hint) + "\n"
    if hint and len(full.encode()) * 2 <= budget:
        return hint
    short = "\n" + marker(total_bytes, total_lines, None) + "\n"
    if len(short.encode()) <= budget:
        return ""
    return None


def _join(
    head: bytes,
    tail: bytes,
    gap_bytes: int,
    gap_lines: int | None,
    budget: int,
    hint: str | None,
    size_hint: int = 0,
) -> Shaped:
    """Fit ``head + <gap> + tail`` into ``budget`` bytes, cutting from the middle.

    The marker's room is reserved for the larger of the real total and ``size_hint``, and
    always with a line count, so that a stream whose lines are unknown is cut exactly where
    the whole text would be.
    """
    total = len(head) + gap_bytes + len(tail)
    if gap_bytes == 0 and total <= budget:
        return Shaped((head + tail).decode(), truncated=False)
    worst = max(total, size_hint)
    chosen = _choose_marker(worst, worst, budget, hint)
    if chosen is None:
        # Degenerate budget: not even a short marker fits. Keep the start.
        data = head + tail
        cut = utf8_prefix(data, budget)
        lines = None if gap_lines is None else data[cut:].count(b"\n") + gap_lines
        return Shaped(data[:cut].decode(), True, total - cut, lines)
    reserve = len(("\n" + marker(worst, worst, chosen or None) + "\n").encode())
    room = budget - reserve
    head_quota = room - room // 2
    tail_quota = room // 2
    # Give what one side does not need to the other.
    if len(head) < head_quota:
        tail_quota += head_quota - len(head)
        head_quota = len(head)
    elif len(tail) < tail_quota:
        head_quota += tail_quota - len(tail)
        tail_quota = len(tail)
    cut = _head_cut(head, head_quota)
    if 0 < cut < len(head) and head[cut : cut + 1] == b"\n" and head[cut - 1 : cut] != b"\n":
        # A cut just before a newline keeps it: the same byte the marker's own line break
        # would cost, and the marker then counts only what is really gone (it said one
        # byte more, hypothesis found, for a newline still shown).
        cut += 1
    start = _tail_start(tail, tail_quota)
    dropped = head[cut:] + tail[:start]
    omitted = gap_bytes + len(dropped)
    lines = None if gap_lines is None else gap_lines + dropped.count(b"\n")
    kept_head = head[:cut].decode()
    kept_tail = tail[start:].decode()
    line = marker(omitted, lines, chosen or None)
    # The marker sits on a line of its own; the head's own newline serves when it has one.
    before = "" if not kept_head or kept_head.endswith("\n") else "\n"
    after = "\n" if kept_tail else ""
    text = f"{kept_head}{before}{line}{after}{kept_tail}"
    return Shaped(text, True, omitted, lines)


def truncate_middle(text: str, budget: int, *, hint: str | None = SHELL_HINT) -> Shaped:
    """Keep the start and end of ``text`` within ``budget`` UTF-8 bytes, marker included.

    ``text`` should already be cleaned (:func:`clean_text`); this only cuts (and replaces
    lone surrogates, which cannot be measured in UTF-8). Text that fits is returned
    unchanged, so truncating truncated text changes nothing.
    """
    if budget < 0:
        raise ValueError("budget must be >= 0")
    text = without_surrogates(text)
    data = text.encode()
    if len(data) <= budget:
        return Shaped(text, truncated=False)
    mid = utf8_prefix(data, len(data) // 2)
    return _join(data[:mid], data[mid:], 0, 0, budget, hint)


def shape_text(
    text: str,
    budget: int,
    *,
    hint: str | None = SHELL_HINT,
    carriage_return: CarriageReturn = "overwrite",
) -> Shaped:
    """Clean ``text`` and fit it into ``budget`` bytes: the whole pipeline for one string."""
    return truncate_middle(clean_text(text, carriage_return=carriage_return), budget, hint=hint)


def clean_capture(capture: StreamCapture) -> tuple[str, str]:
    """Clean a captured stream's head and tail separately, as :func:`clean_text` would.

    At the sandbox's cut, the head may end in a partial escape sequence or a character split
    in two (decoded as U+FFFD), and the tail may start with the rest of one; those artefacts
    of the cut are dropped. An escape sequence's remainder at the start of the tail cannot
    be recognised and may leave a few stray characters.
    """
    head, tail = capture.head, capture.tail
    if capture.truncated:
        head = _PARTIAL_ESCAPE_AT_END.sub("", head).rstrip(_REPLACEMENT)
        tail = tail.lstrip(_REPLACEMENT)
    return clean_text(head), clean_text(tail)


def shape_capture(capture: StreamCapture, budget: int, *, hint: str | None = SHELL_HINT) -> Shaped:
    """Shape a stream the sandbox captured as head + tail, consistently with
    :func:`shape_text` on the whole stream.

    The cuts are placed as they would be in the whole text (the marker's room is reserved
    the same way, from the stream's total size), so for the same budget the kept text is the
    same; the marker counts the bytes the sandbox dropped as produced, and gives no line
    count when the sandbox dropped anything, since those lines were never seen.
    """
    if budget < 0:
        raise ValueError("budget must be >= 0")
    head, tail = clean_capture(capture)
    if not capture.truncated:
        return truncate_middle(head + tail, budget, hint=hint)
    # The stream's own size sizes the marker's room, as the whole text's would.
    return _join(
        head.encode(),
        tail.encode(),
        capture.omitted_bytes,
        None,
        budget,
        hint,
        size_hint=capture.total_bytes,
    )


def capture_demand(capture: StreamCapture) -> int:
    """Bytes the cleaned stream would need to be shown whole (an estimate when cut)."""
    head, tail = clean_capture(capture)
    return len(head.encode()) + len(tail.encode()) + capture.omitted_bytes


def fit(text: str, budget: int) -> str:
    """Last-resort guard: ``text`` cut to ``budget`` bytes with a hint-free marker."""
    return truncate_middle(text, budget, hint=None).text
