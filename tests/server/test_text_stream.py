"""TextStream: incremental text with stop strings held back and cut, tokens released with text."""

from __future__ import annotations

import pytest

from server.text import TextStream

VOCAB = ["Hel", "lo", " wor", "ld", "!", " STOP", "ST", "OP", "", "é"]


class ListDecoder:
    """Token id i decodes to VOCAB[i]."""

    def step(self, token_id: int) -> str:
        return VOCAB[token_id]


def ids(*pieces: str) -> list[int]:
    return [VOCAB.index(p) for p in pieces]


def run(pieces: list[str], stop: list[str] | None, one_at_a_time: bool = True):
    stream = TextStream(ListDecoder(), stop)
    deltas = []
    token_ids = ids(*pieces)
    batches = [[t] for t in token_ids] if one_at_a_time else [token_ids]
    for batch in batches:
        deltas.append(stream.add(batch))
        if stream.stopped:
            break
    else:
        deltas.append(stream.finish())
    return stream, deltas


def test_without_stop_strings_text_is_released_as_it_comes():
    stream, deltas = run(["Hel", "lo", " wor", "ld"], None)
    assert [d.text for d in deltas] == ["Hel", "lo", " wor", "ld", ""]
    assert [d.num_tokens for d in deltas] == [1, 1, 1, 1, 0]
    assert stream.text == "Hello world" and not stream.stopped


def test_stop_string_cuts_before_it_and_is_never_sent():
    stream, deltas = run(["Hel", "lo", " wor", "ld"], ["o wo"])
    assert stream.stopped
    assert "".join(d.text for d in deltas) == "Hell"
    assert stream.text == "Hell"


def test_a_possible_stop_prefix_is_held_back_then_released():
    stream, deltas = run(["Hel", "lo", " wor", "ld", "!"], ["lo!"])
    texts = [d.text for d in deltas]
    assert texts[0] == "He"  # "l" could start "lo!"
    assert texts[1] == "l"  # "Hello": only "lo" could still become "lo!"
    assert "".join(texts) == "Hello world!" and not stream.stopped


def test_stop_split_across_tokens_is_found():
    stream, deltas = run(["Hel", "lo", "ST", "OP", "!"], ["STOP"])
    assert stream.stopped
    assert "".join(d.text for d in deltas) == "Hello"
    # the tokens that start before the cut are released: "Hel", "lo"
    assert sum(d.num_tokens for d in deltas) == 2


def test_earliest_of_several_stop_strings_wins_in_one_batch():
    stream, deltas = run(["Hel", "lo", " wor", "ld"], ["world", "llo"], one_at_a_time=False)
    assert stream.text == "He"
    assert deltas[0].text == "He"
    assert deltas[0].num_tokens == 1


def test_offsets_point_at_each_token_start():
    _, deltas = run(["Hel", "lo", " wor", "ld"], None, one_at_a_time=False)
    assert deltas[0].offsets == [0, 3, 5, 9]


def test_empty_pieces_are_released_with_their_neighbours():
    stream, deltas = run(["Hel", "", "lo"], ["zzz"])
    assert sum(d.num_tokens for d in deltas) == 3
    assert "".join(d.text for d in deltas) == "Hello"


def test_unicode_stop_string():
    stream, _ = run(["Hel", "é", "lo"], ["él"])
    assert stream.stopped and stream.text == "Hel"


def test_add_after_stop_is_an_error():
    stream, _ = run(["Hel", " STOP"], [" STOP"])
    with pytest.raises(RuntimeError):
        stream.add([0])
