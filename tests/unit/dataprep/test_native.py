"""The compiled module is built by the install and reads pyarrow columns in place."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from dataprep import native


def test_module_is_built() -> None:
    # `make test` must exercise the native kernels: a silent fallback to Python (a build
    # that failed, an import error) fails here instead of passing every test slowly.
    assert native.built(), f"dataprep._native did not import: {native.IMPORT_ERROR}"


def test_switched_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BALLAST_NATIVE", "0")
    assert native.module() is None
    monkeypatch.setenv("BALLAST_NATIVE", "1")
    assert native.module() is not None


@pytest.mark.parametrize("kind", [pa.string(), pa.large_string()])
def test_text_column_reads_offsets_and_data(kind: pa.DataType) -> None:
    values = ["héllo", "", None, "wörld " * 50, "日本語", ""]
    arr = pa.array(values, type=kind)
    m = native.module()
    assert m is not None
    for a in (arr, arr.slice(1), arr.slice(3, 2), arr.slice(6), pa.chunked_array([arr, arr])):
        expected = pc.sum(pc.binary_length(a)).as_py() or 0
        assert m.text_bytes(native.text_column(a)) == expected


def test_text_column_refuses_other_types() -> None:
    with pytest.raises(TypeError, match="string array"):
        native.text_column(pa.array([1, 2]))
