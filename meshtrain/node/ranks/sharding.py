"""FSDP2 inside a multi-rank peer: local ranks that each hold a shard of one model, for models
whose parameters, gradients and optimizer state do not fit on one device.

The problem. Under DDP (node/local_ranks.py) every local rank holds the whole model, its
gradients and AdamW's two moments: 16 bytes per parameter on every GPU. A 7B model does not fit
an 80 GB GPU that way. torch's FSDP2 (`torch.distributed.fsdp.fully_shard`) splits every
parameter, gradient and optimizer moment across the ranks, gathering a block's parameters only
while it computes. The outer optimizer, though, works on whole tensors: Δ = φ − θ, an exchange
with the swarm, a new φ, θ ← φ.

Design: a *gather-scatter peer* (the FSDP variant of the gateway-reduced peer).
- Choice (`choose_sharding`): node config `sharding = "ddp" | "fsdp" | "auto"` (`--sharding`).
  "auto" is FSDP when the model's training bytes (`TRAINING_BYTES_PER_PARAM`: fp32 θ, its
  gradient, AdamW's two moments) exceed `AUTO_FSDP_FRACTION` of one device's memory, DDP
  otherwise; on a CPU (no device memory to run out of) "auto" is DDP. Rank 0 decides and tells
  the others with the spec, so every rank shards alike.
- Sharding (`shard_model`): every module held in a `ModuleList` (transformer blocks: GPT's
  `blocks`, Hugging Face's `layers` / `h`) is one FSDP unit, the root the last; the mesh is the
  peer's N ranks, gloo on CPU, NCCL on GPU. Parameter names do not change, so the sharded model,
  a single-rank model and a checkpoint all use the same names. The inner AdamW is built over the
  sharded parameters: its moments stay sharded (1/N per rank) all the time.
- One outer optimizer, on rank 0, over a host *replica*: an unsharded fp32 copy of the model on
  rank 0's host memory, never trained. Under DDP every rank has an outer optimizer and the ranks
  reduce their (identical) Δ; under FSDP the ranks hold shards of one θ, not N replicas, so the
  reduce inside the machine becomes a gather: when a round is due (a fragment to send or to
  merge: `due(step)`), every rank takes part in `pull` — `get_model_state_dict(full_state_dict,
  cpu_offload)`, which all-gathers one tensor at a time and keeps the full copy on rank 0 only —
  into the replica; rank 0's outer optimizer then runs the round on the replica as on any model
  (Δ = φ − θ, the swarm's exchange through its real collective, the outer step, the merge
  θ ← φ); and every rank takes part in `push` — `set_model_state_dict(full_state_dict,
  broadcast_from_rank0)`, rank 0 sending each rank its shard of the new θ ("broadcast φ").
  Between rounds the only cost is FSDP's own: the steps are the user's loop plus a counter.
- The other ranks hold no outer state at all: a `RoundClock` stands in for the outer optimizer.
  It knows the schedule (H, fragment offsets, delay τ, from rank 0's first message) and counts
  steps, so every rank reaches each pull and push at the same step without a message. Rank 0's
  decision to stop or to re-sync reaches them through the group's every-`REPORT_EVERY` (and
  after-every-round) agreement.
- State between runs: the replica is the peer's θ whenever training is not running. At every
  `Trainer.run` rank 0 sends the clock (step, rounds, exchanges in flight) and, after a resume,
  the full inner state; then `push` puts the replica's θ into the shards and each rank cuts its
  own shard of the inner state (`distribute_tensor`, no communication). At the end of a run,
  and after every round, the ranks `pull` θ and gather the inner state (DTensor `full_tensor`)
  to rank 0: its *snapshot*.
- Checkpoints hold full state, in the single-rank format: the replica's θ, the outer state and
  the snapshot's inner state (AdamW's state dict with whole tensors), taken where the snapshot
  was (the last round or the end of a run: a periodic checkpoint of an FSDP peer is its state at
  its last round). So a peer resumes with any rank count and any sharding — a 2-rank FSDP
  checkpoint resumes as one rank, on DDP, or as 4 FSDP ranks, and the other way round.

Costs. Rank 0's host holds θ (the replica), φ, the outer optimizer's state and the inner
snapshot (2×): about 5× the fp32 model, plus what the outer optimizer keeps. Each round moves
the model to rank 0 and back over the machine's links (and the inner state to rank 0 once), on
top of the swarm's exchange. A late joiner's download and a resume land in the replica and reach
the shards at the next run. Evaluation of φ runs on rank 0's replica, on its host.

Failures: as under DDP (node/local_ranks.py) — a rank that dies breaks the process group and
every other rank's pending collective fails at once; a rank never waits on a round alone
because the clock, not a message, says when rounds are.

Not here: mixed DDP/FSDP meshes (HSDP), CPU offload of the shards, FSDP across machines, and
sharded (rather than full) checkpoints: a full state on rank 0 must fit its host memory.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from meshtrain.errors import ConfigError
from meshtrain.optim.schedule import RoundSchedule

SHARDINGS = ("ddp", "fsdp", "auto")
AUTO_FSDP_FRACTION = 0.5  # of one device's memory; the rest is for activations
TRAINING_BYTES_PER_PARAM = 16  # fp32 θ + its gradient + AdamW's exp_avg and exp_avg_sq


def choose_sharding(mode: str, model: torch.nn.Module, device: torch.device) -> str:
    """ "ddp" or "fsdp" for `mode` ("ddp", "fsdp" or "auto") and this model on `device`."""
    if mode not in SHARDINGS:
        raise ConfigError(f"sharding must be one of {', '.join(SHARDINGS)}, got {mode!r}")
    if mode != "auto":
        return mode
    if device.type != "cuda":
        return "ddp"
    need = TRAINING_BYTES_PER_PARAM * sum(p.numel() for p in model.parameters())
    return "fsdp" if need > AUTO_FSDP_FRACTION * torch.cuda.get_device_properties(device).total_memory else "ddp"


def shard_model(model: torch.nn.Module, device: torch.device, world_size: int) -> torch.nn.Module:
    """`model` under FSDP2 over the peer's `world_size` ranks (in place; returned): every module
    held in a ModuleList is a unit, children before parents, then the root. Its shards end on
    `device`."""
    # torch.distributed's FSDP, DTensor and checkpoint modules are imported where they are used:
    # together they take half a second (sympy), and every daemon imports this module.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    units = [m for ml in model.modules() if isinstance(ml, torch.nn.ModuleList) for m in ml]
    for unit in reversed(units):  # pre-order reversed: a nested unit is sharded before its parent
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class RoundClock:
    """A non-gateway rank's stand-in for the outer optimizer under FSDP: the step counter, the
    round schedule and nothing else (rank 0's outer optimizer holds φ). Its `due` agrees with
    rank 0's `OuterOptimizer.due` step for step, so every rank pulls and pushes together.

    H: inner steps per round. fragments: P. delay: τ (a fragment sent at s is merged at s + τ).
    """

    replicas_identical = True

    def __init__(self, H: int, fragments: int, delay: int) -> None:
        self.schedule = RoundSchedule(H, fragments, delay)
        self.inner_steps = 0
        self.rounds = 0
        self.needs_resync = False  # rank 0's decides: it stops the group's run
        self.history: tuple = ()  # the rounds' reports are rank 0's optimizer's: none here
        self._merges: dict[int, int] = {}  # fragment -> the step it is merged at

    @property
    def H(self) -> int:
        return self.schedule.H

    @property
    def delay(self) -> int:
        return self.schedule.delay

    @property
    def in_flight(self) -> bool:
        return bool(self._merges)

    def due(self, step: int) -> tuple[list[int], list[int]]:
        merges = sorted(p for p, at in self._merges.items() if at <= step)
        return merges, self.schedule.sends_at(step)

    def step(self) -> list:
        self.inner_steps += 1
        merges, sends = self.due(self.inner_steps)
        for p in merges:
            del self._merges[p]
        self.rounds += len(merges)
        for p in sends:
            if self.schedule.delay == 0:
                self.rounds += 1
            else:
                self._merges[p] = self.schedule.merge_step(self.inner_steps)
        return []

    def clock_state(self) -> dict[str, Any]:
        return {"inner_steps": self.inner_steps, "rounds": self.rounds, "merges": dict(self._merges)}

    def load_clock(self, state: dict[str, Any]) -> None:
        self.inner_steps, self.rounds = int(state["inner_steps"]), int(state["rounds"])
        self._merges = {int(p): int(at) for p, at in state["merges"].items()}

    async def afinish(self) -> list:
        """Rank 0 merges what is in flight into its replica; the shards get it at the next run."""
        self.rounds += len(self._merges)
        self._merges.clear()
        return []

    async def __aenter__(self) -> RoundClock:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._merges.clear()

    def stats(self) -> dict[str, Any]:
        return {"inner_steps": self.inner_steps, "rounds": self.rounds, "bytes_sent": 0, "bytes_received": 0}


def schedule_of(outer: Any) -> dict[str, int]:
    """What a `RoundClock` needs from rank 0's outer optimizer."""
    return {"H": int(outer.H), "fragments": len(outer.fragments), "delay": int(outer.delay)}


def clock_of(outer: Any) -> dict[str, Any]:
    """Rank 0's outer optimizer's clock, in `RoundClock.clock_state` form."""
    if isinstance(outer, RoundClock):
        return outer.clock_state()
    return {"inner_steps": outer.inner_steps, "rounds": outer.rounds, "merges": outer.pending_merges()}


class ShardedModel:
    """One local rank's FSDP side: the sharded model, and on rank 0 the host replica and the
    inner-state snapshot (module docstring). `pull`, `push`, `gather_inner` and `load_inner`
    are collectives: every rank calls them at the same step.

    model: the freshly built, unsharded model (sharded in place). local: this rank's group
        (`rank_group.LocalRanks`, which imports this module).
    """

    def __init__(self, model: torch.nn.Module, local: Any) -> None:
        self.local = local
        self.replica = copy.deepcopy(model).float().cpu() if local.is_gateway else None
        self.model = shard_model(model, local.device, local.world_size)
        self.inner_state: dict[str, Any] | None = None  # rank 0: full inner state at `snapshot_step`
        self.snapshot_step = 0
        self.inner_to_load = False  # rank 0: a resumed inner state the shards have not got yet

    def pull(self) -> None:
        """θ from the shards into rank 0's replica."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.replica is not None:
            self.replica.load_state_dict(full)

    def push(self) -> None:
        """θ from rank 0's replica into every rank's shards."""
        full = self.replica.state_dict() if self.replica is not None else {}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(self.model, full, options=options)

    def gather_inner(self, optimizer: Any, step: int) -> None:
        """The inner optimizer's state, whole, into rank 0's snapshot (taken at `step`)."""
        from torch.distributed.tensor import DTensor

        full = _map_tensors(optimizer.state_dict(), lambda t: t.full_tensor() if isinstance(t, DTensor) else t)
        if self.replica is not None:
            self.inner_state = _map_tensors(full, lambda t: t.detach().to("cpu", copy=True))
            self.snapshot_step = step

    def load_inner(self, optimizer: Any, full: dict[str, Any]) -> None:
        """Every rank cuts its shard out of a whole inner state (all ranks hold `full`)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        params = list(self.model.parameters())
        body = full.get("optimizer", full)  # a GradScaler's wrapper (devices.ScaledInner) or the optimizer's own
        state = {}
        for i, entry in body["state"].items():
            p = params[int(i)]
            state[i] = {
                k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
                if isinstance(v, torch.Tensor) and isinstance(p, DTensor) and v.shape == p.shape
                else v
                for k, v in entry.items()
            }
        sharded = {**body, "state": state}
        optimizer.load_state_dict({**full, "optimizer": sharded} if "optimizer" in full else sharded)

    def start_state(self, outer: Any) -> dict[str, Any]:
        """Rank 0, at a run's start: what the others need (the clock; a resumed inner state)."""
        inner = self.inner_state if self.inner_to_load else None
        self.inner_to_load = False
        return {"clock": clock_of(outer), "inner": inner}

    def begin(self, outer: Any, optimizer: Any, state: dict[str, Any]) -> None:
        """Every rank, at a run's start, with rank 0's `start_state`."""
        if isinstance(outer, RoundClock):
            outer.load_clock(state["clock"])
        self.push()
        if state["inner"] is not None:
            self.load_inner(optimizer, state["inner"])

    def advance(self, outer: Any, optimizer: Any) -> bool:
        """After the inner step, on every rank: the outer step (rank 0's optimizer on the
        replica, a clock elsewhere), with a pull before it and a push after it when a round is
        due. Returns whether a round completed (the ranks then agree whether to go on)."""
        merges, sends = outer.due(outer.inner_steps + 1)
        if not merges and not sends:
            outer.step()
            return False
        self.pull()
        outer.step()
        if not merges and outer.delay:
            return False  # sent only: θ is unchanged until the merge
        self.push()
        self.gather_inner(optimizer, outer.inner_steps)
        return True

    def finish(self, outer: Any, optimizer: Any) -> None:
        """Every rank, at a run's end: θ and the inner state to rank 0."""
        self.pull()
        self.gather_inner(optimizer, outer.inner_steps)


def _map_tensors(tree: Any, fn: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_map_tensors(v, fn) for v in tree)
    return tree
