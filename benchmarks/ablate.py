"""Benchmark: a data ablation end to end (the `ablate` flow, flows/ablate.py): does the
default web quality chain train a better small model than no filter, and does a fastText
quality classifier on top of it help?

    python -m benchmarks.ablate [--tokenizer bpe] [--tokens 819200] [--seeds 0 1 2]
                                [--parallel 2] [--workdir runs/bench-ablate]
                                [--out benchmarks/results/ablate.json]

The data (generated under --workdir, never committed):
- `web`: the shared OpenWebText pages (../shared/data/web_openwebtext_1k.jsonl) but the
  last --heldout, plus the shared C4 and Dolma Common Crawl fixtures;
- `noise`, planted, made from the same pages (--noise pages per web page, the kinds in
  turn, --noise-kinds): shuffled-word documents (a page's words in random order, its line
  lengths kept), boilerplate-heavy pages (a few sentences of a page inside navigation,
  share buttons, link lists and footers) and markup pages (the page's text left in its
  HTML); scrambled-letter documents (each word's letters in random order) on request;
- the clean held-out set: the last --heldout OpenWebText pages (their first --heldout-chars
  characters), in no arm's sources.

The arms: `base` = Ballast's default web chain (configs/demo.yaml's quality list),
`no_filter` = `quality: []`, `web_classifier` = the chain followed by the `classifier` rule
with a fastText model trained here by `ballast quality train` on
../shared/data/web_dclm_quality_labels_train.jsonl (the threshold it chooses). Every arm's
proxy (seq_len 256, d_model 128, 2 layers, 16 rows a step, QK-norm and z-loss) trains to
the same token budget from each seed, two at a time on the local backend, and is scored by
bits per byte on the held-out set after its last step. The flow runs on a temporary local
Prefect API.

The proxy's tokens (--tokenizer, decided before the first run with it, not after): `bpe`
(the default) is one byte-level BPE of --vocab ids trained here on every source's documents
unfiltered (web and noise: the no_filter arm's data, so if the tokenizer favours an arm it
is that one) and given to every arm as `tokenizer: {kind: file}`, so the arms differ only
in their documents. Why not bytes, the earlier default: with byte tokens, a 2-layer proxy
spends its budget learning spelling, which the planted noise teaches as well as clean text
does (shuffled-word pages keep every word, markup pages keep the page's whole text,
boilerplate keeps sentences), and in three runs (results/ablate.json,
ablate_2x_tokens.json, ablate_2x_tokens_stable.json) no_filter never ranked last. FineWeb's,
DCLM's and OLMo's ablations train subword-token proxies: a token is mostly a word, and a
2-layer model predicts the next word from the previous ones from its first steps, the
statistic shuffled words destroy and link lists and navigation skew. The default budget,
819,200 tokens (200 steps), is under one epoch of every filtered arm's kept tokens (no
repetition to confound the comparison) and about the byte proxy's training time.
QK-norm and z-loss (--stable, now the default) because the byte runs without them had one
seed stall on the early plateau (a 0.24 bpb seed spread from one run of one arm).

Two more views of the held-out pages are scored, to read the verdict by, not to decide it:
the pages the base chain keeps, raw, and as the chain leaves them (its line rules applied):
a filter that edits documents trains on text unlike the raw pages it is then scored on.

Reported: each arm's bpb per seed, mean, standard error and range (and on the two
views); whether `no_filter` ranks last with a gap to the next arm larger than the seed
spread (both arms' ranges, and the flow's 2-standard-error mark); the arms' reuse records
(stages, files, bytes); one arm's prep seconds with the base's stages reused vs from
scratch (`ballast prep` in a process of its own, both); wall times. Skips with a message
when the shared data is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, ROOT, SHARED, have_shared, machine, write_json

OWT = "web_openwebtext_1k.jsonl"
FIXTURES = ["web_c4_olmo_fixtures.jsonl", "web_dolma_cc_fixtures.jsonl"]
LABELS = "web_dclm_quality_labels_train.jsonl"
# Ballast's default web rules: configs/demo.yaml's quality list.
WEB_CHAIN: list[Any] = ["char_repetition", "length", "gopher_quality", "gopher_repetition"]
WEB_CHAIN += ["c4", "fineweb"]
SEQ_LEN = 256
NOISE_KINDS = ["shuffled_words", "boilerplate", "scrambled_letters", "markup"]
# scrambled_letters is not a default: the default chain keeps most of it (the benchmark's
# second run), so it makes no difference between `base` and `no_filter` to measure.
DEFAULT_NOISE = ["shuffled_words", "boilerplate", "markup"]

# Boilerplate a page template wraps around its content (navigation, sharing, footers).
NAV = ["Home", "About Us", "Contact", "Blog", "News", "Shop", "Privacy Policy", "Terms of Use"]
NAV += ["Log in", "Sign up", "Subscribe", "Search", "Menu", "FAQ", "Careers", "Sitemap"]
SHARE = ["Share this:", "Facebook", "Twitter", "Pinterest", "LinkedIn", "Email", "Print"]
SHARE += ["Like this:", "Like Loading..."]
FOOTER = [
    "Leave a Reply Cancel reply",
    "Your email address will not be published. Required fields are marked *",
    "Save my name, email, and website in this browser for the next time I comment.",
    "This site uses cookies. By continuing to browse the site you agree to our use of cookies.",
    "Accept",
    "Copyright © 2019 All rights reserved.",
    "Powered by WordPress | Theme by Example Themes",
    "Back to top",
]


# ---- the data ---------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return path


def shuffled_words(text: str, rng: random.Random) -> str:
    """The page's words in random order, each line keeping its number of words."""
    lines = [ln.split() for ln in text.split("\n")]
    words = [w for ln in lines for w in ln]
    rng.shuffle(words)
    out, i = [], 0
    for ln in lines:
        out.append(" ".join(words[i : i + len(ln)]))
        i += len(ln)
    return "\n".join(out)


def scrambled_letters(text: str, rng: random.Random) -> str:
    """Each word's letters in random order (garbled text: OCR debris, obfuscated spam),
    punctuation, spacing and the letters' frequencies kept."""

    def scramble(w: str) -> str:
        cs = list(w)
        at = [i for i, c in enumerate(cs) if c.isalpha()]
        letters = [cs[i] for i in at]
        rng.shuffle(letters)
        for i, c in zip(at, letters, strict=True):
            cs[i] = c
        return "".join(cs)

    return "\n".join(" ".join(scramble(w) for w in ln.split(" ")) for ln in text.split("\n"))


def markup_page(text: str, rng: random.Random) -> str:
    """The page's text left inside its HTML (a failed extraction): head, inline style and
    script, every paragraph a tagged element, one word in five a link."""
    uid = rng.randint(10_000_000, 99_999_999)

    def linked(w: str) -> str:
        if not w.isalpha() or rng.random() > 0.2:
            return w
        return f'<a href="https://www.example.com/tag/{w.lower()}" rel="tag">{w}</a>'

    paras = [ln for ln in text.split("\n") if ln.strip()]
    body = "\n".join(
        f'<p class="p{k % 4}">' + " ".join(linked(w) for w in ln.split(" ")) + "</p>"
        for k, ln in enumerate(paras)
    )
    return "\n".join(
        [
            '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            "<style>body{margin:0;font-family:Arial,sans-serif}.nav a{color:#333;"
            "text-decoration:none}.p0{line-height:1.6}</style>",
            "<script>window.dataLayer=window.dataLayer||[];function gtag(){dataLayer.push("
            f'arguments);}}gtag("js",new Date());gtag("config","UA-{uid}-1");</script>',
            '</head><body><div id="page" class="site"><div class="entry-content">',
            body,
            "</div></div></body></html>",
        ]
    )


def boilerplate_page(text: str, vocab: list[str], rng: random.Random) -> str:
    """A few sentences of the page inside a template: navigation, share buttons, link lists
    of titles made of the corpus's words, and a footer (most lines short, many repeated)."""
    sentences = [s.strip() for s in text.replace("\n", " ").split(". ") if s.strip()]
    snippet = ". ".join(sentences[: rng.randint(2, 4)]) + "."
    nav = " | ".join(rng.sample(NAV, 8))

    def titles(n: int) -> list[str]:
        return [
            " ".join(rng.choice(vocab).title() for _ in range(rng.randint(3, 7))) for _ in range(n)
        ]

    lines = [nav, "Skip to content", "Posted by admin", snippet, *SHARE, "Related"]
    lines += titles(rng.randint(6, 12))
    lines += ["Recent Posts", *titles(rng.randint(5, 10)), *SHARE, "Categories"]
    lines += [*titles(rng.randint(4, 8)), "Tags: " + ", ".join(rng.sample(vocab, 12))]
    return "\n".join([*lines, *FOOTER, nav])


def make_data(
    data: Path, heldout: int, heldout_chars: int, noise_frac: float, kinds: list[str], seed: int
) -> dict:
    """The sources and the held-out set under `data`; returns what was made."""
    rng = random.Random(seed)
    owt = read_jsonl(SHARED / OWT)
    train, held = owt[:-heldout], owt[-heldout:]
    web = [{"id": d["id"], "text": d["text"]} for d in train]
    for name in FIXTURES:
        web += [
            {"id": f"{name}:{i}", "text": d["text"]}
            for i, d in enumerate(read_jsonl(SHARED / name))
        ]
    vocab = sorted({w for d in train for w in d["text"].split() if w.isalpha() and len(w) > 2})
    n = round(noise_frac * len(train))
    picks = [i for _ in range(n // len(train)) for i in range(len(train))]
    picks += rng.sample(range(len(train)), n - len(picks))
    noise = []
    for j, i in enumerate(picks):
        text, kind = train[i]["text"], kinds[j % len(kinds)]
        if kind == "shuffled_words":
            noisy = shuffled_words(text, rng)
        elif kind == "scrambled_letters":
            noisy = scrambled_letters(text, rng)
        elif kind == "markup":
            noisy = markup_page(text, rng)
        else:
            noisy = boilerplate_page(text, vocab, rng)
        noise.append({"id": f"{kind}-{j}-{i}", "text": noisy})
    held_rows = [{"id": d["id"], "text": d["text"][:heldout_chars]} for d in held]
    write_jsonl(data / "web.jsonl", web)
    write_jsonl(data / "noise.jsonl", noise)
    write_jsonl(data / "heldout.jsonl", held_rows)

    def size(rows: list[dict]) -> dict[str, int]:
        return {"docs": len(rows), "bytes": sum(len(r["text"].encode()) for r in rows)}

    return {
        "web": size(web),
        "noise": size(noise),
        "noise_kinds": {k: sum(r["id"].startswith(f"{k}-") for r in noise) for k in kinds},
        "heldout": size(held_rows),
    }


# ---- the configs ------------------------------------------------------------------------
def train_classifier(work: Path) -> tuple[Path, dict[str, Any]]:
    """`ballast quality train` on the labelled DCLM pages; the model and its report."""
    model = work / "quality" / "dclm.bin"
    model.parent.mkdir(parents=True, exist_ok=True)
    ballast = str(Path(sys.executable).with_name("ballast"))
    cmd = [ballast, "quality", "train", "--labelled", str(SHARED / LABELS), "--out", str(model)]
    subprocess.run(cmd, cwd=ROOT, check=True)
    return model, json.loads(model.with_suffix(".report.json").read_text())


def heldout_views(data: Path) -> dict[str, Any]:
    """Two more views of the held-out pages, to read the verdict by: the pages the base
    chain keeps, raw (`heldout_kept.jsonl`), and as the chain leaves them
    (`heldout_chain.jsonl`: its line rules applied). The verdict is on the raw pages; these
    say how much of an arm's score is the held-out text's likeness to its own data."""
    from dataprep.quality import filter_documents, parse_rules

    held = read_jsonl(data / "heldout.jsonl")
    out = filter_documents(parse_rules(WEB_CHAIN), [d["text"] for d in held], [None] * len(held))
    kept = [(d, o.text) for d, o in zip(held, out, strict=True) if o.text is not None]
    write_jsonl(data / "heldout_kept.jsonl", [{"id": d["id"], "text": d["text"]} for d, _ in kept])
    write_jsonl(data / "heldout_chain.jsonl", [{"id": d["id"], "text": t} for d, t in kept])
    return {
        "pages": len(held),
        "kept_by_chain": len(kept),
        "bytes_raw": sum(len(d["text"].encode()) for d in held),
        "bytes_kept_raw": sum(len(d["text"].encode()) for d, _ in kept),
        "bytes_kept_after_chain": sum(len(t.encode()) for _, t in kept),
    }


def train_tokenizer(work: Path, vocab: int) -> tuple[Path, dict[str, Any]]:
    """One byte-level BPE for every arm, trained on every source's documents unfiltered;
    its path and bytes per token on each source and on the held-out set."""
    from dataprep.tokenizer import train_bpe

    data = work / "data"
    rows = {n: read_jsonl(data / f"{n}.jsonl") for n in ("web", "noise", "heldout")}
    tok = train_bpe((r["text"] for n in ("web", "noise") for r in rows[n]), vocab)
    path = work / "tokenizer.json"
    path.write_text(tok.to_json(), encoding="utf-8")

    def bytes_per_token(texts: list[str]) -> float:
        ids = tok.encode_batch(texts)
        return sum(len(t.encode()) for t in texts) / max(1, sum(len(i) for i in ids))

    return path, {
        "kind": "bpe",
        "vocab_size": tok.vocab_size,
        "trained_on": "web + noise, unfiltered",
        "bytes_per_token": {
            n: round(bytes_per_token([r["text"] for r in rows[n]]), 3) for n in rows
        },
    }


def write_configs(
    work: Path, model: Path, tokenizer: Path | None, args: argparse.Namespace
) -> Path:
    import yaml

    data = work / "data"
    prep = {
        "output": str(work / "unused"),  # each arm's output is under the ablation's `out`
        "seed": 0,
        "workers": 2,
        "sources": [
            {"name": "web", "paths": [str(data / "web.jsonl")]},
            {"name": "noise", "paths": [str(data / "noise.jsonl")]},
        ],
        "dedup": {"exact": True, "near": {"threshold": 0.8, "num_perm": 128, "ngram": 5}},
        "quality": WEB_CHAIN,
        "pack": {"seq_len": SEQ_LEN},
        "dataset": {"validation_fraction": 0.02},
    }
    if tokenizer is not None:
        prep["tokenizer"] = {"kind": "file", "path": str(tokenizer)}
    proxy = {
        "dataset": "-",
        "run_dir": "-",
        "steps": 1,  # the ablation sets it from the token budget
        "micro_batch": args.micro_batch,
        "eval_every": 100_000,  # the validation loss after the last step only
        "eval_batches": 2,
        # --stable: QK-norm and z-loss, the fixes Wortsman et al. (2023, "Small-scale
        # proxies for large-scale Transformer training instabilities") give for a small
        # model at a high learning rate. Without them one web_classifier seed of the default
        # run leaves the early plateau late and ends 0.2 bpb behind its arm's other seeds
        # (5 seeds, 400 steps: 2.857, 3.056, 2.801, 2.844, 2.853); with them every seed is
        # off the plateau by step 40 (2.919, 2.891, 2.851, 2.833, 2.876).
        "model": {"d_model": 128, "n_layer": 2, "n_head": 4, "qk_norm": args.stable},
        "precision": {"z_loss": 1e-4 if args.stable else 0.0},
        "optim": {"name": "adamw", "lr": 3e-3},
        "schedule": {"kind": "cosine", "warmup_steps": 40},
        # Equal token budgets (the rule): a spike skip drops a batch and a rollback
        # (to the last checkpoint: step 0 here) trains past the data window, so with the
        # guards on an arm's proxies train on other tokens than its budget. In the runs
        # with them on (results/ablate.json, ablate_2x_tokens.json) the web_classifier
        # proxies skipped 3-5 steps each and one rolled back to step 0. Non-finite steps
        # are still skipped (never off).
        "guards": {"enabled": args.guards == "on"},
        "checkpoint": {"every": 100_000, "keep_last": 1},
        "launch": {"backend": "local", "nproc_per_node": 1, "max_restarts": 0},
    }
    ablation = {
        "base": str(work / "prep.yaml"),
        "out": str(work / "out"),
        "arms": {
            "no_filter": {"quality": []},
            "web_classifier": {"quality": [*WEB_CHAIN, {"classifier": {"model": str(model)}}]},
        },
        "proxy": {"config": str(work / "proxy.yaml"), "tokens": args.tokens, "seeds": args.seeds},
        "evals": {
            "every": 100_000,  # after the last step only
            "texts": [
                {"name": "owt_heldout", "path": str(data / "heldout.jsonl")},
                {"name": "owt_heldout_kept", "path": str(data / "heldout_kept.jsonl")},
                {"name": "owt_heldout_chain", "path": str(data / "heldout_chain.jsonl")},
            ],
            "limit": None,
            "regression": None,
        },
        "parallel": args.parallel,
    }
    for name, doc in (("prep", prep), ("proxy", proxy), ("ablate", ablation)):
        (work / f"{name}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return work / "ablate.yaml"


# ---- prep seconds with and without the base's stages -------------------------------------
def timed_prep(pc: Any, out: Path, seed_from: Any | None) -> dict[str, Any]:
    """`ballast prep` of `pc` into a fresh `out` in a process of its own, after copying
    `seed_from`'s reusable stages into it (as the flow does) when given."""
    import yaml

    from dataprep.config import parse_config
    from dataprep.reuse import seed_output

    shutil.rmtree(out, ignore_errors=True)
    doc = pc.model_dump(mode="json", exclude={"version"})
    doc["output"] = str(out)
    cfg = parse_config(doc, str(out))
    t0 = time.perf_counter()
    reuse = seed_output(seed_from, cfg) if seed_from is not None else None
    seeded = time.perf_counter() - t0
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    cmd = [sys.executable, "-m", "cli.main", "prep", str(path), "--no-progress"]
    t1 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return {
        "prep_s": round(time.perf_counter() - t1, 1),
        "seed_s": round(seeded, 2),
        "reused": reuse.stages if reuse else [],
        "files": reuse.files if reuse else 0,
    }


# ---- the verdict -------------------------------------------------------------------------
def verdict(r: dict[str, Any], key: str) -> dict[str, Any]:
    """Each arm's values over seeds, the ranking (lower bpb is better), and whether
    `no_filter` is last by more than the seed spread."""
    import numpy as np

    arms: dict[str, Any] = {}
    for arm, seeds in r["proxies"].items():
        xs = [seeds[s]["values"][key] for s in sorted(seeds, key=int)]
        a = np.asarray(xs)
        cell = r["table"][arm][key]
        arms[arm] = {
            "per_seed": {s: round(seeds[s]["values"][key], 5) for s in sorted(seeds, key=int)},
            "mean": round(float(a.mean()), 5),
            "stderr": round(cell["stderr"], 5),
            "range": round(float(a.max() - a.min()), 5),
            "diff_to_base": None if cell["diff"] is None else round(cell["diff"], 5),
            "beyond_2_stderr": cell["significant"],
            "tokens": r["tokens"][arm],
            "skipped_steps": {s: seeds[s].get("skipped_steps") for s in sorted(seeds, key=int)},
            "rollbacks": {s: seeds[s].get("rollbacks") for s in sorted(seeds, key=int)},
        }
    ranking = sorted(arms, key=lambda a: arms[a]["mean"])  # best first
    last = ranking[-1]
    gap = arms["no_filter"]["mean"] - min(arms[a]["mean"] for a in arms if a != "no_filter")
    worst_other = max((a for a in arms if a != "no_filter"), key=lambda a: arms[a]["mean"])
    gap_next = arms["no_filter"]["mean"] - arms[worst_other]["mean"]
    spread = max(arms["no_filter"]["range"], arms[worst_other]["range"])
    separated = min(arms["no_filter"]["per_seed"].values()) > max(
        arms[worst_other]["per_seed"].values()
    )
    return {
        "key": key,
        "arms": arms,
        "ranking_best_first": ranking,
        "no_filter_last": last == "no_filter",
        "gap_to_next_arm": round(gap_next, 5),
        "gap_to_best_arm": round(gap, 5),
        "next_arm": worst_other,
        "seed_spread": round(spread, 5),
        "gap_larger_than_seed_spread": last == "no_filter" and gap_next > spread,
        "every_no_filter_seed_worse_than_every_next_arm_seed": separated,
        "pass": last == "no_filter" and gap_next > spread,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tokenizer",
        choices=["bpe", "bytes"],
        default="bpe",
        help="the proxies' tokens: one BPE for every arm (default) or UTF-8 bytes",
    )
    ap.add_argument("--vocab", type=int, default=4096, help="the BPE's vocabulary size")
    ap.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="each proxy's token budget (default 819,200 with bpe, 1,638,400 with bytes)",
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--heldout", type=int, default=100, help="last OWT pages held out")
    ap.add_argument("--heldout-chars", type=int, default=2000)
    ap.add_argument("--noise", type=float, default=1.5, help="noise pages per web page")
    ap.add_argument("--noise-kinds", nargs="+", choices=NOISE_KINDS, default=DEFAULT_NOISE)
    ap.add_argument("--skip-timing", action="store_true", help="no prep-with/without-reuse runs")
    ap.add_argument(
        "--stable",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="proxies with QK-norm and z-loss 1e-4 (default; --no-stable: without)",
    )
    ap.add_argument(
        "--guards",
        choices=["off", "on"],
        default="off",
        help="the proxies' spike skipping and rollback (off: every proxy trains its budget)",
    )
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bench-ablate"))
    ap.add_argument("--out", default=str(RESULTS / "ablate.json"))
    args = ap.parse_args()
    if args.tokens is None:
        args.tokens = 819_200 if args.tokenizer == "bpe" else 1_638_400
    if not have_shared(OWT, LABELS, *FIXTURES):
        print(f"skip: {OWT}, {LABELS} or the web fixtures not found in {SHARED}")
        return
    t_all = time.perf_counter()
    work = Path(args.workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)  # an ablation from scratch, not a resumed one
    work.mkdir(parents=True)
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect-home"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "300")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # two proxies on two cores

    made = make_data(
        work / "data", args.heldout, args.heldout_chars, args.noise, args.noise_kinds, 0
    )
    made["heldout_views"] = heldout_views(work / "data")
    t0 = time.perf_counter()
    model, creport = train_classifier(work)
    classifier_s = time.perf_counter() - t0
    tok_path, tok_report = None, {"kind": "bytes"}
    if args.tokenizer == "bpe":
        tok_path, tok_report = train_tokenizer(work, args.vocab)
    path = write_configs(work, model, tok_path, args)

    from flows.ablate import ablate, summary_text
    from flows.ablation.config import BASE, load_ablation_config

    t0 = time.perf_counter()
    r = ablate(str(path))
    flow_s = time.perf_counter() - t0
    print(summary_text(r))
    v = verdict(r, "owt_heldout/bpb")
    # The same reading on the held-out views (not the criterion: the raw pages are).
    views = {k: verdict(r, f"{k}/bpb") for k in ("owt_heldout_kept", "owt_heldout_chain")}

    timing: dict[str, Any] = {}
    if not args.skip_timing:
        ab = load_ablation_config(path)
        arm = "web_classifier"
        base = ab.prep[BASE]
        t = work / "timing"
        timing = {
            "arm": arm,
            "with_reuse": timed_prep(ab.prep[arm], t / "reuse", base),
            "from_scratch": timed_prep(ab.prep[arm], t / "scratch", None),
            "base_from_scratch": timed_prep(base, t / "base", None),
        }
    from core.dataset import read_manifest, resolve

    # Each arm's packed training tokens and how many times its proxies read them.
    train_tokens = {
        arm: int(read_manifest(resolve(p["dataset"]))["splits"]["train"]["tokens"])
        for arm, p in r["arms"].items()
    }
    epochs = {arm: round(args.tokens / n, 3) for arm, n in train_tokens.items()}
    reuse = {
        arm: {k: p["reuse"][k] for k in ("stages", "first_redone", "files", "bytes")}
        for arm, p in r["arms"].items()
        if p["reuse"]
    }
    result = {
        "command": "python -m benchmarks.ablate " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "data": made,
        "classifier": {
            "threshold": creport.get("threshold"),
            "held_out": creport.get("held_out"),
            "train_s": round(classifier_s, 1),
        },
        "proxy": {
            "model": "d_model 128, 2 layers, 4 heads, seq_len 256",
            "tokenizer": tok_report,
            "optim": "AdamW lr 3e-3, cosine, 40 warmup steps",
            "stable": "QK-norm, z-loss 1e-4" if args.stable else None,
            "micro_batch": args.micro_batch,
            "tokens": args.tokens,
            "seeds": args.seeds,
            "parallel": args.parallel,
            "guards": args.guards,
        },
        "kept": {arm: p["kept"] for arm, p in r["arms"].items()},
        "train_tokens": train_tokens,
        "epochs": epochs,
        "verdict": v,
        "verdict_on_views": views,
        "reuse": reuse,
        "prep_timing": timing,
        "table": r["rows"],
        "wall_s": {
            "flow": round(flow_s, 1),
            "total": round(time.perf_counter() - t_all, 1),
        },
    }
    out = write_json(args.out, result)
    print(
        f"\nno_filter last: {v['no_filter_last']}; gap to {v['next_arm']}: "
        f"{v['gap_to_next_arm']:+.4f} bpb vs seed spread {v['seed_spread']:.4f} "
        f"-> {'PASS' if v['pass'] else 'MISS'}"
    )
    for k, x in views.items():
        order = ", ".join(f"{a} {x['arms'][a]['mean']:.4f}" for a in x["ranking_best_first"])
        print(f"{k} (not the criterion), best first: {order}")
    read = ", ".join(f"{a} {e}" for a, e in epochs.items())
    print(f"epochs of each arm's training tokens: {read}")
    for arm, x in reuse.items():
        print(
            f"{arm}: reused {', '.join(x['stages'])}: {x['files']} files, {x['bytes'] / 1e6:.1f} MB"
        )
    if timing:
        print(
            f"prep of {timing['arm']}: {timing['with_reuse']['prep_s']} s with the base's "
            f"stages, {timing['from_scratch']['prep_s']} s from scratch"
        )
    print(f"wall: flow {flow_s:.0f} s, total {result['wall_s']['total']:.0f} s; {out}")


if __name__ == "__main__":
    main()
