"""Typed models of cubic's file formats (pydantic), and what a validation error becomes: one line.

A format is defined once, as a model: the loader validates a file against it, and `cubic schema` exports
it as JSON Schema, so an editor completes and checks the same keys, types and allowed values the loader
accepts. Checks that relate several keys (a baseline inside its knobs' choices, a cpu device's cores) stay
in the loaders, after the model has vouched for every type.

Error lines name the file (and line, where the loader knows it), the key as a dotted path, and what is
allowed: `clusters/x.yaml: device.type: 'tpu' is not allowed; choose one of ['cpu', 'gpu']`.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from cubic_harness.errors import ConfigError


class Strict(BaseModel):
    """A section of a file: unknown keys are errors, and no type is coerced into another ("8" is not 8,
    true is not 1); an int is a float where a float is asked for."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _is_tag(part: Any) -> bool:
    """A union member's tag in an error location (`list[int]`, a model's class name), not a key."""
    return isinstance(part, str) and (part.endswith("]") and "[" in part or part[:1].isupper())


def path_of(model: Any, loc: tuple[Any, ...]) -> str:
    """pydantic's error location as the key path a user reads: `knobs.batch_size.choices[1]` (a list's
    item in brackets, a mapping's key after a dot, whatever its type)."""
    out = ""
    for i, part in enumerate(loc):
        if part == "[key]" or _is_tag(part):
            continue
        listed = isinstance(part, int) and typing.get_origin(_unwrap(_field_annotation(model, loc[:i]))) is list
        if listed:
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _field_annotation(model: Any, loc: tuple[Any, ...]) -> Any:
    """The annotation of the field at `loc` (None where the path leaves the models); for a mapping's key
    (`loc` ends in KEY, "[key]"), the type of its keys."""
    if loc and loc[-1] == "[key]":
        ann = _unwrap(_field_annotation(model, loc[:-2]))
        return typing.get_args(ann)[0] if typing.get_origin(ann) is dict else None
    ann: Any = model
    for part in loc:
        if _is_tag(part):
            continue
        ann = _unwrap(ann)
        if typing.get_origin(ann) in (typing.Union, types.UnionType):  # the member a key or index goes into
            members = [_unwrap(a) for a in typing.get_args(ann)]
            ann = next((a for a in members if typing.get_origin(a) is (list if isinstance(part, int) else dict)),
                       next((a for a in members if typing.get_origin(a) is dict), None))
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            if not isinstance(part, str) or part not in ann.model_fields:
                return None
            ann = ann.model_fields[part].annotation
            continue
        origin = typing.get_origin(ann)
        if origin is dict:
            ann = typing.get_args(ann)[1]
        elif origin is list:
            ann = typing.get_args(ann)[0]
        else:
            return None
    return ann


def _unwrap(ann: Any) -> Any:
    """`X | None` -> X; a union of one model and its shorthand -> the model (where keys are listed)."""
    origin = typing.get_origin(ann)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        args = [_unwrap(a) for a in args]
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if models else (args[0] if len(args) == 1 else ann)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(ann)[0])
    return ann


def allowed_values(ann: Any) -> list[Any] | None:
    """The values a Literal field allows (of a union, its Literal member: `rule | table`)."""
    ann = _unwrap(ann)
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        ann = next((a for a in map(_unwrap, typing.get_args(ann)) if typing.get_origin(a) is Literal), None)
    if typing.get_origin(ann) is Literal:
        return list(typing.get_args(ann))
    return None


def _message(model: type[BaseModel], err: dict[str, Any]) -> str:
    kind, value, loc, ctx = err["type"], err.get("input"), tuple(err["loc"]), err.get("ctx") or {}
    if kind in ("extra_forbidden", "invalid_key"):
        parent = _unwrap(_field_annotation(model, loc[:-1]))
        keys = list(parent.model_fields) if isinstance(parent, type) and issubclass(parent, BaseModel) else []
        return f"unknown key; allowed: {keys}" if keys else "unknown key"
    if kind == "missing":
        parent = _unwrap(_field_annotation(model, loc[:-1]))
        req = ([k for k, f in parent.model_fields.items() if f.is_required()]
               if isinstance(parent, type) and issubclass(parent, BaseModel) else [])
        return f"missing; required keys: {req}" if req else "missing"
    if kind in ("literal_error", "enum"):
        choices = allowed_values(_field_annotation(model, loc))
        return f"{value!r} is not allowed; choose one of {choices if choices is not None else ctx.get('expected')}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        op = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}[kind]
        bound = next(iter(ctx.values()))
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)
        return f"{value!r} must be {op} {bound}"
    if kind in ("int_type", "int_from_float", "int_parsing"):
        return f"{value!r} is not an integer"
    if kind in ("float_type", "float_parsing", "finite_number"):
        return f"{value!r} is not a finite number"
    if kind in ("bool_type", "bool_parsing"):
        return f"{value!r} must be true or false"
    if kind in ("string_type", "str_type"):
        return f"{value!r} must be a string"
    if kind in ("dict_type", "model_type", "model_attributes_type", "dataclass_type"):
        return f"must be a mapping, got {type(value).__name__}"
    if kind in ("list_type", "tuple_type"):
        return f"must be a list, got {type(value).__name__}"
    if kind == "too_short":
        return f"must not be empty (at least {ctx.get('min_length', 1)})"
    if kind == "string_pattern_mismatch":
        return f"{value!r} must match {ctx.get('pattern')}"
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error") or err["msg"]).removeprefix("Value error, ")
    return f"{err['msg']} (got {value!r})"


def validate(model: type[BaseModel], raw: Any, where: str,
             line_of: Callable[[str], int | None] | None = None) -> BaseModel:
    """`model` from `raw`, or ConfigError: one line, `WHERE[:LINE]: KEY: what is wrong, what is allowed`.

    Of several errors, the one a reader meets first: pydantic lists a union's failed members after the
    others, and a union's members each complain, so the shortest path is the one to fix."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        keys = [tuple(p for p in x["loc"] if not _is_tag(p)) for x in errs]
        # a union's member that does not take the value's shape at all (a rule name for a table) says less
        # than one that took it and found a wrong entry deeper down: drop the former
        deeper = [i for i, k in enumerate(keys) if not any(len(o) > len(k) and o[:len(k)] == k for o in keys)]
        # then the shallowest; a mapping's bad key before what its value says (checked against the wrong thing)
        err = errs[min(deeper, key=lambda i: (len(keys[i]) - 2 * ("[key]" in keys[i]), i))]
        key = path_of(model, tuple(err["loc"]))
        line = line_of(key) if line_of is not None and key else None
        head = f"{where}:{line}" if line else where
        raise ConfigError(f"{head}: {key or '(top level)'}: {_message(model, err)}") from None


def json_schema(model: type[BaseModel], title: str, about: str) -> dict[str, Any]:
    """The model as JSON Schema (draft 2020-12), titled for an editor's file association."""
    schema = model.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": title, "description": about,
            **{k: v for k, v in schema.items() if k not in ("title", "description")}}
