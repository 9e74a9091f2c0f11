"""Durable writes: a file replaced whole or not at all, and the fsyncs that make a rename stick.

Every file a node keeps in its data dir (checkpoints' `LATEST`, the signed spec, the address
book, the strikes and admission records, `daemon.json`) and the data cache's shards must survive
`kill -9` or a power cut at any instant. POSIX gives one atomic step, `rename` over an existing
name; it is durable only once the new file's bytes and then the directory entry are on disk. So
`write_atomic` writes a sibling temp file (created with the file's final mode, so a secret is never
readable by others), fsyncs it, renames it into place and fsyncs the directory: a reader (or the
next start) sees the old content or the new one, never a mix.

Not here: cleaning up temp files a crash left behind — each owner knows its own names
(checkpoints delete `.tmp-*` at start; the data cache rebuilds an unfinished shard).
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    """Flush a file that is already written and closed to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename into it, a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, mode: int = 0o666) -> None:
    """Replace `path` with `data` so that readers see the old or the new content, never a mix.
    `mode`: the file's permissions (less the umask) from its creation: 0o600 for a secret (an
    identity key, a swarm key, the control token), never readable by others, not even briefly."""
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.unlink(missing_ok=True)  # a crash's leftover keeps its old mode if opened again
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
