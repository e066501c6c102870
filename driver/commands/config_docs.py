"""The schema as documentation: `jointrl config keys` and `jointrl config show`.

Both walk the pydantic models (`model_fields`, nested sections, the model kinds of a discriminated
union), so what they print is the schema itself: a new field shows up with its description and
default without anything written here.
"""
from __future__ import annotations

import types
import typing
from typing import Annotated, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from driver.config import Config, ExpertsConfig, models_of

LIST_KEYS = {(ExpertsConfig, "refiners"): ExpertsConfig.refiner_id}  # a list of sections, keyed per item


def type_name(annotation, metadata=()) -> str:
    """`int > 0`, `list[str] | null`, `ray | inline`, `section` …"""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return type_name(args[0], args[1:])
    if origin is Literal:
        return " | ".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        kinds = [type_name(a) for a in args if a is not type(None)]
        return " | ".join(dict.fromkeys(kinds)) + (" | null" if type(None) in args else "")
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation)) + bounds(metadata)


def bounds(metadata) -> str:
    """` >= 2`, ` > 0.0 <= 1.0`: the tightest lower and upper bound among a field's constraints."""
    out = ""
    lower, upper = (("gt", ">"), ("ge", ">=")), (("lt", "<"), ("le", "<="))
    for side, tightest in ((lower, max), (upper, min)):
        found = [(getattr(m, attr), op) for m in metadata for attr, op in side if getattr(m, attr, None) is not None]
        if found:
            out += " {1} {0}".format(*tightest(found, key=lambda bound: bound[0]))
    return out


def default_of(field: FieldInfo):
    """A field's default (PydanticUndefined for a required one)."""
    return PydanticUndefined if field.is_required() else field.get_default(call_default_factory=True)


def fields(model: type[BaseModel]):
    """(name, field, the sections it holds, how its list items are keyed) per field of `model`."""
    for name, field in model.model_fields.items():
        yield name, field, models_of(field.annotation), LIST_KEYS.get((model, name))


def is_named_sections(annotation) -> bool:
    """Whether a field is a mapping of names to sections (`reward.terms`)."""
    if get_origin(annotation) is dict:
        return bool(models_of(get_args(annotation)[1]))
    return any(is_named_sections(a) for a in get_args(annotation) if get_origin(annotation) in (typing.Union,
                                                                                               types.UnionType))


def builtin_option_rows(prefix: str) -> list[tuple[str, str, str]]:
    """The options of every built-in reward term, labelled with its short name."""
    from tasks.rewards import BUILTINS, resolve
    from tasks.rewards.base import Options
    rows = []
    for name in BUILTINS:
        options = resolve(name).Options
        rows += [r for r in key_rows(options, prefix, name)
                 if options is Options or r[0].removeprefix(prefix) not in Options.model_fields]
    return rows


def kind_of(section: type[BaseModel]) -> str:
    """The `kind` value of a model kind's section, e.g. `tiny_dit`."""
    return get_args(section.model_fields["kind"].annotation)[0]


def key_rows(model: type[BaseModel], prefix: str = "", kind: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, type, description) of every field below `model`, each section before its fields;
    the fields of a model kind are labelled with it."""
    rows = []
    label = f"[{kind}] " if kind else ""
    for name, field, sections, item_key in fields(model):
        key = prefix + (item_key("<i>") if item_key else name)
        typ = "section" if item_key else type_name(field.annotation, field.metadata)
        rows.append((key, typ, label + field.description))
        if is_named_sections(field.annotation):  # reward.terms.<name>: the term's keys, then each built-in's options
            rows += key_rows(sections[0], key + ".<name>.", kind)
            rows += builtin_option_rows(key + ".<name>.")
        elif len(sections) > 1:  # model kinds: which one, then the fields of each
            tags = [kind_of(s) for s in sections]
            about = "; ".join(f"{t}: {s.model_fields['kind'].description}" for t, s in zip(tags, sections))
            rows.append((f"{key}.kind", " | ".join(tags), f"the model kind. {about}"))
            for section, tag in zip(sections, tags):
                rows += [r for r in key_rows(section, key + ".", tag) if r[0] != f"{key}.kind"]
        else:
            for section in sections:
                rows += key_rows(section, key + ".", kind)
    return rows


def keys() -> str:
    """Every dotted key with its type and description, one a line."""
    rows = key_rows(Config)
    width = max(len(k) for k, _, _ in rows), max(len(t) for _, t, _ in rows)
    return "\n".join(f"{k:<{width[0]}}  {t:<{width[1]}}  {d}" for k, t, d in rows)


def value_text(value) -> str:
    """A value as one line of YAML (flow style)."""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**9)
    return text.removesuffix("\n...\n").strip()


def comment(field: FieldInfo, value) -> str:
    """A key's description, plus its default where the value differs from it."""
    default = default_of(field)
    if default is PydanticUndefined:
        return f"{field.description} (required)"
    if isinstance(default, BaseModel) or default == value:
        return field.description
    return f"{field.description} (default {value_text(default)})"


def show_lines(section: BaseModel, indent: str = "") -> list[str]:
    """`key: value  # comment` per field of `section`, nested sections indented below their key."""
    lines = []
    for name, field, _, item_key in fields(type(section)):
        value = getattr(section, name)
        if item_key:
            for i, item in enumerate(value):
                lines += [f"{indent}{item_key(i)}:  # {field.description}", *show_lines(item, indent + "  ")]
        elif isinstance(value, dict) and value and all(isinstance(v, BaseModel) for v in value.values()):
            lines.append(f"{indent}{name}:  # {field.description}")
            for key, item in value.items():
                lines += [f"{indent}  {key}:", *show_lines(item, indent + "    ")]
                lines += [f"{indent}    {k}: {value_text(v)}  # an option of {getattr(item, 'fn', key)}"
                          for k, v in (item.model_extra or {}).items()]
        elif isinstance(value, BaseModel):
            lines += [f"{indent}{name}:  # {comment(field, value)}", *show_lines(value, indent + "  ")]
        else:
            lines.append(f"{indent}{name}: {value_text(value)}  # {comment(field, value)}")
    return lines


def show(config: Config) -> str:
    """The resolved config as YAML (it loads back as the same config), each key commented with its
    description and, where the value differs, its default."""
    return "\n".join(show_lines(config))
