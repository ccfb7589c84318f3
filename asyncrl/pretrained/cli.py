"""The ``asyncrl model`` commands: ``list`` shows the released models asyncrl can fetch, ``get``
fetches one (or takes a local GGUF file), converts it once into asyncrl's cache and prints the
model directory, so that ``asyncrl train model.path=$(asyncrl model get NAME)`` works. Progress
goes to stderr; stdout holds the directory alone. ``asyncrl.cli`` registers ``model_app``.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from asyncrl.config import ConfigError
from asyncrl.pretrained.gguf import GGUFError, convert, require_gguf
from asyncrl.pretrained.registry import RELEASES, FetchError, download, models_dir

model_app = typer.Typer(no_args_is_help=True, help="Fetch released pretrained models (docs/models.md).")


def _log(message: str) -> None:
    typer.echo(message, err=True)


@model_app.command("list")
def list_models() -> None:
    """The models `asyncrl model get NAME` fetches, with their packages, license and cache state."""
    table = Table(title=f"released models (cache: {models_dir()})")
    for column in ("name", "packages", "license", "notes", "cached"):
        table.add_column(column, overflow="fold")
    for name, release in RELEASES.items():
        cached = "yes" if (models_dir() / name).is_dir() else "no"
        table.add_row(name, "\n".join(release.packages), release.license, release.notes, cached)
    Console(width=160).print(table)


@model_app.command("get")
def get(name: str = typer.Argument(..., help="a name from `asyncrl model list`, or a local .gguf file")) -> None:
    """Print the model directory of NAME, fetching and converting it first unless it is cached."""
    try:
        typer.echo(str(_model_dir(name)))
    except (FetchError, GGUFError) as err:
        raise ConfigError(str(err)) from None


def _model_dir(name: str) -> Path:
    """The cached directory of a release or a local GGUF file, converted first when it is not there."""
    if name in RELEASES:
        return _release_dir(name)
    path = Path(name).expanduser()
    if not path.is_file():
        raise ConfigError(f"NAME: {name}: no such file, nor a released model ({', '.join(RELEASES)})")
    sha256 = _sha256(path)
    out_dir = models_dir() / f"{path.stem}-{sha256[:12]}"
    if not out_dir.is_dir():
        convert(path, out_dir, {"file": str(path.resolve()), "sha256": sha256}, _log)
    return out_dir


def _release_dir(name: str) -> Path:
    """``models/NAME`` in the cache: downloaded into a temporary directory and converted once."""
    out_dir = models_dir() / name
    if out_dir.is_dir():
        return out_dir
    require_gguf()  # before a download it could not convert
    release = RELEASES[name]
    with tempfile.TemporaryDirectory(prefix="asyncrl-model-") as tmp:
        gguf_file = download(name, Path(tmp), _log)
        source = {"release": name, "packages": list(release.packages), "license": release.license}
        convert(gguf_file, out_dir, {**source, "sha256": release.sha256}, _log)
    return out_dir


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
