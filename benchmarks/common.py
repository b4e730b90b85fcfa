"""What the benchmarks share: where things are (the repository, the shared data, the
results), the shared-data lookup, result writing, RSS sampling of a process tree, the
generated corpora, `ballast prep` in a process of its own, and the prepared tinyshakespeare
dataset the training benchmarks use.

Only the standard library at import time (everything else is imported inside the
function that needs it): datatrove_compare and spacy_reference run in virtual
environments of their own, without the project's dependencies, and import this module.
"""

from __future__ import annotations

import contextlib
import gettext
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results"

# The shared web and code corpora (dedup's, the prep benchmarks' and the scale corpus's base).
CORPORA = [
    "web_openwebtext_1k.jsonl",
    "web_c4_olmo_fixtures.jsonl",
    "web_dolma_cc_fixtures.jsonl",
    "code_python_cosqa_dev.jsonl",
    "code_humanevalx.jsonl",
    "code_java_methods_codexglue_flat.jsonl",
]
WORD = re.compile(r"[A-Za-z0-9_\x80-\U0010ffff]+")


# ---- the shared data, results ---------------------------------------------------------
def have_shared(*names: str) -> bool:
    """Whether every one of `names` is a file under ../shared/data (the benchmarks that
    need them print why they skip and exit 0 when not)."""
    return all((SHARED / n).is_file() for n in names)


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "load_avg": os.getloadavg()}


def write_json(
    path: str | Path, obj: Any, *, indent: int = 2, end: str = "\n", ensure_ascii: bool = True
) -> Path:
    """`obj` as JSON at `path` (its folder made if missing); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(obj, indent=indent, ensure_ascii=ensure_ascii) + end, encoding="utf-8"
    )
    return out


def du(path: Path) -> int:
    """Bytes of the files under `path` (0 when it is absent)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


# ---- measuring ------------------------------------------------------------------------
class TreeRSS:
    """Samples the summed RSS of a process and all its descendants (/proc); keeps the
    (time, rss) samples so peaks can be attributed to steps, and each process's own peak
    (`per_pid`)."""

    def __init__(self, pid: int, interval: float = 0.05):
        self.pid, self.interval, self.peak, self._stop = pid, interval, 0, threading.Event()
        self.samples: list[tuple[float, int]] = []
        self.per_pid: dict[int, int] = {}
        self._t = threading.Thread(target=self._run, daemon=True)

    def _tree(self, pid: int) -> list[int]:
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            for task in Path(f"/proc/{p}/task").glob("*"):
                with contextlib.suppress(OSError):
                    todo += [int(c) for c in (task / "children").read_text().split()]
        return out

    def sample(self) -> int:
        total = 0
        for p in self._tree(self.pid):
            try:
                for line in Path(f"/proc/{p}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        rss = int(line.split()[1]) * 1024
                        total += rss
                        self.per_pid[p] = max(self.per_pid.get(p, 0), rss)
            except OSError:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = self.sample()
            self.samples.append((time.time(), rss))
            self.peak = max(self.peak, rss)
            time.sleep(self.interval)

    def __enter__(self) -> TreeRSS:
        self._t.start()
        return self

    def __exit__(self, *a: object) -> None:
        self._stop.set()
        self._t.join()


def run_prep_process(cfg: dict, workdir: Path, until: str | None = None) -> dict:
    """`ballast prep` in its own process, so the peak RSS measured is the pipeline's
    process tree alone (not the benchmark's copy of the corpus)."""
    import yaml

    out = Path(cfg["output"])
    workdir.mkdir(parents=True, exist_ok=True)
    cfg_path = workdir / f"config-{out.name}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "cli.main",
        "prep",
        str(cfg_path),
        "--no-progress",
        *(["--until", until] if until else []),
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    with TreeRSS(proc.pid) as rss:
        if proc.wait() != 0:
            raise SystemExit(f"ballast prep failed with exit code {proc.returncode}")
    wall = time.perf_counter() - t0
    report = prep_report(out)
    return {
        "report": report,
        "wall": wall,
        "peak_rss": rss.peak,
        "samples": rss.samples,
        "out": out,
    }


def prep_report(out: Path) -> dict[str, Any]:
    """report.json of the newest dataset version of prep output `out` (each version's
    report lives in <out>/vNNNN/, and <out>/dataset/latest names the newest)."""
    version = (out / "dataset" / "latest").read_text().strip()
    return json.loads((out / version / "report.json").read_text())


def has_dataset(dataset: Path) -> bool:
    """A finished prep's dataset directory (`latest` is written last)."""
    return (dataset / "latest").is_file()


# ---- generated corpora: planted duplicates in memory (dedup, prep stages) --------------
def edit(text: str, frac: float, rng: random.Random) -> str:
    words = text.split(" ")
    k = max(1, round(frac * len(words)))
    for i in rng.sample(range(len(words)), min(k, len(words))):
        words[i] = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6))
    return " ".join(words)


def load_base() -> list[str]:
    texts = []
    for name in CORPORA:
        with open(SHARED / name, encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f]
    return texts


def remix(base: list[str], rng: random.Random) -> str:
    """A new distinct document: random 30-word windows from random base documents."""
    parts = []
    for _ in range(rng.randint(2, 8)):
        w = rng.choice(base).split(" ")
        i = rng.randrange(max(1, len(w) - 30))
        parts.append(" ".join(w[i : i + 30]))
    return "\n".join(parts)


def build_corpus(n_docs: int, seed: int) -> tuple[list[str], dict[str, int]]:
    """Originals + planted copies: ~5% exact copies, ~10% with 1-3% word edits, ~10% with
    5-10% word edits (most of those fall below J=0.8 on 5-grams, by design: the ground
    truth decides). Beyond the base corpus, distinct remixed documents fill the size."""
    rng = random.Random(seed)
    base = load_base()
    n_orig = int(n_docs * 0.75)
    originals = list(base)
    while len(originals) < n_orig:
        originals.append(remix(base, rng))
    originals = originals[:n_orig]
    planted = {"exact": 0, "edit_1_3": 0, "edit_5_10": 0}
    docs = list(originals)
    while len(docs) < n_docs:
        src = rng.choice(originals)
        r = rng.random()
        if r < 0.2:
            docs.append(src)
            planted["exact"] += 1
        elif r < 0.6:
            docs.append(edit(src, rng.uniform(0.01, 0.03), rng))
            planted["edit_1_3"] += 1
        else:
            docs.append(edit(src, rng.uniform(0.05, 0.10), rng))
            planted["edit_5_10"] += 1
    rng.shuffle(docs)
    return docs, planted


def write_corpus(docs: list[str], workdir: Path) -> Path:
    corpus = workdir / "corpus.jsonl"
    corpus.parent.mkdir(parents=True, exist_ok=True)
    with open(corpus, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": f"d{i}", "text": d}) + "\n")
    return corpus


def string_shingles(text: str, n: int) -> set[str]:
    w = WORD.findall(text.lower())
    if len(w) < n:
        return {" ".join(w)} if w else set()
    return {" ".join(w[i : i + n]) for i in range(len(w) - n + 1)}


# ---- the scale corpus: streamed to disk, any document from (seed, index) ---------------
class ScaleCorpus:
    """Document i of the corpus, from (seed, i) alone. A copy points at an earlier index
    and copies whatever document is there (copies of copies make near-duplicate chains)."""

    def __init__(self, seed: int):
        self.seed = seed
        self.base = []
        for name in CORPORA:
            if name.startswith("web_"):
                with open(SHARED / name, encoding="utf-8") as f:
                    self.base += [json.loads(line)["text"] for line in f]
        self.lines = [
            ls for ls in ([x for x in t.split("\n") if x.strip()] for t in self.base) if ls
        ]
        self.vocab = [w for t in self.base for w in t.split() if w.isalpha()]

    def _rng(self, i: int) -> random.Random:
        return random.Random(self.seed * 1_000_003 + i * 7919 + 17)

    def source_of(self, i: int) -> tuple[str, int]:
        """('orig', -1) or (kind of copy, index copied)."""
        if i < len(self.base):
            return "orig", -1
        rng = self._rng(i)
        if rng.random() >= 0.25:
            return "orig", -1
        r = rng.random()
        kind = "exact" if r < 0.2 else "edit_1_3" if r < 0.6 else "edit_5_10"
        return kind, rng.randrange(i)

    def text(self, i: int) -> str:
        if i < len(self.base):
            return self.base[i]
        kind, j = self.source_of(i)
        rng = self._rng(i)
        rng.random(), rng.random(), rng.random()  # the draws source_of made
        if kind == "orig":
            # Runs of consecutive lines of web pages (prose that the web rules keep) with
            # two fifths of the plain words swapped for words drawn from the same pages: two
            # originals that share a line share almost no 5-gram, so the duplicate
            # structure (and the cost per document) does not change with the corpus size.
            parts = []
            vocab, rand, n_vocab = self.vocab, rng.random, len(self.vocab)
            for _ in range(rng.randint(1, 3)):
                ls = self.lines[rng.randrange(len(self.lines))]
                k = rng.randrange(len(ls))
                for line in ls[k : k + rng.randint(1, 2)]:
                    parts.append(
                        " ".join(
                            vocab[int(rand() * n_vocab)] if w.isalpha() and rand() < 0.4 else w
                            for w in line.split(" ")
                        )
                    )
            return "\n".join(parts)
        src = self.text(j)
        if kind == "exact":
            return src
        lo, hi = (0.01, 0.03) if kind == "edit_1_3" else (0.05, 0.10)
        return edit(src, rng.uniform(lo, hi), rng)


def _write_part(args: tuple[int, int, int, str]) -> int:
    seed, lo, hi, path = args
    c = ScaleCorpus(seed)
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for i in range(lo, hi):
            line = json.dumps({"id": f"d{i}", "text": c.text(i)}) + "\n"
            n += len(line.encode("utf-8"))
            f.write(line)
    return n


def build_scale_corpus(n_docs: int, seed: int, workdir: Path, procs: int) -> Path:
    """corpus-N.jsonl, generated in parallel parts and joined; reused when present."""
    path = workdir / f"corpus-{n_docs}.jsonl"
    done = path.with_suffix(".done")
    if done.exists():
        return path
    workdir.mkdir(parents=True, exist_ok=True)
    step = 200_000
    jobs = [
        (seed, lo, min(lo + step, n_docs), str(workdir / f".part-{lo:012d}"))
        for lo in range(0, n_docs, step)
    ]
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(procs) as pool:
        pool.map(_write_part, jobs, chunksize=1)
    with open(path, "wb") as out:
        for *_, p in jobs:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out, 16 << 20)
            os.unlink(p)
    done.write_text(
        json.dumps(
            {
                "docs": n_docs,
                "seed": seed,
                "bytes": path.stat().st_size,
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    )
    return path


# ---- the offline multilingual sample (langid, segment) --------------------------------
LOCALE = Path("/usr/share/locale")
ENGLISH = SHARED / "web_openwebtext_1k.jsonl"
MIN_MESSAGE = 40
# Printf/brace format codes and menu mnemonics ("_File", "&Open"): not language.
_NOISE = re.compile(r"%(?:\d+\$)?[-+ #0]*\d*(?:\.\d+)?[a-zA-Z]|\{[^}]*\}|(?<!\w)[_&](?=\w)")


def messages(catalog_dir: Path) -> list[str]:
    """The translated messages of a gettext catalog directory of at least MIN_MESSAGE
    characters, not equal to their English original, format codes and mnemonics removed."""
    out: list[str] = []
    for mo in sorted(catalog_dir.glob("LC_MESSAGES/*.mo")):
        try:
            with open(mo, "rb") as f:
                catalog = gettext.GNUTranslations(f)._catalog  # type: ignore[attr-defined]
        except (OSError, UnicodeError, ValueError):  # a damaged or non-UTF-8 catalog
            continue
        for key, msgstr in catalog.items():
            msgid = key[0] if isinstance(key, tuple) else key
            if not msgid or not isinstance(msgstr, str) or msgstr.strip() == msgid.strip():
                continue
            text = " ".join(_NOISE.sub("", msgstr).split())
            if len(text) >= MIN_MESSAGE:
                out.append(text)
    return out


def english(n: int, min_chars: int = 300) -> list[str]:
    """The first ~450 characters of the first `n` shared OpenWebText documents of at least
    `min_chars` characters (whitespace collapsed)."""
    docs = []
    with open(ENGLISH, encoding="utf-8") as f:
        for line in f:
            text = " ".join(json.loads(line)["text"].split())
            if len(text) >= min_chars:
                docs.append(text[:450].rsplit(" ", 1)[0])
            if len(docs) == n:
                break
    return docs


# ---- the prepared tinyshakespeare dataset (train_cpu, mup, hpo, recipe_cost) -----------
def prepared_dataset() -> Path | None:
    """train_cpu's prepared tinyshakespeare dataset (byte tokens, seq_len 64), made on
    first use (one training step is the cheapest way to it), for the benchmarks that train
    on it; None when the shared text is absent."""
    text_path = SHARED / "tinyshakespeare.txt"
    if not text_path.is_file():
        return None
    dataset = ROOT / "runs" / "bench-train" / "prep" / "dataset"
    if not has_dataset(dataset):
        from benchmarks.train_cpu import ballast_run

        text = text_path.read_text(encoding="utf-8")
        ballast_run(text, int(0.9 * len(text)), 1, ROOT / "runs" / "bench-train", 1e-3)
    return dataset
