"""A tiny random causal LM that runs offline on a CPU: the trainer examples' default model.

Nothing is downloaded. A byte-level BPE tokenizer is trained here on a few KB of text
(every byte encodes, so nothing is unknown); the model is a two-layer Qwen2 built from a
config with random weights; the chat template is TRL's own Qwen2.5 template, verbatim,
which TRL recognises by string equality and parses ``<tool_call>{json}</tool_call>``
from, and which verl's Hermes tool parser reads too.

A random model does not write a tool call by chance, so :func:`steering_bias` gives the
sampler (transformers' own ``sequence_bias`` logits processor, passed as a generation
argument) a nudge: each assistant turn opens with one of a few scripted continuations (a
tool call, or an answer) about as often as with free text, and a continuation once begun
is finished. The bias only shapes sampling: the trainer's loss uses the model's own
log-probabilities. With a real model (``--model Qwen/Qwen2.5-0.5B-Instruct``) none of this
is used.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl.chat_template_utils import qwen2_5_chat_template

from examples.codebase_planning.episodes import rows
from orchestrator.adapters.trl import OrchestratorEnvironment

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added as plain (not special) tokens: one id each, and kept by decode(skip_special_tokens).
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
VOCAB_SIZE = 1000
# TRL drops a tool result once prompt + completion reach this; the tools' schemas alone
# are several hundred tokens of the prompt.
MAX_POSITIONS = 4096


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as a Qwen/Hermes model writes it (the template's own format)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _corpus() -> list[str]:
    """Text like what the model will see, so the tokenizer's merges keep prompts short."""
    tools = [OrchestratorEnvironment.shell, OrchestratorEnvironment.read_file]
    lines = [qwen2_5_chat_template, *(tool.__doc__ or "" for tool in tools)]
    lines += [str(row["request"]) for row in rows(50, None)]
    lines += [
        "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
        '{"type": "function", "function": {"name": "shell", "description": "", "parameters": '
        '{"type": "object", "properties": {"command": {"type": "string"}}, "required": []}}}',
        "src/requests/sessions.py src/requests/adapters.py src/requests/models.py exit status 0",
    ]
    for i in range(30):
        lines.append(tool_call_text("shell", {"command": f"ls src/requests/{i}"}))
        lines.append(json.dumps([f"src/requests/file{i}.py"]))
    return lines


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A BPE tokenizer trained here, with TRL's Qwen2.5 chat template."""
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",  # noqa: S106 - a token of the vocabulary, not a secret
        pad_token="<|endoftext|>",  # noqa: S106 - likewise
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
    )
    fast.add_tokens(TOOL_TAGS)
    # Verbatim: TRL picks its tool-call parser by comparing the template string.
    fast.chat_template = qwen2_5_chat_template
    return fast


def build_model(tokenizer: PreTrainedTokenizerFast, *, seed: int = 0) -> Qwen2ForCausalLM:
    """A two-layer Qwen2 with random weights (about 150 K parameters)."""
    import torch

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(model_config(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def model_config(tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        architectures=["Qwen2ForCausalLM"],
    )


def save_model_dir(path: Path, *, seed: int = 0) -> PreTrainedTokenizerFast:
    """A model directory (config, weights, tokenizer) as ``from_pretrained`` reads one."""
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=seed).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer


def steering_bias(
    tokenizer: PreTrainedTokenizerFast, continuations: Sequence[tuple[str, float]]
) -> list[list[Any]]:
    """``sequence_bias`` (JSON-safe list form) that opens an assistant turn with each
    ``(text, weight)`` of ``continuations`` ``weight`` times as often as with free text,
    and finishes a continuation once begun.

    Near-uniform logits over V tokens: a bias of ln(V * weight) on a continuation's first
    token gives it ``weight`` times the mass of all the other tokens together.
    """
    header = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=True
    )
    if hasattr(header, "keys"):  # a BatchEncoding on transformers versions that return one
        header = header["input_ids"]
    context = list(header[-2:])  # "assistant", "\n": where a turn starts
    bias: list[list[Any]] = []
    for text, weight in continuations:
        ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        bias.append([[*context, ids[0]], math.log(len(tokenizer) * weight)])
        bias += [[ids[: i + 1], 100.0] for i in range(1, len(ids))]
    # Free text ends within a few tokens instead of running to the length limit.
    bias.append([[tokenizer.eos_token_id], 4.0])
    return bias
