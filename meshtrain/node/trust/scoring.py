"""Loss scoring: does a peer's update lower the loss on the data it was assigned?

Problem. Screening (collective/data_phase.py) compares each contribution's norm and direction
with the group's. An update replayed from an earlier round, or trained on other data than the
peer was assigned, has an ordinary norm and points roughly the right way, so it passes: in
scripts/bench/bench_adversarial.py a replay was struck out only after 5 rounds (once it had drifted
from the swarm's direction) and an other-data peer never was. What such an update lacks is what
the peer claims to have done: H inner steps on its own assigned batches, which are a pure
function of (swarm seed, peer id, step) (models/corpus.py `Corpus.batch`), so anyone can redraw
them.

Design. In a robust round the owner of part p holds every peer's contribution Δ_i[p] to it.
- **Sample.** A few peers per round (`spec.verification.score_samples`), the same on every owner: the group
  ranked by a hash of the round's committed digest (collective/contract.py `sampled_peers`),
  unknown to a sender until every contribution was combined, checkable by anyone from a strike's
  group and digest. The collective keeps their contributions to our part until the round commits
  and hands them over with the round's `RoundScreening` (`samples`, `part`, `aggregate`); it
  stays model-agnostic.
- **Measure** (`score_round`, in a worker thread: the trio loop never runs a forward pass). φ is
  the outer parameters the round started from, the same on every peer: the outer optimizer's live
  φ, read in place, never copied. The listener starts the scoring as the round commits, before the
  round's result is applied (the trainer applies it only after the collective returned,
  optim/outer.py), and the result waits for it: `LossScorer.release` is one of the optimizer's
  `before_state_change` hooks, which returns once the scoring no longer reads φ (within a bound,
  "Costs"). Only the parameters our part covers get a working copy, written with φ − Δ and
  restored from φ (φ itself is never written: a checkpoint or a joiner may read it meanwhile).
  For a sampled peer i, on its batches of the round's last
  b = `spec.verification.score_batches` inner steps (steps r − b .. r − 1 of round r, all H if fewer,
  `scored_steps`: the last it trained, so the ones its update fits best), L the mean of the
  per-batch losses (for batches of one size the loss on their concatenation, with one batch's
  activations alive at a time):

      L0 = L(φ)        Li = L(φ with part p ← φ[p] − Δ_i[p])        La = L(φ with part p ← φ[p] − Δ̄[p])
      gain = (L0 − Li) / L0                ref = (L0 − La) / L0

  Δ = φ − θ, so φ − Δ_i is the peer's own θ_i on our part. An honest peer's θ_i fits its own
  batches at least about as well as the swarm's aggregate Δ̄ does; a replayed or other-data update
  does not. One batch (b = 1, the rule before `score_batches` existed) is a noisy judge: at batch
  8 an honest update now and then fits its last batch worse than the aggregate does (below), and
  CI once saw an honest peer flagged by a quorum in one round (gain −0.0015, ref 0.0073); the
  mean over b batches averages much of that out (default 4, chosen from the table below).
  Flagged (node/trust/strikes.py `loss_flagged`): ref > `score_floor` and gain < `score_ratio` x ref −
  `score_floor` (defaults 0.5 and 2e-3). The floor keeps rounds where every change is tiny from
  convicting anyone (at 1e-3, honest peers of a 4-peer swarm with batches of 4 were flagged by a
  quorum); a batch the aggregate did not lower is no evidence (the round's updates do not fit it:
  an honest update raised one's loss by 1.8 % where the aggregate raised it by 0.7 %, flagged by
  two owners, when such batches were scored). The scores, the contribution's norm over the
  aggregate's and its cosine with it become a signed loss strike (crdt/strikes.py), counted like
  any other: half the round's other owners (each scores the peer on its own part) must flag it,
  in `spec.verification.strikes` rounds within `spec.verification.strikes_window` (node/trust/strikes.py). Other peers re-check
  that the scores break the rule and that the digest sampled the peer; they cannot re-measure
  (they do not hold Δ_i[p]). The strike does not record b: the re-check needs only the scores and
  the spec (b is the swarm's, like the thresholds), so older strikes and readers are unchanged.

Measured (scripts/studies/loss_score_separation.py --rounds 9 --batches 1,2,4,8,
docs/bench/loss_score_separation_issue21.json: gpt-tiny, batch 8, H = 10, one process; 4 honest peers
and one liar per group, every owner's score of every other peer in rounds 2–9; each honest update
is scored in five liars' groups. "keep": inner AdamW state kept across rounds, as the daemon's,
seeds 0–5; "fresh": a new AdamW every round, as tests/test_scoring.py, seeds 0–2). Honest: the
lowest margin gain − 0.5·ref (flagged below −score_floor where ref > score_floor) and the honest
part-scores flagged, never by a quorum at any b; liars: rounds flagged by a quorum of owners.

    b   honest min margin   honest flagged         replay        zeros         otherdata
        keep     fresh      keep      fresh        keep  fresh   keep  fresh   keep  fresh
    1   −0.010   −0.008     29/3840   31/1920      28/48 16/24   18/48 10/24   1/48  4/24
    2   −0.004   −0.004     19/3840    3/1920      28/48 20/24   18/48 11/24   0/48  3/24
    4   −0.005   −0.004      8/3840    0/1920      29/48 20/24   20/48  9/24   1/48  3/24
    8   −0.005   −0.003     16/3840    0/1920      30/48 21/24   17/48 13/24   1/48  4/24

so 4 batches flag honest part-scores less often than one (29 → 8 of 3840 with the daemon's
optimizer, 31 → 0 of 1920 with a fresh one) and catch replays as often or more; 8 flag honest ones
no less often than 4 (16 of 3840) at twice the cost. A zero update is flagged by a quorum in
17–20 of 48 rounds (keep) and 9–13 of 24 (fresh): on about half the parts the aggregate lowers the loss by
less than the floor, so no score there is evidence (screening catches zeros by their norm). A
lazy peer (its last 2 of H steps) or a half-lazy one (its last 5) was flagged by a quorum in at
most 2 of 48 rounds at any b.

Costs. Per round and owner: 3 forward passes (no gradients) of b batches per sampled peer, not
per group member, in a worker thread, on the round's path: the round's result waits for them (in
a blocking round, DiLoCo's, training waits there already; with a delay τ >= 1 they first overlap
the τ inner steps before the merge). With the default 2 samples and 4 batches that is 24 forwards
against H training steps (forward + backward, ~3 forwards each) per round, about 8 training
steps' compute: measured (gpt-tiny, batch 8, one thread, CPU time) 20–21 ms against a 3.7–4.1 ms
training step, ~11 % of a round's compute at H = 50 and ~1 % at H = 500 (b = 1: 5.8 ms, ~3 % at
H = 50; b = 2 halves the default's). In scripts/bench/bench_adversarial.py's runs (before
`score_batches`, b = 1, 5 samples) scoring took 15 ms against a 3.4 s round at H = 50, whose time
is mostly not compute. Beside training (the design before this one) the forwards took the same
compute from a busy device; waiting for them loses only the overlap a device with room to spare
gave. A round waits at most `WAIT_SHARE` (0.5) of its own length (the time since φ last changed):
past that the scoring stops at its next forward pass, the peers scored by then keep their scores,
and the round counts as skipped (logged; status `loss_scoring.skipped`); the sampled peers are
scored in an order the round's digest rotates (`rotated`), so a round cut short leaves out other
peers in the next. So a large model, or many samples and batches against a short H, cost at most
a third of the swarm's time, and score fewer peers per round. Memory: no copy of φ (the design
before held one per queued round, on the trio thread: 4 B/param, up to two alive); while a round
is scored, a working copy of our part's parameters (4/n B/param in a group of n) and one forward
pass's activations; the collective keeps the sampled peers' contributions to our part and the
aggregate's slice until the scoring is done; the `scratch_model`, made once, holds no parameter
memory. Measured with scripts/bench/bench_memory.py (103 M parameters, two peers, H 2:
docs/benchmarks.md, "Memory"): DiLoCo's figures fell from 19.7 / 31.5 B/param (steady / peak)
to 12.3 / 25.6 with it. Nothing extra crosses the wire.

Failures and limits. A round we did not hold the committed result of, a grouped round (its
members' φ differ), a tag that is not a plain fragment ("f<p>"), an optimizer whose exchanged
tensors are not the fragment's Δ in order (SparseLoCo's sparse payload: sizes differ, checked), a
peer with local ranks, or a node that must re-sync (its φ is not the swarm's) scores nothing. A
round whose scoring would hold its result back longer than `WAIT_SHARE` of the round is cut short
("Costs"). φ changes only in a round's `apply` (after the hook) and when a state is loaded
(`join`, `load_state_dict`), which the node does between rounds, when nothing is scored. With error
feedback (SparseLoCo's) what is scored is the compressed accumulator, the update actually applied.
A spec signed before `score_batches` existed reads as the default (4) on nodes that know the key
and scores one batch on older ones; their strikes count alike (the rule and its re-check do not
depend on b).

Not caught. A peer sampled with probability k/n per round is struck only in rounds it is
sampled in, so with the default 2 samples in a group of n it takes ~n/2 times longer to reach
`spec.verification.strikes` than screening takes. An update that fits its own batch but is poisoned elsewhere
(a backdoor) passes; so does a lazy peer that trains only the last few steps of its round on its
assigned data (it lowers its last batches' loss; measured above). An honest peer with an unusual
update can still be flagged by chance: more batches make it rarer (above: 8 of 3840 honest
part-scores at the default, none by a quorum), not impossible; the strikes window bounds what that
adds up to; and the rule needs updates worth scoring: at batch 4 and H = 5 (a test swarm) an honest
peer's update applied to one part raised its own batch's loss by 0.5 % while the aggregate
lowered it, and two owners flagged it in one round (one batch). Other data that still fits the
assigned text (scripts/bench/bench_adversarial.py's reversed token order, on gpt-tiny) is flagged by a
quorum in some rounds only (above: at most 1 in 48 with the daemon's optimizer, at any b), and
was not excluded within the benchmark's 6 rounds. Nor does specificity separate it
(scripts/studies/specificity_separation.py, docs/bench/specificity_separation_issue21.json; same simulation,
b = 4, seeds 0–2): the statistic s = gain(own batches) − gain(unseen batches of the same steps,
a held-out peer id's), alone or less the aggregate's, is mostly noise on one part. With the
daemon's optimizer the median s is 0.0005 for honest updates and 0.0006 for other data (replay
0.0000; zeros exactly 0, well inside the honest spread, whose min is −0.010); at the highest
threshold that flags no honest verdict by a quorum (fit to these very scores, so optimistic; 5–26
of 1920 honest part-scores still flagged) other data was flagged by a quorum in at most 1 of 24
rounds, replay in at most 7 (s less the aggregate's, b = 8) and zeros in at most 2, with a fresh
optimizer, with the group's other peers' batches as the unseen ones or with b = 8 alike, at 2–5x
scoring's forward passes; it is not implemented. In early rounds a replay is still near the
swarm's direction: in tests/test_scoring.py's run one batch flags it by a quorum in round 3, four
batches from round 4. A peer that trains on its assigned data and more (extra data) is not
distinguished. A majority of colluding owners can still strike anyone (as with screening).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch
import trio
from torch.func import functional_call

from meshtrain.collective.contract import RoundScreening, sampled_peers
from meshtrain.log import get_logger, kv
from meshtrain.models.sources import loss_of
from meshtrain.node.trust.strikes import LossScore, StrikeBook

if TYPE_CHECKING:
    from meshtrain.node.trainer import Trainer

log = get_logger(__name__)

WAIT_SHARE = 0.5  # a round waits for its scoring at most this share of its own length (module docstring, "Costs")
FRAGMENT_TAG = re.compile(r"f(\d{1,6})")  # an ungrouped round's tag (optim/outer_round.py)

Batch = tuple[torch.Tensor, torch.Tensor]


class _Stopped(Exception):
    """`score_round`'s `stop` said so between two forward passes."""


def _loss(forward: Callable[[Batch], object], batches: Sequence[Batch], stop: Callable[[], bool]) -> float:
    """The mean of the losses `forward` gives on `batches`: for batches of one size (the spec's),
    the loss on their concatenation, with one batch's activations alive at a time. `_Stopped`
    before a batch once `stop()` is true."""
    total = 0.0
    for batch in batches:
        if stop():
            raise _Stopped
        total += float(loss_of(forward(batch)).float())
    return total / len(batches)


def set_training_flags(model: torch.nn.Module, training: bool) -> None:
    """`model.train(training)` without the model's own `train()` overrides: sets every module's
    `training` flag. A user's Hugging Face model loaded with the Hub's kernels (transformers >= 5.25
    does so by default) re-kernelizes on a mode switch, for the device its parameters are on: the
    `scratch_model`'s meta device, which no kernel supports."""
    for module in model.modules():
        module.training = training


def scratch_model(model: torch.nn.Module, names: Sequence[str]) -> torch.nn.Module:
    """A copy of `model` whose parameters `names` (φ's: the outer optimizer's) hold no memory —
    on the meta device — to run with φ's tensors passed in (`score_round`, functional_call).
    Its other tensors (buffers, parameters φ does not cover) are real copies: small. A deep copy
    of the model would hold another 4 bytes per parameter for the node's lifetime."""
    covered = set(names)
    memo: dict[int, object] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in covered and id(param) not in memo:
            memo[id(param)] = torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False)
    scratch = copy.deepcopy(model, memo)
    scratch.requires_grad_(False)
    return scratch


def _overlaps(
    params: dict[str, torch.Tensor], names: list[str], part: tuple[int, int]
) -> Iterator[tuple[str, int, int, int]]:
    """(parameter name, its [lo, hi) within the flattened parameter, where that starts in the part)
    for every parameter of `names` (in flattening order) that part [a, b) of their flat vector covers."""
    a, b = part
    pos = 0
    for n in names:
        numel = params[n].numel()
        lo, hi = max(a, pos), min(b, pos + numel)
        if lo < hi:
            yield n, lo - pos, hi - pos, lo - a
        pos += numel


def score_round(
    model: torch.nn.Module,
    phi: dict[str, torch.Tensor],
    names: list[str],
    part: tuple[int, int],
    samples: dict[str, torch.Tensor],
    aggregate: torch.Tensor,
    batches: dict[str, Sequence[Batch]],
    autocast: Callable[[], AbstractContextManager] | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[LossScore]:
    """Score each sampled peer's contribution `samples[peer]` to part `part` (the [a, b) slice
    of `names`' parameters flattened in order) against the round's `aggregate` of that slice, on
    the peer's batches `batches[peer]` (at least one; the mean loss over them, module docstring),
    in the order of `samples`. `model` runs with φ (`phi`, by name) passed in
    (`torch.func.functional_call`): a `scratch_model` of no parameter memory, or any model of those
    names, whose own parameters are neither read nor written. φ is only read — it may be the outer
    optimizer's live φ, which must not change until this returns: the parameters the part covers
    get one working copy (1/n of the model), written with φ − Δ and restored from φ itself; the
    others are φ's own tensors (on the batches' device: no copy on the host). `stop`: asked
    before each forward pass; once true, the scores of the peers finished so far are returned.
    Runs in a worker thread."""
    stopped = stop if stop is not None else lambda: False
    with torch.no_grad():
        device = next(iter(batches.values()))[0][0].device
        params = {n: t.to(device) for n, t in phi.items()}
        spans = list(_overlaps(params, names, part))
        # (the working copy's flat view, φ's, the span within them, where it starts in the part)
        views = []
        for n, lo, hi, at in spans:  # the part's parameters get a working copy: φ itself is never written
            source = params[n]
            params[n] = source.clone()
            views.append((params[n].view(-1), source.view(-1), lo, hi, at))
        agg_norm = float(aggregate.norm())

        def loss_at(update: torch.Tensor | None, peer_batches: Sequence[Batch]) -> float:
            if update is not None:
                for flat, source, lo, hi, at in views:
                    torch.sub(source[lo:hi], update[at : at + hi - lo].to(flat.device, flat.dtype), out=flat[lo:hi])
            try:
                with autocast() if autocast is not None else contextlib.nullcontext():
                    return _loss(lambda batch: functional_call(model, params, batch), peer_batches, stopped)
            finally:
                if update is not None:
                    for flat, source, lo, hi, _ in views:
                        flat[lo:hi].copy_(source[lo:hi])

        set_training_flags(model, False)
        scores = []
        for peer, x in samples.items():
            own_batches = batches[peer]
            try:
                base = loss_at(None, own_batches)
                if not math.isfinite(base) or base <= 0:
                    continue
                own, agg = loss_at(x, own_batches), loss_at(aggregate, own_batches)
            except _Stopped:
                break
            norm = float(x.norm())
            cosine = float(x @ aggregate) / max(norm * agg_norm, 1e-30)
            scores.append(
                LossScore(
                    peer,
                    round((base - own) / base, 6),
                    round((base - agg) / base, 6),
                    round(norm / max(agg_norm, 1e-30), 6),
                    round(cosine, 6),
                )
            )
        return scores


def scored_steps(round_id: int, H: int, score_batches: int) -> range:
    """The inner steps whose batches loss scoring measures a peer on in the round that ends at
    step `round_id`: its last `score_batches` (all H if fewer; none before step 0)."""
    return range(max(round_id - min(score_batches, H), 0), max(round_id, 1))


def rotated(peers: Sequence[str], digest: bytes) -> list[str]:
    """`peers` (sorted) rotated by the round's committed `digest`: the order a round's sampled
    peers are scored in, so a round cut short leaves out different peers from round to round."""
    start = int.from_bytes(digest[:4], "big") % len(peers) if peers and digest else 0
    return [*peers[start:], *peers[:start]]


@dataclasses.dataclass
class _Scoring:
    """A round being scored from the live φ: its screening (samples: the scorer's only, in the
    order they are scored), the fragment's parameter names; `stop` tells the worker to end at its
    next forward pass, `done` is set once it no longer reads φ (scored, stopped or never begun)."""

    screening: RoundScreening
    names: list[str]
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    begun: bool = False  # `run` took it


class LossScorer:
    """Scores the sampled contributions of every screened round this peer owned a part of, and
    files what breaks the rule as loss strikes in `book` (module docstring).

    trainer: the node's trainer (its corpus, context and spec draw the peers' batches; its outer
    optimizer holds φ — read live, never copied: `release` is one of its `before_state_change`
    hooks — and the fragments; its model gives the `scratch_model`, of no parameter memory, that φ
    runs in).
    book: the node's `StrikeBook`. `Verification` hands it each screened round (`on_round`, after
    the book's listener); run `run` in a nursery for the node's lifetime."""

    def __init__(self, trainer: Trainer, book: StrikeBook) -> None:
        self.trainer, self.book, self.spec = trainer, book, trainer.spec
        self.model = scratch_model(trainer.model, list(trainer.outer.outer_params))
        self.device = next(trainer.model.parameters()).device  # where the batches go
        self._send, self._receive = trio.open_memory_channel[_Scoring](1)
        self._current: _Scoring | None = None  # the round whose scoring reads the live φ
        self._running = False  # `run` is running: it takes what `on_round` starts
        self._since = trio.current_time()  # when φ last changed: the round's length so far
        self.scored = 0  # rounds scored (status)
        self.skipped = 0  # rounds skipped, or cut short before every sampled peer was scored
        self.waited = 0.0  # seconds rounds waited for their scoring (`release`)
        trainer.outer.before_state_change.append(self.release)

    def on_round(self, screening: RoundScreening) -> None:
        """Called for each screened round (trio thread, must not block): start scoring it on the
        live φ, which the round's result changes only after `release` (module docstring)."""
        outer = self.trainer.outer
        match = FRAGMENT_TAG.fullmatch(screening.tag)
        if not screening.samples or screening.aggregate is None or match is None or outer.needs_resync:
            return
        fragment = int(match.group(1))
        if fragment >= len(outer.fragments):
            return
        # The collective keeps the larger of loss scoring's and spot-checks' samples (SwarmSpec.kept_samples).
        chosen = sampled_peers(screening.group, screening.digest, self.spec.verification.score_samples)
        order = rotated([p for p in chosen if p in screening.samples], screening.digest)
        screening = dataclasses.replace(screening, samples={p: screening.samples[p] for p in order})
        if not screening.samples:
            return
        names = list(outer.fragments[fragment])
        if screening.part[1] > sum(outer.outer_params[n].numel() for n in names):
            return  # not the fragment's Δ in order (a sparse payload): nothing to score
        if self._current is not None:  # an earlier round not yet released (one round is in flight at a time)
            self.skipped += 1
            log.info(kv("loss scoring behind; round skipped", round=screening.round_id))
            return
        self._current = _Scoring(screening, names)
        self._send.send_nowait(self._current)

    async def release(self) -> None:
        """The outer optimizer's `before_state_change` hook (trio side, before a round's result
        changes φ): wait until the round being scored no longer reads φ — at most `WAIT_SHARE` of
        the round's length, then its scoring stops at the next forward pass (the peers scored by
        then keep their scores)."""
        current, self._current = self._current, None
        if current is not None and not current.done.is_set():
            t0 = trio.current_time()
            with trio.move_on_after(WAIT_SHARE * (t0 - self._since) if self._running else 0):
                await current.done.wait()
            if not current.done.is_set():
                current.stop.set()
                if not current.begun:  # `run` never took it (not running): nothing reads φ
                    current.done.set()
                log.info(kv("loss scoring cut short: the round waited long enough", round=current.screening.round_id))
                await current.done.wait()
            self.waited += trio.current_time() - t0
        self._since = trio.current_time()

    def batches(self, screening: RoundScreening) -> dict[str, list[Batch]]:
        """Each sampled peer's assigned batches of the round's last `score_batches` inner steps
        (`scored_steps`)."""
        t, spec, device = self.trainer, self.spec, self.device
        out = {}
        for peer in screening.samples:
            out[peer] = []
            for step in scored_steps(screening.round_id, spec.outer.H, spec.verification.score_batches):
                x, y = t.corpus.batch(spec.data.batch_size, t.context, seed=spec.seed, peer=peer, step=step)
                out[peer].append((x.to(device), y.to(device)))
        return out

    def score(self, scoring: _Scoring) -> list[LossScore]:
        """Score one round on the live φ (a worker thread)."""
        s = scoring.screening
        assert s.aggregate is not None  # on_round starts none without one
        return score_round(
            self.model,
            self.trainer.outer.outer_params,
            scoring.names,
            s.part,
            s.samples,
            s.aggregate,
            self.batches(s),
            self.trainer.precision.autocast,
            scoring.stop.is_set,
        )

    async def run(self) -> None:
        """Score rounds one at a time, off the trio thread; file the verdicts."""
        self._running = True
        try:
            await self._score_rounds()
        finally:
            self._running = False

    async def _score_rounds(self) -> None:
        async for scoring in self._receive:
            scoring.begun = True
            try:
                if scoring.stop.is_set():  # released before it began: a round the optimizer already moved past
                    self.skipped += 1
                    continue
                scores = await trio.to_thread.run_sync(self.score, scoring)
            finally:
                scoring.done.set()
            if scoring.stop.is_set() and len(scores) < len(scoring.screening.samples):
                self.skipped += 1  # cut short: the peers after the last score went unscored
            else:
                self.scored += 1
            log.debug(kv("loss scored", round=scoring.screening.round_id, scores=len(scores)))
            self.book.on_scores(scoring.screening, scores)
