"""A torchrun script's ranks as one swarm peer, for `SwarmOptimizer` (rank 0 the gateway).

    torch.distributed.init_process_group("nccl")        # torchrun --nproc-per-node 8 train.py
    swarm = meshtrain.Swarm.join(addr, data_dir="d") if dist.get_rank() == 0 else None
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    opt = meshtrain.SwarmOptimizer(torch.optim.AdamW(model.parameters()), swarm, model=model)
    while opt.swarm_step < opt.spec.steps: ...           # ddp's forward, backward, opt.step()
    opt.close()                                          # then, on rank 0: swarm.leave()

Problem. A multi-GPU training script already runs N processes under torchrun, DDP keeping their
replicas equal. The swarm wants one peer per machine, not N: one membership, one exchange of the
machine's Δ, one state download. `meshtrain node start --nproc-per-node N` does this for the
daemon's own loop (node/local_ranks.py); this is the same for a loop the user wrote.

Design. The same group the daemon's ranks form (node/ranks/group.py), attached to the script's
own process group: `LocalRanks.attach` makes two gloo groups beside it (control and outer). Rank 0
holds the `meshtrain.Swarm` and sends the others the swarm's spec and its peer id; every rank
builds the spec's outer optimizer over a `LocalRanksCollective`, which reduces Δ inside the
machine, lets rank 0 exchange the mean with the swarm, and hands every rank the outcome — so every
rank applies the same outer update and their φ stay bit-identical. The other ranks run their
optimizer's exchanges on a trio loop of their own in a thread (`RankLoop`); rank 0's run on the
swarm's.

What changes the state outside a round is rank 0's alone: the first step joins the swarm (resume
the data dir's checkpoint, or download the swarm's state), and a missed round or the minority in
a parity check re-downloads it (node/user_loop.py). At the start of every step, after the swarm's
own step hook, rank 0 sends its whole state (θ, φ, the outer and inner optimizers' state) to
the others when it may have changed — the first step, a step that began needing a re-sync, or
any step after a state was loaded (`OuterOptimizer.state_loads`) — and a 4-byte "nothing" flag
otherwise. The others load it before their inner step: the first step's gradients (DDP-averaged,
equal on every rank) then land on the same joined state everywhere. The first step sends even
when nothing was loaded: a rank whose optimizer was built before DDP synced θ holds its own φ.
The state travels as one pickled object (as the daemon's ranks' start does): a peak of about
its size again on each rank while it does.

Failures. Everything is a collective call of every rank, in the same order, as torch.distributed
wants: a rank that dies leaves the others blocked in a gloo call until its timeout (30 min, as
the daemon's), or until torchrun's elastic agent tears the group down, which is torchrun's
failure story for any DDP script. Refused at construction, on every rank alike (one-line
`ConfigError`): a swarm handed to a rank other than 0, none to rank 0, a spec whose optimizer
gathers sparse payloads (SparseLoCo: only rank 0 would hold them), a sharded model (FSDP's
DTensor parameters: the daemon's `--sharding fsdp` is the way for a model that needs it).

Not here: the swarm's side (node/user_loop.py), the outer optimizer (optim/), data order (rank r's
rows of the swarm step's batch are the script's, positioned with `opt.swarm_step`).
"""

from __future__ import annotations

import threading

import torch
import trio

from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.node.ranks.devices import to_host
from meshtrain.node.ranks.group import LocalRanks, LocalRanksCollective
from meshtrain.node.spec.outer import build_outer, outer_class
from meshtrain.node.spec.swarm import SwarmSpec, parse_spec
from meshtrain.node.user_loop import Swarm
from meshtrain.optim.outer import OuterOptimizer
from meshtrain.optim.sparseloco import SparseLoCo

ENTER_TIMEOUT = 60.0  # seconds a rank's trio loop may take to enter its optimizer


class RankPeer:
    """This rank's part of a peer made of a torchrun script's ranks (module docstring).

    inner, model: as `SwarmOptimizer` takes them (the unwrapped model: its parameter names are the
    swarm's). swarm: the `Swarm` on rank 0, None on the others.
    """

    def __init__(self, inner: torch.optim.Optimizer, swarm: Swarm | None, model: torch.nn.Module) -> None:
        if any(type(p).__name__ == "DTensor" for p in model.parameters()):
            raise ConfigError(
                "SwarmOptimizer: the model's parameters are sharded (FSDP); wrap it in DDP, or run a sharded "
                "peer with `meshtrain node start --nproc-per-node N --sharding fsdp`"
            )
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.local = LocalRanks.attach(device)
        # Which ranks hold a swarm, known to all: a wrong hand-out is refused on every rank alike,
        # not on one while the others wait for it in the next collective call.
        holders = self.local.gather(swarm is not None)
        if holders != [True] + [False] * (self.local.world_size - 1):
            raise ConfigError(
                f"SwarmOptimizer across {self.local.world_size} ranks: rank 0 is the swarm's peer and takes the "
                f"Swarm, every other rank passes swarm=None (here the ranks holding one are "
                f"{[r for r, held in enumerate(holders) if held]})"
            )
        said = self.local.share(None if swarm is None else {"spec": swarm.spec.model_dump(), "peer_id": swarm.peer_id})
        self.spec: SwarmSpec = swarm.spec if swarm is not None else parse_spec(said["spec"], signed=True)
        self.local.peer_id = said["peer_id"]
        if issubclass(outer_class(self.spec), SparseLoCo):
            raise ConfigError(
                f"SwarmOptimizer: the swarm's optimizer ({self.spec.outer.optimizer}) gathers sparse payloads, "
                f"which only rank 0 would receive; it does not run across {self.local.world_size} ranks"
            )
        self.model = model
        self.outer: OuterOptimizer = build_outer(self.spec, model, inner, LocalRanksCollective(self.local, swarm))
        self._loop = None if swarm is not None else RankLoop(self.outer)
        self._first = True  # the first step always sends: it joins the swarm's state
        self._resyncing = False
        self._sent_loads = self.outer.state_loads
        if self.local.is_gateway:
            # Around the swarm's own hook (added as the optimizer was built): note what it is about
            # to do, then send what it did.
            self.outer.step_hooks.insert(0, self._before_swarm)
        self.outer.step_hooks.append(self._share_state)

    def _before_swarm(self, outer: OuterOptimizer) -> None:
        self._resyncing = outer.needs_resync

    def _share_state(self, outer: OuterOptimizer) -> None:
        local = self.local
        if local.is_gateway:
            changed = self._first or self._resyncing or outer.state_loads != self._sent_loads
            self._first, self._sent_loads = False, outer.state_loads
            state = None
            if changed:
                state = {
                    "model": to_host(self.model.state_dict(), copy=False),  # pickled at once: no copies
                    "outer": to_host(outer.state_dict(inner=True, copy=False), copy=False),
                }
            local.share_if(state)
            return
        state = local.share_if(None)
        if state is None:
            return
        outer.finish()  # an exchange of ours in flight: rank 0 ended its own before the change
        self.model.load_state_dict(state["model"])
        outer.load_state_dict(state["outer"], inner=True)
        outer.needs_resync = False

    def close(self) -> None:
        """End this rank's part: its exchange in flight, then (not rank 0) its trio loop."""
        if self._loop is not None:
            self.outer.finish()
            self._loop.close()


class RankLoop:
    """A trio loop in a thread of its own that holds `outer` entered, for a rank without the swarm:
    its optimizer's exchanges (reduce, rank 0's outcome) hop there from the training thread."""

    def __init__(self, outer: OuterOptimizer) -> None:
        self._entered = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._main, args=(outer,), name="meshtrain-rank", daemon=True)
        self._thread.start()
        if not self._entered.wait(ENTER_TIMEOUT):
            raise MeshtrainError(f"this rank's trio loop did not start within {ENTER_TIMEOUT:.0f} s")
        if self._error is not None:
            raise self._error

    def _main(self, outer: OuterOptimizer) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            async with outer:
                self._entered.set()
                await self._stop.wait()

        try:
            trio.run(main)
        except BaseException as e:  # noqa: BLE001 - handed to the training thread
            self._error = e
        finally:
            self._entered.set()

    def close(self) -> None:
        stop = self._stop
        if stop is not None and self._thread.is_alive():
            trio.from_thread.run_sync(stop.set, trio_token=self._token)
        self._thread.join(10)
