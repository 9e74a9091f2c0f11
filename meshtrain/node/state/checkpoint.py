"""Checkpoints that survive `kill -9` at any instant: never a half-written file, resume bit-exact.

Layout under the node's checkpoint directory:

    ckpt-000001200/                one checkpoint, complete or absent
        tensors.safetensors        every tensor (model, outer and inner optimizer state), or
        tensors-00001-of-00004.safetensors ...   in shards of at most `shard_bytes` (2 GiB)
        state.msgpack              the rest of the state: nested dicts/lists with tensor refs
        manifest.json              step, round, blake3 digest of every file, format version
    LATEST                         the name of the newest complete checkpoint

Shards. A 7B model's checkpoint (θ, φ, outer momentum, AdamW: ~20 B/param) is 140 GB; as one
file it is one digest to wait for, one file no tool copies in parts, and past some filesystems'
limits. So the tensors go into shards of at most `shard_bytes`, split as the Hugging Face Hub
splits a model (`huggingface_hub.split_torch_state_dict_into_shards`, the same file-name pattern;
a tensor larger than a shard is a shard of its own), each with its own digest in the manifest. A
state that fits one shard is one `tensors.safetensors`, as before. Format 2 lists the files;
format 1 checkpoints (one tensor file) still load.

Why this shape: a checkpoint is written into `.tmp-<name>-<pid>-<n>` and fsynced (files, then
directory), then renamed to its final name (atomic on POSIX), then `LATEST` is replaced by the
same temp-file + fsync + rename dance. A crash at any point leaves either the old `LATEST`
pointing at an intact checkpoint, or the new one; leftovers named `.tmp-*` are deleted at the
next start. Loading re-checks both digests, so even disk corruption is caught, and falls back to
the previous checkpoint rather than starting from scratch.

Memory: no second copy. A checkpoint is written from the live tensors, in two parts:
`write` (safetensors writes each host tensor from its own memory, by pointer: no copy; a device
tensor is copied to the host first) and `PendingCheckpoint.commit` (digests, manifest, fsyncs,
renames: it reads only the files). Only `write` reads the state, so only it must run where the
state is consistent and not changing — the node runs it on the training thread between two steps,
which pauses training for the time it takes to write the bytes into the page cache (logged as
`pause_s`; ~20 B/param for DiLoCo with AdamW), and commits in the background. `save` is both.
A tensor that shares storage with one already written (tied embeddings) is written once and
referenced twice, as safetensors refuses shared storage (and a copy would cost memory).

State is any nest of dicts/lists/scalars/tensors (e.g. `{"model": model.state_dict(),
"outer": outer.state_dict(), "inner": inner.state_dict(), ...}`); tensors go to safetensors
(no pickle: loading a checkpoint cannot run code), the skeleton to msgpack. The format (1) is
unchanged by writing from live tensors: checkpoints of older versions load as they did.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file, save_file

from meshtrain.durable import fsync_dir, fsync_file, write_atomic
from meshtrain.errors import MeshtrainError
from meshtrain.log import get_logger, kv
from meshtrain.transport.framing import packb, unpackb

log = get_logger(__name__)

FORMAT = 2  # 1: one tensor file (`tensors_blake3`); 2: `tensor_files`, shards (module docstring)
READABLE_FORMATS = (1, 2)
LATEST = "LATEST"
_TENSOR_REF = "__tensor__"
MAX_DEPTH = 32  # a state's nesting (an optimizer's state is 4 deep); a deeper skeleton is malformed


class CheckpointError(MeshtrainError):
    """No usable checkpoint, or a checkpoint failed verification."""


class MalformedStateError(CheckpointError):
    """A skeleton that does not unflatten (`unflatten_state`): not `flatten_state`'s output — a
    reference to a tensor it did not come with, a malformed dict, nesting past `MAX_DEPTH`."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    round: int
    state: dict[str, Any]
    digest: str  # blake3 of the tensor file (of the shards' digests, for several): for the log


@dataclass
class _Taken:
    """The memory of the tensors a flattening took so far: each view's name, and their storages."""

    views: dict[tuple[int, int, torch.dtype, tuple[int, ...]], str] = field(default_factory=dict)
    storages: set[int] = field(default_factory=set)


def _split_tensors(obj: Any, prefix: str, tensors: dict[str, torch.Tensor], seen: _Taken) -> Any:
    """Replace tensors by references, collecting them under unique dotted names. Host tensors are
    taken as they are (no copy when contiguous); a tensor seen before (the same view of the same
    memory: tied weights) becomes a second reference to the first one's name; another view of
    memory already taken is copied (safetensors refuses tensors that share storage)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu").contiguous()
        name = prefix or "tensor"
        if t.numel():  # empty tensors have no memory to share
            view = (t.untyped_storage().data_ptr(), int(t.storage_offset()), t.dtype, tuple(t.shape))
            if view in seen.views:
                return {_TENSOR_REF: seen.views[view]}
            if view[0] in seen.storages:
                t = t.clone()
                view = (t.untyped_storage().data_ptr(), 0, t.dtype, tuple(t.shape))
            seen.views[view] = name
            seen.storages.add(view[0])
        tensors[name] = t
        return {_TENSOR_REF: name}
    if isinstance(obj, dict):
        return {
            "__dict__": [
                [k, _split_tensors(v, f"{prefix}.{k}" if prefix else str(k), tensors, seen)] for k, v in obj.items()
            ]
        }
    if isinstance(obj, list | tuple):
        return [_split_tensors(v, f"{prefix}.{i}", tensors, seen) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, bool | int | float | str | bytes):
        return obj
    raise CheckpointError(f"cannot checkpoint a value of type {type(obj).__name__} at {prefix!r}")


def _join_tensors(obj: Any, tensors: dict[str, torch.Tensor], depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise MalformedStateError(f"the state nests deeper than {MAX_DEPTH} levels")
    if isinstance(obj, dict):
        if _TENSOR_REF in obj:
            ref = obj[_TENSOR_REF]
            if len(obj) != 1 or not isinstance(ref, str) or ref not in tensors:
                raise MalformedStateError(f"a reference to a tensor the state does not hold: {str(ref)[:64]!r}")
            return tensors[ref]
        items = obj.get("__dict__")
        if len(obj) != 1 or not isinstance(items, list):
            raise MalformedStateError("a dict that is not a state's")
        out = {}
        for item in items:
            if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str | int):
                raise MalformedStateError("a dict entry that is not a [key, value] pair")
            out[item[0]] = _join_tensors(item[1], tensors, depth + 1)
        return out
    if isinstance(obj, list):
        return [_join_tensors(v, tensors, depth + 1) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str | bytes):
        return obj
    raise MalformedStateError(f"a value of type {type(obj).__name__} in the state")


_DIGEST_BUFFER = 4 << 20
SHARD_BYTES = 2 << 30  # a checkpoint's tensor files hold at most this many bytes each (module docstring)
TENSOR_FILES = "tensors{suffix}.safetensors"  # the shards' names (huggingface_hub's pattern)
STATE_FILE = "state.msgpack"


def tensor_digest(files: dict[str, str]) -> str:
    """One digest for a checkpoint's tensor files (file -> blake3): the file's own for one."""
    if len(files) == 1:
        return next(iter(files.values()))
    return blake3.blake3("\n".join(f"{f} {d}" for f, d in sorted(files.items())).encode()).hexdigest()


def file_digest(path: Path) -> str:
    """blake3 of a file, read through one reused buffer (a checkpoint is as large as the state;
    reading it must not cost memory either)."""
    h = blake3.blake3()
    buffer = memoryview(bytearray(_DIGEST_BUFFER))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(buffer[:n])
    return h.hexdigest()


_SAVE_LOCK = threading.Lock()  # commits are serialised: two of one step replace one folder
_TMP_NUMBERS = itertools.count()  # a temp folder per write, so two writes never share one


class PendingCheckpoint:
    """A checkpoint written into its temp folder, not yet complete: `commit` makes it one (any
    thread: it reads only the files), `abandon` deletes it. Made by `CheckpointStore.write`."""

    def __init__(self, store: CheckpointStore, tmp: Path, name: str, state: dict[str, Any], step: int, round: int):
        self.store, self.tmp, self.name, self.state, self.step, self.round = store, tmp, name, state, step, round

    def commit(self) -> Checkpoint:
        """Digest every file, write the manifest, fsync, rename into place, point `LATEST` at it,
        prune the oldest."""
        tmp, final = self.tmp, self.store.dir / self.name
        try:
            files = {f.name: file_digest(f) for f in sorted(tmp.glob("tensors*.safetensors"))}
            manifest = {
                "format": FORMAT,
                "step": self.step,
                "round": self.round,
                "tensor_files": files,
                "state_blake3": file_digest(tmp / STATE_FILE),
            }
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
            for f in tmp.iterdir():
                fsync_file(f)
            fsync_dir(tmp)
            with _SAVE_LOCK:
                if final.exists():  # re-saving the same step (a final checkpoint after a periodic one)
                    shutil.rmtree(final)
                os.rename(tmp, final)
                fsync_dir(self.store.dir)
                write_atomic(self.store.dir / LATEST, self.name.encode())
                self.store.prune()
        except BaseException:
            self.abandon()
            raise
        log.info(kv("checkpoint saved", step=self.step, round=self.round, path=str(final)))
        return Checkpoint(final, self.step, self.round, self.state, tensor_digest(files))

    def abandon(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


class CheckpointStore:
    """Saves and loads checkpoints in one directory, keeping the newest `keep`. `readonly`: only
    load (export, sample: a running node may be saving into the directory, so nothing is created
    or cleaned up)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep: int = 3,
        *,
        readonly: bool = False,
        shard_bytes: int = SHARD_BYTES,
    ) -> None:
        self.dir = Path(directory)
        self.keep = max(1, keep)
        self.shard_bytes = shard_bytes
        if readonly:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        for leftover in self.dir.glob(".tmp-*"):  # a crash mid-save left these; they are garbage
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)

    def save(self, state: dict[str, Any], *, step: int, round: int) -> Checkpoint:
        """Write and commit a checkpoint of `state` (it must not change meanwhile)."""
        return self.write(state, step=step, round=round).commit()

    def write(self, state: dict[str, Any], *, step: int, round: int) -> PendingCheckpoint:
        """Write `state`'s tensors and skeleton into a temp folder, straight from the tensors'
        memory (module docstring, "Memory"): `state` must not change until this returns, and
        not after either if the caller keeps the returned `PendingCheckpoint.state`."""
        name = f"ckpt-{step:09d}"
        tmp = self.dir / f".tmp-{name}-{os.getpid()}-{next(_TMP_NUMBERS)}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            skeleton, tensors = flatten_state(state)
            split = split_torch_state_dict_into_shards(
                tensors, filename_pattern=TENSOR_FILES, max_shard_size=self.shard_bytes
            )
            for file, names in split.filename_to_tensors.items():
                save_file({n: tensors[n] for n in names}, str(tmp / file))
            if not tensors:  # a state without tensors still has its (empty) tensor file
                save_file({}, str(tmp / TENSOR_FILES.format(suffix="")))
            (tmp / STATE_FILE).write_bytes(packb(skeleton))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return PendingCheckpoint(self, tmp, name, state, step, round)

    def prune(self) -> None:
        """Delete all but the newest `keep` complete checkpoints."""
        for old in self.list()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def list(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return sorted(p for p in self.dir.glob("ckpt-*") if p.is_dir())

    def load(self, path: str | os.PathLike[str]) -> Checkpoint:
        path = Path(path)
        try:
            manifest = json.loads((path / "manifest.json").read_text())
            if manifest.get("format") not in READABLE_FORMATS:
                raise CheckpointError(f"{path}: unknown checkpoint format {manifest.get('format')}")
            files = _tensor_files(manifest)
            for file, digest in files.items():
                if file_digest(path / file) != digest:
                    raise CheckpointError(f"{path}: tensor file {file} digest mismatch (corrupt)")
            if file_digest(path / STATE_FILE) != manifest["state_blake3"]:
                raise CheckpointError(f"{path}: state file digest mismatch (corrupt)")
            tensors: dict[str, torch.Tensor] = {}
            for file in files:
                tensors.update(load_file(str(path / file)))
            state = _join_tensors(unpackb((path / STATE_FILE).read_bytes(), max_size=1 << 30), tensors)
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError, TypeError, MeshtrainError) as e:
            raise CheckpointError(f"{path}: unreadable checkpoint ({type(e).__name__}: {e})") from None
        return Checkpoint(path, int(manifest["step"]), int(manifest["round"]), state, tensor_digest(files))

    def load_latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies; None if there is none at all."""
        candidates = self.list()
        try:
            named = (self.dir / LATEST).read_text().strip()
            if (self.dir / named).is_dir():
                candidates.remove(self.dir / named)
                candidates.append(self.dir / named)
        except OSError:
            pass
        for path in reversed(candidates):
            try:
                return self.load(path)
            except CheckpointError as e:
                log.warning(kv("skipping bad checkpoint", path=str(path), error=str(e)))
        return None


def _tensor_files(manifest: dict[str, Any]) -> dict[str, str]:
    """A manifest's tensor files -> their digests: format 2 lists them, format 1 had one."""
    if manifest["format"] == 1:
        return {TENSOR_FILES.format(suffix=""): manifest["tensors_blake3"]}
    files = manifest["tensor_files"]
    if (
        not isinstance(files, dict)
        or not files
        or not all(
            isinstance(f, str) and isinstance(d, str) and f == Path(f).name and f.endswith(".safetensors")
            for f, d in files.items()
        )
    ):
        raise CheckpointError(f"a manifest's tensor_files must name files of the checkpoint, got {files!r}")
    return files


def flatten_state(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split a nest of dicts/lists/scalars/tensors into a msgpack-able skeleton (tensors replaced
    by references) and the flat dict of tensors: the one way state is put on disk or the wire."""
    tensors: dict[str, torch.Tensor] = {}
    return _split_tensors(state, "", tensors, _Taken()), tensors


def unflatten_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `flatten_state`. `MalformedStateError` for a skeleton that is not its output (one
    may come from a peer: node/state/download.py, node/stages/state.py)."""
    return _join_tensors(skeleton, tensors)
