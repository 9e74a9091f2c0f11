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

No rehash on restart. Reading a multi-GB corpus costs minutes, and a node starts often. So
`digest(manifest=...)` keeps a small JSON manifest (open_dataset: `<cache root>/digests/`, one per
dataset path): for each file its size, mtime_ns and a sampled digest (blake3 of its size and of its
first, middle and last MiB: the whole file when it is at most 3 MiB), and the full digest computed
from them. When every file's (name, size, mtime_ns, sampled digest) matches, the full digest is
reused without reading the rest; otherwise it is recomputed exactly as above and the manifest
rewritten (`write_atomic`: a kill leaves the old one or the new one), all under a flock, so a
node's local ranks digest once and the others reuse it. The digest is the same function of the
content either way; only its caching is new. Stat is taken before hashing, so a file changed while
it is hashed does not match at the next start.
  What it lets past, honestly: an edit that keeps a file's size AND its mtime_ns (a tool that
restores mtimes, `touch -r`, a coarse-clock filesystem within one tick) AND touches only bytes
outside the three sampled MiB. An ordinary edit moves mtime_ns; a touch without an edit is
re-digested and gives the same digest. What such an edit costs: the node keeps the old digest and
the token cache built from the old content (which is what the swarm pinned) — until that cache is
deleted and rebuilt from the new bytes under the old key. Delete `digests/` to force a full
rehash; `dataset_digest` (`swarm create`) never uses a manifest.

Progress. `digest(progress=...)` calls back with a `Progress` (frozen: phase, dataset, done and
total in bytes of input, an ETA once it can tell) at most every `PROGRESS_EVERY_S`, from the thread
that hashes, and once at the end with done == total (`ProgressMeter`; cache.py uses it too).
`READS` counts the bytes read from dataset files (the tests' check that nothing was re-read).

Failures: a missing path, an empty directory, mixed formats: `ConfigError`
(one line, saying which). An unreadable or stale manifest is ignored (the digest is recomputed).
Not here: reading documents (documents.py), tokenising (cache.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import blake3

from meshtrain.durable import write_atomic
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
SAMPLE_BYTES = 1 << 20  # each of the first, middle and last MiB of a file, for the manifest
MANIFEST_FORMAT = 1
PROGRESS_EVERY_S = 0.5  # between two progress callbacks
LOG_EVERY_S = 10.0  # between two progress lines in the log
ETA_AFTER_S = 2.0  # a rate measured over less time is noise


@dataclass(frozen=True)
class Progress:
    """How far preparing a dataset is. phase: "digesting" or "tokenising"; dataset: the path the
    spec named; done, total: bytes of input; eta_s: seconds left at the rate so far (None until
    it can tell)."""

    phase: Literal["digesting", "tokenising"]
    dataset: str
    done: int
    total: int
    eta_s: float | None = None

    def describe(self) -> str:
        """One line for people: "tokenising data/corpus.txt, 1.2 of 4.0 GB (30 %), about 3 min left"."""
        scale, unit = next(((s, u) for s, u in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")) if self.total >= s), (1, "B"))
        amounts = (
            f"{self.done / scale:.1f} of {self.total / scale:.1f}" if scale > 1 else f"{self.done} of {self.total}"
        )
        percent = 100 * self.done // self.total if self.total else 100
        line = f"{self.phase} {self.dataset}, {amounts} {unit} ({percent} %)"
        if self.eta_s is not None:
            line += f", about {_duration(self.eta_s)} left"
        return line


ProgressCallback = Callable[[Progress], None]


class ProgressMeter:
    """Reports one phase's progress: to `callback` at most every `PROGRESS_EVERY_S`, to the log every
    `LOG_EVERY_S`, and always at `finish`. The ETA is measured from this run's own rate (a resumed
    build starts at done > 0)."""

    def __init__(
        self,
        phase: Literal["digesting", "tokenising"],
        dataset: str,
        total: int,
        done: int = 0,
        callback: ProgressCallback | None = None,
    ) -> None:
        self.phase, self.dataset, self.total, self.callback = phase, dataset, total, callback
        self.done = self.started_at = done
        self.t0 = self.t_call = self.t_log = time.monotonic()

    def advance(self, done: int) -> None:
        """`done` bytes of input are behind us (kept below `total` until `finish`)."""
        self.done = min(done, self.total - 1) if self.total else 0
        now = time.monotonic()
        if self.callback is not None and now - self.t_call >= PROGRESS_EVERY_S:
            self.t_call = now
            self.callback(self.progress(now))
        if now - self.t_log >= LOG_EVERY_S:
            self.t_log = now
            p = self.progress(now)
            log.warning(kv(p.phase, dataset=p.dataset, done_mib=p.done >> 20, total_mib=p.total >> 20, eta_s=p.eta_s))

    def finish(self) -> None:
        self.done = self.total
        if self.callback is not None:
            self.callback(self.progress(time.monotonic()))

    def progress(self, now: float) -> Progress:
        elapsed, moved = now - self.t0, self.done - self.started_at
        left = self.total - self.done
        # done: nothing is left to estimate (not "about 1 s left" at 100 %, seen on a loaded machine)
        eta = left * elapsed / moved if elapsed >= ETA_AFTER_S and moved > 0 and left > 0 else None
        return Progress(self.phase, self.dataset, self.done, self.total, None if eta is None else round(eta, 1))


class ReadCounter:
    """Bytes read from dataset files by this module (digests and samples)."""

    def __init__(self) -> None:
        self.bytes = 0


READS = ReadCounter()


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

    def digest(self, *, manifest: Path | None = None, progress: ProgressCallback | None = None) -> str:
        """blake3 of the files' names, sizes and bytes (module docstring), hex. With a `manifest`,
        reused from it when no file changed, and recorded in it when computed — under a lock
        (`<manifest>.lock`, flock): a node's local ranks digest once, the others wait and reuse."""
        if manifest is None:
            return self._full_digest(progress)
        manifest.parent.mkdir(parents=True, exist_ok=True)
        with open(manifest.with_name(manifest.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            stats = [os.stat(f) for f in self.files]  # before hashing: a change while hashing is a mismatch later
            recorded = _read_manifest(manifest)
            if recorded is not None and recorded.get("files") == self._fingerprints(stats, recorded.get("files")):
                return str(recorded["digest"])
            digest = self._full_digest(progress)
            entries = self._entries(stats)
            record = {"format": MANIFEST_FORMAT, "root": str(self.root), "digest": digest, "files": entries}
            write_atomic(manifest, json.dumps(record, indent=1).encode())
        return digest

    def _fingerprints(self, stats: list[os.stat_result], recorded: Any) -> list[dict[str, Any]] | None:
        """The manifest's entries for the files as they are now, or None when a name, size or
        mtime already differs (no file is read then)."""
        if not isinstance(recorded, list) or len(recorded) != len(self.files):
            return None
        for name, st, entry in zip(self.names, stats, recorded, strict=True):
            if not isinstance(entry, dict) or (entry.get("name"), entry.get("size"), entry.get("mtime_ns")) != (
                name,
                st.st_size,
                st.st_mtime_ns,
            ):
                return None
        return self._entries(stats)

    def _entries(self, stats: list[os.stat_result]) -> list[dict[str, Any]]:
        """The manifest's entry of each file: its name, size, mtime_ns and sampled digest."""
        return [
            {"name": n, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sample": _sample(f, st.st_size)}
            for n, f, st in zip(self.names, self.files, stats, strict=True)
        ]

    def _full_digest(self, progress: ProgressCallback | None) -> str:
        h = blake3.blake3()
        h.update(DIGEST_DOMAIN)
        meter = ProgressMeter("digesting", str(self.root), self.size, callback=progress)
        done = 0
        for name, path in zip(self.names, self.files, strict=True):
            h.update(name.encode("utf-8", errors="surrogatepass") + b"\0")
            h.update(path.stat().st_size.to_bytes(8, "little"))
            with open(path, "rb") as f:
                while block := f.read(DIGEST_BLOCK):
                    h.update(block)
                    done += len(block)
                    READS.bytes += len(block)
                    meter.advance(done)
        meter.finish()
        return h.hexdigest()


def _sample(path: Path, size: int) -> str:
    """blake3 of `size` and of the first, middle and last `SAMPLE_BYTES` (the whole file when small)."""
    h = blake3.blake3()
    h.update(size.to_bytes(8, "little"))
    spans = (
        [(0, size)]
        if size <= 3 * SAMPLE_BYTES
        else [(0, SAMPLE_BYTES), (size // 2 - SAMPLE_BYTES // 2, SAMPLE_BYTES), (size - SAMPLE_BYTES, SAMPLE_BYTES)]
    )
    with open(path, "rb") as f:
        for offset, length in spans:
            data = os.pread(f.fileno(), length, offset)
            READS.bytes += len(data)
            h.update(data)
    return h.hexdigest()


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and record.get("format") == MANIFEST_FORMAT and isinstance(record.get("digest"), str)
    return record if ok else None


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


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
