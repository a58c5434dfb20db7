"""``score_model``: a model as judge. An OpenAI-compatible chat-completions server is asked
to score the answer against a rubric; its number is the score.

Configured like the Agent RFT platform's grader of the same name: ``input`` is a list of
chat messages whose text may name, in ``{{ }}``, the answer (``answer``, or the platform's
``sample.output_text``), the row (``item`` as JSON, or one field, ``item.reference``) and
the tail of the trajectory (``trajectory``)::

    grader:
      name: score_model
      options:
        model: judge-small
        base_url: http://judge.internal:8000/v1
        input:
          - {role: system, content: "Score the answer from 0 to 1 against the reference."}
          - role: user
            content: |
              Question: {{ item.question }}
              Reference: {{ item.reference }}
              Answer: {{ answer }}

The key is read from the variable ``api_key_env`` names (the chart fills it from a
Kubernetes Secret) and is never logged, stored or shown in evidence.

The judge is asked for ``{"score": <number>, "reason": <text>}``, as a JSON schema where the
server honours ``response_format`` (a server that refuses it is asked again without it, and
no more for the life of the process); its reply is read strictly: that JSON object (bare or
in one code fence), or exactly one ``score: <number>`` line. A number outside ``range`` is
no verdict.

Whose is what: the judge's number is a score; the judge unreachable, answering 429 or 5xx,
slower than ``request_timeout_s``, or answering nothing readable, after ``max_attempts``
within ``timeout_s``, is :class:`GraderUnavailable` (a 503 naming the kind, with every
attempt as evidence), never a 0. A 4xx other than 429 (a wrong key, an unknown model) is our
configuration, so it is not retried, and is a 503 too. A row lacking a field the input
names is the row's fault (422).

A verdict is kept (:class:`~orchestrator.grading.base.GradeServices`) under the digest of
the rollout, the server, the model and the rendered messages: a retried grade neither pays
for another verdict nor gets a different one (grades racing each other ask once only when
they wait for the same slot, as with ``max_concurrent: 1``). Calls to one server and model
are bounded across the deployment by ``max_concurrent``. ``orchestrator regrade`` runs
offline, without either: it asks the judge again, at most ``max_concurrent`` at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

from pydantic import BaseModel, Field, HttpUrl, field_validator, model_validator

from orchestrator.grading.base import (
    GradeContext,
    Grader,
    GradeResult,
    GraderOptions,
    GraderUnavailable,
    ItemError,
)
from orchestrator.observability import metrics
from orchestrator.observability.logging import get_logger
from orchestrator.state.models import TrajectoryStep

if TYPE_CHECKING:
    import openai

log = get_logger(__name__)

_PLACEHOLDER = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")
_ANSWER_NAMES = frozenset({"answer", "sample.output_text"})
_ITEM_FIELD = re.compile(r"item\.([A-Za-z_][A-Za-z0-9_-]*)")
# One line reading "score: 0.7" (any case, an optional bold or heading mark), alone.
_SCORE_LINE = re.compile(
    r"^[\s#*_>-]*score[\s*_]*[:=][\s*_]*(-?\d+(?:\.\d+)?)[\s*_.]*$", re.IGNORECASE | re.MULTILINE
)
# Any "score: N" at all, in a line or not: a reply giving two is refused, not guessed at.
_ANY_SCORE = re.compile(r"score[\s*_]*[:=][\s*_]*-?\d", re.IGNORECASE)
_FENCE = re.compile(r"^```[A-Za-z]*\s*\n(.*)\n```$", re.DOTALL)
_EXCERPT = 400
"""How much of a reply or an error the evidence keeps."""


class JudgeErrorKind(StrEnum):
    """Why a judge gave no verdict: the ``kind`` of the 503 and of
    ``orchestrator_grader_errors_total``."""

    UNAVAILABLE = "judge_unavailable"  # refused, reset, 429 or 5xx, every attempt
    TIMEOUT = "judge_timeout"  # no reply within request_timeout_s (last attempt)
    UNPARSEABLE = "judge_unparseable"  # replied, with no score we can read
    REFUSED = "judge_refused"  # a 4xx other than 429: the key, the model, the request
    BUSY = "judge_busy"  # no deployment slot came free within timeout_s


class JudgeMessage(BaseModel):
    """One message of the judge's input; ``content`` may name ``{{ }}`` placeholders."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str = Field(min_length=1, max_length=100_000)


class ScoreModelOptions(GraderOptions):
    """Options of :class:`ScoreModelGrader`."""

    model: str = Field(min_length=1, description="The judge model, as the server names it.")
    base_url: HttpUrl = Field(description="The server's OpenAI-compatible API, e.g. .../v1.")
    input: list[JudgeMessage] = Field(min_length=1, description="The rubric, as messages.")
    api_key_env: str = Field(
        "OPENAI_API_KEY",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="The variable holding the key ('' or unset: none is sent).",
    )
    range: tuple[float, float] = Field((0.0, 1.0), description="The judge's scale.")
    temperature: float = Field(0.0, ge=0, le=2)
    max_tokens: int = Field(256, ge=8, le=8192, description="The verdict's length bound.")
    structured_output: bool = Field(True, description="Ask for a JSON schema reply.")
    timeout_s: float = Field(30.0, gt=0, le=600, description="Every attempt, waits included.")
    request_timeout_s: float = Field(10.0, gt=0, le=600, description="One request.")
    max_attempts: int = Field(3, ge=1, le=10)
    backoff_s: float = Field(0.5, ge=0, le=30, description="The first retry's wait; doubles.")
    max_concurrent: int = Field(8, ge=1, le=10_000, description="Per deployment.")
    trajectory_steps: int = Field(10, ge=0, le=1000, description="Calls {{trajectory}} shows.")
    trajectory_chars: int = Field(4000, ge=0, le=200_000, description="Its length bound.")
    cache_ttl_s: float = Field(7 * 24 * 3600, gt=0, description="How long a verdict is kept.")

    @field_validator("range")
    @classmethod
    def _ordered(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not value[0] < value[1]:
            raise ValueError("range must be [low, high] with low < high")
        return value

    @model_validator(mode="after")
    def _placeholders(self) -> Self:
        shown = False
        for index, message in enumerate(self.input):
            for name in _PLACEHOLDER.findall(message.content):
                if name in _ANSWER_NAMES:
                    shown = True
                elif name not in ("item", "trajectory") and not _ITEM_FIELD.fullmatch(name):
                    raise ValueError(
                        f"input.{index}.content: unknown placeholder {{{{ {name} }}}} "
                        "(known: answer, sample.output_text, item, item.FIELD, trajectory)"
                    )
        if not shown:
            raise ValueError("input never shows the answer: name {{ answer }} in a message")
        if self.request_timeout_s > self.timeout_s:
            raise ValueError("request_timeout_s must not exceed timeout_s")
        return self


class _Verdict(BaseModel):
    score: float
    reason: str = ""


_SCHEMA: dict[str, Any] = {
    "type": "json_schema",
    "json_schema": {
        "name": "verdict",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {"score": {"type": "number"}, "reason": {"type": "string"}},
            "required": ["score", "reason"],
            "additionalProperties": False,
        },
    },
}


class ScoreModelGrader(Grader):
    """A judge model's score (see the module docstring)."""

    name: ClassVar[str] = "score_model"
    options_model: ClassVar[type[GraderOptions]] = ScoreModelOptions
    options: ScoreModelOptions

    def grade(
        self, answer: str, item: Mapping[str, Any], trajectory: Sequence[TrajectoryStep]
    ) -> GradeResult:
        """Judges a context with no sample (:meth:`evaluate` does the work)."""
        return self.evaluate(GradeContext(answer=answer, item=item, trajectory=trajectory))

    def evaluate(self, context: GradeContext) -> GradeResult:
        """The judge's verdict on ``context``: kept, or asked for (see the module docstring)."""
        opts = self.options
        messages = [
            {"role": m.role, "content": render(m.content, context, opts)} for m in opts.input
        ]
        key = _verdict_key(context.rollout_id, str(opts.base_url), opts.model, messages)
        services = context.services
        kept = self._kept(context, key)
        if kept is not None:
            return kept
        deadline = time.monotonic() + opts.timeout_s
        slot = (
            services.slot(
                f"judge:{hashlib.sha256(f'{opts.base_url}|{opts.model}'.encode()).hexdigest()[:16]}",
                opts.max_concurrent,
                wait_s=opts.timeout_s,
                hold_s=opts.timeout_s + 5,
            )
            if services is not None
            else _local_slot(f"{opts.base_url}|{opts.model}", opts.max_concurrent, opts.timeout_s)
        )
        with slot as held:
            if not held:
                metrics.JUDGE_VERDICTS.labels(context.environment, JudgeErrorKind.BUSY).inc()
                raise GraderUnavailable(
                    JudgeErrorKind.BUSY,
                    f"judge {opts.model}: no call slot came free in {opts.timeout_s:g} s "
                    f"(max_concurrent {opts.max_concurrent} across the deployment)",
                    {"model": opts.model, "base_url": str(opts.base_url)},
                )
            # A grade of the same rollout that held the slot before may have kept its
            # verdict since this one looked.
            kept = self._kept(context, key)
            if kept is not None:
                return kept
            verdict = self._ask(messages, deadline, context.environment)
            details = {
                "score": verdict["score"],
                "reason": verdict["reason"],
                "model": opts.model,
                "attempts": verdict["attempts"],
                "latency_s": verdict["latency_s"],
                "usage": verdict["usage"],
            }
            # Kept before the slot is given back: the next grade of this rollout to take
            # it finds the verdict instead of asking again.
            if services is not None and context.rollout_id:
                services.remember(key, details, opts.cache_ttl_s)
        return GradeResult(score=verdict["score"], details={**details, "cached": False})

    def _kept(self, context: GradeContext, key: str) -> GradeResult | None:
        if context.services is None or not context.rollout_id:
            return None
        kept = context.services.recall(key)
        if kept is None:
            return None
        metrics.JUDGE_VERDICTS.labels(context.environment, "cached").inc()
        return GradeResult(score=kept["score"], details={**kept, "cached": True})

    def _ask(
        self, messages: list[dict[str, str]], deadline: float, environment: str
    ) -> dict[str, Any]:
        """The verdict, after as many attempts as fit; GraderUnavailable with every
        attempt's evidence when none gives one."""
        import openai  # here, not at the top: 1-2 s of import in every API and worker start

        opts = self.options
        api_key = os.environ.get(opts.api_key_env) or ""
        client = _client(str(opts.base_url), api_key)

        def _excerpt(text: str) -> str:
            # A server may echo the key it refused: evidence never carries it.
            return excerpt(text.replace(api_key, "***") if api_key else text)

        attempts: list[dict[str, Any]] = []
        kind = JudgeErrorKind.UNAVAILABLE
        structured = opts.structured_output and _honours_schema(str(opts.base_url), opts.model)
        attempt = 0
        while attempt < opts.max_attempts:
            remaining = deadline - time.monotonic()
            if remaining < 0.05:
                break
            attempt += 1
            started = time.monotonic()
            record: dict[str, Any] = {"attempt": attempt}
            retry_after: float | None = None
            try:
                request: dict[str, Any] = {
                    "model": opts.model,
                    "messages": messages,
                    "temperature": opts.temperature,
                    "max_tokens": opts.max_tokens,
                    "timeout": min(opts.request_timeout_s, remaining),
                }
                if structured:
                    request["response_format"] = _SCHEMA
                reply = client.chat.completions.create(**request)
            except openai.APITimeoutError:
                kind = JudgeErrorKind.TIMEOUT
                record["error"] = f"no reply in {min(opts.request_timeout_s, remaining):.1f} s"
            except openai.APIConnectionError as exc:
                kind = JudgeErrorKind.UNAVAILABLE
                record["error"] = _excerpt(f"{type(exc).__name__}: {exc.__cause__ or exc}")
            except openai.APIStatusError as exc:
                record["status"] = exc.status_code
                record["error"] = _excerpt(str(exc.message))
                if (
                    structured
                    and exc.status_code in (400, 422)
                    and "response_format" in str(exc.message)
                ):
                    # A server without structured output: ask again without it, now and
                    # for the rest of this process; this attempt does not count.
                    _refuses_schema(str(opts.base_url), opts.model)
                    structured = False
                    attempt -= 1
                    attempts.append(record | {"latency_s": _since(started)})
                    continue
                if exc.status_code != 429 and exc.status_code < 500:
                    attempts.append(record | {"latency_s": _since(started)})
                    raise self._failed(JudgeErrorKind.REFUSED, attempts, environment) from None
                kind = JudgeErrorKind.UNAVAILABLE
                retry_after = _retry_after(exc.response)
            else:
                latency = _since(started)
                metrics.JUDGE_LATENCY.labels(environment).observe(latency)
                text = (reply.choices[0].message.content or "") if reply.choices else ""
                try:
                    verdict = parse_verdict(text, opts.range)
                except ValueError as exc:
                    kind = JudgeErrorKind.UNPARSEABLE
                    record |= {"error": str(exc), "reply": _excerpt(text)}
                else:
                    metrics.JUDGE_VERDICTS.labels(environment, "ok").inc()
                    attempts.append(record | {"latency_s": latency})
                    usage = reply.usage.model_dump() if reply.usage else {}
                    return {
                        "score": verdict.score,
                        "reason": verdict.reason,
                        "attempts": attempts,
                        "latency_s": latency,
                        "usage": usage,
                    }
            attempts.append(record | {"latency_s": _since(started)})
            if attempt < opts.max_attempts:
                wait = opts.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)  # noqa: S311
                wait = max(wait, retry_after or 0.0)
                time.sleep(max(0.0, min(wait, deadline - time.monotonic())))
        raise self._failed(kind, attempts, environment)

    def _failed(
        self, kind: JudgeErrorKind, attempts: list[dict[str, Any]], environment: str
    ) -> GraderUnavailable:
        opts = self.options
        metrics.JUDGE_VERDICTS.labels(environment, kind).inc()
        last = attempts[-1] if attempts else {}
        message = (
            f"judge {opts.model} at {opts.base_url}: {kind.value.removeprefix('judge_')} after "
            f"{len(attempts)} attempt(s) in {opts.timeout_s:g} s"
            + (f": {last.get('status', '')} {last.get('error', '')}".rstrip() if last else "")
        )
        log.warning("judge.failed", kind=kind.value, model=opts.model, attempts=attempts)
        return GraderUnavailable(
            kind,
            message,
            {"model": opts.model, "base_url": str(opts.base_url), "attempts": attempts},
        )


def render(template: str, context: GradeContext, opts: ScoreModelOptions) -> str:
    """``template`` with its placeholders filled from ``context``; a row field it names
    and the row lacks is an :class:`ItemError`."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in _ANSWER_NAMES:
            return context.answer
        if name == "trajectory":
            return trajectory_excerpt(
                context.trajectory, opts.trajectory_steps, opts.trajectory_chars
            )
        if name == "item":
            return json.dumps(dict(context.item), ensure_ascii=False, default=str)
        field = name.removeprefix("item.")
        if field not in context.item or context.item[field] is None:
            raise ItemError(field, "the judge's input names it, and the row has none")
        found = context.item[field]
        return found if isinstance(found, str) else json.dumps(found, ensure_ascii=False)

    return _PLACEHOLDER.sub(value, template)


def trajectory_excerpt(steps: Sequence[TrajectoryStep], count: int, chars: int) -> str:
    """The last ``count`` tool calls, one block each, cut to ``chars`` from the end."""
    if count == 0 or not steps:
        return "(no tool calls)" if count else ""
    blocks = []
    for step in steps[-count:]:
        arguments = (
            step.arguments if isinstance(step.arguments, str) else json.dumps(step.arguments)
        )
        status = f"exit {step.exit_code}" if step.exit_code is not None else step.outcome.value
        blocks.append(f"[{step.seq}] {step.tool} {arguments} -> {status}\n{step.output}")
    text = "\n".join(blocks)
    return text if len(text) <= chars else "..." + text[len(text) - chars :]


def parse_verdict(text: str, scale: tuple[float, float]) -> _Verdict:
    """The judge's verdict in ``text``, read strictly (see the module docstring);
    ValueError saying why there is none."""
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    verdict: _Verdict | None = None
    if body.startswith("{"):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"the reply opens a JSON object it does not close: {exc.msg}"
            ) from None
        score = data.get("score") if isinstance(data, dict) else None
        if isinstance(score, bool) or not isinstance(score, int | float):
            raise ValueError("the reply's JSON has no numeric 'score'")
        reason = data.get("reason", "")
        verdict = _Verdict(score=float(score), reason=reason if isinstance(reason, str) else "")
    else:
        lines = _SCORE_LINE.findall(body)
        if len(_ANY_SCORE.findall(body)) > 1:
            raise ValueError("the reply has several scores")
        if len(lines) != 1:
            raise ValueError(
                "the reply has no 'score: N' line" if not lines else "the reply has several scores"
            )
        verdict = _Verdict(score=float(lines[0]), reason=excerpt(body))
    low, high = scale
    if not low <= verdict.score <= high:
        raise ValueError(f"the score {verdict.score:g} is outside the range [{low:g}, {high:g}]")
    return verdict


def _verdict_key(rollout_id: str, base_url: str, model: str, messages: list[dict[str, str]]) -> str:
    canonical = json.dumps([rollout_id, base_url, model, messages], sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


_clients: dict[tuple[str, str], openai.OpenAI] = {}
_clients_lock = threading.Lock()
_no_schema: set[tuple[str, str]] = set()
_local_slots: dict[str, threading.BoundedSemaphore] = {}


def _client(base_url: str, api_key: str) -> openai.OpenAI:
    """One client per server and key, for the process: its connections (and the TLS
    context it builds) are reused. The SDK's own retries are off: ours bound the whole
    verdict's time, and retry an unreadable reply too."""
    import openai

    with _clients_lock:
        client = _clients.get((base_url, api_key))
        if client is None:
            client = openai.OpenAI(
                base_url=base_url,
                # The SDK refuses no key; a server that needs none ignores this one.
                api_key=api_key or "none",
                max_retries=0,
            )
            _clients[(base_url, api_key)] = client
        return client


def _honours_schema(base_url: str, model: str) -> bool:
    return (base_url, model) not in _no_schema


def _refuses_schema(base_url: str, model: str) -> None:
    _no_schema.add((base_url, model))


@contextmanager
def _local_slot(name: str, limit: int, wait_s: float) -> Iterator[bool]:
    """The process's own bound, where no deployment lends slots (offline regrades)."""
    with _clients_lock:
        semaphore = _local_slots.setdefault(name, threading.BoundedSemaphore(limit))
    held = semaphore.acquire(timeout=wait_s)
    try:
        yield held
    finally:
        if held:
            semaphore.release()


def _retry_after(response: Any) -> float | None:
    if response is None:
        return None
    try:
        return min(30.0, max(0.0, float(response.headers.get("retry-after", ""))))
    except ValueError:
        return None


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)


def excerpt(text: str) -> str:
    """``text`` cut to what evidence keeps."""
    return text if len(text) <= _EXCERPT else text[:_EXCERPT] + "..."


__all__ = [
    "JudgeErrorKind",
    "ScoreModelGrader",
    "ScoreModelOptions",
    "parse_verdict",
    "render",
    "trajectory_excerpt",
]
