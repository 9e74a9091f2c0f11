"""meshtrain.data: text, JSONL, Parquet and directory datasets through `datasets`, the token cache,
packing (every token of every document exactly once, in order), the split, and content digests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtrain.data import dataset_digest, documents, open_dataset, resolve_dataset
from meshtrain.data.cache import is_held_out
from meshtrain.errors import ConfigError
from meshtrain.models import Vocab

BYTES = Vocab.of_bytes()


class BytesWithEos:
    """UTF-8 bytes plus an end-of-text token 256: a tokenizer with an EOS, for packing tests."""

    vocab_size = 257
    eos_id = 256
    digest = "bytes+eos"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def stream(ds, part: str = "train") -> list[int]:
    data = ds.train if part == "train" else ds.held_out
    return data.read(0, len(data)).tolist()


def expected(
    docs: list[str], tokenizer, fraction: float, part: str = "train", record_newline: bool = True
) -> list[int]:
    out: list[int] = []
    for d in docs:
        if is_held_out(d, fraction) == (part == "held-out"):
            text = d + "\n" if tokenizer.eos_id is None and record_newline else d
            out += list(tokenizer.encode(text)) + ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
    return [int(i) for i in out]


DOCS = [f"document {i} " + "lorem ipsum " * (i % 7) for i in range(200)]


def test_jsonl_documents_are_tokenised_in_order_with_eos_and_split_by_hash(tmp_path):
    tok = BytesWithEos()
    ds = open_dataset(write_jsonl(tmp_path / "d.jsonl", DOCS), tok, tmp_path / "cache", held_out=0.2)
    assert stream(ds) == expected(DOCS, tok, 0.2)
    assert stream(ds, "held-out") == expected(DOCS, tok, 0.2, "held-out")
    assert 0 < ds.meta["held_out_documents"] < 80 and ds.meta["dtype"] == "uint16"


def test_a_named_field_and_a_missing_one(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS, field="content")
    ds = open_dataset(path, BYTES, tmp_path / "cache", field="content", held_out=0.1)
    assert stream(ds) == expected(DOCS, BYTES, 0.1)
    with pytest.raises(ConfigError, match="no field 'text'.*content, id"):
        open_dataset(path, BYTES, tmp_path / "cache2")


def test_parquet_file(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"text": DOCS, "n": list(range(len(DOCS)))}), tmp_path / "d.parquet", row_group_size=64)
    ds = open_dataset(tmp_path / "d.parquet", BytesWithEos(), tmp_path / "cache", held_out=0.1)
    assert stream(ds) == expected(DOCS, BytesWithEos(), 0.1)


def test_text_file_without_eos_is_the_file_itself(tmp_path):
    text = "First paragraph,\nsecond line.\n\n\nSecond paragraph.\nü and ✓\n\nlast line without newline"
    (tmp_path / "t.txt").write_text(text)
    ds = open_dataset(tmp_path / "t.txt", BYTES, tmp_path / "cache", held_out=1e-12)
    assert bytes(stream(ds)) == text.encode()
    assert ds.meta["train_documents"] == 3  # paragraphs, blank lines kept with the one before


def test_a_text_file_without_blank_lines_is_tokenised_in_bounded_batches(tmp_path, monkeypatch):
    """Paragraphs cut at MAX_DOCUMENT_CHARS must not pile up into one batch the size of the
    corpus (a 1 GiB file of single lines was one batch: in memory whole, no progress until done)."""
    monkeypatch.setattr(documents, "MAX_DOCUMENT_CHARS", 1000)
    monkeypatch.setattr(documents, "BATCH_CHARS", 20_000)
    text = "".join(f"line {i} of a file without blank lines\n" for i in range(4000))  # ~160 kB
    path = tmp_path / "t.txt"
    path.write_text(text)
    batches = list(documents.document_batches(resolve_dataset(path)))
    assert len(batches) >= 8 and all(sum(map(len, b)) <= 20_000 + 1000 for b in batches)
    assert "".join(d for b in batches for d in b) == text
    ds = open_dataset(path, BYTES, tmp_path / "cache", held_out=1e-12)
    assert bytes(stream(ds)) == text.encode()


def test_directory_of_jsonl_files_in_sorted_order_skipping_hidden(tmp_path):
    (tmp_path / "data" / "sub").mkdir(parents=True)
    write_jsonl(tmp_path / "data" / "b.jsonl", DOCS[100:])
    write_jsonl(tmp_path / "data" / "sub" / "a.jsonl", DOCS[50:100])
    write_jsonl(tmp_path / "data" / "a.jsonl", DOCS[:50])
    write_jsonl(tmp_path / "data" / ".hidden.jsonl", ["never read"])
    (tmp_path / "data" / "README").write_text("not data")
    files = resolve_dataset(tmp_path / "data")
    assert files.names == ("a.jsonl", "b.jsonl", "sub/a.jsonl") and files.format == "json"
    ds = open_dataset(tmp_path / "data", BYTES, tmp_path / "cache", held_out=0.1)
    assert stream(ds) == expected(DOCS[:50] + DOCS[100:] + DOCS[50:100], BYTES, 0.1)


def test_eval_dataset_is_the_held_out_split(tmp_path):
    train, held = write_jsonl(tmp_path / "t.jsonl", DOCS), write_jsonl(tmp_path / "e.jsonl", DOCS[:20])
    tok = BytesWithEos()
    ds = open_dataset(train, tok, tmp_path / "cache", eval_path=held)
    assert stream(ds) == expected(DOCS, tok, 0.0)
    assert stream(ds, "held-out") == expected(DOCS[:20], tok, 2.0, "held-out")  # fraction 2: all held out


def test_bad_datasets_are_one_line_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_dataset(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no data files"):
        resolve_dataset(tmp_path / "empty")
    (tmp_path / "mixed").mkdir()
    write_jsonl(tmp_path / "mixed" / "a.jsonl", DOCS)
    (tmp_path / "mixed" / "b.txt").write_text("text")
    with pytest.raises(ConfigError, match="mixes formats"):
        resolve_dataset(tmp_path / "mixed")
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(ConfigError, match="cannot read it as json"):
        open_dataset(tmp_path / "broken.jsonl", BYTES, tmp_path / "cache")
    ds = open_dataset(write_jsonl(tmp_path / "tiny.jsonl", ["ab"] * 3), BYTES, tmp_path / "cache")
    with pytest.raises(ConfigError, match="held-out split has 0 tokens"):
        ds.eval_batches(1, 2, 8)


def test_the_cache_is_built_once_and_keyed_by_content_and_tokenizer(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", DOCS)
    first = open_dataset(path, BYTES, tmp_path / "cache")
    again = open_dataset(path, BYTES, tmp_path / "cache")
    assert again.directory == first.directory and again.meta == first.meta  # reused, not rebuilt
    assert open_dataset(path, BytesWithEos(), tmp_path / "cache").directory != first.directory
    write_jsonl(path, DOCS[1:])
    assert open_dataset(path, BYTES, tmp_path / "cache").directory != first.directory
    assert not list((tmp_path / "cache").glob(".tmp-*"))


def test_content_digest_follows_bytes_and_names_not_location(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "y").mkdir()
    a = write_jsonl(tmp_path / "x" / "d.jsonl", DOCS)
    b = write_jsonl(tmp_path / "y" / "d.jsonl", DOCS)
    assert (
        dataset_digest(a)
        == dataset_digest(b)
        == dataset_digest(tmp_path / "x")
        != dataset_digest(tmp_path / "x", tmp_path / "y")
    )
    b.rename(tmp_path / "y" / "e.jsonl")
    assert dataset_digest(tmp_path / "y") != dataset_digest(tmp_path / "x")
    raw = bytearray(a.read_bytes())
    raw[10] ^= 1
    a.write_bytes(bytes(raw))
    assert dataset_digest(a) != dataset_digest(tmp_path / "y" / "e.jsonl")


def test_batches_are_packed_sequences_and_a_pure_function_of_seed_peer_step(tmp_path):
    ds = open_dataset(write_jsonl(tmp_path / "d.jsonl", DOCS), BytesWithEos(), tmp_path / "cache")
    ids = ds.sample_ids(8, 16, seed=1, peer="a", step=5)
    x, y = ds.batch(8, 16, seed=1, peer="a", step=5)
    for row, i in enumerate(ids.tolist()):
        seq = torch.from_numpy(ds.sequence(i, 16).astype(np.int64))
        assert torch.equal(x[row], seq[:-1]) and torch.equal(y[row], seq[1:])
    assert torch.equal(ds.batch(8, 16, seed=1, peer="a", step=5)[0], x)
    assert not torch.equal(ds.batch(8, 16, seed=1, peer="b", step=5)[0], x)
    assert not torch.equal(ds.batch(8, 16, seed=1, peer="a", step=6)[0], x)
    evals = ds.eval_batches(3, 4, 16)
    assert len(evals) == 3 and all(e[0].shape == (4, 16) for e in evals)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(evals, ds.eval_batches(3, 4, 16), strict=True))


_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(docs=st.lists(_text, min_size=1, max_size=30), context=st.integers(1, 40), eos=st.booleans())
def test_packing_keeps_every_token_of_every_document_once_in_order(tmp_path_factory, docs, context, eos):
    tmp = tmp_path_factory.mktemp("pack")
    tok = BytesWithEos() if eos else BYTES
    ds = open_dataset(write_jsonl(tmp / "d.jsonl", docs), tok, tmp / "cache", held_out=0.3)
    for part in ("train", "held-out"):
        want = expected(docs, tok, 0.3, part)
        n = ds.sequences(context, part)
        packed = [ds.sequence(i, context, part).tolist() for i in range(n)]
        assert all(len(s) == context + 1 for s in packed)
        tail = want[n * (context + 1) :]
        assert len(tail) < context + 1  # only a tail shorter than one sequence is left out
        assert [t for s in packed for t in s] + tail == want
