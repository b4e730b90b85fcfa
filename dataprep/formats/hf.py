"""hf: a directory written by `datasets`' save_to_disk (a Dataset or a DatasetDict), one
record per row, read through Arrow; from local disk only, never split. Locations:
`<rel>[/<split>]#row=<n>`, 1-based."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from dataprep.formats.base import Format, InputFile
from dataprep.formats.validate import BadRecord, RawDoc, Records, corrupt

_DICT_MARKER = "dataset_dict.json"
_MARKERS = ("dataset_info.json", "state.json")


def is_dir(has: Callable[[str], bool]) -> bool:
    return has(_DICT_MARKER) or all(has(m) for m in _MARKERS)


def read(recs: Records, f: InputFile, path: str) -> Iterator[RawDoc | BadRecord]:
    import datasets  # slow to import; only hf sources pay for it

    rel = f.rel
    try:
        loaded = datasets.load_from_disk(path)
    except Exception as e:  # datasets raises a zoo of types for a damaged directory
        yield corrupt(f"{rel}#row=1", e)
        return
    if isinstance(loaded, datasets.DatasetDict):
        splits = [(f"{rel}/{name}", loaded[name]) for name in sorted(loaded)]
    else:
        splits = [(rel, loaded)]
    for prefix, ds in splits:
        row = 0
        # The arrow format skips feature decoding and honours an indices mapping.
        for table in ds.with_format("arrow").iter(batch_size=1024):
            for rec in table.to_pylist():
                row += 1
                yield recs.record(rec, f"{prefix}#row={row}", rec, arrow=True)


FORMAT = Format(
    name="hf",
    read=read,
    is_dir=is_dir,
    dir_noun="datasets.save_to_disk directory",
    dir_hint=f"has neither {_DICT_MARKER} nor {' + '.join(_MARKERS)} (write it with "
    "datasets' save_to_disk)",
)
