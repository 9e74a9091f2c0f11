"""Datasets from files: streamed, tokenised once into a token cache, packed, sampled by a pure
function of (seed, peer, step). A low layer beside `models` (it imports nothing from node/).

    files.py       which files a dataset is, its content digest (the spec's `dataset_digest`)
    documents.py   documents streamed through Hugging Face `datasets`
    cache.py       the on-disk token cache and the held-out split
    packed.py      `PackedDataset`: packed sequences by random access, batches, eval batches
    assignment.py  the pure (seed, peer, step) -> samples function, shared with `Corpus`

`open_dataset` is the one entry point: resolve the files, check their digest against the spec's
(reused from the digest manifest under the cache root when no file changed: files.py), build (or
reuse, or resume) the cache, open it — reporting its progress (`Progress`) to a callback.
"""

from __future__ import annotations

from pathlib import Path

import blake3

from meshtrain.data.cache import Split, TextTokenizer, build_token_cache, cache_key
from meshtrain.data.files import DatasetFiles, Progress, ProgressCallback, check_digest, resolve_dataset
from meshtrain.data.packed import PackedDataset

__all__ = [
    "DatasetFiles",
    "PackedDataset",
    "Progress",
    "ProgressCallback",
    "Split",
    "TextTokenizer",
    "dataset_digest",
    "open_dataset",
    "resolve_dataset",
]


def dataset_digest(path: str | Path, eval_path: str | Path = "") -> str:
    """The content digest a spec pins (`dataset_digest`): the files' digest, or with an
    `eval_path`, one digest of both."""
    digest = resolve_dataset(path).digest()
    if not eval_path:
        return digest
    return _combined(digest, resolve_dataset(eval_path).digest())


def open_dataset(
    path: str | Path,
    tokenizer: TextTokenizer,
    cache_root: str | Path,
    *,
    field: str = "text",
    held_out: float = 0.05,
    eval_path: str | Path = "",
    expected_digest: str = "",
    progress: ProgressCallback | None = None,
) -> PackedDataset:
    """The dataset at `path`, tokenised with `tokenizer` into a cache under `cache_root`.
    `expected_digest` (the spec's) must match the local files' content (ConfigError otherwise).
    `progress`: called from this thread while digesting and tokenising (files.py `Progress`)."""
    root = Path(cache_root)
    files = resolve_dataset(path)
    eval_files = resolve_dataset(eval_path) if eval_path else None
    digest = files.digest(manifest=_manifest(root, files), progress=progress)
    eval_digest = (
        eval_files.digest(manifest=_manifest(root, eval_files), progress=progress) if eval_files is not None else ""
    )
    check_digest(str(path), expected_digest, _combined(digest, eval_digest) if eval_digest else digest)
    split = Split(held_out, eval_files)
    key = cache_key(digest, tokenizer, field, split, eval_digest)
    return PackedDataset.open(
        build_token_cache(files, tokenizer, root, key=key, field=field, split=split, progress=progress)
    )


def _manifest(cache_root: Path, files: DatasetFiles) -> Path:
    """Where the digest manifest of the dataset at `files.root` lives (one per absolute path)."""
    name = blake3.blake3(str(files.root.resolve()).encode("utf-8", errors="surrogatepass")).hexdigest()[:32]
    return cache_root / "digests" / f"{name}.json"


def _combined(train: str, held_out: str) -> str:
    return blake3.blake3(f"train {train}\nheld-out {held_out}\n".encode()).hexdigest()
