"""Tokenizers: bytes (always), and BPE / tokenizer.json files when HF `tokenizers` is there.

BPE tests train once per module on 300 OpenWebText documents at vocab 1000 (about a
second), and hold out later documents for compression and round-trip checks.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dataprep.config import TokenizerConfig
from dataprep.tokenizer import (
    EOS_TOKEN,
    PAD_TOKEN,
    Tokenizer,
    build_tokenizer,
    byte_tokenizer,
    load_tokenizer,
    train_bpe,
)
from tests.support.helpers import ROOT, read_jsonl, shared_file

OWT = "web_openwebtext_1k.jsonl"
TRAIN_DOCS = 300
BPE_VOCAB = 1000

# Strings that break naive byte/char handling: multi-byte scripts, emoji with ZWJ and
# skin-tone modifiers, combining marks, control characters (no NUL), leading/trailing and
# repeated whitespace, and a literal special-token string inside a document.
TRICKY = [
    "",
    " ",
    "   leading spaces",
    "trailing spaces   ",
    "\ttab\nnewline\r\ncrlf\n\n\n",
    "héllo wörld — “quotes” ‘single’ …",
    "日本語のテキストと中文文本，한국어 텍스트",
    "emoji 👩‍👩‍👧‍👦 👍🏽 🇩🇪 🤗",
    "combining e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937",
    "controls \x01\x02\x07\x1b[31m\x7f\u200b\u2028\ufeff",
    "Ω≈ç√∫˜µ≤≥÷ 𝕳𝖊𝖑𝖑𝖔 \U0010fffd",
    "a <|endoftext|> b <|pad|> c",
]


# ---------------------------------------------------------------------------------------
# bytes


def test_bytes_ids_and_round_trip() -> None:
    tok = byte_tokenizer()
    assert (tok.kind, tok.vocab_size, tok.eos_id, tok.pad_id) == ("bytes", 258, 256, 257)
    arrays = tok.encode_batch(TRICKY)
    assert len(arrays) == len(TRICKY)
    for text, ids in zip(TRICKY, arrays, strict=True):
        assert ids.dtype == np.int32
        assert ids.tolist() == list(text.encode("utf-8"))  # no EOS appended
        assert ids.size == 0 or int(ids.max()) < 256  # specials are outside the byte range
        assert tok.decode(ids) == text
        assert tok.decode(ids.tolist()) == text


def test_bytes_decode_specials_and_bad_ids() -> None:
    tok = byte_tokenizer()
    a, b = tok.encode_batch(["é", "x"])
    ids = [*a.tolist(), tok.eos_id, *b.tolist(), tok.pad_id]
    assert tok.decode(ids) == f"é{EOS_TOKEN}x{PAD_TOKEN}"
    # A row cut in the middle of a character decodes with a replacement char, not an error.
    assert tok.decode(a[:1]) == "\ufffd"
    for bad in ([258], [-1], [0, 1000]):
        with pytest.raises(ValueError, match="out of range"):
            tok.decode(bad)


def test_bytes_json_load_and_sha() -> None:
    tok = byte_tokenizer()
    body = json.loads(tok.to_json())
    assert body["ballast_tokenizer"] == "bytes"
    assert (body["eos_id"], body["pad_id"], body["vocab_size"]) == (256, 257, 258)
    assert tok.sha256() == byte_tokenizer().sha256()
    assert len(tok.sha256()) == 64
    again = load_tokenizer(tok.to_json())
    assert (again.kind, again.vocab_size, again.eos_id, again.pad_id) == ("bytes", 258, 256, 257)
    assert again.sha256() == tok.sha256()


def test_bytes_pickle() -> None:
    tok = pickle.loads(pickle.dumps(byte_tokenizer()))
    assert (tok.kind, tok.sha256()) == ("bytes", byte_tokenizer().sha256())
    assert tok.encode_batch(["é"])[0].tolist() == [0xC3, 0xA9]


def test_bytes_load_from_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(byte_tokenizer().to_json(), encoding="utf-8")
    assert load_tokenizer(str(tmp_path / "tokenizer.json")).kind == "bytes"
    assert load_tokenizer(str(tmp_path)).kind == "bytes"  # a directory holding tokenizer.json


def test_build_bytes_and_bpe_without_texts() -> None:
    assert build_tokenizer(TokenizerConfig(), None).kind == "bytes"
    with pytest.raises(ValueError, match="needs training texts"):
        build_tokenizer(TokenizerConfig(kind="bpe", vocab_size=512), None)


def test_bad_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ValueError, match=f"{re.escape(str(missing))} does not exist"):
        load_tokenizer(str(missing))
    with pytest.raises(ValueError, match="does not exist"):
        build_tokenizer(TokenizerConfig(kind="file", path=str(missing)), None)
    with pytest.raises(ValueError, match=r"tokenizer\.json does not exist"):
        load_tokenizer(str(tmp_path))  # a directory without tokenizer.json
    broken = tmp_path / "broken.json"
    broken.write_text('{"model": ', encoding="utf-8")
    with pytest.raises(ValueError, match=f"{re.escape(str(broken))} is not valid JSON"):
        load_tokenizer(str(broken))
    array = tmp_path / "array.json"
    array.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ValueError, match="not a JSON object"):
        load_tokenizer(str(array))
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00junk")
    with pytest.raises(ValueError, match=f"cannot read tokenizer file {re.escape(str(binary))}"):
        load_tokenizer(str(binary))
    future = tmp_path / "future.json"
    future.write_text(json.dumps({"ballast_tokenizer": "bytes16", "vocab_size": 65538}))
    with pytest.raises(ValueError, match="does not know"):
        load_tokenizer(str(future))


def test_missing_tokenizers_package_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # sys.modules[name] = None makes `import tokenizers` raise ImportError, installed or not.
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ValueError, match="need the Hugging Face `tokenizers` package"):
        train_bpe(["some text"], 300)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    with pytest.raises(ValueError, match="need the Hugging Face `tokenizers` package"):
        load_tokenizer(str(path))
    assert load_tokenizer(byte_tokenizer().to_json()).kind == "bytes"  # bytes needs nothing


def test_bytes_encode_batch_views_are_independent() -> None:
    # encode_batch returns views into one buffer; writing to one must not touch another.
    tok = byte_tokenizer()
    a, b = tok.encode_batch(["ab", "cd"])
    a[:] = 0
    assert b.tolist() == [ord("c"), ord("d")]


# ---------------------------------------------------------------------------------------
# BPE and tokenizer.json files (need HF `tokenizers`)


@pytest.fixture(scope="module")
def owt_texts() -> list[str]:
    return [r["text"] for r in read_jsonl(shared_file(OWT))]


@pytest.fixture(scope="module")
def bpe(owt_texts: list[str]) -> Tokenizer:
    pytest.importorskip("tokenizers")
    return train_bpe(owt_texts[:TRAIN_DOCS], BPE_VOCAB)


def test_bpe_ids_and_compression(bpe: Tokenizer, owt_texts: list[str]) -> None:
    assert bpe.kind == "bpe"
    assert (bpe.eos_id, bpe.pad_id) == (0, 1)
    assert bpe.vocab_size == BPE_VOCAB
    held_out = owt_texts[TRAIN_DOCS : TRAIN_DOCS + 200]
    arrays = bpe.encode_batch(held_out)
    assert all(a.dtype == np.int32 for a in arrays)
    assert all(a.size == 0 or (a.min() >= 0 and a.max() < bpe.vocab_size) for a in arrays)
    # Nothing special is emitted for ordinary text: no EOS appended, no PAD.
    assert not any(np.isin(a, [bpe.eos_id, bpe.pad_id]).any() for a in arrays)
    n_bytes = sum(len(t.encode("utf-8")) for t in held_out)
    n_tokens = sum(a.size for a in arrays)
    # Byte-level BPE with 1000 symbols on English web text: typically ~2.5-3 bytes/token on
    # unseen documents; 2.0 leaves room for corpus drift while still proving real merges.
    assert n_bytes / n_tokens > 2.0, f"{n_bytes / n_tokens:.2f} bytes/token"


def test_bpe_round_trip(bpe: Tokenizer, owt_texts: list[str]) -> None:
    texts = TRICKY + owt_texts[TRAIN_DOCS : TRAIN_DOCS + 50]
    for text, ids in zip(texts, bpe.encode_batch(texts), strict=True):
        assert bpe.decode(ids) == text


def test_bpe_special_strings_are_plain_text(bpe: Tokenizer) -> None:
    (ids,) = bpe.encode_batch([f"before {EOS_TOKEN} after {PAD_TOKEN}"])
    assert bpe.eos_id not in ids.tolist() and bpe.pad_id not in ids.tolist()
    assert bpe.decode([*ids.tolist(), bpe.eos_id]).endswith(f"{PAD_TOKEN}{EOS_TOKEN}")


def test_bpe_pickle(bpe: Tokenizer) -> None:
    # What a worker process receives: same kind, same JSON, and special-token strings still
    # encoded as plain text.
    tok = pickle.loads(pickle.dumps(bpe))
    assert (tok.kind, tok.sha256(), tok.eos_id, tok.pad_id) == ("bpe", bpe.sha256(), 0, 1)
    texts = [*TRICKY, f"x {EOS_TOKEN} y"]
    got = [a.tolist() for a in tok.encode_batch(texts)]
    assert got == [a.tolist() for a in bpe.encode_batch(texts)]
    assert bpe.eos_id not in got[-1]


def test_bpe_deterministic_in_process(bpe: Tokenizer, owt_texts: list[str]) -> None:
    again = train_bpe(owt_texts[:TRAIN_DOCS], BPE_VOCAB)
    assert again.to_json() == bpe.to_json()
    assert again.sha256() == bpe.sha256()


def test_bpe_deterministic_across_processes(bpe: Tokenizer) -> None:
    # A fresh interpreter has a different Python hash seed and different Rust hash-map
    # seeds; one rayon thread also rules out any dependence on thread scheduling.
    script = textwrap.dedent(f"""
        import json, sys
        from dataprep.tokenizer import train_bpe
        with open({str(shared_file(OWT))!r}, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for _, line in zip(range({TRAIN_DOCS}), f)]
        sys.stdout.write(train_bpe(texts, {BPE_VOCAB}).sha256())
    """)
    env = {**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == bpe.sha256()


def test_bpe_save_load(bpe: Tokenizer, owt_texts: list[str], tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(bpe.to_json(), encoding="utf-8")
    texts = TRICKY + owt_texts[TRAIN_DOCS : TRAIN_DOCS + 50]
    want = [a.tolist() for a in bpe.encode_batch(texts)]
    for loaded in (load_tokenizer(str(path)), load_tokenizer(bpe.to_json())):
        assert loaded.kind == "file"
        assert (loaded.vocab_size, loaded.eos_id, loaded.pad_id) == (BPE_VOCAB, 0, 1)
        assert [a.tolist() for a in loaded.encode_batch(texts)] == want
        assert loaded.sha256() == bpe.sha256()


def test_build_bpe_caps_train_docs(owt_texts: list[str]) -> None:
    pytest.importorskip("tokenizers")
    seen = 0

    def texts() -> Any:
        nonlocal seen
        for t in owt_texts:
            seen += 1
            yield t

    cfg = TokenizerConfig(kind="bpe", vocab_size=300, train_docs=20)
    tok = build_tokenizer(cfg, texts)
    assert tok.kind == "bpe" and tok.vocab_size <= 300
    assert seen == 20  # the generator was not drained past train_docs


def _foreign_tokenizer(specials: list[str], template_eos: str | None = None) -> str:
    """A tokenizer.json as other projects ship them: its own special tokens, optionally a
    post-processor that appends EOS (as Llama-style tokenizers do)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(["hello world, hello tokenizers"] * 10, trainer=trainer)
    if template_eos is not None:
        eos_id = hf.token_to_id(template_eos)
        hf.post_processor = processors.TemplateProcessing(
            single=f"$A {template_eos}", special_tokens=[(template_eos, eos_id)]
        )
    return str(hf.to_str(pretty=True))


def test_file_kind_eos_and_pad(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    path = tmp_path / "tokenizer.json"
    # Llama-style: </s> is EOS, no pad token -> pad falls back to EOS.
    path.write_text(_foreign_tokenizer(["<unk>", "<s>", "</s>"], template_eos="</s>"))
    tok = build_tokenizer(TokenizerConfig(kind="file", path=str(path)), None)
    assert (tok.kind, tok.eos_id, tok.pad_id) == ("file", 2, 2)
    assert 259 < tok.vocab_size <= 300  # 256 bytes + 3 specials + merges (few: tiny corpus)
    (ids,) = tok.encode_batch(["hello world"])
    assert tok.eos_id not in ids.tolist()  # the file's post-processor is not applied
    assert tok.decode(ids) == "hello world"

    # Both candidates present: the first in preference order wins, pad is found.
    path.write_text(_foreign_tokenizer(["<pad>", "<eos>", "</s>"]))
    tok = load_tokenizer(str(path))
    assert (tok.eos_id, tok.pad_id) == (2, 0)


def test_file_kind_errors(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    no_eos = tmp_path / "no_eos.json"
    no_eos.write_text(_foreign_tokenizer(["<unk>", "<s>"]))
    looked_for = re.escape("<|endoftext|>, </s>, <eos>")
    with pytest.raises(ValueError, match=f"{re.escape(str(no_eos))}.*{looked_for}"):
        load_tokenizer(str(no_eos))
    not_hf = tmp_path / "not_hf.json"
    not_hf.write_text(json.dumps({"model": {"type": "nonsense"}}))
    with pytest.raises(ValueError, match=re.escape(f"{not_hf} is not a Hugging Face")):
        load_tokenizer(str(not_hf))
