"""The ``asyncrl bench`` commands: each runs one benchmark, prints its JSON and writes
bench-results/<name>.json. ``asyncrl.cli`` registers ``bench_app`` as its ``bench`` sub-command;
the benchmarks themselves live beside this module and are imported only by the command that runs them.
"""

from __future__ import annotations

from pathlib import Path

import typer

from asyncrl.choices import choices
from asyncrl.config import ConfigError, load_config

bench_app = typer.Typer(
    no_args_is_help=True,
    help="Speed and overhead benchmarks: each prints JSON and writes bench-results/<name>.json.",
)
RuntimeChoice = choices("RuntimeChoice", ("local", "ray"))
OUTPUT_HELP = "where to write the JSON (default: bench-results/<name>.json in the working directory)"


@bench_app.command("overlap")
def bench_overlap(
    quick: bool = typer.Option(False, "--quick", help="a smoke run under a minute: small delays, few steps"),
    scale: float | None = typer.Option(None, "--scale", min=0.001, help="seconds per unit of g and t (default 0.5)"),
    steps: int | None = typer.Option(None, "--steps", min=1, help="measured steps per run (default 8)"),
    runtime: list[RuntimeChoice] | None = typer.Option(None, "--runtime", help="repeatable (default: local and ray)"),
    output: Path | None = typer.Option(None, "--output", help=OUTPUT_HELP),
) -> None:
    """Async step time against the ideal max(g, t), and against a synchronous loop (g + t)."""
    from asyncrl.bench import common, overlap

    settings = {
        "scale_s": scale or (0.05 if quick else 0.5),
        "steps": steps or (3 if quick else 8),
        "warmup": 1 if quick else 2,
        "runtimes": [r.value for r in runtime] if runtime else (["local"] if quick else ["local", "ray"]),
        "prompts_per_step": overlap.PROMPTS_PER_STEP,
        "generations_per_prompt": overlap.GROUP_SIZE,
        "shapes_g_t": overlap.SHAPES,
        "max_lags": overlap.LAGS,
    }
    rows = overlap.run(
        scale=settings["scale_s"],
        steps=settings["steps"],
        warmup=settings["warmup"],
        runtimes=tuple(settings["runtimes"]),
    )
    common.write_result("overlap", settings, rows, output)


@bench_app.command("controller")
def bench_controller(
    quick: bool = typer.Option(False, "--quick", help="a smoke run: fewer groups"),
    steps: int | None = typer.Option(None, "--steps", min=1, help="steps of 8 groups (default 1000)"),
    top: int = typer.Option(15, "--top", min=1, help="profile rows to report"),
    output: Path | None = typer.Option(None, "--output", help=OUTPUT_HELP),
) -> None:
    """Controller time per group with no-op workers, and its top costs under cProfile."""
    from asyncrl.bench import common, controller_overhead

    settings = {"steps": steps or (50 if quick else 1000), "prompts_per_step": 8, "max_lag": 1, "top": top}
    result = controller_overhead.run(steps=settings["steps"], top=top)
    common.write_result("controller", settings, result, output)


@bench_app.command("weight-sync")
def bench_weight_sync(
    quick: bool = typer.Option(False, "--quick", help="a smoke run: the 1M model only"),
    repeats: int = typer.Option(5, "--repeats", min=1, help="syncs per model (the best one counts)"),
    runtime: list[RuntimeChoice] | None = typer.Option(None, "--runtime", help="repeatable (default: local and ray)"),
    output: Path | None = typer.Option(None, "--output", help=OUTPUT_HELP),
) -> None:
    """Bytes/s of a full weight sync against torch memcpy bandwidth, for ~1M, 10M and 100M parameters."""
    from asyncrl.bench import common, weight_sync

    settings = {
        "models": ["1M"] if quick else list(weight_sync.MODELS),
        "repeats": 2 if quick else repeats,
        "runtimes": [r.value for r in runtime] if runtime else (["local"] if quick else ["local", "ray"]),
    }
    rows = weight_sync.run(
        models=tuple(settings["models"]), repeats=settings["repeats"], runtimes=tuple(settings["runtimes"])
    )
    common.write_result("weight-sync", settings, rows, output)


@bench_app.command("backends")
def bench_backends(
    quick: bool = typer.Option(False, "--quick", help="a smoke run: fewer requests, updates and steps"),
    output: Path | None = typer.Option(None, "--output", help=OUTPUT_HELP),
) -> None:
    """The transformers and vLLM backends on one model: tokens/s (short and long responses), sync s, step s."""
    from asyncrl.bench import backends, common

    settings = {
        "requests": 16 if quick else 128,
        "updates": 3 if quick else 10,
        "train_steps": 5 if quick else 30,
        "max_new_tokens": backends.SETTINGS,
    }
    rows = backends.run(requests=settings["requests"], updates=settings["updates"], train_steps=settings["train_steps"])
    common.write_result("backends", settings, rows, output)


@bench_app.command("memory")
def bench_memory(
    quick: bool = typer.Option(False, "--quick", help="a smoke run: the 16M model"),
    updates: int = typer.Option(4, "--updates", min=2, max=8, help="K: mini-batch updates of the measured step"),
    output: Path | None = typer.Option(None, "--output", help=OUTPUT_HELP),
) -> None:
    """Peak RSS of a step of K mini-batch updates against one update, on a ~100M-parameter model."""
    from asyncrl.bench import common, memory

    settings = {"models": ["16M"] if quick else ["100M"], "updates": updates}
    rows = memory.run(models=tuple(settings["models"]), updates=updates)
    common.write_result("memory", settings, rows, output)


@bench_app.command("long-context")
def bench_long_context(
    quick: bool = typer.Option(
        False, "--quick", help="a smoke run: T = 256, a 4,096-token vocabulary, 4 blocks at most"
    ),
    shape: str = typer.Option(
        "tiny", "--shape", help="the model: tiny (Qwen2 layout, 4 layers, V = 151,936) or smollm2 (SmolLM2-135M's)"
    ),
    max_len: int = typer.Option(32768, "--max-len", min=16, help="the largest T (tokens of the step's two rows)"),
    vocab: list[int] | None = typer.Option(
        None, "--vocab", min=64, help="vocabulary sizes to measure (repeatable; default and goals: the shape's)"
    ),
    output: Path | None = typer.Option(
        None, "--output", help="where to write the JSON (default: bench-results/long-context[-<shape>].json)"
    ),
) -> None:
    """Per-rank peak memory growth and time of one train step for T = 1k to 32k tokens, cp = 1 and 2
    (float32, CPU gloo ranks): equal, ragged and packed rows on the tiny shape, equal rows on smollm2."""
    from asyncrl.bench import common, long_context

    if shape not in long_context.SHAPES:
        raise typer.BadParameter(f"'{shape}' is not one of {', '.join(long_context.SHAPES)}", param_hint="--shape")
    chosen = long_context.SHAPES[shape]
    vocab = vocab or [chosen.vocab_size]
    if quick:
        chosen, max_len, vocab = chosen.quick(), long_context.QUICK_SEQ_LEN, [long_context.QUICK_VOCAB]
    settings = {
        "shape": shape,
        "max_len": max_len,
        "vocab_sizes": vocab,
        "model": chosen.model,
        "cores": long_context.CORES,
        "memory_limit_bytes": long_context.MEMORY_LIMIT,
        "time_limit_s": long_context.TIME_LIMIT,
    }
    measured = long_context.run(shape=chosen, max_len=max_len, vocabs=tuple(vocab))
    common.write_result(chosen.result, settings, measured.pop("results"), output, **measured)


@bench_app.command("lora")
def bench_lora(
    quick: bool = typer.Option(False, "--quick", help="a smoke run: a small model"),
    output: Path | None = typer.Option(None, "--output", help=OUTPUT_HELP),
) -> None:
    """LoRA rank 16 against full fine-tuning on a Qwen2.5-0.5B-shaped model (float32, CPU): peak RSS,
    step time (generation, training, sync), bytes and seconds of a sync, checkpoint size."""
    from asyncrl.bench import common, lora

    workload = lora.QUICK if quick else lora.FULL
    common.write_result("lora", lora.settings(workload), lora.run(workload), output)


@bench_app.command("roofline")
def bench_roofline(
    quick: bool = typer.Option(False, "--quick", help="a smoke run: a tiny random model, a few tokens, no vLLM"),
    output: Path | None = typer.Option(None, "--output", help=OUTPUT_HELP),
) -> None:
    """Train step (full and LoRA) and generation (HF, vLLM: prefill and decode) FLOP/s as fractions of
    this CPU's float32 matmul FLOP/s, on SmolLM2-135M-Instruct (or its shape)."""
    from asyncrl.bench import common, roofline

    workload = roofline.QUICK if quick else roofline.FULL
    result = roofline.run(workload, cached_model=not quick)
    common.write_result("roofline", roofline.settings(workload), result, output)


@bench_app.command("e2e")
def bench_e2e(
    quick: bool = typer.Option(False, "--quick", help="a smoke run: a tiny model, a few steps, one seed"),
    seeds: int = typer.Option(3, "--seeds", min=1, help="runs per setting"),
    max_steps: int | None = typer.Option(None, "--max-steps", min=1, help="steps per run (default 400)"),
    eval_every: int | None = typer.Option(None, "--eval-every", min=1, help="evaluation cadence (default 25)"),
    target: float = typer.Option(0.8, "--target", min=0.0, max=1.0, help="held-out accuracy to reach"),
    against: str | None = typer.Option(
        None, "--against", help="also train the peer baseline: trl (trl-async is refused: it needs CUDA GPUs)"
    ),
    variants: bool = typer.Option(
        False, "--variants", help="also max_lag 1 with 4 mini-batch updates per step, and with dynamic sampling"
    ),
    lags: str = typer.Option("0,1,2", "--lags", help="the max_lag settings to train, comma-separated"),
    timing_seeds: int = typer.Option(
        0, "--timing-seeds", min=0, help="also profile short runs of every setting over this many seeds"
    ),
    timing_steps: int = typer.Option(4, "--timing-steps", min=1, help="steps per profiled run"),
    config: Path | None = typer.Option(
        None, "--config", help="YAML run config every run starts from (default: the embedded one)"
    ),
    metric: str = typer.Option(
        "accuracy", "--metric", help="the held-out metric the target is on: accuracy or reward_mean"
    ),
    output: Path | None = typer.Option(
        None, "--output", help="where to write the JSON (default: bench-results/e2e[-trl][-<config name>].json)"
    ),
    overrides: list[str] | None = typer.Argument(None, help="config overrides applied to every run"),
) -> None:
    """Wall time to a held-out accuracy (or --metric) for max_lag 0, 1 and 2 (and TRL with --against trl)."""
    lag_values = _lags(lags)
    _require_baseline(against)
    from asyncrl.bench import common, e2e

    if metric not in e2e.METRICS:
        raise typer.BadParameter(f"'{metric}' is not one of {', '.join(e2e.METRICS)}", param_hint="--metric")
    settings = e2e.settings(
        config=config,
        metric=metric,
        overrides=list(overrides or ()),
        quick=quick,
        seeds=seeds,
        max_steps=max_steps,
        eval_every=eval_every,
        target=target,
        against=against,
        variants=variants,
        lags=lag_values,
        timing_seeds=timing_seeds,
        timing_steps=timing_steps,
    )
    base = load_config(config, settings["overrides"])  # a bad file or override fails here, before any run
    if against == "trl" and base.environment.name is not None:
        from asyncrl.bench.trl_environment import require_tool_environment

        require_tool_environment(base)
    result = e2e.run_settings(settings, config)
    name = "-".join(["e2e", *(["trl"] if against else []), *([config.stem] if config is not None else [])])
    common.write_result(name, settings, result, output)


@bench_app.command("integrity")
def bench_integrity(
    quick: bool = typer.Option(False, "--quick", help="a smoke run: a tiny model, 3 steps, one pair"),
    pairs: int = typer.Option(3, "--pairs", min=1, help="pairs of runs, guard on and off (the median pair counts)"),
    steps: int | None = typer.Option(None, "--steps", min=2, help="steps per run (default 20)"),
    config: Path | None = typer.Option(
        None, "--config", help="YAML run config every run starts from (default: the embedded one)"
    ),
    output: Path | None = typer.Option(None, "--output", help=OUTPUT_HELP),
    overrides: list[str] | None = typer.Argument(None, help="config overrides applied to every run"),
) -> None:
    """Step time with the integrity guard over step time without it, in one bench run."""
    from asyncrl.bench import common, integrity

    settings = integrity.settings(config=config, overrides=list(overrides or ()), quick=quick, pairs=pairs, steps=steps)
    load_config(config, settings["overrides"])  # a bad file or override fails here, before any run
    common.write_result("integrity", settings, integrity.run(settings, config), output)


def _lags(lags: str) -> tuple[int, ...]:
    """``--lags`` as sorted, distinct max_lag values."""
    try:
        values = tuple(sorted({int(lag) for lag in lags.split(",")}))
    except ValueError:
        raise typer.BadParameter(f"'{lags}' is not a comma-separated list of integers", param_hint="--lags") from None
    if any(lag < 0 for lag in values):
        raise typer.BadParameter("a max_lag is 0 or more", param_hint="--lags")
    return values


def _require_baseline(against: str | None) -> None:
    """``--against``: a known baseline whose package is installed, refused where it cannot run."""
    if against not in (None, "trl", "trl-async"):
        raise typer.BadParameter(f"unknown baseline '{against}'; the one available is trl", param_hint="--against")
    if against == "trl-async":
        from asyncrl.bench.trl_baseline import refuse_trl_async

        refuse_trl_async()
    if against == "trl":
        from asyncrl.bench.trl_baseline import require_trl

        require_trl()


@bench_app.command("gpu")
def bench_gpu(
    peak_tflops: float | None = typer.Option(
        None, "--peak-tflops", min=0.001, help="the GPU's dense bf16 peak in TFLOP/s (default: looked up by name)"
    ),
    output: Path | None = typer.Option(None, "--output", help=OUTPUT_HELP),
) -> None:
    """On one CUDA GPU: bf16 train steps of a Qwen2.5-0.5B-shaped model (tokens/s, MFU), weight export and
    load GB/s, FSDP2 on one rank, and the vLLM backend when its environment exists."""
    import torch

    if not torch.cuda.is_available():
        typer.echo("skipped: no CUDA GPU")
        return
    from asyncrl.bench import common, gpu

    common.write_result("gpu", gpu.settings(gpu.QWEN25_05B), gpu.run(peak=peak_tflops), output)


@bench_app.command("report")
def bench_report(
    results_dir: Path | None = typer.Option(
        None, "--results-dir", help="default: bench-results in the working directory"
    ),
    write: Path | None = typer.Option(None, "--write", help="replace the generated tables in this page"),
) -> None:
    """The results as Markdown tables; with --write, into docs/performance.md's generated section."""
    from asyncrl.bench import common, report

    directory = results_dir or common.RESULTS_DIR
    if write is None:
        typer.echo(report.render(directory), nl=False)
        return
    try:
        report.write(write, directory)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"--write: {err}") from None
    typer.echo(str(write))
