"""Which samples a peer trains on at a step: a pure function of (seed, peer, step, microbatch).

As in Psyche (each client's data follows from the round and the client's identity), the swarm
seed, the peer id, the step and the microbatch index are hashed (blake2b, under a versioned
domain tag) into the seed of a private `torch.Generator`, from which the data source draws its
samples. So peers draw different samples without coordinating, and a peer restarted at step s
draws exactly what it would have drawn: the step *is* the data position, and a checkpoint that
records the step records where the data stream stands. The global RNG is never touched. Peer 3
and peer "3" are the same peer.

Used by both data sources: `Corpus` (random windows of an in-memory text) and `PackedDataset`
(random packed sequences of a token cache). Not here: what a sample is (each source decides).
"""

from __future__ import annotations

import hashlib

import torch

from meshtrain.errors import ConfigError
from meshtrain.transport.validate import is_int

# Domain tag of the batch hash; bump the version if the sampling scheme ever changes, so peers on
# different schemes cannot believe they share a data assignment.
BATCH_HASH_DOMAIN = b"meshtrain/corpus/batch/v1"


def check_positive(name: str, value: int) -> None:
    if not is_int(value) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def assignment_generator(
    batch_size: int, context: int, *, seed: int, peer: str | int, step: int, microbatch: int = 0
) -> torch.Generator:
    """The private generator `peer` draws its batch at (`step`, `microbatch`) from, after
    checking every argument (ConfigError, one line, for a bad one)."""
    check_positive("batch_size", batch_size)
    check_positive("context", context)
    for name, value in (("seed", seed), ("step", step), ("microbatch", microbatch)):
        if not is_int(value):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
    if step < 0 or microbatch < 0:
        raise ConfigError(f"step and microbatch must be >= 0, got {step}, {microbatch}")
    if not (is_int(peer) or isinstance(peer, str)):
        raise ConfigError(f"peer must be a string or an integer, got {peer!r}")
    key = b"\0".join(
        [BATCH_HASH_DOMAIN, str(seed).encode(), str(peer).encode(), str(step).encode(), str(microbatch).encode()]
    )
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
