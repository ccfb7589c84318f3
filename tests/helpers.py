"""What many test files share: the small run, the one-line-error check, synthetic trainer inputs,
and the process probes that tell whether Ray or vLLM servers outlived their tests.

Every test folder imports it as ``from helpers import ...`` (``tests/`` is on ``pythonpath`` in
pyproject.toml). It holds no tests and no fixtures (fixtures live in ``tests/conftest.py``).
"""

import importlib
import os
import random
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.metrics import read_jsonl, strip_timing
from asyncrl.models import build_char_tokenizer
from asyncrl.types import Rollout, RolloutGroup

SMALL = [  # the small arithmetic task: short answers, so 4 new tokens complete them
    "data.task.name=arithmetic",
    "data.task.options.difficulty=1",
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.intermediate_size=64",
    "step.prompts_per_step=4",
    "step.generations_per_prompt=4",
    "step.max_steps=4",
    "generation.max_new_tokens=4",
    "generation.batch_size=8",
    "trainer.micro_batch_size=6",
    "trainer.lr=0.01",
    "trainer.lr_schedule=constant",  # a resumed run may then extend max_steps and still match exactly
    "data.eval_size=8",
    "warm_start.steps=0",
    "logging.eval_every_steps=2",
    "logging.tensorboard=false",
    "logging.progress=false",
]


def run(tmp_path, name, *overrides, resume=None):
    """A SMALL run in ``tmp_path / name`` on the local runtime: (summary, metrics, groups)."""
    from asyncrl.run import train  # heavy (models, generation): only the files that run import it

    config = load_config(None, [*SMALL, f"logging.output_dir={tmp_path / name}", *overrides])
    summary = train(config, resume=resume)
    return summary, read_jsonl(tmp_path / name / "metrics.jsonl"), read_jsonl(tmp_path / name / "groups.jsonl")


def deterministic(records):
    """Metric records without their timings: what two equal runs must agree on exactly."""
    return [strip_timing(r) for r in records]


def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, source: str):
    """``source`` written as the module ``name`` in a folder of its own on ``sys.path``, and
    imported fresh: a user's parts as a run would load them."""
    folder = tmp_path / "parts"
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)


def error(capsys, *argv) -> str:
    """The one-line message of a command that must fail with exit code 2, without ``error: ``."""
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert "Traceback" not in captured.err + captured.out
    return captured.err.removeprefix("error: ").rstrip("\n")


TOKENIZER = build_char_tokenizer()


def make_groups(seed: int, count: int = 5, n: int = 4, version: int = 0) -> list[RolloutGroup]:
    """``count`` random groups of ``n`` rollouts over the char tokenizer, half with a reward error."""
    rng = random.Random(seed)
    groups = []
    for g in range(count):
        prompt = [rng.randrange(3, len(TOKENIZER)) for _ in range(rng.randint(2, 5))]
        rollouts = []
        for _ in range(n):
            response = [rng.randrange(3, len(TOKENIZER)) for _ in range(rng.randint(1, 6))]
            rollouts.append(
                Rollout(prompt, response, [-rng.random() for _ in response], "stop", reward=float(rng.random() < 0.5))
            )
        group = RolloutGroup.from_rollouts(
            f"p{seed}-{g}", rollouts, pad_id=0, start_version=version, target_step=version
        )
        groups.append(RolloutGroup(**{**group.__dict__, "correct": group.rewards.clone(), "reward_errors": g % 2}))
    return groups


def updates_of(trainer, batch, fail_after: int | None = None):
    """One step of three mini-batch updates; ``fail_after`` updates, the step fails and aborts."""
    trainer.begin_train_step()
    for index, part in enumerate(batch.split([4, 4, 4])):
        if index == fail_after:
            trainer.abort_train_step()
            return
        trainer.train_microbatch(part)
        if index < 2:
            trainer.finish_update()
    trainer.finish_train_step()


NO_CUDA = "needs a CUDA GPU (marked gpu), and torch.cuda.is_available() is False here"


def skip_gpu_tests(items: list, cuda_available: Callable[[], bool]) -> None:
    """Skip every collected test marked ``gpu``, saying why, unless CUDA is available; CUDA is
    asked about only when such a test was collected (tests/conftest.py calls this)."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu and not cuda_available():
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


TESTS = Path(__file__).resolve().parent  # on the path of every test run and of the processes they start
ROOT = TESTS.parent
RAY_SERVERS = ("raylet", "gcs_server")


# tests/conftest.py sets this in each pytest process's environment, so every process a test starts
# (Ray's servers, a vLLM server and its engine) inherits it. The probes below count only processes
# that carry the session's value: parallel pytest workers, or other runs on the machine, each see
# their own.
SESSION_VARIABLE = "ASYNCRL_TEST_SESSION"


def _processes() -> list[Path]:
    """This session's processes: those whose environment holds this session's value."""
    session = f"{SESSION_VARIABLE}={os.environ[SESSION_VARIABLE]}".encode()
    entries = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if session in (entry / "environ").read_bytes().split(b"\0"):
                entries.append(entry)
        except OSError:  # the process ended while we looked, or is another user's
            pass
    return entries


def ray_server_processes() -> set[int]:
    """Process ids of the Ray server processes (raylet, gcs_server) this test session started."""
    pids = set()
    for entry in _processes():
        try:
            if (entry / "comm").read_text().strip() in RAY_SERVERS:
                pids.add(int(entry.name))
        except OSError:  # the process ended while we looked
            pass
    return pids


def _command_lines() -> dict[int, str]:
    lines = {}
    for entry in _processes():
        try:
            lines[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:  # the process ended while we looked
            pass
    return lines


def dashboard_command_lines() -> list[list[str]]:
    """The command lines of the Ray dashboard processes this test session started."""
    argvs = [line.split("\0") for line in _command_lines().values()]
    return [argv for argv in argvs if any(arg.endswith("dashboard/dashboard.py") for arg in argv)]


def vllm_processes() -> set[int]:
    """Process ids of the vLLM servers this test session started, and of their engine and worker processes."""
    return {pid for pid, line in _command_lines().items() if "vllm_server.py" in line or line.startswith("VLLM::")}


def wait_for_exit(find, timeout_s: float = 20.0) -> set[int]:
    """What ``find()`` still returns after up to ``timeout_s`` (servers take a moment to exit)."""
    deadline = time.monotonic() + timeout_s
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def wait_until_gone(pids: set[int], timeout_s: float = 20.0) -> set[int]:
    """Those of ``pids`` still running after up to ``timeout_s``."""
    return wait_for_exit(lambda: pids & ray_server_processes(), timeout_s)


def window_rise(rows: list[dict], key: str, window: int) -> float:
    """The mean of ``key`` over the last ``window`` rows of metrics.jsonl minus its mean over the
    first ``window``: a rise over every sampled episode of those steps, which a learning test can
    assert with a margin where a held-out evaluation of a hundred prompts swings by a tenth."""
    if len(rows) < 2 * window:
        raise ValueError(f"window_rise: {len(rows)} rows, fewer than two windows of {window}")
    first = sum(row[key] for row in rows[:window]) / window
    last = sum(row[key] for row in rows[-window:]) / window
    return last - first
