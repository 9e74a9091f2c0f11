"""`PackedDataset`: fixed-length training sequences drawn from a token cache by random access.

The token cache (cache.py) is a flat stream of ids, documents back to back with an end-of-text
token between them. For a context c, packed sequence i is tokens [i·(c+1), (i+1)·(c+1)): inputs
are its first c tokens, targets its last c (the next-token objective), and a sequence may span a
document boundary, as in GPT pre-training. The tail shorter than c + 1 tokens is not trained on.

Sampling: the batch of (seed, peer, step, microbatch) is `batch_size` sequence ids drawn with
replacement from the private generator of `assignment.assignment_generator` — a pure function,
so a peer restarted at step s continues exactly where it stopped (the step is the data position;
`sample_ids` tells which sequences a step trains, for checking). A batch reads its sequences
with one positioned read (`os.pread`) each: resident memory stays a few batches, whatever the
corpus size. (Not a memmap: the kernel's fault-around maps 64 KiB of cached file around every
page a random read touches, and all of it counts as the process' resident memory — 550 MiB
after 500 batches of a freshly built 500 MB cache.)

Evaluation: `eval_batches` reads held-out sequences at fixed, evenly spaced ids, the same on
every peer and every call (wrapping round when the held-out split has fewer sequences than
asked for). A split without one whole sequence is a ConfigError that says what to change.

Same interface as `meshtrain.models.Corpus` (`batch`, `eval_batches`, `vocab_size`, `digest`,
`source`), so the trainer takes either. Not here: building the cache (cache.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from meshtrain.data.assignment import assignment_generator, check_positive
from meshtrain.data.cache import CACHE_FORMAT, META
from meshtrain.errors import ConfigError


@dataclass(frozen=True, eq=False)
class PackedDataset:
    """A token cache opened for sampling.

    directory: the cache directory. meta: its meta.json. train, held_out: the token files.
    digest: the cache key (dataset, tokenizer and split in one fingerprint: what a checkpoint
        records to know it resumes on the same data).
    """

    directory: Path
    meta: dict[str, Any] = field(repr=False)
    train: TokenFile = field(repr=False)
    held_out: TokenFile = field(repr=False)

    @classmethod
    def open(cls, directory: str | Path) -> PackedDataset:
        directory = Path(directory)
        try:
            meta = json.loads((directory / META).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"token cache {directory} is unreadable ({e}); delete it to rebuild") from None
        if meta.get("format") != CACHE_FORMAT:
            raise ConfigError(
                f"token cache {directory} has format {meta.get('format')}, not {CACHE_FORMAT}; delete it to rebuild"
            )
        dtype = np.dtype(meta["dtype"])
        return cls(
            directory, meta, TokenFile(directory / "train.bin", dtype), TokenFile(directory / "held_out.bin", dtype)
        )

    @property
    def digest(self) -> str:
        return str(self.meta["key"])

    @property
    def source(self) -> str:
        return str(self.meta["dataset"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def sequences(self, context: int, part: str = "train") -> int:
        """How many whole packed sequences of `context` + 1 tokens `part` ("train" or
        "held-out") holds."""
        check_positive("context", context)
        return len(self.train if part == "train" else self.held_out) // (context + 1)

    def sequence(self, index: int, context: int, part: str = "train") -> np.ndarray:
        data = self.train if part == "train" else self.held_out
        return data.read(index * (context + 1), context + 1)

    def sample_ids(
        self, batch_size: int, context: int, *, seed: int, peer: str | int, step: int, microbatch: int = 0
    ) -> torch.Tensor:
        """The ids of the packed sequences `peer` trains on at `step` (int64 [batch_size])."""
        generator = assignment_generator(batch_size, context, seed=seed, peer=peer, step=step, microbatch=microbatch)
        n = self._count(context, "train")
        return torch.randint(0, n, (batch_size,), generator=generator)

    def batch(
        self, batch_size: int, context: int, *, seed: int, peer: str | int, step: int, microbatch: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 [batch_size, context] each: a pure function of the arguments."""
        ids = self.sample_ids(batch_size, context, seed=seed, peer=peer, step=step, microbatch=microbatch)
        return self._rows(self.train, ids, context)

    def eval_batches(self, n: int, batch_size: int, context: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        check_positive("n", n)
        check_positive("batch_size", batch_size)
        count = self._count(context, "held-out")
        total = n * batch_size
        ids = (
            torch.arange(total, dtype=torch.int64) * max(count - 1, 0) // max(total - 1, 1)
            if count >= total
            else torch.arange(total, dtype=torch.int64) % count
        )
        return [self._rows(self.held_out, part, context) for part in ids.split(batch_size)]

    def _count(self, context: int, part: str) -> int:
        count = self.sequences(context, part)
        if count == 0:
            data = self.train if part == "train" else self.held_out
            hint = (
                "hold out more documents (held_out) or name an eval_dataset"
                if part == "held-out"
                else "use more data or a shorter context"
            )
            raise ConfigError(
                f"dataset {self.source}: the {part} split has {len(data)} tokens, fewer "
                f"than one sequence of context + 1 = {context + 1}; {hint}"
            )
        return count

    @staticmethod
    def _rows(data: TokenFile, ids: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        length = context + 1
        rows = np.stack([data.read(i * length, length) for i in ids.tolist()]).astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class TokenFile:
    """A flat file of token ids read by position (`os.pread`: thread-safe, no shared offset)."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path = path
        self.dtype = np.dtype(dtype)
        self._file = open(path, "rb")  # noqa: SIM115 — lives as long as the dataset
        self.tokens = os.fstat(self._file.fileno()).st_size // self.dtype.itemsize

    def __len__(self) -> int:
        return self.tokens

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) (fewer at the end of the file)."""
        size = self.dtype.itemsize
        raw = os.pread(self._file.fileno(), count * size, start * size)
        return np.frombuffer(raw, dtype=self.dtype)
