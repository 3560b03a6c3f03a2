"""The incremental detokenizer with SmolLM2's real tokenizer: streamed deltas rebuild the
text exactly, never split a UTF-8 character, and stop strings are found across token
boundaries without ever being emitted, even in part."""

import pytest

from kvmesh.worker.engine_loop.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def stream(tokenizer, text: str, stop=(), prompt="Say something:") -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), stop)
    deltas = []
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        detok.push(token_id)
        deltas.append(detok.take_delta(finished=False))
        if detok.stop_hit is not None:
            break
    deltas.append(detok.take_delta(finished=True))
    return deltas, detok


@pytest.mark.parametrize("text", [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnewlines  ",
    "Ünïcödé, 中文字符 and emoji 🎉🚀 mixed in.",
    "x" * 100 + " a long run that moves the window many times " * 3,
])
def test_deltas_rebuild_the_text_and_are_whole_characters(tokenizer, text):
    deltas, detok = stream(tokenizer, text)
    expected = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=True)
    assert "".join(deltas) == expected == detok.text
    assert not any("\ufffd" in d for d in deltas)


def test_a_multibyte_character_waits_for_its_last_token(tokenizer):
    ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits the emoji: the case this guards
    detok = IncrementalDetokenizer(tokenizer, [])
    for token_id in ids[:-1]:
        detok.push(token_id)
        assert detok.take_delta(finished=False) == ""
    detok.push(ids[-1])
    assert detok.take_delta(finished=False) == "🎉"


def test_stop_string_across_tokens_is_cut_and_never_emitted(tokenizer):
    deltas, detok = stream(tokenizer, "Hello world, goodbye world, see you.", stop=("bye wor",))
    assert detok.stop_hit == "bye wor"
    assert "".join(deltas) == "Hello world, good"
    assert not any("bye" in d or d.endswith(("b", "by")) for d in deltas[:-1])


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    _, detok = stream(tokenizer, "alpha beta gamma delta", stop=("delta", "beta"))
    assert detok.stop_hit == "beta" and detok.text == "alpha "


def test_holdback_releases_text_that_turned_out_not_to_be_a_stop(tokenizer):
    deltas, detok = stream(tokenizer, "one two three", stop=("two and",))
    assert detok.stop_hit is None
    assert "".join(deltas) == "one two three"


def test_nothing_after_a_stop_is_taken(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=("STOP",))
    for token_id in tokenizer.encode("go STOP more text", add_special_tokens=False):
        detok.push(token_id)
    assert detok.stop_hit == "STOP" and detok.take_delta(finished=True) == "go "
