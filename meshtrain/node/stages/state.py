"""A pipeline stage's state for the peers that take the stage over: late joiners, moved peers, refills.

Problem. In a pipeline swarm (node/stages/peer.py) a peer placed on a stage it has not trained
— a late joiner, a peer moved by placement's refill rule, a restarted peer whose checkpoint is
behind the swarm — must train from that stage's current state, not from the swarm's initial
weights: a replica that starts from θ0 drags its stage back (DiLoCo) or trains a lineage of its
own (every-step: its replicas would never agree again). A stage whose only replica crashes
(kill -9: no handover) would lose its training altogether if nobody else held its state.

Design. The multi-donor state sync of node/state/sync.py, unchanged, with one state per stage:
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
- *Backups* (`backers`, `StageStates.back_up`). A stage with exactly one replica in an epoch is
  at risk: that replica's crash loses it. For each such stage one peer of another stage —
  `backers(placement)`: the lowest id on the next stage (s + 1 mod S), else on the one after, a
  peer not already backing another stage if there is one; every peer computes the same from the
  epoch's placement — downloads the replica's newest snapshot as the epoch starts (the one it
  published as the last epoch ended: a stage just left with one replica is covered at once; the
  benchmark's kill run lost stage 1 when backups waited for the epoch's end) and again at the
  epoch's end (in the background, once the replica announces it as `offer`), and publishes it under the stage's key in
  its own donor, bit for bit (the same meta too: a replica still reachable and the backer then
  offer one manifest, and the download fails over between them). A peer backs up one stage at a
  time: backing another drops the previous backup (`StateDonor.withdraw`); the same stage's next
  backup replaces it like any publish (a key keeps its newest two). Cost: at most two stage
  downloads per at-risk stage per epoch (one when the stage stays at one replica: the snapshot an
  epoch ends with, already held, is the next one's start; off the replica's uplink, capped by its
  `upload_limit`), and one
  stage's state in memory on each backer. The spec's `stage_backup = false` turns it off.
- *Fetching* (`StageStates.fetch`). Donors are the epoch's peers on the stage that offer the
  epoch's step: the download is their majority's state (one donor's for NoLoCo, whose replicas
  differ by design). If none is left — the stage lost its last replica — every other peer of the
  epoch is asked for the stage's key, and the newest snapshot any of them still holds (a former
  replica's, or a backer's) is taken (trusted: nobody can outvote it). If the newest one's holders
  fail mid-download (a last replica that dies as it leaves: seen in tests/test_pipeline_backup.py
  under load), `fetch_state` falls back to the next newest one, so an older backup still beats θ0.
  `DonatedState.from_backup`
  says the stage's backer (the caller names it) was among its donors. A taker that is itself the
  stage's backer uses its own backup unless a newer one is offered (`own_backup`). If nobody holds
  one, `fetch` returns None and the caller starts the stage from its initial weights, saying so.

Wire: state_sync's manifests and chunks, key `pipeline/stage<i>`; meta `{round, step, stage,
replica_sync, skeleton}` (the skeleton of `checkpoint.flatten_state`); a backer's copy is the
replica's, unchanged.

Failures: a donor that dies or lies mid-download is state_sync's business (banned, its chunks
re-fetched from the others); a download that fails altogether falls back as above. A backup that
fails (the replica died or moved first) is logged and the backer keeps what it had. A caller that
cannot start from θ0 (`meshtrain export`: node/stages/export.py) uses `fetch_required`, which
raises `StageStateError` naming the stage and every reason (replicas that disagree, all failed,
nobody holds a snapshot) instead of returning None.

Not here: when to fetch or back up and whom placement puts where (node/stages/handover.py), the
download protocol (node/state/sync.py). Still lost in a checkpoint-less swarm (the "starts from
θ0" case): a stage whose last replica died before any epoch end published its state, one whose
replica and backer both died before another peer took it, and the training a stage did since
its last epoch end (a refill resumes at the backup's step).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from meshtrain.errors import MeshtrainError
from meshtrain.log import get_logger, kv
from meshtrain.node.state.checkpoint import MalformedStateError, flatten_state, unflatten_state
from meshtrain.node.state.donor import StateDonor
from meshtrain.node.state.fetch import FetchReport, Progress, fetch_state
from meshtrain.node.state.sync import StateSyncError
from meshtrain.pipeline.placement import stage_map
from meshtrain.transport.host import Host
from meshtrain.transport.tensor_streams import TensorStreams
from meshtrain.transport.validate import is_int

log = get_logger(__name__)

FETCH_TIMEOUT = 600.0  # seconds one stage download may take
BACKUP_OFFER_WAIT = 30.0  # seconds a backer waits for the replica to announce the epoch end's snapshot
OFFER_POLL = 0.2  # seconds between two looks at the replica's announcement


class StageStateError(MeshtrainError):
    """Nobody could give a stage's state; the message names the stage and why."""


def stage_key(stage: int) -> str:
    """The state_sync key a stage's state is published under."""
    return f"pipeline/stage{stage}"


def backers(placement: Mapping[str, int], num_stages: int) -> dict[int, str]:
    """stage -> the peer that backs it up, for every stage with exactly one replica in
    `placement` (module docstring, Backups): the lowest id on stage s + 1 (mod S), else on s + 2,
    ..., preferring a peer that backs no other stage. Pure: every peer of an epoch computes the
    same. A stage with no other stage's peer to back it is left out."""
    stages = stage_map(placement, num_stages)
    out: dict[int, str] = {}
    for s in range(num_stages):
        if len(stages[s]) != 1:
            continue
        candidates = [p for k in range(1, num_stages) for p in stages[(s + k) % num_stages]]
        free = [p for p in candidates if p not in out.values()]
        if free or candidates:
            out[s] = (free or candidates)[0]
    return out


@dataclass(frozen=True)
class Published:
    """A stage's state as this peer last offered it: the stage, the swarm step, the state (the
    caller's copies, which nobody changes) and how many publishes this peer has made so far."""

    stage: int
    step: int
    state: dict[str, Any]
    count: int


@dataclass(frozen=True)
class Backup:
    """Another stage's state this peer holds as that stage's backer: the stage, the swarm step,
    the replica it came from and what the download cost."""

    stage: int
    step: int
    replica: str
    seconds: float
    bytes: int


@dataclass(frozen=True)
class DonatedState:
    """A stage's state as downloaded: `state` (the donor's `donated_state()`), the swarm step it
    was published at, where it came from and what it cost."""

    stage: int
    step: int
    state: dict[str, Any]
    donors: tuple[str, ...]
    from_replicas: bool  # False: the fallback (a peer that held the stage before, or a backer)
    seconds: float
    bytes: int
    from_backup: bool = False  # a backer's copy (module docstring, Backups)


class StageStates:
    """This peer's side of the stage state exchange (module docstring): a `StateDonor` for the
    stages it held and the download of the stage it takes.

    host, streams: the node's. replica_sync: the spec's (what `identical` replicas mean).
    upload_limit: the node's cap on serving state (bytes/s, None: none). quiet: whether a peer's
    heartbeats stopped reaching us (the node's presence): a download drops a donor gone silent
    (node/state/fetch.py, "Silence").
    """

    def __init__(
        self,
        host: Host,
        streams: TensorStreams,
        replica_sync: str,
        *,
        upload_limit: float | None = None,
        quiet: Callable[[str], bool] | None = None,
    ) -> None:
        self.host = host
        self.quiet = quiet
        self.streams = streams
        self.replica_sync = replica_sync
        self.donor = StateDonor(host, streams, upload_limit=upload_limit)
        self.published: Published | None = None  # the last `publish` (node/stages/export.py exports it)
        self.backup: Backup | None = None  # the other stage we back up, if any
        self._backup_state: tuple[dict[str, Any], dict[str, Any]] | None = None  # its (meta, tensors)
        self._backup_scope: trio.CancelScope | None = None  # the backup in flight (one at a time) ...
        self._backup_stage: int | None = None  # ... of this stage
        self._backup_done = trio.Event()
        self._backup_done.set()

    def publish(self, stage: int, step: int, state: dict[str, Any]) -> None:
        """Offer `state` (copies the caller will not touch again) as stage `stage` at `step`."""
        skeleton, tensors = flatten_state(state)
        meta = {"round": step, "step": step, "stage": stage, "replica_sync": self.replica_sync, "skeleton": skeleton}
        self.donor.publish(meta, tensors, key=stage_key(stage))
        self.published = Published(stage, step, state, self.published.count + 1 if self.published else 1)
        if self.backup is not None and self.backup.stage == stage:  # we hold the stage now: not a backup
            self.backup, self._backup_state = None, None

    def start_backup(
        self, nursery: trio.Nursery, stage: int, replica: str, step: int, offered: Callable[[], bool]
    ) -> None:
        """`back_up` in `nursery` once `offered()` (the replica announces its snapshot of `step`,
        or is gone); skipped if it has not after `BACKUP_OFFER_WAIT` s. A backup still in flight
        is cancelled. Nothing to do if we hold `stage`'s backup of `step` already (a stage left with
        one replica epoch after epoch: the snapshot an epoch ends with is the next one's start)."""
        if self.backup is not None and self.backup.stage == stage and self.backup.step >= step:
            return
        self.cancel_backup()
        scope, done = trio.CancelScope(), trio.Event()
        self._backup_scope, self._backup_stage, self._backup_done = scope, stage, done

        async def run() -> None:
            try:
                with scope:
                    with trio.move_on_after(BACKUP_OFFER_WAIT):
                        while not offered():
                            await trio.sleep(OFFER_POLL)
                    if not offered():  # e.g. a mover that has not published the stage yet
                        log.info(kv("stage backup skipped: its replica offers no snapshot yet", stage=stage))
                        return
                    await self.back_up(stage, replica, step)
            finally:
                done.set()

        nursery.start_soon(run)

    def cancel_backup(self) -> None:
        """Give up the backup in flight, if any (the one we hold stays)."""
        if self._backup_scope is not None:
            self._backup_scope.cancel()

    async def finish_backup(self, stage: int, timeout: float) -> None:
        """Wait (at most `timeout` s) for a backup of `stage` in flight: a taker that is the
        stage's backer wants it before it looks for the stage's state."""
        if self._backup_stage == stage:
            with trio.move_on_after(timeout):
                await self._backup_done.wait()

    async def back_up(self, stage: int, replica: str, step: int) -> Backup | None:
        """Download stage `stage`'s newest snapshot (the caller waited for the one of `step`) from
        its single replica and offer it under the stage's key as its backup (module docstring, Backups); None if it failed or
        is not newer than the backup we hold. A backup of another stage is dropped once this one
        is in."""
        report = FetchReport()
        t0 = time.monotonic()
        try:
            meta, tensors = await fetch_state(
                self.host,
                self.streams,
                [replica],
                key=stage_key(stage),
                timeout=FETCH_TIMEOUT,
                report=report,
                quiet=self.quiet,
            )
        except StateSyncError as e:
            log.warning(kv("stage backup failed", stage=stage, replica=replica, reason=str(e)[:300]))
            return None
        got = self._offered_step(meta, stage)
        if got is None:
            log.warning(kv("a stage backup offered another stage or replica sync; ignored", stage=stage))
            return None
        if self.backup is not None and self.backup.stage == stage and got <= self.backup.step:
            log.info(kv("stage backup not newer than the one we hold; ignored", stage=stage, step=got, wanted=step))
            return None
        if self.published is not None and self.published.stage == stage:
            return None  # we moved onto the stage meanwhile: our own state is what we offer
        if self.backup is not None and self.backup.stage != stage:
            self.donor.withdraw(stage_key(self.backup.stage))
        # The replica's meta unchanged: the same bits make the same manifest, so a taker counts us
        # and a replica still reachable as donors of one state (state_sync's failover).
        self.donor.publish(meta, tensors, key=stage_key(stage))
        self.backup = Backup(stage, got, replica, round(time.monotonic() - t0, 3), report.total_bytes)
        self._backup_state = (meta, tensors)
        log.warning(kv("took a backup of a stage with one replica", **dataclasses.asdict(self.backup)))
        return self.backup

    def _offered_step(self, meta: dict[str, Any], stage: int) -> int | None:
        """The swarm step of a downloaded snapshot's `meta`, None unless it is `stage`'s under our
        replica sync."""
        step = meta.get("step")
        if meta.get("stage") != stage or meta.get("replica_sync") != self.replica_sync or not is_int(step):
            return None
        return int(step)

    def own_backup(self, stage: int) -> DonatedState | None:
        """Our backup of `stage` as a download would give it (no bytes moved); None if we hold
        none or it does not unflatten."""
        if self.backup is None or self.backup.stage != stage or self._backup_state is None:
            return None
        meta, tensors = self._backup_state
        try:  # copies: the trainer may adopt tensors (AdamW's state) that the donor still serves
            state = unflatten_state(meta.get("skeleton"), {k: v.clone() for k, v in tensors.items()})
        except MalformedStateError as e:
            log.warning(kv("our stage backup does not unflatten; ignored", stage=stage, error=str(e)[:200]))
            return None
        return DonatedState(stage, self.backup.step, state, (), False, 0.0, 0, from_backup=True)

    async def fetch(
        self,
        stage: int,
        replicas: Sequence[str],
        others: Sequence[str],
        *,
        backer_peers: Collection[str] = (),
        progress: Progress | None = None,
    ) -> DonatedState | None:
        """Download stage `stage`'s state from `replicas` (the peers on it that offer the epoch's
        step), else the newest snapshot any of `others` still holds — `from_backup` if one of
        `backer_peers` (the stage's backers, by `backers`, in recent epochs) is among its donors — else
        our own backup if it is newer; None if nobody has one."""
        try:
            got: DonatedState | None = await self.fetch_required(stage, replicas, others, progress=progress)
        except StageStateError:
            got = None
        if got is not None and not got.from_replicas and set(backer_peers) & set(got.donors):
            got = dataclasses.replace(got, from_backup=True)
        own = self.own_backup(stage)
        if own is not None and (got is None or (not got.from_replicas and own.step >= got.step)):
            return own
        return got

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
            # quorum 1: the newest snapshot anyone holds; if its holders fail mid-download (a last
            # replica dying as it left), fetch_state falls back to an older one (a backup).
            got = await self._fetch(stage, rest, quorum=1, progress=progress, reasons=reasons)
            if got is not None:
                return dataclasses.replace(got, from_replicas=False)
        elif not replicas:
            reasons.append("no connected peer to ask")
        raise StageStateError(f"cannot fetch stage {stage}'s state: {'; '.join(reasons)}")

    async def _fetch(
        self,
        stage: int,
        donors: list[str],
        *,
        quorum: int | None,
        progress: Progress | None,
        reasons: list[str],
    ) -> DonatedState | None:
        t0 = time.monotonic()
        report = FetchReport()
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
                quiet=self.quiet,
            )
        except StateSyncError as e:
            log.warning(kv("stage state download failed", stage=stage, donors=len(donors), reason=str(e)[:300]))
            reasons.append(f"from {who} ({len(donors)}): {str(e)[:300]}")
            return None
        step = self._offered_step(meta, stage)
        if step is None:
            log.warning(kv("a donor offered a state of another stage or replica sync; ignored", stage=stage))
            reasons.append(f"from {who}: a state of another stage or replica sync")
            return None
        try:
            state = unflatten_state(meta.get("skeleton"), tensors)
        except MalformedStateError as e:
            log.warning(kv("a donated stage state does not unflatten; ignored", stage=stage, error=str(e)[:200]))
            reasons.append(f"from {who}: a state that does not unflatten")
            return None
        return DonatedState(
            stage,
            step,
            state,
            tuple(report.agreeing),
            True,
            time.monotonic() - t0,
            report.total_bytes,
        )
