"""Incremental detokenization: multi-byte characters split across tokens, stop strings that span
tokens, text held back only as long as a stop string could still be forming."""
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.sampling_params import SamplingParams

from tests.helpers_models import make_tiny_tokenizer

TOK = make_tiny_tokenizer()  # byte-level: token id == byte value


def stream(text: str, params: SamplingParams, prompt: str = "Q: ") -> tuple[list[str], bool]:
    detok = IncrementalDetokenizer(TOK, list(prompt.encode()), params)
    pieces, stopped = [], False
    for byte in text.encode():
        stopped = detok.update([byte])
        pieces.append(detok.take_new_text(finished=stopped))
        if stopped:
            break
    if not stopped:
        pieces.append(detok.take_new_text(finished=True))
    return pieces, stopped


def test_multibyte_characters_are_emitted_whole():
    pieces, _ = stream("héllo €", SamplingParams())
    assert "".join(pieces) == "héllo €"
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_across_tokens_is_cut_and_never_emitted():
    pieces, stopped = stream("one two STOP three", SamplingParams(stop=["STOP"]))
    assert stopped and "".join(pieces) == "one two "
    assert not any("S" in p for p in pieces)


def test_stop_string_included_when_asked():
    pieces, stopped = stream("abc<end>xyz", SamplingParams(stop=["<end>"], include_stop_str_in_output=True))
    assert stopped and "".join(pieces) == "abc<end>"


def test_partial_stop_prefix_is_released_at_the_end():
    pieces, stopped = stream("ends with STO", SamplingParams(stop=["STOP"]))
    assert not stopped and "".join(pieces) == "ends with STO"


def test_earliest_of_several_stop_strings_wins():
    pieces, stopped = stream("a, b. c", SamplingParams(stop=[".", ","]))
    assert stopped and "".join(pieces) == "a"


def test_incremental_text_equals_one_decode_of_every_token_on_the_default_tokenizer():
    import random

    from pdserve.engine.detokenizer import fast_decoder
    from pdserve.model.loader import load_tokenizer, resolve_model_path
    tok = load_tokenizer(resolve_model_path("default"))
    fast = fast_decoder(tok)
    rng = random.Random(0)
    # ids from the whole vocabulary, and from the first 300 (single bytes: split multi-byte characters)
    for trial in range(40):
        high = len(tok) if trial % 2 else 300
        ids = [rng.randrange(0, high) for _ in range(50)]
        assert fast(ids) == tok.decode(ids, skip_special_tokens=True)
        detok = IncrementalDetokenizer(tok, [rng.randrange(0, len(tok)) for _ in range(8)], SamplingParams())
        for token_id in ids:
            detok.update([token_id])
        whole = tok.decode(ids, skip_special_tokens=True)
        if not whole.endswith("\ufffd"):  # a trailing partial character is held back, by design
            assert detok.text == whole, (trial, ids)


def _emitted(text: str, params: SamplingParams, split: int, prompt: str = "Q: ") -> tuple[str, bool]:
    """The client's whole text when the instance that emitted the first `split` bytes died and another
    one resumed: the first's pieces up to the split, then the resumed detokenizer's."""
    data = text.encode()
    first = IncrementalDetokenizer(TOK, list(prompt.encode()), params)
    pieces = []
    for byte in data[:split]:
        assert not first.update([byte])
        pieces.append(first.take_new_text(finished=False))
    second = IncrementalDetokenizer(TOK, list(prompt.encode()), params)
    assert not second.resume(list(data[:split]))
    stopped = False
    for byte in data[split:]:
        stopped = second.update([byte])
        pieces.append(second.take_new_text(finished=stopped))
        if stopped:
            break
    if not stopped:
        pieces.append(second.take_new_text(finished=True))
    return "".join(pieces), stopped


def test_resume_goes_on_where_the_client_text_stopped_at_every_split():
    """A multi-byte character, or a stop string, across the boundary of a resumed request: the text
    is the uninterrupted one, no character twice, none lost."""
    for text, params in (("héllo € ok 日本", SamplingParams()),
                         ("one two STOP three", SamplingParams(stop=["STOP"])),
                         ("ab€<end>cd", SamplingParams(stop=["<end>", "zz"]))):
        whole, whole_stopped = stream(text, params)
        # bytes the uninterrupted run took (one piece per byte, and one more at the end if it ran out)
        num_taken = len(whole) if whole_stopped else len(text.encode())
        for split in range(num_taken):
            assert _emitted(text, params, split) == ("".join(whole), whole_stopped), (text, split)


def test_resume_reports_tokens_that_hold_a_stop_string():
    detok = IncrementalDetokenizer(TOK, list(b"Q: "), SamplingParams(stop=["STOP"]))
    assert detok.resume(list(b"a STOP b"))
