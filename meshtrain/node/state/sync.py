"""Late joiners: download the swarm's current state from several peers at once, verified — the protocol.

The problem. A peer joining a running swarm needs φ (the outer parameters) and the outer
optimizer's state — 200 MB for a 25M-parameter model with Nesterov momentum, gigabytes for real
models. hivemind's `load_state_from_peers` picks the one peer that advertises the highest
priority in the DHT (a number the peer reports about itself) and streams everything from it; the
join is as slow as that volunteer's uplink, a failure restarts from zero with the next peer, and
nothing checks what arrives, so one peer announcing a high priority hands every joiner its own
tensors. This protocol replaces that:

1. **Snapshots** (node/state/donor.py, `StateDonor.publish`). After each outer round the node
   publishes `(meta, tensors)`, a snapshot that does not change while it is offered: its live φ
   and outer state, lent without a copy until the next round changes them, and copied then only
   if a joiner is fetching it (copy-on-write); serving reads only published snapshots, so it
   never blocks or races training. The donor keeps the newest two, so a joiner whose download
   straddles a round boundary can finish the older one.
2. **Flattened state** (here: `FlatState`). The tensors sorted by name, their raw bytes
   concatenated: the state's digest is blake3 over that (= `payload_digest` of the sorted dict).
   A chunk is a fixed byte range `[i·C, min((i+1)·C, total))` of it — it may cut through or span
   tensors — with its own blake3 digest. The joiner chooses C (default 8 MiB); every donor
   answers for that C.
3. **Manifests and the vote** (RPC `state/manifest`; node/state/fetch.py). The joiner asks every
   donor for its offered snapshots: round, step, layout (names, dtypes, shapes), meta (small
   msgpack values), digest, chunk digests (here: `Offer`, `parse_manifest`). A snapshot's
   identity is the blake3 of its canonical encoding; the joiner takes the newest round whose
   identical manifest is offered by a majority of the donors that answered. A lone liar (or any
   minority) cannot choose the state — it is simply not asked for chunks. With one donor there
   is nobody to outvote it: that is trust, not proof.
4. **Chunks** (RPC `state/chunk` + the data plane; node/state/fetch.py). The joiner pulls chunks
   from every agreeing donor at once and checks each against the agreed chunk digest; a donor
   that lies, fails or stalls is dropped and its chunks fetched from the others, and if every
   donor of the chosen state fails, an older state the vote agreed on is taken. At the end the
   whole state's digest is checked against the agreed one.
5. **Entering** is the node's job: it unflattens `meta["skeleton"]` and calls
   `OuterOptimizer.join(state, at_step=...)`, which enters at the swarm's next round boundary.

Wire. `state/manifest` request `{chunk_bytes, key?}`, reply `{format: "meshtrain.state/1",
snapshots: [{round, step, total, chunk_bytes, digest, chunks, layout, meta}], inner_moments?}`
(snapshots newest first, at most 8; `inner_moments`, for the default key: the donor's own inner
optimizer described, optim/inner_moments.py — outside every snapshot's identity, as each donor's
differ, and ignored by joiners that predate it); `state/chunk` request `{digest, chunk_bytes,
index, fetch}`, reply `{sent}`, the bytes themselves sent over the data plane under the tag
`state/<round>/<index>/<fetch>`. Refusals are
`RemoteError`s: `bad_request`, `no_state`, `unknown_state`, `busy`, `send_failed`, `not-a-member`.

Keys: a donor may serve several states side by side, each under a key (`publish(..., key=)`,
`fetch_state(..., key=)`; the manifest request names it, "" by default). A pipeline peer offers
its stage's state under the stage's key (node/stages/peer.py): a joiner that asks the replicas
of stage 2 for `"pipeline/stage2"` is never offered another stage's weights by a peer that has
moved meanwhile — that peer answers `no_state`. Each key keeps its own newest snapshots;
`withdraw(key)` drops them all (a pipeline peer's backup of a stage it no longer backs).

This module: the wire's names and limits, the flattened state, the manifest entry (`Offer`) and
its validation, the errors. Serving is node/state/donor.py, downloading node/state/fetch.py.
Not here: choosing donors (the node passes live trainers from membership), unflattening, join.
Limits: a majority of *identities* is not a majority of people (a Sybil with many peer ids can
outvote honest donors; membership admission is the defence); a manifest must fit in one RPC
reply (4 MiB: about 100k tensors or 65k chunks).
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import blake3
import torch

from meshtrain.errors import MeshtrainError
from meshtrain.transport.framing import packb_canonical
from meshtrain.transport.tensor_layout import (
    LayoutError,
    TensorSpec,
    byte_views,
    specs_of,
    total_bytes,
    validate_specs,
)
from meshtrain.transport.validate import is_int

STATE_FORMAT = "meshtrain.state/1"
MANIFEST_RPC = "state/manifest"
CHUNK_RPC = "state/chunk"

DEFAULT_CHUNK_BYTES = 8 << 20  # 25 chunks for a 25M-param DiLoCo state: enough to spread
MIN_CHUNK_BYTES = 64 << 10
MAX_CHUNK_BYTES = 64 << 20
MAX_CHUNKS = 1 << 16
MAX_SNAPSHOTS = 8  # per manifest reply
MAX_MANIFEST_BYTES = (4 << 20) - 4096  # must fit one RPC frame (framing.DEFAULT_MAX_FRAME)
MAX_META_BYTES = 1 << 20
MAX_REQUEST_BYTES = 4096
MAX_KEY_CHARS = 128
MAX_PER_DONOR = 4  # chunks one joiner may have in flight at one donor
FETCH_ID = re.compile(r"^[0-9a-f]{1,32}(\.[0-9]{1,9})?$")  # a chunk request's `fetch`: download id.attempt


class StateSyncError(MeshtrainError):
    """The state could not be downloaded; the message says why and what to try."""


class NoDonors(StateSyncError):
    """Nobody to download from: the list was empty, or no donor answered or offered a state."""


class NoAgreement(StateSyncError):
    """No snapshot is offered identically by a majority of the donors that answered."""


class OfferDeclined(StateSyncError):
    """Every agreed state was declined by the caller's `accept` from its manifest alone — before
    a byte of it was fetched (a joiner that could not enter with it: a round old, or before its
    roster round)."""


class DonorsExhausted(StateSyncError):
    """Every donor of every agreed state failed (vanished, lied, stalled, timed out) before a
    download completed."""


# --------------------------------------------------------------------------------------------
# The flattened state: byte ranges over a dict of tensors


def chunk_ranges(total: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """The chunks of a `total`-byte flattened state: `[start, end)` ranges, in order."""
    if chunk_bytes < 1:
        raise ValueError("chunk_bytes must be positive")
    return [(s, min(s + chunk_bytes, total)) for s in range(0, total, chunk_bytes)]


def chunk_count(total: int, chunk_bytes: int) -> int:
    return -(-total // chunk_bytes)


class FlatState:
    """A dict of tensors seen as one byte string: their bytes concatenated in dict order.

    tensors: contiguous CPU tensors, in the order that defines the flattened state (the donor
        sorts by name; the joiner allocates in the agreed layout's order). Not copied: writes
        go into these tensors and `slices` are views of them.
    """

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.specs = specs_of(tensors)
        self.views = byte_views(tensors)
        self.sizes = [len(v) for v in self.views]
        self.ends = list(itertools.accumulate(self.sizes))
        self.total = self.ends[-1] if self.ends else 0

    def copy(self) -> FlatState:
        """The same state in memory of its own (the donor's copy-on-write)."""
        return FlatState({k: t.clone() for k, t in self.tensors.items()})

    def pieces(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """`(tensor index, byte offset in it, length)` of the non-empty pieces of `[start, end)`."""
        if not 0 <= start <= end <= self.total:
            raise ValueError(f"range [{start}, {end}) outside the state's {self.total} bytes")
        out = []
        i = bisect.bisect_right(self.ends, start)
        pos = start
        while pos < end:
            take = min(end, self.ends[i]) - pos
            if take > 0:
                out.append((i, pos - (self.ends[i] - self.sizes[i]), take))
                pos += take
            i += 1
        return out

    def slices(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """`[start, end)` as uint8 tensors that share memory with the state (for `send`)."""
        return {
            str(k): torch.frombuffer(self.views[i][off : off + n], dtype=torch.uint8)
            for k, (i, off, n) in enumerate(self.pieces(start, end))
        }

    def write(self, start: int, source: Sequence[memoryview]) -> None:
        """Copy the concatenation of `source` into the state at byte `start`."""
        end = start + sum(len(s) for s in source)
        src = iter(s for s in source if len(s))
        cur = next(src, None)
        at = 0
        for i, off, n in self.pieces(start, end):
            dst = self.views[i]
            pos = 0
            while pos < n:
                assert cur is not None  # lengths add up by construction of `end`
                take = min(n - pos, len(cur) - at)
                dst[off + pos : off + pos + take] = cur[at : at + take]
                pos += take
                at += take
                if at == len(cur):
                    cur, at = next(src, None), 0

    def digest(self) -> bytes:
        h = blake3.blake3()
        for v in self.views:
            h.update(v)
        return h.digest()

    def digests(self, chunk_bytes: int) -> tuple[bytes, list[bytes]]:
        """(digest of the whole state, digest of each chunk) in one read of the memory."""
        whole = blake3.blake3()
        chunks = []
        for start, end in chunk_ranges(self.total, chunk_bytes):
            h = blake3.blake3()
            for i, off, n in self.pieces(start, end):
                piece = self.views[i][off : off + n]
                h.update(piece)
                whole.update(piece)
            chunks.append(h.digest())
        return whole.digest(), chunks


# --------------------------------------------------------------------------------------------
# Manifests


@dataclass(frozen=True)
class Offer:
    """One snapshot as a donor described it (validated)."""

    round: int
    step: int
    total: int
    chunk_bytes: int
    digest: bytes
    chunks: tuple[bytes, ...]
    specs: tuple[TensorSpec, ...]
    meta: dict[str, Any]
    key: bytes  # blake3 of the canonical encoding: equal keys = identical manifests


def parse_manifest(reply: Any, chunk_bytes: int, max_bytes: int) -> list[Offer]:
    """Validate a `state/manifest` reply from the network; `StateSyncError` on any defect."""
    if not (
        isinstance(reply, dict)
        and reply.get("format") == STATE_FORMAT
        and isinstance(reply.get("snapshots"), list)
        and 1 <= len(reply["snapshots"]) <= MAX_SNAPSHOTS
    ):
        raise StateSyncError(f"not a {STATE_FORMAT} manifest")
    offers = []
    for raw in reply["snapshots"]:
        if not isinstance(raw, dict):
            raise StateSyncError("snapshot entry is not a map")
        rnd, step, total, cb = raw.get("round"), raw.get("step"), raw.get("total"), raw.get("chunk_bytes")
        digest, chunks, meta = raw.get("digest"), raw.get("chunks"), raw.get("meta")
        if not all(is_int(v) and v >= 0 for v in (rnd, step, total)):
            raise StateSyncError("round, step and total must be non-negative integers")
        if cb != chunk_bytes:
            raise StateSyncError(f"chunk_bytes {cb!r:.20} is not the {chunk_bytes} asked for")
        if not isinstance(digest, bytes) or len(digest) != 32:
            raise StateSyncError("digest must be 32 bytes")
        if not isinstance(meta, dict):
            raise StateSyncError("meta must be a map")
        try:
            specs = validate_specs(raw.get("layout"), max_bytes=max_bytes)
        except LayoutError as e:
            raise StateSyncError(f"bad layout: {e}") from None
        if total_bytes(specs) != total:
            raise StateSyncError(f"layout has {total_bytes(specs)} bytes, manifest says {total}")
        if not (
            isinstance(chunks, list)
            and len(chunks) == chunk_count(total, chunk_bytes)
            and all(isinstance(c, bytes) and len(c) == 32 for c in chunks)
        ):
            raise StateSyncError(f"expected {chunk_count(total, chunk_bytes)} chunk digests of 32 bytes")
        key = blake3.blake3(packb_canonical(raw)).digest()
        offers.append(Offer(rnd, step, total, cb, digest, tuple(chunks), tuple(specs), meta, key))
    return offers


__all__ = [
    "CHUNK_RPC",
    "DEFAULT_CHUNK_BYTES",
    "MANIFEST_RPC",
    "DonorsExhausted",
    "FlatState",
    "NoAgreement",
    "NoDonors",
    "Offer",
    "StateSyncError",
    "chunk_count",
    "chunk_ranges",
    "parse_manifest",
]
