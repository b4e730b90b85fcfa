"""Config loading shared by prep and training: the strict pydantic base (unknown keys and
non-finite numbers are errors), YAML reading with one-line errors, and validation errors
formatted as one line per bad key path."""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from core.errors import SECRET_IN_CONFIG, ConfigError

ENV_PREFIX = "env:"  # a config given as env:NAME is the YAML held in $NAME


class Strict(BaseModel):
    # allow_inf_nan=False: `lr: .inf` or `.nan` in any float field is an error naming the
    # key, not a run that trains on NaN weights.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def key_path(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a YAML key path: `sources[1].paths`."""
    out = ""
    for part in loc:
        # pydantic puts the failing validator's name into the path for unions; drop it.
        if isinstance(part, str) and part.startswith("function-"):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _fields(model: type) -> dict[str, Any]:
    """A pydantic model's or a dataclass's fields: {name: annotation}."""
    if isinstance(model, type) and issubclass(model, BaseModel):
        return {k: f.annotation for k, f in model.model_fields.items()}
    hints = typing.get_type_hints(model, include_extras=True)
    return {f.name: hints.get(f.name) for f in dataclasses.fields(model)}


def _models_in(annotation: Any) -> list[type]:
    """The pydantic models (or dataclasses) a field's type can hold: itself, or those
    inside Optional, unions, Annotated, lists, tuples and dict values."""
    if isinstance(annotation, type) and (
        issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)
    ):
        return [annotation]
    if typing.get_origin(annotation) is None and not isinstance(annotation, types.UnionType):
        return []
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def known_keys(model: type[BaseModel], loc: Iterable[Any]) -> list[str]:
    """The keys the model(s) at `loc` (a pydantic error location, less its last part) take.
    Parts that name no field (list indexes, dict keys, a union's tag) are stepped over."""
    models: list[type] = [model]
    for part in loc:
        if not isinstance(part, str):
            continue
        inner = [m for owner in models for m in _models_in(_fields(owner).get(part, None)) if m]
        if inner:
            models = inner
        elif any(part in _fields(owner) for owner in models):
            return []  # a field that holds no model: nothing to suggest
    return sorted({k for m in models for k in _fields(m)})


def did_you_mean(key: Any, known: Iterable[str]) -> str:
    """`; did you mean `text_field`?` when one of `known` is close to `key`, else ""."""
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    return f"; did you mean `{close[0]}`?" if close else ""


def format_validation_error(
    err: ValidationError,
    where: str,
    what: str = "config",
    loc: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None,
    model: type[BaseModel] | None = None,
) -> str:
    """One line per error under a heading; `loc` rewrites an error's location first (to
    drop a union's tag, say, which is not a key the user wrote). `model`: the model that
    was validated, so that an unknown key gets the closest known one as a suggestion."""
    lines = [f"invalid {what} {where}:" if where else f"invalid {what}:"]
    for e in err.errors():
        # A dataclass field (pydantic validates it as a call) reports an unknown key as
        # an unexpected keyword argument: the same mistake, said the same way.
        unknown = e["type"] in ("extra_forbidden", "unexpected_keyword_argument")
        msg = (
            "unknown key"
            if unknown
            else {"missing": "required key is missing"}.get(e["type"], e["msg"])
        )
        if unknown and model is not None and e["loc"]:
            *parent, key = e["loc"]
            msg += did_you_mean(key, known_keys(model, parent))
        where_ = key_path(loc(tuple(e["loc"])) if loc is not None else e["loc"])
        shown = (
            ""
            if unknown
            or e["type"] in ("missing", SECRET_IN_CONFIG)
            # A validator that names the item itself (`quality[0] length.min_charz: ...`):
            # the whole list after it would only hide the point.
            or (where_ and f"{where_}[" in msg)
            else f" (got {e.get('input')!r:.80})"
        )
        lines.append(f"  {where_ or '(top level)'}: {msg}{shown}")
    return "\n".join(lines)


def _leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """A config dump as {dotted key path: value}: `sources[0].text_field`."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_leaves(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list) and value:
        out = {}
        for i, v in enumerate(value):
            out.update(_leaves(v, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


_UNSET = object()


def changed_keys(old: dict[str, Any], new: dict[str, Any], limit: int = 5) -> str:
    """The keys that differ between two config dumps, on one line: `dedup.near.threshold:
    0.8 -> 0.7, seed: 0 -> 1` (at most `limit`, then how many more). Values are shortened
    and pass through core.redact (a URL's user:password@, credentials from the
    environment)."""
    from core.redact import redact

    a, b = _leaves(old), _leaves(new)
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k, _UNSET) != b.get(k, _UNSET))

    def show(v: Any) -> str:
        return "(unset)" if v is _UNSET else redact(f"{v!r:.60}")

    parts = [f"{k}: {show(a.get(k, _UNSET))} -> {show(b.get(k, _UNSET))}" for k in keys[:limit]]
    if len(keys) > limit:
        parts.append(f"and {len(keys) - limit} more")
    return ", ".join(parts)


def read_yaml(path: str | Path, error: type[ConfigError] = ConfigError) -> Any:
    """The YAML document in `path` (or in $NAME for `env:NAME`), or `error` with one line
    naming the file and the cause."""
    if str(path).startswith(ENV_PREFIX):
        name = str(path)[len(ENV_PREFIX) :]
        text = os.environ.get(name)
        if text is None:
            raise error(f"config {path}: environment variable {name} is not set")
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            where = "" if Path(path).is_absolute() else f" (resolved against {Path.cwd()})"
            raise error(f"config file {path} does not exist{where}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise error(f"cannot read config file {path}: {e}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise error(f"config file {path} is not valid YAML: {e}") from None
