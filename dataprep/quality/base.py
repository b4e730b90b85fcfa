"""The rule interface: a rule reads a `Doc` and keeps it, edits it, or drops it with a
named check and the measured value that failed."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Generic, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field

from dataprep.quality.text import Doc

# A threshold that is a fraction; rules allow `Fraction | None` where a config may switch
# the check off.
Fraction = Annotated[float, Field(ge=0, le=1)]


class RuleParams(BaseModel):
    """Base of every rule's parameters: unknown keys are errors, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True, slots=True)
class Drop:
    check: str  # e.g. "min_doc_words"; the reason becomes "<rule>:<check>"
    detail: str  # e.g. "words=12 < 50"


# What a rule returns: None keeps the text as it is, a str replaces it, a Drop drops it.
Verdict = Drop | str | None


P = TypeVar("P", bound=RuleParams)


class Rule(ABC, Generic[P]):
    """A quality rule. Subclasses set `name` (the config key) and `Params` (their
    parameter model); `Rule(**params)` validates keyword parameters like a config does."""

    name: ClassVar[str]
    Params: ClassVar[type[RuleParams]]

    def __init__(self, params: P | None = None, **kwargs: Any) -> None:
        if params is not None and kwargs:
            raise TypeError("pass either a params object or keyword parameters, not both")
        self.params: P = params if params is not None else cast(P, self.Params(**kwargs))
        self.setup()

    def setup(self) -> None:
        """Precompute what the parameters imply (sets, regexes); runs once per rule."""

    @abstractmethod
    def apply(self, doc: Doc) -> Verdict: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params!r})"


def fmt(x: float) -> str:
    """Measured values in drop details: 3 significant decimals, no float noise."""
    return f"{x:.3g}" if isinstance(x, float) else str(x)
