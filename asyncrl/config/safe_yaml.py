"""YAML as a run config may be written: ``yaml.safe_load``, plus a key given twice is an error and
a document whose aliases would expand past ``MAX_YAML_VALUES`` values is refused before it is built."""

from __future__ import annotations

from typing import Any

import yaml

MAX_YAML_VALUES = 100_000  # values a YAML document may expand to through aliases; a run config has a few hundred


class StrictLoader(yaml.SafeLoader):
    """``yaml.safe_load``, except that a key given twice in one mapping is an error: YAML would
    silently keep the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key '{key}' is given twice", key_node.start_mark
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


class TooLarge(Exception):
    """A YAML document that would expand past ``MAX_YAML_VALUES`` values, or into itself."""


def load_yaml(text: str) -> Any:
    """``yaml.load`` with ``StrictLoader``, refusing (``TooLarge``) a document whose aliases would
    expand it past ``MAX_YAML_VALUES`` values, before anything is built from it."""
    loader = StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _count_values(node, {}, set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _count_values(node: yaml.Node, counted: dict[int, int], open_nodes: set[int]) -> int:
    """Values in ``node`` once every alias is expanded; an alias reuses the node it names, so a
    node is counted once and ``counted`` keeps the work linear in the document's size."""
    key = id(node)
    if key in counted:
        return counted[key]
    if key in open_nodes:
        raise TooLarge("an alias refers to a value that contains it")
    open_nodes.add(key)
    children = node.value if isinstance(node.value, list) else []
    total = 1
    for child in children:
        for item in child if isinstance(child, tuple) else (child,):
            total += _count_values(item, counted, open_nodes)
            if total > MAX_YAML_VALUES:
                raise TooLarge(f"its aliases expand it past {MAX_YAML_VALUES} values")
    open_nodes.discard(key)
    counted[key] = total
    return total
