"""docs/metrics.md documents exactly the keys a run writes: every key of metrics.jsonl, eval.jsonl,
groups.jsonl and summary.json has a row in that file's table, and every row is written."""

import json
import re

import pytest
from helpers import ROOT, run

DOC = ROOT / "docs" / "metrics.md"


def documented_keys(file_name: str) -> set[str]:
    """The backticked names in the first column of the tables under the `## ... (`file_name`)` heading."""
    section = re.search(rf"^## [^\n]*\(`{re.escape(file_name)}`\)\n(.*?)(?=^## |\Z)", DOC.read_text(), re.M | re.S)
    assert section, f"docs/metrics.md has no section for {file_name}"
    first_cells = re.findall(r"^\| ([^|\n]+) \|", section.group(1), re.M)
    return {name for cell in first_cells for name in re.findall(r"`([^`]+)`", cell)}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One step of the small run, with every conditional key on: `kl` (a reference model) and `entropy`."""
    tmp_path = tmp_path_factory.mktemp("metrics")
    run(
        tmp_path,
        "run",
        "step.max_steps=1",
        "data.eval_size=2",
        "algorithm.options.kl_coef=0.01",
        "trainer.track_entropy=true",
    )
    return tmp_path / "run"


@pytest.mark.parametrize("file_name", ["metrics.jsonl", "eval.jsonl", "groups.jsonl"])
def test_every_key_of_a_record_file_is_documented_and_every_documented_key_is_written(run_dir, file_name):
    lines = (run_dir / file_name).read_text().splitlines()
    assert lines
    written = {key for line in lines for key in json.loads(line)}
    assert written == documented_keys(file_name)


def test_every_key_of_the_summary_is_documented_and_every_documented_key_is_written(run_dir):
    written = set(json.loads((run_dir / "summary.json").read_text()))
    assert written == documented_keys("summary.json")
