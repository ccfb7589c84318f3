"""A tool environment whose tool module fails to import in a tool process, as one whose module
needs a package or a file that only the run's own process has.

A tool process runs ``python -c ...`` and imports no pytest (a pytest-xdist worker, also started as
``python -c ...``, has); anywhere else (the run's own process) the module imports at once. ``AlwaysCalls`` reads every turn as a call of ``echo``, so that even an untrained model makes one.
"""

import sys

from asyncrl.environments.parsers import ParsedTurn
from asyncrl.environments.tool_env import ToolEnvironment

if sys.argv[0] == "-c" and "pytest" not in sys.modules:
    raise ImportError("a dependency of this tool is missing here")


def echo(text: str) -> str:
    """Repeat the text.

    Args:
        text: any text
    """
    return text


class AlwaysCalls:
    def parse(self, text: str) -> ParsedTurn:
        call = {"type": "function", "function": {"name": "echo", "arguments": {"text": text}}}
        return ParsedTurn({"role": "assistant", "content": "", "tool_calls": [call]})


class EchoEnvironment(ToolEnvironment):
    functions = (echo,)

    def reset(self, prompt):
        return [{"role": "user", "content": prompt.text}]
