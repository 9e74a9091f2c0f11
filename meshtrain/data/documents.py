"""Documents, streamed from a dataset's files through Hugging Face `datasets`.

`document_batches(files)` yields lists of document strings in file order, reading through
`datasets.load_dataset(<builder>, data_files=..., streaming=True)`: the files are read in chunks
(10 MB for text and JSON, a row group for Parquet), so memory stays bounded however large the
corpus; nothing is downloaded and nothing is converted to Arrow files on disk.

What a document is:
    json, parquet  one record's `field` (default "text"); a record whose field is null is skipped,
                   one whose field is not a string is a ConfigError that names the record.
    text           a paragraph: lines up to and including the blank lines that follow them, line
                   breaks kept — so concatenating the documents gives back the file exactly (a
                   tokenizer without an end-of-text token then sees the text as it is). A
                   paragraph is cut at the line break before it would pass `MAX_DOCUMENT_CHARS` (one
                   line is never cut: `datasets` reads a whole line).

Not here: which files, digests (files.py); tokens, packing, the split (cache.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from meshtrain.data.files import DatasetFiles
from meshtrain.errors import ConfigError

BATCH_DOCUMENTS = 1024  # documents handed to the tokenizer at once...
# ...or fewer, once they hold this many characters: a text file without blank lines is cut into
# 1 MiB paragraphs, and 1,024 of them would be a whole 1 GiB corpus in one batch — in memory at
# once, and no progress to report until it is all tokenised.
BATCH_CHARS = 8 << 20
MAX_DOCUMENT_CHARS = 1 << 20  # a text paragraph is cut here (bounded memory for one-line files)


def document_batches(files: DatasetFiles, *, field: str = "text", cache_dir: Path | None = None) -> Iterator[list[str]]:
    """Every document of `files`, in order, in lists of up to `BATCH_DOCUMENTS`."""
    stream = _stream(files, field, cache_dir)
    if files.format == "text":
        yield from _paragraphs(stream)
        return
    record = 0
    for batch in stream:
        if field not in batch:
            raise ConfigError(
                f"dataset {files.root}: records have no field {field!r} (they have "
                f"{', '.join(sorted(batch)) or 'no fields'}); name it with dataset_field"
            )
        docs = []
        for value in batch[field]:
            if isinstance(value, str):
                docs.append(value)
            elif value is not None:
                raise ConfigError(
                    f"dataset {files.root}: record {record} has a {type(value).__name__} in field {field!r}, not text"
                )
            record += 1
        if docs:
            yield docs


def _stream(files: DatasetFiles, field: str, cache_dir: Path | None) -> Iterator[dict[str, list]]:
    try:
        import datasets
    except ImportError:  # pragma: no cover - a dependency
        raise ConfigError("a file dataset needs the `datasets` package: pip install datasets") from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    options: dict = {"keep_linebreaks": True} if files.format == "text" else {}
    if files.format == "parquet":
        options["columns"] = [field]
    try:
        ds = datasets.load_dataset(
            files.format,
            data_files=[str(f) for f in files.files],
            split="train",
            streaming=True,
            cache_dir=str(cache_dir) if cache_dir else None,
            **options,
        )
        yield from ds.iter(batch_size=BATCH_DOCUMENTS)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 — pyarrow/datasets raise many types for a bad file
        message = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        if files.format == "parquet" and field in message:
            raise ConfigError(f"dataset {files.root}: no column {field!r} (name it with dataset_field)") from None
        raise ConfigError(f"dataset {files.root}: cannot read it as {files.format} ({message})") from None


def _paragraphs(stream: Iterator[dict[str, list]]) -> Iterator[list[str]]:
    docs: list[str] = []
    lines: list[str] = []
    size = batch_chars = 0  # the paragraph's and the finished documents' characters
    after_blank = False
    for batch in stream:
        for line in batch["text"]:
            blank = not line.strip()
            if (after_blank and not blank) or size + len(line) > MAX_DOCUMENT_CHARS:
                if lines:
                    docs.append("".join(lines))
                    batch_chars += size
                    if len(docs) >= BATCH_DOCUMENTS or batch_chars >= BATCH_CHARS:
                        yield docs
                        docs, batch_chars = [], 0
                lines, size = [], 0
            lines.append(line)
            size += len(line)
            after_blank = blank
    if lines:
        docs.append("".join(lines))
    if docs:
        yield docs
