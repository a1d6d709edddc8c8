"""Streaming text from tokens never emits half a character and adds up to the whole decode."""

import pytest

from troupe.generation.detokenize import ByteDetokenizer, TextDetokenizer

TEXT = "naïve café, 25°C — 🎉 ok! 日本語のテキスト"


def _stream(det, ids):
    pieces = [det.add(t) for t in ids]
    return pieces + [det.finish()]


def test_bytes_split_across_tokens_wait_for_the_whole_character():
    pieces = _stream(ByteDetokenizer(), list(TEXT.encode()) + [256])
    assert "".join(pieces) == TEXT and not any("\ufffd" in p for p in pieces)
    assert pieces[:3] == ["n", "a", ""]  # "ï" is two bytes: nothing after the first


@pytest.fixture(scope="module")
def byte_bpe():
    """A byte-level BPE tokenizer trained here (multi-byte characters split into tokens)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50,
                            vocab_size=300, min_frequency=2, show_progress=False)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)


def test_text_detokenizer_adds_up_to_the_decode(byte_bpe):
    ids = byte_bpe.encode(TEXT)
    assert len(ids) > len(TEXT) // 2  # mostly byte tokens: characters do get split
    pieces = _stream(TextDetokenizer(byte_bpe), ids)
    assert "".join(pieces) == byte_bpe.decode(ids) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    prompt = byte_bpe.encode("the quick")  # with a prompt: only the new text comes out
    pieces = _stream(TextDetokenizer(byte_bpe, prompt), byte_bpe.encode(" brown fox"))
    assert "".join(pieces) == " brown fox"
