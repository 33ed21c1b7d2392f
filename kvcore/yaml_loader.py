"""kvgate's one YAML reader: PyYAML's safe loader, refusing what no settings file means.

Every YAML file kvgate reads (gates.yaml, an engine's settings, workload specs, a run's config.yaml)
goes through `kvcore.settings.load_yaml_file`, which parses with `CheckedLoader`. Before anything is
built from the document, its nodes are walked once and the loader refuses:

- a key given twice in one mapping (PyYAML keeps the last without a word): the key's path and both lines;
- aliases that expand past `ALIAS_EXPANSION_LIMIT` values: a "billion laughs" document is small on disk
  and parses at once into shared nodes, but everything after (merging profiles, validating, copying)
  walks it expanded, for minutes and gigabytes;
- a recursive alias (a collection inside itself): it expands without end.

Merge keys stay (`<<: *base`, then a key beside it overrides the merged one, as YAML says); what a merged
mapping brings counts towards the expansion like any alias.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

ALIAS_EXPANSION_LIMIT = 10_000   # values aliases may add to a document: far above any settings file's own use
_MERGE_TAG = "tag:yaml.org,2002:merge"


class YamlRefused(ValueError):
    """The document is valid YAML that kvgate will not read; `loc` is the key path ((): the document)."""

    def __init__(self, loc: tuple, message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message


@dataclass
class _Walk:
    sizes: dict[int, int] = field(default_factory=dict)   # node id -> values in it, aliases expanded
    open: set[int] = field(default_factory=set)           # the collections being walked (a cycle meets one)
    added: int = 0                                        # values aliases added so far


class CheckedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that checks the composed document (duplicate keys, alias expansion, recursion)
    before constructing it."""

    def construct_document(self, node: Node):
        self._walk(node, (), _Walk())
        return super().construct_document(node)

    def _walk(self, node: Node, loc: tuple, walk: _Walk) -> int:
        """Values in `node` with its aliases expanded; raises YamlRefused on what the module refuses."""
        if id(node) in walk.sizes:  # a node met again is an alias of it
            walk.added += walk.sizes[id(node)]
            if walk.added > ALIAS_EXPANSION_LIMIT:
                raise YamlRefused((), f"expected YAML whose aliases expand to at most {ALIAS_EXPANSION_LIMIT:,} "
                                      f"values, found more (aliases of the anchor at line {_line(node)} bring them to "
                                      f"{walk.added:,})")
            return walk.sizes[id(node)]
        if id(node) in walk.open:
            raise YamlRefused((), f"expected YAML without a recursive alias, found one at line {_line(node)} "
                                  "(a collection inside itself)")
        walk.open.add(id(node))
        size = 1
        if isinstance(node, SequenceNode):
            size += sum(self._walk(item, (*loc, i), walk) for i, item in enumerate(node.value))
        elif isinstance(node, MappingNode):
            size += self._walk_mapping(node, loc, walk)
        walk.open.discard(id(node))
        walk.sizes[id(node)] = size
        return size

    def _walk_mapping(self, node: MappingNode, loc: tuple, walk: _Walk) -> int:
        size = 0
        lines: dict[object, int] = {}     # each key's line, to name both of a repeated key
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                size += self._walk(value_node, loc, walk)
                continue
            key = self.construct_object(key_node) if isinstance(key_node, ScalarNode) else None
            if key is not None and not isinstance(key, (list, dict)):
                if key in lines:
                    raise YamlRefused((*loc, key), f"expected each key once, found it at lines {lines[key]} and "
                                                   f"{_line(key_node)}")
                lines[key] = _line(key_node)
            size += 1 + self._walk(value_node, (*loc, key), walk)
        return size


def _line(node: Node) -> int:
    return node.start_mark.line + 1
