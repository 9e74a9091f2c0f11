"""`Node`: one meshtrain peer, as the composition of the services it names, and its lifecycle.

    start ─► resolve the swarm spec (file, or fetched from the peer we join, verified)
          ─► Host ─► TensorStreams (data plane) ─► NatTraversal (if enabled)
          ─► PeerPresence: DHT, mDNS, CRDT membership (as "syncing"), re-dialling
          ─► SwarmCollective ─► Trainer ─► RunState ─► StatusServer
          ─► enter: resume our checkpoint, or — if the swarm is past it — download the current
             state from several peers in parallel and enter at the swarm's step (RunState)
          ─► "trainer": train in a worker thread; after each outer round publish the state for
             joiners; checkpoint every `checkpoint_every` seconds in the background
          ─► stop (spec's steps reached, `stop()`, SIGINT/SIGTERM): leave the swarm (tombstone),
             let the current step finish (a round in flight gets a short grace, then is cancelled:
             the collective tells the others at once), save a checkpoint, exit 0. A second signal
             exits at once.

Where each concern lives: who is in the swarm and staying connected — `node/presence.py`; which
state we train on (resume, download, parity, donor publishing, checkpoints) — `node/run_state.py`;
the training loop — `node/trainer.py`; the status document — `node/status.py`, its server — `node/status_server.py`. This
module wires them, runs the training loop's start and stop, and writes the status document.

Files in `data_dir`: identity.key (0600), swarm.json (the signed spec), checkpoints/,
daemon.json (pid, peer id, addresses, status url: how `meshtrain node status/stop` find us),
control.token (0600: the bearer token `node stop` must present), history.json (loss history).

Membership for a round is the live peers whose role is "trainer" and whom we are connected to: a
peer still downloading state is not waited for, and a peer whose connection closed (killed,
partitioned) stops being waited for at once rather than when its lease runs out.

Chaos-proofing (issue 14):
- **Who may take part.** Only members get data-plane sessions (`TensorStreams.authorize`); only
  a round's candidates may join, report or watch it, and only near our own step (the
  collective's `round_window`). Refusals are counted and shown on `/metrics`. Members are the
  peers the spec's admission rule admits (issue 21, node/admission.py: a proof of work, the
  owner's allowlist — `allow_peer`, reached through `POST /allow` — or the swarm key); a node
  the others do not admit yet waits before it enters the swarm, and says why.
- **Parity.** After every round we hash φ and publish the digest with our progress; a watcher
  compares it with every live trainer's. In the minority — a split round, a round we spent
  alone — we log it, show it on `/status`, and re-sync from the majority's holders (RunState).
- **Joins never give up on a transient** (RunState.download); only a state that cannot fit this
  node (another model or optimizer) ends the node, as a configuration error.
- **What it waits for.** `round_status()["waiting"]` (on `/status` and the console) names the
  peers a round waits for, or the download in progress; the collective logs a round that still
  waits every few seconds.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import signal
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import trio

import meshtrain
from meshtrain.backoff import Backoff
from meshtrain.collective import AllReduceConfig, SwarmCollective
from meshtrain.crdt.swarm_view import SwarmView
from meshtrain.dht.discovery import Discovery
from meshtrain.dht.records import DhtError
from meshtrain.errors import ConfigError, MeshtrainError, meshtrain_error_in
from meshtrain.log import get_logger, kv
from meshtrain.models.sources import check_local_copy
from meshtrain.node.admission import allow_key, load_or_mint_pow
from meshtrain.node.checkpoint import write_atomic
from meshtrain.node.config import NodeConfig
from meshtrain.node.devices import device_label, resolve_device
from meshtrain.node.outer_spec import check_copy as check_outer_copy
from meshtrain.node.parity import ParityMonitor
from meshtrain.node.presence import PeerPresence
from meshtrain.node.run_state import NodeError, Phase, RunState, StopRequest
from meshtrain.node.status import DAEMON_FILE, TOKEN_FILE, read_daemon_file  # noqa: F401
from meshtrain.node.status_server import StatusServer
from meshtrain.node.swarm_spec import SPEC_RPC, JoinTarget, SignedSpec, SpecError, parse_join_address
from meshtrain.node.trainer import OuterFactory, TrainedState, Trainer
from meshtrain.transport.host import Host, HostConfig
from meshtrain.transport.identity import Identity
from meshtrain.transport.nat import NatConfig, NatTraversal
from meshtrain.transport.reachability import ReachabilityError
from meshtrain.transport.rpc import RpcError
from meshtrain.transport.tensor_streams import TensorStreams

if TYPE_CHECKING:
    from meshtrain.node.rank_group import LocalRanks

log = get_logger(__name__)

__all__ = ["Node", "NodeError", "NodeResult"]

SPEC_FILE = "swarm.json"
STOP_GRACE = 3.0  # seconds a step in flight may take to finish after a stop request
ADMISSION_POLL = 1.0  # seconds between two looks at our own admission while we are not admitted


@dataclass(frozen=True)
class NodeResult:
    peer_id: str
    step: int
    rounds: int
    eval_loss: float | None
    checkpoint: str | None
    stopped_early: bool


class Node:
    """One peer. `await Node(config, spec=...).run()`; `stop()` from anywhere ends it cleanly.

    spec: the swarm to create/run (`SignedSpec`); else `join` (a peer multiaddr, optionally
        `<swarm id>@<multiaddr>`, to fetch it from; or a swarm id or name, looked up in the DHT's
        swarm index through `config.bootstrap`); else `data_dir/swarm.json` from an earlier run.
    model, outer_factory: the Python API's hooks — your own `torch.nn.Module` (forward(x, y) →
        loss) and `outer_factory(model, inner, collective) -> OuterOptimizer` (e.g. a custom
        outer optimizer); every peer of the swarm must use the same.
    local: the local-rank group when this process is rank 0 (the gateway) of a multi-GPU peer
        (node/local_ranks.py builds it); None for a single-process peer.
    user_loop: loop mode, for `meshtrain.Swarm` (node/user_loop.py): no trainer of its own; it
        serves the optimizer of the user's loop (`adopt`, `begin`, `resync`) and watches no
        signals (the user's program owns them).

    While it runs, its parts are attributes (None until started): `host`, `streams`, `nat`,
    `presence` (with `view` and `discovery`), `collective`, `trainer`, `run_state` (with `parity`).
    """

    def __init__(
        self,
        config: NodeConfig,
        *,
        spec: SignedSpec | None = None,
        join: str | None = None,
        model: torch.nn.Module | None = None,
        outer_factory: OuterFactory | None = None,
        local: LocalRanks | None = None,
        user_loop: bool = False,
    ) -> None:
        if config.nproc_per_node > 1 and local is None:
            raise ConfigError(
                f"nproc_per_node = {config.nproc_per_node}: a multi-rank peer is started by "
                f"`meshtrain node start --nproc-per-node N` (torch's launcher runs the ranks); "
                f"a Node built in Python is one process"
            )
        self.config = config
        self._local = local
        self.data_dir = Path(config.data_dir).expanduser()
        self._spec_arg = spec
        self._join = parse_join_address(join) if join else None
        self._entry_addrs = [self._join.addr] if self._join and self._join.addr else []
        self._model = model
        self._outer_factory = outer_factory
        self._stop = StopRequest()
        self._token: trio.lowlevel.TrioToken | None = None
        self.phase = Phase()
        self.stop_signal: str | None = None  # the signal that stopped us, if one did
        self.started = time.time()
        self.signed: SignedSpec | None = None
        self.host: Host | None = None
        self.streams: TensorStreams | None = None
        self.nat: NatTraversal | None = None
        self.presence: PeerPresence | None = None
        self.collective: SwarmCollective | None = None
        self.trainer: Trainer | None = None
        self.run_state: RunState | None = None
        self.status_url: str | None = None
        self._waiting: str | None = None  # what start-up waits for (the peer we join through)
        # Loop mode (`meshtrain.Swarm`): the user's loop trains; the node serves it.
        self._user_loop = user_loop
        self.network_ready = trio.Event()  # host, data plane, presence and collective are up
        self._adopted: TrainedState | None = None
        self._adopt = trio.Event()
        self._outer_entered = trio.Event()

    @property
    def state(self) -> str:
        """starting, syncing, training, stopping."""
        return self.phase.value

    @property
    def view(self) -> SwarmView | None:
        return self.presence.view if self.presence is not None else None

    @property
    def discovery(self) -> Discovery | None:
        return self.presence.discovery if self.presence is not None else None

    @property
    def parity(self) -> ParityMonitor | None:
        return self.run_state.parity if self.run_state is not None else None

    @property
    def joined_from(self) -> dict[str, Any] | None:
        return self.run_state.joined_from if self.run_state is not None else None

    # -- control -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the node to stop cleanly (thread-safe; idempotent)."""
        self._stop.flag.set()
        if self._token is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except (RuntimeError, trio.RunFinishedError):  # already on the trio thread, or gone
                self._stop.set()

    def allow_peer(self, peer_id: str, allowed: bool = True) -> None:
        """Owner of an allowlist swarm: admit `peer_id` (or, `allowed=False`, revoke it) at run
        time, by writing `allow/<peer id>` into the swarm's owner-only config CRDT; every peer
        applies it as it arrives. Call on the trio thread (`meshtrain swarm allow` reaches it
        through the status endpoint). `ConfigError` for a non-allowlist swarm or a bad peer id,
        `NotSwarmOwner` if this node does not own the swarm, `NodeError` before it is up."""
        view, signed = self.view, self.signed
        if view is None or signed is None:
            raise NodeError("the node is still starting; try again once it is up")
        if signed.spec.admission != "allowlist":
            raise ConfigError(
                f"swarm {signed.swarm_id} admits by {signed.spec.admission}, not by allowlist; nothing to allow"
            )
        view.set_config({allow_key(peer_id): allowed})
        log.warning(kv("allowlist changed", peer=peer_id, allowed=allowed))

    # -- the run ---------------------------------------------------------------------------------

    async def run(self) -> NodeResult:
        """Run until stopped or done. A `MeshtrainError` (a configuration mistake, a swarm that
        cannot be joined) is raised as itself, not inside the nurseries' exception groups."""
        try:
            return await self._run()
        except BaseExceptionGroup as eg:
            err = meshtrain_error_in(eg)
            if err is None:
                raise
            raise err from None

    async def _run(self) -> NodeResult:
        self._token = trio.lowlevel.current_trio_token()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        identity = Identity.load_or_create(self.data_dir)
        config = self.config
        async with AsyncExitStack() as stack:
            # Signals first: a Ctrl-C during start-up (imports, bootstrap, a state download) must
            # reach the node, which then stops as soon as it can (before its first step).
            if not self._user_loop:
                signals = await stack.enter_async_context(trio.open_nursery())
                stack.callback(signals.cancel_scope.cancel)
                signals.start_soon(self._watch_signals)
            host = self.host = await stack.enter_async_context(
                Host(identity, HostConfig(listen=config.listen, swarm_key=config.swarm_key, announce=config.announce))
            )
            signed = self.signed = await self._resolve_spec(host)
            host.rpc.serve(SPEC_RPC, self._serve_spec)
            streams = self.streams = await stack.enter_async_context(TensorStreams(host))
            bootstrap = list(config.bootstrap) + ([self._join.addr] if self._join and self._join.addr else [])
            spec = signed.spec
            pow_nonce = None
            if spec.admission == "open" and spec.pow_bits:  # minted once, kept in the data dir
                pow_nonce = await trio.to_thread.run_sync(
                    load_or_mint_pow, self.data_dir, signed.swarm_id, host.peer_id, spec.pow_bits
                )
            presence = self.presence = PeerPresence(
                host, signed, bootstrap=bootstrap, mdns=config.mdns, connection="direct", pow_nonce=pow_nonce
            )
            if config.nat:  # before any peer connects, so every relayed peer can be punched
                self.nat = presence.nat = await stack.enter_async_context(
                    NatTraversal(
                        host,
                        streams,
                        relays=presence.relay_candidates,
                        config=NatConfig(
                            serve_relay_when_public=config.relay, upnp=config.upnp and _beyond_loopback(config.listen)
                        ),
                    )
                )
                presence.connection = "unknown"
            await stack.enter_async_context(presence)
            # Only members get data-plane sessions; only round candidates may join a round, and
            # only near our step (a stranger's join for a far-future round voided real rounds).
            streams.authorize = presence.is_member
            collective = self.collective = await stack.enter_async_context(
                SwarmCollective(
                    host,
                    streams,
                    presence.candidates,
                    AllReduceConfig(
                        join_timeout=config.join_timeout,
                        part_timeout=config.part_timeout,
                        round_window=max(4 * signed.spec.H, 64),
                    ),
                    current_round=self._current_round,
                )
            )
            self.network_ready.set()
            if config.threads:
                torch.set_num_threads(config.threads)
            local = self._local
            trainer: TrainedState
            if self._user_loop:
                await self._adopt.wait()
                assert self._adopted is not None  # set with the event
                trainer = self.trainer = self._adopted
            else:
                trainer = self.trainer = Trainer(
                    signed.spec,
                    local.collective(collective) if local else collective,
                    host.peer_id,
                    model=self._model,
                    outer_factory=self._outer_factory,
                    local=local,
                    device=None if local else resolve_device(config.device),
                    data_dir=self.data_dir,
                )
            run_state = self.run_state = await stack.enter_async_context(
                RunState(trainer, presence, streams, config, self.data_dir, phase=self.phase, stop=self._stop)
            )
            if self.nat is not None:
                # announce how we are reached (public / relayed / private) and our circuit
                # addresses while private, in our membership record
                view = presence.view
                assert view is not None  # entered above
                self.nat.on_announce(lambda conn, addrs: view.set_connection(conn, addrs))
                probes = await stack.enter_async_context(trio.open_nursery())
                stack.callback(probes.cancel_scope.cancel)
                probes.start_soon(self._first_probe, self.nat)
            await self._start_status(stack)
            self._write_daemon_file(host, signed)
            log.warning(
                kv(
                    "node started",
                    peer=host.peer_id,
                    swarm=signed.swarm_id,
                    addrs=",".join(host.addrs),
                    status=self.status_url,
                )
            )
            try:
                if self._user_loop:
                    return await self._serve_loop(trainer, presence, run_state)
                assert isinstance(trainer, Trainer)
                return await self._train(trainer, presence, run_state)
            finally:
                (self.data_dir / DAEMON_FILE).unlink(missing_ok=True)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _resolve_spec(self, host: Host) -> SignedSpec:
        if self._spec_arg is not None:
            signed = self._spec_arg
        elif self._join is not None:
            if self._join.addr is None:
                self._join = await self._find_swarm(self._join)
            want, addrs = self._join.swarm_id, self._entry_addrs
            backoff = Backoff(initial=2.0, cap=30.0)
            attempt = 0
            while True:  # an unreachable peer is a transient (restarting, partitioned): keep asking
                addr = addrs[attempt % len(addrs)]
                attempt += 1
                try:
                    peer = await host.connect(addr, timeout=15)
                    break
                except MeshtrainError as e:
                    delay = backoff.next()
                    log.warning(
                        kv(
                            "cannot reach the peer to join through; retrying (Ctrl-C to give up)",
                            addr=addr,
                            error=str(e)[:200],
                            retry_in_s=round(delay, 1),
                        )
                    )
                    self._waiting = f"joining: waiting for {addr} to answer"
                    await self._stop.sleep(delay)
                    if self._stop.is_set():
                        raise NodeError(f"stopped before {addr} answered") from None
            self._waiting = None
            try:
                signed = SignedSpec.from_wire(await host.rpc.call(peer, SPEC_RPC, {}, timeout=15), expect_id=want)
            except RpcError as e:
                raise NodeError(f"{addr} did not send a swarm spec ({e}); is it a meshtrain node?") from None
            except SpecError as e:
                raise NodeError(f"{addr}: {e}") from None
        else:
            path = self.data_dir / SPEC_FILE
            if not path.exists():
                raise NodeError(
                    f"no swarm to run: {path} does not exist. Create a swarm (`meshtrain swarm "
                    f"create`) or join one (`meshtrain swarm join <multiaddr>`)"
                )
            signed = SignedSpec.load(path)
        spec = signed.spec
        if spec.admission == "private" and self.config.swarm_key is None:
            raise ConfigError(
                f"swarm {signed.swarm_id} is private: pass its key (--swarm-key, or MESHTRAIN_SWARM_KEY; "
                f"`swarm create --private` wrote it to the creator's data dir)"
            )
        # our copy of the model and tokenizer files must be the swarm's
        check_local_copy(spec.model, spec.tokenizer, model_pin=spec.model_digest, tokenizer_pin=spec.tokenizer_digest)
        check_outer_copy(spec)
        existing = self.data_dir / SPEC_FILE
        if existing.exists():
            old = SignedSpec.load(existing)
            if old.swarm_id != signed.swarm_id and (self.data_dir / "checkpoints").exists():
                raise NodeError(
                    f"{self.data_dir} holds swarm {old.swarm_id}, not {signed.swarm_id}; "
                    f"use another --data-dir for another swarm"
                )
        signed.save(existing)
        return signed

    async def _find_swarm(self, target: JoinTarget) -> JoinTarget:
        """Look a swarm id or name up in the DHT's swarm index (through `config.bootstrap`)."""
        from meshtrain.node.swarm_list import find_swarms, pick_swarm

        self._waiting = f"looking up swarm {target.wanted!r} in the DHT's swarm index"
        try:
            found = pick_swarm(await find_swarms(self.config.bootstrap), target.wanted)
        except DhtError as e:
            raise NodeError(f"cannot look up swarm {target.wanted!r}: {e}") from None
        if not found.addrs:
            raise NodeError(f"swarm {found.swarm_id} is listed without an address to join through")
        self._waiting = None
        log.warning(kv("found the swarm", swarm=found.swarm_id, name=found.name, entry=found.addrs[0]))
        self._entry_addrs = list(found.addrs)
        return JoinTarget(found.swarm_id, found.addrs[0])

    async def _serve_spec(self, peer: str, req: Any) -> dict:
        assert self.signed is not None  # served only once resolved
        return self.signed.to_wire()

    async def _first_probe(self, nat: NatTraversal) -> None:
        """Probe reachability as soon as a peer can dial us back (NatTraversal re-probes later)."""
        assert self.host is not None
        for _ in range(30):
            if self.host.connected_peers():
                try:
                    if (await nat.probe()).status != "unknown":
                        return
                except ReachabilityError:
                    pass
            await trio.sleep(2.0)

    def _current_round(self) -> int | None:
        """Our step, against which the collective refuses far-away rounds; None while we are not
        in step ourselves (starting, downloading), when a far-away round may well be the swarm's."""
        if self.trainer is None or self.state != "training":
            return None
        return self.trainer.step

    async def _watch_signals(self) -> None:
        signalled = False  # a stop for another reason (a failed local rank) is not a first signal
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for sig in signals:
                if signalled:
                    log.warning("second signal: exiting at once")
                    os._exit(130)
                signalled = True
                self.stop_signal = signal.Signals(sig).name
                log.warning(kv("stopping", signal=signal.Signals(sig).name))
                self.stop()

    async def _start_status(self, stack: AsyncExitStack) -> None:
        token = secrets.token_hex(16)
        write_atomic(self.data_dir / TOKEN_FILE, token.encode())
        os.chmod(self.data_dir / TOKEN_FILE, 0o600)
        trio_token = trio.lowlevel.current_trio_token()

        def accept_stop() -> None:
            """On the status server's thread: the trainer sees the flag at its next step even if
            the trio loop is busy; the rest of `stop()` runs on the trio thread when it can."""
            self._stop.flag.set()
            try:
                trio_token.run_sync_soon(self.stop)
            except trio.RunFinishedError:
                return  # the run is over: stopped already

        try:
            srv = await stack.enter_async_context(
                StatusServer(
                    self.snapshot,
                    host=self.config.status_host,
                    port=self.config.status_port,
                    on_stop=accept_stop,
                    on_allow=lambda peer, allowed: trio.from_thread.run_sync(
                        self.allow_peer, peer, allowed, trio_token=trio_token
                    ),
                    token=token,
                )
            )
        except OSError as e:
            raise NodeError(
                f"cannot serve the status page on {self.config.status_host}:{self.config.status_port}"
                f" ({e.strerror or e}); pick another --status-port (0 = any)"
            ) from None
        self.status_url = srv.url

    def _write_daemon_file(self, host: Host, signed: SignedSpec) -> None:
        """daemon.json: how `meshtrain node status/stop` find us. They read it with
        `status.read_daemon_file` (re-exported here), as that path must not import this module."""
        info = {
            "pid": os.getpid(),
            "peer_id": host.peer_id,
            "addrs": host.addrs,
            "swarm_id": signed.swarm_id,
            "status_url": self.status_url,
            "token_file": str(self.data_dir / TOKEN_FILE),
        }
        write_atomic(self.data_dir / DAEMON_FILE, json.dumps(info).encode())

    # -- training ------------------------------------------------------------------------------

    async def _train(self, trainer: Trainer, presence: PeerPresence, run_state: RunState) -> NodeResult:
        view = presence.view
        assert view is not None and self.host is not None  # entered
        stop = self._stop
        await self._enter_swarm(run_state, presence)
        until = trainer.spec.steps
        if self.config.max_steps is not None:
            until = min(until, self.config.max_steps) if until else self.config.max_steps
        finished_cleanly = True
        async with trainer.outer:
            async with trio.open_nursery() as nursery:

                async def train() -> None:
                    while True:
                        await trio.to_thread.run_sync(trainer.run, stop.flag, until, run_state.after_step)
                        if stop.is_set() or not trainer.outer.needs_resync:
                            break
                        # We missed a round (cut off, or late for its group): our outer state
                        # differs from the swarm's. Download it again rather than drift apart.
                        await self._resync(run_state, presence)
                    stop.requested.set()

                nursery.start_soon(train)
                await stop.requested.wait()
                self.phase.set("stopping")
                stop.flag.set()
                stopped_early = until == 0 or trainer.step < until
                if stopped_early and not trainer.outer.in_flight:
                    # Others stop expecting us before we finish the step. With an exchange in
                    # flight we stay a member until it ends: a peer reaching that round after our
                    # tombstone would leave us out and we would wait for it in vain (seen in CI).
                    await view.leave()
                with trio.move_on_after(STOP_GRACE):
                    await _wait_done(nursery)
                if nursery.child_tasks:
                    log.warning("a round was in flight; cancelling it")
                    finished_cleanly = False
                    nursery.cancel_scope.cancel()
            if finished_cleanly and trainer.outer.in_flight:
                with trio.move_on_after(STOP_GRACE):
                    await trainer.outer.afinish()
                finished_cleanly = not trainer.outer.in_flight
        return await self._finish(trainer, view, run_state, save=finished_cleanly, stopped_early=stopped_early)

    async def _enter_swarm(self, run_state: RunState, presence: PeerPresence) -> None:
        """Wait to be admitted, resume or download the swarm's state, count as a trainer, wait
        for `wait_peers`."""
        view = presence.view
        assert view is not None  # entered
        await self._wait_admitted(presence)
        await run_state.enter()
        view.role = "trainer"
        view.heartbeat()
        await self._wait_for_peers(presence)
        self.phase.set("training")

    async def _wait_admitted(self, presence: PeerPresence) -> None:
        """Until the swarm's peers admit us (an allowlist swarm whose owner has not allowed us
        yet), say so and wait: they ignore our records, serve us no state and take us into no
        round."""
        assert self.host is not None  # entered
        told = False
        while (reason := presence.not_admitted()) is not None and not self._stop.is_set():
            self._waiting = (
                f"not admitted to the swarm ({reason}): its owner admits this node with "
                f"`meshtrain swarm allow {self.host.peer_id}`"
            )
            if not told:
                log.warning(kv("waiting for admission", reason=reason, peer=self.host.peer_id))
                told = True
            await self._stop.sleep(ADMISSION_POLL)
        if self._stop.is_set():
            raise NodeError("stopped before the swarm admitted this node")
        self._waiting = None

    async def _resync(self, run_state: RunState, presence: PeerPresence) -> None:
        """We missed a round (cut off, late for its group) or parity says we are in the minority:
        our outer state differs from the swarm's. Download it again rather than drift apart."""
        view, trainer = presence.view, run_state.trainer
        assert view is not None  # entered
        log.warning(kv("out of step with the swarm; downloading its state", step=trainer.step))
        view.role = "syncing"
        view.heartbeat()
        await run_state.download()
        view.role = "trainer"
        view.heartbeat()
        self.phase.set("training")

    async def _finish(
        self, trainer: TrainedState, view: SwarmView, run_state: RunState, *, save: bool, stopped_early: bool
    ) -> NodeResult:
        """Checkpoint (unless stopped mid-round), leave the swarm, write the loss history."""
        assert self.host is not None  # running
        path = None
        if save:
            path = await run_state.save_final()
        else:
            log.warning(
                kv(
                    "stopped mid-round; the last periodic checkpoint stands",
                    checkpoint=run_state.last_checkpoint.get("path"),
                )
            )
        if not view.has_left:
            await view.leave()
        with trainer.lock:
            history = list(trainer.info.history)
        write_atomic(self.data_dir / "history.json", json.dumps(history).encode())
        return NodeResult(
            self.host.peer_id,
            trainer.step,
            trainer.outer.rounds,
            trainer.info.eval_loss,
            path or run_state.last_checkpoint.get("path"),
            stopped_early,
        )

    # -- loop mode (meshtrain.Swarm: the user's loop trains) -------------------------------------

    async def adopt(self, trainer: TrainedState) -> None:
        """Serve the user's loop's optimizer (`trainer.outer`); returns once it is entered on our
        trio loop (its collective calls from the user's thread land here)."""
        if not self._user_loop or self._adopted is not None:
            raise NodeError("this node does not take a user loop's optimizer (one per Swarm)")
        self._adopted = trainer
        self._adopt.set()
        await self._outer_entered.wait()

    async def begin(self) -> None:
        """The user's first step: join the swarm's state (resume or download), then train."""
        run_state, presence = self.run_state, self.presence
        assert run_state is not None and presence is not None  # adopt() waited for them
        run_state.parity.enabled = run_state.trainer.outer.replicas_identical  # now fully built
        await self._enter_swarm(run_state, presence)

    async def resync(self) -> None:
        """The user's loop lost step with the swarm: download its state (between two steps)."""
        run_state, presence = self.run_state, self.presence
        assert run_state is not None and presence is not None
        await self._resync(run_state, presence)

    async def _serve_loop(self, trainer: TrainedState, presence: PeerPresence, run_state: RunState) -> NodeResult:
        """Loop mode: hold the user's optimizer entered until `stop()`, then finish its exchange in
        flight, checkpoint and leave."""
        view = presence.view
        assert view is not None  # entered
        async with trainer.outer:
            self._outer_entered.set()
            await self._stop.requested.wait()
            self.phase.set("stopping")
            if trainer.outer.in_flight:
                with trio.move_on_after(self.config.join_timeout):
                    await trainer.outer.afinish()
        began = self.phase.changes > 1  # starting -> training happened
        return await self._finish(
            trainer, view, run_state, save=began and not trainer.outer.in_flight, stopped_early=False
        )

    async def _wait_for_peers(self, presence: PeerPresence) -> None:
        """With `wait_peers`, start training only once that many trainers (us included) are in
        the swarm, so a swarm started together begins its first round together."""
        want = self.config.wait_peers
        if want <= 1:
            return
        with trio.move_on_after(self.config.wait_peers_timeout):
            while len(presence.trainers()) < want and not self._stop.is_set():
                await trio.sleep(0.1)
        have = len(presence.trainers())
        if have < want:
            log.warning(kv("starting without every awaited peer", have=have, want=want))

    # -- status -------------------------------------------------------------------------------

    def round_status(self) -> dict[str, Any]:
        """The outer rounds as the status page shows them: `phi_round`, `phi_digest` (hex),
        `phi_history` ([[round, digest hex], ...], newest last), `parity` (this peer's standing
        against the swarm's φ digests), `waiting` (what a round waits for now, or None) and
        `refused` (requests refused to non-members and the like, by reason)."""
        parity = self.parity
        history = list(parity.history) if parity is not None else []
        waiting = (
            self._waiting
            or (self.run_state.waiting if self.run_state is not None else None)
            or (self.collective.waiting_for() if self.collective is not None else None)
        )
        return {
            "phi_round": history[-1][0] if history else None,
            "phi_digest": history[-1][1].hex() if history else None,
            "phi_history": [[r, d.hex()] for r, d in history],
            "parity": parity.status() if parity is not None else None,
            "waiting": waiting,
            "refused": self.refused(),
        }

    def _admission_status(self) -> dict[str, Any]:
        """How this swarm admits peers, whether the others admit us, whom we ignore."""
        spec, presence = self.signed.spec if self.signed else None, self.presence
        if spec is None or presence is None or presence.view is None:
            return {"rule": spec.admission if spec else None, "not_admitted": None, "ignored": []}
        return {"rule": spec.admission, "not_admitted": presence.not_admitted(), "ignored": presence.ignored()}

    def refused(self) -> dict[str, int]:
        """Requests refused to peers, by reason (`not-a-member`, `round-out-of-window`, ...):
        the collective's and the data plane's, for `/metrics`."""
        out: dict[str, int] = {}
        for counts in (
            self.collective.refused if self.collective else {},
            self.streams.refused if self.streams else {},
        ):
            for reason, n in counts.items():
                if n:
                    out[reason] = out.get(reason, 0) + n
        return out

    def snapshot(self) -> dict[str, Any]:
        """The status document (schema in `meshtrain.node.status`). Call it on the trio thread; it
        never waits for a training step (the trainer thread holds `trainer.lock` only while it
        publishes a step's numbers), so the status page and the console stay live under load."""
        host, view, trainer = self.host, self.view, self.trainer
        now = time.time()
        node = {
            "peer_id": host.peer_id if host else "",
            "name": self.config.name,
            "version": meshtrain.__version__,
            "started": self.started,
            "uptime_s": now - self.started,
            "swarm": self.signed.swarm_id if self.signed else "",
            "state": self.state,
            "state_changes": self.phase.changes,
            "recent_states": self.phase.recent(),
            "listen": host.addrs if host else [],
            "reachability": self.nat.connection_type if self.nat is not None else "unknown",
            "device": device_label(trainer.device) if trainer is not None else self.config.device,
            "local_ranks": self._local.world_size if self._local is not None else 1,
            "sharding": self._local.sharding if self._local is not None else "none",
            "local_rank_pids": self._local.pids if self._local is not None else [os.getpid()],
            "admission": self._admission_status(),
        }
        training: dict[str, Any] = {
            "step": 0,
            "round": 0,
            "loss": None,
            "eval_loss": None,
            "optimizer": "",
            "samples_per_s": 0.0,
            "bytes_sent": 0,
            "bytes_received": 0,
            "history": [],
        }
        if trainer is not None:
            with trainer.lock:  # copies only: the critical section is microseconds
                info = trainer.info
                st = trainer.outer.stats()
                training.update(
                    step=info.step,
                    round=info.rounds,
                    loss=info.loss,
                    eval_loss=info.eval_loss,
                    samples_per_s=info.samples_per_s,
                    bytes_sent=st["bytes_sent"],
                    bytes_received=st["bytes_received"],
                    history=list(info.history),
                )
            training["optimizer"] = trainer.spec.optimizer
        training.update(self.round_status())
        if training.get("waiting") is None and self.state == "starting":
            # What start-up waits for (rounds say it themselves through round_status).
            if self.signed is None and self._join is not None and self._join.addr:
                training["waiting"] = f"fetching the swarm spec from {self._join.addr}"
            elif view is None:
                training["waiting"] = "connecting to the swarm (bootstrap peers, DHT, membership)"
            elif self.config.wait_peers > 1 and trainer is not None and self.presence is not None:
                have = len(self.presence.trainers())
                if have < self.config.wait_peers:
                    training["waiting"] = (
                        f"waiting for {self.config.wait_peers - have} more peer(s) before "
                        f"training starts ({have} of {self.config.wait_peers} here)"
                    )
        peers = []
        if view is not None and host is not None:
            progress, metrics = view.progress(), view.metrics()
            for p in view.live_peers():
                pr, me = progress.get(p.peer_id), metrics.get(p.peer_id)
                peers.append(
                    {
                        "peer_id": p.peer_id,
                        "addr": p.addrs[0] if p.addrs else "",
                        "connection": (
                            "self" if p.peer_id == host.peer_id else host.connection_type(p.peer_id) or "none"
                        ),
                        "role": p.role,
                        "step": pr.step if pr else 0,
                        "loss": me.values.get("loss") if me else None,
                        "last_seen_s": max(0.0, now - p.last_heartbeat_ms / 1000),
                        "reachability": p.connection,
                    }
                )
        return {
            "node": node,
            "training": training,
            "peers": peers,
            "checkpoint": dict(self.run_state.last_checkpoint)
            if self.run_state
            else {"last_step": None, "path": None, "saved_at": None},
            "joined_from": self.joined_from,
        }


async def _wait_done(nursery: trio.Nursery) -> None:
    while nursery.child_tasks:
        await trio.sleep(0.05)


def _beyond_loopback(listen: list[str]) -> bool:
    """Whether any listen address can be reached from the LAN (UPnP is pointless otherwise, and
    a loopback-only node — tests, the demo — must not multicast on the LAN)."""
    for addr in listen:
        ip = addr.split("/")[2] if addr.startswith(("/ip4/", "/ip6/")) else ""
        try:
            if not ipaddress.ip_address(ip).is_loopback:
                return True
        except ValueError:
            return True  # a DNS name: assume it is reachable
    return False
