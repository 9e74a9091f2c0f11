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
    .building-<key>/       a build under way (or killed): the same two files, and
        progress.json      what is committed: documents consumed, tokens and documents per file
    <key>.lock             taken (flock) by whoever builds <key>: local ranks wait, not rebuild
    digests/               the datasets' digest manifests (files.py)

key = blake3(format, dataset digest, tokenizer digest, field, held_out, eval dataset digest)[:32
hex], so a changed file, tokenizer or split setting is a different cache and a stale one is never
read.

Resumable. A build commits a shard every `SHARD_TOKENS` tokens (at a batch boundary): both token
files are flushed and fsynced, then `progress.json` is replaced (`write_atomic`) with the committed
lengths and the number of documents consumed. A build killed at any instant (kill -9, power cut)
leaves `.building-<key>/`; the next build truncates the token files to the committed lengths,
streams past the consumed documents without tokenising them, and goes on — the finished shards are
kept, only the unfinished one is redone, and the files are byte for byte those of an uninterrupted
build (documents are appended in order either way). When done, `meta.json` is written and the
folder renamed to `<key>/` (then fsynced): a reader sees a whole cache or none. A build that
fails on the data itself (a ConfigError: a bad record) deletes its folder: fixing the files changes
the key. Leftover `.tmp-<key>-*` folders (the all-or-nothing builds of earlier versions) are deleted.

Progress: `progress=` gets a `files.Progress` ("tokenising", done and total in bytes of input) at
most every 0.5 s, from the building thread, and once at the end (done == total). Done counts the
UTF-8 bytes of the documents read: exact for text files (their documents are the file), a little
behind for JSON Lines (keys, escapes), ahead for compressed Parquet (held just below total until
the end). Also logged every 10 s.

Why not `datasets.Dataset.map(batched=True, num_proc=...)`: it needs a non-streaming dataset, which
first converts the whole corpus to Arrow files on disk (a second copy of it), and its own cache
fingerprints would be a second resume mechanism beside ours. A Hugging Face tokenizer's
`encode_batch` already encodes a batch on every core.

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
from typing import Any, Protocol

import blake3
import numpy as np

from meshtrain.data.documents import document_batches
from meshtrain.data.files import DatasetFiles, ProgressCallback, ProgressMeter
from meshtrain.durable import fsync_dir, write_atomic
from meshtrain.errors import ConfigError
from meshtrain.log import get_logger, kv

log = get_logger(__name__)

CACHE_FORMAT = 1
META = "meta.json"
PROGRESS = "progress.json"  # an unfinished build's committed shards
FLUSH_TOKENS = 4 << 20  # tokens buffered before a write
SHARD_TOKENS = 16 << 20  # tokens between two commits of a build: at most this much is redone after a kill


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
    files: DatasetFiles,
    tokenizer: TextTokenizer,
    root: Path,
    *,
    key: str,
    field: str = "text",
    split: Split = Split(),
    progress: ProgressCallback | None = None,
    shard_tokens: int = SHARD_TOKENS,
) -> Path:
    """The cache directory for `key` under `root`, tokenising `files` into it unless it exists
    (resuming a killed build's committed shards: module docstring)."""
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
        work = root / f".building-{key}"
        work.mkdir(exist_ok=True)
        if not (work / META).is_file():  # else: killed between meta.json and the rename
            build = ShardedBuild(work, key, dtype_for(tokenizer.vocab_size), shard_tokens)
            try:
                meta = build.run(files, tokenizer, field=field, split=split, hf_cache=root / "hf", progress=progress)
            except ConfigError:  # these files cannot be built (a bad record): nothing worth resuming
                shutil.rmtree(work, ignore_errors=True)
                raise
            write_atomic(work / META, json.dumps(meta, indent=1).encode())
            (work / PROGRESS).unlink(missing_ok=True)
        shutil.rmtree(final, ignore_errors=True)  # an incomplete one (no meta)
        os.rename(work, final)
        fsync_dir(root)
    return final


class TokenWriter:
    """Appends token arrays to a flat file, buffered, counting what it wrote. `tokens` and
    `documents`: what the file already holds (a resumed build); anything after is cut off."""

    def __init__(self, path: Path, dtype: np.dtype, tokens: int = 0, documents: int = 0) -> None:
        self.file = open(path, "ab")  # noqa: SIM115 — closed by close()
        self.file.truncate(tokens * dtype.itemsize)  # an unfinished shard's tail
        self.dtype = dtype
        self.buffer: list[np.ndarray] = []
        self.buffered = 0
        self.tokens = tokens
        self.documents = documents

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

    def commit(self) -> dict[str, int]:
        """Everything added is on disk (flushed and fsynced); what the file now holds."""
        self.flush()
        self.file.flush()
        os.fsync(self.file.fileno())
        return {"tokens": self.tokens, "documents": self.documents}

    def close(self) -> None:
        self.commit()
        self.file.close()


class ShardedBuild:
    """One build of a token cache in `work`, committed every `shard_tokens` tokens to
    `progress.json` and resumed from it (module docstring). key: the cache's; dtype: the ids'."""

    def __init__(self, work: Path, key: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.work, self.key, self.dtype, self.shard_tokens = work, key, dtype, shard_tokens
        self.committed = self._load()
        self.resumed_seconds = float(self.committed["seconds"])  # the killed runs' time

    def _load(self) -> dict[str, Any]:
        """The committed state, or an empty one (no shard yet, or a record of another build)."""
        try:
            state = json.loads((self.work / PROGRESS).read_text())
        except (OSError, ValueError):
            state = None
        if isinstance(state, dict) and state.get("key") == self.key and state.get("dtype") == self.dtype.name:
            return state
        none = {"tokens": 0, "documents": 0}
        return {"key": self.key, "train": none, "held_out": none, "documents": 0, "input_bytes": 0, "seconds": 0.0}

    def run(
        self,
        files: DatasetFiles,
        tokenizer: TextTokenizer,
        *,
        field: str,
        split: Split,
        hf_cache: Path,
        progress: ProgressCallback | None,
    ) -> dict:
        """Tokenise what is not committed yet; the cache's meta.json."""
        state = self.committed
        train = TokenWriter(self.work / "train.bin", self.dtype, **state["train"])
        held = TokenWriter(self.work / "held_out.bin", self.dtype, **state["held_out"])
        skip, input_bytes = int(state["documents"]), int(state["input_bytes"])
        if skip:
            log.warning(kv("resuming the tokenising", dataset=str(files.root), documents_done=skip))
        sources = [(files, False)] + ([(split.eval_files, True)] if split.eval_files is not None else [])
        meter = ProgressMeter(
            "tokenising", str(files.root), sum(f.size for f, _ in sources), done=input_bytes, callback=progress
        )
        t0, since_commit = time.monotonic(), 0
        try:
            for source, all_held in sources:
                for batch in document_batches(source, field=field, cache_dir=hf_cache):
                    docs, skip = batch[skip:], max(0, skip - len(batch))  # committed before a kill
                    if not docs:
                        continue
                    for doc, ids in zip(docs, encode_documents(tokenizer, docs, source.format), strict=True):
                        held_out = all_held or (split.eval_files is None and is_held_out(doc, split.held_out))
                        (held if held_out else train).add(ids)
                        since_commit += len(ids)
                        input_bytes += len(doc.encode("utf-8", errors="surrogatepass"))
                    meter.advance(input_bytes)
                    if since_commit >= self.shard_tokens:
                        self._commit(train, held, input_bytes, t0)
                        since_commit = 0
        finally:
            train.close()
            held.close()
        meter.finish()
        seconds = self.resumed_seconds + time.monotonic() - t0
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
            "key": self.key,
            "dataset": str(files.root),
            "tokenizer_digest": tokenizer.digest,
            "field": field,
            "held_out": split.held_out,
            "eval_dataset": str(split.eval_files.root) if split.eval_files is not None else "",
            "dtype": self.dtype.name,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "train_tokens": train.tokens,
            "held_out_tokens": held.tokens,
            "train_documents": train.documents,
            "held_out_documents": held.documents,
            "seconds": round(seconds, 3),
        }

    def _commit(self, train: TokenWriter, held: TokenWriter, input_bytes: int, t0: float) -> None:
        """A shard: the token files on disk first, then the record that says they are."""
        self.committed = {
            "key": self.key,
            "dtype": self.dtype.name,
            "train": train.commit(),
            "held_out": held.commit(),
            "documents": train.documents + held.documents,
            "input_bytes": input_bytes,
            "seconds": self.resumed_seconds + time.monotonic() - t0,
        }
        write_atomic(self.work / PROGRESS, json.dumps(self.committed).encode())


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
