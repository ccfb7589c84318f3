"""The README's Python example runs as written."""

import re

from helpers import ROOT

README = ROOT / "README.md"


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no Python example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})


def test_readme_opens_with_the_install_and_test_commands():
    commands = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    assert commands[0].strip() == "pip install -e . torch==2.13.0 && asyncrl train"
    assert (
        commands[1].strip()
        == 'pip install -e ".[test]" torch==2.13.0 && ruff format --check && ruff check && lint-imports '
        "&& python -m pytest -n 2 --dist loadgroup"
    )
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1].strip() in ci
