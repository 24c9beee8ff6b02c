"""A pydantic model's fields in words: a config written as TOML with every key explained, and as Markdown tables.

Everything here is read off the models (a field's description, its annotation: Literal choices, bool, numbers
and their ge/gt/le/lt bounds, optional = may be unset), so ``treadle config --explain`` and the "accepted: ..."
of a config error cannot drift from what validation really accepts. It knows pydantic and TOML, not treadle's
sections: ``treadle.config`` calls it (``to_toml(cfg, explain=True)``, config errors, the reference).
"""

from __future__ import annotations

import inspect
import re
import textwrap
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import tomli_w
from pydantic import BaseModel
from pydantic.fields import FieldInfo

_NUMBERS = {2: "two", 3: "three", 4: "four"}
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def model_of(annotation: Any) -> type[BaseModel] | None:
    """The model class a field holds (a section), or None."""
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def item_model(annotation: Any) -> type[BaseModel] | None:
    """``list[SomeModel]`` -> SomeModel (an array of tables such as ``data.sources``), else None."""
    return model_of(get_args(annotation)[0]) if get_origin(annotation) is list and get_args(annotation) else None


# An array longer than this on one line (a few dozen data files) is written one item per line instead.
INLINE_ARRAY_CHARS = 88


def toml_value(value: Any) -> str:
    """One value as a TOML literal on one line (``"cosine"``, ``true``, ``[0.9, 0.95]``, ``{ a = 1 }``); an array of
    tables, or one too long to read on a line, puts one item per line."""
    if isinstance(value, (list, tuple)):
        items = [toml_value(v) for v in value]
        inline = "[" + ", ".join(items) + "]"
        if any(isinstance(v, dict) for v in value) or len(inline) > INLINE_ARRAY_CHARS:
            return "[\n" + "".join(f"    {item},\n" for item in items) + "]"
        return inline
    if isinstance(value, dict):
        pairs = [f"{k if _BARE_KEY.fullmatch(k) else toml_value(k)} = {toml_value(v)}" for k, v in value.items()]
        return "{ " + ", ".join(pairs) + " }" if pairs else "{}"
    return tomli_w.dumps({"v": value})[len("v = "):].strip()


def _number(x: float) -> str:
    return f"{x:g}"


_BOUNDS = {"ge": ("[", ">="), "gt": ("(", ">"), "le": ("]", "<="), "lt": (")", "<")}


def _bounds(metadata: list) -> str:
    """ge/gt/le/lt metadata -> ' >= 1', ' in [0, 1)', or ''."""
    found = {}
    for m in metadata:
        for c in m.metadata if isinstance(m, FieldInfo) else [m]:  # Field(ge=0) inside Annotated keeps them here
            # pydantic's annotated_types.Ge / Gt / Le / Lt: one attribute each, named as in Field(...)
            found |= {name: getattr(c, name) for name in _BOUNDS if getattr(c, name, None) is not None}
    lo = next((n for n in ("ge", "gt") if n in found), None)
    hi = next((n for n in ("le", "lt") if n in found), None)
    if lo and hi:
        return f" in {_BOUNDS[lo][0]}{_number(found[lo])}, {_number(found[hi])}{_BOUNDS[hi][0]}"
    return "".join(f" {_BOUNDS[n][1]} {_number(found[n])}" for n in (lo, hi) if n)


def _unannotated(annotation: Any) -> tuple[Any, list]:
    """``Annotated[float, Field(ge=0)]`` -> (float, [its metadata]); anything else -> (it, [])."""
    if get_origin(annotation) is Annotated:
        base, *metadata = get_args(annotation)
        return base, metadata
    return annotation, []


def _items(annotation: Any, count: str) -> str:
    """'two numbers, each in [0, 1)', 'a list of integers, each >= 0'."""
    base, metadata = _unannotated(annotation)
    if get_origin(base) is Literal:
        return f"{count} values, each one of " + ", ".join(toml_value(a) for a in get_args(base))
    plural = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(base, "values")
    bounds = _bounds(metadata)
    return f"{count} {plural}" + (f", each{bounds}" if bounds else "")


def accepted(annotation: Any, metadata: list = ()) -> str:
    """What a field of this annotation (and ge/gt/le/lt metadata) accepts, in words."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return accepted(args[0], [*metadata, *args[1:]])
    if origin in (Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        inner = accepted(rest[0] if len(rest) == 1 else Union[tuple(rest)], metadata)
        return f"{inner}, or unset (leave the key out; on the command line: =none)"
    if origin in (Union, types.UnionType):
        return ", or ".join(accepted(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(toml_value(a) for a in args)
    if annotation is bool:
        return "true or false"
    if annotation is int:
        return "an integer" + _bounds(metadata)
    if annotation is float:
        return "a number" + _bounds(metadata)
    if annotation is str:
        return "a string"
    if model_of(annotation):
        return "a table"
    if origin is list:
        entry = item_model(annotation)
        return f"a list of tables (keys: {', '.join(entry.model_fields)})" if entry else _items(args[0], "a list of")
    if origin is tuple and args and Ellipsis not in args and len({accepted(a) for a in args}) == 1:
        return _items(args[0], _NUMBERS.get(len(args), str(len(args))))
    if origin is tuple and args and Ellipsis not in args:
        return "[" + ", ".join(accepted(a) for a in args) + "]"
    if origin is dict:
        return "a table" if args[1] is Any else _items(args[1], "a table of")
    if annotation is Any:
        return "any value"
    return getattr(annotation, "__name__", str(annotation))


def field_accepted(field: FieldInfo) -> str:
    return accepted(field.annotation, field.metadata)


def list_item(annotation: Any) -> Any | None:
    """The item annotation of a list or tuple of plain values anywhere in ``annotation`` (``list[str]``,
    ``Literal["all-linear"] | list[str]``, ``list[int] | None``, ``tuple[float, float]``), else None: an array of
    tables (``data.sources``) or a key that takes no list. What a comma list on the command line is read into."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return list_item(args[0])
    if origin in (Union, types.UnionType):
        return next((item for item in map(list_item, args) if item is not None), None)
    if origin in (list, tuple) and args and not item_model(annotation) and not model_of(args[0]):
        return args[0]
    return None


def default_value(field: FieldInfo) -> str:
    """A field's default as TOML ('"cosine"', '[0.9, 0.95]'), 'unset', or 'required'."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return "unset" if value is None else toml_value(value)


def _default(field: FieldInfo) -> str:
    value = default_value(field)
    return value if value == "required" else f"default: {value}"


def describe(field: FieldInfo) -> list[str]:
    """Comment lines for one key: its description, then default and accepted values (and an entry's keys)."""
    lines = [field.description] if field.description else []
    lines.append(f"{_default(field)}; accepted: {field_accepted(field)}")
    entry = item_model(field.annotation)
    for name, sub in (entry.model_fields.items() if entry else ()):
        lines.append("; ".join([f"  {name}: {sub.description}" if sub.description else f"  {name}",
                                _default(sub), f"accepted: {field_accepted(sub)}"]))
    return [f"# {part}" for line in lines
            for part in textwrap.wrap(line, 114, subsequent_indent="    " if line.startswith("  ") else "  ",
                                      break_on_hyphens=False)]


def explained_toml(model: type[BaseModel], tree: dict, path: tuple[str, ...] = (), explain: bool = True) -> str:
    """``tree`` (a model's ``model_dump(mode="json")``, unset keys left out) as TOML, a comment above each key.

    A key absent from ``tree`` is explained too, as a commented-out line. Every value is written on its key's line
    (tables inline, short arrays too), so only sub-models become ``[sections]`` and the plain keys of a table come
    before them. ``explain=False``: the same TOML without the comments and the unset keys (``treadle config``).
    """
    blocks, sections = [], []
    for name, field in model.model_fields.items():
        sub = model_of(field.annotation)
        if sub is not None:
            sections.append(explained_toml(sub, tree.get(name, {}), (*path, name), explain))
        elif name in tree or explain:
            line = f"{name} = {toml_value(tree[name])}" if name in tree else f"# {name} = (unset)"
            blocks.append("\n".join([*(describe(field) if explain else []), line]))
    if path and blocks:
        blocks[0] = f"[{'.'.join(path)}]\n{blocks[0]}"
    keys = ("\n\n" if explain else "\n").join(blocks)  # explained keys apart, plain ones a line each
    return "\n\n".join(block for block in [keys, *sections] if block)


def _cell(text: str) -> str:
    """Text for one Markdown table cell: rst's ``code`` as Markdown's, '|' and '<' (a tag's start) escaped."""
    text = " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def markdown_tables(model: type[BaseModel], path: tuple[str, ...] = (), depth: int = 2) -> str:
    """Every key of ``model`` as Markdown: one heading and one table (key, default, accepted, meaning) per
    section, in the order of the model's fields, sub-sections after their parent's keys; an array of tables
    (``[[data.sources]]``) gets a table of its own below its section's. A section's docstring, if it has one, is
    the paragraph under its heading; the root model's own keys come last, as "Keys outside a section"."""
    rows, entries, sections = [], [], []
    for name, field in model.model_fields.items():
        sub, entry = model_of(field.annotation), item_model(field.annotation)
        if sub is not None:
            sections.append(markdown_tables(sub, (*path, name), depth))
            continue
        default = default_value(field)
        rows.append(f"| `{name}` | {default if default in ('unset', 'required') else f'`{default}`'} | "
                    f"{_cell(field_accepted(field))} | {_cell(field.description or '')} |")
        if entry is not None:
            entries.append(markdown_tables(entry, (*path, name), depth + 1).replace(
                f"{'#' * (depth + 1)} [{'.'.join((*path, name))}]", f"{'#' * (depth + 1)} [[{'.'.join((*path, name))}]]", 1))
    blocks = []
    if rows:
        heading = f"{'#' * depth} " + (f"[{'.'.join(path)}]" if path else "Keys outside a section")
        about = _cell(inspect.cleandoc(model.__doc__)) if model.__doc__ and path else ""
        table = "\n".join(["| key | default | accepted | meaning |", "|---|---|---|---|", *rows])
        blocks.append("\n\n".join(part for part in (heading, about, table) if part))
    parts = (sections + blocks + entries) if not path else (blocks + entries + sections)
    return "\n\n".join(parts)
