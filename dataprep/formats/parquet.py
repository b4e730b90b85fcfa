"""parquet: one record per row (read through Arrow, as hf datasets are). A big file is
split into runs of row groups. Locations: `<rel>#row=<n>`, 1-based. Parquet compresses
internally, and an outer gzip/zstd layer is not something a reader can seek in, so
`.parquet.gz` is not taken."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from dataprep.formats.base import Format, InputFile
from dataprep.formats.validate import BadRecord, RawDoc, Records, corrupt


def read(recs: Records, f: InputFile, path: str) -> Iterator[RawDoc | BadRecord]:
    """All rows, or those of row groups [first, stop) numbered from `f.first_record`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rel = f.rel
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        yield corrupt(f"{rel}#row={f.first_record}", e)
        return
    row = f.first_record - 1
    groups = None if f.row_groups is None else range(*f.row_groups)
    with pf:
        try:
            # Row batches, not whole row groups: a row group of long documents can be GBs.
            for batch in pf.iter_batches(batch_size=1024, row_groups=groups):
                for rec in batch.to_pylist():
                    row += 1
                    yield recs.record(rec, f"{rel}#row={row}", rec, arrow=True)
        except (pa.ArrowException, OSError) as e:
            yield corrupt(f"{rel}#row={row + 1}", e)


def split(f: InputFile, unit_bytes: int) -> list[InputFile]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        md = pq.read_metadata(f.uri)
    except (pa.ArrowException, OSError):
        return [f]  # the reader reports it, as corrupt_file
    # [first row group, stop, first row, compressed bytes]
    runs: list[list[int]] = []
    row = 1
    for i in range(md.num_row_groups):
        rg = md.row_group(i)
        nbytes = sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
        if runs and runs[-1][3] + nbytes <= unit_bytes:
            runs[-1][1] = i + 1
            runs[-1][3] += nbytes
        else:
            runs.append([i, i + 1, row, nbytes])
        row += rg.num_rows
    if len(runs) <= 1:
        return [f]  # one (huge) row group, or all of them within one unit
    return [
        replace(f, size=nbytes, row_groups=(first, stop), first_record=first_row, file_size=f.size)
        for first, stop, first_row, nbytes in runs
    ]


FORMAT = Format(
    name="parquet", read=read, extensions=(".parquet",), parts="row_groups", split=split
)
