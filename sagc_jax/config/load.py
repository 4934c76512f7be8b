"""A config built from YAML and ``--set`` overrides, every error one line naming the file
(and line), the key, the bad value and what is allowed; :func:`to_dict` / :func:`from_dict`."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from sagc_jax.config.base import ConfigError
from sagc_jax.config.sections import Config


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Convert a YAML value to the field type ``tp`` or raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError:
                pass
    elif origin is tuple:
        (item_tp, _) = typing.get_args(tp)
        if isinstance(value, list | tuple):
            return tuple(_coerce(key, v, item_tp) for v in value)
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 4e-5 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict:  # a mapping of named values (data.rg_config)
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return dict(value)
    raise ConfigError(f"{key} = {value!r} has the wrong type; expected {type_name(tp)}")


def _closest(name: str, allowed: list[str]) -> str:
    match = difflib.get_close_matches(name, allowed, n=1, cutoff=0.5)
    hint = f"did you mean '{match[0]}'? " if match else ""
    return f"{hint}allowed keys: {', '.join(allowed)}"


# Keys that moved (old -> new): a file or --set that still uses one fails naming the new key,
# rather than being read as the new key without a word.
MOVED_KEYS = {
    "controller.sagc.candidates": "controller.candidates",
    "controller.sagc.delta": "controller.delta",
    "controller.sagc.tau": "controller.tau",
    "controller.sagc.scope": "controller.scope",
    "controller.sagc.g_init": "controller.g_init",
    "controller.sagc.gamma": "controller.sagc.posterior_gamma",
    "controller.sagc_plus.gamma": "controller.sagc_plus.trial_gamma",
    "controller.hybrid.rollout_budget": "controller.hybrid.rows_per_step",
}


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the config"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping of keys, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        if name not in fields:
            if f"{prefix}{name}" in MOVED_KEYS:
                raise ConfigError(f"{prefix}{name} moved to {MOVED_KEYS[f'{prefix}{name}']}")
            allowed = sorted(fields)
            raise ConfigError(f"unknown key '{prefix}{name}'; {_closest(str(name), allowed)}")
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(f"{prefix}{name}", value, tp)
    return cls(**kwargs)


def from_dict(data: dict, cls: type = Config) -> Any:
    """Build a validated config dataclass from nested plain data."""
    return _build(cls, data, getattr(cls, "_prefix", ""))


def to_dict(cfg: Any) -> dict:
    """Nested plain data (tuples as lists) that :func:`from_dict` turns back into ``cfg``."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def _key_lines(text: str) -> dict[str, int]:
    """Map every dotted key of a YAML mapping to its 1-based line number."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = f"{prefix}{key_node.value}"
                lines[key] = key_node.start_mark.line + 1
                walk(value_node, key + ".")

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        walk(root, "")
    return lines


def set_dotted(
    data: dict, dotted: str, value: Any, origin: str, lines: dict[str, int] | None = None
) -> None:
    """Set ``data[a][b][c] = value`` for ``dotted`` 'a.b.c'. A prefix that holds a value, not a
    mapping, is blamed on ``origin`` (the ``--set``), or, when ``lines`` has it, on the file
    line that gave it that value (``lines``: dotted key -> line; '' -> the file's name)."""
    parts = dotted.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            prefix = ".".join(parts[: i + 1])
            if lines and prefix in lines:
                raise ConfigError(
                    f"{lines['']}:{lines[prefix]}: {prefix} = {child!r} must be a mapping of keys"
                )
            raise ConfigError(f"{origin}: '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``section.key=value``; the value is parsed as a YAML scalar or flow list."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"--set {text!r}: cannot parse the value ({err.problem})") from None
    return key, value


def load_config(
    path: str | Path | None = None,
    overrides: typing.Sequence[str] = (),
    check: typing.Callable[[Config], None] | None = None,
) -> Config:
    """Load ``path`` (YAML; None for all defaults), apply ``--set`` overrides, validate.

    ``check``: a further check of the config (``planning.choices.check_names``: the keys that
    name a kind, against their tables), its errors located like the others. Raises ConfigError
    with a one-line message that starts with the file (and line) or the ``--set`` argument
    responsible.
    """
    data: dict = {}
    lines: dict[str, int] = {}
    origin = "defaults"
    if path is not None:
        path = Path(path)
        origin = str(path)
        try:
            raw = path.read_bytes()
        except OSError as err:
            raise ConfigError(f"{path}: cannot read the config file ({err.strerror})") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            line = raw.count(b"\n", 0, err.start) + 1
            raise ConfigError(
                f"{path}:{line}: not UTF-8 text (byte {err.start + 1} of the file); save the "
                "config as UTF-8"
            ) from None
        try:
            loaded = yaml.safe_load(text)
            lines = _key_lines(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            at = f":{mark.line + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"{path}{at}: not valid YAML ({problem})") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        data = loaded or {}
    set_keys = {}
    from_file = {**lines, "": origin}  # keys a --set has not replaced: blamed on the file
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(data, key, value, f"--set {text}", from_file)
        set_keys[key] = text
        from_file = {k: v for k, v in from_file.items() if k != key and not k.startswith(key + ".")}
    try:
        cfg = from_dict(data)
        if check is not None:
            check(cfg)
        return cfg
    except ConfigError as err:
        raise ConfigError(_locate(str(err), origin, lines, set_keys)) from None


def _locate(message: str, origin: str, lines: dict[str, int], set_keys: dict[str, str]) -> str:
    """Prefix an error with where the offending key came from (``--set`` or file:line)."""
    key = message.split(" ", 1)[0]
    if message.startswith("unknown key '"):
        key = message.split("'")[1]
    for candidate in (key, key.rsplit(".", 1)[0]):
        if candidate in set_keys:
            return f"--set {set_keys[candidate]}: {message}"
        if candidate in lines:
            return f"{origin}:{lines[candidate]}: {message}"
    for dotted, text in set_keys.items():  # an unknown section: --set trian.steps=3
        if dotted.startswith(f"{key}."):
            return f"--set {text}: {message}"
    return f"{origin}: {message}"
