"""`Swarm`: the network for a training loop you write yourself (hivemind's `Optimizer` style).

    swarm = meshtrain.Swarm.join("/ip4/1.2.3.4/tcp/4001/p2p/12D3Koo...", data_dir="d")
    opt = meshtrain.DiLoCo(model, torch.optim.AdamW(model.parameters()), swarm, H=500)
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()
        opt.step()                      # inner step; every H steps an outer round with the swarm
        opt.zero_grad()
        swarm.report(loss=loss.item())  # optional: the status page's loss
    swarm.leave()                       # or `with Swarm.join(...) as swarm:`

Problem. `Node` owns its training loop (model, data, batches from the spec). A researcher with
their own model, data loader and loop still wants everything else: NAT traversal, membership,
the fault-tolerant collective, late joining, parity, checkpoints and the status page.

Design. `Swarm` runs a `Node` in *loop mode* in a background thread with its own trio loop.
`Swarm.join`/`create`/`open` return once the node is connected to the swarm (host, data plane,
presence, collective). The swarm is the `Collective` the outer optimizer averages through (it
forwards every call to the node's `SwarmCollective`, with its capabilities: a round in groups
gets the consensus term, a round's join goes out ahead — collective/forwarding.py), and an
optimizer built over it is *watched*
(`collective.contract.WatchesOptimizer`): its class and H are checked against the swarm's spec
at once (a one-line `ConfigError`: a spec that says `diloco` cannot be trained with another
optimizer), and it is entered on the swarm's trio loop, so its collective calls hop there from
your thread. Its step hook runs at the start of every `step()`, in your thread:
- the first call joins the swarm's state (`RunState.enter`: resume this data dir's checkpoint,
  or download the swarm's state from its peers when the swarm is past it). The gradients of that
  first step, computed before the join, are applied to the joined state: one step of staleness,
  as in asynchronous SGD, and none in a fresh swarm;
- every `REPORT_EVERY` steps and after each round: progress, donor publishing, the periodic
  checkpoint (`RunState.after_step`, the same as the daemon's);
- when the outer optimizer lost step with the swarm (`needs_resync`: a missed round, or parity
  says we are in the minority), it downloads the swarm's state before the step goes on.
`leave()` finishes an exchange in flight, saves a checkpoint, leaves the membership and stops
the thread; it returns the `NodeResult`. `save_checkpoint()` writes one at once, between steps. Checkpoints hold your model's θ and the outer state
(φ, outer optimizer, inner optimizer): `Swarm.open(data_dir)` then a new optimizer resumes them.

Not here: your data and its position (a checkpoint records the step; resuming your loader at
that step is yours: `swarm.step` after the first `opt.step()`), signals (your program owns
Ctrl-C: leave the swarm in a `finally` or a `with` block).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import torch
import trio

from meshtrain.collective.contract import Collective
from meshtrain.collective.forwarding import ForwardingCollective
from meshtrain.errors import ConfigError, MeshtrainError, meshtrain_error_in
from meshtrain.log import get_logger
from meshtrain.node.daemon import Node, NodeResult
from meshtrain.node.phase import StoppedWhileStarting
from meshtrain.node.spec.config import NodeConfig, load_node_config
from meshtrain.node.spec.data_dir import make_data_dir
from meshtrain.node.spec.outer import check_matches
from meshtrain.node.spec.signed import SignedSpec
from meshtrain.node.spec.swarm import SwarmSpec
from meshtrain.node.trainer import REPORT_EVERY, StepInfo, TrainedState
from meshtrain.optim.outer import OuterOptimizer
from meshtrain.transport.identity import Identity

log = get_logger(__name__)

START_TIMEOUT = 120.0  # seconds `Swarm.join` waits for the node to be connected


class Swarm(ForwardingCollective):
    """A running swarm membership for your own training loop (see the module docstring).

    Build it with `Swarm.join(address, data_dir=...)`, `Swarm.create(spec, data_dir=...)` or
    `Swarm.open(data_dir)`; `**options` are `NodeConfig` fields (listen, bootstrap, status_port,
    checkpoint_every, nat, ...). Thread-safe: call it from your training thread.
    """

    def __init__(self, config: NodeConfig, *, spec: SignedSpec | None = None, join: str | None = None) -> None:
        self.node = Node(config, spec=spec, join=join, user_loop=True)
        self._ready = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._result: NodeResult | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._loop: LoopTrainer | None = None
        self._thread = threading.Thread(target=self._main, name="meshtrain-swarm", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT) and self._error is None:
            self.node.stop()
            raise MeshtrainError(f"the swarm's node did not start within {START_TIMEOUT:.0f} s")
        if self._error is not None:
            raise self._error

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def join(cls, address: str, *, data_dir: str | Path, **options: Any) -> Swarm:
        """Join the swarm that the peer at `address` (`/ip4/.../p2p/<id>`, or `<swarm id>@<addr>`)
        is in: its signed spec is fetched and verified first."""
        return cls(_config(data_dir, options), join=address)

    @classmethod
    def create(cls, spec: SwarmSpec | SignedSpec, *, data_dir: str | Path, **options: Any) -> Swarm:
        """Create a swarm with `spec`, signed with this data dir's identity (created if new)."""
        config = _config(data_dir, options)
        if isinstance(spec, SwarmSpec):
            spec = SignedSpec.create(spec, Identity.load_or_create(make_data_dir(config.data_dir)))
        return cls(config, spec=spec)

    @classmethod
    def open(cls, data_dir: str | Path, **options: Any) -> Swarm:
        """Rejoin the swarm this data dir was in (its swarm.json), resuming its checkpoint."""
        return cls(_config(data_dir, options))

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    # -- what the user sees ----------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        assert self.node.host is not None  # started in __init__
        return self.node.host.peer_id

    @property
    def addrs(self) -> list[str]:
        assert self.node.host is not None
        return list(self.node.host.addrs)

    @property
    def spec(self) -> SwarmSpec:
        assert self.node.signed is not None
        return self.node.signed.spec

    @property
    def swarm_id(self) -> str:
        assert self.node.signed is not None
        return self.node.signed.swarm_id

    @property
    def status_url(self) -> str | None:
        return self.node.status_url

    @property
    def step(self) -> int:
        """The inner step the watched optimizer is at (0 before one is built)."""
        return self._loop.step if self._loop is not None else 0

    def report(self, *, loss: float | None = None, eval_loss: float | None = None) -> None:
        """Numbers for the status page and the swarm's metrics (optional; any thread)."""
        if self._loop is not None:
            self._loop.report(loss=loss, eval_loss=eval_loss)

    def save_checkpoint(self) -> str | None:
        """Write a checkpoint into the data dir now, between two steps, from the loop's thread (a
        framework's own save, e.g. the Trainer's `checkpoint-N`, gets the swarm's beside it); its
        path, or None before the first step, while an exchange is in flight (the periodic
        checkpoint after it covers it) or while the state is one we proceeded alone in after a
        failed round, before its re-sync (`RunState.save_final`)."""
        loop, run_state = self._loop, self.node.run_state
        if loop is None or not loop.begun or run_state is None or loop.outer.in_flight:
            return None
        path: str = self._call(run_state.save_final)
        return path

    def leave(self) -> NodeResult | None:
        """Finish an exchange in flight, checkpoint, leave the swarm, stop the node (idempotent).
        None if no optimizer was ever built over the swarm (nothing was trained)."""
        if not self._done.is_set():
            self.node.stop()
            self._done.wait()
        self._thread.join(10)
        if self._error is not None and not isinstance(self._error, KeyboardInterrupt | StoppedWhileStarting):
            raise self._error
        return self._result

    # -- the optimizer's side ----------------------------------------------------------------------

    def watch(self, optimizer: OuterOptimizer) -> None:
        """Called by an outer optimizer built over this swarm (`WatchesOptimizer`)."""
        if self._loop is not None:
            raise ConfigError("this Swarm already has an outer optimizer; build one per Swarm")
        check_matches(optimizer, self.spec)
        loop = self._loop = LoopTrainer(optimizer, self.spec)
        self._call(self.node.adopt, loop)
        optimizer.step_hooks.append(self._before_step)

    def _before_step(self, optimizer: OuterOptimizer) -> None:
        loop, run_state = self._loop, self.node.run_state
        assert loop is not None and run_state is not None  # adopted
        if not loop.begun:
            self._call(self.node.begin)
            loop.begun = True
        elif optimizer.needs_resync:
            self._call(self.node.resync)
        if loop.due():
            run_state.after_step(loop)

    # The Collective the outer optimizer averages through: the node's, on the swarm's trio loop
    # (the optimizer's calls arrive there already: it was entered on that loop). Every call and
    # capability but `watch` goes to it as it came (collective/forwarding.py).

    @property
    def inner(self) -> Collective:  # type: ignore[override]  # read where the call is made
        assert self.node.collective is not None  # started in __init__
        return self.node.collective

    # -- the thread ------------------------------------------------------------------------------

    def _call(self, fn: Any, *args: Any) -> Any:
        if self._done.is_set():
            raise MeshtrainError("the swarm's node has stopped" + (f": {self._error}" if self._error else ""))
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def _main(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            async with trio.open_nursery() as nursery:

                async def ready() -> None:
                    await self.node.network_ready.wait()
                    self._ready.set()

                nursery.start_soon(ready)
                self._result = await self.node.run()
                nursery.cancel_scope.cancel()

        try:
            trio.run(main)
        except BaseExceptionGroup as eg:  # our nursery's: what ended the node, as itself
            self._error = meshtrain_error_in(eg) or eg
        except BaseException as e:  # noqa: BLE001 - handed to the user's thread
            self._error = e
        finally:
            self._done.set()
            self._ready.set()


class LoopTrainer(TrainedState):
    """The `TrainedState` of a user's loop: their model and outer optimizer, and the numbers
    `Swarm.report` hands over."""

    def __init__(self, outer: OuterOptimizer, spec: SwarmSpec) -> None:
        self.spec, self.outer, self.model = spec, outer, outer.model
        self.device = next((p.device for p in outer.model.parameters()), torch.device("cpu"))
        self.info = StepInfo()
        self.lock = threading.Lock()
        self.begun = False
        self._loss: float | None = None
        self._eval_loss: float | None = None
        self._reported = (-1, -1)  # (step, rounds) of the last after_step
        self._t_last, self._step_last = time.monotonic(), 0

    def report(self, *, loss: float | None, eval_loss: float | None) -> None:
        if loss is not None:
            self._loss = float(loss)
        if eval_loss is not None:
            self._eval_loss = float(eval_loss)

    def due(self) -> bool:
        """Every `REPORT_EVERY` steps and after a round (then the numbers are published)."""
        step, rounds = self.step, self.outer.rounds
        if (step, rounds) == self._reported or (step % REPORT_EVERY and rounds == self._reported[1]):
            return False
        self._reported = (step, rounds)
        now = time.monotonic()
        rate = self.spec.data.batch_size * max(0, step - self._step_last) / max(now - self._t_last, 1e-9)
        self._t_last, self._step_last = now, step
        eval_loss, self._eval_loss = self._eval_loss, None
        self.publish(step, self._loss, rate, eval_loss)
        return True


def _config(data_dir: str | Path, options: dict[str, Any]) -> NodeConfig:
    return load_node_config(None, overrides={"data_dir": str(data_dir), **options})
