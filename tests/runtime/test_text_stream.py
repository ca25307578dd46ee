"""Incremental detokenization: pieces concatenate to the full text, stop strings cut across tokens,
incomplete UTF-8 is held back."""

from __future__ import annotations

from glmquant.runtime.text_stream import TextStream

WORDS = ["Hel", "lo", " wor", "ld", "! ST", "OP", " tail"]


def decode(ids):
    return "".join(WORDS[i] for i in ids)


def _run(stop: tuple[str, ...]) -> tuple[list[str], TextStream]:
    stream = TextStream(decode, stop)
    pieces = [stream.push(i) for i in range(len(WORDS)) if not stream.stopped]
    return pieces + [stream.finish()], stream


def test_pieces_concatenate_to_the_text():
    pieces, stream = _run(())
    assert "".join(pieces) == "".join(WORDS) == stream.text
    assert pieces[:2] == ["Hel", "lo"]


def test_stop_string_across_tokens_is_cut_and_never_leaked():
    pieces, stream = _run(("STOP",))
    assert stream.stopped and stream.text == "Hello world! " == "".join(pieces)
    assert not any("ST" in p for p in pieces)


def test_partial_stop_prefix_is_released_when_it_does_not_complete():
    pieces, stream = _run(("! SX",))
    assert not stream.stopped and "".join(pieces) == "".join(WORDS)
    assert pieces[3] == "ld" and pieces[4] == "! ST"  # "!" held until "! ST" proved not to be "! SX"


def test_incomplete_utf8_is_held_until_complete():
    raw = "żółw".encode()
    stream = TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    pieces = [stream.push(b) for b in raw] + [stream.finish()]
    assert "".join(pieces) == "żółw" and "\ufffd" not in "".join(pieces)
