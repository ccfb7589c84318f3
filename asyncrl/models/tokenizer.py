"""A character-level tokenizer built locally, so the tiny setup needs nothing from a hub.

One character is one token: arithmetic answers are scored digit by digit and no merge can hide a
digit inside a larger token. Text outside the alphabet maps to ``<unk>``.

It is a byte-level BPE without merges, the layout of the Qwen2 and GPT-2 tokenizers: the vocabulary
holds each character as byte-level BPE writes it (a space is ``Ġ``, a newline ``Ċ``). transformers
rebuilds a Qwen2 model's tokenizer as byte-level BPE from the saved vocabulary, whatever
``tokenizer_config.json`` names, so only this layout makes ``AutoTokenizer`` on a saved checkpoint
encode and decode exactly as training did.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
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
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = [byte_level.pre_tokenize_str(char)[0][0] for char in chars]
    wide = next((char for char, symbol in zip(chars, symbols) if len(symbol) != 1), None)
    if wide is not None:
        raise ValueError(f"build_char_tokenizer: {wide!r} is more than one byte in UTF-8, so it cannot be one token")
    vocab = {token: i for i, token in enumerate([PAD, EOS, UNK] + symbols)}
    backend = Tokenizer(models.BPE(vocab, [], unk_token=UNK))
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
