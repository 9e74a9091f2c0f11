"""A dataset on disk: which files it is, in which format, and a digest of their content.

Problem. A swarm spec used to pin a dataset by its path, so two peers with different files under
the same name trained on different data without noticing. Here the dataset a spec names
(`dataset = "<file or directory>"`) is resolved to an ordered list of files and fingerprinted by
content; `swarm create` writes that fingerprint into the spec (`dataset_digest`) and every peer
recomputes it from its own files before training (`check_digest`: a mismatch is refused in one
line that names the dataset).

Formats, by file extension (one format per dataset; a directory is every matching file below it,
in sorted relative-path order, hidden files skipped):

    text      .txt .text .md       documents are paragraphs (runs of lines up to a blank line)
    json      .jsonl .json         one JSON object per line; the document is its `field` ("text")
    parquet   .parquet             the document is the column `field` ("text")

A single file with any other extension is read as text (as meshtrain always has).

Digest: blake3 over a domain tag, then for each file its relative path (UTF-8), a NUL, its size
(8 bytes little-endian) and its bytes, streamed in 8 MiB blocks — so renaming, reordering,
truncating or editing any file changes it, and hashing never holds a file in memory. A single
file is named by its base name, so the digest does not depend on where a peer keeps its copy.

Failures: a missing path, an empty directory, mixed formats: `ConfigError`
(one line, saying which). Not here: reading documents (documents.py), tokenising (cache.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import blake3

from meshtrain.errors import ConfigError
from meshtrain.log import get_logger, kv

log = get_logger(__name__)

Format = Literal["text", "json", "parquet"]
FORMATS: dict[str, Format] = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}
DIGEST_DOMAIN = b"meshtrain/dataset/v1"
DIGEST_BLOCK = 8 << 20
PROGRESS_EVERY_S = 10.0


@dataclass(frozen=True)
class DatasetFiles:
    """The files of one dataset. root: the path the spec named; files: absolute paths in digest
    order; names: what each file is called in the digest (relative to root); format: see above."""

    root: Path
    files: tuple[Path, ...]
    names: tuple[str, ...]
    format: Format

    @property
    def size(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def digest(self) -> str:
        """blake3 of the files' names, sizes and bytes (module docstring), hex."""
        h = blake3.blake3()
        h.update(DIGEST_DOMAIN)
        done, total, t_last = 0, self.size, time.monotonic()
        for name, path in zip(self.names, self.files, strict=True):
            h.update(name.encode("utf-8", errors="surrogatepass") + b"\0")
            h.update(path.stat().st_size.to_bytes(8, "little"))
            with open(path, "rb") as f:
                while block := f.read(DIGEST_BLOCK):
                    h.update(block)
                    done += len(block)
                    if time.monotonic() - t_last > PROGRESS_EVERY_S:
                        t_last = time.monotonic()
                        log.warning(
                            kv("hashing the dataset", path=str(self.root), done_mib=done >> 20, total_mib=total >> 20)
                        )
        return h.hexdigest()


def resolve_dataset(path: str | Path) -> DatasetFiles:
    """The files a spec's `dataset` names: one file, or every known file below a directory."""
    root = Path(path).expanduser()
    if root.is_file():
        return DatasetFiles(root, (root.resolve(),), (root.name,), _format_of(root))
    if not root.is_dir():
        raise ConfigError(f"dataset {root} does not exist on this machine (every peer needs the same files)")
    found = sorted(
        (p.relative_to(root).as_posix(), p)
        for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    known = [(name, p) for name, p in found if p.suffix.lower() in FORMATS]
    if not known:
        raise ConfigError(f"dataset {root} holds no data files ({', '.join(sorted(FORMATS))})")
    formats = {FORMATS[p.suffix.lower()] for _, p in known}
    if len(formats) > 1:
        raise ConfigError(f"dataset {root} mixes formats ({', '.join(sorted(formats))}); keep one format per dataset")
    return DatasetFiles(root, tuple(p.resolve() for _, p in known), tuple(n for n, _ in known), formats.pop())


def check_digest(name: str, expected: str, actual: str) -> None:
    """Refuse (ConfigError, one line naming the dataset) when the spec pins a digest that the
    local files do not have. An empty `expected` pins nothing."""
    if expected and expected != actual:
        raise ConfigError(
            f"dataset {name}: the local files differ from the swarm's (content digest "
            f"{actual[:16]}…, the swarm spec pins {expected[:16]}…); every peer needs "
            f"the same files"
        )


def _format_of(path: Path) -> Format:
    return FORMATS.get(path.suffix.lower(), "text")
