"""Judge models for the tests: tiny real causal LMs, built here on the CPU, that a real
OpenAI-compatible server (``transformers serve``) loads from their directories.

Run in the trainers' venv (transformers, tokenizers, torch)::

    python tests/judge_models.py OUT_DIR

writes one model directory per entry of :data:`VERDICTS` under ``OUT_DIR``. A random model
writes no verdict by chance, so each is steered: its ``generation_config.json`` carries a
``sequence_bias`` (transformers' own logits processor, applied by the server to every
request) that opens the assistant's turn with its scripted verdict and finishes it, as
``examples/tiny_model.py`` steers the trainers' policy to a tool call. The weights, the
tokenizer and the server are real; only what the model says is chosen.
"""

from __future__ import annotations

import sys
from pathlib import Path

VERDICTS = {
    # A verdict as structured output asks for it.
    "fair": '{"score": 0.75, "reason": "It names the file to change and misses one."}',
    # A verdict as a strict pattern reads it: one "score: N" line.
    "lined": "The answer names the right file.\nScore: 0.5",
    # No verdict at all.
    "garbage": "I would rather not say what I think of it.",
    # A number outside the judge's range.
    "overscored": '{"score": 7, "reason": "Seven out of ten."}',
}

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        [*VERDICTS.values(), CHAT_TEMPLATE, "Score the answer from 0 to 1 against the rubric."],
        trainer=trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    header = fast.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=True
    )
    if hasattr(header, "keys"):  # a BatchEncoding on transformers versions that return one
        header = header["input_ids"]
    turn = list(header[-2:])  # "assistant", "\n": where the judge's turn starts
    for name, text in VERDICTS.items():
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=len(fast),
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=8192,
                tie_word_embeddings=True,
                pad_token_id=fast.pad_token_id,
                eos_token_id=fast.eos_token_id,
                bos_token_id=None,
            )
        )
        ids = [*fast.encode(text, add_special_tokens=False), fast.eos_token_id]
        # The first token after the turn's start, then each next one after the verdict so
        # far: far above anything the random weights give.
        bias = [[[*turn, ids[0]], 100.0]] + [[ids[: i + 1], 100.0] for i in range(1, len(ids))]
        model.generation_config.eos_token_id = fast.eos_token_id
        model.generation_config.pad_token_id = fast.pad_token_id
        model.generation_config.sequence_bias = bias
        model.save_pretrained(out / name)
        fast.save_pretrained(out / name)


if __name__ == "__main__":
    build(Path(sys.argv[1]))
