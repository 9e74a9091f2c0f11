"""`PackedDataset`: fixed-length training sequences drawn from a token cache by random access.

The token cache (cache.py) is a flat stream of ids, documents back to back with an end-of-text
token between them. For a context c, packed sequence i is tokens [i·(c+1), (i+1)·(c+1)): inputs
are its first c tokens, targets its last c (the next-token objective), and a sequence may span a
document boundary, as in GPT pre-training. The tail shorter than c + 1 tokens is not trained on.

Sampling: the batch of (seed, peer, step, microbatch) is `batch_size` sequence ids drawn with
replacement from the private generator of `assignment.assignment_generator` — a pure function,
so a peer restarted at step s continues exactly where it stopped (the step is the data position;
`sample_ids` tells which sequences a step trains, for checking). The files are numpy memmaps
opened read-only: a batch reads only its own pages, and resident memory stays bounded by what
the OS keeps cached, whatever the corpus size.

Evaluation: `eval_batches` reads held-out sequences at fixed, evenly spaced ids, the same on
every peer and every call (wrapping round when the held-out split has fewer sequences than
asked for). A split without one whole sequence is a ConfigError that says what to change.

Same interface as `meshtrain.models.Corpus` (`batch`, `eval_batches`, `vocab_size`, `digest`,
`source`), so the trainer takes either. Not here: building the cache (cache.py).
"""

from __future__ import annotations

import json
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

    directory: the cache directory. meta: its meta.json. train, held_out: the token memmaps.
    digest: the cache key (dataset, tokenizer and split in one fingerprint: what a checkpoint
        records to know it resumes on the same data).
    """

    directory: Path
    meta: dict[str, Any] = field(repr=False)
    train: np.ndarray = field(repr=False)
    held_out: np.ndarray = field(repr=False)

    @classmethod
    def open(cls, directory: str | Path) -> PackedDataset:
        directory = Path(directory)
        try:
            meta = json.loads((directory / META).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"token cache {directory} is unreadable ({e}); delete it to rebuild") from None
        if meta.get("format") != CACHE_FORMAT:
            raise ConfigError(f"token cache {directory} has format {meta.get('format')}, not "
                              f"{CACHE_FORMAT}; delete it to rebuild")
        dtype = np.dtype(meta["dtype"])
        return cls(directory, meta, _memmap(directory / "train.bin", dtype),
                   _memmap(directory / "held_out.bin", dtype))

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
        return np.asarray(data[index * (context + 1):(index + 1) * (context + 1)])

    def sample_ids(self, batch_size: int, context: int, *, seed: int, peer: str | int, step: int,
                   microbatch: int = 0) -> torch.Tensor:
        """The ids of the packed sequences `peer` trains on at `step` (int64 [batch_size])."""
        generator = assignment_generator(batch_size, context, seed=seed, peer=peer, step=step,
                                         microbatch=microbatch)
        n = self._count(context, "train")
        return torch.randint(0, n, (batch_size,), generator=generator)

    def batch(self, batch_size: int, context: int, *, seed: int, peer: str | int, step: int,
              microbatch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 [batch_size, context] each: a pure function of the arguments."""
        ids = self.sample_ids(batch_size, context, seed=seed, peer=peer, step=step, microbatch=microbatch)
        return self._rows(self.train, ids, context)

    def eval_batches(self, n: int, batch_size: int, context: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        check_positive("n", n)
        check_positive("batch_size", batch_size)
        count = self._count(context, "held-out")
        total = n * batch_size
        ids = torch.arange(total, dtype=torch.int64) * max(count - 1, 0) // max(total - 1, 1) \
            if count >= total else torch.arange(total, dtype=torch.int64) % count
        return [self._rows(self.held_out, part, context) for part in ids.split(batch_size)]

    def _count(self, context: int, part: str) -> int:
        count = self.sequences(context, part)
        if count == 0:
            data = self.train if part == "train" else self.held_out
            hint = ("hold out more documents (held_out) or name an eval_dataset" if part == "held-out"
                    else "use more data or a shorter context")
            raise ConfigError(f"dataset {self.source}: the {part} split has {len(data)} tokens, fewer "
                              f"than one sequence of context + 1 = {context + 1}; {hint}")
        return count

    @staticmethod
    def _rows(data: np.ndarray, ids: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        length = context + 1
        index = ids.numpy()[:, None] * length + np.arange(length)
        rows = torch.from_numpy(np.asarray(data[index], dtype=np.int64))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def _memmap(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:  # numpy cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")
