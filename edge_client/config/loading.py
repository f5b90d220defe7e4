"""Loading a config: TOML tables, environment variables and CLI flags into frozen dataclasses.

Precedence, lowest first: dataclass defaults, the role's TOML table, environment
variables ``SAFL_<ROLE>_<KEY>``, then explicit overrides (CLI flags).  Unknown
keys and wrong types are refused with a :class:`ConfigError` naming the key;
range checks live in each config's ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (JetPack 6)
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

from ..errors import ConfigError
from ..messages import ID_PATTERN, is_id

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["load_config", "read_toml", "from_mapping", "check_range", "check_id", "toml_text"]

C = TypeVar("C")


def check_range(key: str, value: float, low: float | None = None, high: float | None = None,
                *, low_open: bool = False) -> None:
    """Raise a ConfigError naming ``key`` unless ``low <= value <= high``."""
    if low is not None and (value <= low if low_open else value < low):
        raise ConfigError(key, f"must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise ConfigError(key, f"must be <= {high}, got {value!r}")


def check_id(key: str, value: str) -> None:
    """Ids become MQTT topic levels: the one pattern messages check too (no '/', '+', '#')."""
    if not is_id(value):
        raise ConfigError(key, f"must be an id matching {ID_PATTERN.pattern} (letters, digits, "
                          f"'_', '.', ':', '-'; no '/', '+' or '#'), got {value!r}")


def _coerce(key: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # the first form the value takes
        for option in typing.get_args(hint):
            try:
                return _coerce(key, value, option)
            except ConfigError:
                pass
        raise ConfigError(key, f"expected {' or '.join(a.__name__ for a in typing.get_args(hint))}"
                          f", got {value!r}")
    if hint is bool:
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "0", "false", "no"):
            return value.lower() in ("1", "true", "yes")
        if isinstance(value, bool):
            return value
    elif hint in (int, float):
        # TOML gives 1 for a float key; env and CLI give strings. An int key refuses 1.5.
        numeric = hint is float and isinstance(value, int) or isinstance(value, hint)
        if numeric and not isinstance(value, bool):
            return hint(value)
        if isinstance(value, str):
            try:
                return hint(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if isinstance(items, (list, tuple)):
            inner = typing.get_args(hint)[0]
            return tuple(_coerce(key, v.strip() if isinstance(v, str) else v, inner)
                         for v in items if v != "")
    raise ConfigError(key, f"expected {getattr(hint, '__name__', hint)}, got {value!r}")


def from_mapping(cls: type[C], values: Mapping[str, Any], table: str = "") -> C:
    """Build config ``cls`` from a flat mapping, refusing unknown keys: the refusal names
    the table (``[source]``, where ``table`` is given) and the nearest key it knows."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cast("type[DataclassInstance]", cls))
    names = {f.name for f in fields}
    for key in values:
        if key not in names:
            near = difflib.get_close_matches(key, sorted(names), n=1)
            raise ConfigError(key, f"unknown key in [{table or cls.__name__}]"
                              + (f"; did you mean {near[0]!r}?" if near else "")
                              + f" (it knows {', '.join(sorted(names))})")
    for f in fields:
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in values:
            raise ConfigError(f.name, f"is required by {cls.__name__} and missing")
    return cls(**{k: _coerce(k, v, hints[k]) for k, v in values.items()})


def read_toml(path: str | Path, key: str) -> dict[str, Any]:
    """A TOML file as a dict; an unreadable or invalid file is a :class:`ConfigError` naming
    ``key``.  The one reader of TOML (``tomllib``, or ``tomli`` on Python 3.10: JetPack 6)."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(key, f"{path} is not valid TOML: {exc}") from exc


def load_config(cls: type[C], role: str, path: str | Path | None = None,
                overrides: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> C:
    """Load the ``[role]`` table of a TOML file, then environment, then overrides."""
    values: dict[str, Any] = {}
    if path is not None:
        table = read_toml(path, "config").get(role, {})
        if not isinstance(table, dict):
            raise ConfigError(role, f"must be a table in {path}")
        values.update(table)
    prefix = f"SAFL_{role.upper()}_"
    env = os.environ if environ is None else environ
    values.update({k[len(prefix):].lower(): v for k, v in env.items() if k.startswith(prefix)})
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return from_mapping(cls, values, role)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def toml_text(tables: dict[str, dict[str, Any]]) -> str:
    """A TOML document of flat tables (enough for role configs; no dependency): what the
    provisioner and the lab's launcher write and :func:`load_config` reads back."""
    out = []
    for name, values in tables.items():
        out.append(f"[{name}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
        out.append("")
    return "\n".join(out)
