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
CHAT_ALPHABET = DEFAULT_ALPHABET + '{}"[]_'  # appended, so the default characters keep their ids
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"

# One line per message behind a one-letter role (every character is a token here): S system,
# U user, A assistant (ended by EOS, which the generator stops on), R a tool's result. Tools are
# listed by name and parameters; a tool call is Hermes' <tool_call>{json}</tool_call>.
CHAT_TEMPLATE = (
    "{%- if tools %}S:tools"
    "{%- for tool in tools %}{% set f = tool.function or tool %} {{ f.name }}"
    "({{ (f.parameters.properties or {}) | list | join(',') }}){% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{%- if m.role == 'assistant' %}A:{{ m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}{% set c = call.function or call %}<tool_call>"
    "{{ {'name': c.name, 'arguments': c.arguments} | tojson }}</tool_call>{% endfor %}{{ eos_token }}"
    "{%- else %}{{ {'system': 'S', 'user': 'U', 'tool': 'R'}[m.role] }}:{{ m.content }}\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}A:{% endif %}"
)


def build_char_tokenizer(alphabet: str | None = None, *, chat: bool = False) -> PreTrainedTokenizerFast:
    """Ids 0, 1, 2 are ``<pad>``, ``<eos>``, ``<unk>``; the alphabet's characters follow in order.

    Prompts are padded on the left so that a generation batch ends at the same column. No BOS is
    added and no EOS is appended: the generator stops on ``eos_token_id``. ``chat``: with
    ``CHAT_TEMPLATE``, over ``CHAT_ALPHABET`` unless an alphabet is given (multi-turn episodes).
    """
    if alphabet is None:
        alphabet = CHAT_ALPHABET if chat else DEFAULT_ALPHABET
    chars = list(dict.fromkeys(alphabet))
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
        chat_template=CHAT_TEMPLATE if chat else None,
    )
