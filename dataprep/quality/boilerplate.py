"""`boilerplate`: drop documents that contain any of a list of strings, such as template
filler or the notice a page shows in place of its content."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from dataprep.quality.base import Drop, Rule, RuleParams, Verdict
from dataprep.quality.lists import read_list, readable_list
from dataprep.quality.text import Doc

# Placeholder text, and the notices of pages that render nothing without scripts or
# cookies. C4 drops "lorem ipsum" pages too; the rest are this project's choice.
BOILERPLATE = ("lorem ipsum", "javascript is disabled", "enable cookies")


class BoilerplateParams(RuleParams):
    strings: tuple[str, ...] = Field(
        default=BOILERPLATE,
        description=(
            "Strings that drop a document (not empty); replaces the built-in list when given."
        ),
    )
    file: str | None = Field(
        default=None, description=("A file of more strings, one a line, added to `strings`.")
    )
    case_sensitive: bool = Field(
        default=False, description=("Match case (line breaks are still ignored).")
    )

    @field_validator("strings")
    @classmethod
    def _non_empty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s.strip() for s in v):
            raise ValueError("an empty string would match every document")
        return v

    @field_validator("file")
    @classmethod
    def _readable(cls, v: str | None) -> str | None:
        return readable_list(v)

    @model_validator(mode="after")
    def _something(self) -> BoilerplateParams:
        if not self.strings and self.file is None:
            raise ValueError("give strings or a file of them")
        return self


class Boilerplate(Rule[BoilerplateParams]):
    """Drops a document containing one of the strings. Matching ignores case (unless
    `case_sensitive`) and treats any run of whitespace as one space, so a string still
    matches across a line break. Meant for tens of strings, each searched in turn."""

    name = "boilerplate"
    Params = BoilerplateParams

    def setup(self) -> None:
        p = self.params
        strings = [*p.strings, *(read_list(p.file) if p.file is not None else ())]
        self._needles = list(dict.fromkeys(self._normalise(s) for s in strings))

    def _normalise(self, text: str) -> str:
        text = " ".join(text.split())
        return text if self.params.case_sensitive else text.lower()

    def apply(self, doc: Doc) -> Verdict:
        text = self._normalise(doc.text)
        for needle in self._needles:
            if needle in text:
                return Drop("string", f"contains {needle[:60]!r}")
        return None
