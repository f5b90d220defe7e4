"""Write ``docs/config.md``: every table of every role's TOML file, each key with its type,
default and one line of meaning, read from the config classes themselves (the comment on
or above the field, else the sentence of the class docstring that names it), so the page
cannot drift from the code: ``tests/test_config.py`` fails when the file is stale or a key
has no meaning to show.

Run: ``python docs/make_config_doc.py`` from the repository root.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import typing
from pathlib import Path

from aggregator.config import CloudConfig, StationConfig
from edge_client.service import DEVICE_TABLES, SHARED_TABLES

OUT = Path(__file__).with_name("config.md")

# The tables each role's loader reads (edge_client/service.py, safl/cli.py), in its order.
ROLES = (
    ("device", "`safl device --config F` (or `safl-device`)", DEVICE_TABLES),
    ("station", "`safl station --config F`", {"station": StationConfig, **SHARED_TABLES}),
    ("cloud", "`safl cloud --config F`", {"cloud": CloudConfig, **SHARED_TABLES}),
)


def _field_comments(cls: type) -> dict[str, str]:
    """Comments on each field of ``cls``'s own body: the one after it on its line, else
    the block right above it."""
    lines, _ = inspect.getsourcelines(cls)
    source = textwrap.dedent("".join(lines))
    out: dict[str, str] = {}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    text = source.splitlines()
    block = ""  # a comment block above a run of fields speaks for the whole run
    for node in body.body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            block = ""
            continue
        line = text[node.lineno - 1]
        above, k = [], node.lineno - 2
        while k >= 0 and text[k].strip().startswith("#"):
            above.insert(0, text[k].strip().lstrip("#").strip())
            k -= 1
        if above:
            block = " ".join(above)
        elif not text[node.lineno - 2].strip():
            block = ""  # a blank line ends the run
        if "#" in line and not line.strip().startswith("#"):
            out[node.target.id] = line.split("#", 1)[1].strip()
            block = ""  # a field with its own comment is not part of the run above
        elif block:
            out[node.target.id] = block
    return out


def _sentences(text: str) -> list[str]:
    """``text`` cut after each '.' or ';' that ends a sentence outside parentheses (a
    parenthesis's '"": none; ...' is part of its sentence)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if ch in ".;" and depth <= 0 and (i + 1 == len(text) or text[i + 1] == " "):
            out.append(text[start:i + 1].strip())
            start = i + 1
    return [s for s in [*out, text[start:].strip()] if s]


def _from_docstring(cls: type, key: str) -> str:
    doc = " ".join((inspect.getdoc(cls) or "").split())
    for sentence in _sentences(doc):
        if re.search(rf"``{re.escape(key)}``|`{re.escape(key)}`", sentence):
            return sentence
    return ""


def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    head = re.split(r"(?<=[.;:])\s+(?=[A-Z(])", text, maxsplit=1)[0]
    return head.rstrip(".;:").replace("``", "`") + "."


def meaning(cls: type, key: str) -> str:
    """One line saying what ``key`` of ``cls`` is, from the class that declares it."""
    for klass in cls.__mro__:
        if key in getattr(klass, "__annotations__", {}):
            found = _field_comments(klass).get(key) or _from_docstring(klass, key) \
                or _from_docstring(cls, key)
            return _first_sentence(found) if found else ""
    return ""


def _type(hint: object) -> str:
    if typing.get_origin(hint) is tuple:
        return f"list of {_type(typing.get_args(hint)[0])}"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(
        hint, str(hint))  # type: ignore[call-overload]


def _default(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "**required**"
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, tuple):
        return "`[" + ", ".join(f'"{v}"' if isinstance(v, str) else repr(v) for v in value) + "]`"
    return f"`{value!r}`"


def table(name: str, cls: type) -> list[str]:
    hints = typing.get_type_hints(cls)
    rows = [f"### `[{name}]` ({cls.__name__})", "",
            " ".join(_first_sentence(inspect.getdoc(cls) or "").split()), "",
            "| key | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        rows.append(f"| `{f.name}` | {_type(hints[f.name])} | {_default(f)} | "
                    f"{meaning(cls, f.name).replace('|', '/')} |")
    return [*rows, ""]


def render() -> str:
    out = ["# Configuration reference", "",
           "Generated by `python docs/make_config_doc.py` from the config classes; a test "
           "fails when it is stale.", "",
           "Each role reads one TOML file. A key may also come from the environment as "
           "`SAFL_<TABLE>_<KEY>` (`SAFL_BROKER_URL`, `SAFL_SOURCE_KIND`) and from the "
           "command's flags, which win. Start-up refuses an unknown key, an unknown table, "
           "a wrong type or a value out of range, with a message naming the key; a "
           "misspelled key or table is named with its table and the nearest one it knows "
           "(`'retrys': unknown key in [source]; did you mean 'retries'?`). "
           "`safl status` and `safl monitor` read `[broker]` (and the monitor "
           "`[monitor] http = \"HOST:PORT\"`, where its page listens), as provisioning "
           "writes them in `monitor/status-*.toml` and `monitor/monitor-*.toml` (each on "
           "a certificate of its own); `safl provision` reads the fleet file "
           "(`docs/deploy.md`).", ""]
    done: set[str] = set()
    for role, command, tables in ROLES:
        out += [f"## {role}: {command}", "",
                "Tables: " + ", ".join(f"`[{t}]`" for t in tables) + ".", ""]
        for name, cls in tables.items():
            if name in done:
                out += [f"`[{name}]`: as above.", ""]
                continue
            done.add(name)
            out += table(name, cls)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
