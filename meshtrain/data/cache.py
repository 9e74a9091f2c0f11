"""The token cache: a dataset tokenised once, streamed, into flat token files on disk.

Problem. Tokenising a corpus at every start is slow, and holding it in memory does not scale; but
sampling must be random access, so that a peer's batch at step s is a pure function of (seed,
peer, step) (assignment.py) and a restarted peer needs nothing but its step to continue.

Design. `build_token_cache` streams the documents (documents.py), tokenises them in batches,
appends an end-of-text token after each document when the tokenizer has one (a tokenizer without
one sees the text as it is: text paragraphs keep their line breaks; a JSON/Parquet record gets a
"\\n" appended), and appends the ids to one of two flat files: `train.bin` or `held_out.bin`.
Which one: a document is held out when the first 8 bytes of blake2b(document) read as a fraction
are below `held_out` — a fixed choice per document, the same on every peer, and duplicates land
on the same side — or, when the spec names an `eval_dataset`, every document of it is held out
and none of the training files is. Packing into fixed-length sequences is then arithmetic on the
flat stream (packed.py): sequence i of a context c is tokens [i·(c+1), (i+1)·(c+1)), so one
cache serves every context.

Layout, under the node's data dir (`<data_dir>/datacache/`):

    <key>/                 complete or absent
        train.bin          token ids, uint16 when the vocabulary has at most 65,536 ids, else uint32
        held_out.bin       the same for the held-out split
        meta.json          format, key, dataset and tokenizer digests, dtype, counts, source
    <key>.lock             taken (flock) by whoever builds <key>: local ranks wait, not rebuild

key = blake3(format, dataset digest, tokenizer digest, field, held_out, eval dataset digest)[:32
hex], so a changed file, tokenizer or split setting is a different cache and a stale one is never
read. The cache is written into `.tmp-<key>-<pid>/` (buffered writes of ~4M tokens, files and
directory fsynced) and renamed into place: a crash leaves garbage that the next build deletes,
never a half-written cache. Progress is logged every 10 s.

Not here: files and digests (files.py), sampling (packed.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import blake3
import numpy as np

from meshtrain.data.documents import document_batches
from meshtrain.data.files import DatasetFiles
from meshtrain.durable import fsync_dir, fsync_file
from meshtrain.errors import ConfigError
from meshtrain.log import get_logger, kv

log = get_logger(__name__)

CACHE_FORMAT = 1
META = "meta.json"
FLUSH_TOKENS = 4 << 20  # tokens buffered before a write
PROGRESS_EVERY_S = 10.0


class TextTokenizer(Protocol):
    """What the data pipeline needs of a tokenizer (`meshtrain.models` tokenizers, `Vocab`).
    A tokenizer may also offer `encode_batch(texts) -> list[list[int]]`, used when present
    (Hugging Face tokenizers encode a batch in parallel)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def digest(self) -> str: ...

    def encode(self, text: str) -> Sequence[int]: ...


@dataclass(frozen=True)
class Split:
    """How documents are divided: `held_out` (a fraction, by document hash) unless `eval_files`
    names the held-out documents."""

    held_out: float = 0.05
    eval_files: DatasetFiles | None = None


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def is_held_out(document: str, fraction: float) -> bool:
    """The hash split: the same answer for the same text, on every peer."""
    h = hashlib.blake2b(document.encode("utf-8", errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "little") < fraction * 2.0**64


def cache_key(dataset_digest: str, tokenizer: TextTokenizer, field: str, split: Split, eval_digest: str = "") -> str:
    h = blake3.blake3()
    for part in (str(CACHE_FORMAT), dataset_digest, tokenizer.digest, field, repr(float(split.held_out)), eval_digest):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


def build_token_cache(
    files: DatasetFiles, tokenizer: TextTokenizer, root: Path, *, key: str, field: str = "text", split: Split = Split()
) -> Path:
    """The cache directory for `key` under `root`, tokenising `files` into it unless it exists."""
    final = root / key
    if (final / META).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another local rank may be building it: wait for it
        if (final / META).is_file():
            return final
        for leftover in root.glob(f".tmp-{key}-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        tmp = root / f".tmp-{key}-{os.getpid()}"
        tmp.mkdir()
        try:
            meta = _tokenise(files, tokenizer, tmp, key=key, field=field, split=split, hf_cache=root / "hf")
            (tmp / META).write_text(json.dumps(meta, indent=1))
            for f in tmp.iterdir():
                fsync_file(f)
            fsync_dir(tmp)
            shutil.rmtree(final, ignore_errors=True)  # an incomplete one (no meta)
            os.rename(tmp, final)
            fsync_dir(root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


class TokenWriter:
    """Appends token arrays to a flat file, buffered, counting what it wrote."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.file = open(path, "wb")  # noqa: SIM115 — closed by close()
        self.dtype = dtype
        self.buffer: list[np.ndarray] = []
        self.buffered = 0
        self.tokens = 0
        self.documents = 0

    def add(self, ids: np.ndarray) -> None:
        self.buffer.append(ids.astype(self.dtype))
        self.buffered += len(ids)
        self.documents += 1
        if self.buffered >= FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            np.concatenate(self.buffer).tofile(self.file)
            self.tokens += self.buffered
            self.buffer, self.buffered = [], 0

    def close(self) -> None:
        self.flush()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def _tokenise(
    files: DatasetFiles, tokenizer: TextTokenizer, out: Path, *, key: str, field: str, split: Split, hf_cache: Path
) -> dict:
    dtype = dtype_for(tokenizer.vocab_size)
    train, held = TokenWriter(out / "train.bin", dtype), TokenWriter(out / "held_out.bin", dtype)
    t0 = t_last = time.monotonic()
    try:
        sources = [(files, False)] + ([(split.eval_files, True)] if split.eval_files is not None else [])
        for source, all_held in sources:
            for docs in document_batches(source, field=field, cache_dir=hf_cache):
                for doc, ids in zip(docs, encode_documents(tokenizer, docs, source.format), strict=True):
                    held_out = all_held or (split.eval_files is None and is_held_out(doc, split.held_out))
                    (held if held_out else train).add(ids)
                if time.monotonic() - t_last > PROGRESS_EVERY_S:
                    t_last = time.monotonic()
                    done = train.tokens + train.buffered + held.tokens + held.buffered
                    log.warning(
                        kv(
                            "tokenising the dataset",
                            dataset=str(source.root),
                            documents=train.documents + held.documents,
                            tokens=done,
                            tokens_per_s=round(done / (t_last - t0)),
                        )
                    )
    finally:
        train.close()
        held.close()
    seconds = time.monotonic() - t0
    log.warning(
        kv(
            "dataset tokenised",
            dataset=str(files.root),
            documents=train.documents + held.documents,
            train_tokens=train.tokens,
            held_out_tokens=held.tokens,
            seconds=round(seconds, 1),
        )
    )
    return {
        "format": CACHE_FORMAT,
        "key": key,
        "dataset": str(files.root),
        "tokenizer_digest": tokenizer.digest,
        "field": field,
        "held_out": split.held_out,
        "eval_dataset": str(split.eval_files.root) if split.eval_files is not None else "",
        "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "train_tokens": train.tokens,
        "held_out_tokens": held.tokens,
        "train_documents": train.documents,
        "held_out_documents": held.documents,
        "seconds": round(seconds, 3),
    }


def encode_documents(tokenizer: TextTokenizer, docs: list[str], fmt: str) -> Iterable[np.ndarray]:
    """Each document's ids as it goes into the cache: with the end-of-text token after it, or
    (no such token) a record followed by a line break (module docstring)."""
    eos = tokenizer.eos_id
    if eos is None and fmt != "text":
        docs = [d + "\n" for d in docs]
    batch = getattr(tokenizer, "encode_batch", None)
    encoded = batch(docs) if batch is not None else (tokenizer.encode(d) for d in docs)
    tail = np.array([eos] if eos is not None else [], dtype=np.int64)
    for ids in encoded:
        arr = np.asarray(ids, dtype=np.int64)
        if len(arr) and (arr.max() >= tokenizer.vocab_size or arr.min() < 0):
            raise ConfigError(
                f"the tokenizer produced id {int(arr.max())} outside its vocabulary of {tokenizer.vocab_size}"
            )
        yield np.concatenate([arr, tail]) if len(tail) else arr
