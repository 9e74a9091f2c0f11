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
  the inner state to load; then `push` puts the replica's θ into the shards and each rank takes
  its own shard of the inner state. At the end of a run the ranks `pull` θ to rank 0 and save
  their shards of the inner state (below).
- The inner state is never gathered. AdamW's moments stay DTensor shards, 1/N per rank, from
  the run's start to its end; no round touches them.

Checkpoints: θ and the outer state in rank 0's checkpoint file, the inner state sharded beside
it with `torch.distributed.checkpoint` (DCP), all of one step.
- Where: `<data_dir>/checkpoints/inner-<step>/`, one file per rank plus DCP's `.metadata`
  (`save_inner_shards`: `get_optimizer_state_dict`, `dcp.save`). It is written as
  `.tmp-inner-<step>` and renamed whole by rank 0 once every rank is done (DCP returns on every
  rank after rank 0 wrote the metadata), so a kill -9 leaves no half save under the name; the
  checkpoint store deletes `.tmp-*` at start. Rank 0's file names it (`inner_shards`: its
  directory's name, its step, the GradScaler's state under fp16) instead of holding the state.
- When: only when rank 0's node takes a checkpoint — its timer, `checkpoint_every` — and at a
  run's end; not at every round (a 7B model's moments are 56 GB). The node takes a checkpoint
  between two steps (`Trainer.checkpoint_state` from the run state's `after_step`), where the
  others cannot know it wants one; but every place rank 0 reports from is followed, on every
  rank, by an agreement (`agree`: after a round, every `REPORT_EVERY` steps, at evaluation
  steps, at the run's end), and the agreement carries orders: before its verdict (go on /
  stop) rank 0 may order "save the inner state of step s" (`save_now`, `LocalRanks.order`:
  one int64 pair broadcast on the control group), and every rank then pulls θ to rank 0's
  replica and writes its shard. So θ (the replica, just pulled), the outer state (φ does not
  move between rounds) and the shards are all of step s, and the save is on disk before the
  checkpoint file that names it is written. A step is saved at most once (the run end's save
  is skipped when a checkpoint saved that step); nothing is saved before a run's first inner
  step (a fresh AdamW has no state to save, and DCP would make one).
- Between runs (the final checkpoint after the run end's save, after a download) no
  collective can run: a checkpoint names the newest save. After a join (θ ← the swarm's φ, the
  inner state kept, as on one rank) or a failed rank (the run ends without its pull: θ and the
  outer state are then the last round's, and the data position goes back there) that save is
  older than θ; it is linked (hard links, no bytes copied) under the checkpoint's step, so a
  checkpoint of step s always names `inner-s`.
- Pruning: at each save rank 0 deletes the `inner-<s>` that no kept checkpoint (`ckpt-<s>`)
  names, except the newest two saves (the checkpoint of the one before the last may still be
  being written). A save whose checkpoint was just dropped by the store therefore goes at the
  next save: at most `keep_checkpoints` + 1 saves are on disk. A single-rank peer resuming an
  FSDP peer's checkpoint leaves the old saves where they are.
- Resume (`Trainer.load_checkpoint`), any topology: FSDP from a save, any rank count (every
  rank reads its shard at the run's start, `load_inner_shards`; DCP reshards); one rank, or
  DDP's rank 0, from a save, without a process group (`dcp.load(no_dist=True)`: whole
  tensors); FSDP from a single-rank checkpoint (the whole inner state in the file: each rank
  cuts its shard out of it, `load_inner`, no communication). A checkpoint whose save is gone
  resumes θ and the outer state with a fresh inner optimizer, and says so.

Costs, per parameter (fp32, AdamW). Each rank's device: θ, its gradient and the two moments,
all sharded: 16/N bytes, plus one FSDP unit's gathered parameters while it computes. Rank 0's
host: the replica's θ, φ and the outer optimizer's state — 12 bytes for DiLoCo with Nesterov
momentum, more for what other outer optimizers keep — and, while a checkpoint is taken, the
copies of those it writes (12 more). Nothing is gathered for the inner state, ever (it was 8 more bytes on
rank 0's host, and a whole AdamW state materialised on every rank after every round). What is
gathered when: θ to rank 0 (`pull`: `get_model_state_dict` all-gathers one tensor at a time
and keeps the full copy on rank 0 only) before every round and at every checkpoint and run
end; the new θ from rank 0 to every rank's shard (`push`) after every round and at a run's
start. Each round moves the model to rank 0 and back over the machine's links, on top of the
swarm's exchange. A late joiner's download and a resume land in the replica and reach the
shards at the next run. Evaluation of φ runs on rank 0's replica, on its host.

Failures: as under DDP (node/local_ranks.py) — a rank that dies breaks the process group and
every other rank's pending collective fails at once; a rank never waits on a round alone
because the clock, not a message, says when rounds are; a save is ordered only where every
rank is in an agreement. A save or a load that DCP cannot do (a full disk, a shard file gone)
fails on every rank alike, as a `CheckpointError` naming the directory: the peer stops with that
line (a periodic checkpoint's failure is not survived as on one rank, where it is a warning).

Not here: mixed DDP/FSDP meshes (HSDP), CPU offload of the shards, FSDP across machines, and
sharding θ, φ and the outer state in the checkpoint file: those stay whole on rank 0's host.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import warnings
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from meshtrain.durable import fsync_dir
from meshtrain.errors import ConfigError
from meshtrain.node.ranks.devices import ScaledInner
from meshtrain.node.state.checkpoint import CheckpointError, CheckpointStore
from meshtrain.optim.schedule import RoundSchedule

SHARDINGS = ("ddp", "fsdp", "auto")
AUTO_FSDP_FRACTION = 0.5  # of one device's memory; the rest is for activations
TRAINING_BYTES_PER_PARAM = 16  # fp32 θ + its gradient + AdamW's exp_avg and exp_avg_sq
INNER_DIR = "inner-"  # + the step: a checkpoint's inner state, saved with DCP beside it
DCP_METADATA = ".metadata"  # DCP's index of a save, written last: a directory without it is incomplete
PARTIAL = ".tmp-"  # a directory being written (the checkpoint store's prefix for its leftovers)
KEEP_RECENT_SAVES = 2  # the newest saves are kept whatever: their checkpoints may be being written
GO_ON, STOP, SAVE_INNER = 0, 1, 2  # rank 0's orders between two steps (LocalRanks.order)


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
        self.skipped_steps = 0  # a multi-rank peer trains every step (node/pace.py)
        self.comm_wait_seconds = 0.0  # rank 0's optimizer waits on the rounds
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
        return {
            "inner_steps": self.inner_steps,
            "rounds": self.rounds,
            "bytes_sent": 0,
            "bytes_received": 0,
            "comm_wait_seconds": self.comm_wait_seconds,
            "skipped_steps": self.skipped_steps,
        }


def schedule_of(outer: Any) -> dict[str, int]:
    """What a `RoundClock` needs from rank 0's outer optimizer."""
    return {"H": int(outer.H), "fragments": len(outer.fragments), "delay": int(outer.delay)}


def clock_of(outer: Any) -> dict[str, Any]:
    """Rank 0's outer optimizer's clock, in `RoundClock.clock_state` form."""
    if isinstance(outer, RoundClock):
        return outer.clock_state()
    return {"inner_steps": outer.inner_steps, "rounds": outer.rounds, "merges": outer.pending_merges()}


@dataclass(frozen=True)
class InnerShards:
    """An inner optimizer state saved with DCP: every rank's shard of AdamW's moments in
    `directory` (`inner-<step>` beside the checkpoints), readable by any rank count or by a
    single process (`load_inner_shards`).

    directory: where the shards are. step: the inner step they are from. scaler: rank 0's
        GradScaler state (fp16 runs), which is not sharded; None otherwise.
    """

    directory: Path
    step: int
    scaler: dict[str, Any] | None = None


def inner_dir(checkpoints: Path, step: int) -> Path:
    """Where the inner state's shards for the checkpoint of `step` live."""
    return checkpoints / f"{INNER_DIR}{step:09d}"


def save_inner_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Every rank writes its own shard of `optimizer`'s state into `directory` (a collective:
    DCP plans the files together and rank 0 writes the metadata last)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    with _typed_errors(f"saving the inner optimizer state into {directory}"):
        dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=directory)


def load_inner_shards(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path, *, collective: bool
) -> None:
    """`optimizer`'s state from a DCP directory written by any number of ranks. `collective`:
    every rank of a sharded model reads its own shard (DCP reshards); otherwise one process
    reads whole tensors without a process group (a single rank, or rank 0 under DDP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    # get_optimizer_state_dict builds a fresh optimizer's state with a zero-lr step (θ does not
    # move), and only where no gradient is set: a finished run leaves its last gradients.
    optimizer.zero_grad(set_to_none=True)
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    with warnings.catch_warnings(), _typed_errors(f"loading the inner optimizer state from {directory}"):
        # DCP warns that it loads in one process: what we ask of it
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=directory, no_dist=not collective)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


class ShardedModel:
    """One local rank's FSDP side: the sharded model, and on rank 0 the host replica and the
    record of where the inner state is saved (module docstring). `pull`, `push`, `agree`,
    `begin`, `finish` and rank 0's `save_now` are collectives: every rank takes part at the
    same step.

    model: the freshly built, unsharded model (sharded in place). local: this rank's group
        (`rank_group.LocalRanks`, which imports this module). checkpoints: the node's checkpoint
        directory: the inner state's shards are saved beside the checkpoints (`inner_dir`).
    """

    def __init__(self, model: torch.nn.Module, local: Any, checkpoints: Path) -> None:
        self.local = local
        self.checkpoints = checkpoints
        self.replica = copy.deepcopy(model).float().cpu() if local.is_gateway else None
        self.model = shard_model(model, local.device, local.world_size)
        self.replica_step = 0  # rank 0: the inner step the replica's θ is from
        self.saved: InnerShards | None = None  # rank 0: the newest save of the inner state we hold
        self.recent: deque[Path] = deque(maxlen=KEEP_RECENT_SAVES)  # rank 0: never pruned
        self.to_load: InnerShards | dict[str, Any] | None = None  # rank 0: a resumed inner state the shards lack
        self.between_steps = False  # rank 0: an agreement follows, where the others can take part in a save

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

    # -- saving the inner state (module docstring: "Checkpoints") -------------------------------

    def agree(self, optimizer: Any, step: int, stop: bool) -> bool:
        """Every rank, between two steps: whether to go on (rank 0's `stop` decides). Before its
        verdict rank 0 may order saves (`save_now`), which the others carry out here."""
        self.between_steps = False
        if self.local.is_gateway:
            verdict, _ = self.local.order(STOP if stop else GO_ON, step)
            return verdict == GO_ON
        while True:
            what, at = self.local.order(None, step)
            if what != SAVE_INNER:
                return what == GO_ON
            if at != step:
                raise RuntimeError(f"rank 0 saves the inner state of step {at}; this rank is at step {step}")
            self._save(optimizer, step)

    def save_now(self, optimizer: Any, step: int) -> None:
        """Rank 0, between two steps before an agreement: every rank pulls θ into the replica and
        saves its shard of the inner state — once a step, and not before the first step (a fresh
        optimizer has no state, and DCP would make one)."""
        if not _optimizer_of(optimizer).state or (
            self.saved is not None and self.saved.step == step and self.saved.directory.is_dir()
        ):
            return
        final = inner_dir(self.checkpoints, step)
        for stale in (final, _partial(final)):  # a lost run's, which no checkpoint names
            shutil.rmtree(stale, ignore_errors=True)
        self.local.order(SAVE_INNER, step)
        self._save(optimizer, step)

    def _save(self, optimizer: Any, step: int) -> None:
        self.pull()
        final = inner_dir(self.checkpoints, step)
        save_inner_shards(self.model, _optimizer_of(optimizer), _partial(final))
        if self.replica is None:
            return
        self.replica_step = step
        os.rename(_partial(final), final)  # DCP returns on every rank once rank 0 wrote the metadata
        fsync_dir(self.checkpoints)
        self._saved(InnerShards(final, step, _scaler_state(optimizer)))

    def _saved(self, shards: InnerShards) -> None:
        self.saved = shards
        self.recent.append(shards.directory)
        self._prune()

    def _prune(self) -> None:
        """Rank 0: delete the saves no checkpoint names (a checkpoint of step s names `inner-s`),
        but the newest ones, whose checkpoints may still be being written."""
        named = {p.name.rsplit("-", 1)[-1] for p in CheckpointStore(self.checkpoints, readonly=True).list()}
        for d in self.checkpoints.glob(f"{INNER_DIR}*"):
            if d.name.rsplit("-", 1)[-1] not in named and d not in self.recent:
                shutil.rmtree(d, ignore_errors=True)

    def inner_for_checkpoint(self) -> InnerShards | dict[str, Any] | None:
        """Rank 0: the inner state a checkpoint of the replica's step names: its shards' directory
        (`inner-<step>`: the one saved at that step, or the newest save linked under that name —
        after a join or a failed rank the inner state is older than θ), a resumed whole state
        the shards have not taken yet, or None (a fresh inner optimizer)."""
        if isinstance(self.to_load, dict):
            return self.to_load
        saved = self.saved
        if saved is None or saved.step == self.replica_step:
            return saved
        linked = InnerShards(inner_dir(self.checkpoints, self.replica_step), self.replica_step, saved.scaler)
        _link_tree(saved.directory, linked.directory)
        if self.to_load == saved:  # the same state: load it from the name that is kept
            self.to_load = linked
        self._saved(linked)
        return linked

    def resumed(self, inner: InnerShards | dict[str, Any] | None, step: int) -> None:
        """Rank 0, after a checkpoint is loaded into the replica at `step`: the inner state it
        names (shards, a whole state, or none) reaches the shards at the next run."""
        self.replica_step = step
        self.to_load = inner
        self.saved = None
        self.recent.clear()
        if isinstance(inner, InnerShards):
            self._saved(inner)

    # -- runs ------------------------------------------------------------------------------------

    def start_state(self, outer: Any) -> dict[str, Any]:
        """Rank 0, at a run's start: what the others need (the clock; a resumed inner state)."""
        inner, self.to_load = self.to_load, None
        return {"clock": clock_of(outer), "inner": inner}

    def begin(self, outer: Any, optimizer: Any, state: dict[str, Any]) -> None:
        """Every rank, at a run's start, with rank 0's `start_state`."""
        if isinstance(outer, RoundClock):
            outer.load_clock(state["clock"])
        self.push()
        inner = state["inner"]
        if isinstance(inner, InnerShards):
            load_inner_shards(self.model, _optimizer_of(optimizer), inner.directory, collective=True)
            if inner.scaler is not None and isinstance(optimizer, ScaledInner):
                optimizer.scaler.load_state_dict(inner.scaler)
        elif inner is not None:
            self.load_inner(optimizer, inner)

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
        self.replica_step = outer.inner_steps  # pulled θ, or the round's new θ
        if not merges and outer.delay:
            return False  # sent only: θ is unchanged until the merge
        self.push()
        return True

    def finish(self, outer: Any, optimizer: Any) -> None:
        """Every rank, at a run's end: the saves rank 0 ordered at the last step, then θ to rank
        0's replica and the inner state saved (once a step: a checkpoint there saved it)."""
        step = outer.inner_steps
        if self.local.is_gateway:
            self.save_now(optimizer, step)
        self.agree(optimizer, step, stop=True)


@contextlib.contextmanager
def _typed_errors(what: str) -> Iterator[None]:
    """DCP's failures as a `CheckpointError` (DCP raises a BaseException, which would pass every
    handler on its way; it raises it on every rank alike)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        ranks = ", ".join(str(r) for r in sorted(e.failures))
        first = next(iter(e.failures.values()), None)
        cause = f"{type(first[0]).__name__}: {first[0]}" if first is not None else "no cause given"
        raise CheckpointError(f"{what} failed on rank(s) {ranks} ({str(cause).splitlines()[0][:200]})") from None


def _optimizer_of(stepped: Any) -> torch.optim.Optimizer:
    """The inner optimizer itself, under its GradScaler wrapper if it has one (fp16)."""
    return stepped.optimizer if isinstance(stepped, ScaledInner) else stepped


def _scaler_state(stepped: Any) -> dict[str, Any] | None:
    return stepped.scaler.state_dict() if isinstance(stepped, ScaledInner) else None


def _partial(directory: Path) -> Path:
    """Where `directory` is written before it is renamed into place (the checkpoint store deletes
    these leftovers of a crash at start)."""
    return directory.with_name(PARTIAL + directory.name)


def _link_tree(src: Path, dst: Path) -> None:
    """`dst` as a copy of the directory `src` made of hard links (no bytes copied), whole or not
    at all."""
    partial = _partial(dst)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    for f in src.iterdir():
        os.link(f, partial / f.name)
    fsync_dir(partial)
    shutil.rmtree(dst, ignore_errors=True)
    os.rename(partial, dst)
    fsync_dir(dst.parent)
