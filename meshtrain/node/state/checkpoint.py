"""Checkpoints that survive `kill -9` at any instant: never a half-written file, resume bit-exact.

Layout under the node's checkpoint directory:

    ckpt-000001200/                one checkpoint, complete or absent
        tensors.safetensors        every tensor (model, outer and inner optimizer state)
        state.msgpack              the rest of the state: nested dicts/lists with tensor refs
        manifest.json              step, round, blake3 digest of both files, format version
    LATEST                         the name of the newest complete checkpoint

Why this shape: a checkpoint is written into `.tmp-<name>` and fsynced (files, then directory),
then renamed to its final name (atomic on POSIX), then `LATEST` is replaced by the same
temp-file + fsync + rename dance. A crash at any point leaves either the old `LATEST` pointing
at an intact checkpoint, or the new one; leftovers named `.tmp-*` are deleted at the next start.
Loading re-checks both digests, so even disk corruption is caught, and falls back to the
previous checkpoint rather than starting from scratch.

State is any nest of dicts/lists/scalars/tensors (e.g. `{"model": model.state_dict(),
"outer": outer.state_dict(), "inner": inner.state_dict(), ...}`); tensors go to safetensors
(no pickle: loading a checkpoint cannot run code), the skeleton to msgpack.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import torch
from safetensors.torch import load_file, save_file

from meshtrain.durable import fsync_dir, fsync_file, write_atomic
from meshtrain.errors import MeshtrainError
from meshtrain.log import get_logger, kv
from meshtrain.transport.framing import packb, unpackb

log = get_logger(__name__)

FORMAT = 1
LATEST = "LATEST"
_TENSOR_REF = "__tensor__"


class CheckpointError(MeshtrainError):
    """No usable checkpoint, or a checkpoint failed verification."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    round: int
    state: dict[str, Any]
    digest: str  # blake3 of the tensor file: what peers compare


def _split_tensors(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replace tensors by references, collecting them under unique dotted names."""
    if isinstance(obj, torch.Tensor):
        name = prefix or "tensor"
        tensors[name] = obj.detach().to("cpu").contiguous()
        return {_TENSOR_REF: name}
    if isinstance(obj, dict):
        return {
            "__dict__": [[k, _split_tensors(v, f"{prefix}.{k}" if prefix else str(k), tensors)] for k, v in obj.items()]
        }
    if isinstance(obj, list | tuple):
        return [_split_tensors(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, bool | int | float | str | bytes):
        return obj
    raise CheckpointError(f"cannot checkpoint a value of type {type(obj).__name__} at {prefix!r}")


def _join_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if _TENSOR_REF in obj:
            return tensors[obj[_TENSOR_REF]]
        return {k: _join_tensors(v, tensors) for k, v in obj["__dict__"]}
    if isinstance(obj, list):
        return [_join_tensors(v, tensors) for v in obj]
    return obj


def _file_digest(path: Path) -> str:
    h = blake3.blake3()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


_SAVE_LOCK = threading.Lock()


class CheckpointStore:
    """Saves and loads checkpoints in one directory, keeping the newest `keep`. `readonly`: only
    load (export, sample: a running node may be saving into the directory, so nothing is created
    or cleaned up)."""

    def __init__(self, directory: str | os.PathLike[str], keep: int = 3, *, readonly: bool = False) -> None:
        self.dir = Path(directory)
        self.keep = max(1, keep)
        if readonly:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        for leftover in self.dir.glob(".tmp-*"):  # a crash mid-save left these; they are garbage
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)

    def save(self, state: dict[str, Any], *, step: int, round: int) -> Checkpoint:
        """Write a checkpoint of `state` (a consistent snapshot the caller will not mutate).

        Saves are serialised within the process: a node's final checkpoint may coincide with a
        periodic one of the same step (both wrote one temp folder and the node crashed)."""
        with _SAVE_LOCK:
            return self._save(state, step=step, round=round)

    def _save(self, state: dict[str, Any], *, step: int, round: int) -> Checkpoint:
        name = f"ckpt-{step:09d}"
        final = self.dir / name
        tmp = self.dir / f".tmp-{name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        tensors: dict[str, torch.Tensor] = {}
        skeleton = _split_tensors(state, "", tensors)
        save_file(tensors, str(tmp / "tensors.safetensors"))
        (tmp / "state.msgpack").write_bytes(packb(skeleton))
        manifest = {
            "format": FORMAT,
            "step": step,
            "round": round,
            "tensors_blake3": _file_digest(tmp / "tensors.safetensors"),
            "state_blake3": _file_digest(tmp / "state.msgpack"),
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        for f in tmp.iterdir():
            fsync_file(f)
        fsync_dir(tmp)
        if final.exists():  # re-saving the same step: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(self.dir)
        write_atomic(self.dir / LATEST, name.encode())
        self._prune()
        log.info(kv("checkpoint saved", step=step, round=round, path=str(final)))
        return Checkpoint(final, step, round, state, manifest["tensors_blake3"])

    def _prune(self) -> None:
        for old in self.list()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def list(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        return sorted(p for p in self.dir.glob("ckpt-*") if p.is_dir())

    def load(self, path: str | os.PathLike[str]) -> Checkpoint:
        path = Path(path)
        try:
            manifest = json.loads((path / "manifest.json").read_text())
            if manifest.get("format") != FORMAT:
                raise CheckpointError(f"{path}: unknown checkpoint format {manifest.get('format')}")
            if _file_digest(path / "tensors.safetensors") != manifest["tensors_blake3"]:
                raise CheckpointError(f"{path}: tensor file digest mismatch (corrupt)")
            if _file_digest(path / "state.msgpack") != manifest["state_blake3"]:
                raise CheckpointError(f"{path}: state file digest mismatch (corrupt)")
            tensors = load_file(str(path / "tensors.safetensors"))
            state = _join_tensors(unpackb((path / "state.msgpack").read_bytes(), max_size=1 << 30), tensors)
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError, TypeError, MeshtrainError) as e:
            raise CheckpointError(f"{path}: unreadable checkpoint ({type(e).__name__}: {e})") from None
        return Checkpoint(path, int(manifest["step"]), int(manifest["round"]), state, manifest["tensors_blake3"])

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


def flatten_state(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split a nest of dicts/lists/scalars/tensors into a msgpack-able skeleton (tensors replaced
    by references) and the flat dict of tensors: the one way state is put on disk or the wire."""
    tensors: dict[str, torch.Tensor] = {}
    return _split_tensors(state, "", tensors), tensors


def unflatten_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `flatten_state`."""
    return _join_tensors(skeleton, tensors)
