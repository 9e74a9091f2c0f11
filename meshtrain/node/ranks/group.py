"""The local-rank group of a multi-GPU peer: `LocalRanks` (the process groups, the sharding
choice and the control messages rank 0 sends the others) and `LocalRanksCollective` (under DDP:
the in-machine reduce, then the swarm's collective on rank 0, then the broadcast back; under
FSDP: rank 0's exchange alone, as only rank 0 holds an outer optimizer). The design and its
failures are told in `node/local_ranks.py`, which launches the ranks, and the FSDP variant in
`node/ranks/sharding.py`; this module is what the `Trainer` and the `Node` of one rank hold, so it
imports neither (their types appear here as `Any`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import trio

from meshtrain.collective.contract import Collective, CollectiveError, GatherResult, ReduceResult, RoundRequest
from meshtrain.collective.flat import flatten_fp32, unflatten
from meshtrain.collective.forwarding import ForwardingCollective
from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.log import get_logger
from meshtrain.node.ranks.devices import resolve_device
from meshtrain.node.ranks.sharding import choose_sharding, schedule_of
from meshtrain.node.spec.config import NodeConfig

log = get_logger(__name__)

LOCAL_GROUP_TIMEOUT = timedelta(minutes=30)
DONE = "done"
DONE_EXIT = "done; exit at once"  # the launcher is closing (SIGTERM): no one will read our result


class LocalRankError(MeshtrainError):
    """A local rank of this peer failed; the peer stopped."""


class LocalRanks:
    """This process's place in its peer's group of local ranks (built by `LocalRanks.start` in
    each rank, from the launcher's environment).

    rank, world_size: local rank and number of ranks. device: this rank's device.
    control: gloo group for rank 0's messages (state, go on / stop, under FSDP "save the inner
        state now", done), and the pids at start.
    outer: gloo group for the in-machine reduction of Δ and the broadcast of the outcome.
    sharding: the node config's "ddp", "fsdp" or "auto"; rank 0 settles it (`choose_sharding`)
        and the others take its choice with the spec.
    """

    def __init__(
        self, rank: int, world_size: int, device: torch.device, control: Any, outer: Any, sharding: str = "ddp"
    ) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.control, self.outer = control, outer
        self.sharding = sharding
        self.schedule: dict[str, int] = {}  # FSDP followers: rank 0's round schedule (sharding.RoundClock)
        self.peer_id = ""  # followers learn it from rank 0's first message
        self.pending: dict[str, Any] | None = None  # a follower's next run message
        self.pids: list[int] = [os.getpid()]  # every rank's process id, by rank (the status page shows them)

    @classmethod
    def start(cls, config: NodeConfig) -> LocalRanks:
        rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
        device = resolve_device(config.device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=LOCAL_GROUP_TIMEOUT)
        local = cls._with_groups(rank, world, device, config.sharding)
        local.pids = [int(p) for p in local.gather(os.getpid())]
        return local

    @classmethod
    def attach(cls, device: torch.device) -> LocalRanks:
        """The ranks of a script that initialised torch.distributed itself (torchrun with
        `meshtrain.SwarmOptimizer`, integrations/ranks.py): its default group's ranks, rank 0 the
        gateway, under DDP (every rank holds the whole model). Every rank calls it, in the same order
        as its other collective calls: it makes the two gloo groups."""
        return cls._with_groups(dist.get_rank(), dist.get_world_size(), device, "ddp")

    @classmethod
    def _with_groups(cls, rank: int, world: int, device: torch.device, sharding: str) -> LocalRanks:
        """Our two gloo groups (a collective call of every rank), and this rank's place."""
        control = dist.new_group(backend="gloo", timeout=LOCAL_GROUP_TIMEOUT)
        outer = dist.new_group(backend="gloo", timeout=LOCAL_GROUP_TIMEOUT)
        return cls(rank, world, device, control, outer, sharding)

    @property
    def is_gateway(self) -> bool:
        return self.rank == 0

    def batch_rows(self, batch_size: int) -> slice:
        if batch_size % self.world_size:
            raise ConfigError(
                f"the spec's batch_size ({batch_size}) must divide by the peer's "
                f"{self.world_size} local ranks (each trains batch_size / nproc_per_node rows)"
            )
        share = batch_size // self.world_size
        return slice(self.rank * share, (self.rank + 1) * share)

    def collective(self, swarm: Collective | None) -> LocalRanksCollective:
        return LocalRanksCollective(self, swarm)

    def choose_sharding(self, model: torch.nn.Module) -> str:
        """ "ddp" or "fsdp" for this model: rank 0 decides ("auto": node/ranks/sharding.py); the others
        learnt its choice from its first message."""
        if self.is_gateway:
            self.sharding = choose_sharding(self.sharding, model, self.device)
        return self.sharding

    def wrap(self, model: torch.nn.Module, current: torch.nn.Module) -> torch.nn.Module:
        """`model` in DistributedDataParallel (once; `current` is what the trainer holds)."""
        if isinstance(current, torch.nn.parallel.DistributedDataParallel):
            return current
        ids = [self.device.index] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)

    # -- control messages (the trainer thread) --------------------------------------------------

    def _broadcast(self, obj: Any, group: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    def receive(self) -> dict[str, Any] | str:
        """Followers: rank 0's next message (what to build, a run to start, or "done")."""
        msg = self._broadcast(None, self.control)
        if isinstance(msg, dict) and "peer_id" in msg:
            self.peer_id, self.sharding, self.schedule = msg["peer_id"], msg["sharding"], msg["schedule"]
        return msg

    def prepare(self, trainer: Any) -> None:
        """Rank 0, as its trainer is built: the others build theirs (spec, peer id, sharding and,
        under FSDP, the round schedule their clocks keep)."""
        schedule = schedule_of(trainer.outer) if trainer.sharded is not None else {}
        self._broadcast(
            {
                "spec": trainer.spec.model_dump(),
                "peer_id": trainer.peer_id,
                "sharding": self.sharding,
                "schedule": schedule,
            },
            self.control,
        )

    def start_run(self, trainer: Any, until: int) -> int:
        """At the start of every `Trainer.run`: rank 0 sends its state and where to stop; a
        follower loads what it received (under DDP); under FSDP rank 0 sends its clock (and a
        resumed inner state) and every rank takes its shard of θ (`ShardedModel.begin`).
        Returns the step to stop at."""
        sharded = trainer.sharded
        if self.is_gateway:
            state = trainer.checkpoint_state() if sharded is None else sharded.start_state(trainer.outer)
            msg: dict[str, Any] | None = {"until": until, "state": state}
            self._broadcast(msg, self.control)
        else:
            msg, self.pending = self.pending, None
            if msg is None:
                raise RuntimeError("a follower rank started a run without rank 0's message")
            if sharded is None:
                trainer.load_checkpoint(msg["state"])
                trainer.outer.needs_resync = False
        if sharded is not None:
            sharded.begin(trainer.outer, trainer.stepped, msg["state"])
        return int(msg["until"])

    def share(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (the others pass None): one pickled broadcast on the control
        group."""
        return self._broadcast(obj, self.control)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, by rank, on every rank (the control group)."""
        objs: list[Any] = [None] * self.world_size
        dist.all_gather_object(objs, obj, group=self.control)
        return objs

    def share_if(self, obj: Any) -> Any:
        """`share`, for a call made every step: rank 0 passes None when it has nothing to send, and
        then the step costs one 4-byte broadcast, not a pickled object. None on every rank, or
        rank 0's `obj`."""
        flag = torch.tensor([0 if obj is None else 1], dtype=torch.int32)
        dist.broadcast(flag, src=0, group=self.control)
        return self.share(obj) if flag[0] else None

    def keep_going(self, stop: bool) -> bool:
        """Every REPORT_EVERY steps, on every rank: go on unless rank 0 stops."""
        flag = torch.tensor([1 if stop else 0], dtype=torch.int32)
        dist.broadcast(flag, src=0, group=self.control)
        return not bool(flag[0])

    def order(self, what: int | None, step: int) -> tuple[int, int]:
        """Between two steps under FSDP, on every rank: rank 0 sends `what` (sharding's GO_ON,
        STOP or SAVE_INNER) for `step`; the others (`what` None) receive rank 0's (order, step)."""
        box = torch.tensor([0 if what is None else what, step], dtype=torch.int64)
        dist.broadcast(box, src=0, group=self.control)
        return int(box[0]), int(box[1])

    def finish(self, exit_now: bool = False) -> None:
        """Rank 0, once the node is done: the followers exit (`exit_now`: without a result)."""
        self._broadcast(DONE_EXIT if exit_now else DONE, self.control)

    @staticmethod
    def is_failure(e: BaseException) -> bool:
        """Whether an error from the training loop means a local rank is gone."""
        text = str(e).lower()
        return isinstance(e, dist.DistError) or any(w in text for w in ("gloo", "nccl", "connection", "peer"))

    # -- the round's in-machine steps (worker threads of the trio side) ----------------------------

    def reduce_mean(self, flat: torch.Tensor) -> None:
        dist.reduce(flat, dst=0, op=dist.ReduceOp.SUM, group=self.outer)
        if self.is_gateway:
            flat.div_(self.world_size)

    def share_outcome(
        self, outcome: dict[str, Any] | None, flat: torch.Tensor | None
    ) -> tuple[dict, torch.Tensor | None]:
        outcome = self._broadcast(outcome, self.outer)
        if "error" in outcome:
            return outcome, None
        if flat is None:
            flat = torch.empty(int(outcome["numel"]), dtype=torch.float32)
        dist.broadcast(flat, src=0, group=self.outer)
        return outcome, flat


class LocalRanksCollective(ForwardingCollective):
    """The `Collective` every local rank's outer optimizer sees: reduce inside the machine, rank 0
    exchanges with the swarm (`swarm`, None on the other ranks), everyone gets the outcome. Its
    capabilities are the swarm's (collective/forwarding.py); whether a round ran in groups comes
    to the other ranks with the outcome, so every rank's optimizer runs the consensus term's
    exchange with rank 0's, or none does.

    local: this rank's `LocalRanks`. swarm: the swarm's collective (rank 0 only).
    """

    def __init__(self, local: LocalRanks, swarm: Collective | None) -> None:
        self.local, self.inner = local, swarm
        self.grouped: dict[int, bool] = {}  # round id -> whether it ran in groups, as rank 0 said

    @property
    def peer_id(self) -> str:
        return self.inner.peer_id if self.inner is not None else self.local.peer_id

    def group(self, round_id: int) -> tuple[str, ...]:
        return self.inner.group(round_id) if self.inner is not None else (self.local.peer_id,)

    def round_is_grouped(self, round_id: int) -> bool:
        """As rank 0 found it after the round's exchange (under FSDP: the swarm's answer)."""
        grouped = self.grouped.get(round_id)
        return super().round_is_grouped(round_id) if grouped is None else grouped

    async def all_gather(
        self, payload: dict[str, torch.Tensor], *, round_id: int, tag: str = "", weight: float = 1.0
    ) -> GatherResult:
        """Under FSDP rank 0's gather (only it has an optimizer); under DDP none, on every rank
        alike: the other ranks would need rank 0's payloads, which the outcome does not carry."""
        if self.local.sharding != "fsdp":
            raise CollectiveError("a sparse all-gather (SparseLoCo) does not run across local ranks under DDP")
        return await super().all_gather(payload, round_id=round_id, tag=tag, weight=weight)

    async def all_reduce(self, request: RoundRequest) -> ReduceResult:
        swarm = self.inner
        return await self._round(
            request,
            None if swarm is None else lambda t: swarm.all_reduce(replace(request, tensors=t)),
        )

    async def average_with(self, partner: str | None, request: RoundRequest) -> ReduceResult:
        swarm = self.inner
        return await self._round(
            request,
            None if swarm is None else lambda t: swarm.average_with(partner, replace(request, tensors=t)),
        )

    async def _round(self, request: RoundRequest, exchange: Any) -> ReduceResult:
        """`exchange(tensors)`, the swarm's call with the machine's tensors (rank 0 only)."""
        tensors, round_id, local = request.tensors, request.round_id, self.local
        if local.sharding == "fsdp":  # only rank 0 has an outer optimizer; its Δ is the machine's
            return await exchange(tensors)
        flat = flatten_fp32(tensors)
        await trio.to_thread.run_sync(local.reduce_mean, flat)
        if not local.is_gateway:
            outcome, mean = await trio.to_thread.run_sync(local.share_outcome, None, None)
            if mean is None:
                raise CollectiveError(outcome["error"])
            self._remember(round_id, outcome["grouped"])
            return ReduceResult(
                unflatten(mean, tensors, list(tensors)),
                tuple(outcome["contributors"]),
                outcome["digest"],
                0,
                0,
                dict(outcome["excluded"]),
                members=tuple(outcome["members"]),
            )
        try:
            result = await exchange(unflatten(flat, tensors, list(tensors)))
        except BaseException as e:  # CollectiveError, or cancelled: the other ranks must not wait
            why = str(e) if isinstance(e, CollectiveError) else "rank 0 left the round"
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(local.share_outcome, {"error": why}, None)
            raise
        mean = flatten_fp32(result.tensors)
        grouped = super().round_is_grouped(round_id)
        await trio.to_thread.run_sync(
            local.share_outcome,
            {
                "numel": mean.numel(),
                "contributors": list(result.contributors),
                "digest": result.digest,
                "excluded": dict(result.excluded),
                "members": list(result.members),
                "grouped": grouped,
            },
            mean,
        )
        self._remember(round_id, grouped)
        return result

    def _remember(self, round_id: int, grouped: bool) -> None:
        self.grouped[round_id] = bool(grouped)
        for old in list(self.grouped)[:-8]:  # asked right after the round's exchange: a few suffice
            del self.grouped[old]
