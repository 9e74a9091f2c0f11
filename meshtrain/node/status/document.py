"""The status document: what a running node is doing, as `/status`, `/metrics`, the dashboard,
the console and `meshtrain node status` show it (schema: `node/status/client.py`).

Built from the node's parts on the trio thread, where they are written; it never waits for a
training step (the trainer thread holds `trainer.lock` only while it publishes a step's numbers),
so the status page and the console stay live under load. Parts that are not up yet (starting,
a failed start) show as empty, and `training.waiting` says what start-up waits for.

Not here: serving it (`node/status/server.py`), reading it (`node/status/client.py`, `node/status/console.py`).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Protocol

import meshtrain
from meshtrain.collective import SwarmCollective
from meshtrain.crdt.swarm_view import MEMBERSHIP, SwarmView
from meshtrain.node.phase import Phase
from meshtrain.node.presence import PeerPresence
from meshtrain.node.ranks.devices import device_label
from meshtrain.node.spec.config import NodeConfig
from meshtrain.node.spec.signed import JoinTarget, SignedSpec
from meshtrain.node.stages.peer import PipelinePeer
from meshtrain.node.state.parity import ParityMonitor
from meshtrain.node.state.run_state import RunState
from meshtrain.node.trainer import TrainedState
from meshtrain.node.trust.scoring import LossScorer
from meshtrain.node.trust.spot_check import SpotChecker
from meshtrain.transport.host import Host
from meshtrain.transport.nat import NatTraversal
from meshtrain.transport.tensor_streams import TensorStreams

if TYPE_CHECKING:
    from meshtrain.node.ranks.group import LocalRanks

# The trainer's thread blocked this long on one call of its round logic is shown as what the node
# waits for, when nothing more specific is (a round's own wait is: "waiting for 1 of 3 peers").
TRAINER_BLOCKED_SHOWN_S = 10.0
ROUND_PEERS_SHOWN = 8  # exchanges whose peers `training.round_peers` lists (the newest)


class Node(Protocol):
    """What the document reads of a `daemon.Node` (None: not started yet)."""

    config: NodeConfig
    started: float
    phase: Phase
    signed: SignedSpec | None
    host: Host | None
    streams: TensorStreams | None
    nat: NatTraversal | None
    presence: PeerPresence | None
    collective: SwarmCollective | None
    trainer: TrainedState | None
    run_state: RunState | None
    pipeline: PipelinePeer | None
    local: LocalRanks | None
    scorer: LossScorer | None
    spot_checker: SpotChecker | None
    startup_waiting: str | None

    @property
    def join_address(self) -> JoinTarget | None: ...

    @property
    def state(self) -> str: ...

    @property
    def view(self) -> SwarmView | None: ...

    @property
    def parity(self) -> ParityMonitor | None: ...

    @property
    def joined_from(self) -> dict[str, Any] | None: ...


def trainer_blocked(node: Node) -> str | None:
    """What the training thread has waited on for over `TRAINER_BLOCKED_SHOWN_S` in its outer
    optimizer's round logic (an exchange, a hook before φ changes), in words; else None."""
    blocked = node.trainer.outer.blocked_on() if node.trainer is not None else None
    if blocked is None or blocked[1] < TRAINER_BLOCKED_SHOWN_S:
        return None
    return f"training waits on {blocked[0]} ({blocked[1]:.0f} s)"


def round_status(node: Node) -> dict[str, Any]:
    """The outer rounds as the status page shows them: `phi_round`, `phi_digest` (hex),
    `phi_history` ([[round, digest hex], ...], newest last), `parity` (this peer's standing
    against the swarm's φ digests), `waiting` (what a round waits for now, or None) and
    `refused` (requests refused to non-members and the like, by reason)."""
    parity = node.parity
    history = list(parity.history) if parity is not None else []
    waiting = (
        node.startup_waiting
        or (node.run_state.waiting if node.run_state is not None else None)
        or (node.pipeline.waiting if node.pipeline is not None else None)
        or (node.collective.waiting_for() if node.collective is not None else None)
        or trainer_blocked(node)
    )
    return {
        "phi_round": history[-1][0] if history else None,
        "phi_digest": history[-1][1].hex() if history else None,
        "phi_history": [[r, d.hex()] for r, d in history],
        "parity": parity.status() if parity is not None else None,
        "waiting": waiting,
        "refused": refused(node),
    }


def admission_status(node: Node) -> dict[str, Any]:
    """How this swarm admits peers, whether the others admit us, whom we ignore, and the standing
    of every peer with verified strikes (node/trust/strikes.py)."""
    spec, presence = node.signed.spec if node.signed else None, node.presence
    if spec is None or presence is None or presence.view is None:
        return {"rule": spec.admission.mode if spec else None, "not_admitted": None, "ignored": [], "standing": {}}
    return {
        "rule": spec.admission.mode,
        "not_admitted": presence.not_admitted(),
        "ignored": presence.ignored(),
        "standing": {
            p: {
                "strikes": s.rounds,
                "excluded": s.excluded,
                "by_loss": s.by_loss,
                "by_spot": s.by_spot,
                "by_echo": s.by_echo,
            }
            for p, s in presence.standing().items()
        },
        # Loss scoring (node/trust/scoring.py): rounds this peer scored as an owner, skipped or cut short,
        # and the seconds rounds' results waited for it.
        "loss_scoring": (
            {"scored": node.scorer.scored, "skipped": node.scorer.skipped, "waited_s": round(node.scorer.waited, 3)}
            if node.scorer
            else None
        ),
        # Replay spot-checks (node/trust/spot_check.py): rounds this peer checked as an owner, and skipped.
        "spot_check": {"checked": spot.checked, "skipped": spot.skipped} if (spot := node.spot_checker) else None,
        # Loss and spot verdicts on peers holding another φ: passed over, and filed past the passes.
        "other_phi": {"passed": book.passed_over, "filed": book.filed_other_phi}
        if (book := presence.strikes)
        else None,
    }


def refused(node: Node) -> dict[str, int]:
    """Requests refused to peers, by reason (`not-a-member`, `round-out-of-window`, ...):
    the collective's, the data plane's, and the CRDT records the replica would not store
    (`crdt-not-a-member`, `crdt-not-admitted`: crdt/swarm_view.py), for `/metrics`."""
    out: dict[str, int] = {}
    for counts in (
        node.collective.refused if node.collective else {},
        node.streams.refused if node.streams else {},
        node.view.replica.stats.refusals_by_reason if node.view else {},
    ):
        for reason, n in counts.items():
            if n:
                out[reason] = out.get(reason, 0) + n
    return out


def status_document(node: Node) -> dict[str, Any]:
    """The status document (schema in `meshtrain.node.status.client`). Call it on the trio thread; it
    never waits for a training step (the trainer thread holds `trainer.lock` only while it
    publishes a step's numbers), so the status page and the console stay live under load."""
    host, view, trainer = node.host, node.view, node.trainer
    now = time.time()
    about = {
        "peer_id": host.peer_id if host else "",
        "name": node.config.name,
        "version": meshtrain.__version__,
        "started": node.started,
        "uptime_s": now - node.started,
        "swarm": node.signed.swarm_id if node.signed else "",
        "state": node.state,
        "state_changes": node.phase.changes,
        "recent_states": node.phase.recent(),
        "listen": host.addrs if host else [],
        "reachability": node.nat.connection_type if node.nat is not None else "unknown",
        "device": device_label(trainer.device) if trainer is not None else node.config.device,
        "local_ranks": node.local.world_size if node.local is not None else 1,
        "sharding": node.local.sharding if node.local is not None else "none",
        "local_rank_pids": node.local.pids if node.local is not None else [os.getpid()],
        "admission": admission_status(node),
        # node/presence.py's bound on connections, and what it holds now
        "connections": node.presence.connection_counts()
        if node.presence is not None and node.view is not None
        else {
            "connections": 0,
            "max_peers": node.config.max_peers,
            "wanted": 0,
            "unwanted": 0,
            "closed": 0,
            "one_off_closed": 0,
        },
    }
    training: dict[str, Any] = {
        "step": 0,
        "round": 0,
        "loss": None,
        "eval_loss": None,
        "optimizer": "",
        "samples_per_s": 0.0,
        "skipped_steps": 0,
        "round_wait_s": 0.0,
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
                skipped_steps=st.get("skipped_steps", 0),  # to keep the swarm's pace (node/pace.py)
                round_wait_s=round(st.get("comm_wait_seconds", 0.0), 3),  # training waited on rounds
                bytes_sent=st["bytes_sent"],
                bytes_received=st["bytes_received"],
                history=list(info.history),
                # With whom our newest exchanges averaged (in grouped rounds, our group), by round id.
                round_peers=[[r.step, list(r.peers)] for r in list(trainer.outer.history)[-ROUND_PEERS_SHOWN:]],
            )
        training["optimizer"] = trainer.spec.outer.optimizer
    pipeline = node.pipeline
    if pipeline is not None:
        training.update(pipeline.training_status())
    training.update(round_status(node))
    if training.get("waiting") is None and node.state in ("starting", "preparing"):
        # What start-up waits for (rounds say it themselves through round_status).
        # Fetching the spec from the join address, until a failed try says more.
        if node.signed is None and node.join_address is not None and node.join_address.addr:
            training["waiting"] = f"fetching the swarm spec from {node.join_address.addr}"
        elif view is None:
            training["waiting"] = "connecting to the swarm (bootstrap peers, DHT, membership)"
        elif node.config.wait_peers > 1 and trainer is not None and node.presence is not None:
            have = len(node.presence.trainers())
            if have < node.config.wait_peers:
                training["waiting"] = (
                    f"waiting for {node.config.wait_peers - have} more peer(s) before "
                    f"training starts ({have} of {node.config.wait_peers} here)"
                )
    peers = []
    standing = node.presence.standing() if node.presence is not None and view is not None else {}
    if view is not None and host is not None:
        progress, metrics = view.progress(), view.metrics()
        clock = node.presence.clock if node.presence is not None else None
        paths = node.streams.paths if node.streams is not None else {}
        at = time.monotonic()
        for p in view.live_peers(at=at):
            pr, me = progress.get(p.peer_id), metrics.get(p.peer_id)
            offset = clock.offset(p.peer_id) if clock is not None else None
            peers.append(
                {
                    "peer_id": p.peer_id,
                    "addr": p.addrs[0] if p.addrs else "",
                    "connection": ("self" if p.peer_id == host.peer_id else host.connection_type(p.peer_id) or "none"),
                    "data_path": paths.get(p.peer_id),
                    "role": p.role,
                    "in_from": p.in_from,
                    "step": pr.step if pr else 0,
                    "loss": me.values.get("loss") if me else None,
                    # by our clock: the peer's own may be minutes off (crdt/swarm_records.py)
                    "last_seen_s": max(0.0, view.age(MEMBERSHIP, p.peer_id, at) or 0.0),
                    "clock_offset_s": None if offset is None else round(offset, 3),
                    "reachability": p.connection,
                    "strikes": standing[p.peer_id].rounds if p.peer_id in standing else 0,
                }
            )
            if pipeline is not None:
                peers[-1]["stage"] = pipeline.announced_stage(p)
    keeper = node.run_state or node.pipeline
    doc: dict[str, Any] = {
        "node": about,
        "training": training,
        "peers": peers,
        "checkpoint": dict(keeper.last_checkpoint)
        if keeper is not None
        else {"last_step": None, "path": None, "saved_at": None},
        "joined_from": node.joined_from,
    }
    if pipeline is not None:
        doc["pipeline"] = pipeline.status()
    return doc
