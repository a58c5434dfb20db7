"""GRPO with TRL's own ``GRPOTrainer``: every rollout's tool calls run in its own
orchestrator sandbox, and the orchestrator grades it.

    make up              # terminal 1: prints the URL and the API token
    make trainers-venv   # TRL, verl and torch (CPU build) in .venv-trainers
    .venv-trainers/bin/python -m examples.trl_grpo --base-url http://127.0.0.1:8000 --token TOKEN

The default policy is a tiny random model built on the spot (examples/tiny_model.py): the
run takes seconds on a CPU and downloads nothing, and shows the wiring, not learning.
``--model Qwen/Qwen2.5-0.5B-Instruct`` (or a local directory) trains a real model.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from examples import tiny_model
from examples.codebase_planning.episodes import example_parser, rows
from orchestrator.adapters.trl import OrchestratorEnvironment, environment_factory, reward_function

TINY = "tiny"
# What the tiny policy is steered to write, and how often against free text: a tool call,
# and the gold answers of the first dataset rows (a random model never finds them itself).
TINY_CONTINUATIONS = [
    (tiny_model.tool_call_text("shell", {"command": "ls src/requests"}), 3.0),
    ('["src/requests/sessions.py"]', 1.0),
    ('["src/requests/utils.py"]', 1.0),
    ('["src/requests/models.py"]', 1.0),
]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = example_parser(__doc__.splitlines()[0])
    parser.set_defaults(rows=4)
    parser.add_argument("--model", default=TINY, help="a model name or directory; 'tiny': offline")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps")
    parser.add_argument("--generations", type=int, default=2, help="rollouts per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", type=Path, help="write what ran here, as JSON")
    return parser.parse_args(argv)


def dataset(rows_: list[dict[str, Any]]) -> Dataset:
    """TRL's conversational rows: the request as the prompt, the rest for the rollout."""
    return Dataset.from_list(
        [{"prompt": [{"role": "user", "content": row["request"]}], **row} for row in rows_]
    )


class SampleLog:
    """Wraps a TRL reward function to keep what each sample was: its rollout, its calls,
    its reward (``None``: dropped). TRL calls it once per generation batch."""

    def __init__(self, reward: Callable[..., list[float | None]]) -> None:
        self.reward = reward
        self.samples: list[dict[str, Any]] = []
        self.__name__ = getattr(reward, "__name__", "orchestrator_reward")

    def __call__(
        self, completions: list[Any], environments: list[OrchestratorEnvironment], **kwargs: Any
    ) -> list[float | None]:
        scores = self.reward(completions=completions, environments=environments, **kwargs)
        step = kwargs["trainer_state"].global_step if "trainer_state" in kwargs else None
        for env, score in zip(environments, scores, strict=True):
            self.samples.append(
                {
                    "step": step,
                    "rollout_id": env.rollout_id,
                    "tool_calls": env.tool_calls,
                    "infra_failed": env.infra_failed,
                    "reward": score,
                }
            )
        return scores


def build(
    args: argparse.Namespace,
    factory: Callable[[], OrchestratorEnvironment] | None = None,
) -> tuple[GRPOTrainer, SampleLog]:
    """The trainer on the orchestrator's environment factory and reward function."""
    factory = factory or environment_factory(args.base_url, args.token)
    log = SampleLog(reward_function())
    model: Any = args.model
    tokenizer = None
    generation_kwargs: dict[str, Any] = {}
    if args.model == TINY:
        tokenizer = tiny_model.build_tokenizer()
        model = tiny_model.build_model(tokenizer, seed=args.seed)
        generation_kwargs["sequence_bias"] = tiny_model.steering_bias(tokenizer, TINY_CONTINUATIONS)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"),
        max_steps=args.steps,
        per_device_train_batch_size=4,
        num_generations=args.generations,
        max_completion_length=256,
        max_tool_calling_iterations=3,
        learning_rate=1e-3 if args.model == TINY else 1e-6,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=args.seed,
        dataloader_num_workers=0,
        generation_kwargs=generation_kwargs or None,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[log],
        args=config,
        train_dataset=dataset(rows(args.rows, args.codebase)),
        environment_factory=factory,
    )
    return trainer, log


def report(trainer: GRPOTrainer, log: SampleLog) -> dict[str, Any]:
    """What ran: the trainer's own step logs and every sample's rollout."""
    keep = ("step", "loss", "reward", "tools/call_frequency", "tools/failure_frequency")
    steps = [
        {key: entry[key] for key in keep if key in entry}
        for entry in trainer.state.log_history
        if "loss" in entry
    ]
    return {"global_step": trainer.state.global_step, "steps": steps, "samples": log.samples}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train; returns (and with ``--report`` writes) what ran."""
    args = parse_args(argv)
    trainer, log = build(args)
    trainer.train()
    result = report(trainer, log)
    for sample in log.samples:
        shown = "dropped" if sample["reward"] is None else f"{sample['reward']:.2f}"
        print(f"{sample['rollout_id']}  calls={sample['tool_calls']}  reward={shown}")
    if args.report:
        args.report.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
