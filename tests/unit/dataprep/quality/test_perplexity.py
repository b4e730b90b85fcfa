"""The `perplexity` rule: a small model trained here by Ballast's own trainer and exported
with `ballast export hf` scores documents in batches; the batched scores equal a plain
one-document computation; text unlike the training text scores higher; a prep run drops
above `max`, writes meta.perplexity into kept rows and names the rule in dropped rows."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

pytest.importorskip("transformers")

import torch

from dataprep.config import parse_config
from dataprep.pipeline import run_prep
from dataprep.quality import parse_rules
from dataprep.quality.perplexity import context, load, perplexities
from tests.support.factories import train_config
from tests.support.helpers import shared_file, write_jsonl
from training.export_hf import export_hf
from training.train import main as train_main


@pytest.fixture(scope="module")
def model_dir(train_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A byte-level model trained for 80 steps on tinyshakespeare, exported."""
    root = tmp_path_factory.mktemp("ppl-model")
    cfg = root / "train.yaml"
    cfg.write_text(
        yaml.safe_dump(
            train_config(
                train_dataset,
                root / "run",
                steps=80,
                micro_batch=8,
                eval_every=1000,
                optim={"lr": 3e-3},
                checkpoint={"every": 80, "keep_last": 1},
                schedule={"warmup_steps": 5},
            )
        )
    )
    assert train_main(["--config", str(cfg)]) == 0
    out, _arch = export_hf(str(root / "run"), str(root / "hf"))
    return str(out)


def shakespeare(n: int) -> list[str]:
    paras = shared_file("tinyshakespeare.txt").read_text(encoding="utf-8").split("\n\n")
    return [p for p in paras[-400:] if len(p) > 200][:n]  # the end: past the training excerpt


def garbage(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = "qxzj#%&}{~^|0123456789QXZJ"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(150, 400))) for _ in range(n)]


def plain_perplexity(text: str, model_dir: str) -> float:
    """One document, no padding, no batching: the definition."""
    model, tok, _dev = load(model_dir, "cpu", (Path(model_dir) / "config.json").stat().st_mtime)
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"][: context(model)]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    nll = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:])
    return math.exp(nll.item())


def test_batched_scores_equal_one_document_at_a_time(model_dir):
    texts = shakespeare(5) + garbage(3) + ["a", "ab"]  # mixed lengths: padding in batches
    got = perplexities(texts, model_dir, batch_size=4, device="cpu")
    assert got[-2] is None  # one byte token: nothing to predict
    for text, ppl in zip(texts, got, strict=True):
        if ppl is not None:
            assert ppl == pytest.approx(plain_perplexity(text, model_dir), rel=1e-4)


def test_text_unlike_the_reference_scores_higher(model_dir):
    good = perplexities(shakespeare(20), model_dir, device="cpu")
    bad = perplexities(garbage(20), model_dir, device="cpu")
    assert max(good) < min(bad)  # type: ignore[type-var]


def test_prep_drops_above_max_and_records_the_score(model_dir, tmp_path):
    good, bad = shakespeare(12), garbage(6, seed=1)
    docs = [{"id": f"s{i}", "text": t} for i, t in enumerate(good)]
    docs += [{"id": f"g{i}", "text": t} for i, t in enumerate(bad)]
    write_jsonl(tmp_path / "in.jsonl", docs)
    # The cut between the two groups' scores, measured with the same function.
    hi = max(perplexities(good, model_dir, device="cpu"))  # type: ignore[type-var]
    lo = min(perplexities(bad, model_dir, device="cpu"))  # type: ignore[type-var]
    cut = math.sqrt(hi * lo)
    out = tmp_path / "out"
    report = run_prep(
        parse_config(
            {
                "output": str(out),
                "workers": 1,
                "sources": [
                    {"name": "web", "paths": [str(tmp_path / "in.jsonl")], "id_field": "id"}
                ],
                "dedup": {"exact": False, "near": False},
                "quality": [{"perplexity": {"model": model_dir, "max": cut, "batch_size": 5}}],
            }
        ),
        until="quality",
        progress=False,
    )
    q = report["stages"]["quality"]["total"]
    assert (q["docs_in"], q["kept"]) == (18, 12)
    kept = pq.read_table(next((out / "docs" / "quality").rglob("*.parquet"))).to_pylist()
    assert sorted(r["id"] for r in kept) == sorted(d["id"] for d in docs[:12])
    for r in kept:
        assert 1 < json.loads(r["meta"])["perplexity"] <= cut
    dropped = [
        r
        for f in (out / "dropped" / "quality").rglob("*.parquet")
        for r in pq.read_table(f).to_pylist()
    ]
    assert sorted(r["id"] for r in dropped) == sorted(d["id"] for d in docs[12:])
    assert {r["reason"] for r in dropped} == {"perplexity:too_high"}
    assert all(f"> {cut}" in r["detail"] for r in dropped)


def test_a_path_that_is_not_a_model_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"quality\[0\] perplexity.*model.*no config.json"):
        parse_rules([{"perplexity": {"model": str(tmp_path), "max": 100}}])
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(ValueError, match="ballast export hf"):
        parse_rules([{"perplexity": {"model": str(tmp_path), "max": 100}}])
