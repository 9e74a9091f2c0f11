"""A pipeline stage's state for the peers that take the stage over: late joiners, moved peers, refills.

Problem. In a pipeline swarm (node/pipeline_peer.py) a peer placed on a stage it has not trained
— a late joiner, a peer moved by placement's refill rule, a restarted peer whose checkpoint is
behind the swarm — must train from that stage's current state, not from the swarm's initial
weights: a replica that starts from θ0 drags its stage back (DiLoCo) or trains a lineage of its
own (every-step: its replicas would never agree again).

Design. The multi-donor state sync of node/state_sync.py, unchanged, with one state per stage:
- *Publishing.* At the end of every epoch (all peers stand between the same two iterations) a
  peer that holds its stage's state publishes it under the stage's key (`stage_key`) in its
  `StateDonor`, with `round` = `step` = the swarm's step, and announces that step as `offer` in
  its membership record. It keeps the snapshots of a stage it has left (each key keeps its own
  newest two), so a stage's state outlives its replica's move.
- *What is published* depends on the replica sync. every-step: the stage's weights and AdamW
  state (every replica holds the same bits: their gradients are all-reduced). diloco / noloco:
  the stage's outer state (φ, the outer optimizer's momentum, the counters; `OuterOptimizer.
  state_dict(inner=False)`), which DiLoCo's replicas share bit for bit after each round; the
  taker enters with `OuterOptimizer.join` (θ ← φ, a fresh AdamW, weight 0 in the next round).
- *Fetching* (`StageStates.fetch`). Donors are the epoch's peers on the stage that offer the
  epoch's step: the download is their majority's state (one donor's for NoLoCo, whose replicas
  differ by design). If none is left — the stage lost its last replica — every other peer of the
  epoch is asked for the stage's key, and the newest snapshot any of them still holds is taken
  (trusted: nobody can outvote it); if nobody holds one, `fetch` returns None and the caller
  starts the stage from its initial weights, saying so.

Wire: state_sync's manifests and chunks, key `pipeline/stage<i>`; meta `{round, step, stage,
replica_sync, skeleton}` (the skeleton of `checkpoint.flatten_state`).

Failures: a donor that dies or lies mid-download is state_sync's business (banned, its chunks
re-fetched from the others); a download that fails altogether falls back as above. A caller that
cannot start from θ0 (`meshtrain export`: node/pipeline_export.py) uses `fetch_required`, which
raises `StageStateError` naming the stage and every reason (replicas that disagree, all failed,
nobody holds a snapshot) instead of returning None.

Not here: when to fetch and whom placement puts where (node/pipeline_peer.py), the download
protocol (node/state_sync.py). A stage whose last replica died before any epoch end published
its state is lost in a checkpoint-less swarm: that is the "starts from θ0" case.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from meshtrain.errors import MeshtrainError
from meshtrain.log import get_logger, kv
from meshtrain.node.checkpoint import flatten_state, unflatten_state
from meshtrain.node.state_sync import FetchReport, Progress, StateDonor, StateSyncError, fetch_state
from meshtrain.transport.host import Host
from meshtrain.transport.tensor_streams import TensorStreams
from meshtrain.transport.validate import is_int

log = get_logger(__name__)

FETCH_TIMEOUT = 600.0  # seconds one stage download may take


class StageStateError(MeshtrainError):
    """Nobody could give a stage's state; the message names the stage and why."""


def stage_key(stage: int) -> str:
    """The state_sync key a stage's state is published under."""
    return f"pipeline/stage{stage}"


@dataclass(frozen=True)
class Published:
    """A stage's state as this peer last offered it: the stage, the swarm step, the state (the
    caller's copies, which nobody changes) and how many publishes this peer has made so far."""

    stage: int
    step: int
    state: dict[str, Any]
    count: int


@dataclass(frozen=True)
class DonatedState:
    """A stage's state as downloaded: `state` (the donor's `donated_state()`), the swarm step it
    was published at, where it came from and what it cost."""

    stage: int
    step: int
    state: dict[str, Any]
    donors: tuple[str, ...]
    from_replicas: bool  # False: the fallback (a peer that held the stage before)
    seconds: float
    bytes: int


class StageStates:
    """This peer's side of the stage state exchange (module docstring): a `StateDonor` for the
    stages it held and the download of the stage it takes.

    host, streams: the node's. replica_sync: the spec's (what `identical` replicas mean).
    upload_limit: the node's cap on serving state (bytes/s, None: none).
    """

    def __init__(
        self, host: Host, streams: TensorStreams, replica_sync: str, *, upload_limit: float | None = None
    ) -> None:
        self.host = host
        self.streams = streams
        self.replica_sync = replica_sync
        self.donor = StateDonor(host, streams, upload_limit=upload_limit)
        self.published: Published | None = None  # the last `publish` (node/pipeline_export.py exports it)

    def publish(self, stage: int, step: int, state: dict[str, Any]) -> None:
        """Offer `state` (copies the caller will not touch again) as stage `stage` at `step`."""
        skeleton, tensors = flatten_state(state)
        meta = {"round": step, "step": step, "stage": stage, "replica_sync": self.replica_sync, "skeleton": skeleton}
        self.donor.publish(meta, tensors, key=stage_key(stage))
        self.published = Published(stage, step, state, self.published.count + 1 if self.published else 1)

    async def fetch(
        self, stage: int, replicas: Sequence[str], others: Sequence[str], *, progress: Progress | None = None
    ) -> DonatedState | None:
        """Download stage `stage`'s state from `replicas` (the peers on it that offer the epoch's
        step), else the newest snapshot any of `others` still holds; None if nobody has one."""
        try:
            return await self.fetch_required(stage, replicas, others, progress=progress)
        except StageStateError:
            return None

    async def fetch_required(
        self, stage: int, replicas: Sequence[str], others: Sequence[str], *, progress: Progress | None = None
    ) -> DonatedState:
        """`fetch`, but a stage nobody can give raises `StageStateError` naming the stage and why
        (the replicas disagree, all failed, or nobody holds a snapshot). `progress(done, total)`
        in bytes after each verified chunk."""
        identical = self.replica_sync != "noloco"
        reasons: list[str] = []
        if replicas:
            donors = list(replicas) if identical else list(replicas)[:1]
            got = await self._fetch(stage, donors, quorum=None, progress=progress, reasons=reasons)
            if got is not None:
                return got
        rest = [p for p in others if p not in replicas]
        if rest:
            got = await self._fetch(stage, rest, quorum=1, progress=progress, reasons=reasons)
            if got is not None:
                return dataclasses.replace(got, from_replicas=False)
        if not replicas and not rest:
            reasons.append("no connected peer to ask")
        raise StageStateError(f"cannot fetch stage {stage}'s state: {'; '.join(reasons)}")

    async def _fetch(
        self, stage: int, donors: list[str], *, quorum: int | None, progress: Progress | None, reasons: list[str]
    ) -> DonatedState | None:
        report = FetchReport()
        t0 = time.monotonic()
        who = "its replicas" if quorum is None else "peers that held it before"
        try:
            meta, tensors = await fetch_state(
                self.host,
                self.streams,
                donors,
                key=stage_key(stage),
                min_agree=quorum,
                timeout=FETCH_TIMEOUT,
                progress=progress,
                report=report,
            )
        except StateSyncError as e:
            log.warning(kv("stage state download failed", stage=stage, donors=len(donors), reason=str(e)[:300]))
            reasons.append(f"from {who} ({len(donors)}): {str(e)[:300]}")
            return None
        step = meta.get("step")
        if meta.get("stage") != stage or meta.get("replica_sync") != self.replica_sync or not is_int(step):
            log.warning(kv("a donor offered a state of another stage or replica sync; ignored", stage=stage))
            reasons.append(f"from {who}: a state of another stage or replica sync")
            return None
        try:
            state = unflatten_state(meta["skeleton"], tensors)
        except (KeyError, TypeError, ValueError) as e:
            log.warning(kv("a donated stage state does not unflatten; ignored", stage=stage, error=str(e)[:200]))
            reasons.append(f"from {who}: a state that does not unflatten")
            return None
        return DonatedState(
            stage,
            int(step),
            state,
            tuple(report.agreeing),
            True,
            time.monotonic() - t0,
            report.total_bytes,
        )
