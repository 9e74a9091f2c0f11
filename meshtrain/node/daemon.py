"""`Node`: one meshtrain peer — host, data plane, swarm state, collective, trainer, checkpoints,
late-joiner state service and the local status endpoint — and its lifecycle.

    start ─► resolve the swarm spec (file, or fetched from the peer we join, verified)
          ─► connect to bootstrap peers; replicate swarm state (membership as "syncing")
          ─► enter: resume our checkpoint, or — if the swarm is past it — download the current
             state from several peers in parallel and enter at the swarm's step
          ─► "trainer": train in a worker thread; after each outer round publish the state for
             joiners; checkpoint every `checkpoint_every` seconds in the background
          ─► stop (spec's steps reached, `stop()`, SIGINT/SIGTERM): leave the swarm (tombstone),
             let the current step finish (a round in flight gets a short grace, then is cancelled:
             the collective tells the others at once), save a checkpoint, exit 0. A second signal
             exits at once.

Files in `data_dir`: identity.key (0600), swarm.json (the signed spec), checkpoints/,
daemon.json (pid, peer id, addresses, status url: how `meshtrain node status/stop` find us),
control.token (0600: the bearer token `node stop` must present).

Membership for a round is the live peers whose role is "trainer" and whom we are connected to: a
peer still downloading state is not waited for, and a peer whose connection closed (killed,
partitioned) stops being waited for at once rather than when its lease runs out.

Chaos-proofing (issue 14):
- **Who may take part.** Only members get data-plane sessions (`TensorStreams.authorize`); only
  a round's candidates may join, report or watch it, and only near our own step (the
  collective's `round_window`). Refusals are counted and shown on `/metrics`.
- **Parity.** After every round we hash φ and publish the digest with our progress; a watcher
  compares it with every live trainer's (`node/parity.py`). In the minority — a split round, a
  round we spent alone — we log it, show it on `/status`, and re-sync from the majority's holders.
- **Joins never give up on a transient.** A state download retries with a jittered backoff for
  as long as the node runs, choosing donors by the same parity rule, so a split round's two
  states never face each other in the vote. Only a state that cannot fit this node (another
  model or optimizer) ends the node, as a configuration error. Donors, the swarm's step and
  parity count only peers that train *now* (a fresh progress record): a restarted peer's record
  from its last life is not the swarm. With nobody training for `ORPHAN_WAIT`, a node trains
  on its own state (its checkpoint) instead of waiting for peers that wait for it.
- **What it waits for.** `round_status()["waiting"]` (on `/status` and the console) names the
  peers a round waits for, or the download in progress; the collective logs a round that still
  waits every few seconds.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import secrets
import signal
import threading
import time
from collections import deque
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import trio

import meshtrain
from meshtrain.backoff import Backoff
from meshtrain.collective import AllReduceConfig, SwarmCollective
from meshtrain.crdt.swarm_view import PeerProgress, SwarmView, open_swarm_view
from meshtrain.crdt.types import now_ms
from meshtrain.dht.discovery import Discovery, DiscoveryConfig
from meshtrain.dht.kademlia import Dht
from meshtrain.dht.mdns import LanDiscovery
from meshtrain.dht.records import DhtError
from meshtrain.errors import ConfigError, MeshtrainError
from meshtrain.log import get_logger, kv
from meshtrain.node.checkpoint import CheckpointStore, flatten_state, unflatten_state, write_atomic
from meshtrain.node.config import NodeConfig
from meshtrain.node.devices import device_label, resolve_device
from meshtrain.node.parity import ParityMonitor, phi_digest, winning_digest
from meshtrain.node.state_sync import StateDonor, StateSyncError, fetch_state
from meshtrain.node.status import DAEMON_FILE, TOKEN_FILE, StatusServer, read_daemon_file  # noqa: F401
from meshtrain.node.swarm_spec import SPEC_RPC, SignedSpec, SpecError, parse_join_address
from meshtrain.node.trainer import OuterFactory, Trainer
from meshtrain.optim.outer import OuterStateError, StaleStateError
from meshtrain.transport.host import Host, HostConfig
from meshtrain.transport.identity import Identity
from meshtrain.transport.nat import NatConfig, NatTraversal
from meshtrain.transport.reachability import ReachabilityError
from meshtrain.transport.rpc import RpcError
from meshtrain.transport.tensor_streams import TensorStreams

if TYPE_CHECKING:
    from meshtrain.node.rank_group import LocalRanks

log = get_logger(__name__)

SPEC_FILE = "swarm.json"
STOP_GRACE = 3.0  # seconds a step in flight may take to finish after a stop request
CONNECT_INTERVAL = 2.0
DISCOVERY_INTERVAL = 15.0
ENTER_WAIT = 10.0  # at start, how long to wait for the others' progress before training on our own state
BEHIND_ROUNDS = 3  # a connected trainer this many rounds ahead of us means we were left behind
PROGRESS_FRESH_BEATS = 3  # a progress record older than this many heartbeat intervals (+5 s): not training
ORPHAN_WAIT = 20.0  # nobody training to download from for this long: train on our own state
PARITY_INTERVAL = 1.0  # seconds between two parity checks against the swarm's φ digests
STATE_LOG = 8  # the status document keeps this many recent states (a console polling slower sees them all)
MEMBER_WAIT = 3.0  # a data-plane request from a peer not yet in our membership waits this long for it


class NodeError(MeshtrainError):
    """The node cannot start or continue (no spec, swarm unreachable, state download failed)."""


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
        `<swarm id>@<multiaddr>`) to fetch it from; else `data_dir/swarm.json` from an earlier run.
    model, outer_factory: the Python API's hooks — your own `torch.nn.Module` (forward(x, y) →
        loss) and `outer_factory(model, inner, collective) -> OuterOptimizer` (e.g. a custom
        outer optimizer); every peer of the swarm must use the same.
    local: the local-rank group when this process is rank 0 (the gateway) of a multi-GPU peer
        (node/local_ranks.py builds it); None for a single-process peer.
    """

    def __init__(self, config: NodeConfig, *, spec: SignedSpec | None = None, join: str | None = None,
                 model: torch.nn.Module | None = None, outer_factory: OuterFactory | None = None,
                 local: LocalRanks | None = None) -> None:
        if config.nproc_per_node > 1 and local is None:
            raise ConfigError(f"nproc_per_node = {config.nproc_per_node}: a multi-rank peer is started by "
                              f"`meshtrain node start --nproc-per-node N` (torch's launcher runs the ranks); "
                              f"a Node built in Python is one process")
        self.config = config
        self._local = local
        self.data_dir = Path(config.data_dir).expanduser()
        self._spec_arg = spec
        self._join = parse_join_address(join) if join else None
        self._model = model
        self._outer_factory = outer_factory
        self._stop_flag = threading.Event()
        self._stop_requested = trio.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._states: deque[str] = deque(["starting"], maxlen=STATE_LOG)
        self._state_changes = 0  # how many times the state changed since start
        self.started = time.time()
        self.host: Host | None = None
        self.view: SwarmView | None = None
        self.trainer: Trainer | None = None
        self.signed: SignedSpec | None = None
        self.status_url: str | None = None
        self._last_ckpt: dict[str, Any] = {"last_step": None, "path": None, "saved_at": None}
        self._ckpt_busy = False
        self._last_ckpt_time = time.monotonic()
        self._published_round = -1
        self.donor: Any = None
        self.discovery: Discovery | None = None
        self.nat: NatTraversal | None = None
        self._nursery: trio.Nursery | None = None
        self.joined_from: dict[str, Any] | None = None
        self.collective: SwarmCollective | None = None
        self.streams: TensorStreams | None = None
        self.parity: ParityMonitor | None = None
        self._waiting: str | None = None  # what the node itself waits for (a download, peers)

    # -- control -------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        """starting, syncing, training, stopping."""
        return self._states[-1]

    @state.setter
    def state(self, value: str) -> None:
        if value != self._states[-1]:
            self._states.append(value)
            self._state_changes += 1

    def stop(self) -> None:
        """Ask the node to stop cleanly (thread-safe; idempotent)."""
        self._stop_flag.set()
        if self._token is not None:
            try:
                trio.from_thread.run_sync(self._stop_requested.set, trio_token=self._token)
            except (RuntimeError, trio.RunFinishedError):  # already on the trio thread, or gone
                self._stop_requested.set()

    # -- the run ---------------------------------------------------------------------------------

    async def run(self) -> NodeResult:
        self._token = trio.lowlevel.current_trio_token()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        identity = Identity.load_or_create(self.data_dir)
        host_cfg = HostConfig(listen=self.config.listen, swarm_key=self.config.swarm_key,
                              announce=self.config.announce)
        async with AsyncExitStack() as stack:
            # Signals first: a Ctrl-C during start-up (imports, bootstrap, a state download) must
            # reach the node, which then stops as soon as it can (before its first step).
            signals = await stack.enter_async_context(trio.open_nursery())
            stack.callback(signals.cancel_scope.cancel)
            signals.start_soon(self._watch_signals)
            host = self.host = await stack.enter_async_context(Host(identity, host_cfg))
            signed = self.signed = await self._resolve_spec(host)
            host.rpc.serve(SPEC_RPC, self._serve_spec)
            streams = await stack.enter_async_context(TensorStreams(host))
            if self.config.nat:  # before any peer connects, so every relayed peer can be punched
                self.nat = await stack.enter_async_context(NatTraversal(
                    host, streams, relays=self._relay_candidates,
                    config=NatConfig(serve_relay_when_public=self.config.relay,
                                     upnp=self.config.upnp and _beyond_loopback(self.config.listen))))
            # Discovery: the swarm's DHT (bootstrapped from the configured peers and the one we
            # join through) lists every live peer under /meshtrain/<swarm>/peers; the replicated
            # membership then carries everyone's addresses too.
            dht = await stack.enter_async_context(Dht(host, signed.swarm_id))
            if self.config.mdns:  # LAN peers of this swarm bootstrap us as they are heard
                async def lan_peer(peer: str, addrs: list[str]) -> None:
                    if not host.is_connected(peer):
                        await dht.bootstrap([f"{addrs[0]}/p2p/{peer}"])
                await stack.enter_async_context(LanDiscovery(host, signed.swarm_id, lan_peer))
            await self._bootstrap(dht)
            self.discovery = await stack.enter_async_context(Discovery(dht, DiscoveryConfig(role="trainer")))
            # Alone (first node of a swarm), there is nothing to recover: do not wait for it.
            view = self.view = await stack.enter_async_context(open_swarm_view(
                host, signed.swarm_id, signed.owner, role="syncing",
                connection="unknown" if self.nat is not None else "direct",
                recover_timeout=5.0 if host.connected_peers() else 0.2))
            if view.is_owner and view.config().get("spec") != signed.to_wire():
                view.set_config(spec=signed.to_wire())
            # Only members get data-plane sessions; only round candidates may join a round, and
            # only near our step (a stranger's join for a far-future round voided real rounds).
            streams.authorize = self._is_member
            self.streams = streams
            collective = self.collective = SwarmCollective(
                host, streams, self._membership,
                AllReduceConfig(join_timeout=self.config.join_timeout, part_timeout=self.config.part_timeout,
                                round_window=max(4 * signed.spec.H, 64)),
                current_round=self._current_round)
            if self.config.threads:
                torch.set_num_threads(self.config.threads)
            local = self._local
            self.trainer = Trainer(signed.spec, local.collective(collective) if local else collective, host.peer_id,
                                   model=self._model, outer_factory=self._outer_factory, local=local,
                                   device=None if local else resolve_device(self.config.device),
                                   data_dir=self.data_dir)
            self.parity = ParityMonitor(host.peer_id, enabled=self.trainer.outer.replicas_identical)
            self.donor = StateDonor(host, streams, upload_limit=self.config.donor_upload_mib * 2**20 or None)
            store = CheckpointStore(self.data_dir / "checkpoints", keep=self.config.keep_checkpoints)
            nursery = self._nursery = await stack.enter_async_context(trio.open_nursery())
            nursery.start_soon(self._keep_connected)
            nursery.start_soon(self._watch_parity)
            if self.nat is not None:
                # announce how we are reached (public / relayed / private) and our circuit
                # addresses while private, in our membership record
                self.nat.on_announce(lambda conn, addrs: view.set_connection(conn, addrs))
                nursery.start_soon(self._first_probe)
            await self._start_status(stack)
            self._write_daemon_file()
            log.warning(kv("node started", peer=host.peer_id, swarm=signed.swarm_id, addrs=",".join(host.addrs),
                           status=self.status_url))
            try:
                result = await self._train(store, streams)
            finally:
                nursery.cancel_scope.cancel()
                (self.data_dir / DAEMON_FILE).unlink(missing_ok=True)
            return result
        raise AssertionError("unreachable")  # pragma: no cover

    async def _resolve_spec(self, host: Host) -> SignedSpec:
        if self._spec_arg is not None:
            signed = self._spec_arg
        elif self._join is not None:
            want, addr = self._join
            backoff = Backoff(initial=2.0, cap=30.0)
            while True:  # an unreachable peer is a transient (restarting, partitioned): keep asking
                try:
                    peer = await host.connect(addr, timeout=15)
                    break
                except MeshtrainError as e:
                    delay = backoff.next()
                    log.warning(kv("cannot reach the peer to join through; retrying (Ctrl-C to give up)",
                                   addr=addr, error=str(e)[:200], retry_in_s=round(delay, 1)))
                    self._waiting = f"joining: waiting for {addr} to answer"
                    with trio.move_on_after(delay):
                        await self._stop_requested.wait()
                    if self._stop_flag.is_set():
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
                raise NodeError(f"no swarm to run: {path} does not exist. Create a swarm (`meshtrain swarm "
                                f"create`) or join one (`meshtrain swarm join <multiaddr>`)")
            signed = SignedSpec.load(path)
        existing = self.data_dir / SPEC_FILE
        if existing.exists():
            old = SignedSpec.load(existing)
            if old.swarm_id != signed.swarm_id and (self.data_dir / "checkpoints").exists():
                raise NodeError(f"{self.data_dir} holds swarm {old.swarm_id}, not {signed.swarm_id}; "
                                f"use another --data-dir for another swarm")
        signed.save(existing)
        return signed

    async def _serve_spec(self, peer: str, req: Any) -> dict:
        assert self.signed is not None
        return self.signed.to_wire()

    async def _bootstrap(self, dht: Dht) -> None:
        addrs = list(self.config.bootstrap) + ([self._join[1]] if self._join else [])
        if not addrs:
            return
        try:
            await dht.bootstrap(addrs)
        except DhtError as e:
            log.warning(kv("no bootstrap peer reachable; running alone until peers dial us", error=str(e)))

    def _relay_candidates(self) -> list[str]:
        """Relays a private node reserves on: bootstrap peers, then members announced public."""
        out = [a for a in self.config.bootstrap if "/p2p/" in a]
        if self._join is not None and "/p2p/" in self._join[1]:
            out.append(self._join[1])
        if self.view is not None and self.host is not None:
            for p in self.view.live_peers():
                if p.connection == "public" and p.peer_id != self.host.peer_id and p.addrs:
                    a = p.addrs[0]
                    out.append(a if "/p2p/" in a else f"{a}/p2p/{p.peer_id}")
        return list(dict.fromkeys(out))

    async def _first_probe(self) -> None:
        """Probe reachability as soon as a peer can dial us back (NatTraversal re-probes later)."""
        assert self.nat is not None and self.host is not None
        for _ in range(30):
            if self.host.connected_peers():
                try:
                    if (await self.nat.probe()).status != "unknown":
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

    def _front_step(self) -> int | None:
        """The furthest step a connected peer training now reports (None: nobody)."""
        steps = [pr.step for pr in self._training_peers(connected=True).values()]
        return max(steps) if steps else None

    def _trainers(self) -> list[str]:
        """Live trainers per the replicated membership, us included (connected or not)."""
        assert self.view is not None
        return [p.peer_id for p in self.view.live_peers() if p.role == "trainer"]

    def _membership(self, _round: int) -> list[str]:
        """A round's candidates: live trainers we are connected to, and us. A peer whose connection
        closed (killed, partitioned) stops being waited for at once, not when its lease runs out;
        `_keep_connected` re-dials it, and it is a candidate again as soon as it is back."""
        assert self.view is not None and self.host is not None
        me = self.host.peer_id
        return [p.peer_id for p in self.view.live_peers()
                if p.role == "trainer" and (p.peer_id == me or self.host.is_connected(p.peer_id))]

    async def _is_member(self, peer: str) -> bool:
        """Data-plane sessions only for peers with a live membership record (any role: a joiner
        downloading state is "syncing"). Its record may still be on its way: wait a little."""
        assert self.view is not None
        with trio.move_on_after(MEMBER_WAIT):
            while not self.view.is_live(peer):
                await trio.sleep(0.1)
            return True
        return False

    async def _keep_connected(self) -> None:
        """Dial every live swarm member we are not connected to (the swarm is a full mesh up to a
        few dozen peers; the membership CRDT carries their addresses)."""
        assert self.host is not None and self.view is not None
        last_lookup = -math.inf
        while True:
            known = {p.peer_id: p.addrs for p in self.view.live_peers()}
            if time.monotonic() - last_lookup > DISCOVERY_INTERVAL and self.discovery is not None:
                last_lookup = time.monotonic()
                try:
                    for a in await self.discovery.peers():
                        known.setdefault(a.peer_id, a.addrs)
                except MeshtrainError as e:
                    log.info(kv("discovery lookup failed", error=str(e)))
            for peer, addrs in known.items():
                if peer == self.host.peer_id or self.host.is_connected(peer) or not addrs:
                    continue
                addr = addrs[0] if "/p2p/" in addrs[0] else f"{addrs[0]}/p2p/{peer}"
                with trio.move_on_after(5):
                    try:
                        await self.host.connect(addr, timeout=5)
                    except MeshtrainError as e:
                        log.info(kv("peer unreachable", peer=peer[-8:], error=str(e)))
                if self.nat is not None and self.host.connection_type(peer) == "relayed":
                    assert self._nursery is not None
                    self._nursery.start_soon(self.nat.upgrade, peer)  # DCUtR, in the background
            await trio.sleep(CONNECT_INTERVAL)

    async def _watch_signals(self) -> None:
        signalled = False  # a stop for another reason (a failed local rank) is not a first signal
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for sig in signals:
                if signalled:
                    log.warning("second signal: exiting at once")
                    os._exit(130)
                signalled = True
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
            self._stop_flag.set()
            try:
                trio_token.run_sync_soon(self.stop)
            except trio.RunFinishedError:
                return  # the run is over: stopped already

        try:
            srv = await stack.enter_async_context(StatusServer(
                self.snapshot, host=self.config.status_host, port=self.config.status_port,
                on_stop=accept_stop, token=token))
        except OSError as e:
            raise NodeError(f"cannot serve the status page on {self.config.status_host}:{self.config.status_port}"
                            f" ({e.strerror or e}); pick another --status-port (0 = any)") from None
        self.status_url = srv.url

    def _write_daemon_file(self) -> None:
        """daemon.json: how `meshtrain node status/stop` find us. They read it with
        `status.read_daemon_file` (re-exported here), as that path must not import this module."""
        assert self.host is not None and self.signed is not None
        info = {"pid": os.getpid(), "peer_id": self.host.peer_id, "addrs": self.host.addrs,
                "swarm_id": self.signed.swarm_id, "status_url": self.status_url,
                "token_file": str(self.data_dir / TOKEN_FILE)}
        write_atomic(self.data_dir / DAEMON_FILE, json.dumps(info).encode())

    # -- entering the swarm and training -----------------------------------------------------

    def _training_peers(self, *, connected: bool) -> dict[str, PeerProgress]:
        """Trainers other than us that train *now*: their progress record is fresh (a training
        node refreshes it every heartbeat). A trainer that is starting or downloading — perhaps
        restarted, its record left over from its last life — does not count: after the last
        training peer died, restarted nodes waited on each other's stale records for minutes."""
        assert self.view is not None and self.host is not None
        horizon = now_ms() - int((PROGRESS_FRESH_BEATS * self.view.current_interval() + 5.0) * 1000)
        candidates = set(self._membership(0) if connected else self._trainers()) - {self.host.peer_id}
        return {p: pr for p, pr in self.view.progress().items() if p in candidates and pr.updated_ms >= horizon}

    def _swarm_step(self) -> int | None:
        """The furthest step a peer training now reports, or None if nobody trains."""
        steps = [pr.step for pr in self._training_peers(connected=False).values()]
        return max(steps) if steps else None

    async def _enter(self, store: CheckpointStore, streams: TensorStreams) -> None:
        """Resume our checkpoint, or fetch the swarm's state if the swarm is past it."""
        assert self.trainer is not None and self.host is not None
        trainer = self.trainer
        ckpt = await trio.to_thread.run_sync(store.load_latest)
        if ckpt is not None:
            trainer.load_checkpoint(ckpt.state)
            self._last_ckpt = {"last_step": ckpt.step, "path": str(ckpt.path), "saved_at": None}
            log.warning(kv("resumed from checkpoint", step=ckpt.step, digest=ckpt.digest[:16]))
        with trio.move_on_after(ENTER_WAIT):  # let membership and progress from the others arrive
            while self._swarm_step() is None and self.view is not None and len(self.view.live_peers()) > 1:
                await trio.sleep(0.2)
        swarm_step = self._swarm_step()
        if swarm_step is None or swarm_step < trainer.outer.next_send_step(trainer.step):
            return  # nobody is past our next exchange: our state is the swarm's; train on from it
        await self._download_state(streams)

    def _donors(self) -> list[str]:
        """Whom to download the swarm's state from: among the connected trainers, the holders of
        the winning φ digest (the parity rule, `node/parity.py`) at the newest round any of them
        published — so a split round's two states never face each other in the download's vote,
        and a group left behind (restarted from an old checkpoint) is not mistaken for the swarm."""
        assert self.host is not None and self.view is not None and self.trainer is not None
        progress = self._training_peers(connected=True)
        donors = sorted(progress)
        newest: dict[int, dict[bytes, set[str]]] = {}
        for p in donors:
            pr = progress.get(p)
            if pr is not None and pr.phi:
                rnd, digest = pr.phi[-1]
                newest.setdefault(rnd, {}).setdefault(digest, set()).add(p)
        if newest:
            # At the newest round someone published, the parity winner's holders; peers still at
            # an older round would offer the same state once they catch up, but not yet.
            holders = newest[max(newest)]
            donors = sorted(holders[winning_digest(holders)])
        if not self.trainer.outer.replicas_identical:
            donors = donors[:1]  # NoLoCo replicas differ: take one peer's state whole
        elif self.config.max_donors:
            donors = donors[: self.config.max_donors]
        return donors

    async def _download_state(self, streams: TensorStreams) -> bool:
        """Fetch the swarm's outer state from several peers in parallel and enter at its step.

        Never gives up on a transient — no donor yet, donors that disagree (a split round: wait for
        parity to settle it), a state a round old, a donor that vanished — but retries with a
        jittered backoff, saying what it waits for, until it joins or the node is stopped (False).
        A state that cannot fit this node (another model or optimizer) is a configuration error:
        `NodeError`."""
        assert self.trainer is not None and self.host is not None and self.view is not None
        trainer = self.trainer
        self.state = "syncing"
        # Count as a trainer from now on: peers then expect us at the next round, and every peer
        # (us included) picks that round's coordinator from the same set. Announcing only after
        # the download made a joiner with the lowest peer id wait as the "coordinator" of a
        # round the others had already formed without it.
        self.view.role = "trainer"
        self.view.heartbeat()
        if trainer.outer.in_flight:  # an exchange of ours still runs: end it before replacing the state
            with trio.move_on_after(self.config.join_timeout):
                await trainer.outer.afinish()
        backoff = Backoff(initial=1.0, cap=30.0)
        attempt = 0
        orphaned_at = time.monotonic()
        try:
            while not self._stop_flag.is_set():
                attempt += 1
                donors = self._donors()
                if not donors:
                    if time.monotonic() - orphaned_at >= ORPHAN_WAIT:
                        # Nobody trains (the last training peer died; everyone else is starting or
                        # syncing too): waiting for each other would stall the swarm for good.
                        # Train on our own state; parity and the front rule merge the lineages
                        # once peers train again (the furthest step wins).
                        log.warning(kv("nobody is training to download from; training on our own state",
                                       step=trainer.step, round=trainer.outer.rounds))
                        trainer.outer.needs_resync = False
                        return True
                    self._waiting = "state download: waiting for a connected peer that trains"
                    await self._retry_later(backoff, "no connected peer is training yet")
                    continue
                orphaned_at = time.monotonic()
                t0 = time.monotonic()
                last_log = [0.0]

                def progress(done: int, total: int, last_log: list[float] = last_log, donors: list[str] = donors) -> None:
                    if time.monotonic() - last_log[0] > 2 or done == total:
                        last_log[0] = time.monotonic()
                        log.warning(kv("downloading swarm state", done_mib=round(done / 2**20, 1),
                                       total_mib=round(total / 2**20, 1), donors=len(donors)))

                self._waiting = f"state download from {len(donors)} peers (attempt {attempt})"
                try:
                    meta, tensors = await fetch_state(self.host, streams, donors, timeout=600.0, progress=progress)
                except StateSyncError as e:
                    await self._retry_later(backoff, f"state download failed: {e}", attempt=attempt)
                    continue
                state = unflatten_state(meta["skeleton"], tensors)
                # Enter at the step the donors — the swarm we join — are at now.
                progress = self.view.progress()
                now = max([progress[d].step for d in donors if d in progress] or [state["inner_steps"]])
                try:
                    trainer.join(state, at_step=max(now, state["inner_steps"]))
                except StaleStateError as e:
                    await self._retry_later(backoff, f"downloaded state is a round old: {e}", attempt=attempt)
                    continue
                except OuterStateError as e:
                    raise NodeError(f"the swarm's state does not fit this node ({e}): every peer must run the "
                                    f"same model and optimizer as the swarm spec says") from None
                self._published_round = trainer.outer.rounds  # the donors already offer this round
                self._record_phi()
                self.joined_from = {"donors": len(donors), "seconds": time.monotonic() - t0, "step": trainer.step,
                                    "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
                log.warning(kv("joined the swarm", step=trainer.step, donors=len(donors),
                               seconds=round(self.joined_from["seconds"], 2)))
                return True
            return False
        finally:
            self._waiting = None

    async def _retry_later(self, backoff: Backoff, why: str, attempt: int | None = None) -> None:
        delay = backoff.next()
        log.warning(kv("cannot join the swarm yet; retrying", why=why[:300], attempt=attempt,
                       retry_in_s=round(delay, 1)))
        with trio.move_on_after(delay):
            await self._stop_requested.wait()

    def _record_phi(self) -> None:
        """Hash φ after a round (or a download) and publish it with our progress (trainer thread
        or trio thread: the caller owns φ at that moment)."""
        trainer, parity = self.trainer, self.parity
        if trainer is None or parity is None or not parity.enabled:
            return
        parity.record(trainer.outer.rounds, phi_digest(trainer.outer.outer_params))

    async def _watch_parity(self) -> None:
        """Compare our φ digests with every live trainer's, continuously; in the minority, re-sync
        from the majority (the training loop downloads their state) and say so."""
        assert self.parity is not None and self.view is not None and self.host is not None
        acted_on: int | None = None
        while True:
            await trio.sleep(PARITY_INTERVAL)
            if (self.trainer is None or self.state != "training" or not self.parity.enabled
                    or self.trainer.outer.needs_resync):
                continue
            others = {p: pr.phi for p, pr in self._training_peers(connected=False).items()}
            verdict = self.parity.check(others)
            if verdict.status == "minority" and verdict.outer_round != acted_on:
                acted_on = verdict.outer_round
                self.parity.resyncs += 1
                log.warning(kv("out of step with the swarm: φ differs from the majority's; re-syncing",
                               round=verdict.outer_round, mine=verdict.mine.hex()[:16] if verdict.mine else None,
                               majority=verdict.majority.hex()[:16] if verdict.majority else None,
                               agreeing=verdict.agreeing, compared=verdict.compared,
                               holders=",".join(p[-8:] for p in verdict.holders)))
                self.trainer.outer.needs_resync = True
                continue
            front = self._front_step()
            if front is not None and front >= self.trainer.step + BEHIND_ROUNDS * self.trainer.spec.H:
                # A group left behind (its members restarted from old checkpoints and found each
                # other) completes rounds among itself that the swarm passed long ago; parity never
                # compares them. Catch up with the front instead.
                log.warning(kv("behind the swarm; re-syncing", step=self.trainer.step, swarm_step=front))
                self.parity.resyncs += 1
                self.trainer.outer.needs_resync = True

    async def _train(self, store: CheckpointStore, streams: TensorStreams) -> NodeResult:
        assert self.trainer is not None and self.view is not None and self.host is not None
        trainer, view = self.trainer, self.view
        await self._enter(store, streams)
        view.role = "trainer"
        view.heartbeat()
        await self._wait_for_peers()
        self.state = "training"
        until = self.trainer.spec.steps
        if self.config.max_steps is not None:
            until = min(until, self.config.max_steps) if until else self.config.max_steps
        finished_cleanly = True
        async with trainer.outer:
            async with trio.open_nursery() as nursery:
                async def train() -> None:
                    while True:
                        await trio.to_thread.run_sync(trainer.run, self._stop_flag, until, self._after_step)
                        if self._stop_flag.is_set() or not trainer.outer.needs_resync:
                            break
                        # We missed a round (cut off, or late for its group): our outer state
                        # differs from the swarm's. Download it again rather than drift apart.
                        log.warning(kv("out of step with the swarm; downloading its state", step=trainer.step))
                        view.role = "syncing"
                        view.heartbeat()
                        await self._download_state(streams)
                        view.role = "trainer"
                        view.heartbeat()
                        self.state = "training"
                    self._stop_requested.set()

                nursery.start_soon(train)
                await self._stop_requested.wait()
                self.state = "stopping"
                self._stop_flag.set()
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
        path = None
        if finished_cleanly:
            state = trainer.checkpoint_state()
            ck = await trio.to_thread.run_sync(lambda: store.save(state, step=trainer.step, round=trainer.outer.rounds))
            path = str(ck.path)
        else:
            log.warning(kv("stopped mid-round; the last periodic checkpoint stands",
                           checkpoint=self._last_ckpt.get("path")))
        if not view.has_left:
            await view.leave()
        with trainer.lock:
            history = list(trainer.info.history)
        write_atomic(self.data_dir / "history.json", json.dumps(history).encode())
        return NodeResult(self.host.peer_id, trainer.step, trainer.outer.rounds, trainer.info.eval_loss,
                          path or self._last_ckpt.get("path"), stopped_early)

    async def _wait_for_peers(self) -> None:
        """With `wait_peers`, start training only once that many trainers (us included) are in
        the swarm, so a swarm started together begins its first round together."""
        assert self.view is not None
        want = self.config.wait_peers
        if want <= 1:
            return
        with trio.move_on_after(self.config.wait_peers_timeout):
            while len(self._trainers()) < want and not self._stop_flag.is_set():
                await trio.sleep(0.1)
        have = len(self._trainers())
        if have < want:
            log.warning(kv("starting without every awaited peer", have=have, want=want))

    def _after_step(self, trainer: Trainer) -> None:
        """Between two steps, in the trainer's thread: report, publish, checkpoint."""
        assert self._token is not None
        info = trainer.info
        outer = trainer.outer
        publish = checkpoint = None
        parity = self.parity
        if parity is not None and parity.enabled and (not parity.history or parity.history[-1][0] != outer.rounds):
            self._record_phi()  # φ is ours between steps, even with a fragment in flight
        phi = list(parity.history) if parity is not None and parity.enabled else None
        if outer.rounds != self._published_round and not outer.in_flight:
            self._published_round = outer.rounds
            skeleton, tensors = flatten_state(trainer.donor_state())
            publish = ({"skeleton": skeleton, "step": trainer.step, "round": outer.rounds}, tensors)
        if (time.monotonic() - self._last_ckpt_time >= self.config.checkpoint_every and not self._ckpt_busy
                and not outer.in_flight):
            self._last_ckpt_time = time.monotonic()
            checkpoint = (trainer.checkpoint_state(), trainer.step, outer.rounds)

        def on_trio() -> None:
            assert self.view is not None
            self.view.report_progress(step=trainer.step, samples=trainer.step * trainer.spec.batch_size,
                                      outer_round=outer.rounds, phi=phi)
            metrics = {k: v for k, v in (("loss", info.loss), ("eval_loss", info.eval_loss),
                                         ("samples_per_s", info.samples_per_s)) if v is not None and math.isfinite(v)}
            self.view.report_metrics(metrics)
            if publish is not None and self.donor is not None:
                self.donor.publish(*publish)
            if checkpoint is not None and self._nursery is not None:
                self._ckpt_busy = True
                self._nursery.start_soon(self._write_checkpoint, *checkpoint)

        trio.from_thread.run_sync(on_trio, trio_token=self._token)

    async def _write_checkpoint(self, state: dict[str, Any], step: int, rnd: int) -> None:
        store = CheckpointStore(self.data_dir / "checkpoints", keep=self.config.keep_checkpoints)
        try:
            ck = await trio.to_thread.run_sync(lambda: store.save(state, step=step, round=rnd))
            self._last_ckpt = {"last_step": step, "path": str(ck.path), "saved_at": time.time()}
        except OSError as e:
            log.warning(kv("checkpoint failed", step=step, error=str(e)))
        finally:
            self._ckpt_busy = False

    # -- status -------------------------------------------------------------------------------

    def round_status(self) -> dict[str, Any]:
        """The outer rounds as the status page shows them: `phi_round`, `phi_digest` (hex),
        `phi_history` ([[round, digest hex], ...], newest last), `parity` (this peer's standing
        against the swarm's φ digests), `waiting` (what a round waits for now, or None) and
        `refused` (requests refused to non-members and the like, by reason)."""
        parity = self.parity
        history = list(parity.history) if parity is not None else []
        waiting = self._waiting or (self.collective.waiting_for() if self.collective is not None else None)
        return {"phi_round": history[-1][0] if history else None,
                "phi_digest": history[-1][1].hex() if history else None,
                "phi_history": [[r, d.hex()] for r, d in history],
                "parity": parity.status() if parity is not None else None,
                "waiting": waiting, "refused": self.refused()}

    def refused(self) -> dict[str, int]:
        """Requests refused to peers, by reason (`not-a-member`, `round-out-of-window`, ...):
        the collective's and the data plane's, for `/metrics`."""
        out: dict[str, int] = {}
        for counts in (self.collective.refused if self.collective else {}, self.streams.refused if self.streams else {}):
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
        node = {"peer_id": host.peer_id if host else "", "name": self.config.name, "version": meshtrain.__version__,
                "started": self.started, "uptime_s": now - self.started,
                "swarm": self.signed.swarm_id if self.signed else "", "state": self.state,
                "state_changes": self._state_changes, "recent_states": list(self._states),
                "listen": host.addrs if host else [],
                "reachability": self.nat.connection_type if self.nat is not None else "unknown",
                "device": device_label(trainer.device) if trainer is not None else self.config.device,
                "local_ranks": self._local.world_size if self._local is not None else 1,
                "local_rank_pids": self._local.pids if self._local is not None else [os.getpid()]}
        training: dict[str, Any] = {"step": 0, "round": 0, "loss": None, "eval_loss": None, "optimizer": "",
                                    "samples_per_s": 0.0, "bytes_sent": 0, "bytes_received": 0, "history": []}
        if trainer is not None:
            with trainer.lock:  # copies only: the critical section is microseconds
                info = trainer.info
                st = trainer.outer.stats()
                training.update(step=info.step, round=info.rounds, loss=info.loss, eval_loss=info.eval_loss,
                                samples_per_s=info.samples_per_s, bytes_sent=st["bytes_sent"],
                                bytes_received=st["bytes_received"], history=list(info.history))
            training["optimizer"] = trainer.spec.optimizer
        training.update(self.round_status())
        if training.get("waiting") is None and self.state == "starting":
            # What start-up waits for (rounds say it themselves through round_status).
            if self.signed is None and self._join is not None:
                training["waiting"] = f"fetching the swarm spec from {self._join[1]}"
            elif view is None:
                training["waiting"] = "connecting to the swarm (bootstrap peers, DHT, membership)"
            elif self.config.wait_peers > 1 and trainer is not None:
                have = len(self._trainers())
                if have < self.config.wait_peers:
                    training["waiting"] = (f"waiting for {self.config.wait_peers - have} more peer(s) before "
                                           f"training starts ({have} of {self.config.wait_peers} here)")
        peers = []
        if view is not None and host is not None:
            progress, metrics = view.progress(), view.metrics()
            for p in view.live_peers():
                pr, me = progress.get(p.peer_id), metrics.get(p.peer_id)
                peers.append({"peer_id": p.peer_id, "addr": p.addrs[0] if p.addrs else "",
                              "connection": ("self" if p.peer_id == host.peer_id
                                             else host.connection_type(p.peer_id) or "none"),
                              "role": p.role,
                              "step": pr.step if pr else 0, "loss": me.values.get("loss") if me else None,
                              "last_seen_s": max(0.0, now - p.last_heartbeat_ms / 1000),
                              "reachability": p.connection})
        return {"node": node, "training": training, "peers": peers, "checkpoint": dict(self._last_ckpt),
                "joined_from": self.joined_from}


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
