"""IncrementalDetokenizer on a real byte-level BPE tokenizer: UTF-8 splits, stop strings across tokens, holdback."""

import pytest

from specserve.engine.detokenizer import IncrementalDetokenizer
from tests.tiny_models import EOS, build_tokenizer

MULTIBYTE = "café 東京 😀 naïve"
ENGLISH = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("detok_tok"))


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _pieces(tok, ids):
    return [tok.decode([i]) for i in ids]


def _stream(detok, ids):
    """Feed ids one at a time; return (deltas, index of the token whose append returned True or None)."""
    deltas, hit = [], None
    for n, i in enumerate(ids):
        if detok.append(i):
            hit = n
            break
        deltas.append(detok.take_delta(False))
    return deltas, hit


def test_multibyte_characters_split_across_tokens(tok):
    ids = _ids(tok, MULTIBYTE)
    assert tok.decode(ids) == MULTIBYTE
    assert any("\ufffd" in p for p in _pieces(tok, ids)), "precondition: some character spans several tokens"
    detok = IncrementalDetokenizer(tok, [], [])
    deltas = []
    for n, i in enumerate(ids, start=1):
        assert detok.append(i) is False
        # the text is always the decoded prefix minus an incomplete trailing character
        assert detok.text == tok.decode(ids[:n]).rstrip("\ufffd")
        deltas.append(detok.take_delta(False))
    deltas.append(detok.take_delta(True))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)
    assert sum(1 for d in deltas if d == "") >= 3  # the byte tokens of 東/京/😀 produced nothing until complete


def test_prompt_context_is_not_part_of_the_output(tok):
    # the last prompt tokens are decoded for context; the 5-token window starts in the middle of 東.
    prompt = _ids(tok, "東京")
    assert len(prompt) > 5 and "\ufffd" in tok.decode(prompt[-5:])
    out = _ids(tok, "😀 café")
    detok = IncrementalDetokenizer(tok, prompt, [])
    deltas, hit = _stream(detok, out)
    assert hit is None
    assert "".join(deltas) + detok.take_delta(True) == "😀 café" == detok.text


def test_special_tokens_are_skipped(tok):
    eos = tok.convert_tokens_to_ids(EOS)
    detok = IncrementalDetokenizer(tok, [], [])
    ids = _ids(tok, "ab")
    for i in [ids[0], eos, *ids[1:]]:
        detok.append(i)
    detok.flush()
    assert detok.text == "ab"


def test_stop_string_across_token_boundary(tok):
    ids = _ids(tok, ENGLISH)
    pieces = _pieces(tok, ids)
    stop = "ck b"
    # precondition: 'ick' | ' b' — the stop string starts inside one token and ends in the next
    n = next(j for j in range(len(ids)) if stop in tok.decode(ids[: j + 1]))
    start = tok.decode(ids).index(stop)
    assert stop not in pieces[n] and stop not in pieces[n - 1]
    assert len(tok.decode(ids[: n - 1])) < start < len(tok.decode(ids[:n]))
    assert tok.decode(ids[: n + 1]).endswith(stop)

    detok = IncrementalDetokenizer(tok, _ids(tok, "prompt: "), [stop])
    results = [detok.append(i) for i in ids[: n + 1]]
    assert results == [False] * n + [True]
    assert detok.stopped
    assert detok.text == ENGLISH[:start] == "The qui"
    assert detok.take_delta(True) == "The qui"


def test_stop_string_spanning_three_tokens_and_ending_inside_one(tok):
    ids = _ids(tok, ENGLISH)
    stop = "k br"  # 'ick' | ' b' | 'ro'
    n = next(j for j in range(len(ids)) if stop in tok.decode(ids[: j + 1]))
    assert not tok.decode(ids[: n + 1]).endswith(stop)  # ends inside the token 'ro'
    detok = IncrementalDetokenizer(tok, [], [stop])
    assert [detok.append(i) for i in ids[: n + 1]] == [False] * n + [True]
    assert detok.text == "The quic"


def test_earliest_stop_string_wins(tok):
    ids = _ids(tok, ENGLISH)
    # both complete on the same token ('n'); the text is cut before the one that starts first
    detok = IncrementalDetokenizer(tok, [], ["own", "brown"])
    _, hit = _stream(detok, ids)
    assert _pieces(tok, ids)[hit] == "n"
    assert detok.text == "The quick "


def test_stop_string_in_the_prompt_does_not_stop(tok):
    prompt = _ids(tok, "The quick brown")
    detok = IncrementalDetokenizer(tok, prompt, ["ck b"])
    deltas, hit = _stream(detok, _ids(tok, " fox jumps"))
    assert hit is None and detok.text == " fox jumps"


def test_multibyte_stop_string(tok):
    ids = _ids(tok, MULTIBYTE)
    detok = IncrementalDetokenizer(tok, [], ["京 😀"])
    deltas, hit = _stream(detok, ids)
    assert hit is not None
    assert tok.decode(ids[: hit + 1]).endswith("😀") and not tok.decode(ids[:hit]).endswith("😀")
    assert detok.text == "café 東"
    assert "".join(deltas) + detok.take_delta(True) == "café 東"


@pytest.mark.parametrize("stops, final", [
    ([" jumps", "lazy"], "The quick brown fox"),
    (["the lazy cat"], ENGLISH),  # a stop prefix appears ("the lazy ") but never completes
    (["x"], "The quick brown fo"),
])
def test_holdback_never_emits_text_that_is_later_cut(tok, stops, final):
    ids = _ids(tok, ENGLISH)
    holdback = max(len(s) for s in stops) - 1
    detok = IncrementalDetokenizer(tok, [], stops)
    emitted = ""
    for i in ids:
        hit = detok.append(i)
        if hit:
            break
        emitted += detok.take_delta(False)
        assert final.startswith(emitted)
        # exactly the text that can no longer become part of a stop string has been released
        assert emitted == detok.text[: max(0, len(detok.text) - holdback)]
    detok.flush()
    emitted += detok.take_delta(True)
    assert emitted == final == detok.text
    assert detok.take_delta(True) == ""


def test_no_holdback_without_stop_strings(tok):
    ids = _ids(tok, ENGLISH)
    detok = IncrementalDetokenizer(tok, [], [])
    for n, i in enumerate(ids, start=1):
        detok.append(i)
        assert detok.take_delta(False) == _pieces(tok, ids)[n - 1]


def test_flush_adds_text_held_for_an_incomplete_character(tok):
    ids = _ids(tok, "ab 😀")
    cut = len(ids) - 1  # the request ends (e.g. max_tokens) one byte before the emoji is complete
    assert tok.decode(ids[:cut]).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, [], ["zzz"])
    for i in ids[:cut]:
        assert detok.append(i) is False
    assert detok.text == "ab "
    streamed = detok.take_delta(False)
    detok.flush()
    assert detok.text == tok.decode(ids[:cut])
    assert streamed + detok.take_delta(True) == tok.decode(ids[:cut])
    detok.flush()  # idempotent
    assert detok.text == tok.decode(ids[:cut])


def test_flush_with_nothing_pending_changes_nothing(tok):
    detok = IncrementalDetokenizer(tok, [], [])
    for i in _ids(tok, "ab café"):
        detok.append(i)
    detok.flush()
    assert detok.text == "ab café"


def test_flush_does_nothing_after_a_stop_hit(tok):
    ids = _ids(tok, "ab 😀")
    detok = IncrementalDetokenizer(tok, [], ["b "])
    assert [detok.append(i) for i in ids[:3]] == [False, False, True]
    assert detok.text == "a"
    detok.append(ids[3])  # a stray partial byte after the stop (should never be shown)
    detok.flush()
    assert detok.text == "a" and detok.stopped
    assert detok.take_delta(True) == "a"
