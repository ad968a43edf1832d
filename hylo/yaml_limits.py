"""Bounds on the shape of a YAML document, checked on its parse events before anything is built from it
(a JSON file's depth is bounded the same, `hylo.json_files.loads_json`).

YAML aliases let a few hundred bytes stand for billions of nodes (nine anchors of nine aliases each: the
"billion laughs"), an alias inside its own anchor makes a cycle, and a deeply nested document overflows
PyYAML's recursive composer. `check_yaml_shape` walks the event stream once (no recursion, no expansion) and
refuses, with the line:
* nesting deeper than `MAX_DEPTH` levels (a config is a few levels deep);
* an alias inside the node it refers to (a recursive alias);
* aliases that together stand for more than `MAX_ALIAS_NODES` nodes, counted as they would expand (every
  reader of a config walks the expanded tree: the key -> line map, the dataclasses, the config hash).
A document without aliases is never limited by its size, only by its depth. The file it comes from is: a YAML
file is read only up to `MAX_YAML_BYTES`, and only when it is a regular file (`hylo.bounded_read`, through
`hylo.pipeline.config.read_yaml_file`, the one reader of a YAML file).
"""

from __future__ import annotations

from typing import Any

import yaml

# Bytes of a YAML file (a config, a cluster file) read at most; the shipped configs are under 16 KiB.
MAX_YAML_BYTES = 16 << 20
# Nesting levels (mappings and lists inside each other); the shipped configs use at most 5.
MAX_DEPTH = 64
# Nodes the aliases of one document may stand for in all, once expanded.
MAX_ALIAS_NODES = 10_000


class YamlShapeError(ValueError):
    """The document breaks one of the bounds above; `line` is 1-based (None when unknown)."""

    def __init__(self, reason: str, line: int | None) -> None:
        super().__init__(f"line {line}: {reason}" if line else reason)
        self.reason, self.line = reason, line


def check_yaml_shape(text: str, loader: type | None = None) -> None:
    """Raise YamlShapeError when `text` nests too deep or its aliases recurse or expand too far; a YAML
    syntax error is left to the caller's loader (it raises yaml.YAMLError here too, from the parser)."""
    # per open collection: [expanded nodes so far, its anchor]
    stack: list[list[Any]] = []
    sizes: dict[str, int] = {}
    open_anchors: set[str] = set()
    aliased = 0
    for event in yaml.parse(text, Loader=loader or yaml.SafeLoader):
        line = event.start_mark.line + 1 if event.start_mark is not None else None
        if isinstance(event, yaml.CollectionStartEvent):
            if len(stack) >= MAX_DEPTH:
                raise YamlShapeError(f"nested more than {MAX_DEPTH} levels deep", line)
            stack.append([0, event.anchor])
            if event.anchor is not None:
                open_anchors.add(event.anchor)
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            count, anchor = stack.pop()
            size = 1 + count
            if anchor is not None:
                sizes[anchor] = size
                open_anchors.discard(anchor)
        elif isinstance(event, yaml.ScalarEvent):
            size = 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.AliasEvent):
            if event.anchor in open_anchors:
                raise YamlShapeError(f"alias *{event.anchor} refers to a node that contains it (a recursive alias)", line)
            # an undefined alias is the composer's error, with its own message
            size = sizes.get(event.anchor, 1)
            aliased += size
            if aliased > MAX_ALIAS_NODES:
                raise YamlShapeError(f"the aliases expand to more than {MAX_ALIAS_NODES:,} nodes (at alias "
                                     f"*{event.anchor}); write the values out or use fewer aliases", line)
        else:
            continue
        if stack:
            stack[-1][0] += size

