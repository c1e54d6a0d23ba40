from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.model_dirs.tiny import train_tokenizer

TOKENIZER = train_tokenizer(512)


def decode(ids: list[int]) -> str:
    return str(TOKENIZER.decode(ids, skip_special_tokens=True))


def stream(text: str, prompt: str = "Hello") -> list[str]:
    ids = TOKENIZER.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(decode, TOKENIZER.encode(prompt).ids)
    return [detok.push(i) for i in ids]


def test_multibyte_characters_split_over_tokens_are_emitted_whole() -> None:
    text = "中文 한국어 🚀∑ 日本語 ç"
    ids = TOKENIZER.encode(text, add_special_tokens=False).ids
    assert any("\ufffd" in decode([i]) for i in ids)  # some characters span several byte tokens
    deltas = stream(text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # held back while a character was incomplete


@settings(deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab ç日😀\n.")), max_size=30))
def test_incremental_text_equals_full_decode(text: str) -> None:
    deltas = stream(text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_split_across_deltas_is_not_emitted() -> None:
    matcher = StopStringMatcher(["STOP"])
    emitted = []
    for piece in ["hello S", "T", "OP and more"]:
        text, hit = matcher.feed(piece)
        emitted.append(text)
        if hit:
            break
    assert "".join(emitted) == "hello "
    assert hit


def test_partial_match_that_fails_is_released() -> None:
    matcher = StopStringMatcher(["<end>"])
    assert matcher.feed("a <e") == ("a ", False)
    assert matcher.feed("x") == ("<ex", False)
    assert matcher.feed("<en") == ("", False)
    assert matcher.flush() == "<en"


def test_earliest_of_several_stop_strings_wins() -> None:
    matcher = StopStringMatcher(["cd", "b"])
    assert matcher.feed("abcd") == ("a", True)


def test_no_stop_strings_passes_text_through() -> None:
    assert StopStringMatcher([]).feed("anything") == ("anything", False)
