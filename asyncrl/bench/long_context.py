"""``asyncrl bench long-context``: per-rank peak memory and time of one train step as T grows.

One split train step (begin, one micro-batch, finish) of a model of one ``Shape`` (random
weights, built from a config) on two rows that hold T tokens in all, float32 on the CPU, at
cp = 1 and cp = 2, with equal rows and, where the shape measures them, with ragged ones (60 % and
40 % of T), right-padded as the trainer pads them and packed into one row (``trainer.packing``),
which computes no padding. Every measurement is a fresh set of rank processes from the
project's launcher (trainer/parallel.py ``launch``, gloo), since peak resident memory is a
per-process high-water mark. A rank builds its trainer, takes a short step (so AdamW's moments
exist, as in any step after a run's first), resets its high-water mark (``/proc/self/clear_refs``)
and reports the step's peak growth above that: what T costs, not the weights and optimizer; large
allocations are mapped on their own (``_map_large_allocations``), so the mark follows the
tensors. T doubles per setting until the next step is expected to take its ranks' resident memory
together past ``memory_limit`` bytes or to run past ``time_limit`` seconds (the growth so far
extrapolated), or a step fails.
"""

from __future__ import annotations

import ctypes
import gc
import json
import operator
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from asyncrl.algorithms.grpo import GRPO
from asyncrl.config import ParallelConfig, TrainerConfig
from asyncrl.models import build_tiny_model
from asyncrl.trainer.parallel import init_parallel, launch
from asyncrl.trainer.policy import PolicyTrainer
from asyncrl.types import TrainBatch

SEQ_LENS = tuple(1024 * 2**k for k in range(6))  # 1k .. 32k tokens per step
QUICK_SEQ_LEN = 256
QUICK_VOCAB = 4096
QUICK_LAYERS = 4
CORES = 2  # each setting gets the same cores: cp = 1 one rank on 2 threads, cp = 2 two ranks on one each
MEMORY_LIMIT = 16 * 2**30  # the ranks of a step together, on a 24 GiB machine
TIME_LIMIT = 600.0  # seconds of one step
RAGGED = (0.6, 0.4)  # the two rows' shares of T
PROMPT_TOKENS = 64
M_MMAP_THRESHOLD, MMAP_THRESHOLD = -3, 64 * 1024  # glibc's mallopt parameter, and its value here
EQUAL = (False, False)  # (padded: ragged rows, packed)
LAYOUTS = (EQUAL, (True, False), (True, True))  # equal, ragged, ragged packed


@dataclass(frozen=True)
class Shape:
    """A model layout (``tiny_config`` keywords), the vocabulary its goals are on, the row layouts
    measured (a deep model takes minutes a step, so it may measure equal rows only) and the name
    its result is saved under in bench-results/."""

    model: dict[str, Any]
    vocab_size: int
    result: str
    layouts: tuple[tuple[bool, bool], ...] = LAYOUTS

    def quick(self) -> Shape:
        """The same layout at most ``QUICK_LAYERS`` blocks deep, for a smoke run."""
        return replace(self, model={**self.model, "num_layers": min(self.model["num_layers"], QUICK_LAYERS)})


SHAPES = {
    # a Qwen2 layout whose embedding and head (Qwen's vocabulary) hold 39M of its 43M parameters
    "tiny": Shape(
        model=dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024),
        vocab_size=151_936,
        result="long-context",
    ),
    # SmolLM2-135M's layout: the 30 blocks hold 106M parameters, the tied embedding 28M
    "smollm2": Shape(
        model=dict(arch="llama", hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536),
        vocab_size=49_152,
        result="long-context-smollm2",
        layouts=(EQUAL,),
    ),
}
COMPARE = {"<=": operator.le, "<": operator.lt}
GOALS = {
    "growth_8k_to_16k": ("<=", 2.2),
    "cp2_over_cp1_memory_at_largest_T": ("<=", 0.55),
    "cp2_over_cp1_time_per_token_at_largest_T": ("<=", 1.0),
    "ragged_2x8k_step_peak_gb": ("<", 8.0),
}


def seq_lens(max_len: int) -> list[int]:
    """The doubling grid up to ``max_len``, or ``max_len`` alone below the grid's first length."""
    return [t for t in SEQ_LENS if t <= max_len] or [max_len]


def rows_of(seq_len: int, padded: bool) -> list[int]:
    """The two rows' lengths: T/2 each, or 60 % / 40 % of T (the wider sets the padded width)."""
    if not padded:
        return [seq_len // 2, seq_len - seq_len // 2]
    first = round(seq_len * RAGGED[0])
    return [first, seq_len - first]


def train_batch(lengths: list[int], vocab: int, seed: int = 0) -> TrainBatch:
    """Rows of ``lengths`` tokens right-padded to the longest; a prompt, then a response."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    columns = torch.arange(width)
    ends = torch.tensor(lengths)[:, None]
    attention_mask = (columns < ends).long()
    prompt = min(PROMPT_TOKENS, min(lengths) - 1)
    response_mask = ((columns >= prompt) & (columns < ends)).float()
    input_ids = torch.randint(1, vocab, (len(lengths), width), generator=gen) * attention_mask
    behaviour = torch.log(torch.rand(input_ids.shape, generator=gen)) * response_mask
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        behaviour_logprobs=behaviour,
        advantages=torch.tensor([1.0, -1.0]),
        response_lengths=response_mask.sum(1).long(),
    )


def _map_large_allocations() -> None:
    """Have glibc map each allocation of ``MMAP_THRESHOLD`` bytes or more on its own (a fixed
    threshold also turns off its dynamic one), so that a freed tensor leaves RSS at once and the
    high-water mark follows the live tensors. On glibc's default heap two runs of the same step
    grew by 5.6 and 8.0 GB; mapped, runs agree to 0.1 %."""
    if not ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure_rank(
    rank: int,
    world_size: int,
    model: dict[str, Any],
    seq_len: int,
    padded: bool,
    vocab: int,
    chunk: int | None,
    packed: bool = False,
) -> bytes:
    """One rank's step: its peak growth above the built trainer, that trainer's RSS and the
    step's seconds, as JSON bytes."""
    _map_large_allocations()
    torch.set_num_threads(CORES // world_size)
    torch.manual_seed(0)
    parallel = init_parallel(ParallelConfig(cp=world_size)) if world_size > 1 else None
    policy = build_tiny_model(vocab, seed=0, max_position_embeddings=max(seq_len, 1024), **model)
    options = {} if chunk is None else {"logprob_chunk_tokens": chunk}
    config = TrainerConfig(lr=1e-5, micro_batch_size=2, packing=packed, **options)
    trainer = PolicyTrainer(policy, config, GRPO(), total_steps=2, parallel=parallel)
    trainer.train_step(train_batch([16, 16], vocab))
    batch = train_batch(rows_of(seq_len, padded), vocab)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # restart the high-water mark at the current RSS
    before = _rss("VmRSS:")
    start = time.perf_counter()
    trainer.begin_train_step()
    trainer.train_microbatch(batch)
    trainer.finish_train_step()
    seconds = time.perf_counter() - start
    peak = _rss("VmHWM:") - before
    return json.dumps({"step_peak_bytes": peak, "base_rss_bytes": before, "step_seconds": seconds}).encode()


def measure(
    shape: Shape, seq_len: int, cp: int, padded: bool, vocab: int, chunk: int | None = None, packed: bool = False
) -> list[dict[str, Any]]:
    """One row per rank, each from a fresh process; a progress line on stderr."""
    payloads = launch(measure_rank, cp, shape.model, seq_len, padded, vocab, chunk, packed, timeout_s=3600.0)
    setting = {
        "seq_len": seq_len,
        "cp": cp,
        "padded": padded,
        "packed": packed,
        "vocab_size": vocab,
        "rows": rows_of(seq_len, padded),
    }
    rows = [{**setting, "rank": rank, **json.loads(payload)} for rank, payload in enumerate(payloads)]
    peak, seconds = max(r["step_peak_bytes"] for r in rows), max(r["step_seconds"] for r in rows)
    layout = ("packed" if packed else "ragged") if padded else "equal"
    print(
        f"long-context: T {seq_len} cp {cp} {layout} V {vocab}: {peak / 1e9:.2f} GB, {seconds:.1f} s", file=sys.stderr
    )
    return rows


def _grown(lens: list[int], values: list[float]) -> float:
    """The value expected at the next length: the last one times the last growth ratio (at least
    the ratio of the lengths)."""
    done = len(values)
    ratio = lens[done] / lens[done - 1]
    if done > 1:
        ratio = max(ratio, values[-1] / values[-2])
    return values[-1] * ratio


def _stop_reason(
    lens: list[int], measured: list[list[dict[str, Any]]], memory_limit: int, time_limit: float
) -> str | None:
    """Why the step at the next length is not taken, or None: it is expected to fit, its ranks'
    resident memory together within ``memory_limit`` bytes and its time within ``time_limit``."""
    if not measured:
        return None
    base = sum(r["base_rss_bytes"] for r in measured[-1])
    memory = base + _grown(lens, [sum(r["step_peak_bytes"] for r in rows) for rows in measured])
    if memory > memory_limit:
        return f"expected {memory / 2**30:.1f} GiB, over {memory_limit / 2**30:g} GiB"
    seconds = _grown(lens, [max(r["step_seconds"] for r in rows) for rows in measured])
    if seconds > time_limit:
        return f"expected {seconds:.0f} s, over {time_limit:g} s"
    return None


def _setting(
    shape: Shape,
    cp: int,
    layout: tuple[bool, bool],
    vocab: int,
    lens: list[int],
    limits: tuple[int, float],
    chunk: int | None,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(rows of this setting for each length that fits, a note if it stopped short of the last)."""
    measured: list[list[dict[str, Any]]] = []
    padded, packed = layout
    note = {"cp": cp, "padded": padded, "packed": packed, "vocab_size": vocab}
    for seq_len in lens:
        reason = _stop_reason(lens, measured, *limits)
        if reason is not None:
            return sum(measured, []), {**note, "seq_len": seq_len, "reason": reason}
        try:
            measured.append(measure(shape, seq_len, cp, padded, vocab, chunk, packed))
        except (RuntimeError, TimeoutError) as err:
            return sum(measured, []), {**note, "seq_len": seq_len, "reason": str(err).strip().splitlines()[0]}
    return sum(measured, []), None


def run(
    *,
    shape: Shape,
    max_len: int,
    vocabs: tuple[int, ...],
    memory_limit: int = MEMORY_LIMIT,
    time_limit: float = TIME_LIMIT,
    chunk: int | None = None,
) -> dict[str, Any]:
    """Every setting's rows, the lengths it stopped at, and the goals on the shape's vocabulary."""
    results, stopped = [], []
    for vocab in vocabs:
        for cp in (1, 2):
            for layout in shape.layouts:
                rows, note = _setting(shape, cp, layout, vocab, seq_lens(max_len), (memory_limit, time_limit), chunk)
                results += rows
                if note is not None:
                    stopped.append(note)
    return {"results": results, "stopped": stopped, "goals": goals(results, shape.vocab_size)}


def _worst(results: list[dict[str, Any]], key: str, **setting: Any) -> float | None:
    """The largest ``key`` over the ranks of one setting (None if it was not measured)."""
    values = [r[key] for r in results if all(r[k] == v for k, v in setting.items())]
    return max(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def _largest_shared(results: list[dict[str, Any]], vocab: int) -> int | None:
    """The largest T measured with equal rows at both cp = 1 and cp = 2."""
    lengths = [
        {r["seq_len"] for r in results if r["cp"] == cp and not r["padded"] and r["vocab_size"] == vocab}
        for cp in (1, 2)
    ]
    return max(lengths[0] & lengths[1], default=None)


def goals(results: list[dict[str, Any]], vocab: int) -> dict[str, dict[str, Any]]:
    """The page's goals on ``vocab``, each over the worst rank; a value is None when its settings
    were not measured. Both cp runs take the same tokens, so time per token is time."""
    largest = _largest_shared(results, vocab)

    def worst(key: str, cp: int, seq_len: int | None, padded: bool = False) -> float | None:
        return _worst(results, key, cp=cp, seq_len=seq_len, padded=padded, packed=False, vocab_size=vocab)

    values = {
        "growth_8k_to_16k": _ratio(worst("step_peak_bytes", 1, 16384), worst("step_peak_bytes", 1, 8192)),
        "cp2_over_cp1_memory_at_largest_T": _ratio(
            worst("step_peak_bytes", 2, largest), worst("step_peak_bytes", 1, largest)
        ),
        "cp2_over_cp1_time_per_token_at_largest_T": _ratio(
            worst("step_seconds", 2, largest), worst("step_seconds", 1, largest)
        ),
        "ragged_2x8k_step_peak_gb": _ratio(worst("step_peak_bytes", 1, 16384, padded=True), 1e9),
    }
    return {
        name: {
            "value": value,
            "goal": f"{GOALS[name][0]} {GOALS[name][1]:g}",
            "met": None if value is None else COMPARE[GOALS[name][0]](value, GOALS[name][1]),
            **({"seq_len": largest} if "largest" in name else {}),
        }
        for name, value in values.items()
    }
