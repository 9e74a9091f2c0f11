"""`SwarmOptimizer`: the swarm as a torch optimizer around yours (`hivemind.Optimizer`'s place).

    swarm = meshtrain.Swarm.join("/ip4/1.2.3.4/tcp/4001/p2p/12D3Koo...", data_dir="d")
    opt = meshtrain.SwarmOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), swarm, model=model)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10_000)   # schedulers take it
    with swarm:
        for batch in loader:
            model(**batch).loss.backward()
            opt.step()          # the inner step; every H steps the swarm's outer round
            sched.step()
            opt.zero_grad()

Problem. A training script already has an optimizer, maybe an LR scheduler, maybe Accelerate
around both. `DiLoCo(model, inner, swarm, H=...)` asks its author to name the swarm's algorithm
and copy its hyper-parameters out of the spec, and it is no `torch.optim.Optimizer`, so a
scheduler or a library that expects one refuses it. hivemind's answer is an optimizer that wraps
the user's and does the collaboration inside `step()`; this is ours.

Design. `SwarmOptimizer` *is* a `torch.optim.Optimizer` (schedulers check `isinstance`) that owns
no parameters of its own: `param_groups`, `state` and `defaults` are the inner optimizer's, so a
scheduler that sets `lr` sets the inner optimizer's. Inside it holds the outer optimizer the
swarm's spec names, built as every peer builds it (node/spec/outer.py `build_outer`: DiLoCo with
the spec's H, outer lr and momentum; a py: class of the swarm's own) over `model` and the inner
optimizer, with the swarm as its collective — so everything `meshtrain.Swarm` does for a loop
(the first step joins the swarm's state, resync, checkpoints in the swarm's data dir, the status
page) happens here too (node/user_loop.py). `step()` is that outer optimizer's step: the inner
step, then whatever round is due.

- `state_dict()`/`load_state_dict()` are the outer optimizer's (φ, outer optimizer, step counter,
  and the inner optimizer's state), so code that saves "the optimizer" (Accelerate's
  `save_state`, a `torch.save` of your own) saves all of it. The first `step()` still joins the
  swarm: the data dir's checkpoint, or the swarm's state when the swarm has moved on, replaces
  what `load_state_dict` restored before it, if there is one.
- Accelerate: prepare first, then wrap — `model, inner = accelerator.prepare(model, inner)`, then
  `SwarmOptimizer(inner, swarm, model=accelerator.unwrap_model(model))`. The prepared optimizer
  applies gradient scaling and, inside `accelerator.accumulate(model)`, steps only when the
  gradients are synced; a `step()` while they are not (`gradient_state.sync_gradients` False)
  is a micro-step: it steps nothing and counts no inner step, so H counts updates.
- torchrun: one peer per machine, rank 0 the gateway. Every rank builds its `SwarmOptimizer`
  over the same (unwrapped) model under DDP; rank 0 passes the `Swarm` it joined, the others
  None. The machine's Δ is reduced across the ranks, rank 0 exchanges it with the swarm, and
  every rank applies the same outcome; the state rank 0 joins or re-downloads reaches the
  others at the start of the step (integrations/ranks.py). `spec`, `swarm_step` and `peer_id`
  answer on every rank; ranks 1..N-1 call `close()` after their last step.

Failures. A spec this optimizer cannot serve, another `SwarmOptimizer` on the same swarm, or a
multi-rank script that hands the swarm to the wrong rank (or a sharded model, or SparseLoCo
across ranks) is a one-line `ConfigError` at construction. Round failures are the outer
optimizer's (optim/outer.py: a round without the swarm proceeds alone and resyncs).

Not here: data order (`swarm_step` after the first `step()` is the swarm's step: position your
loader with it), the HF Trainer (hf.py), FSDP-sharded models (the daemon's
`meshtrain node start --nproc-per-node N --sharding fsdp`, node/local_ranks.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from meshtrain.errors import ConfigError
from meshtrain.integrations.ranks import RankPeer
from meshtrain.node.spec.outer import build_outer
from meshtrain.node.spec.swarm import SwarmSpec
from meshtrain.node.user_loop import Swarm
from meshtrain.optim.outer import OuterOptimizer


class SwarmOptimizer(torch.optim.Optimizer):
    """Your optimizer, with the swarm's outer optimizer around it (module docstring).

    inner: the torch optimizer over `model`'s parameters (Accelerate's prepared one is fine).
    swarm: the `meshtrain.Swarm` this process is a peer of; one `SwarmOptimizer` per swarm.
    model: the module `inner` trains (unwrapped: its parameter names are the swarm's).

    `outer` is the spec's outer optimizer (`rounds`, `history`, `outer_params` φ, `stats()`);
    `swarm.step` is the swarm's inner step once the first `step()` joined it.
    """

    def __init__(self, inner: torch.optim.Optimizer, swarm: Swarm | None, *, model: torch.nn.Module) -> None:
        # No `super().__init__`: the parameters, their groups and their state are the inner
        # optimizer's (the properties below), not a copy a scheduler would update in vain.
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.inner = inner
        self.swarm = swarm
        self.ranks: RankPeer | None = None
        if distributed and torch.distributed.get_world_size() > 1:
            self.ranks = RankPeer(inner, swarm, model)  # rank 0 the gateway (integrations/ranks.py)
            self.outer: OuterOptimizer = self.ranks.outer
            self.spec: SwarmSpec = self.ranks.spec
        elif swarm is None:
            raise ConfigError("SwarmOptimizer: pass the Swarm this process is a peer of (None only on ranks 1..N-1)")
        else:
            self.outer = build_outer(swarm.spec, model, inner, swarm)
            self.spec = swarm.spec

    @property
    def swarm_step(self) -> int:
        """The swarm's inner step this peer is at, on every rank (after the first `step()` joined
        the swarm: position your data with it)."""
        return self.outer.inner_steps

    @property
    def peer_id(self) -> str:
        """This peer's id, on every rank (the swarm's data assignment names it)."""
        return self.outer.collective.peer_id

    def close(self) -> None:
        """Ranks 1..N-1 of a torchrun script: end this rank's part (its exchange in flight, its
        trio loop), after the last `step()`. Rank 0 and a single process leave with the Swarm;
        for them it does nothing."""
        if self.ranks is not None:
            self.ranks.close()

    # -- what torch (and schedulers) read of an optimizer: the inner one's -------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]  # torch: a plain attribute
        return self.inner.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ConfigError("SwarmOptimizer: the swarm's parameters are fixed when it is built; add groups before")

    # -- the loop's calls ------------------------------------------------------------------------

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """The inner step and, when due, the swarm's outer round (`closure`, if given, is called
        first for the loss, as torch optimizers do). Returns the closure's loss, or None."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not _gradients_synced(self.inner):
            return loss  # an Accelerate micro-step inside `accumulate`: no update, no inner step
        self.outer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The outer optimizer's state with the inner one's (bit-exact; between rounds)."""
        return self.outer.state_dict(inner=True)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.outer.load_state_dict(state_dict, inner=True)

    def __repr__(self) -> str:
        return f"SwarmOptimizer({type(self.outer).__name__}(H={self.outer.H}), inner={type(self.inner).__name__})"


def _gradients_synced(inner: torch.optim.Optimizer) -> bool:
    """False inside `accelerator.accumulate` between two syncs (Accelerate's prepared optimizer
    says so in its `gradient_state`); True for any other optimizer."""
    state = getattr(inner, "gradient_state", None)
    return state is None or bool(getattr(state, "sync_gradients", True))
