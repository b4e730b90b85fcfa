"""Writes a small real corpus from text that ships with Python (pydoc's topic pages and
the docstrings of standard-library modules), for the demo on machines without
../shared/data. Usage: python -m dataprep.stdlib_corpus OUT_DIR"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import warnings
from pathlib import Path


def topics() -> list[dict]:
    from pydoc_data.topics import topics as t

    return [{"id": f"pydoc/{k}", "text": v} for k, v in sorted(t.items())]


def docstrings() -> list[dict]:
    out = []
    skip = ("test", "idlelib", "tkinter", "turtle", "antigravity", "this", "__")
    for mod in sorted(m.name for m in pkgutil.iter_modules() if m.name in sys.stdlib_module_names):
        if mod.startswith(skip):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m = importlib.import_module(mod)
        except Exception:  # some stdlib modules need optional system libraries
            continue
        for name in sorted(dir(m)):
            obj = getattr(m, name, None)
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 40 and getattr(obj, "__module__", "") == mod:
                out.append({"id": f"doc/{mod}.{name}", "text": doc})
    return out


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("topics", topics()), ("docstrings", docstrings())):
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        print(f"wrote {len(rows)} documents to {out / name}.jsonl")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/stdlib-corpus")
