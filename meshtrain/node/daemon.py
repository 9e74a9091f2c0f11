"""`Node`: one meshtrain peer, as the composition of the services it names, and its lifecycle.

    start ─► resolve the swarm spec (file, or fetched from the peer we join, verified)
          ─► Host ─► TensorStreams (data plane) ─► NatTraversal (if enabled)
          ─► PeerPresence: DHT, mDNS, CRDT membership (as "syncing"), re-dialling
          ─► SwarmCollective ─► StatusServer ─► daemon.json
          ─► Trainer, built in a worker thread ("preparing") ─► RunState
          ─► the training run (node/training_run.py: enter, train, stop, checkpoint, leave) until
             the spec's steps, `stop()` or SIGINT/SIGTERM/SIGHUP (a second signal exits at once;
             SIGHUP — a closed terminal — is left alone where it is ignored, as under nohup)
          ─► remove daemon.json; exit 0

Where each concern lives: who is in the swarm and staying connected — `node/presence.py`; which
state we train on (resume, parity, donors, checkpoints) — `node/state/run_state.py`, `node/state/download.py`;
the training loop — `node/trainer.py`; entering, stopping and finishing the run —
`node/training_run.py`; the status document — `node/status/client.py`, its server —
`node/status/server.py`; which swarm we run — `node/spec/resolve.py`. This module builds and
wires the services in that order (`_start_network`, `_start_collective`, `_start_trainer`),
hands them to the training run, watches signals and writes daemon.json and the control token.

Files in `data_dir`: identity.key (0600), swarm.json (the signed spec), checkpoints/,
daemon.json (pid, peer id, addresses, status url: how `meshtrain node status/stop` find us),
control.token (0600: the bearer token `node stop` must present), history.json (loss history),
strikes.bin (the swarm's signed strikes, node/trust/strikes.py), admission.json (our proof of work),
peers.json (the swarm's trainers we saw, to find them again after a restart: node/state/address_book.py),
node.lock (locked while we run: one node per data dir, of one swarm: node/spec/data_dir.py).

Every all-reduce of the swarm (the optimizer's, and any other through `node.collective`) combines
contributions by the spec's `aggregation` (mean, trimmed_mean, clipped_mean), set once here in the
collective's `AllReduceConfig` from `SwarmSpec.aggregation_options()`; `meshtrain.Swarm` runs this
same Node, so a loop of your own gets it too.

Start-up never freezes the node. Everything that may take long with a real model and corpus —
loading the model, digesting and tokenising the dataset (`Trainer`, `load_data`), hashing the
model's files against the spec's pins (node/spec/resolve.py) — runs in a worker thread, while the
trio thread keeps heartbeating (as "syncing": rounds do not wait for us), serving `/status` (state
"preparing", `training.waiting` saying what) and `node stop`, and hearing Ctrl-C. The status
server and daemon.json come before the trainer, so `node status`/`node stop` find a preparing
node. A stop while preparing ends start-up at once (`StoppedWhileStarting`, exit 130); the
worker thread, which cannot be interrupted mid-call, is abandoned (trio's workers are daemon
threads: the process exits without waiting for it) — except a multi-rank peer's, whose build
talks to its other ranks: its stop is heard once the build is done.

Membership for a round is the live peers whose role is "trainer" and whom we are connected to: a
peer still downloading state is not waited for, and a peer whose connection closed (killed,
partitioned) stops being waited for at once rather than when its lease runs out.

Chaos-proofing (what a churn soak of real daemons found, scripts/bench/bench_chaos.py):
- **Who may take part.** Only members get data-plane sessions (`TensorStreams.authorize`); only
  a round's candidates may join, report or watch it, and only near our own step (the
  collective's `round_window`). Refusals are counted and shown on `/metrics`. Members are the
  peers the spec's admission rule admits (node/trust/admission.py: a proof of work, the
  owner's allowlist — `allow_peer`, reached through `POST /allow` — or the swarm key); a node
  the others do not admit yet waits before it enters the swarm (node/training_run.py).
- **Parity.** After every round we hash φ and publish the digest with our progress; a watcher
  compares it with every live trainer's. In the minority — a split round, a round we spent
  alone — we log it, show it on `/status`, and re-sync from the majority's holders (RunState).
  Off while the spec's `group_size` has rounds run in groups (their replicas differ by design).
- **Joins never give up on a transient** (SwarmDownload.download); only a state that cannot fit this
  node (another model or optimizer) ends the node, as a configuration error.
- **What it waits for.** `round_status()["waiting"]` (on `/status` and the console) names the
  peers a round waits for, or the download in progress; the collective logs a round that still
  waits every few seconds.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import signal
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import trio

from meshtrain.allocator import release_freed_memory
from meshtrain.collective import AllReduceConfig, SwarmCollective
from meshtrain.crdt.swarm_view import SwarmView
from meshtrain.data import Progress, ProgressCallback
from meshtrain.dht.discovery import Discovery
from meshtrain.durable import write_atomic
from meshtrain.errors import ConfigError, meshtrain_error_in
from meshtrain.log import get_logger, kv
from meshtrain.node.phase import NodeError, Phase, StopRequest
from meshtrain.node.presence import PeerPresence
from meshtrain.node.ranks.devices import resolve_device
from meshtrain.node.spec.config import NodeConfig
from meshtrain.node.spec.data_dir import DataDirLock, make_data_dir
from meshtrain.node.spec.resolve import SpecResolver
from meshtrain.node.spec.signed import SPEC_RPC, JoinTarget, SignedSpec
from meshtrain.node.stages.export import PipelineExporter
from meshtrain.node.stages.peer import PipelinePeer
from meshtrain.node.state.parity import ParityMonitor
from meshtrain.node.state.run_state import RunState
from meshtrain.node.status.client import DAEMON_FILE, TOKEN_FILE, write_daemon_file
from meshtrain.node.status.document import round_status, status_document
from meshtrain.node.status.server import StatusServer
from meshtrain.node.status.tensorboard import TensorBoardLog
from meshtrain.node.trainer import OuterFactory, TrainedState, Trainer
from meshtrain.node.training_run import NodeResult, TrainingRun, run_pipeline_peer
from meshtrain.node.trust import adversary
from meshtrain.node.trust.admission import allow_key, load_or_mint_pow
from meshtrain.node.trust.scoring import LossScorer
from meshtrain.node.trust.spot_check import SpotChecker
from meshtrain.node.trust.verification import Verification
from meshtrain.transport.host import Host, HostConfig, host_connection_cap
from meshtrain.transport.identity import Identity
from meshtrain.transport.nat import NatConfig, NatTraversal
from meshtrain.transport.reachability import ReachabilityError
from meshtrain.transport.relay import RelayConfig
from meshtrain.transport.tensor_streams import DataPlaneConfig, TensorStreams

if TYPE_CHECKING:
    from meshtrain.node.ranks.group import LocalRanks

log = get_logger(__name__)

__all__ = ["Node", "NodeError", "NodeResult"]


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
        release_freed_memory()  # a round's and a checkpoint's freed buffers leave the process (allocator.py)
        self.config = config
        self.local = local
        self.data_dir = Path(config.data_dir).expanduser()
        self._model = model
        self._outer_factory = outer_factory
        self._stop = StopRequest()
        self.spec_source = SpecResolver(
            config, self.data_dir, spec=spec, join=join, stop=self._stop, on_waiting=self._say_waiting
        )
        self.adversary = adversary.mode_from_env()  # a test hook (node/trust/adversary.py); None: honest
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
        self.trainer: TrainedState | None = None
        self.scorer: LossScorer | None = None  # loss scoring of sampled contributions (node/trust/scoring.py)
        self.spot_checker: SpotChecker | None = None  # replay spot-checks of them (node/trust/spot_check.py)
        self.run_state: RunState | None = None
        self.pipeline: PipelinePeer | None = None  # a pipeline swarm's run path (instead of trainer, run_state)
        self.pipeline_exporter: PipelineExporter | None = None  # `meshtrain export` in a pipeline swarm
        self.status_url: str | None = None
        self.startup_waiting: str | None = None  # what start-up waits for (the peer we join through)
        # Loop mode (`meshtrain.Swarm`): the user's loop trains; the node serves it.
        self._user_loop = user_loop
        self.network_ready = trio.Event()  # host, data plane, presence and collective are up
        self._adopted: TrainedState | None = None
        self._adopt = trio.Event()
        self._outer_entered = trio.Event()
        self._training: TrainingRun | None = None  # the run, once its services are up (node/training_run.py)

    @property
    def state(self) -> str:
        """starting, preparing (the model and data: `_prepare`), syncing, training, stopping."""
        return self.phase.value

    @property
    def join_address(self) -> JoinTarget | None:
        """What `swarm join` was given (a swarm id or name found in the DHT becomes its entry)."""
        return self.spec_source.join_address

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

    def start_export(self, out: str) -> dict[str, Any]:
        """A pipeline swarm's peer: begin assembling the whole model from every stage into `out`
        (node/stages/export.py); its initial progress. On the trio thread (`meshtrain export`
        reaches it through the status endpoint). `NodeError` for a node of another swarm."""
        if self.pipeline_exporter is None:
            raise NodeError(
                "this node is not a pipeline swarm's peer (or not up yet): export its data dir with `meshtrain export`"
            )
        return self.pipeline_exporter.start(out)

    def allow_peer(self, peer_id: str, allowed: bool = True) -> None:
        """Owner of an allowlist swarm: admit `peer_id` (or, `allowed=False`, revoke it) at run
        time, by writing `allow/<peer id>` into the swarm's owner-only config CRDT; every peer
        applies it as it arrives. Call on the trio thread (`meshtrain swarm allow` reaches it
        through the status endpoint). `ConfigError` for a non-allowlist swarm or a bad peer id,
        `NotSwarmOwner` if this node does not own the swarm, `NodeError` before it is up."""
        view, signed = self.view, self.signed
        if view is None or signed is None:
            raise NodeError("the node is still starting; try again once it is up")
        if signed.spec.admission.mode != "allowlist":
            raise ConfigError(
                f"swarm {signed.swarm_id} admits by {signed.spec.admission.mode}, not by allowlist; nothing to allow"
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
        async with AsyncExitStack() as stack:
            stack.enter_context(DataDirLock(make_data_dir(self.data_dir)))  # one node per data dir
            # Signals first: a Ctrl-C during start-up (imports, bootstrap, a state download) must
            # reach the node, which then stops as soon as it can (before its first step).
            if not self._user_loop:
                signals = await stack.enter_async_context(trio.open_nursery())
                stack.callback(signals.cancel_scope.cancel)
                signals.start_soon(self._watch_signals)
            host, signed, streams, presence = await self._start_network(stack)
            if signed.spec.pipeline.kind != "none":
                return await self._run_pipeline(stack, host, signed, presence, streams)
            collective = await self._start_collective(stack, host, signed, streams, presence)
            self.network_ready.set()
            if self.config.threads:
                torch.set_num_threads(self.config.threads)
            await self._start_status(stack)
            self._write_daemon_file(host, signed)
            stack.callback((self.data_dir / DAEMON_FILE).unlink, missing_ok=True)
            trainer = await self._start_trainer(stack, host, signed, presence, collective)
            run_state = self.run_state = await stack.enter_async_context(
                RunState(trainer, presence, streams, self.config, self.data_dir, phase=self.phase, stop=self._stop)
            )
            training = self._training = TrainingRun(
                presence,
                run_state,
                self.config,
                self.data_dir,
                peer_id=host.peer_id,
                phase=self.phase,
                stop=self._stop,
                on_waiting=self._say_waiting,
            )
            # Grouped rounds: replicas in different groups hold different φ by design (node/state/parity.py).
            run_state.parity.paused_by = lambda: "rounds run in groups (group_size)" if collective.grouped else ""
            await self._announce_reachability(stack, presence)
            if self._user_loop:
                return await training.serve_loop(trainer, self._outer_entered)
            assert isinstance(trainer, Trainer)
            return await training.train(trainer, self._until(trainer.spec.steps))
        raise AssertionError("unreachable")  # pragma: no cover

    async def _start_network(self, stack: AsyncExitStack) -> tuple[Host, SignedSpec, TensorStreams, PeerPresence]:
        """Host, the swarm's spec, the data plane, NAT traversal (if enabled) and presence (DHT,
        mDNS, membership as "syncing", re-dialling): everything a pipeline peer and a trainer share."""
        config = self.config
        identity = Identity.load_or_create(self.data_dir)
        host = self.host = await stack.enter_async_context(
            Host(
                identity,
                HostConfig(
                    listen=config.listen,
                    swarm_key=config.swarm_key,
                    announce=config.announce,
                    max_connections=host_connection_cap(config.max_peers),
                ),
            )
        )
        signed = self.signed = await self.spec_source.resolve(host)
        host.rpc.serve(SPEC_RPC, self.spec_source.serve)
        try:
            streams = self.streams = await stack.enter_async_context(
                TensorStreams(host, DataPlaneConfig(port=config.data_port))
            )
        except OSError as e:
            raise ConfigError(
                f"cannot listen on data port {config.data_port} ({e.strerror or e}); pick another --data-port (0 = any)"
            ) from None
        if config.announce and not config.data_port:
            log.warning(
                kv(
                    "the data plane listens on a random port that --announce does not cover; bulk tensors "
                    "may take the slow libp2p path: set --data-port and open or forward it too",
                    port=streams.port,
                )
            )
        spec = signed.spec
        pow_nonce = None
        if spec.admission.mode == "open" and spec.admission.pow_bits:  # minted once, kept in the data dir
            pow_nonce = await trio.to_thread.run_sync(
                load_or_mint_pow, self.data_dir, signed.swarm_id, host.peer_id, spec.admission.pow_bits
            )
        presence = self.presence = PeerPresence(
            host,
            signed,
            bootstrap=list(config.bootstrap) + self.spec_source.entry_addrs[:1],
            mdns=config.mdns,
            connection="direct",
            pow_nonce=pow_nonce,
            data_dir=self.data_dir,
            max_peers=config.max_peers,
        )
        if config.nat:  # before any peer connects, so every relayed peer can be punched
            self.nat = presence.nat = await stack.enter_async_context(
                NatTraversal(
                    host,
                    streams,
                    relays=presence.relay_candidates,
                    config=NatConfig(
                        relay=RelayConfig(**config.relay_limits()),
                        serve_relay_when_public=config.relay,
                        upnp=config.upnp and _beyond_loopback(config.listen),
                    ),
                )
            )
            presence.connection = "unknown"
        await stack.enter_async_context(presence)
        self.phase.on_change(presence.keep_progress_live)
        # Only members get data-plane sessions; only round candidates may join a round, and
        # only near our step (a stranger's join for a far-future round voided real rounds).
        streams.authorize = presence.is_member
        return host, signed, streams, presence

    async def _start_collective(
        self, stack: AsyncExitStack, host: Host, signed: SignedSpec, streams: TensorStreams, presence: PeerPresence
    ) -> SwarmCollective:
        """The swarm's all-reduce, with the spec's aggregation and grouping; what it flags as a
        part's owner becomes our strikes."""
        config = self.config
        collective = self.collective = await stack.enter_async_context(
            SwarmCollective(
                host,
                streams,
                presence.candidates,
                AllReduceConfig(
                    join_timeout=config.join_timeout,
                    part_timeout=config.part_timeout,
                    uplink_mbit=config.uplink_mbit,
                    round_window=signed.spec.round_window(),
                    **signed.spec.aggregation_options(),  # the spec's aggregation, for every all-reduce
                ),
                current_round=self._current_round,
                # Grouped rounds (collective/groups.py): groups from the round's roster (node/roster.py),
                # alike on every peer whatever connections drop; candidates stay the connected ones.
                grouping=signed.spec.group_plan(),
                roster=presence.roster,
                reported_step=presence.reported_step,
                present=presence.present,
                quiet=presence.heartbeats_stopped,
                trainer_step=self._trainer_step,
            )
        )
        if presence.strikes is not None:
            collective.screening_listeners.append(presence.strikes.on_round)
        presence.current_round = self._current_round  # whose partners presence keeps connected
        return collective

    async def _start_trainer(
        self,
        stack: AsyncExitStack,
        host: Host,
        signed: SignedSpec,
        presence: PeerPresence,
        collective: SwarmCollective,
    ) -> TrainedState:
        """Our `Trainer` over the collective (through the local ranks, if any), with loss scoring
        and spot-checks of sampled contributions; in loop mode, the user's loop's optimizer."""
        if self._user_loop:
            # Until the user's loop builds its optimizer over the swarm, or leaves without one
            # (a script that failed before its first step: `Swarm.leave` must not wait forever).
            await self._stop.before_stop(
                self._adopt.wait, "left before an optimizer was built over the swarm; nothing was trained"
            )
            assert self._adopted is not None  # set with the event
            self.trainer = self._adopted
            return self._adopted
        local = self.local
        ours = adversary.wrap(self.adversary, local.collective(collective) if local else collective)
        device = None if local else resolve_device(self.config.device)
        trainer = self.trainer = await self._prepare(
            lambda on_progress: Trainer(
                signed.spec,
                ours,
                host.peer_id,
                model=self._model,
                outer_factory=self._outer_factory,
                local=local,
                device=device,
                data_dir=self.data_dir,
                on_progress=on_progress,
            )
        )
        adversary.arm(self.adversary, trainer, presence.view)
        if presence.strikes is not None and collective.config.score_samples and local is None:
            # Loss scoring and spot-checks: after the strike book, which logs the round.
            checks = Verification(trainer, presence.strikes, collective.screening_listeners)
            self.scorer, self.spot_checker = checks.scorer, checks.spot_checker
            verifying = await stack.enter_async_context(trio.open_nursery())
            stack.callback(verifying.cancel_scope.cancel)
            verifying.start_soon(checks.run)
        return trainer

    async def _announce_reachability(self, stack: AsyncExitStack, presence: PeerPresence) -> None:
        """With NAT traversal: announce how we are reached (public / relayed / private) and our
        circuit addresses while private, in our membership record and DHT announcement; probe as
        soon as we can."""
        if self.nat is None:
            return
        self.nat.on_announce(presence.announce_connection)
        probes = await stack.enter_async_context(trio.open_nursery())
        stack.callback(probes.cancel_scope.cancel)
        probes.start_soon(self._first_probe, self.nat)

    async def _run_pipeline(
        self, stack: AsyncExitStack, host: Host, signed: SignedSpec, presence: PeerPresence, streams: TensorStreams
    ) -> NodeResult:
        """A pipeline swarm (node/stages/peer.py): no swarm-wide collective, `Trainer` or
        `RunState`: the peer holds one stage, runs it in epochs and checkpoints it."""
        if self.local is not None:  # why: node/stages/peer.py, "Devices and precision"
            raise ConfigError(
                "a pipeline swarm's peer is one process on one device (--nproc-per-node 1): a stage's "
                "replicas already are its data parallelism, so run one node per GPU (--device cuda:i) instead"
            )
        if self._user_loop or self._model is not None or self._outer_factory is not None:
            raise ConfigError(
                "a pipeline swarm trains the spec's built-in GPT inside the node: no user loop, "
                "or model or optimizer hooks"
            )
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        peer = self.pipeline = PipelinePeer(
            signed.spec,
            signed.swarm_id,
            presence,
            streams,
            self.config,
            self.data_dir,
            phase=self.phase,
            stop=self._stop,
        )
        exports = await stack.enter_async_context(trio.open_nursery())
        stack.callback(exports.cancel_scope.cancel)  # an export in flight ends with the node
        self.pipeline_exporter = PipelineExporter(peer, signed, exports)
        self.network_ready.set()
        await self._announce_reachability(stack, presence)
        await self._start_status(stack)
        self._write_daemon_file(host, signed)
        until = self._until(signed.spec.steps)
        try:
            return await run_pipeline_peer(
                peer, presence, self.data_dir, peer_id=host.peer_id, phase=self.phase, until=until
            )
        finally:
            (self.data_dir / DAEMON_FILE).unlink(missing_ok=True)

    def _until(self, steps: int) -> int:
        """The step to stop at: the spec's, or this node's `max_steps` if lower (0: never)."""
        if self.config.max_steps is not None:
            return min(steps, self.config.max_steps) if steps else self.config.max_steps
        return steps

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

    def _trainer_step(self) -> int | None:
        """Our trainer's step in any phase, unlike `_current_round` (collective/own_rounds.py)."""
        return self.trainer.step if self.trainer is not None else None

    async def _prepare(self, build: Callable[[ProgressCallback], Trainer]) -> Trainer:
        """`build(on_progress)` the trainer — the model loaded, the dataset digested and tokenised:
        seconds to hours — in a worker thread, as the module docstring says: the node stays live
        meanwhile, and a stop ends start-up at once (`StoppedWhileStarting`; a multi-rank peer's,
        once the build is done). `on_progress` puts
        how far the data is into `startup_waiting` ("preparing: tokenising data/c.txt, 1.2 of 4.0
        GB (30 %), about 3 min left")."""

        def on_progress(progress: Progress) -> None:
            # From the worker thread: one attribute replaced whole, read by the status page.
            if self.state == "preparing":
                tokenised = progress.phase == "tokenising" and progress.done == progress.total
                self._say_waiting(f"preparing: {progress.describe()}" + ("; loading the model" if tokenised else ""))

        self.phase.set("preparing")
        self._say_waiting("preparing: loading the model, digesting and tokenising the data")
        if self.local is not None:
            # A multi-rank peer's build talks to its other ranks (torch.distributed: they build
            # theirs from what rank 0 sends): it is never abandoned half-way, which would leave
            # them waiting in a collective. A stop meanwhile is heard once it is built, and the
            # run then ends before its first step.
            trainer = await trio.to_thread.run_sync(build, on_progress)
            self._say_waiting(None)
            return trainer
        trainer = await self._stop.before_stop(
            # trio-typing's stubs predate abandon_on_cancel (trio >= 0.23)
            lambda: trio.to_thread.run_sync(build, on_progress, abandon_on_cancel=True),  # type: ignore[call-arg]
            "stopped while preparing the model and data; nothing was trained",
        )
        self._say_waiting(None)
        return trainer

    async def _watch_signals(self) -> None:
        signalled = False  # a stop for another reason (a failed local rank) is not a first signal
        hangup = () if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else (signal.SIGHUP,)  # nohup: keep on
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, *hangup) as signals:
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
        write_atomic(self.data_dir / TOKEN_FILE, token.encode(), mode=0o600)
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
                    on_export=lambda out: trio.from_thread.run_sync(self.start_export, out, trio_token=trio_token),
                    token=token,
                )
            )
        except OSError as e:
            raise ConfigError(
                f"cannot serve the status page on {self.config.status_host}:{self.config.status_port}"
                f" ({e.strerror or e}); pick another --status-port (0 = any)"
            ) from None
        self.status_url = srv.url
        if self.config.tensorboard is not None:
            await stack.enter_async_context(TensorBoardLog(self.snapshot, self.config.tensorboard))

    def _write_daemon_file(self, host: Host, signed: SignedSpec) -> None:
        """daemon.json: how `meshtrain node status/stop` find us (node/status/client.py)."""
        info = {
            "pid": os.getpid(),
            "peer_id": host.peer_id,
            "addrs": host.addrs,
            "data_port": self.streams.port if self.streams is not None else None,
            "swarm_id": signed.swarm_id,
            "status_url": self.status_url,
            "token_file": str(self.data_dir / TOKEN_FILE),
        }
        write_daemon_file(self.data_dir, info)
        said = {"peer": host.peer_id, "swarm": signed.swarm_id, "addrs": ",".join(host.addrs)}
        log.warning(kv("node started", **said, data_port=info["data_port"], status=self.status_url))

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
        run_state, training = self.run_state, self._training
        assert run_state is not None and training is not None  # adopt() waited for them
        run_state.parity.enabled = run_state.trainer.outer.replicas_identical  # now fully built
        await training.enter_swarm()

    async def resync(self) -> None:
        """The user's loop lost step with the swarm: download its state (between two steps)."""
        training = self._training
        assert training is not None
        await training.resync()

    def _say_waiting(self, what: str | None) -> None:
        """What start-up waits for now (None: nothing); `startup_waiting` on `/status`."""
        self.startup_waiting = what

    # -- status (the document: node/status/document.py) -------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The status document (schema in `meshtrain.node.status.client`); on the trio thread."""
        return status_document(self)

    def round_status(self) -> dict[str, Any]:
        """The outer rounds as the status page shows them (`status_document.round_status`)."""
        return round_status(self)


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
