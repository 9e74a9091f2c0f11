"""Re-routing: what a pipeline run does when a peer fails mid-iteration.

Failures. The origin owns its microbatches. It restarts a microbatch — attempt + 1, recomputed
from its data, on a route where every dead peer is replaced by a live replica of the same stage
(the least used one), or, in a SkipPipe run where no replica is left and the path rules allow, with
that stage skipped — when a peer on its route drops its connection (every peer watches the
liveness of the others), or when a hop reports it could not deliver. A microbatch that cannot be
re-routed, or failed `MAX_ATTEMPTS` times, is dropped from the iteration; the iteration completes
with the rest. Why restart from the origin rather than patch the path where it broke: the dead
peer may hold the only copy of an activation the backward needs; recomputing the few stages
before it is cheap, and the rule is the same wherever the failure hit. Per-microbatch gradients
are kept apart (`stages.py`) and only the attempts the origins list in `done` are summed, so work
done by a voided attempt is never counted. A dead origin's microbatches are taken over (`_adopt`):
the live origin with the lowest id, if it has not sent its own `done` yet, re-runs them from their
data (a pure function of iteration and microbatch) as attempts above any the dead origin started,
on the schedule's paths with the dead replaced, voids the older attempts everywhere (`abandon`,
accepted from a live origin for a dead origin's microbatch) and lists them in its `done`. An heir
that has already sent its `done` cannot; the dead origin's microbatches are then lost for that
iteration. The next iteration is scheduled without the peers the origins reported dead.

`Rerouter` is the part of `PipelineRuntime` (`runtime.py`) that does this; the runtime constructs
it and hands it only what it needs: the host (liveness), the `PipelineRun`, the run's `DeadPeers`,
the runtime's sending side (`Wire`), the iterations in progress and the worker's `maybe_done`. It
watches the liveness of the run's peers (`watch_liveness`), restarts an origin's microbatches on
a new route (`restart`; `_reroute`, within the scheduler's path-shape rules: `_path_ok`), voids
the older attempts here and on every live peer (`_void_everywhere`, by `pipeline/abandon`), and
takes a dead origin's microbatches over (`_adopt`).

Not here: the handlers of the messages that carry it (`pipeline/abandon`, `pipeline/failed`:
`runtime.py`), the schedule of the next iteration without the dead (`scheduler.py`, from
`PipelineRun.schedule`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from meshtrain.log import get_logger, kv
from meshtrain.pipeline.hop import ABANDON_RPC
from meshtrain.pipeline.iteration import DeadPeers, IterationState, OriginMicrobatch, Wire
from meshtrain.pipeline.run import PipelineRun
from meshtrain.pipeline.scheduler import compile_problem
from meshtrain.transport.host import Host

log = get_logger(__name__)

MAX_ATTEMPTS = 4  # a microbatch re-routed this many times is dropped from its iteration


class Rerouter:
    """The origin's re-routing and the takeover of a dead origin's microbatches; one per
    `PipelineRuntime`, which calls `watch_liveness` during each iteration and `restart` when a hop
    of one of our microbatches was lost.

    host: this peer's host; liveness is read from its connections to the run's peers.
    run: the shared `PipelineRun` (its name, in `abandon`; its placement and path-shape rules; its
        mode: only a SkipPipe run may skip a stage).
    deaths: the run's `DeadPeers` (we add the peers we see die).
    wire: the runtime's sending side (`Wire`: broadcast, spawn).
    iterations: () -> the iterations in progress (a peer that dies is a dead origin in all).
    maybe_done: (st) the worker's `maybe_done`, called when we drop one of our microbatches.
    """

    def __init__(
        self,
        host: Host,
        run: PipelineRun,
        deaths: DeadPeers,
        wire: Wire,
        iterations: Callable[[], Iterable[IterationState]],
        maybe_done: Callable[[IterationState], None],
    ) -> None:
        self.host = host
        self.me = host.peer_id
        self.run = run
        self.stage = run.problem.placement[self.me]
        self.compiled = compile_problem(run.problem)  # the path-shape rules
        self.deaths = deaths
        self.wire = wire
        self.iterations = iterations
        self.maybe_done = maybe_done

    def restart(self, st: IterationState, mb: int, att: int, suspects: set[str]) -> None:
        """Attempt `att` of our microbatch `mb` was lost (`suspects`: the peers that may have
        died): run it again as attempt + 1 on a new route, or drop it; stale news is ignored."""
        mine = st.mine.get(mb)
        if mine is None or mine.status != "running" or mine.att != att:
            return  # stale news: that attempt was already replaced
        self.deaths.saw({p for p in suspects if p != self.me and not self.host.is_connected(p)})
        route = self._reroute(st, mine.route)
        new_att = att + 1
        self._void_everywhere(st, mb, new_att)
        st.restart_count += 1
        if route is None or new_att >= MAX_ATTEMPTS:
            mine.status = "dropped"
            log.warning(kv("pipeline microbatch dropped", it=st.it, mb=mb, attempts=new_att))
            self.maybe_done(st)
            return
        log.info(
            kv("pipeline microbatch re-routed", it=st.it, mb=mb, att=new_att, route=",".join(p[-6:] for p in route))
        )
        mine.att, mine.route = new_att, route
        st.restarts.append((mb, new_att))
        st.notify()

    def _void_everywhere(self, st: IterationState, mb: int, floor: int) -> None:
        """Attempts of `mb` below `floor` no longer count, here and (`abandon`) on every live peer."""
        st.void(mb, floor)
        self.wire.spawn(
            self.wire.broadcast,
            ABANDON_RPC,
            {"run": self.run.run, "it": st.it, "mb": mb, "floor": floor},
            self.deaths.live_others(),
        )

    def _reroute(self, st: IterationState, route: tuple[str, ...]) -> tuple[str, ...] | None:
        """`route` with every dead peer replaced by the live replica of its stage that the
        iteration's schedule uses least, or (SkipPipe only, no replica left) its stage skipped if
        the path rules allow; None if neither works."""
        placement = self.run.problem.placement
        dead = self.deaths.seen
        load: dict[str, int] = {}
        assert st.schedule is not None  # our own lifecycle: only a scheduled iteration re-routes
        for plan in st.schedule.plans:
            for _, q in plan.path[1:-1]:
                load[q] = load.get(q, 0) + 1
        out = [route[0]]
        for q in route[1:]:
            if q not in dead and self.host.is_connected(q):
                out.append(q)
                continue
            s = placement[q]
            spares = sorted(
                (load.get(p, 0), p)
                for p, t in placement.items()
                if t == s and p not in dead and p not in out and self.host.is_connected(p)
            )
            if spares:
                out.append(spares[0][1])
            elif self.run.mode != "skippipe":
                return None
        if len(out) < 2 or not self._path_ok(tuple(placement[p] for p in out[1:])):
            return None
        return tuple(out)

    def _path_ok(self, stages: tuple[int, ...]) -> bool:
        """The scheduler's path-shape rules (jump and swap limits) hold for this stage sequence."""
        c = self.compiled
        frontier, swaps = 0, 0
        for s in stages:
            nxt = c.step(frontier, swaps, s)
            if nxt is None:
                return False
            frontier, swaps = nxt
        return True

    async def watch_liveness(self, st: IterationState) -> None:
        """Notice dead peers during iteration `st` (runs until cancelled): an origin re-routes its
        microbatches that used them; everyone stops waiting for a dead origin's microbatches and
        its `done`."""
        others = [p for p in self.run.problem.placement if p != self.me]
        while True:
            gone = {p for p in others if p not in self.deaths.seen and not self.host.is_connected(p)}
            if gone:
                self.deaths.saw(gone)
                log.warning(kv("pipeline peers lost", it=st.it, peers=",".join(p[-8:] for p in sorted(gone))))
                for later in list(self.iterations()):
                    later.dead_origins |= gone & set(later.origins or st.origins)
                    later.notify()
                for mb, mine in st.mine.items():
                    hit = gone & set(mine.route)
                    if mine.status == "running" and hit:
                        self.restart(st, mb, mine.att, hit)
                self._adopt(st, gone)
            await self.host.wait_until(
                lambda: any(p not in self.deaths.seen and not self.host.is_connected(p) for p in others)
            )

    def _adopt(self, st: IterationState, gone: set[str]) -> None:
        """Origin takeover (module docstring, Failures): if we are the heir — the live origin of
        this iteration with the lowest id — and have not sent our `done`, re-run the microbatches
        of the origins in `gone` as our own."""
        if self.stage != 0 or st.schedule is None or self.me in st.done_from:
            return
        heirs = sorted(o for o in st.origins if o not in self.deaths.seen)
        if not heirs or heirs[0] != self.me:
            return
        taken = []
        for plan in st.schedule.plans:
            mb = plan.microbatch
            if plan.origin not in gone or mb in st.mine:
                continue
            att = st.floor.get(mb, 0) + 1  # above any attempt the dead origin may have started
            route = self._reroute(st, (self.me, *(q for _, q in plan.path[1:-1])))
            if route is None or att >= MAX_ATTEMPTS:
                continue  # lost for this iteration, as without a takeover
            st.origin_of[mb] = self.me
            self._void_everywhere(st, mb, att)
            st.mine[mb] = OriginMicrobatch(att, route)
            st.restarts.append((mb, att))
            taken.append(mb)
        if taken:
            st.restart_count += len(taken)
            log.warning(kv("pipeline origin takeover", it=st.it, microbatches=",".join(map(str, taken))))
            st.notify()


__all__ = ["MAX_ATTEMPTS", "Rerouter"]
