"""What every reader yields, and the checks every record goes through whatever its format:
a parsed record (or a text) becomes a `RawDoc`, or a `BadRecord` with a quarantine reason,
a detail and its exact location. A bad record never stops a file."""

from __future__ import annotations

import json
import math
import unicodedata
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from dataprep.records import LOCATION_KEY

if TYPE_CHECKING:
    from dataprep.config import ExtractConfig, SourceConfig

RAW_LIMIT = 64 * 1024  # characters (or bytes) of a bad record kept for display


@dataclass(slots=True)
class RawDoc:
    id: str
    text: str
    meta: dict
    location: str
    # The text's UTF-8 bytes, as validation measured them (-1: not measured).
    nbytes: int = field(default=-1, compare=False)


@dataclass(slots=True)
class BadRecord:
    reason: str
    detail: str
    location: str
    raw: str  # the record for display: cut after RAW_LIMIT, with a marker
    id: str | None  # None when the record never parsed far enough to have an id
    # Bytes of the whole record in the input (a jsonl line without its line ending, a txt
    # file or paragraph, an arrow record rendered as JSON); 0 for a broken stream.
    size: int


def _raw_bytes(b: bytes) -> str:
    if len(b) > RAW_LIMIT:
        return b[:RAW_LIMIT].decode("utf-8", "backslashreplace") + _marker(len(b), "bytes")
    return b.decode("utf-8", "backslashreplace")


def _raw_str(s: str) -> str:
    if len(s) > RAW_LIMIT:
        return s[:RAW_LIMIT] + _marker(len(s), "characters")
    return s


def _marker(total: int, unit: str) -> str:
    return f"\n…[truncated by ballast: {total} {unit} in all]"


def _render(obj: Any) -> str:
    try:
        return json.dumps(obj, ensure_ascii=False, default=str)
    except (ValueError, TypeError, RecursionError):
        return repr(obj)


def bad(
    reason: str, detail: str, loc: str, raw: Any, doc_id: str | None, size: int | None = None
) -> BadRecord:
    """A bad record. `raw` is the record's source bytes (a jsonl line, txt data), a str,
    or an arrow record (rendered as JSON); it is cut for display, while `size` (unless
    given) is the whole of it in bytes, line ending excluded."""
    if isinstance(raw, bytes | bytearray):
        b = bytes(raw).rstrip(b"\r\n")
        return BadRecord(
            reason, detail, loc, _raw_bytes(b), doc_id, len(b) if size is None else size
        )
    s = raw if isinstance(raw, str) else _render(raw)
    if size is None:
        size = len(s.encode("utf-8", "surrogatepass"))
    return BadRecord(reason, detail, loc, _raw_str(s), doc_id, size)


def corrupt(loc: str, e: BaseException) -> BadRecord:
    """A broken stream or file: nothing from `loc` on can be read."""
    msg = str(e) or type(e).__name__
    return bad(
        "corrupt_file", f"cannot read on from here: {type(e).__name__}: {msg}", loc, "", None, 0
    )


def _type_name(v: Any) -> str:
    names = {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
        type(None): "null",
    }
    return names.get(type(v), type(v).__name__)


# Passed through to meta as they are; floats are checked (NaN, infinities) by _jsonable.
_JSON_NON_FLOAT_SCALARS = (str, int, bool, type(None))


class NonFinite(Exception):
    """A number that standard JSON cannot hold: NaN, Infinity, or a literal too big for
    a float (which Python would read, and write back, as Infinity)."""


def _refuse_constant(token: str) -> Any:
    raise NonFinite(f"{token} is not a JSON number (RFC 8259 has no NaN or Infinity)")


def _finite_float(token: str) -> float:
    v = float(token)
    if math.isinf(v):
        raise NonFinite(
            f"the number {token} is out of range of a 64-bit float (it would "
            "be read and written back as Infinity)"
        )
    return v


# json.loads, except that NaN/Infinity/-Infinity and overflowing numbers raise NonFinite:
# Python reads them by default, and json.dumps would write them back as non-standard JSON.
decode_json = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float).decode


def _jsonable(v: Any) -> Any:
    """Arrow's Python values made JSON-serialisable, so meta is the same kind of thing
    whatever the input format. Raises NonFinite for a NaN or infinite float."""
    if isinstance(v, _JSON_NON_FLOAT_SCALARS):
        return v
    if isinstance(v, float):
        if not math.isfinite(v):
            raise NonFinite(
                f"holds {v!r}, which JSON cannot represent (RFC 8259 has no NaN or Infinity)"
            )
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, datetime | date | time):
        return v.isoformat()
    if isinstance(v, timedelta):
        return v.total_seconds()
    if isinstance(v, bytes):
        return v.decode("utf-8", "backslashreplace")
    if isinstance(v, Decimal):
        return str(v)  # keeps every digit, which a float would not
    return str(v)


_MISSING = object()


class Records:
    """Turns parsed records and texts into RawDoc/BadRecord; one per (source, file)."""

    __slots__ = ("extract", "id_field", "max_bytes", "name", "source", "text_field")

    def __init__(
        self, source: SourceConfig, max_doc_bytes: int, extract: ExtractConfig | None = None
    ):
        self.source = source  # for format options (txt_unit)
        self.extract = extract  # ingest.extract, for the HTML formats (None: its defaults)
        self.name = source.name
        self.text_field = source.text_field
        self.id_field = source.id_field
        self.max_bytes = max_doc_bytes

    def record(self, obj: Any, loc: str, raw: Any, arrow: bool = False) -> RawDoc | BadRecord:
        """`raw` is the record's source bytes (jsonl) or the record itself (arrow); it is
        only rendered for bad records."""
        if type(obj) is not dict:
            return bad(
                "not_an_object", f"expected a JSON object, got {_type_name(obj)}", loc, raw, None
            )
        idf = self.id_field
        if idf is not None and idf in obj:
            v = obj[idf]
            # type() rather than isinstance: True is an int, but never a meaningful id.
            if type(v) is str and v:
                doc_id = v
            elif type(v) is int:
                doc_id = str(v)
            else:
                got = "empty string" if v == "" else _type_name(v)
                return bad(
                    "bad_id",
                    f"field {idf!r} must be a non-empty string or an integer, got {got}",
                    loc,
                    raw,
                    None,
                )
        else:
            doc_id = f"{self.name}/{loc}"
        tf = self.text_field
        text = obj.get(tf, _MISSING)
        if text is _MISSING:
            keys = ", ".join(list(obj)[:20]) + (", …" if len(obj) > 20 else "")
            return bad(
                "missing_text",
                f"field {tf!r} is missing; fields present: {keys or '(none)'}",
                loc,
                raw,
                doc_id,
            )
        if type(text) is not str:
            return bad(
                "wrong_type",
                f"field {tf!r} must be a string, got {_type_name(text)}",
                loc,
                raw,
                doc_id,
            )
        if LOCATION_KEY in obj and tf != LOCATION_KEY:
            # Ingest stores the document's location under this name; overwriting the
            # record's own field would lose it, so the record is kept whole here instead.
            return bad(
                "reserved_field",
                f"field {LOCATION_KEY!r} is reserved: ingest "
                "stores each document's location under it in "
                "meta; rename the field",
                loc,
                raw,
                doc_id,
            )
        if arrow:
            # A new dict: `raw` is this same record and must keep its text for quarantine.
            # (Strings from arrow are valid UTF-8; floats may be NaN or infinite.)
            try:
                meta = {
                    k: v if isinstance(v, _JSON_NON_FLOAT_SCALARS) else _jsonable(v)
                    for k, v in obj.items()
                    if k != tf
                }
            except NonFinite as e:
                return bad("non_finite_number", _non_finite_field(obj, tf, e), loc, raw, doc_id)
        else:
            del obj[tf]  # jsonl's raw is the line's bytes, so the parsed dict is ours
            meta = obj
            # A \uD800-\uDFFF escape can leave an unpaired surrogate in a value, a field
            # name or the id, which no UTF-8 writer accepts (the text is checked below).
            # Only lines with such an escape (escaped pairs are common) pay for the check.
            if (b"\\ud" in raw or b"\\uD" in raw) and (surrogate := _surrogate_in(meta)):
                return bad(
                    "invalid_utf8",
                    f"metadata has an unpaired surrogate {surrogate} "
                    "(from a \\u escape), which is not UTF-8",
                    loc,
                    raw,
                    doc_id,
                )
        return self.text(text, meta, doc_id, loc, raw)

    def text(
        self, text: str, meta: dict, doc_id: str, loc: str, raw: Any, size: int | None = None
    ) -> RawDoc | BadRecord:
        """`size`: the record's bytes in the input when `raw` is not all of it."""
        # isascii() is O(1) on CPython and true for most web text: skip NFC and encoding.
        if text.isascii():
            nbytes = len(text)
        else:
            text = unicodedata.normalize("NFC", text)
            try:
                nbytes = len(text.encode("utf-8"))
            except UnicodeEncodeError as e:
                # JSON "\ud800" escapes decode to lone surrogates, which no UTF-8 writer
                # (Arrow included) accepts.
                return bad(
                    "invalid_utf8",
                    f"text has an unpaired surrogate "
                    f"U+{ord(text[e.start]):04X} at character "
                    f"{e.start}",
                    loc,
                    raw,
                    doc_id,
                    size,
                )
        if nbytes > self.max_bytes:
            return bad(
                "too_large",
                f"text is {nbytes} bytes, over max_doc_bytes={self.max_bytes}",
                loc,
                raw,
                doc_id,
                size,
            )
        if "\x00" in text:
            return bad(
                "nul_bytes",
                f"text has a NUL character at index {text.index(chr(0))}",
                loc,
                raw,
                doc_id,
                size,
            )
        if not text or text.isspace():
            return bad(
                "empty_text",
                "text is empty" if not text else "text is only whitespace",
                loc,
                raw,
                doc_id,
                size,
            )
        return RawDoc(doc_id, text, meta, loc, nbytes)


def _non_finite_field(obj: dict, tf: str, e: NonFinite) -> str:
    """The detail for an arrow record with a NaN/infinite float: which field."""
    for k, v in obj.items():
        if k != tf:
            try:
                _jsonable(v)
            except NonFinite:
                return f"field {k!r} {e}"
    return str(e)


def _surrogate_in(meta: dict) -> str | None:
    """'U+D800' for the first unpaired surrogate in `meta` (values and names), or None."""
    try:
        json.dumps(meta, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return f"U+{ord(e.object[e.start]):04X}"
    return None
