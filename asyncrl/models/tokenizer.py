"""A character-level tokenizer built locally, so the tiny setup needs nothing from a hub.

One character is one token: arithmetic answers are scored digit by digit and no merge can hide a
digit inside a larger token. Text outside the alphabet maps to ``<unk>``.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

DEFAULT_ALPHABET = string.digits + "+-*/=()?.,:;!<> " + string.ascii_lowercase + string.ascii_uppercase + "\n"
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


def build_char_tokenizer(alphabet: str | None = None) -> PreTrainedTokenizerFast:
    """Ids 0, 1, 2 are ``<pad>``, ``<eos>``, ``<unk>``; the alphabet's characters follow in order.

    Prompts are padded on the left so that a generation batch ends at the same column. No BOS is
    added and no EOS is appended: the generator stops on ``eos_token_id``.
    """
    chars = list(dict.fromkeys(DEFAULT_ALPHABET if alphabet is None else alphabet))
    if not chars:
        raise ValueError("build_char_tokenizer: the alphabet is empty")
    vocab = {token: i for i, token in enumerate([PAD, EOS, UNK] + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every char, newline too
    backend.decoder = decoders.Fuse()  # join tokens with no separator, so spaces survive decoding
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
