"""YAML read as plain values plus the line of every value, so that a configuration error can say
where it is (`alerts.yaml:12: routes[0].channels[1]: ...`)."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import yaml

Path = tuple[str | int, ...]


class YamlError(ValueError):
    """The file is not valid YAML for a configuration (syntax, duplicate keys, non-string keys)."""


def load_file(
    path: str | os.PathLike[str], what: str, fix: str, error: type[ValueError]
) -> tuple[Any, dict[Path, int]]:
    """`load_with_lines` of the file at `path`; `error` naming it (as `what`, with `fix`) when it cannot
    be read, or the line when it is not YAML."""
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"{what} {path}: cannot read it ({exc.strerror}); {fix}") from None
    try:
        return load_with_lines(text, str(path))
    except YamlError as exc:
        raise error(str(exc)) from None


def located(source: str, lines: dict[Path, int], path: Path, problem: str) -> str:
    """`source:line: dotted.path[0]: problem`, at the line of `path` or of its nearest parent."""
    at, line = path, lines.get(path)
    while line is None and at:
        at = at[:-1]
        line = lines.get(at)
    name = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or "top level"
    return f"{source}:{line or 1}: {name}: {problem}"


def load_with_lines(text: str, source: str) -> tuple[Any, dict[Path, int]]:
    """The document's plain value (dicts, lists, scalars) and {path: 1-based line} of every node."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise YamlError(f"{where}: not valid YAML ({problem})") from None
    lines: dict[Path, int] = {}
    try:
        return (None if node is None else _plain(loader, node, (), lines, source)), lines
    finally:
        loader.dispose()


def _plain(loader: yaml.SafeLoader, node: yaml.Node, path: Path, lines: dict[Path, int], source: str) -> Any:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node) if isinstance(key_node, yaml.ScalarNode) else key_node
            if not isinstance(key, str):
                raise YamlError(f"{source}:{key_node.start_mark.line + 1}: keys must be names, got {key!r}")
            if key in out:
                raise YamlError(f"{source}:{key_node.start_mark.line + 1}: {key!r} is given twice")
            out[key] = _plain(loader, value_node, (*path, key), lines, source)
            lines[(*path, key)] = key_node.start_mark.line + 1  # errors point at the key's line
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_plain(loader, item, (*path, i), lines, source) for i, item in enumerate(node.value)]
    return loader.construct_object(
        node
    )  # a scalar, as the safe loader types it (int, float, bool, null, str)
