"""The tool environment of docs/environments.md ("A complete tool environment"), as a user writes it."""

from asyncrl.environments.tool_env import ToolEnvironment

DICTIONARY = {"cat": ["a small carnivore", "a jazz musician"]}


def lookup(word: str, limit: int = 3) -> str:
    """Find the definitions of a word.

    Args:
        word: the word to look up
        limit: how many definitions at most
    """
    return "; ".join(DICTIONARY.get(word, ["unknown word"])[:limit])


class Dictionary(ToolEnvironment):
    """The prompt is the user's turn; the model may look words up before it answers."""

    functions = (lookup,)

    def reset(self, prompt):
        return [{"role": "user", "content": prompt.text}]


def undocumented(word: str) -> str:
    return word


class Undocumented(Dictionary):
    """A tool without the docstring its schema is made from: refused when the config is checked."""

    functions = (lookup, undocumented)
