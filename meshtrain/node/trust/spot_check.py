"""Replay spot-check: does a peer's update match a recomputation of its own first inner steps?
(Against peers that replay old updates, send none, or skip their work.)

Problem. Screening (collective/data_phase.py) passes an update with an ordinary norm that points
roughly the right way, and loss scoring (node/trust/scoring.py) asks only whether it fits the last
batch of the round: an update replayed from an earlier round is flagged there only once it has
drifted, and a lazy peer that trains only the last few steps of its round on its assigned data
lowers that batch's loss and passes. What a peer claims is H inner steps from φ (the round's
outer parameters, the same on every peer) on its assigned batches, which are a pure function of
(swarm seed, peer id, step) (models/corpus.py `Corpus.batch`). Anyone can redo its first steps.

Design. Loss scoring's machinery, with a recomputation instead of a forward pass:
- **Sample.** `spec.verification.spot_check_samples` peers per round (default 1), the same on every owner:
  `sampled_peers(group, digest, k)` of the round's committed digest (collective/contract.py),
  unknown to a sender until every contribution was combined, checkable by anyone from a
  strike's group and digest. The collective keeps the larger of the two samples
  (`SwarmSpec.kept_samples`; a ranking's prefix holds the smaller) and hands them over with the
  round's `RoundScreening`.
- **Recompute** (`recompute_update`, in a worker thread: the trio loop never runs compute). The
  owner of part p trains a working copy of φ (φ copied as the round commits, before its result is
  applied) through a `scratch_model` of no parameter memory (`torch.func.functional_call`) and
  runs k = `spec.verification.spot_check_steps` inner steps of the spec's inner
  optimizer (AdamW, `inner_lr`, `weight_decay`, `clip`) on the sampled peer's batches of steps
  r − H .. r − H + k − 1 of round r: its first k, the only ones that start from a point every
  peer knows. Δ_v = φ − θ_v.
- **Compare.** The recomputation cannot be exact: the daemon's inner optimizer keeps its state
  across rounds (optim/outer.py: θ ← φ at a round's end, the inner AdamW's moments stay; never
  shared). So the test is relative, on our part p of the flattened fragment:

      match = cos(Δ_i[p], Δ_v[p])        ref = cos(Δ̄[p], Δ_v[p])        flagged: match < ref − margin

  An honest update went through the very batches Δ_v did, so it agrees with the recomputation
  at least about as well as the round's aggregate Δ̄ (the swarm's mean direction) does; a replayed,
  empty or lazy update lacks the batch-specific part and falls below it. The aggregate calibrates
  the test for the model, the part, k, and how far the fresh recomputation is from any peer's
  warm optimizer. The recomputation starts from a fresh AdamW: starting it from the checker's
  own second moments (peers' are alike: β2 = 0.999 averages a thousand steps of the same data)
  brings it nearer every update, honest or not, and separated no better (below). Flagged
  (node/trust/strikes.py `spot_flagged`) with `spot_check_margin` (default 0.2) become signed spot
  strikes (crdt/strikes.py: `match`, `ref`, and the norm and alignment against the aggregate),
  counted like any strike: half the round's other owners (each checks the peer on its own part)
  in `spec.verification.strikes` rounds within `spec.verification.strikes_window`. Other peers re-check that the cosines
  break the rule and that the digest sampled the peer; they cannot recompute (they do not hold
  Δ_i[p]).

Measured (scripts/studies/spot_check_separation.py --rounds 9 --steps 2,5,10, one process, as
tests/test_spot_check.py: gpt-tiny, 4 honest peers whose inner AdamW keeps its state across
rounds, H = 10, batch 8, rounds 2–9, each honest owner's part; match − ref, and the share of
part-checks flagged at margin 0.2):

    k = H = 10   honest     min −0.12, 10th pct −0.02, median +0.05       0 of 96 flagged
                 replay     (its round-1 update) median −0.49, max −0.12   94 %
                 zeros      median −0.54, max −0.26                        100 %
                 lazy       (trains only its last 2 of 10 steps) median −0.34   91 %
                 half-lazy  (its last 5) median −0.20                      53 %
                 otherdata  (reversed token order) median −0.17            38 %
    k = 5        honest min −0.13 (0 %); replay 84 %, zeros 94 %, lazy 69 %, otherdata 22 %
    k = 2        honest min −0.19 (0 %); replay 75 %, zeros 91 %, lazy 16 %, otherdata 9 %
    k = 10, from the checker's own second moments: honest min −0.18; replay 100 %, lazy 94 %,
                 otherdata 34 % (no better, and a model-sized copy per round: not used)

so a margin of 0.2 flagged no honest part-check and most of a replay's, a zero update's and a
lazy peer's (a quorum of owners flags a peer in a round). k = H separates best; small k still
catches replays and empty updates. Other data is flagged more as training goes on (k = H: 20 %
of its part-checks in rounds 2–6, 38 % in rounds 2–9).

Costs. Per round and owner: k training steps (forward + backward + optimizer step) of one batch
per sampled peer, in a worker thread beside training: with k = H and one sample, as much compute
as the round's own training, so about half a peer's throughput (every owner recomputes the same
sampled peer, once each); k = H/10 costs a tenth. Memory: φ per queued round (on the trio thread,
a memory copy: up to QUEUE + 1 rounds alive), and while recomputing a working copy of it with its
gradients and AdamW state; no model copy for the node's life (a deep copy was, until the
real-scale issue: 4 bytes per parameter). Nothing extra crosses the wire. Measured in
scripts/bench/bench_adversarial.py (`--spot-check-steps`, docs/bench/bench_adversarial_spotcheck_issue21.json):
one owner's checks of 4 peers on 10 steps of gpt-tiny took 262 ms on one thread (~6.5 ms a
recomputed step, what a training step costs), 6 % of the benchmark's contended round at H = 50
and 80 % of that round's own training compute.

Failures and limits. Only diloco (a single fragment whose exchange blocks the round: Streaming
DiLoCo's fragments train while others are exchanged, so θ never restarts from φ as a whole; the
spec refuses the key there), ungrouped rounds, a node that holds the round's committed result and
need not re-sync, and no local ranks. With error feedback or a lossy codec what is compared is
the sent update, a little off Δ_i. fp16 swarms recompute without loss scaling. If checks fall
behind by more than `QUEUE` rounds, rounds are skipped (logged).

Not caught. A peer sampled with probability k/n per round is struck only in rounds it is
sampled in. Only the first k steps are recomputed: a lazy peer that trains those honestly and
skips the rest passes, unless k = H. Steps cannot be drawn from the digest instead: step j starts
from the peer's θ after its j earlier steps and from its inner optimizer's state, which only the
peer holds and nothing commits to, so checking step j means recomputing every step before it (a
drawn step is a drawn k, costing up to H steps, not a cheaper check). Other data that shares the assigned batches' content
(scripts/bench/bench_adversarial.py's `otherdata`: the same windows with their token order reversed,
on gpt-tiny's character corpus) agrees with the recomputation nearly as well as an honest update
in early rounds: a fraction of its part-checks is flagged (above), seldom by a quorum, and the
benchmark did not exclude it within 6 rounds. Nor is a peer that trains on its assigned data and
more caught, nor a poisoned update that also follows its batches. The test assumes the spec's inner
optimizer: a peer's warm AdamW state is the gap the margin covers (measured above); an honest
peer restarted mid-run with a fresh optimizer matches its recomputation more closely, not less.
Chance flags of honest peers are bounded by the quorum and the window, not ruled out (none in
the benchmark's runs; an earlier variant that started from the checker's second moments flagged
2 honest part-checks in 3 runs of 6 rounds, by one owner each). A majority of colluding owners
can still strike anyone (as with screening).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import trio
from torch.func import functional_call

from meshtrain.collective.contract import RoundScreening, sampled_peers
from meshtrain.collective.flat import flatten_fp32
from meshtrain.log import get_logger, kv
from meshtrain.models.sources import loss_of
from meshtrain.node.trust.scoring import FRAGMENT_TAG, scratch_model, set_training_flags
from meshtrain.node.trust.strikes import SpotCheck, StrikeBook

if TYPE_CHECKING:
    from meshtrain.node.trainer import Trainer

log = get_logger(__name__)

QUEUE = 1  # rounds waiting to be checked (besides the one being checked); beyond that a round is skipped: each holds a copy of φ

Batch = tuple[torch.Tensor, torch.Tensor]


def queue_full(send: trio.MemorySendChannel[Any]) -> bool:
    """Whether `send.send_nowait` would block now (its buffer full, no receiver waiting): asked
    before a round's φ is copied for the queue, not after."""
    stats = send.statistics()
    return stats.current_buffer_used >= stats.max_buffer_size and not stats.tasks_waiting_receive


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b) / max(float(a.norm()) * float(b.norm()), 1e-30)


def recompute_update(
    model: torch.nn.Module,
    phi: dict[str, torch.Tensor],
    names: list[str],
    batches: list[Batch],
    *,
    lr: float,
    weight_decay: float,
    clip: float,
    autocast: Callable[[], AbstractContextManager] | None = None,
) -> torch.Tensor:
    """Δ_v = φ − θ_v, flat fp32 over `names` in order, after one AdamW step (`lr`,
    `weight_decay`, gradients clipped to `clip`) per batch of `batches` from φ (`phi`, by name).
    `model` runs with the parameters passed in (`torch.func.functional_call`): a `scratch_model`
    of no parameter memory, or any model of those names, whose own parameters are neither read nor
    written. The trained parameters are a working copy of φ's (on the batches' device), dropped
    on return; φ is only read. The optimizer is fresh (module docstring). Runs in a worker thread."""
    device = batches[0][0].device if batches else torch.device("cpu")
    params = {n: t.detach().to(device, copy=True).requires_grad_(n in names) for n, t in phi.items()}
    trained = [params[n] for n in names]
    opt = torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay)
    set_training_flags(model, True)
    for x, y in batches:
        with autocast() if autocast is not None else contextlib.nullcontext():
            out = functional_call(model, params, (x, y))
            loss = loss_of(out)
        opt.zero_grad(set_to_none=True)
        loss.float().backward()
        torch.nn.utils.clip_grad_norm_(trained, clip)
        opt.step()
    with torch.no_grad():
        return flatten_fp32({n: phi[n].to(params[n].device) - params[n].detach() for n in names}).cpu()


def spot_check_round(
    recomputed: dict[str, torch.Tensor],
    part: tuple[int, int],
    samples: dict[str, torch.Tensor],
    aggregate: torch.Tensor,
) -> list[SpotCheck]:
    """Compare each sampled peer's contribution `samples[peer]` to part `part` (a [a, b) slice
    of the flat fragment) with our recomputation of its update (`recomputed[peer]`, the whole flat
    fragment) and the round's `aggregate` of that slice (module docstring)."""
    a, b = part
    agg = aggregate.float()
    agg_norm = float(agg.norm())
    checks = []
    for peer in sorted(samples):
        if peer not in recomputed:
            continue
        x, v = samples[peer].float(), recomputed[peer][a:b].float()
        norm = float(x.norm())
        checks.append(
            SpotCheck(
                peer,
                round(_cosine(x, v), 6),
                round(_cosine(agg, v), 6),
                round(norm / max(agg_norm, 1e-30), 6),
                round(_cosine(x, agg), 6),
            )
        )
    return checks


@dataclasses.dataclass(frozen=True)
class _Queued:
    """A round waiting to be checked: its screening (samples: the spot-check's only), the
    fragment's parameter names, and φ as the round started."""

    screening: RoundScreening
    names: list[str]
    phi: dict[str, torch.Tensor]


class SpotChecker:
    """Spot-checks the sampled contributions of every screened round this peer owned a part of,
    and files what breaks the rule as spot strikes in `book` (module docstring).

    trainer: the node's trainer (its corpus, context and spec draw the peers' batches; its outer
    optimizer holds φ; its model gives the `scratch_model`, of no parameter memory, that the
    working copy of φ trains in). book: the node's
    `StrikeBook`. `Verification` hands it each screened round (`on_round`, after the book's
    listener); run `run` in a nursery for the node's lifetime."""

    def __init__(self, trainer: Trainer, book: StrikeBook) -> None:
        self.trainer, self.book, self.spec = trainer, book, trainer.spec
        # φ's parameters on the meta device: each check trains a working copy of φ through it.
        self.model = scratch_model(trainer.model, list(trainer.outer.outer_params))
        self.device = next(trainer.model.parameters()).device  # where the batches go
        self._send, self._receive = trio.open_memory_channel[_Queued](QUEUE)
        self.checked = 0  # rounds checked (status)
        self.skipped = 0  # rounds skipped because checks were behind
        self.seconds = 0.0  # worker time spent recomputing (the benchmark's cost)

    def on_round(self, screening: RoundScreening) -> None:
        """Called for each screened round (trio thread, must not block): queue it with a copy of
        φ as the round started (the round's result is applied only after the collective returned,
        optim/outer.py, so the listener still sees that φ)."""
        outer, spec = self.trainer.outer, self.spec
        match = FRAGMENT_TAG.fullmatch(screening.tag)
        if (
            not screening.samples
            or screening.aggregate is None
            or match is None
            or outer.needs_resync
            or len(outer.fragments) != 1
            or outer.delay
        ):
            return
        chosen = sampled_peers(screening.group, screening.digest, spec.verification.spot_check_samples)
        samples = {p: x for p, x in screening.samples.items() if p in chosen}
        names = list(outer.fragments[0])
        if not samples or int(match.group(1)) != 0 or screening.round_id < spec.outer.H:
            return
        if screening.part[1] > sum(outer.outer_params[n].numel() for n in names):
            return  # not the fragment's Δ in order: nothing to compare
        if queue_full(self._send):  # before φ is copied for it: a skipped round costs no memory
            self.skipped += 1
            log.info(kv("spot-checks behind; round skipped", round=screening.round_id))
            return
        phi = {n: t.detach().clone() for n, t in outer.outer_params.items()}
        self._send.send_nowait(_Queued(dataclasses.replace(screening, samples=samples), names, phi))

    def batches(self, screening: RoundScreening, peer: str) -> list[Batch]:
        """`peer`'s assigned batches of the round's first `spot_check_steps` inner steps."""
        t, spec = self.trainer, self.spec
        device = self.device
        first = screening.round_id - spec.outer.H
        out = []
        for step in range(first, first + spec.verification.spot_check_steps):
            x, y = t.corpus.batch(spec.data.batch_size, t.context, seed=spec.seed, peer=peer, step=step)
            out.append((x.to(device), y.to(device)))
        return out

    def check(self, queued: _Queued) -> list[SpotCheck]:
        """Recompute each sampled peer's first steps and compare (a worker thread)."""
        spec, s = self.spec, queued.screening
        if s.aggregate is None:  # on_round queues none without one
            return []
        recomputed = {
            peer: recompute_update(
                self.model,
                queued.phi,
                queued.names,
                self.batches(s, peer),
                lr=spec.outer.inner_lr,
                weight_decay=spec.outer.weight_decay,
                clip=spec.outer.clip,
                autocast=self.trainer.precision.autocast,
            )
            for peer in sorted(s.samples)
        }
        return spot_check_round(recomputed, s.part, s.samples, s.aggregate)

    async def run(self) -> None:
        """Check queued rounds one at a time, off the trio thread; file the verdicts."""
        async for queued in self._receive:
            t0 = trio.current_time()
            checks = await trio.to_thread.run_sync(self.check, queued)
            self.seconds += trio.current_time() - t0
            self.checked += 1
            log.debug(kv("spot-checked", round=queued.screening.round_id, checks=len(checks)))
            self.book.on_spot_checks(queued.screening, checks)
