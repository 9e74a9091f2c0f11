"""Our own progress, metrics and strikes records: what this peer reports, and when it is written.

Problem. A peer's swarm view (swarm_view.py) holds everyone's records; three of them are ours to
write besides membership: progress (step, samples, outer round, φ digests), metrics (loss, rates)
and strikes (parts we found bad). Written at every change, progress alone would flood the swarm —
every peer's round ends send a record to every peer — and a record written before we know better
(a restart's, beaten by the last life's) must be written again.

Design. `OwnReports` keeps the latest numbers and a dirty flag per record; the view's heartbeat
writes what is dirty (`beat`). An outer-round change, new φ digests and the record of a node that
starts training (`announce`) are written at once — unless a progress record of ours went out less
than `progress_gap()` ago (the view's: 0 up to 12 peers, 29 s at 256); then once the gap has
passed, in the nursery the view lends (`nursery`). The gap bounds every progress write, the
heartbeat's and `live`'s rewrites included (`live`: while the node trains, the record is rewritten
at every heartbeat, so a trainer held in a round still reads as training). Strikes are written at
once, merged with the record an earlier life of ours left, each peer's latest `per_peer` kept.
`superseded(crdt)` says whether an entry of ours from a previous life that beat ours must be
written over (it marks that record dirty); nothing is written once `closed` (we left the swarm).

Wire: the records of swarm_records.py and strikes.py, written through the replica.

Not here: membership and liveness, reading anyone's records (swarm_view.py), the records' checks
(swarm_records.py, strikes.py), why the gap is what it is (heartbeat_rate.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import trio

from meshtrain.crdt.entries import CrdtError
from meshtrain.crdt.replica import Replica
from meshtrain.crdt.strikes import MAX_STRIKES, Strike, record_of
from meshtrain.crdt.swarm_records import (
    MAX_PHI_DIGESTS,
    METRICS,
    PROGRESS,
    STRIKES,
    phi_digests,
    require_count,
    require_metrics,
)
from meshtrain.crdt.types import now_ms


class OwnReports:
    """This peer's progress, metrics and strikes records (module docstring).

    replica: where they are written. capabilities: what the strikes record carries beside the
    strikes, now (the membership's, so the record gate keeps it; a pipeline peer adds its stage
    later). progress_gap: the least seconds between two progress writes of ours, now
    (`SwarmView.progress_gap`)."""

    def __init__(
        self, replica: Replica, capabilities: Callable[[], Mapping[str, Any]], progress_gap: Callable[[], float]
    ) -> None:
        self.replica = replica
        self.me = replica.me
        self.capabilities = capabilities
        self.progress_gap = progress_gap
        self.closed = False  # we left the swarm: nothing more is written
        self.nursery: trio.Nursery | None = None  # where a write held by the gap waits (the view's)
        self.live = False  # while True, the progress record is rewritten at every `beat`
        self._progress: dict[str, Any] = {"step": 0, "samples": 0, "round": 0}
        self._progress_dirty = False
        self.progress_written = False  # a progress record of this process went out
        self._progress_at = -math.inf  # trio time of our last progress write
        self._progress_deferred = False  # a round change waits for the gap (`_write_progress_after`)
        self._metrics: dict[str, float] = {}
        self._metrics_dirty = False
        self._strikes: list[Strike] = []  # ours, written in this process (merged with our record)
        self._strikes_dirty = False
        self._per_peer = MAX_STRIKES

    def progress(
        self,
        *,
        step: int | None = None,
        samples: int | None = None,
        outer_round: int | None = None,
        phi: list[tuple[int, bytes]] | None = None,
        announce: bool = False,
    ) -> None:
        """Record our progress (`SwarmView.report_progress` says when it goes out)."""
        new = dict(self._progress)
        for key, value in (("step", step), ("samples", samples), ("round", outer_round)):
            if value is not None:
                new[key] = require_count(value, key)
        if phi is not None:
            new["phi"] = [list(p) for p in phi_digests(list(phi)[-MAX_PHI_DIGESTS:])]
        round_changed = new["round"] != self._progress["round"] or new.get("phi") != self._progress.get("phi")
        self._progress = new
        self._progress_dirty = True
        if (round_changed or announce) and not self.closed:
            wait = self._progress_at + self.progress_gap() - trio.current_time()
            if wait <= 0:
                self._write_progress()
            elif not self._progress_deferred and self.nursery is not None:
                self._progress_deferred = True
                self.nursery.start_soon(self._write_progress_after, wait)

    def metrics(self, values: Mapping[str, float]) -> None:
        """Record our latest metrics (merged into the previous ones); written at the next `beat`."""
        merged = {**self._metrics, **values}
        require_metrics(merged)
        self._metrics = merged
        self._metrics_dirty = True

    def strikes(self, strikes: Iterable[Strike], *, per_peer: int = MAX_STRIKES) -> None:
        """Add strikes we raised to our signed record, written at once (`SwarmView.report_strikes`)."""
        self._per_peer = max(1, per_peer)
        for strike in strikes:
            if strike.reporter != self.me:
                raise CrdtError("we can only report our own strikes")
            Strike.from_record(self.me, strike.to_record())  # the rules every peer applies
            self._strikes.append(strike)
        self._strikes_dirty = True
        if not self.closed:
            self._write_strikes()

    def beat(self) -> None:
        """A heartbeat: write what is dirty — progress only once the gap since our last progress
        write has passed (a change within it waits for its deferred write), rewritten while
        `live` —, metrics and strikes."""
        if self.live and self.progress_written:
            self._progress_dirty = True
        if self._progress_dirty and trio.current_time() - self._progress_at >= self.progress_gap():
            self._write_progress()
        if self._metrics_dirty:
            self._write_metrics()
        if self._strikes_dirty:
            self._write_strikes()

    def superseded(self, crdt: str) -> bool:
        """An entry of ours in `crdt` from a previous life beat ours (or came before we wrote):
        whether ours must be written over it at once (its record is marked dirty). Not where this
        process reported nothing yet: the old record stands."""
        if crdt == PROGRESS and self.progress_written:
            self._progress_dirty = True
        elif crdt == METRICS and self._metrics:
            self._metrics_dirty = True
        elif crdt == STRIKES and self._strikes:  # ours from this process go on top of the old record's
            self._strikes_dirty = True
        else:
            return False
        return True

    async def _write_progress_after(self, seconds: float) -> None:
        await trio.sleep(seconds)
        self._progress_deferred = False
        if self._progress_dirty and not self.closed:
            self._write_progress()

    def _write_progress(self) -> None:
        rec = dict(self._progress)
        ts = now_ms()
        self.replica.write(PROGRESS, lambda c, me: c.set(me, rec, timestamp=ts))
        self._progress_dirty = False
        self.progress_written = True
        self._progress_at = trio.current_time()

    def _write_metrics(self) -> None:
        rec = dict(self._metrics)
        ts = now_ms()
        self.replica.write(METRICS, lambda c, me: c.set(me, rec, timestamp=ts))
        self._metrics_dirty = False

    def _write_strikes(self) -> None:
        """Our record: the strikes it holds (a previous life's too) and ours from this process,
        the latest `MAX_STRIKES` by round, one per (round, peer), each peer's latest `per_peer`."""
        own = self.replica.crdt(STRIKES).entry(self.me)
        merged = {(s.round_key, s.peer): s for s in (record_of(own).strikes if own is not None else ())}
        merged.update({(s.round_key, s.peer): s for s in self._strikes})
        by_peer: dict[str, list[Strike]] = {}
        for strike in sorted(merged.values(), key=lambda s: (s.round_id, s.tag, s.peer)):
            by_peer.setdefault(strike.peer, []).append(strike)
        kept = [s for group in by_peer.values() for s in group[-self._per_peer :]]
        latest = sorted(kept, key=lambda s: (s.round_id, s.tag, s.peer))[-MAX_STRIKES:]
        self._strikes = [s for s in self._strikes if s in latest]
        rec = {"strikes": [s.to_record() for s in latest], "caps": self.capabilities()}
        ts = now_ms()
        self.replica.write(STRIKES, lambda c, me: c.set(me, rec, timestamp=ts))
        self._strikes_dirty = False


__all__ = ["OwnReports"]
