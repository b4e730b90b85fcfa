"""Config loading shared by prep and training: the strict pydantic base (unknown keys and
non-finite numbers are errors), YAML reading with one-line errors, and validation errors
formatted as one line per bad key path."""

from __future__ import annotations

import os
from collections.abc import Callable
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


def format_validation_error(
    err: ValidationError,
    where: str,
    what: str = "config",
    loc: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None,
) -> str:
    """One line per error under a heading; `loc` rewrites an error's location first (to
    drop a union's tag, say, which is not a key the user wrote)."""
    lines = [f"invalid {what} {where}:"]
    for e in err.errors():
        msg = {"extra_forbidden": "unknown key", "missing": "required key is missing"}.get(
            e["type"], e["msg"]
        )
        shown = (
            ""
            if e["type"] in ("missing", "extra_forbidden", SECRET_IN_CONFIG)
            else f" (got {e.get('input')!r:.80})"
        )
        where_ = loc(tuple(e["loc"])) if loc is not None else e["loc"]
        lines.append(f"  {key_path(where_) or '(top level)'}: {msg}{shown}")
    return "\n".join(lines)


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
