"""Words where whitespace does not separate them (dataprep/quality/segment.py): ICU's word
segmentation for Chinese, Japanese and Thai, the script fallback when no language rule
labelled a document, and the Gopher rule's per-language thresholds (FineWeb-2's)."""

from __future__ import annotations

import pytest

from dataprep.quality import filter_document, parse_rules
from dataprep.quality.gopher import LANGUAGE_DEFAULTS
from dataprep.quality.segment import count_sentences, script_language, words
from dataprep.quality.text import Doc

# Plain prose written for this test (a short account of a library visit), long enough for
# Gopher's 50-word minimum once segmented.
ZH = (
    "我们今天去北京大学的图书馆参观。图书馆里有很多学生在安静地看书，也有人在电脑前查资料。"
    "管理员告诉我们，这个图书馆是在一九零二年建立的，现在有八百多万本书。我们在三楼看到了一些"
    "很老的地图和手写的信，这些东西都被保存得很好。参观结束以后，大家都觉得这是一次很有意思的"
    "经历，也希望以后还有机会再来。"
)
JA = (
    "私たちは今日、大学の図書館を見学しました。図書館にはたくさんの学生がいて、静かに本を読ん"
    "でいました。司書の方によると、この図書館は千九百二年に建てられ、今では八百万冊以上の本が"
    "あるそうです。三階では古い地図や手書きの手紙を見ることができました。見学の後、みんなはとて"
    "も面白い経験だったと話していました。"
)
TH = (
    "วันนี้พวกเราไปเยี่ยมชมห้องสมุดของมหาวิทยาลัย ในห้องสมุดมีนักศึกษาจำนวนมากที่กำลังอ่านหนังสือ"
    "อย่างเงียบ ๆ บรรณารักษ์บอกว่าห้องสมุดแห่งนี้สร้างขึ้นเมื่อหลายปีก่อน และมีหนังสือมากกว่าแปดล้านเล่ม "
    "ที่ชั้นสามเราได้เห็นแผนที่เก่าและจดหมายที่เขียนด้วยมือ ทุกคนคิดว่าการเยี่ยมชมครั้งนี้เป็นประสบการณ์"
    "ที่น่าสนใจมาก และหวังว่าจะได้กลับมาอีกครั้งในอนาคต"
)


@pytest.mark.parametrize(
    ("text", "lang", "expected"),
    [
        (ZH, "zh", ["北京", "大学", "学生", "电脑"]),
        (JA, "ja", ["図書館", "学生", "地図", "手紙"]),
        (TH, "th", ["มหาวิทยาลัย", "นักศึกษา", "หนังสือ", "บรรณารักษ์"]),
    ],
)
def test_icu_finds_the_words(text: str, lang: str, expected: list[str]) -> None:
    ws = words(text, lang)
    for w in expected:
        assert w in ws, (w, ws[:20])
    assert "".join(ws) == "".join(text.split())  # nothing lost but whitespace
    assert not any(w.isspace() for w in ws)


def test_script_decides_without_a_label() -> None:
    assert script_language(ZH) == "zh"
    assert script_language(JA) == "ja"  # kana with the Han characters
    assert script_language(TH) == "th"
    assert script_language("The Tang poet 李白 wrote about the moon over 长安.") is None
    assert script_language("") is None
    assert Doc(ZH).word_language == "zh" and Doc(ZH).words == words(ZH, "zh")
    # A language rule's label wins over the script.
    assert Doc(ZH, annotations={"language": "en"}).word_language == "en"
    assert Doc(JA, annotations={"language": "ja"}).word_language == "ja"
    english = "Plain English text, nothing else."
    assert Doc(english).word_language is None
    assert Doc(english).words == Doc(english, annotations={"language": "en"}).words


def test_sentences_without_spaces() -> None:
    assert count_sentences("第一句。第二句！第三句？") == 3
    assert count_sentences("他说：「好。」然后走了。") == 2
    assert count_sentences("   ") == 0
    assert Doc(ZH).count_sentences(ZH) == ZH.count("。")


@pytest.mark.parametrize("text", [ZH, JA, TH])
def test_gopher_keeps_prose_in_these_languages(text: str) -> None:
    rules = parse_rules(["gopher_quality"])
    out = filter_document(rules, text)
    assert out.reason is None, out
    assert out.stats["gopher_quality.words"] >= 50
    lang = script_language(text)
    lo = LANGUAGE_DEFAULTS[lang]["min_avg_word_length"]
    hi = LANGUAGE_DEFAULTS[lang]["max_avg_word_length"]
    assert lo <= out.stats["gopher_quality.mean_word_length"] <= hi
    # Split and judged as English, the same text is dropped: that is what ICU fixes.
    (rule,) = rules
    assert rule.apply(Doc(text, annotations={"language": "en"})) is not None


def test_config_overrides_the_language_defaults() -> None:
    rules = parse_rules([{"gopher_quality": {"min_avg_word_length": 3}}])
    out = filter_document(rules, ZH)
    assert out.reason == "gopher_quality:min_avg_word_length"
    # Unset parameters still take the language's defaults: the stop words are Chinese.
    rules = parse_rules([{"gopher_quality": {"min_doc_words": 10}}])
    assert filter_document(rules, ZH).reason is None
