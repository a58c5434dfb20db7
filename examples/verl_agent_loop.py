"""verl's own agent loop on the orchestrator: every trajectory's tool calls run in its own
sandbox, the orchestrator grades it, and verl's GRPO advantage is computed on the scores.

    make up              # terminal 1: prints the URL and the API token
    make trainers-venv   # TRL, verl and torch (CPU build) in .venv-trainers
    .venv-trainers/bin/python -m examples.verl_agent_loop --base-url http://127.0.0.1:8000 \\
        --token TOKEN --report /tmp/verl.json

What runs here, on a CPU, with verl 0.9.1's own code: verl's hydra ``ppo_trainer`` config;
the dataset (a parquet file read by verl's ``RLHFDataset``, ``extra_info.tools_kwargs``
per row, repeated ``--generations`` times per prompt as verl's trainer does); verl's
``AgentLoopWorker`` running its ``ToolAgentLoop`` (Hermes tool parser, create/execute/
release around each call) with the tools verl loads from ``examples/verl_tool_config.yaml``;
verl's ``RewardLoopWorker`` and ``NaiveRewardManager`` calling
``pkg://orchestrator.adapters.verl`` ``compute_score`` with ``reward_kwargs``; then
:func:`~orchestrator.adapters.verl.drop_infra_failed` and verl's
``compute_grpo_outcome_advantage``. The policy is the tiny random model of
``examples/tiny_model.py`` generating for real (transformers' sampler, nudged towards a
tool call by a sequence bias; the log-probs are the model's own) behind the interface of
verl's LLM server client.

Where the CPU line is: not run here are the vLLM/SGLang rollout servers (the tiny model
stands in for them), Ray (the two workers are verl's plain classes on one event loop; a
Ray actor call is mimicked by pickling its argument), and everything after the
advantage: the actor/critic update, FSDP/Megatron workers and weight sync. On GPUs the
same tool config and reward function go to verl's trainer unchanged:

    python -m verl.trainer.main_ppo \\
        algorithm.adv_estimator=grpo \\
        data.train_files=train.parquet data.val_files=val.parquet data.return_raw_chat=true \\
        actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct \\
        actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=4 \\
        actor_rollout_ref.rollout.multi_turn.enable=true \\
        actor_rollout_ref.rollout.multi_turn.format=hermes \\
        actor_rollout_ref.rollout.multi_turn.max_assistant_turns=8 \\
        actor_rollout_ref.rollout.multi_turn.tool_config_path=examples/verl_tool_config.yaml \\
        reward.custom_reward_function.path=pkg://orchestrator.adapters.verl \\
        reward.custom_reward_function.name=compute_score \\
        +reward.custom_reward_function.reward_kwargs.base_url=http://HOST:8000 \\
        +reward.custom_reward_function.reward_kwargs.token=TOKEN

(each parquet row: ``prompt`` messages, ``data_source``, ``reward_model.ground_truth``,
``agent_name: tool_agent``, ``extra_info.tools_kwargs.{shell,read_file}.create_kwargs.item``
= the orchestrator row, as :func:`dataset_rows` writes). There ``compute_score`` raises on
an infrastructure failure (the default), failing the step instead of scoring it; with
``+reward.custom_reward_function.reward_kwargs.on_infra_failure=flag`` the sample is scored
0.0 and flagged, and verl's trainer has no hook to drop it: a custom advantage step (or a
``ray_trainer`` subclass) must call ``drop_infra_failed`` first, as this script does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import tempfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import verl
import yaml
from datasets import Dataset
from hydra import compose, initialize_config_dir
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
from verl.workers.rollout.replica import TokenOutput

from examples import tiny_model
from examples.codebase_planning.episodes import example_parser, rows
from orchestrator.adapters import verl as adapter

TOOL_CONFIG = Path(__file__).with_name("verl_tool_config.yaml")
# The policy's own trace key in agent_data.extra_fields (verl copies the first turn's
# TokenOutput.extra_fields there): which verl request each sample was.
REQUEST_ID = "policy_request_id"
# What the tiny policy is steered to write, and how often against free text.
TINY_CONTINUATIONS = [
    (tiny_model.tool_call_text("shell", {"command": "ls src/requests"}), 3.0),
    ('["src/requests/sessions.py"]', 1.0),
    ('["src/requests/utils.py"]', 1.0),
]
MAX_NEW_TOKENS = 64


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = example_parser(__doc__.splitlines()[0])
    parser.add_argument("--generations", type=int, default=2, help="trajectories per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--on-infra-failure", choices=["raise", "flag"], default="flag")
    parser.add_argument("--report", type=Path, help="write what ran here, as JSON")
    return parser.parse_args(argv)


class TinyPolicy:
    """Stands in for verl's LLM server client (``generate(request_id, prompt_ids,
    sampling_params)`` → ``TokenOutput``) with the tiny model's real sampler."""

    def __init__(
        self, model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast, seed: int
    ) -> None:
        self.model, self.tokenizer, self.seed = model.eval(), tokenizer, seed
        self.bias = tiny_model.steering_bias(tokenizer, TINY_CONTINUATIONS)
        self.turns: dict[str, list[str]] = {}
        self._seen: dict[int, int] = {}
        # One generation at a time: two cores, and the seeding below is global.
        self._lock = asyncio.Lock()

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_: Any
    ) -> TokenOutput:
        async with self._lock:
            ids, log_probs = await asyncio.to_thread(
                self._sample, list(prompt_ids), sampling_params
            )
        self.turns.setdefault(request_id, []).append(self.tokenizer.decode(ids))
        return TokenOutput(
            token_ids=ids,
            log_probs=log_probs,
            stop_reason="completed",
            extra_fields={REQUEST_ID: request_id},
        )

    def _sample(self, prompt: list[int], params: dict[str, Any]) -> tuple[list[int], list[float]]:
        # Seeded by the prompt and how often it was seen: the run's draws do not depend
        # on which trajectory's HTTP call returned first.
        key = zlib.crc32(np.asarray(prompt, dtype=np.int64).tobytes())
        occurrence = self._seen.get(key, 0)
        self._seen[key] = occurrence + 1
        torch.manual_seed(zlib.crc32(f"{self.seed}:{key}:{occurrence}".encode()))
        with torch.no_grad():
            out = self.model.generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=True,
                temperature=float(params.get("temperature") or 1.0),
                top_k=0,
                top_p=1.0,
                sequence_bias=self.bias,
                eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.pad_token_id,
                return_dict_in_generate=True,
                output_logits=True,
            )
        ids = out.sequences[0, len(prompt) :].tolist()
        # The model's own log-probabilities of what was sampled (the bias only steered).
        logits = torch.stack(out.logits, dim=1)[0, : len(ids)]
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        chosen = log_probs[torch.arange(len(ids)), torch.tensor(ids)]
        return ids, [float(x) for x in chosen]


class LocalActor:
    """Stands in for a Ray actor handle (``handle.compute_score.remote(data)``): the
    argument is pickled as Ray would, so samples share no mutable state."""

    def __init__(self, worker: RewardLoopWorker) -> None:
        self.compute_score = self
        self._worker = worker

    async def remote(self, data: DataProto) -> dict[str, Any]:
        result: dict[str, Any] = await self._worker.compute_score(
            pickle.loads(pickle.dumps(data))  # noqa: S301 - our own object, in-process
        )
        return result


def dataset_rows(rows_: list[dict[str, Any]], tools: Sequence[str]) -> list[dict[str, Any]]:
    """verl's dataset format: the request as the prompt, the orchestrator row as every
    tool's create_kwargs (verl's RLHFDataset moves extra_info.tools_kwargs to tools_kwargs)."""
    out = []
    for index, row in enumerate(rows_):
        create = {"create_kwargs": {"item": row}}
        out.append(
            {
                "data_source": "orchestrator/codebase-planning",
                "prompt": [{"role": "user", "content": row["request"]}],
                "agent_name": "tool_agent",
                "reward_model": {"style": "rule", "ground_truth": json.dumps(row["gold_files"])},
                "extra_info": {"index": index, "tools_kwargs": {n: create for n in tools}},
            }
        )
    return out


def tool_config(work: Path, base_url: str, token: str | None) -> Path:
    """The example's tool config with this deployment's URL and token."""
    loaded = yaml.safe_load(TOOL_CONFIG.read_text())
    for entry in loaded["tools"]:
        entry["config"].update(base_url=base_url, token=token)
    path = work / "tools.yaml"
    path.write_text(yaml.safe_dump(loaded))
    return path


def verl_config(work: Path, args: argparse.Namespace, tools: Path) -> Any:
    """verl's own ``ppo_trainer`` config, with the tool and reward settings of the docstring."""
    reward_kwargs = {
        "base_url": args.base_url,
        "token": args.token,
        "on_infra_failure": args.on_infra_failure,
    }
    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(
            "ppo_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={work / 'model'}",
                "actor_rollout_ref.rollout.name=vllm",
                f"actor_rollout_ref.rollout.n={args.generations}",
                "actor_rollout_ref.rollout.prompt_length=2048",
                "actor_rollout_ref.rollout.response_length=512",
                "actor_rollout_ref.rollout.multi_turn.enable=true",
                "actor_rollout_ref.rollout.multi_turn.format=hermes",
                "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
                f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
                "data.return_raw_chat=true",
                "data.filter_overlong_prompts=false",
                "reward.custom_reward_function.path=pkg://orchestrator.adapters.verl",
                "reward.custom_reward_function.name=compute_score",
                *(
                    f"+reward.custom_reward_function.reward_kwargs.{k}={v}"
                    for k, v in reward_kwargs.items()
                    if v is not None
                ),
            ],
        )


@dataclass
class Run:
    """Everything one run is built from (tests/trainers/verl_checks.py reuses it)."""

    loop: asyncio.AbstractEventLoop
    config: Any
    tokenizer: PreTrainedTokenizerFast
    policy: TinyPolicy
    worker: AgentLoopWorker
    batch: DataProto


def build(args: argparse.Namespace, work: Path | None = None) -> Run:
    """The config, dataset, policy and verl's two workers, on a fresh event loop."""
    work = work or Path(tempfile.mkdtemp(prefix="verl-agent-loop-"))
    tokenizer = tiny_model.save_model_dir(work / "model", seed=args.seed)
    model = Qwen2ForCausalLM.from_pretrained(work / "model")
    tools = tool_config(work, args.base_url, args.token)
    config = verl_config(work, args, tools)

    names = [
        e["tool_schema"]["function"]["name"] for e in yaml.safe_load(tools.read_text())["tools"]
    ]
    parquet = work / "train.parquet"
    Dataset.from_list(dataset_rows(rows(args.rows, args.codebase), names)).to_parquet(parquet)
    dataset = RLHFDataset(data_files=[str(parquet)], tokenizer=tokenizer, config=config.data)
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))
    # As verl's trainer does: a group id per prompt, then n trajectories of each, adjacent.
    batch.non_tensor_batch["uid"] = np.array([f"p{i}" for i in range(len(batch))], dtype=object)
    batch = batch.repeat(repeat_times=args.generations, interleave=True)
    batch.meta_info = {"global_steps": 1, "validate": False}

    # verl's workers keep the event loop current when they are built: build them on the
    # loop that runs them.
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    policy = TinyPolicy(model, tokenizer, args.seed)
    reward = RewardLoopWorker(config)
    worker = AgentLoopWorker(
        config, llm_client=policy, reward_loop_worker_handles=[LocalActor(reward)]
    )
    return Run(loop, config, tokenizer, policy, worker, batch)


def advantages(out: DataProto) -> dict[str, Any]:
    """verl's GRPO advantage on the scored samples, the infra-flagged ones dropped first."""
    kept = adapter.drop_infra_failed(out)
    if len(kept) == 0:
        return {"kept": [], "advantages": []}
    adv, _ = compute_grpo_outcome_advantage(
        token_level_rewards=kept.batch["rm_scores"],
        response_mask=kept.batch["response_mask"],
        index=kept.non_tensor_batch["uid"],
    )
    # One value per sample: GRPO spreads the sample's advantage over its model tokens.
    per_sample = [
        float(row[mask.bool()][0]) if mask.any() else 0.0
        for row, mask in zip(adv, kept.batch["response_mask"], strict=True)
    ]
    return {"kept": [str(r) for r in kept.non_tensor_batch[REQUEST_ID]], "advantages": per_sample}


def samples(out: DataProto) -> list[dict[str, Any]]:
    """Per sample: its verl request, orchestrator rollout, tool calls, score and flag."""
    nt = out.non_tensor_batch
    flags = adapter.infra_failed_mask(nt)
    scores = out.batch["rm_scores"].sum(-1).tolist()
    result = []
    for i in range(len(out)):
        reward = nt[adapter.REWARD_EXTRA_INFO][i] or {}
        result.append(
            {
                "request_id": nt[REQUEST_ID][i],
                "uid": nt["uid"][i],
                "rollout_id": nt.get(adapter.ROLLOUT_ID, [None] * len(out))[i]
                or reward.get(adapter.ROLLOUT_ID),
                "tool_calls": int(nt.get(adapter.TOOL_CALLS, [None] * len(out))[i] or 0),
                "turns": int(nt["__num_turns__"][i]),
                "score": float(scores[i]),
                "infra_failed": flags[i],
                "infra_error": nt.get(adapter.INFRA_ERROR, [None] * len(out))[i],
            }
        )
    return result


def execute(run: Run) -> DataProto:
    """verl's agent loop over the batch (tools in sandboxes, scores from the orchestrator),
    the uids put back as verl's trainer unions them with the input batch."""
    out: DataProto = run.loop.run_until_complete(run.worker.generate_sequences(run.batch))
    out.non_tensor_batch["uid"] = run.batch.non_tensor_batch["uid"]
    return out


def finish(run: Run) -> None:
    run.loop.run_until_complete(adapter.OrchestratorTool.shutdown())
    run.loop.close()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the batch; returns (and with ``--report`` writes) what ran."""
    args = parse_args(argv)
    run = build(args)
    try:
        out = execute(run)
    finally:
        finish(run)
    result = {
        "samples": samples(out),
        **advantages(out),
        "tools": [t.name for t in run.worker.tools],
    }
    for sample in result["samples"]:
        shown = "infra failure (dropped)" if sample["infra_failed"] else f"{sample['score']:.2f}"
        print(f"{sample['rollout_id']}  calls={sample['tool_calls']}  score={shown}")
    print("advantages:", result["advantages"])
    if args.report:
        args.report.write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
