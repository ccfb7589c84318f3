"""A tiny GGUF file written with the ``gguf`` package: a 2-layer llama with float32 and float16
tensors and a byte-level BPE tokenizer (a chat template, control tokens) in its metadata, under
the names transformers' GGUF loader maps, so a conversion can be tested without a download."""

from pathlib import Path

import gguf
import numpy as np
from transformers.convert_slow_tokenizer import bytes_to_unicode

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e"]
TOKENS = [*bytes_to_unicode().values(), *(merge.replace(" ", "") for merge in MERGES), *SPECIAL]
LAYERS, HIDDEN, HEADS, KV_HEADS, FFN = 2, 32, 4, 2, 64


def write_tiny_llama(path: Path, *, architecture: str = "llama", seed: int = 0) -> Path:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny llama")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    _add_tokenizer(writer)
    _add_tensors(writer, np.random.default_rng(seed))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: gguf.GGUFWriter) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    normal = [gguf.TokenType.NORMAL] * (len(TOKENS) - len(SPECIAL))
    writer.add_token_types(normal + [gguf.TokenType.CONTROL] * len(SPECIAL))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(TOKENS.index("<|im_start|>"))
    writer.add_eos_token_id(TOKENS.index("<|im_end|>"))
    writer.add_pad_token_id(TOKENS.index("<|endoftext|>"))
    writer.add_chat_template(CHATML)


def _add_tensors(writer: gguf.GGUFWriter, rng: np.random.Generator) -> None:
    """Embeddings tied to the output (no ``output.weight``); q and k in float16, the rest float32."""

    def random(name: str, rows: int, columns: int, dtype=np.float32) -> None:
        writer.add_tensor(name, (rng.standard_normal((rows, columns)) * 0.2).astype(dtype))

    kv = KV_HEADS * HIDDEN // HEADS
    random("token_embd.weight", len(TOKENS), HIDDEN)
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        random(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN, np.float16)
        random(f"blk.{i}.attn_k.weight", kv, HIDDEN, np.float16)
        random(f"blk.{i}.attn_v.weight", kv, HIDDEN)
        random(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        random(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        random(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        random(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
