"""The text a config comes in: YAML files and dotted `--set section.key=value` items, read into plain dicts.

What goes wrong here is one `ConfigError` line (the error every config problem raises,
defined here because this is where the first ones are found; nsa_jax/config.py exports
it): a YAML syntax error names the file, line and column (`read_yaml`), an override that
is not `section.key=value` says so (`parse_override`). Which keys and values are valid is
the schema's (config.py), which names the nearest valid key of an unknown one (`closest`).
No jax.
"""

from __future__ import annotations

import difflib
import pathlib
import re
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config problem, phrased as one line that names the key and how to fix it."""


class _Loader(yaml.SafeLoader):
    """YAML 1.1 without its base-60 numbers: `10:12` (logging.profile_steps' A:B) stays the text it is,
    not the integer 612."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    """A YAML document as plain data, base-60 numbers read as text (_Loader)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader


def read_yaml(path: pathlib.Path) -> Any:
    """The YAML document in `path` ({} when empty); ConfigError naming the line and column of a syntax error."""
    try:
        return load_yaml(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config: {yaml_error_line(path, e)}; fix the file") from None


def yaml_error_line(path: pathlib.Path, e: yaml.YAMLError) -> str:
    """`FILE line L, column C: not valid YAML: <problem> (<context> at line L', column C')`: PyYAML's
    several-line message as one line, positions counted from 1."""
    mark = getattr(e, "problem_mark", None)
    if mark is None:
        first = str(e).splitlines()[0] if str(e) else "parse error"
        return f"{path} is not valid YAML ({first})"
    where = f"{path} line {mark.line + 1}, column {mark.column + 1}"
    context, at = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and at is not None and (at.line, at.column) != (mark.line, mark.column):
        context = f" ({context} at line {at.line + 1}, column {at.column + 1})"
    else:
        context = f" ({context})" if context else ""
    return f"{where}: not valid YAML: {getattr(e, 'problem', None) or 'parse error'}{context}"


def parse_override(item: str) -> tuple[list[str], Any]:
    """`model.n_layers=2` -> (['model', 'n_layers'], 2); values are read as YAML scalars."""
    if "=" not in item:
        raise ConfigError(f"config: override '{item}' must look like section.key=value (e.g. model.n_layers=2)")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if len(path) < 2:
        raise ConfigError(f"config: override key '{key}' must name a section and a key, e.g. train.steps=100")
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"config: override '{item}': '{part}' is not a section")
            node = child
        node[path[-1]] = value
    return data


def closest(name: str, names: list[str]) -> str | None:
    """The entry of `names` spelled most like `name` (difflib's ratio 0.6 or more), or None."""
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return close[0] if close else None
