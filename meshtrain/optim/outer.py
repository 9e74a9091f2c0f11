"""`OuterOptimizer`: the public base class for low-communication outer optimizers.

What it is for. DiLoCo-style training runs an ordinary *inner* optimizer on every peer and, every
`H` inner steps, an *outer* step that brings the peers' parameters together: each peer sends what
it learned since the last round (the pseudo-gradient Δ = φ − θ, outer parameters minus local
ones), a `Collective` averages it, and an outer optimizer moves φ. This class owns everything
those algorithms share, so an algorithm is a few hooks:

    build_outer_optimizer(params)    a torch optimizer over φ (the default `apply` steps it)
    pseudo_gradient(names)           what a peer sends          default: Δ = φ − θ
    communicate(tensors, ...)        with whom, through the Collective   default: all-reduce
    apply(result, names)             the outer update of φ      default: grad = mean Δ, step
    merge(names)                     θ from the new φ           default: θ ← α·θ + (1−α)·φ (α=0: θ ← φ)

and inherits the outer-parameter snapshot φ (fp32), the codec, error feedback, state
(de)serialisation (bit-exact, for checkpoints and late joiners) and the round logic that calls
the hooks (the schedule: fragments and overlap; weights; the handling of a failed exchange; byte
accounting). It composes parts that each own their state and one job: the round logic
(`Exchanges`, outer_exchanges.py), the threading bridge and the timing of prepared rounds
(`TrioBridge`, `RoundPreparation`, outer_round.py) and the writing and loading of its state
(`OuterState`, outer_state.py); the grouped rounds' consensus term and error feedback are
functions of their own (group_consensus.py, error_feedback.py).

How the training loop calls it. The outer optimizer *wraps* the inner one: it is what the loop
steps, so the loop reads like ordinary torch.

    outer = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=4e-4), collective, H=500)

    def train():                                   # runs in a worker thread
        for x, y in batches:
            loss = model(x, y).loss
            outer.zero_grad(); loss.backward()
            outer.step()                           # inner step; every H steps also an outer round

    async with outer:                              # owns the tasks that overlap communication
        await trio.to_thread.run_sync(train)       # torch off the trio thread: networking flows
        await outer.afinish()                      # merge exchanges still in flight

Devices. θ, its gradients and the inner optimizer live wherever the model is (a GPU); φ, the
outer optimizer's state and every registered buffer live on the host in fp32 — pinned memory when
the model is on a CUDA device, never for a model on the CPU — so the collective, checkpoints and state sync only ever see host tensors, and
GPU memory holds one copy of the model, not three. Δ = φ − θ is computed on the device (φ is
copied up without blocking) and copied back to the host once per round, all tensors queued
before one wait; with τ >= 1 that round's exchange then overlaps with the next inner steps
(Streaming DiLoCo). The merge copies φ back into θ (host to device).

Grouped rounds. When the collective runs a round in groups smaller than the swarm (`GroupsRounds`:
a `SwarmCollective` with the spec's `group_size`, collective/groups.py), averaging Δ alone lets
the groups' φ random-walk apart. So the default `communicate` also averages φ in the group, in
fp16, and hands `apply` Δ̄ + (φ_i − φ̄) = φ_i − mean θ: NoLoCo's consensus term with γ = β, FedAvg
within each group at outer lr 1 and momentum 0 (optim/group_consensus.py: the problem, the cost,
what a failure leaves). A subclass that overrides `communicate` (SparseLoCo) does without.

Built from a swarm spec. The node builds every outer optimizer a spec names, built-in or a
`py:` class of the swarm's own, with `Class.from_spec(model, inner, collective, spec)` (node/spec/
outer.py), where `spec` is the swarm spec's `outer` section (`OuterSection`, optim/spec_section.py);
the default reads only `spec.H`. What the spec's checks must know of an algorithm —
its own defaults for spec keys, whether its rounds may run in groups, whether a robust
aggregation rule can combine its exchange — each class declares as class attributes (the class
docstring), and the spec's checks read them from the built-in classes (`BUILTIN_OPTIMIZERS`,
optim/__init__.py; `declared`, optim/spec_section.py). `OuterSpec` lists the fields the built-in
`from_spec`s read (`OuterSection` has them): this module does not import the section, which
imports `BUILTIN_OPTIMIZERS`.

Late joiners. `join(state)` loads a peer's `state_dict` (φ, outer optimizer state, step counter),
sets θ ← φ, and keeps the inner optimizer fresh (inner state is never averaged or shared,
docs/algorithms.md) — but seeded, where its caller passes the donors' `moments`, with their mean
second moments and step count, so its steps start at the swarm's scale (optim/inner_moments.py);
with `at_step` it enters the round the swarm is in (outer_exchanges.py, "Joiners enter at a
step"). Until it has done a full H steps of its own, and at least `JOIN_WARMUP_STEPS` (a fresh
inner optimizer's first steps are larger than a trained one's: in a short round they would make
the veterans the outliers that screening flags), it contributes weight 0 to every all-reduce
(prime's live recovery: docs/algorithms.md, DiLoCo) but still receives the average, so its φ
and outer state stay identical to everyone else's.

The round logic and the schedule. Each `step()` runs that step's rounds: `Exchanges.advance`
(outer_exchanges.py) decides what is due, does the tensor work and yields the async calls it
needs, which the `TrioBridge` (outer_round.py) runs on the trio side. Fragment p of P is sent
every H inner steps at its offset p·H/P, and with `delay` τ >= 1 merged τ steps later while the
exchange overlaps training (Streaming DiLoCo; requires H % P == 0 and τ < H/P, `RoundSchedule`,
optim/schedule.py). Every completed exchange is counted (`rounds`, bytes, waits) and kept as a
`RoundReport` in `history`.

Swarm pace (the spec's `pace`). A peer that is behind the swarm — a slower GPU — may `skip()`
inner steps instead of training them: the step counter and the round logic advance as `step()`
advances them, without an inner step, so the peer reaches the swarm's round when the others do
instead of holding it (or missing it and re-syncing). Each fragment's exchange then weighs the
share of the steps since its last send that the peer trained (outer_exchanges.py, "Weights").
Who decides to skip, and when, is the caller's (node/pace.py). An optimizer whose exchange does
not weigh contributions, or where a skipped step is a round (dp), says so in `unpaced_reason`.

State lent out. `state_dict(copy=False)` hands out the live φ and outer state, no copy: a
checkpoint written at once, or the node's state donor serving joiners (node/state/run_state.py)
until the next round. They change in place only when a round completes (`apply`, `merge`) or a
state is loaded, so `before_state_change` (async callables, run on the trio side by the driver
of the round, before the round's `apply`) is where a borrower gives them back — copies them if
it still needs them (copy-on-write) or stops reading them. `load_state_dict`/`join` are the
caller's to announce (they run where the caller runs).

Memory. A round's buffers (Δ, the collective's, the averaged result) live while the model's
gradients would otherwise still be held: the inner step has spent them, and the loop's next
`zero_grad`/backward replaces them. So on a step that runs a round (sends or merges an exchange)
`step()` drops them after the inner step (`p.grad = None`, as `zero_grad()` leaves them): a
round's peak is 4 B/param (fp32 gradients) lower than with them held (scripts/bench/bench_memory.py,
docs/benchmarks.md "Memory"). A loop that reads gradients after `step()` finds None on those steps.

Step hooks. `step_hooks` are called with the optimizer at the start of every `step()`, in the
caller's thread; a collective that `WatchesOptimizer` (`meshtrain.Swarm`, for a loop you write
yourself) is told of the optimizer at the end of `__init__` and installs its hook there. With no
hook the list costs one empty loop per step.

Failures. The collective already averages over the survivors when a peer dies mid-round. If
*this* peer could not take part at all (`CollectiveError`: cut off, or late for the group), it
proceeds alone — its own Δ is applied as a group of one — so training never stops, and
`needs_resync` is set: its φ and outer state now differ from the swarm's, and the node should
download the swarm's state (`join`).

Not here: what is due at a step, an exchange's weight, and what completing one does
(outer_exchanges.py); how a round's calls reach the trio side, and when a round's group is formed
ahead of it (outer_round.py); the schedule's formula and rules (schedule.py); how a state is
written, loaded and checked (outer_state.py); which peers are in a round (the collective's
membership), data, checkpoint files.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, contextmanager
from typing import Any, ClassVar, Protocol, Self

import torch

from meshtrain.collective.contract import (
    Collective,
    GroupsRounds,
    PreparesRounds,
    ReduceResult,
    RoundRequest,
    WatchesOptimizer,
)
from meshtrain.lifecycle import Service
from meshtrain.optim.error_feedback import codec_round_trip, feed_back_into
from meshtrain.optim.group_consensus import group_consensus
from meshtrain.optim.inner_moments import InnerMoments
from meshtrain.optim.outer_exchanges import Exchanges
from meshtrain.optim.outer_round import RoundReport, TrioBridge
from meshtrain.optim.outer_state import (
    STATE_FORMAT,
    OuterState,
    OuterStateError,
    StaleStateError,
    StateLayout,
    fragment_partition,
    host_copy,
    synchronize,
)
from meshtrain.optim.schedule import RoundSchedule

__all__ = [
    "HISTORY_LENGTH",
    "JOIN_WARMUP_STEPS",
    "STATE_FORMAT",
    "OuterOptimizer",
    "OuterSpec",
    "OuterStateError",
    "RoundReport",
    "StaleStateError",
]

HISTORY_LENGTH = 4096  # round reports kept in memory
# A joiner's weight-0 period lasts at least this many inner steps, even where H is shorter. Its
# inner optimizer is fresh, and a fresh AdamW's first steps are larger than a trained one's (its
# second moment lacks the larger gradients of earlier training that a veteran's still holds):
# on gpt-tiny at step 272 (scripts/studies/joiner_step_sizes.py), a veteran's Δ over 2 steps was
# 0.33-0.43 of a fresh joiner's per fifth of the model, 0.51-0.61 at 10 steps, 0.65-0.82 at 20. In a
# short round the joiners' Δ is then several times the veteran's, and a robust swarm's screening
# flags the veteran, the outlier among fresh joiners: a grouped daemon swarm of H = 2 saw its
# creator excluded by strikes when four daemons joined it (norm ratios 0.09-0.25). A creator that
# ran DiLoCo rounds alone is further off (0.13-0.43 at 20 steps): a node now seeds its joiner's
# AdamW with the donors' second moments (optim/inner_moments.py: 0.77-1.04 at 20 steps), and
# the warm-up stays for what seeding leaves out (first moments, per-coordinate spread).
JOIN_WARMUP_STEPS = 20


class OuterSpec(Protocol):
    """The fields of a swarm spec's `outer` section (`OuterSection`, optim/spec_section.py) that the
    built-in optimizers' `from_spec` read; the section is passed as it is, not converted."""

    @property
    def H(self) -> int: ...
    @property
    def outer_lr(self) -> float: ...
    @property
    def outer_momentum(self) -> float: ...
    @property
    def noloco_outer(self) -> bool: ...
    @property
    def codec(self) -> str: ...
    @property
    def fragments(self) -> int: ...
    @property
    def delay(self) -> int: ...
    @property
    def alpha(self) -> float: ...
    @property
    def eager(self) -> bool: ...
    @property
    def error_decay(self) -> float: ...
    @property
    def sparse_chunk(self) -> int: ...
    @property
    def sparse_k(self) -> int: ...


class OuterOptimizer(Service):
    """Base class of outer optimizers. Subclasses override hooks (module docstring).

    Class attributes, part of the API for an optimizer of your own (the built-in ones set theirs):

    `replicas_identical` (default True): every peer holds the same φ after the
    same round, which the node checks continuously (node/state/parity.py). An optimizer whose replicas
    differ by design (NoLoCo's pairwise gossip) sets it False.
    `join_warmup_steps` (default `JOIN_WARMUP_STEPS`): a joiner's weight-0 period lasts at least
    this many of its own inner steps (and at least H): its inner optimizer starts fresh. An
    optimizer whose joiner downloads the inner state too (dp) sets 0.

    What a swarm spec that names the optimizer may say (node/spec/swarm.py reads these of the
    built-in classes; a spec naming a `py:` class is checked before, and without, its code being
    loaded — a spec may come from the network — so with the defaults here, whatever the class says):
    `spec_defaults` (default none): spec keys (flat names, of any section) whose default differs for this optimizer, and their
        value; a spec that names it and not the key gets the value written in (so it is part of
        the swarm id). `{"H": 1}`: this optimizer's spec has H = 1 unless it says otherwise.
    `ungrouped_reason` (default None: rounds may run in groups, `group_size`): why its rounds
        never run in groups; a spec that sets `group_size` is refused with it.
    `dense_all_reduce` (default False): its exchange is an all-reduce of dense contributions, so
        a swarm open to strangers combines them robustly (trimmed_mean) unless the spec says
        otherwise; False: the mean unless the spec names a rule.
    `not_robust_reason` (default None: the spec may name a robust rule): why no robust aggregation
        rule can combine its exchange; a spec whose `aggregation` is not mean is refused with it.
    `unpaced_reason` (default None: a slow peer may skip steps, the spec's `pace` "swarm"): why
        its peers must train every step; a spec with pace "swarm" is refused with it.
    `spec_keys` (default None: any): the keys of the spec's `outer` section its `from_spec` reads
        beyond those every optimizer's trainer reads (`H`, the inner AdamW's, `group_size`); a spec
        written now that gives another of `OPTIMIZER_KEYS` a value other than its default is
        refused (it would do nothing). None for a `py:` class: its `from_spec` may read any.
    `check_spec(spec)` (default: nothing to check): the rules its hyper-parameters in the spec's
        `outer` section must keep (Streaming DiLoCo's schedule, dp's H = 1); a `ValueError` says
        which, and the spec is refused with it.

    `from_spec(model, inner, collective, spec)`: how the node builds it from the spec's `outer`
    section (`OuterSpec`); the default is `cls(model, inner, collective, H=spec.H)`. Define it to
    read more of the section.

    model: the module trained in place; its trainable parameters (`requires_grad`) are θ.
    inner: the inner torch optimizer over `model`'s parameters, stepped by `step()`; None if the
        caller steps it itself (then call `step()` right after the inner step).
    collective: averages among peers (`SwarmCollective` on a swarm, `LocalSwarm` in-process).
    H: inner steps between two syncs of a fragment.
    codec: compression of what is exchanged (`compression.CODECS`): "none", "fp16", "fp4", ...
    fragments: a partition of the parameter names into P lists (None: one fragment).
    delay: τ, inner steps the exchange of a fragment overlaps with (0 = blocking).
    alpha: merge weight of the local parameters at s + τ (θ ← α·θ + (1−α)·φ).
    """

    replicas_identical = True
    join_warmup_steps: ClassVar[int] = JOIN_WARMUP_STEPS
    spec_defaults: ClassVar[Mapping[str, Any]] = {}
    ungrouped_reason: ClassVar[str | None] = None
    dense_all_reduce: ClassVar[bool] = False
    not_robust_reason: ClassVar[str | None] = None
    unpaced_reason: ClassVar[str | None] = None
    spec_keys: ClassVar[frozenset[str] | None] = None

    @classmethod
    def check_spec(cls, spec: OuterSpec) -> None:
        """The rules `spec` must keep for this optimizer (the class docstring); `ValueError` if not."""

    @classmethod
    def from_spec(
        cls, model: torch.nn.Module, inner: torch.optim.Optimizer | None, collective: Collective, spec: OuterSpec
    ) -> Self:
        """This optimizer as the swarm's spec configures it (the class docstring)."""
        return cls(model, inner, collective, H=spec.H)

    def __init__(
        self,
        model: torch.nn.Module,
        inner: torch.optim.Optimizer | None,
        collective: Collective,
        *,
        H: int,
        codec: str = "none",
        fragments: Sequence[Sequence[str]] | None = None,
        delay: int = 0,
        alpha: float = 0.0,
    ) -> None:
        RoundSchedule(H)  # H's own rule first, before the model is looked at
        self.model = model
        self.inner = inner
        self.collective = collective
        self.codec = codec
        self.params: dict[str, torch.nn.Parameter] = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        self.fragments = fragment_partition(list(self.params), fragments)
        self.schedule = RoundSchedule(H, len(self.fragments), delay)
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
        self.alpha = float(alpha)
        # φ: the outer parameters, fp32 whatever the model's dtype ("accumulate in fp32"), on the
        # host whatever the model's device (module docstring, "Devices").
        self.outer_params: dict[str, torch.Tensor] = {n: host_copy(p) for n, p in self.params.items()}
        self._outer_optimizer: torch.optim.Optimizer | None = None
        self._outer_optimizer_built = False
        self.outer_state = OuterState(self)  # writes and loads the state (optim/outer_state.py)
        self.inner_steps = 0  # the swarm's step counter (a joiner loads it)
        self.rounds = 0  # exchanges completed (all fragments)
        self.needs_resync = False
        self.state_loads = 0  # states loaded so far (`load_state_dict`, and `join` through it)
        self.skipped_steps = 0  # steps skipped to keep the swarm's pace (`skip`), in this process
        # the round logic, the exchanges in flight and a joiner's warm-up (optim/outer_exchanges.py)
        self.exchanges = Exchanges(self, self.schedule)
        self._bridge = TrioBridge(type(self).__name__, self.schedule.delay)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.peak_bytes_per_sync = 0
        self.comm_wait_seconds = 0.0
        self.history: deque[RoundReport] = deque(maxlen=HISTORY_LENGTH)
        # Error feedback (SparseLoCo's accumulator; any optimizer may keep one): β, or None for none;
        # e per parameter, this peer's alone.
        self.error_feedback: float | None = None
        self.residual: dict[str, torch.Tensor] = {}
        # Called with this optimizer at the start of every `step()`, in the caller's thread
        # (`meshtrain.Swarm` runs the swarm's side of a user's own loop there).
        self.step_hooks: list[Callable[[OuterOptimizer], None]] = []
        # Awaited on the trio side before a round changes φ or the outer state in place (module
        # docstring, "State lent out").
        self.before_state_change: list[Callable[[], Awaitable[None]]] = []
        if isinstance(collective, WatchesOptimizer):
            collective.watch(self)

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer | None:
        """The torch optimizer over φ from `build_outer_optimizer`, built on first use (so a
        subclass may set its hyper-parameters after `super().__init__`)."""
        if not self._outer_optimizer_built:
            self._outer_optimizer = self.build_outer_optimizer(list(self.outer_params.values()))
            self._outer_optimizer_built = True
        return self._outer_optimizer

    # -- hooks ---------------------------------------------------------------------------------

    def build_outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer | None:
        """A torch optimizer over φ (`params`, in `outer_params` order), or None if `apply` is
        written by hand. Its state is part of `state_dict`."""
        return None

    def pseudo_gradient(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Δ = φ − θ for `names` (DiLoCo's sign: it points from where we went back to where we
        started, so descending on it moves φ toward θ). Runs in the trainer's thread.

        The tensors are views of one flat fp32 host buffer, in `names` order: the collective
        takes that as its flat input without copying it (collective/flat.py `flat_view`)."""
        return self.deltas_into(self.host_buffer(names), names)

    def host_buffer(self, names: Sequence[str], copies: int = 1) -> torch.Tensor:
        """An uninitialised flat fp32 host vector for `copies` × the elements of `names` (pinned
        when θ is on a CUDA device, so the copies into it are non_blocking)."""
        pinned = any(self.params[n].is_cuda for n in names)
        numel = sum(self.outer_params[n].numel() for n in names)
        return torch.empty(copies * numel, dtype=torch.float32, device="cpu", pin_memory=pinned)

    def deltas_into(self, flat: torch.Tensor, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Δ for `names`, written into the start of `flat` in order; the views, by name."""
        out, device, pos = {}, None, 0
        for n in names:
            theta, phi = self.params[n].detach(), self.outer_params[n]
            view = flat[pos : pos + phi.numel()].view(phi.shape)
            pos += phi.numel()
            if theta.device == phi.device:
                out[n] = torch.sub(phi, theta.to(torch.float32), out=view)
                continue
            # On the device, then one copy to the (pinned) host per tensor, all queued before the
            # single wait below: the copies overlap with each other and with queued compute.
            delta = phi.to(theta.device, non_blocking=True) - theta.to(torch.float32)
            out[n] = view.copy_(delta, non_blocking=True)
            device = theta.device
        if device is not None:
            synchronize(device)
        return out

    async def communicate(
        self, tensors: dict[str, torch.Tensor], *, round_id: int, tag: str, weight: float
    ) -> ReduceResult:
        """Average `tensors` with the other peers: by default an all-reduce over the round's group
        (in a grouped round, with the consensus term: module docstring, "Grouped rounds").
        Runs on the trio side; must not touch the model (training may be running)."""
        result = await self.collective.all_reduce(RoundRequest(tensors, round_id, tag, self.codec, weight))
        if isinstance(self.collective, GroupsRounds) and self.collective.round_is_grouped(round_id):
            result = await self.with_group_consensus(result, round_id=round_id, tag=tag)
        return result

    @property
    def prepares_rounds(self) -> bool:
        """Whether this optimizer lets its collective form a round's group ahead of the round
        (outer_round.py, "Prepared rounds"): only with the default `communicate` — one all-reduce
        per exchange under the exchange's tag — and a collective that `PreparesRounds`."""
        return type(self).communicate is OuterOptimizer.communicate and isinstance(self.collective, PreparesRounds)

    async def prepare(self, *, round_id: int, tag: str, within: float) -> None:
        """Trio side: have the collective send the join of exchange `round_id`/`tag`, due in
        about `within` seconds, now (contract.py `PreparesRounds`)."""
        assert isinstance(self.collective, PreparesRounds)  # checked by `prepares_rounds`
        await self.collective.prepare(round_id=round_id, tag=tag, within=within)

    async def unprepare(self, *, round_id: int, tag: str) -> None:
        """Trio side: exchange `round_id`/`tag`, prepared, will not run (training ended)."""
        assert isinstance(self.collective, PreparesRounds)  # it prepared the exchange
        await self.collective.unprepare(round_id=round_id, tag=tag)

    async def with_group_consensus(self, result: ReduceResult, *, round_id: int, tag: str) -> ReduceResult:
        """`result` (the group's Δ̄) plus φ_i − φ̄, φ̄ averaged over the group in fp16
        (optim/group_consensus.py). φ of these names is not written while their exchange is in
        flight (only `apply` writes it)."""
        return await group_consensus(self.collective, self.outer_params, result, round_id=round_id, tag=tag)

    def apply(self, result: ReduceResult, names: Sequence[str]) -> None:
        """Update φ[names] from the averaged `result`. Default: the outer optimizer's step with
        grad = mean Δ (torch semantics, so SGD(nesterov) is docs/algorithms.md's DiLoCo rule)."""
        opt = self.outer_optimizer
        if opt is None:
            raise NotImplementedError(f"{type(self).__name__} must override apply() or build_outer_optimizer()")
        for n in names:
            self.outer_params[n].grad = result.tensors[n].to(torch.float32)
        opt.step()
        for n in names:
            self.outer_params[n].grad = None

    def merge(self, names: Sequence[str]) -> None:
        """θ[names] from the new φ: θ ← φ, or with α > 0 the Streaming DiLoCo merge
        θ ← α·θ + (1−α)·φ (paper §2.2; torchft's `lerp`)."""
        for n in names:
            p, phi = self.params[n], self.outer_params[n]
            if self.alpha == 0.0:
                p.copy_(phi)
            else:
                p.lerp_(phi.to(p.device, p.dtype), 1.0 - self.alpha)

    # -- error feedback (optim/error_feedback.py): `error_feedback = β`, e in `residual` ---------

    def compress(
        self, accumulated: dict[str, torch.Tensor], names: Sequence[str]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(what `communicate` sends, what it decodes to) for the accumulator e[names]. Default:
        `self.codec` applied to each tensor whole (`codec_round_trip`); SparseLoCo overrides this
        to send its sparse payload itself."""
        return codec_round_trip(self.codec, accumulated)

    def feed_back(self, delta: dict[str, torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
        """e ← β·e + Δ; (send, ŝ) = compress(e); e ← e − ŝ; returns `send`. Runs in the trainer's thread."""
        return feed_back_into(self.residual, self.error_feedback, delta, names, self.compress, self.outer_params)

    # -- the training loop ---------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.inner is not None:
            self.inner.zero_grad(set_to_none=set_to_none)
        else:
            self.model.zero_grad(set_to_none=set_to_none)

    def step(self) -> list[RoundReport]:
        """The inner step, then whatever the schedule says is due. Call from a worker thread
        (not from the trio thread: use `astep` there). Returns the exchanges completed."""
        for hook in self.step_hooks:
            hook(self)
        self._inner_step()
        return self._bridge.run_from_thread(self.exchanges.advance())

    async def astep(self) -> list[RoundReport]:
        """`step()` for code running in trio (tensor work runs inline in the trio thread)."""
        self._inner_step()
        return await self._bridge.run_async(self.exchanges.advance())

    def _inner_step(self) -> None:
        """The inner optimizer's step; before a step that runs a round, its gradients are dropped
        (module docstring, "Memory")."""
        if self.inner is None:
            return
        self.inner.step()
        merges, sends = self.due(self.inner_steps + 1)
        if merges or sends:
            self.inner.zero_grad(set_to_none=True)

    def skip(self) -> list[RoundReport]:
        """Advance one inner step without training it, to keep the swarm's pace (module
        docstring, "Swarm pace"): the rounds due run as at `step()`; the step's batch is not
        trained, and the fragments' next exchanges weigh one step less. From a worker thread."""
        return self._bridge.run_from_thread(self.exchanges.advance(trained=False))

    async def askip(self) -> list[RoundReport]:
        """`skip()` for code running in trio."""
        return await self._bridge.run_async(self.exchanges.advance(trained=False))

    def finish(self) -> list[RoundReport]:
        """Wait for exchanges still in flight and merge them (end of training; from a thread)."""
        return self._bridge.run_from_thread(self.exchanges.flush())

    async def afinish(self) -> list[RoundReport]:
        return await self._bridge.run_async(self.exchanges.flush())

    async def _start(self, stack: AsyncExitStack) -> None:
        # Leaving cancels exchanges still in flight (call `afinish()` first to keep them): the
        # bridge's nursery closes first, then they are forgotten.
        stack.callback(self.exchanges.pending.clear)
        await stack.enter_async_context(self._bridge)

    @property
    def in_flight(self) -> bool:
        return self.exchanges.in_flight

    def pending_merges(self) -> dict[int, int]:
        """fragment -> the inner step at which its exchange in flight is merged."""
        return {p: ex.merge_step for p, ex in self.exchanges.pending.items()}

    @property
    def H(self) -> int:
        """Inner steps between two syncs of a fragment."""
        return self.schedule.H

    @property
    def delay(self) -> int:
        """τ: inner steps an exchange overlaps with (0: blocking)."""
        return self.schedule.delay

    def next_send_step(self, step: int) -> int:
        """The first inner step after `step` at which some fragment is sent."""
        return self.schedule.next_send_step(step)

    def due(self, step: int) -> tuple[list[int], list[int]]:
        """(fragments to merge, fragments to send) at inner step `step`."""
        return self.exchanges.due(step)

    def sends_at(self, step: int) -> list[int]:
        """The fragments sent at inner step `step`: the schedule alone (safe to call from another
        thread while the trainer's runs, unlike `due`, which reads the exchanges in flight)."""
        return self.schedule.sends_at(step)

    # -- state a subclass keeps (serialised with the rest) ------------------------------------

    def register_buffers(
        self, name: str, init: Callable[[torch.Tensor], torch.Tensor] = torch.zeros_like
    ) -> dict[str, torch.Tensor]:
        """Per-parameter tensors (e.g. a momentum) that `state_dict` saves and `load_state_dict`
        restores bit-exactly. Returns the dict, keyed like `outer_params`."""
        buf = {n: init(phi) for n, phi in self.outer_params.items()}
        self.outer_state.buffers[name] = buf
        return buf

    @contextmanager
    def outer_weights(self) -> Iterator[None]:
        """Temporarily put φ into the model (evaluate the outer parameters, not a replica —
        Streaming DiLoCo §3); θ is restored on exit. Do not train inside."""
        saved = {n: p.detach().clone() for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.outer_params[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(saved[n])

    def stats(self) -> dict[str, Any]:
        return {
            "inner_steps": self.inner_steps,
            "rounds": self.rounds,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "peak_bytes_per_sync": self.peak_bytes_per_sync,
            "comm_wait_seconds": self.comm_wait_seconds,
            "needs_resync": self.needs_resync,
            "skipped_steps": self.skipped_steps,
        }

    def blocked_on(self) -> tuple[str, float] | None:
        """What the caller's training thread waits on in `step()` now, in words, and for how many
        seconds; None when it does not wait (any thread: status pages)."""
        awaiting = self._bridge.awaiting
        return None if awaiting is None else (awaiting[0], time.monotonic() - awaiting[1])

    # -- state (written and loaded by `OuterState`, optim/outer_state.py) -----------------------

    def state_dict(self, *, inner: bool = True, copy: bool = True) -> dict[str, Any]:
        """Everything needed to continue: φ, the outer optimizer, registered buffers, counters,
        and (with `inner`) the inner optimizer's state; bit-exact. Tensors are copies, or with
        `copy=False` the live tensors themselves (no memory: for a checkpoint written at once, or
        a state lent to joiners until the next round — `before_state_change`); the caller must
        not write them. A subclass that overrides this takes `copy` too."""
        return self.outer_state.write(inner=inner, copy=copy)

    def load_state_dict(self, state: dict[str, Any], *, inner: bool = True) -> None:
        """Restore `state_dict()` output (a checkpoint of this or another peer). Does not touch the
        model's parameters θ — restore those from the model checkpoint, or use `join`."""
        self.outer_state.load(state, inner=inner)
        self.exchanges.count_from(self.inner_steps, self.skipped_steps)  # weights counted afresh
        self.state_loads += 1

    def inner_moments(self) -> InnerMoments | None:
        """Our inner optimizer described for joiners (optim/inner_moments.py); None where it keeps
        no Adam moments. Call between steps (the trainer's thread, or while it is stopped)."""
        return InnerMoments.of(self.inner, self.params)

    def join(self, state: dict[str, Any], *, at_step: int | None = None, moments: InnerMoments | None = None) -> None:
        """Late joiner: take the swarm's outer state from a peer's `state_dict`, set θ ← φ, keep a
        fresh inner optimizer — its moments seeded from the donors' `moments` where it has none yet
        (optim/inner_moments.py) —, and contribute weight 0 until H steps of our own are done.

        `at_step`: the swarm's inner step now, if it is already past the state's (the state is
        the last completed round, the swarm is inside the next one). We jump our step counter
        there (`entry_step`: outer_exchanges.py, "Joiners enter at a step") and enter the swarm's
        next exchange with it; `StaleStateError` if the state is a round old."""
        if at_step is not None:  # refused before anything changes: a stale state leaves ours as it was
            self.state_layout().check(state)
            at_step = self.entry_step(int(state["inner_steps"]), at_step)
        self.load_state_dict(state, inner=False)
        if at_step is not None:
            self.inner_steps = at_step
            self.exchanges.count_from(at_step, self.skipped_steps)
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.outer_params[n])
        self.exchanges.joined_at = self.inner_steps
        if moments is not None:
            moments.seed(self.inner, self.params)
        self.needs_resync = False
        self.residual = {}  # error feedback starts afresh: no one's residual travels with a state

    def entry_step(self, state_step: int, at_step: int) -> int:
        """The step a joiner enters at with a state from inner step `state_step` while the swarm
        is at `at_step` (`join`'s rule); `StaleStateError` if that state is a round old. A node
        asks this of a state's manifest before downloading its bytes (node/state/download.py)."""
        return self.exchanges.entry_step(state_step, at_step)

    def state_layout(self) -> StateLayout:
        """What a state must match to be loaded here (optim/outer_state.py)."""
        return self.outer_state.layout()
