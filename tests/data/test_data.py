"""Corpora, batches and schedules: deterministic, split per rank, errors that name the line."""

import json

import numpy as np
import pytest
import torch

from troupe.data import (ByteTokenizer, CurriculumConfig, DataConfig, RandomLTDConfig,
                         TokenDataset, file_documents)


@pytest.fixture(scope="module")
def stdlib_data():
    return TokenDataset(DataConfig(seed=5))


def test_stdlib_corpus_is_deterministic_and_split(stdlib_data):
    again = TokenDataset(DataConfig(seed=5))
    assert np.array_equal(again.train, stdlib_data.train)
    assert len(stdlib_data.train) > 1_000_000 and len(stdlib_data.val) > 10_000
    other = TokenDataset(DataConfig(seed=6))
    assert not np.array_equal(other.val[:1000], stdlib_data.val[:1000])


def test_stdlib_corpus_is_parsed_once_then_read_and_a_damaged_copy_is_parsed_again(
        tmp_path, monkeypatch):
    from troupe.data import corpus
    calls = []
    monkeypatch.setenv("TROUPE_CACHE", str(tmp_path))
    monkeypatch.setattr(corpus, "_parse_stdlib",
                        lambda root, n: calls.append(n) or [f"doc {len(calls)}", "two"])
    assert corpus.stdlib_documents() == ["doc 1", "two"] == corpus.stdlib_documents()
    assert calls == [40]
    assert corpus.stdlib_documents(min_chars=10) == ["doc 2", "two"]  # another key
    for cached in (tmp_path / "corpus").iterdir():
        cached.write_text('["doc 1", ')
    assert corpus.stdlib_documents() == ["doc 3", "two"] and len(calls) == 3


def test_rank_batches_are_slices_of_the_global_batch(stdlib_data):
    x, y = stdlib_data.train_batch(7, 8, 16)
    parts = [stdlib_data.train_batch(7, 8, 16, r, 4) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    assert not torch.equal(stdlib_data.train_batch(8, 8, 16)[0], x)


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "naïve 1-bit Adam ≠ Adam"
    assert tok.decode(tok.encode(text, eos=True)) == text


def test_jsonl_errors_name_file_and_line(tmp_path):
    good, bad = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    good.write_text(json.dumps({"text": "hello"}) + "\n")
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + '{"body": 1}\n')
    assert file_documents([good]) == ["hello"]
    with pytest.raises(ValueError, match=r"b.jsonl:2: expected an object with a string 'text'"):
        file_documents([bad])
    with pytest.raises(ValueError, match=r"\.csv"):
        (tmp_path / "c.csv").write_text("x")
        file_documents([tmp_path / "c.csv"])


def test_bytes_that_are_not_utf8_are_named_by_file_and_line(tmp_path):
    """A byte-order mark is allowed (editors write one); other bytes outside UTF-8 name the
    file and line instead of a bare UnicodeDecodeError."""
    marked, latin = tmp_path / "marked.jsonl", tmp_path / "latin.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "caf\u00e9"}).encode() + b"\n")
    assert file_documents([marked]) == ["caf\u00e9"]
    latin.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin.jsonl:2: not UTF-8 text \(byte 14 of the line\)"):
        file_documents([latin])
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match=r"latin.txt: not UTF-8 text \(byte 4\)"):
        file_documents([tmp_path / "latin.txt"])


def test_parquet_rows_are_documents_and_bad_rows_named(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    pq.write_table(pa.table({"text": ["first", "second"], "id": [1, 2]}), tmp_path / "a.parquet")
    assert file_documents([tmp_path / "a.parquet"]) == ["first", "second"]
    pq.write_table(pa.table({"text": ["ok", None]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"b.parquet:2: expected an object with a string"):
        file_documents([tmp_path / "b.parquet"])


def test_user_files_train_and_validate(tmp_path):
    for i in range(4):
        (tmp_path / f"d{i}.txt").write_text(f"document {i} " * 200)
    data = TokenDataset(DataConfig(source=[str(p) for p in sorted(tmp_path.glob("*.txt"))],
                                   val_fraction=0.25))
    x, _ = data.train_batch(1, 2, 64)
    assert x.shape == (2, 64)
    assert len(list(data.val_batches(2, 2, 64))) == 2


def test_curriculum_and_ltd_schedules():
    c = CurriculumConfig(enabled=True, min_len=16, total_steps=100, step_size=8)
    lens = [c.seq_len_at(s, 128) for s in range(0, 120)]
    assert lens[0] == 16 and lens[100] == 128 and lens == sorted(lens)
    assert all(n % 8 == 0 for n in lens)
    assert CurriculumConfig().seq_len_at(0, 128) == 128
    r = RandomLTDConfig(enabled=True, min_tokens=32, total_steps=50)
    assert r.keep_at(0, 128) == 32 and r.keep_at(50, 128) == 128
    assert r.layers(6) == range(1, 5)
    with pytest.raises(ValueError, match="last_layer"):
        RandomLTDConfig(first_layer=3, last_layer=2)
