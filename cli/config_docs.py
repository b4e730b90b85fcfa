"""docs/config.md, generated from the config models' `Field(description=...)`: every key of
the prep, training, launch and search configs and every quality rule's parameters, with
type, default and description. It lives in cli/ because it imports tasks, training, infra
and flows, which only the top layer may.

    python -m cli.config_docs write   # regenerate docs/config.md (make docs)
    python -m cli.config_docs check   # exit 1 with one line if it is stale (make test)
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
_LINK = "@@link:"  # a link to a model's section, resolved once every anchor is known
OUT = ROOT / "docs" / "config.md"


@dataclasses.dataclass(frozen=True)
class Key:
    """One config key as the docs show it."""

    name: str
    annotation: Any
    info: FieldInfo
    default: Any  # PydanticUndefined when required


def keys(cls: type) -> list[Key]:
    """The keys of a pydantic model or of a dataclass that a model nests (KubeOptions), in
    definition order, with the FieldInfo that holds their description and constraints."""
    if issubclass(cls, BaseModel):
        out = []
        for name, info in cls.model_fields.items():
            default = (
                info.default_factory()
                if info.default_factory is not None  # type: ignore[call-arg]
                else info.default
            )
            out.append(Key(info.alias or name, info.annotation, info, default))
        return out
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        default = (
            f.default_factory()
            if f.default_factory is not dataclasses.MISSING
            else f.default
            if f.default is not dataclasses.MISSING
            else PydanticUndefined
        )
        info = FieldInfo.from_annotation(hints[f.name])
        out.append(Key(f.name, info.annotation, info, default))
    return out


def is_section(t: Any) -> bool:
    """A type whose keys get a table of their own."""
    return isinstance(t, type) and (issubclass(t, BaseModel) or dataclasses.is_dataclass(t))


def nested(t: Any) -> Iterator[tuple[str, type]]:
    """(path suffix, class) for every model inside a field's type: `[]` for list items,
    `.<key>` for dict values."""
    origin, args = get_origin(t), get_args(t)
    if origin is Annotated:
        yield from nested(args[0])
    elif origin in (Union, types.UnionType):
        for a in args:
            yield from nested(a)
    elif origin is list:
        for suffix, cls in nested(args[0]):
            yield "[]" + suffix, cls
    elif origin is dict:
        for suffix, cls in nested(args[1]):
            yield ".<key>" + suffix, cls
    elif is_section(t):
        yield "", t


def constraints(meta: list[Any]) -> list[str]:
    out: list[str] = []
    for m in meta:
        if isinstance(m, FieldInfo):
            out += constraints(m.metadata)
        elif isinstance(m, at.Ge):
            out.append(f">= {m.ge}")
        elif isinstance(m, at.Gt):
            out.append(f"> {m.gt}")
        elif isinstance(m, at.Le):
            out.append(f"<= {m.le}")
        elif isinstance(m, at.Lt):
            out.append(f"< {m.lt}")
        elif isinstance(m, at.MinLen):
            out.append(f"at least {m.min_length}")
        elif isinstance(m, at.MaxLen):
            out.append(f"at most {m.max_length}")
        elif getattr(m, "pattern", None):
            out.append(f"matches {m.pattern}")
    return out


class Renderer:
    def __init__(self) -> None:
        self.anchors: dict[str, int] = {}
        # A model is drawn once; later uses link to it. class -> (path, label), and its
        # anchor once drawn.
        self.drawn_at: dict[type, tuple[str, str]] = {}
        self.rendered: dict[type, str] = {}
        self.pending: list[tuple[str, type]] = []

    def anchor(self, heading: str) -> str:
        """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to
        hyphens, -1, -2... for repeats."""
        base = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = self.anchors.get(base, 0)
        self.anchors[base] = n + 1
        return base if n == 0 else f"{base}-{n}"

    def type_name(self, t: Any) -> str:
        origin, args = get_origin(t), get_args(t)
        if t is type(None):
            return "null"
        if t is Any:
            return "any"
        if origin is Annotated:
            extra = constraints(list(args[1:]))
            inner = self.type_name(args[0])
            return f"{inner} ({', '.join(extra)})" if extra else inner
        if origin is Literal:
            return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
        if origin in (Union, types.UnionType):
            return " | ".join(dict.fromkeys(self.type_name(a) for a in args))
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return f"list of {self.type_name(args[0])}"
            return f"[{', '.join(self.type_name(a) for a in args)}]"
        if origin is list:
            return f"list of {self.type_name(args[0])}"
        if origin is dict:
            return f"mapping of {self.type_name(args[0])} to {self.type_name(args[1])}"
        if is_section(t):
            return "section"
        return getattr(t, "__name__", str(t))

    def field_type(self, t: Any, extra: list[str]) -> str:
        """A key's type with the field's own constraints, which bound the value, not its
        null: `int (>= 1) | null`."""
        if not extra:
            return self.type_name(t)
        args = get_args(t)
        nullable = get_origin(t) in (Union, types.UnionType) and type(None) in args
        if nullable:
            t = Union[tuple(a for a in args if a is not type(None))]  # noqa: UP007
        return f"{self.type_name(t)} ({', '.join(extra)})" + (" | null" if nullable else "")

    def value(self, v: Any) -> str:
        if v is None:
            return "null"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            # Quoted where YAML would read the bare word as something else ("true", "8").
            return v if v and yaml.safe_load(v) == v else json.dumps(v)
        if isinstance(v, list | tuple):
            return "[" + ", ".join(self.value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}: {self.value(x)}" for k, x in v.items()) + "}"
        return repr(v)

    def default(self, k: Key) -> str:
        if k.default is PydanticUndefined:
            return "required"
        if is_section(type(k.default)):
            return "(the section's defaults)"
        shown = self.value(k.default)
        if len(shown) > 70 and isinstance(k.default, list | tuple):
            return f"(a built-in list of {len(k.default)})"
        return f"`{shown}`"

    def table(self, path: str, cls: type, intro: str = "", label: str = "") -> list[str]:
        """The section for the model at `path`, then those of the models inside it that
        were not drawn before."""
        self.drawn_at.setdefault(cls, (path, label))
        heading = self.link_text(cls)
        self.rendered[cls] = self.anchor(heading)
        lines = [f"### {heading}", ""]
        doc = intro or _first_paragraph(cls)
        if doc:
            lines += [doc, ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        inner: list[type] = []  # drawn after this table
        for k in keys(cls):
            subs = [(f"{path}.{k.name}{suffix}", sub) for suffix, sub in nested(k.annotation)]
            for sub_path, sub in subs:
                if sub not in self.drawn_at:
                    many = [p for p, _ in subs].count(sub_path) > 1
                    self.drawn_at[sub] = (sub_path, _label(sub) if many else "")
                    inner.append(sub)
            kind = self.field_type(k.annotation, constraints(k.info.metadata))
            see = ""
            if subs:
                see = (
                    " See "
                    + ", ".join(f"[{self.link_text(sub)}](#{_LINK}{id(sub)}@)" for _, sub in subs)
                    + "."
                )
            desc = (k.info.description or "") + see
            lines.append(
                f"| `{k.name}` | {_cell(kind, code=True)} | {_cell(self.default(k))} "
                f"| {_cell(desc)} |"
            )
        lines.append("")
        for sub in inner:
            sub_path, sub_label = self.drawn_at[sub]
            lines += self.table(sub_path, sub, label=sub_label)
        return lines

    def link_text(self, cls: type) -> str:
        path, label = self.drawn_at[cls]
        return f"`{path}`" + (f" ({label})" if label else "")

    def resolve(self, text: str) -> str:
        """Links to models are written before their anchor is known: fill them in."""
        by_id = {str(id(cls)): a for cls, a in self.rendered.items()}
        return re.sub(_LINK + r"(\d+)@", lambda m: by_id[m.group(1)], text)


def _label(cls: type) -> str:
    """What tells apart the members of a union at one path (a search space's
    distributions): their type tag, or else their class name."""
    tag = getattr(cls, "model_fields", {}).get("type")
    if tag is not None and get_origin(tag.annotation) is Literal:
        return f"type: {get_args(tag.annotation)[0]}"
    return cls.__name__


def _first_paragraph(cls: type) -> str:
    doc = cls.__doc__ or ""
    if not doc or (dataclasses.is_dataclass(cls) and doc.startswith(cls.__name__ + "(")):
        return ""  # a dataclass's generated signature is no description
    return " ".join(doc.strip().split("\n\n")[0].split())


def _cell(text: str, code: bool = False) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return f"`{text}`" if code and text else text


HEADER = """\
# Config reference

<!-- Generated by `make docs` (python -m cli.config_docs write) from the config models'
Field(description=...): edit the descriptions in the code, not this file. `make test`
fails while it is stale. -->

One YAML file per run. Unknown keys are errors, and every error names its key path, e.g.
`sources[0].text_feild: unknown key` or
`dedup.near.threshold: Input should be a valid number (got 'high')`. Non-finite numbers
(`.inf`, `.nan`) are errors too. Relative source paths are resolved from the config file's
directory; every other relative path (`output`, a rule's files, the training config's
`dataset` and `run_dir`) from the working directory ([prep.md](prep.md#relative-paths)). An
unknown key gets the closest known one: ``sources[0].text_feild: unknown key; did you mean
`text_field`?``.

- [Prep config](#prep-config): `ballast prep CONFIG`, the `prep` flow (dataprep/config.py)
- [Training config](#training-config): `ballast train CONFIG`, the `train` flow
  (training/config/)
- [Launch](#launch): the training config's `launch:` section (infra/launch.py)
- [Hyperparameter search](#hyperparameter-search): `ballast hpo run CONFIG` (flows/tuning/config.py)
- [Data ablation](#data-ablation): `ballast ablate CONFIG` (flows/ablation/config.py)
- [Quality rule parameters](#quality-rule-parameters): `{rule: {param: value}}` in a
  `quality:` list (dataprep/quality/)

What the stages do with these keys: [prep.md](prep.md); the trainer: [training.md](training.md).
"""

PARTS: list[tuple[str, str, str]] = [
    (
        "Prep config",
        "prep",
        "A prep config (e.g. configs/demo.yaml). A prep config may also "
        "hold a `train:` section, a whole training config, so that one file describes a "
        "pipeline run.",
    ),
    (
        "Training config",
        "train",
        "A training config (e.g. configs/train-demo.yaml), or the "
        "`train:` section of a prep config.",
    ),
    (
        "Launch",
        "launch",
        "How the `train` flow runs a training config (the trainer ignores "
        "the section). A flow run's `launch` parameter overrides single keys for that run; "
        "deployments set only `backend`, from their work pool.",
    ),
    (
        "Hyperparameter search",
        "hpo",
        "A search config for the `hpo` flow (e.g. "
        "configs/hpo-demo.yaml); see [tools.md](tools.md#tuning-on-proxy-models).",
    ),
    (
        "Data ablation",
        "ablate",
        "An ablation config for the `ablate` flow (e.g. configs/ablate-demo.yaml); see "
        "[tools.md](tools.md#data-ablations-ballast-ablate).",
    ),
]


def models() -> dict[str, type]:
    from dataprep.config import PrepConfig
    from flows.ablation.config import AblationConfig
    from flows.hpo import HpoConfig
    from infra.launch import LaunchConfig
    from training.config import TrainConfig

    return {
        "prep": PrepConfig,
        "train": TrainConfig,
        "launch": LaunchConfig,
        "hpo": HpoConfig,
        "ablate": AblationConfig,
    }


def rules() -> dict[str, type]:
    from dataprep.quality import RULES

    return dict(RULES)


def render() -> str:
    r = Renderer()
    lines = [*HEADER.splitlines(), ""]
    found = models()
    for title, root, intro in PARTS:
        r.anchor(title)
        lines += [f"## {title}", "", intro, ""]
        lines += r.table(root, found[root])
    title = "Quality rule parameters"
    r.anchor(title)
    lines += [
        f"## {title}",
        "",
        "A rule's parameters default to the published thresholds; `{rule: {param: "
        "value}}` in a `quality:` list sets them, e.g. `{gopher_repetition: "
        "{dup_line_frac: 0.3}}`. What each rule drops, and why: "
        "[prep.md](prep.md#quality-rules).",
        "",
    ]
    for name, rule in rules().items():
        lines += r.table(name, rule.Params, intro=_first_paragraph(rule))
    text = "\n".join(lines).rstrip("\n") + "\n"
    return r.resolve(text)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in (["write"], ["check"]):
        print("usage: python -m cli.config_docs write|check", file=sys.stderr)
        return 2
    text = render()
    rel = OUT.relative_to(ROOT)
    if args == ["write"]:
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(text, encoding="utf-8")
        print(f"wrote {rel}")
        return 0
    current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
    if current != text:
        print(f"{rel} is stale: run `make docs` (python -m cli.config_docs write)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
