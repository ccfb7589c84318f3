"""A model directory in the shape of a released chat checkpoint, built locally from nothing.

``python -m asyncrl.models.example DIR`` writes what a downloaded instruct model holds: a
byte-level BPE tokenizer (trained here, with ``tokenizers``, on arithmetic chat transcripts the
module generates), a chat template, BOS before every text, ``generation_config.json`` declaring
two end tokens (end of text and end of turn, as Llama-3-Instruct does), a Llama ``config.json``
and bfloat16 safetensors. The weights are random: it exercises the ``model.path`` route
(``configs/example-checkpoint.yaml``) end to end on a CPU, with nothing fetched from a hub.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from asyncrl.data.synthetic import SYNTHETIC_TASKS

BOS, EOS, END_OF_TURN = "<|begin_of_text|>", "<|end_of_text|>", "<|end_of_turn|>"
ROLES = ("<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end_of_turn|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VOCAB_SIZE = 320


def corpus(num_lines: int = 2000, seed: int = 0) -> list[str]:
    """Chat transcripts of arithmetic problems of every level, with their answers."""
    rng = random.Random(seed)
    task = SYNTHETIC_TASKS["arithmetic"]
    lines = []
    for _ in range(num_lines):
        difficulty = rng.randint(1, task.max_difficulty)
        question, answer = task.problem(rng.randrange(task.size(difficulty)), difficulty)
        lines.append(f"{ROLES[0]}{question}{END_OF_TURN}{ROLES[1]}{answer}{END_OF_TURN}")
    return lines


def build_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    """Byte-level BPE; digits are split one by one before merging (as Llama-3 and Qwen do), so no
    merge hides a digit of an answer inside a larger token."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    backend.decoder = decoders.ByteLevel()
    special = [BOS, EOS, END_OF_TURN, *ROLES]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(corpus(seed=seed), trainer=trainer)
    bos_id = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        additional_special_tokens=[END_OF_TURN, *ROLES],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


SHAPE = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=512,
    max_position_embeddings=256,
)


def write_example_checkpoint(directory: str | Path, *, seed: int = 0, **shape: int) -> Path:
    """Write the checkpoint to ``directory`` (created if missing) and return its path; ``shape``
    overrides fields of ``SHAPE`` (a released model's layer counts and context length) and
    ``vocab_size`` (the tokenizer's by default; a larger one pads the embedding, as released
    models do)."""
    directory = Path(directory)
    tokenizer = build_tokenizer(seed)
    end_ids = [tokenizer.convert_tokens_to_ids(t) for t in (EOS, END_OF_TURN)]
    config = LlamaConfig(
        **{"vocab_size": len(tokenizer), **SHAPE, **shape},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=end_ids,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = end_ids
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="where to write the model directory")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tokenizer corpus and the weights")
    args = parser.parse_args(argv)
    path = write_example_checkpoint(args.directory, seed=args.seed)
    files = ", ".join(sorted(p.name for p in path.iterdir()))
    print(json.dumps({"directory": str(path), "files": files}))


if __name__ == "__main__":
    main()
