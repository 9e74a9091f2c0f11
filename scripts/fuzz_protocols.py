"""Protocol fuzzer: hostile input from a non-member against a live swarm, on every protocol a node
serves (a swarm must survive strangers' bytes, not only their absence).

    python scripts/fuzz_protocols.py [--cases 10000] [--seed 0] [--nodes 2]

The problem. Every protocol a node serves is reachable by anyone who can open a libp2p connection
to it, member of the swarm or not. A soak found a fresh identity that had never joined the swarm
sending `allreduce/join` for a future round with `expected = [itself]`; the coordinator accepted
it as a group of one and both real members then fell into a state-download loop. Unit tests feed
each handler the inputs its author thought of; this feeds a real swarm the inputs nobody did.

Design.
- **Target**: a real swarm of `--nodes` (2-3) `Node`s training the tiny demo model on loopback,
  in this process and this trio run (so the oracles can watch the members from the inside), with
  short rounds (`--H`) and a short `join_timeout`. Startup waits until the first outer round
  completes with every member as a contributor: the baseline is a healthy swarm.
- **Attacker**: a `Host` with a fresh `Identity` (plus its own data plane, to receive what it is
  sent), connected to every member, that never writes a membership record: by the definition the
  node uses (`Node._membership`: live peers with role "trainer") it is not a member.
- **Cases** (`--cases`, counted one per hostile message sent). Every protocol the node serves,
  enumerated from the code (`rpc.serve(` and `set_stream_handler`): the `/meshtrain/*` RPCs
  (allreduce join/report/watch/where, dataplane session, crdt digest/pull, dht find/store, state
  manifest/chunk, swarm spec, dataplane-punch, reach-dialback), the data plane (raw TCP to the port
  a session reply names, sealed frames over a real session, the `/meshtrain/tensors/1` fallback),
  and the libp2p protocols it serves beside them (gossipsub, kad, circuit relay hop/stop, dcutr).
  Three kinds of input per protocol, drawn by hypothesis from `--seed`:
  *garbage* (recursive msgpack values of any shape, type and size); *frame-level defects*
  (truncated, oversized-length, non-msgpack and empty frames); and *valid-looking* messages built
  from the swarm's live state at send time: joins for the current round, for future rounds with
  `expected = [attacker]` and for far-off rounds (claiming any `uplink`, sane or not), replays of a member's join for a past round,
  reports and watches for real round keys, CRDT entries signed by the attacker that claim members'
  records or the swarm config, replays of members' old signed entries (pulled earlier), DHT
  records forged for members' subkeys and replays of their real ones, state-sync chunk requests
  for the real manifests, data-plane transfer headers for real all-reduce tags.
- **Oracles**, checked after every case (cheap ones) and every `CHECK_EVERY` seconds:
  *crash* — a member's `Node.run()` raised or returned while fuzzing, or the trio run raised;
  *hang* — a case got no answer (reply, error or close) within its protocol's deadline; the
  event loop stalled > `LOOP_STALL` s; a member's step counter stood still > `--stall` s; its
  HTTP status request took > `STATUS_TIMEOUT` s; or it did not stop within `STOP_TIMEOUT` s.
  Two waits are the attacker's own and not hangs: a well-formed transfer header waiting for a
  receive that will never come ("parked", the data plane's documented rendezvous), and a chunk
  request whose chunk the attacker never receives ("held"; reported as a `resource` finding);
  *non-member effect* — (1) the attacker got a join reply that placed it in a group; (2) a
  member's all-reduce ended with a group or contributors other than the members, or without the
  swarm (`CollectiveError`: "proceeding alone"), or a member started re-syncing; (3) a member's
  live-peer set changed; (4) a member accepted (stored) a CRDT entry owned by a non-member, of
  any kind — progress and metrics too, which readers ignore but storing them lets a stranger
  grow every member's replica (entries owned by a member verify against the member's own key: a
  relayed or replayed one is the member's own record, not an effect); (5) two members published different states (φ) for the
  same round; (6) a member's DHT announcement subkey holds a record its owner did not sign.
  A handler that answers `internal` (it raised) is reported as a finding of its own.
- **Positive control** (`--control`): afterwards a second fresh identity *is* made a member (it
  writes a live trainer record through its own `SwarmView`) and sends the same future-round join;
  the oracles must flag it. Without that, "0 effects" could mean blind oracles.

Output: progress on stderr; the last line of stdout one JSON object: cases, crashes, hangs,
nonmember_effects, crdt_refused (records the members' replicas refused to store, by reason: the
attacker's own progress and metrics land here), by_protocol (cases and outcomes per protocol), findings (the first few, each
with its protocol, family and input), seconds, and (with --control) control.

Not here: the pipeline RPCs (`pipeline/hop|abandon|failed|done`) — a `Node` runs no pipeline
runtime, so nothing serves them (sent anyway as `unserved`: the answer must be a clean refusal);
identify and ping (py-libp2p's own). Never sends anything to an address other than 127.0.0.1:
every address a case carries is rewritten to loopback before it leaves.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import random
import re
import struct
import sys
import tempfile
import time
import urllib.request
import warnings
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisDeprecationWarning

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import meshtrain  # noqa: E402
from meshtrain.collective.allreduce import JOIN_RPC, REPORT_RPC, WATCH_RPC, WHERE_RPC, WITHDRAW_RPC  # noqa: E402
from meshtrain.collective.contract import CollectiveError, RoundRequest  # noqa: E402
from meshtrain.crdt.anti_entropy import RPC_DIGEST, RPC_PULL  # noqa: E402
from meshtrain.crdt.entries import EntryScope, SignedEntry, encode_entries, sign_entry  # noqa: E402
from meshtrain.crdt.gossip import GOSSIP_VERSION, gossip_topic  # noqa: E402
from meshtrain.crdt.swarm_view import CONFIG, MEMBERSHIP, METRICS, PROGRESS, open_swarm_view  # noqa: E402
from meshtrain.crdt.types import LWWMap, LWWRegister, now_ms  # noqa: E402
from meshtrain.dht.discovery import peers_key  # noqa: E402
from meshtrain.dht.kademlia import FIND_RPC, KAD_PROTOCOL, NETWORK, STORE_RPC  # noqa: E402
from meshtrain.dht.records import Record  # noqa: E402
from meshtrain.node.spec.signed import SPEC_RPC  # noqa: E402
from meshtrain.node.state.sync import CHUNK_RPC, MANIFEST_RPC, MIN_CHUNK_BYTES  # noqa: E402
from meshtrain.node.trust.admission import POW_CAP, mint_pow  # noqa: E402
from meshtrain.transport.framing import LENGTH, FramedStream, WireError, packb  # noqa: E402
from meshtrain.transport.holepunch import PUNCH_RPC  # noqa: E402
from meshtrain.transport.host import Host, HostConfig, StreamOpenError  # noqa: E402
from meshtrain.transport.identity import Identity  # noqa: E402
from meshtrain.transport.reachability import DIALBACK_RPC  # noqa: E402
from meshtrain.transport.relay import HOP_PROTOCOL, STOP_PROTOCOL  # noqa: E402
from meshtrain.transport.rpc import (  # noqa: E402
    RemoteError,
    RpcProtocolError,
    RpcTimeout,
    RpcUnavailable,
    protocol_id,
)
from meshtrain.transport.tensor_streams import (  # noqa: E402
    FALLBACK_PROTOCOL,
    HEADER,
    MAGIC,
    SESSION_RPC,
    TensorStreams,
    TransferError,
)

DEFAULT_CASES = 10_000
DEFAULT_NODES = 2
DEFAULT_H = 8  # inner steps per outer round: about a round a second on the tiny model
DEFAULT_JOIN_TIMEOUT = 4.0
DEFAULT_STALL = 90.0  # a member's step counter standing still this long while fuzzing is a hang
CONCURRENCY = 24  # cases in flight at once (joins wait seconds for their group by design)
RPC_DEADLINE = 15.0  # an RPC must be answered within this (the server's read timeout is 10 s)
RAW_DEADLINE = 15.0  # a raw stream or TCP connection must be answered or closed within this
# How long a transfer header waits for an answer before we leave it "parked": the fallback stream
# refuses a non-member after ~3 s; a header for a receive that never comes is never answered.
PARK_WAIT = 5.0
LOOP_STALL = 10.0  # the event loop not running a 0.1 s sleep for this long is a hang
STATUS_TIMEOUT = 10.0
CHECK_EVERY = 2.0  # seconds between the slower oracle checks
STARTUP_TIMEOUT = 180.0
STOP_TIMEOUT = 30.0  # a member must stop cleanly this soon after stop() (the node says: seconds)
MAX_FINDINGS_SHOWN = 12
PIPELINE_RPCS = ("pipeline/hop", "pipeline/abandon", "pipeline/failed", "pipeline/done")
GOSSIP_PROTOCOLS = ("/meshsub/1.1.0", "/meshsub/1.0.0")
DCUTR_PROTOCOL = "/libp2p/dcutr"
LOOPBACK = "127.0.0.1"
_IP_LIKE = re.compile(r"(\d{1,3}\.){3}\d{1,3}|/ip6/|/dns|::|localhost", re.I)


# --------------------------------------------------------------------------------------------
# Results


@contextlib.asynccontextmanager
async def _reported() -> Any:
    """Print an exception leaving the block at once: the nodes' shutdown may take a while."""
    try:
        yield
    except BaseException as e:
        if not isinstance(e, trio.Cancelled):
            import traceback

            print("[fuzz] the fuzzer failed:\n" + "".join(traceback.format_exception(e))[-4000:], file=sys.stderr)
        raise


def _debug(text: str) -> None:
    if os.environ.get("FUZZ_DEBUG"):
        print(f"[fuzz debug {time.monotonic():.1f}] {text}", file=sys.stderr)


@dataclass
class Finding:
    kind: str  # "crash" | "hang" | "nonmember_effect" | "internal_error" | "resource" (a bounded hold)
    protocol: str
    family: str
    detail: str
    case_input: str = ""

    def to_json(self) -> dict[str, str]:
        return {
            "kind": self.kind,
            "protocol": self.protocol,
            "family": self.family,
            "detail": self.detail[:400],
            "input": self.case_input[:300],
        }


@dataclass
class Results:
    cases: int = 0
    crashes: int = 0
    hangs: int = 0
    nonmember_effects: int = 0
    internal_errors: int = 0
    by_protocol: dict[str, Counter] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    notes: set[str] = field(default_factory=set)
    _seen: set[tuple[str, str, str]] = field(default_factory=set)

    def count(self, protocol: str, outcome: str) -> None:
        c = self.by_protocol.setdefault(protocol, Counter())
        c["cases"] += 1
        c[outcome] += 1
        self.cases += 1

    def report(self, f: Finding) -> None:
        """Count a finding; identical ones (kind, protocol, detail) are listed once."""
        if f.kind == "crash":
            self.crashes += 1
        elif f.kind == "hang":
            self.hangs += 1
        elif f.kind == "nonmember_effect":
            self.nonmember_effects += 1
        elif f.kind == "internal_error":
            self.internal_errors += 1
        key = (f.kind, f.protocol, f.detail[:120])
        if key not in self._seen:
            self._seen.add(key)
            self.findings.append(f)
            print(f"[fuzz] FINDING {f.kind} {f.protocol}/{f.family}: {f.detail[:300]}", file=sys.stderr)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.add(text)
            print(f"[fuzz] note: {text}", file=sys.stderr)


# --------------------------------------------------------------------------------------------
# The swarm under test


@dataclass
class RoundSeen:
    """One all-reduce as a member saw it (recorded by wrapping its collective)."""

    member: str
    round_id: int
    tag: str
    contributors: tuple[str, ...] | None
    error: str
    at: float


class Swarm:
    """`n` real `Node`s on loopback in this trio run, watched from the inside.

    Startup returns once the first outer round completed with every member contributing.
    `crashed` lists members whose `run()` raised or returned; `rounds` every all-reduce seen;
    `entries_from_nonmembers` CRDT entries owned by non-members that a member accepted."""

    def __init__(self, data_dir: Path, n: int, H: int, join_timeout: float) -> None:
        self.data_dir = data_dir
        self.n = n
        self.H = H
        self.join_timeout = join_timeout
        self.nodes: list[meshtrain.Node] = []
        self.members: list[str] = []
        self.crashed: list[str] = []
        self.rounds: deque[RoundSeen] = deque(maxlen=4096)
        self.entries_from_nonmembers: list[tuple[str, str, str, int]] = []  # member, crdt, owner, seq
        self.resyncs: list[tuple[str, float]] = []
        self.stopping = False
        self.swarm_id = ""
        self._running: set[meshtrain.Node] = set()

    def config(self, name: str) -> meshtrain.NodeConfig:
        return meshtrain.NodeConfig(
            data_dir=self.data_dir / name,
            listen=[f"/ip4/{LOOPBACK}/tcp/0"],
            status_port=0,
            wait_peers=self.n,
            join_timeout=self.join_timeout,
            part_timeout=10.0,
            threads=1,
            checkpoint_every=3600.0,
            mdns=False,
            upnp=False,
            nat=True,
            relay=True,
        )

    async def start(self, nursery: trio.Nursery) -> None:
        spec = meshtrain.SwarmSpec(model="gpt-tiny", steps=0, H=self.H, eval_every=0, batch_size=4)
        owner = Identity.load_or_create(self.data_dir / "n0")
        signed = meshtrain.SignedSpec.create(spec, owner)
        self.swarm_id = signed.swarm_id
        first = meshtrain.Node(self.config("n0"), spec=signed)
        self.nodes.append(first)
        nursery.start_soon(self._run, first)
        with trio.fail_after(STARTUP_TIMEOUT):
            while first.view is None:
                await trio.sleep(0.05)
            for i in range(1, self.n):
                node = meshtrain.Node(self.config(f"n{i}"), join=first.host.addrs[0])
                self.nodes.append(node)
                nursery.start_soon(self._run, node)
            for node in self.nodes:
                while node.trainer is None or node.view is None:
                    await trio.sleep(0.02)
                self._instrument(node)
            self.members = sorted(node.host.peer_id for node in self.nodes)
            while not self._healthy_round_seen():
                if self.crashed:
                    raise RuntimeError(f"a member failed during startup: {self.crashed}")
                await trio.sleep(0.2)

    def _healthy_round_seen(self) -> bool:
        full = {
            r.member for r in self.rounds if r.contributors is not None and set(r.contributors) == set(self.members)
        }
        return full >= set(self.members)

    async def _run(self, node: meshtrain.Node) -> None:
        self._running.add(node)
        try:
            await node.run()
        except Exception as e:
            self.crashed.append(f"{node.host.peer_id if node.host else '?'}: {type(e).__name__}: {e}")
            return
        finally:
            self._running.discard(node)
        if not self.stopping:
            self.crashed.append(f"{node.host.peer_id}: run() returned while the swarm should train")

    def _instrument(self, node: meshtrain.Node) -> None:
        """Record every all-reduce's group and every CRDT entry a non-member owns."""
        me = node.host.peer_id
        collective = node.trainer.outer.collective
        inner = collective.all_reduce

        async def all_reduce(request: RoundRequest) -> Any:
            round_id, tag = request.round_id, request.tag
            try:
                result = await inner(request)
            except CollectiveError as e:
                self.rounds.append(RoundSeen(me, round_id, tag, None, str(e), time.monotonic()))
                raise
            self.rounds.append(RoundSeen(me, round_id, tag, tuple(result.contributors), "", time.monotonic()))
            return result

        collective.all_reduce = all_reduce

        def on_change(event: Any) -> None:
            for entry in event.entries:
                if self.members and entry.owner not in self.members:
                    self.entries_from_nonmembers.append((me, event.crdt, entry.owner, entry.seq))

        node.view.replica.on_change(on_change)

    def node_of(self, peer: str) -> meshtrain.Node:
        return next(n for n in self.nodes if n.host.peer_id == peer)

    @property
    def coordinator(self) -> str:
        return self.members[0]

    def step(self) -> int:
        return max(n.trainer.step for n in self.nodes)

    def round_id(self, offset_rounds: int = 0) -> int:
        """The id of the next round (offset 0), a later one (> 0) or an earlier one (< 0)."""
        return (self.step() // self.H + 1 + offset_rounds) * self.H

    def key(self, round_id: int, coordinator: str | None = None, tag: str = "f0") -> str:
        return f"{round_id}/{tag}/{coordinator or self.coordinator}"

    def stop(self) -> None:
        self.stopping = True
        for node in self.nodes:
            node.stop()

    async def stop_within(self, timeout: float, results: Results) -> None:
        """`stop()` every member; one that has not finished within `timeout` is a hang (the
        node documents a clean stop within seconds)."""
        self.stop()
        with trio.move_on_after(timeout):
            while self._running:
                await trio.sleep(0.1)
        for node in self._running:
            results.report(
                Finding(
                    "hang",
                    "node",
                    "stop",
                    f"member {node.host.peer_id[-8:]} did not stop within "
                    f"{timeout:g} s of stop() (state {node.state!r}, step {node.trainer.step}, "
                    f"last rounds {[(r.round_id, r.error[:80]) for r in self.rounds if r.member == node.host.peer_id][-3:]})",
                )
            )


# --------------------------------------------------------------------------------------------
# The attacker


class Attacker:
    """A fresh identity connected to every member, never a member itself."""

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm
        self.host: Host | None = None
        self.streams: TensorStreams | None = None
        self.captured_entries: dict[str, list[SignedEntry]] = {}  # members' entries pulled earlier
        self.captured_records: list[dict] = []  # members' DHT records fetched earlier
        self.sessions: dict[str, dict] = {}  # member -> a data-plane session reply
        self.manifests: dict[str, dict] = {}  # member -> its state manifest (MIN_CHUNK_BYTES)
        self.port = 0
        self._gossip_seqno = 0

    @property
    def peer_id(self) -> str:
        assert self.host is not None
        return self.host.peer_id

    async def start(self, stack: AsyncExitStack) -> None:
        self.host = await stack.enter_async_context(
            Host(Identity.generate(), HostConfig(listen=[f"/ip4/{LOOPBACK}/tcp/0"]))
        )
        self.streams = await stack.enter_async_context(TensorStreams(self.host))
        self.port = int(self.host.addrs[0].split("/tcp/")[1].split("/")[0])
        for node in self.swarm.nodes:
            await self.host.connect(node.host.addrs[0], timeout=10)

    async def rpc(self, peer: str, name: str, request: Any, timeout: float = RPC_DEADLINE) -> tuple[str, Any]:
        assert self.host is not None
        try:
            return "reply", await self.host.rpc.call(peer, name, request, timeout=timeout)
        except RemoteError as e:
            return f"error:{e.code}", e.text
        except RpcTimeout:
            return "hang", None
        except RpcUnavailable:
            return "unavailable", None
        except RpcProtocolError:
            return "closed", None

    async def raw(
        self, peer: str, protocol: str, data: bytes, *, reply_frames: bool = True, fire_and_forget: bool = False
    ) -> str:
        """Open `protocol`, write `data`, close our side, and see how the stream ends: a reply
        ("reply": a frame, or for non-RPC protocols any bytes), the stream closed or reset
        ("closed"), or nothing (the caller's deadline: a hang).

        `fire_and_forget` is for protocols with no answer (gossipsub keeps reading a stream for
        the next message): the outcome is "sent" if the node is still answering RPCs right after."""
        assert self.host is not None
        try:
            stream = await self.host.open_stream(peer, protocol, timeout=RAW_DEADLINE)
        except StreamOpenError:
            return "unavailable"
        try:
            if data:
                await stream.write(data)
            await stream.close()
            if fire_and_forget:
                with trio.move_on_after(PARK_WAIT):
                    with contextlib.suppress(Exception):
                        await stream.read(1 << 16)
                return await self.still_answering(peer, "sent")
            if not reply_frames:
                return "reply" if await stream.read(1 << 16) else "closed"
            try:
                await FramedStream(stream).read_frame()
                return "reply"
            except WireError:
                return "closed"
        except Exception:  # a reset or a dead stream: the server closed it on us
            return "closed"
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1), contextlib.suppress(Exception):
                await stream.reset()

    async def still_answering(self, peer: str, outcome: str) -> str:
        """`outcome` if `peer` answers a cheap RPC (its swarm spec) within the deadline, else "hang"."""
        got, _ = await self.rpc(peer, SPEC_RPC, {}, timeout=RPC_DEADLINE)
        return outcome if got == "reply" else "hang"

    async def tcp(self, port: int, data: bytes) -> str:
        """Raw bytes to a member's data-plane port; "reply" if it answered, "closed" if it hung up."""
        stream = await trio.open_tcp_stream(LOOPBACK, port)
        try:
            with contextlib.suppress(trio.BrokenResourceError, OSError):
                await stream.send_all(data)
                await stream.send_eof()
            got = b""
            with contextlib.suppress(trio.BrokenResourceError, OSError):
                while chunk := await stream.receive_some(1 << 16):
                    got += chunk
            return "reply+closed" if got else "closed"
        finally:
            await stream.aclose()

    def sign_gossip(self, data: bytes, topic: str, *, from_id: bytes | None = None) -> bytes:
        """A pubsub RPC publishing `data`, signed by the attacker (strict signing)."""
        from libp2p.pubsub.pb import rpc_pb2
        from libp2p.pubsub.validators import PUBSUB_SIGNING_PREFIX
        from libp2p.utils.varint import encode_uvarint

        assert self.host is not None
        self._gossip_seqno += 1
        msg = rpc_pb2.Message(
            data=data,
            topicIDs=[topic],
            from_id=from_id or self.host.libp2p.get_id().to_bytes(),
            seqno=self._gossip_seqno.to_bytes(8, "big"),
        )
        key = self.host.libp2p.get_private_key()
        msg.signature = key.sign(PUBSUB_SIGNING_PREFIX.encode() + msg.SerializeToString())
        msg.key = self.host.libp2p.get_public_key().serialize()
        rpc = rpc_pb2.RPC(publish=[msg])
        body = rpc.SerializeToString()
        return encode_uvarint(len(body)) + body


# --------------------------------------------------------------------------------------------
# Case generation (hypothesis)


def msgpack_values(max_leaves: int = 24) -> st.SearchStrategy:
    """Any msgpack value: every scalar type at its edges, nested lists and maps."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
        | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(max_size=80)
        | st.binary(max_size=160)
    )
    keys = st.text(max_size=12) | st.integers(min_value=-(1 << 31), max_value=1 << 31)
    return st.recursive(
        scalars,
        lambda kids: st.lists(kids, max_size=6) | st.dictionaries(keys, kids, max_size=6),
        max_leaves=max_leaves,
    )


def shaped(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """Maps with a protocol's field names, each value the right kind or anything, some fields
    missing, some extra: the shape a handler checks, broken one way at a time or all at once."""
    anything = msgpack_values(8)
    return st.fixed_dictionaries({}, optional={k: st.one_of(s, anything) for k, s in fields.items()}).flatmap(
        lambda d: st.dictionaries(st.text(max_size=8), anything, max_size=2).map(lambda extra: {**extra, **d})
    )


def sample(strategy: st.SearchStrategy, n: int, seed_value: int) -> list[Any]:
    """`n` values of `strategy`, deterministic for a seed (cycled if it has fewer)."""
    out: list[Any] = []
    if n <= 0:
        return out

    @settings(
        max_examples=n, database=None, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck)
    )
    @seed(seed_value)
    @given(strategy)
    def collect(value: Any) -> None:
        out.append(value)

    with warnings.catch_warnings():
        # Hypothesis compares the global `random` state around each draw. `plan` draws in a worker
        # thread (trio.to_thread) while the swarm's trio thread uses `random` itself (gossipsub's
        # peer picks, anti-entropy's jitter), which it would take for a strategy that uses `random`.
        warnings.filterwarnings("ignore", "Do not use the `random` module", HypothesisDeprecationWarning)
        collect()
    if not out:
        raise RuntimeError("hypothesis produced no examples")
    return [out[i % len(out)] for i in range(n)]


ints = st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
small_ints = st.integers(min_value=-3, max_value=1 << 20)
any_text = st.text(max_size=120)
# A join's `uplink` (collective/protocol.py: bytes/s, for bandwidth-weighted parts): absent, sane,
# or anything a liar might claim.
uplinks = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), ints, st.sampled_from([0, 1e30]))
FRAME_DEFECTS = st.sampled_from(
    [
        "truncated",
        "oversized_length",
        "not_msgpack",
        "no_q",
        "empty",
        "ext_type",
        "two_frames",
        "huge_declared_small_body",
    ]
)


def frame_bytes(defect: str, body: Any, rng: random.Random) -> bytes:
    """One RPC request frame broken in the named way."""
    good = packb({"q": body})
    if defect == "truncated":
        return LENGTH.pack(len(good)) + good[: max(0, len(good) // 2)]
    if defect == "oversized_length":
        return LENGTH.pack(0xFFFFFFFF) + good[:8]
    if defect == "huge_declared_small_body":
        return LENGTH.pack((4 << 20) - 1) + good
    if defect == "not_msgpack":
        junk = bytes([0xC1]) + rng.randbytes(rng.randrange(0, 64))  # 0xC1: never valid msgpack
        return LENGTH.pack(len(junk)) + junk
    if defect == "no_q":
        b = packb(body)
        return LENGTH.pack(len(b)) + b
    if defect == "ext_type":
        b = b"\xd4\x05\x00"  # fixext1, type 5: extensions are refused
        return LENGTH.pack(len(b)) + b
    if defect == "two_frames":
        return LENGTH.pack(len(good)) + good + LENGTH.pack(len(good)) + good
    return b""


def loopback_only(value: Any, port: int) -> Any:
    """The same value with every address-like string and every port-like field pointing at
    127.0.0.1 (the attacker's own port): no case may make a node dial anywhere else."""
    if isinstance(value, str):
        return f"/ip4/{LOOPBACK}/tcp/{port}" if _IP_LIKE.search(value) else value
    if isinstance(value, list):
        return [loopback_only(v, port) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k in ("ports", "port", "addr", "addrs"):
                v = (
                    [LOOPBACK, port]
                    if k == "addr"
                    else ([port] if k == "ports" else (port if k == "port" else [f"/ip4/{LOOPBACK}/tcp/{port}"]))
                )
            out[k] = loopback_only(v, port)
        return out
    return value


# --------------------------------------------------------------------------------------------
# Case families: what one hostile message is, per protocol


@dataclass
class Ctx:
    swarm: Swarm
    attacker: Attacker
    results: Results
    rng: random.Random

    def target(self, i: int) -> str:
        return self.swarm.members[i % len(self.swarm.members)]

    def effect(self, protocol: str, family: str, detail: str, case_input: Any) -> None:
        self.results.report(Finding("nonmember_effect", protocol, family, detail, repr(case_input)))


Send = Callable[[Ctx, Any], Awaitable[str]]


@dataclass(frozen=True)
class Family:
    protocol: str
    name: str
    strategy: st.SearchStrategy
    send: Send
    weight: int
    deadline: float = RPC_DEADLINE + 5


def _rpc_garbage(name: str, fields: dict[str, st.SearchStrategy] | None = None) -> tuple[st.SearchStrategy, Send]:
    """Requests of the protocol's shape with wrong values, or any msgpack value at all."""
    body = st.one_of(shaped(fields), msgpack_values()) if fields else msgpack_values()
    strat = st.tuples(st.integers(0, 7), body)

    async def send(ctx: Ctx, params: Any) -> str:
        i, body = params
        body = loopback_only(body, ctx.attacker.port)
        outcome, _ = await ctx.attacker.rpc(ctx.target(i), name, body)
        return outcome

    return strat, send


def _rpc_frames(name: str) -> tuple[st.SearchStrategy, Send]:
    strat = st.tuples(st.integers(0, 7), FRAME_DEFECTS, msgpack_values(6))

    async def send(ctx: Ctx, params: Any) -> str:
        i, defect, body = params
        data = frame_bytes(defect, loopback_only(body, ctx.attacker.port), ctx.rng)
        return await ctx.attacker.raw(ctx.target(i), protocol_id(name), data)

    return strat, send


# -- allreduce: the coordinator's RPCs ------------------------------------------------------------


def _join_reply_check(ctx: Ctx, family: str, request: Any, outcome: str, reply: Any) -> None:
    me = ctx.attacker.peer_id
    if outcome == "reply" and isinstance(reply, dict) and "attempt" in reply:
        group = reply.get("group")
        if isinstance(group, list) and me in group:
            ctx.effect(
                "allreduce/join", family, f"a non-member was accepted into a round's group: {reply!r:.200}", request
            )


async def join_future_self(ctx: Ctx, params: Any) -> str:
    """The soak's case: a key for a coming round, `expected = [attacker]`, with any `uplink`."""
    offset, coord_pick, uplink = params
    sw = ctx.swarm
    coordinator = sw.coordinator if coord_pick == 0 else ctx.target(coord_pick)
    req = {"key": sw.key(sw.round_id(offset), coordinator), "expected": [ctx.attacker.peer_id], "skipped": []}
    if uplink is not None:
        req["uplink"] = uplink
    outcome, reply = await ctx.attacker.rpc(coordinator, JOIN_RPC, req, timeout=join_deadline(sw))
    _join_reply_check(ctx, "join_future_self", req, outcome, reply)
    return outcome


async def join_with_members(ctx: Ctx, params: Any) -> str:
    """A join for a coming round that lists the real members and the attacker, as a member
    would list a newcomer it has heard of, claiming any `uplink` (a huge one would win it a large part)."""
    offset, uplink = params
    sw = ctx.swarm
    req = {"key": sw.key(sw.round_id(offset)), "expected": [*sw.members, ctx.attacker.peer_id], "skipped": []}
    if uplink is not None:
        req["uplink"] = uplink
    outcome, reply = await ctx.attacker.rpc(sw.coordinator, JOIN_RPC, req, timeout=join_deadline(sw))
    _join_reply_check(ctx, "join_with_members", req, outcome, reply)
    return outcome


async def join_replay(ctx: Ctx, params: Any) -> str:
    """A member's join for a past round, replayed (the request it sent, byte for byte)."""
    (back,) = params
    sw = ctx.swarm
    req = {"key": sw.key(sw.round_id(-back)), "expected": list(sw.members), "skipped": []}
    outcome, reply = await ctx.attacker.rpc(sw.coordinator, JOIN_RPC, req, timeout=join_deadline(sw))
    _join_reply_check(ctx, "join_replay", req, outcome, reply)
    return outcome


async def join_far(ctx: Ctx, params: Any) -> str:
    """A join for a round id far from the swarm's: huge, negative, zero, or not a number."""
    rid, expected_self = params
    sw = ctx.swarm
    expected = [ctx.attacker.peer_id] if expected_self else list(sw.members)
    req = {"key": f"{rid}/f0/{sw.coordinator}", "expected": expected, "skipped": []}
    outcome, reply = await ctx.attacker.rpc(sw.coordinator, JOIN_RPC, req, timeout=join_deadline(sw))
    _join_reply_check(ctx, "join_far", req, outcome, reply)
    return outcome


async def report_real(ctx: Ctx, params: Any) -> str:
    """A report for a real round key: failure blaming a member, or success with a bogus digest."""
    offset, attempt, status, blame_i = params
    sw = ctx.swarm
    req = {
        "key": sw.key(sw.round_id(offset)),
        "attempt": attempt,
        "status": status,
        "digest": None if status == "fail" else os.urandom(32),
        "suspects": [ctx.target(blame_i)],
        "rejected": [ctx.target(blame_i + 1)],
        "evidence": True,
    }
    outcome, _ = await ctx.attacker.rpc(sw.coordinator, REPORT_RPC, req, timeout=join_deadline(sw))
    return outcome


async def watch_real(ctx: Ctx, params: Any) -> str:
    offset, attempt = params
    sw = ctx.swarm
    req = {"key": sw.key(sw.round_id(offset)), "attempt": attempt}
    outcome, _ = await ctx.attacker.rpc(sw.coordinator, WATCH_RPC, req, timeout=join_deadline(sw))
    return outcome


async def withdraw_real(ctx: Ctx, params: Any) -> str:
    (offset,) = params
    sw = ctx.swarm
    outcome, _ = await ctx.attacker.rpc(sw.coordinator, WITHDRAW_RPC, {"key": sw.key(sw.round_id(offset))})
    return outcome


async def where_real(ctx: Ctx, params: Any) -> str:
    offset, i = params
    sw = ctx.swarm
    outcome, _ = await ctx.attacker.rpc(ctx.target(i), WHERE_RPC, {"tag": "f0", "round": sw.round_id(offset)})
    return outcome


def join_deadline(sw: Swarm) -> float:
    """A join may legitimately wait out the hard join deadline (3 x join_timeout) and a round."""
    return 3 * sw.join_timeout + 30


# -- data plane ---------------------------------------------------------------------------------


async def session_open(ctx: Ctx, params: Any) -> str:
    (i,) = params
    peer = ctx.target(i)
    outcome, reply = await ctx.attacker.rpc(peer, SESSION_RPC, {"op": "open"})
    if outcome == "reply" and isinstance(reply, dict):
        ctx.attacker.sessions[peer] = reply
        ctx.results.note("dataplane: a non-member is handed a data-plane session (sid, key, port)")
    return outcome


def _port_of(ctx: Ctx, i: int) -> int:
    node = ctx.swarm.nodes[i % len(ctx.swarm.nodes)]
    return int(node.trainer.outer.collective.streams.port)


async def tcp_garbage(ctx: Ctx, params: Any) -> str:
    """Bytes to the data-plane port: junk, a bad magic, an unknown session, a cut-off opening."""
    i, kind, junk = params
    peer = ctx.target(i)
    port = _port_of(ctx, ctx.swarm.members.index(peer))
    sess = ctx.attacker.sessions.get(peer)
    if kind == "junk":
        data = junk
    elif kind == "bad_magic":
        data = b"MTDP0" + junk[:32].ljust(32, b"\0")
    elif kind == "unknown_session":
        data = MAGIC + os.urandom(32)
    elif kind == "short_opening":
        data = MAGIC + junk[:10]
    elif kind == "replayed_opening" and sess and isinstance(sess.get("sid"), bytes):
        data = MAGIC + sess["sid"] + os.urandom(16) + junk  # server's fresh nonce: junk fails auth
    else:
        data = MAGIC + (sess["sid"] if sess and isinstance(sess.get("sid"), bytes) else os.urandom(16)) + junk[:16]
    return await ctx.attacker.tcp(port, data)


async def sealed_header(ctx: Ctx, params: Any) -> str:
    """A real session, a correct handshake, then a hostile HEADER: a real all-reduce tag with
    hostile specs, or hypothesis garbage as the header. The receiver must refuse or park it."""
    i, header_kind, garbage = params
    peer = ctx.target(i)
    a = ctx.attacker
    outcome, reply = await a.rpc(peer, SESSION_RPC, {"op": "open"})
    if outcome != "reply" or not isinstance(reply, dict):
        return f"session-{outcome}"
    return await _send_header(ctx, peer, reply, header_kind, garbage)


def _session_keys(key: bytes, cnonce: bytes, snonce: bytes, client: str, server: str) -> bytes:
    """The client->server key of a data-plane connection, derived as the wire spec says
    (tensor_streams.py: HKDF-SHA256 over both nonces and both peer ids), written out here again
    so that the fuzzer is a second, independent client rather than the node's own code."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    okm = HKDF(
        algorithm=hashes.SHA256(),
        length=64,
        salt=cnonce + snonce,
        info=b"meshtrain/dataplane/1|" + client.encode() + b"|" + server.encode(),
    ).derive(key)
    return okm[:32]


def _sealed_frame(key: bytes, counter: int, kind: int, body: bytes) -> bytes:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    sealed = AESGCM(key).encrypt(b"\0\0\0\0" + counter.to_bytes(8, "big"), body, bytes([kind]))
    return struct.pack(">IB", len(sealed) + 1, kind) + sealed


async def _send_header(ctx: Ctx, peer: str, session: dict, header_kind: str, garbage: Any) -> str:
    sw, a = ctx.swarm, ctx.attacker
    sid, key, port = session.get("sid"), session.get("key"), session.get("port")
    if not (isinstance(sid, bytes) and isinstance(key, bytes) and isinstance(port, int)):
        return "session-malformed"
    stream = await trio.open_tcp_stream(LOOPBACK, port)
    try:
        cnonce = os.urandom(16)
        await stream.send_all(MAGIC + sid + cnonce)
        snonce = await FramedStream(stream).read_exactly(16)
        c2s = _session_keys(key, cnonce, snonce, a.peer_id, peer)
        await stream.send_all(_sealed_frame(c2s, 0, HEADER, packb(_hostile_header(sw, header_kind, garbage))))
        with trio.move_on_after(PARK_WAIT):
            got = await stream.receive_some(1 << 16)
            return "reply" if got else "closed"
        return "parked"
    except (WireError, OSError, trio.BrokenResourceError):
        return "closed"
    finally:
        await stream.aclose()


def _hostile_header(sw: Swarm, kind: str, garbage: Any) -> Any:
    tag = f"ar/{sw.key(sw.round_id(0))}/0/rs/0"
    if kind == "garbage":
        return garbage
    specs: Any = [["values", "float32", [1 << 20]]]
    if kind == "huge_specs":
        specs = [["values", "float32", [1 << 40, 1 << 40]]]
    elif kind == "bad_dtype":
        specs = [["values", "object", [4]]]
    elif kind == "negative_shape":
        specs = [["values", "float32", [-1]]]
    return {
        "tag": tag if kind != "long_tag" else "x" * 10_000,
        "xfer": os.urandom(16),
        "specs": specs,
        "meta": {"w": float("nan")},
        "digest": None,
    }


async def fallback_stream(ctx: Ctx, params: Any) -> str:
    """`/meshtrain/tensors/1`: the data-plane frames unsealed over libp2p."""
    i, kind, garbage = params
    sw = ctx.swarm
    if kind == "junk":
        data = garbage if isinstance(garbage, bytes) else packb(garbage)
    else:
        body = packb(_hostile_header(sw, kind, garbage))
        data = struct.pack(">IB", len(body) + 1, HEADER) + body
        if kind == "truncated":
            data = data[: len(data) // 2]
    assert ctx.attacker.host is not None
    try:
        stream = await ctx.attacker.host.open_stream(ctx.target(i), FALLBACK_PROTOCOL, timeout=RAW_DEADLINE)
    except StreamOpenError:
        return "unavailable"
    try:
        await stream.write(data)
        with trio.move_on_after(PARK_WAIT):
            try:
                got = await stream.read(1 << 16)
                return "reply" if got else "closed"
            except Exception:
                return "closed"
        return "parked"
    except Exception:
        return "closed"
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(1), contextlib.suppress(Exception):
            await stream.reset()


# -- CRDT: anti-entropy RPCs and gossip -----------------------------------------------------------


def _crdt_types() -> dict[str, str]:
    return {
        MEMBERSHIP: LWWRegister.type_tag,
        PROGRESS: LWWRegister.type_tag,
        METRICS: LWWRegister.type_tag,
        CONFIG: LWWMap.type_tag,
    }


def _forged_entries(ctx: Ctx, kind: str, n: int, value: Any) -> tuple[str, list[SignedEntry]]:
    """Entries signed by the attacker. `claim_member`: owner field says a member (signature is
    the attacker's); `own_config`: a config write by a non-owner; `own_progress` / `own_metrics`:
    the attacker's own records with extreme values; `replay`: members' old entries, as pulled."""
    sw, a = ctx.swarm, ctx.attacker
    types = _crdt_types()
    assert a.host is not None
    ident = a.host.identity
    ts = now_ms()
    if kind == "replay":
        names = [k for k, v in a.captured_entries.items() if v]
        if not names:
            return PROGRESS, []
        name = names[n % len(names)]
        return name, a.captured_entries[name]
    if kind == "claim_member":
        name = (MEMBERSHIP, PROGRESS, METRICS)[n % 3]
        target = sw.members[n % len(sw.members)]
        body = _record_body(name, ts, value)
        entry = sign_entry(ident, EntryScope(sw.swarm_id, name, types[name]), 1 << 40, body)
        return name, [SignedEntry(target, entry.seq, entry.body, entry.signature)]
    if kind == "own_config":
        body = [[ts, "spec", value if value is not None else {"evil": True}]]
        try:
            return CONFIG, [sign_entry(ident, EntryScope(sw.swarm_id, CONFIG, types[CONFIG]), 1 << 40, body)]
        except Exception:
            return CONFIG, []
    name = PROGRESS if kind == "own_progress" else METRICS
    body = _record_body(name, ts, value)
    return name, [sign_entry(ident, EntryScope(sw.swarm_id, name, types[name]), 1 + n, body)]


def _record_body(name: str, ts: int, value: Any) -> Any:
    if name == MEMBERSHIP:  # a live trainer record (claimed for a member by the attacker)
        return [
            ts,
            {
                "addrs": [f"/ip4/{LOOPBACK}/tcp/1"],
                "role": "trainer",
                "caps": {},
                "conn": "direct",
                "lease": 3_600_000,
                "left": bool(value) if isinstance(value, bool) else True,
            },
        ]
    if name == PROGRESS:
        big = (1 << 63) - 1
        return [ts, {"step": big, "samples": big, "round": big}]
    return [ts, {"loss": -1e308, "samples_per_s": 1e308}]


async def crdt_pull_entries(ctx: Ctx, params: Any) -> str:
    """`crdt/pull` pushing forged or replayed entries (and pulling everything, to replay later)."""
    i, kind, n, value = params
    sw, a = ctx.swarm, ctx.attacker
    try:
        name, entries = _forged_entries(ctx, kind, n, value)
    except Exception as e:  # a value our own signer refuses is not a case
        return f"unsendable:{type(e).__name__}"
    push = {name: encode_entries(_crdt_types()[name], entries)} if entries else {}
    outcome, reply = await a.rpc(ctx.target(i), RPC_PULL, {"ns": sw.swarm_id, "d": {}, "p": push})
    if outcome == "reply" and isinstance(reply, dict) and isinstance(reply.get("e"), dict):
        from meshtrain.crdt.entries import decode_entries

        for cname, data in reply["e"].items():
            with contextlib.suppress(Exception):
                got = decode_entries(data)[1]
                if cname in _crdt_types() and got and len(a.captured_entries.get(cname, [])) < 64:
                    a.captured_entries.setdefault(cname, []).extend(got)
    return outcome


async def gossip_publish(ctx: Ctx, params: Any) -> str:
    """A gossipsub message signed by the attacker on the swarm's topic, carrying forged or
    replayed entries, a hostile envelope, or a forged origin."""
    i, kind, n, value = params
    sw, a = ctx.swarm, ctx.attacker
    topic = gossip_topic(sw.swarm_id)
    from_id = None
    if kind in ("claim_member", "own_config", "own_progress", "own_metrics", "replay"):
        try:
            name, entries = _forged_entries(ctx, kind, n, value)
        except Exception as e:
            return f"unsendable:{type(e).__name__}"
        if not entries:
            return "unsendable:no-entries"
        data = packb([GOSSIP_VERSION, sw.swarm_id, [[name, encode_entries(_crdt_types()[name], entries)]]])
    elif kind == "envelope_garbage":
        data = packb(value)
    elif kind == "wrong_swarm":
        data = packb([GOSSIP_VERSION, "ms" + "0" * 20, []])
    elif kind == "forged_origin":  # claims a member published it; the signature is ours
        data = packb([GOSSIP_VERSION, sw.swarm_id, []])
        from libp2p.peer.id import ID

        from_id = ID.from_base58(ctx.target(i)).to_bytes()
    else:  # raw protobuf junk on the gossip stream
        junk = value if isinstance(value, bytes) else packb(value)
        from libp2p.utils.varint import encode_uvarint

        return await a.raw(
            ctx.target(i), GOSSIP_PROTOCOLS[n % 2], encode_uvarint(len(junk)) + junk, fire_and_forget=True
        )
    rpc = a.sign_gossip(data, topic, from_id=from_id)
    return await a.raw(ctx.target(i), GOSSIP_PROTOCOLS[0], rpc, fire_and_forget=True)


# -- DHT ------------------------------------------------------------------------------------------


async def dht_records(ctx: Ctx, params: Any) -> str:
    """`dht/store` of records forged for members' subkeys, replays of their real records, and the
    attacker's own announcement; `dht/find` of the swarm's peers key (to capture records)."""
    i, kind, value = params
    sw, a = ctx.swarm, ctx.attacker
    key = peers_key(sw.swarm_id)
    assert a.host is not None
    ident = a.host.identity
    if kind == "find":
        outcome, reply = await a.rpc(ctx.target(i), FIND_RPC, {"swarm": NETWORK, "target": os.urandom(32), "key": key})
        if outcome == "reply" and isinstance(reply, dict) and isinstance(reply.get("records"), list):
            a.captured_records = reply["records"][:16]
        return outcome
    expiry = time.time() + 60
    ann = {
        "addrs": [f"/ip4/{LOOPBACK}/tcp/{a.port}/p2p/{a.peer_id}"],
        "role": "trainer",
        "caps": {},
        "version": meshtrain.__version__,
    }
    if kind == "forged_subkey":
        rec = Record.create(ident, NETWORK, key, ann, expiry, subkey=ctx.target(i)).to_wire()
    elif kind == "claim_owner":
        rec = Record.create(ident, NETWORK, key, ann, expiry, subkey=ctx.target(i)).to_wire()
        rec["o"] = ctx.target(i)
    elif kind == "replay" and a.captured_records:
        rec = dict(a.captured_records[i % len(a.captured_records)])
    elif kind == "own":
        rec = Record.create(ident, NETWORK, key, ann, expiry, subkey=a.peer_id).to_wire()
    else:
        rec = loopback_only(value, a.port)
    outcome, _ = await a.rpc(ctx.target(i), STORE_RPC, {"swarm": NETWORK, "key": key, "records": [rec]})
    return outcome


# -- state sync -----------------------------------------------------------------------------------


async def state_manifest(ctx: Ctx, params: Any) -> str:
    i, cb = params
    peer = ctx.target(i)
    outcome, reply = await ctx.attacker.rpc(peer, MANIFEST_RPC, {"chunk_bytes": cb})
    if outcome == "reply" and cb == MIN_CHUNK_BYTES and isinstance(reply, dict):
        ctx.attacker.manifests[peer] = reply
    return outcome


async def state_chunk(ctx: Ctx, params: Any) -> str:
    """A chunk request for a real manifest (the donor then sends it to us over the data plane);
    or with a hostile index, chunk size or fetch id."""
    i, index, fetch, receive = params
    a = ctx.attacker
    peer = ctx.target(i)
    man = a.manifests.get(peer)
    if man is None:
        outcome, man = await a.rpc(peer, MANIFEST_RPC, {"chunk_bytes": MIN_CHUNK_BYTES})
        if outcome != "reply" or not isinstance(man, dict):
            return f"manifest-{outcome}"
        a.manifests[peer] = man
    snaps = man.get("snapshots") or [{}]
    snap = snaps[index % len(snaps)] if isinstance(snaps, list) and snaps else {}
    digest = snap.get("digest", os.urandom(32)) if isinstance(snap, dict) else os.urandom(32)
    n_chunks = len(snap.get("chunks", [])) if isinstance(snap, dict) else 0
    idx = index % max(n_chunks, 1) if receive else index
    req = {"digest": digest, "chunk_bytes": MIN_CHUNK_BYTES, "index": idx, "fetch": fetch}
    if not receive or not isinstance(snap, dict) or "round" not in snap:
        with trio.move_on_after(RPC_DEADLINE):
            outcome, _ = await a.rpc(peer, CHUNK_RPC, req)
            return outcome
        # The donor is sending us the chunk and we never receive it: its answer waits on us
        # (a rendezvous we do not complete, like a parked header), not on the node.
        ctx.results.report(
            Finding(
                "resource",
                CHUNK_RPC,
                "real_manifest",
                "a chunk request whose sender never receives the chunk "
                "is answered only when the donor's send times out (DONOR_SEND_TIMEOUT, 120 s), holding one of "
                "the donor's MAX_CONCURRENT_SENDS (8) send slots and MAX_SENDS_PER_PEER (4) per identity meanwhile: "
                "two identities, member or not, can stall every joiner's download",
                repr(req),
            )
        )
        return "held"
    result = {"outcome": "hang"}
    assert a.streams is not None

    async def get() -> None:
        with contextlib.suppress(TransferError):
            await a.streams.receive(peer, f"state/{snap['round']}/{idx}/{fetch}", timeout=RPC_DEADLINE)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(get)
        result["outcome"], _ = await a.rpc(peer, CHUNK_RPC, req)
        nursery.cancel_scope.cancel()
    return result["outcome"]


# -- NAT traversal, spec, relay, kad, dcutr, pipeline ---------------------------------------------


async def punch_valid(ctx: Ctx, params: Any) -> str:
    i, op, token = params
    a = ctx.attacker
    req = (
        {"op": "prepare", "addr": [LOOPBACK, a.port], "public": True}
        if op == "prepare"
        else {"op": "go", "token": token}
    )
    outcome, reply = await a.rpc(ctx.target(i), PUNCH_RPC, req, timeout=RPC_DEADLINE + 10)
    if op == "prepare" and outcome == "reply" and isinstance(reply, dict) and "key" in reply:
        ctx.results.note(
            "dataplane-punch: `prepare` hands a non-member a data-plane session "
            "(sid, key, port) — a second door beside the dataplane RPC"
        )
    return outcome


async def dialback_valid(ctx: Ctx, params: Any) -> str:
    (i,) = params
    outcome, _ = await ctx.attacker.rpc(
        ctx.target(i), DIALBACK_RPC, {"ports": [ctx.attacker.port]}, timeout=RPC_DEADLINE + 10
    )
    return outcome


async def protobuf_stream(ctx: Ctx, params: Any) -> str:
    """Varint-delimited protobuf (valid relay messages, or junk) on a libp2p protocol."""
    i, proto, kind, junk = params
    from libp2p.utils.varint import encode_uvarint

    if proto in (HOP_PROTOCOL, STOP_PROTOCOL) and kind != "junk":
        from libp2p.peer.id import ID
        from libp2p.relay.circuit_v2.pb import circuit_pb2 as pb

        target = ID.from_base58(ctx.target(i + 1)).to_bytes()
        if proto == HOP_PROTOCOL:
            msg = pb.HopMessage(
                type=pb.HopMessage.RESERVE if kind == "reserve" else pb.HopMessage.CONNECT,
                peer=pb.Peer(id=target) if hasattr(pb, "Peer") else None,
            )
        else:
            msg = pb.StopMessage(type=pb.StopMessage.CONNECT)
        body = msg.SerializeToString()
    else:
        body = junk
    return await ctx.attacker.raw(ctx.target(i), proto, encode_uvarint(len(body)) + body, reply_frames=False)


async def unserved(ctx: Ctx, params: Any) -> str:
    i, name, body = params
    outcome, _ = await ctx.attacker.rpc(ctx.target(i), name, loopback_only(body, ctx.attacker.port))
    return outcome


def families() -> list[Family]:
    """Every case family, with its share of the cases (`weight`)."""
    fam: list[Family] = []

    def rpc(protocol: str, fields: dict[str, st.SearchStrategy] | None, w_garbage: int, w_frames: int) -> None:
        s, send = _rpc_garbage(protocol, fields)
        fam.append(Family(protocol, "garbage", s, send, w_garbage))
        s, send = _rpc_frames(protocol)
        fam.append(Family(protocol, "frames", s, send, w_frames))

    key_text = st.one_of(any_text, st.builds(lambda r, t, c: f"{r}/{t}/{c}", ints, any_text, any_text))
    rpc(
        JOIN_RPC,
        {
            "key": key_text,
            "expected": st.lists(any_text, max_size=5),
            "skipped": st.lists(any_text, max_size=3),
            "uplink": uplinks,
        },
        6,
        2,
    )
    long = 3 * DEFAULT_JOIN_TIMEOUT + 40
    fam += [
        Family(
            JOIN_RPC,
            "join_future_self",
            st.tuples(st.integers(0, 3), st.integers(0, 2), uplinks),
            join_future_self,
            3,
            long,
        ),
        Family(JOIN_RPC, "join_with_members", st.tuples(st.integers(0, 2), uplinks), join_with_members, 1, long),
        Family(JOIN_RPC, "join_replay", st.tuples(st.integers(1, 6)), join_replay, 2, long),
        Family(
            JOIN_RPC,
            "join_far",
            st.tuples(st.one_of(ints, st.just(0), st.just(1 << 62)), st.booleans()),
            join_far,
            2,
            long,
        ),
    ]
    rpc(
        REPORT_RPC,
        {
            "key": key_text,
            "attempt": ints,
            "status": st.sampled_from(["done", "fail", ""]),
            "digest": st.one_of(st.none(), st.binary(max_size=40)),
            "suspects": st.lists(any_text),
            "rejected": st.lists(any_text),
            "evidence": st.booleans(),
        },
        5,
        1,
    )
    fam.append(
        Family(
            REPORT_RPC,
            "report_real",
            st.tuples(st.integers(-3, 1), st.integers(-1, 3), st.sampled_from(["done", "fail"]), st.integers(0, 5)),
            report_real,
            3,
            long,
        )
    )
    rpc(WATCH_RPC, {"key": key_text, "attempt": ints}, 4, 1)
    fam.append(Family(WATCH_RPC, "watch_real", st.tuples(st.integers(-3, 0), st.integers(-1, 3)), watch_real, 2, long))
    rpc(WITHDRAW_RPC, {"key": key_text}, 2, 1)
    fam.append(Family(WITHDRAW_RPC, "withdraw_real", st.tuples(st.integers(-3, 3)), withdraw_real, 1))
    rpc(WHERE_RPC, {"tag": any_text, "round": ints}, 3, 1)
    fam.append(Family(WHERE_RPC, "where_real", st.tuples(st.integers(-3, 3), st.integers(0, 5)), where_real, 1))

    rpc(SESSION_RPC, {"op": st.sampled_from(["open", "close", ""])}, 3, 1)
    fam.append(Family(SESSION_RPC, "session_open", st.tuples(st.integers(0, 5)), session_open, 1))
    fam.append(
        Family(
            "dataplane-tcp",
            "raw",
            st.tuples(
                st.integers(0, 5),
                st.sampled_from(
                    ["junk", "bad_magic", "unknown_session", "short_opening", "replayed_opening", "session_then_junk"]
                ),
                st.binary(max_size=256),
            ),
            tcp_garbage,
            6,
            RAW_DEADLINE + 5,
        )
    )
    fam.append(
        Family(
            "dataplane-tcp",
            "sealed_header",
            st.tuples(
                st.integers(0, 5),
                st.sampled_from(["real_tag", "huge_specs", "bad_dtype", "negative_shape", "long_tag", "garbage"]),
                msgpack_values(10),
            ),
            sealed_header,
            4,
            RAW_DEADLINE + 5,
        )
    )
    fam.append(
        Family(
            FALLBACK_PROTOCOL,
            "frames",
            st.tuples(
                st.integers(0, 5),
                st.sampled_from(["junk", "real_tag", "huge_specs", "bad_dtype", "truncated", "garbage"]),
                msgpack_values(10),
            ),
            fallback_stream,
            4,
            RAW_DEADLINE + 5,
        )
    )

    rpc(
        RPC_DIGEST,
        {"ns": st.one_of(any_text), "fp": st.dictionaries(any_text, st.binary(max_size=20), max_size=8)},
        3,
        1,
    )
    rpc(
        RPC_PULL,
        {
            "ns": any_text,
            "d": st.dictionaries(any_text, msgpack_values(6), max_size=4),
            "p": st.dictionaries(any_text, st.binary(max_size=200), max_size=4),
        },
        4,
        1,
    )
    crdt_kinds = st.sampled_from(["claim_member", "own_config", "own_progress", "own_metrics", "replay"])
    fam.append(
        Family(
            RPC_PULL,
            "entries",
            st.tuples(st.integers(0, 5), crdt_kinds, st.integers(0, 100), msgpack_values(6)),
            crdt_pull_entries,
            4,
        )
    )
    fam.append(
        Family(
            "gossipsub",
            "publish",
            st.tuples(
                st.integers(0, 5),
                st.one_of(
                    crdt_kinds, st.sampled_from(["envelope_garbage", "wrong_swarm", "forged_origin", "protobuf_junk"])
                ),
                st.integers(0, 100),
                msgpack_values(8),
            ),
            gossip_publish,
            6,
            RAW_DEADLINE + 5,
        )
    )

    rpc(FIND_RPC, {"swarm": any_text, "target": st.binary(max_size=600), "key": st.one_of(st.none(), any_text)}, 3, 1)
    rpc(STORE_RPC, {"swarm": any_text, "key": any_text, "records": st.lists(msgpack_values(6), max_size=4)}, 3, 1)
    fam.append(
        Family(
            STORE_RPC,
            "records",
            st.tuples(
                st.integers(0, 5),
                st.sampled_from(["find", "forged_subkey", "claim_owner", "replay", "own", "garbage"]),
                msgpack_values(6),
            ),
            dht_records,
            3,
        )
    )

    rpc(MANIFEST_RPC, {"chunk_bytes": st.one_of(ints, st.just(MIN_CHUNK_BYTES))}, 2, 1)
    fam.append(
        Family(
            MANIFEST_RPC,
            "valid",
            st.tuples(st.integers(0, 5), st.sampled_from([MIN_CHUNK_BYTES, 1 << 20, 64 << 20, MIN_CHUNK_BYTES - 1, 0])),
            state_manifest,
            1,
        )
    )
    rpc(
        CHUNK_RPC,
        {
            "digest": st.binary(max_size=40),
            "chunk_bytes": ints,
            "index": ints,
            "fetch": st.one_of(any_text, st.from_regex(r"^[0-9a-f]{1,32}$", fullmatch=True)),
        },
        3,
        1,
    )
    fam.append(
        Family(
            CHUNK_RPC,
            "real_manifest",
            st.tuples(
                st.integers(0, 5),
                st.one_of(st.integers(0, 64), ints),
                st.from_regex(r"^[0-9a-f]{1,32}$", fullmatch=True),
                st.booleans(),
            ),
            state_chunk,
            2,
            RPC_DEADLINE + 15,
        )
    )

    rpc(SPEC_RPC, None, 1, 1)
    rpc(
        PUNCH_RPC,
        {
            "op": st.sampled_from(["prepare", "go", "x"]),
            "addr": st.just([LOOPBACK, 1]),
            "public": st.booleans(),
            "token": st.binary(max_size=20),
        },
        2,
        1,
    )
    fam.append(
        Family(
            PUNCH_RPC,
            "valid",
            st.tuples(st.integers(0, 5), st.sampled_from(["prepare", "go"]), st.binary(min_size=16, max_size=16)),
            punch_valid,
            1,
            RPC_DEADLINE + 15,
        )
    )
    rpc(DIALBACK_RPC, {"ports": st.just([1])}, 1, 1)
    fam.append(Family(DIALBACK_RPC, "valid", st.tuples(st.integers(0, 5)), dialback_valid, 1, RPC_DEADLINE + 15))

    proto_kinds = st.sampled_from(["junk", "reserve", "connect"])
    for proto in (HOP_PROTOCOL, STOP_PROTOCOL, DCUTR_PROTOCOL, KAD_PROTOCOL):
        fam.append(
            Family(
                proto,
                "protobuf",
                st.tuples(st.integers(0, 5), st.just(proto), proto_kinds, st.binary(max_size=300)),
                protobuf_stream,
                2,
                RAW_DEADLINE + 5,
            )
        )
    fam.append(
        Family(
            "pipeline/*",
            "unserved",
            st.tuples(st.integers(0, 5), st.sampled_from(PIPELINE_RPCS), msgpack_values(6)),
            unserved,
            1,
        )
    )
    return fam


@dataclass(frozen=True)
class Case:
    family: Family
    params: Any


BATCH = 400  # cases generated at a time (in a worker thread, while the previous batch is sent)


def plan(total: int, seed_value: int) -> Iterator[list[Case]]:
    """`total` cases in batches of about `BATCH`, spread over the families by weight, each
    family's inputs from hypothesis (seeded by `seed_value`, the family and the batch), each batch
    in a seeded random order. Deterministic for a seed; generated lazily because hypothesis takes
    a few ms per example, as long as sending it."""
    fams = families()
    weight = sum(f.weight for f in fams)
    counts = [max(1, total * f.weight // weight) for f in fams]
    i = 0
    while sum(counts) < total:  # hand out the remainder round-robin
        counts[i % len(counts)] += 1
        i += 1
    while sum(counts) > total:
        j = max(range(len(counts)), key=lambda k: counts[k])
        counts[j] -= 1
    batches = max(1, math.ceil(total / BATCH))
    for b in range(batches):
        cases = []
        for k, (f, n) in enumerate(zip(fams, counts, strict=True)):
            share = n // batches + (1 if b < n % batches else 0)
            for params in sample(f.strategy, share, (seed_value * 1009 + k) * 100_003 + b):
                cases.append(Case(f, params))
        random.Random(seed_value * 1_000_003 + b).shuffle(cases)
        yield cases


# --------------------------------------------------------------------------------------------
# Oracles


class Oracles:
    """The slower checks: membership, rounds, φ parity, DHT, liveness. Each finding once."""

    def __init__(self, swarm: Swarm, results: Results, stall: float) -> None:
        self.swarm = swarm
        self.results = results
        self.stall = stall
        self.rounds_checked = 0
        self.entries_checked = 0
        self.last_step = {p: (0, time.monotonic()) for p in swarm.members}
        self.loop_lag = 0.0
        self.fuzzing = False
        self.recent: deque[str] = deque(maxlen=8)  # the last valid-looking cases sent (for attribution)
        self._phi: dict[tuple[str, int], bytes] = {}

    def effect(self, protocol: str, detail: str) -> None:
        self.results.report(
            Finding("nonmember_effect", protocol, "oracle", detail, "recent cases: " + " | ".join(self.recent))
        )

    async def watch_loop(self) -> None:
        """Measure the event loop's lag: a handler that blocks the loop stalls every node."""
        while True:
            t0 = time.monotonic()
            await trio.sleep(0.1)
            lag = time.monotonic() - t0 - 0.1
            self.loop_lag = max(self.loop_lag, lag)
            if lag > LOOP_STALL and self.fuzzing:
                self.results.report(Finding("hang", "event-loop", "oracle", f"the trio loop stalled {lag:.1f} s"))

    def check_fast(self) -> None:
        sw = self.swarm
        for c in sw.crashed:
            self.results.report(Finding("crash", "node", "oracle", c))
        sw.crashed.clear()
        rounds = list(sw.rounds)[self.rounds_checked :]
        self.rounds_checked += len(rounds)
        for r in rounds:
            if not self.fuzzing:
                continue
            if r.contributors is None:
                self.effect(
                    "allreduce",
                    f"member {r.member[-8:]} round {r.round_id}/{r.tag} ended without the "
                    f"swarm (proceeding alone): {r.error[:200]}",
                )
            elif set(r.contributors) != set(sw.members):
                self.effect(
                    "allreduce",
                    f"member {r.member[-8:]} round {r.round_id}/{r.tag} contributors "
                    f"{sorted(c[-8:] for c in r.contributors)} != the members",
                )
        entries = sw.entries_from_nonmembers[self.entries_checked :]
        self.entries_checked += len(entries)
        for member, crdt, owner, seq in entries:
            if not self.fuzzing:
                continue
            # Every kind: since admission rules exist a member stores no record of a non-member at all (the
            # replica's gate, crdt/swarm_view.py) — before, progress and metrics were stored and
            # spread though ignored, a storage DoS by identities minted for free.
            self.effect(
                "crdt", f"member {member[-8:]} accepted a {crdt} entry owned by non-member {owner[-8:]} (seq {seq})"
            )

    async def check_slow(self) -> None:
        sw = self.swarm
        now = time.monotonic()
        for node in sw.nodes:
            me = node.host.peer_id
            if node.state == "syncing" and self.fuzzing:
                self.effect("node", f"member {me[-8:]} is re-downloading the swarm state (resync)")
            live = sorted((p.peer_id, p.role) for p in node.view.live_peers())
            want = sorted((p, "trainer") for p in sw.members)
            if live != want and self.fuzzing:
                self.effect(
                    "membership",
                    f"member {me[-8:]} sees live peers "
                    f"{[(p[-8:], r) for p, r in live]} instead of the {len(want)} members",
                )
            step = node.trainer.step
            last, since = self.last_step.get(me, (step, now))
            if step != last:
                self.last_step[me] = (step, now)
            elif now - since > self.stall and self.fuzzing:
                self.results.report(
                    Finding(
                        "hang", "node", "oracle", f"member {me[-8:]} made no step for {now - since:.0f} s (step {step})"
                    )
                )
                self.last_step[me] = (step, now)
            _debug(f"check_slow status {me[-8:]}")
            await self._check_status(node)
            self._check_dht(node)
        _debug("check_slow phi")
        await self._check_phi()
        _debug("check_slow done")

    async def _check_status(self, node: meshtrain.Node) -> None:
        url = node.status_url
        if not url:
            return
        t0 = time.monotonic()

        def get() -> bytes:
            with urllib.request.urlopen(url.rstrip("/") + "/status", timeout=STATUS_TIMEOUT) as r:
                return r.read()

        try:
            await trio.to_thread.run_sync(get)
        except Exception as e:
            if time.monotonic() - t0 >= STATUS_TIMEOUT * 0.9 and self.fuzzing:
                self.results.report(Finding("hang", "status", "oracle", f"status request stalled: {e!r}"))

    def _check_dht(self, node: meshtrain.Node) -> None:
        if node.discovery is None:
            return
        dht = node.discovery.dht
        with contextlib.suppress(Exception):
            for subkey, rec in dht.local.get(peers_key(self.swarm.swarm_id), time.time()).items():
                if subkey in self.swarm.members and rec.owner != subkey:
                    self.effect(
                        "dht",
                        f"member {node.host.peer_id[-8:]} holds {subkey[-8:]}'s announcement "
                        f"signed by {rec.owner[-8:]}",
                    )

    async def _check_phi(self) -> None:
        """Every member asks the next for its published states; equal rounds, equal digests."""
        sw = self.swarm
        for node in sw.nodes:
            other = sw.members[(sw.members.index(node.host.peer_id) + 1) % len(sw.members)]
            if other == node.host.peer_id:
                continue
            with contextlib.suppress(Exception), trio.move_on_after(5):
                man = await node.host.rpc.call(other, MANIFEST_RPC, {"chunk_bytes": 1 << 20}, timeout=5)
                for snap in man.get("snapshots", []):
                    key = (other, int(snap["round"]))
                    self._phi[key] = snap["digest"]
        by_round: dict[int, set[bytes]] = {}
        for (_, rnd), digest in self._phi.items():
            by_round.setdefault(rnd, set()).add(digest)
        for rnd, digests in by_round.items():
            if len(digests) > 1 and self.fuzzing:
                self.effect("state", f"members published different states for round {rnd}")
                self._phi = {k: v for k, v in self._phi.items() if k[1] != rnd}


# --------------------------------------------------------------------------------------------
# The run


async def run_case(ctx: Ctx, oracles: Oracles, case: Case) -> None:
    f = case.family
    outcome = "hang"
    with trio.move_on_after(f.deadline):
        try:
            outcome = await f.send(ctx, case.params)
        except Exception as e:  # a case that cannot even be sent (our side) is not the node's fault
            outcome = f"sender-error:{type(e).__name__}"
    if f.name not in ("garbage", "frames", "raw", "protobuf", "unserved"):
        oracles.recent.append(f"{f.protocol}/{f.name}{case.params!r:.80}")
    ctx.results.count(f.protocol, outcome.split(":", 1)[0] if outcome.startswith("sender-error") else outcome)
    if outcome == "hang":
        ctx.results.report(Finding("hang", f.protocol, f.name, f"no answer within {f.deadline:g} s", repr(case.params)))
    elif outcome == "error:internal":
        ctx.results.report(
            Finding("internal_error", f.protocol, f.name, "the handler raised (answered `internal`)", repr(case.params))
        )
    oracles.check_fast()


async def positive_control(swarm: Swarm, results: Results, oracles: Oracles, stack: AsyncExitStack) -> dict:
    """Make a fresh identity a member (a live trainer record through its own SwarmView), send the
    soak's join from it, and report what the oracles flagged."""
    before, listed = results.nonmember_effects, len(results.findings)
    oracles.fuzzing = True  # the oracles judge the control exactly as they judged the fuzzing
    # An id above the members': a lower one would become the round's coordinator and the
    # coordinator would hand the round over to it ({"moved": insider}), as it should.
    identity = Identity.generate()
    while identity.peer_id_str < swarm.members[-1]:
        identity = Identity.generate()
    insider = await stack.enter_async_context(Host(identity, HostConfig(listen=[f"/ip4/{LOOPBACK}/tcp/0"])))
    for node in swarm.nodes:
        await insider.connect(node.host.addrs[0], timeout=10)
    owner = swarm.nodes[0].signed.owner
    join_flagged = False
    spec = swarm.nodes[0].signed.spec  # an open swarm admits an identity that shows its proof of work
    proof = (
        {POW_CAP: mint_pow(swarm.swarm_id, insider.peer_id, spec.admission.pow_bits)}
        if spec.admission.mode == "open"
        else {}
    )
    async with open_swarm_view(insider, swarm.swarm_id, owner, role="trainer", capabilities=proof, recover_timeout=2.0):
        with trio.move_on_after(15):
            while not all(n.view.is_live(insider.peer_id) for n in swarm.nodes):
                await trio.sleep(0.1)
        oracles.check_fast()
        req = {"key": swarm.key(swarm.round_id(1)), "expected": [insider.peer_id], "skipped": []}
        try:
            reply = await insider.rpc.call(swarm.coordinator, JOIN_RPC, req, timeout=join_deadline(swarm))
        except Exception as e:
            reply = {"error": repr(e)}
        if isinstance(reply, dict) and "attempt" in reply and insider.peer_id in reply.get("group", []):
            join_flagged = True
            results.report(
                Finding(
                    "nonmember_effect",
                    "allreduce/join",
                    "positive_control",
                    f"(control) an identity outside the starting members joined a group: {reply!r:.150}",
                    repr(req),
                )
            )
        await oracles.check_slow()
        oracles.check_fast()
    oracles.fuzzing = False  # what the control set off (members re-syncing) is not the fuzzing's
    flagged = results.findings[listed:]
    del results.findings[listed:]
    return {
        "join_flagged": join_flagged,
        "effects_flagged": results.nonmember_effects - before,
        "join_reply": repr(reply)[:200],
        "findings": [f.to_json() for f in flagged][:MAX_FINDINGS_SHOWN],
    }


async def fuzz(
    cases: int = DEFAULT_CASES,
    seed_value: int = 0,
    nodes: int = DEFAULT_NODES,
    H: int = DEFAULT_H,
    join_timeout: float = DEFAULT_JOIN_TIMEOUT,
    stall: float = DEFAULT_STALL,
    control: bool = False,
    data_dir: Path | None = None,
    concurrency: int = CONCURRENCY,
) -> dict:
    """Run the whole thing; returns the summary (the JSON the script prints)."""
    t_start = time.monotonic()
    results = Results()
    rng = random.Random(seed_value)
    batches = plan(cases, seed_value)
    print(f"[fuzz] {cases} cases (seed {seed_value}); starting a {nodes}-node swarm", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="meshtrain-fuzz-") as tmp:
        swarm = Swarm(Path(data_dir or tmp), nodes, H, join_timeout)
        control_out: dict | None = None
        crdt_refused: Counter[str] = Counter()  # records the members' replicas would not store, by reason
        async with AsyncExitStack() as stack:
            # One stack, entered in order: the nodes' nursery first, so that the attacker's host
            # (entered later) closes before the nodes do.
            nursery = await stack.enter_async_context(trio.open_nursery())
            first: list[list[Case] | None] = [None]
            async with trio.open_nursery() as startup:  # hypothesis plans the first batch meanwhile

                async def plan_first() -> None:
                    first[0] = await trio.to_thread.run_sync(next, batches, None)

                startup.start_soon(plan_first)
                await swarm.start(nursery)
            print(
                f"[fuzz] swarm {swarm.swarm_id} up ({time.monotonic() - t_start:.1f} s), members "
                f"{[m[-8:] for m in swarm.members]}",
                file=sys.stderr,
            )
            attacker = Attacker(swarm)
            await attacker.start(stack)
            oracles = Oracles(swarm, results, stall)
            nursery.start_soon(oracles.watch_loop)
            ctx = Ctx(swarm, attacker, results, rng)
            oracles.fuzzing = True
            t_fuzz = time.monotonic()
            limiter = trio.CapacityLimiter(concurrency)
            done = [0]

            async def one(case: Case, token: object) -> None:
                try:
                    await run_case(ctx, oracles, case)
                finally:
                    done[0] += 1
                    limiter.release_on_behalf_of(token)

            async def checker() -> None:
                last_print = 0.0
                while True:
                    await trio.sleep(CHECK_EVERY)
                    await oracles.check_slow()
                    oracles.check_fast()
                    if time.monotonic() - last_print > 5:
                        last_print = time.monotonic()
                        print(
                            f"[fuzz] {done[0]}/{cases} cases, {time.monotonic() - t_fuzz:.0f} s, "
                            f"step {swarm.step()}, crashes {results.crashes} hangs {results.hangs} "
                            f"effects {results.nonmember_effects}",
                            file=sys.stderr,
                        )

            async with _reported(), trio.open_nursery() as cases_nursery:
                cases_nursery.start_soon(checker)
                batch, sent = first[0], 0
                while batch:
                    async with trio.open_nursery() as prefetch:  # the next batch, while this one is sent
                        upcoming: list[list[Case] | None] = [None]

                        async def generate(slot: list = upcoming) -> None:
                            slot[0] = await trio.to_thread.run_sync(next, batches, None)

                        prefetch.start_soon(generate)
                        for case in batch:
                            token = object()
                            await limiter.acquire_on_behalf_of(token)
                            cases_nursery.start_soon(one, case, token)
                            sent += 1
                    batch = upcoming[0]
                while done[0] < sent:
                    await trio.sleep(0.1)
                # one more round with everyone, then the last look
                settle = swarm.round_id(1)
                with trio.move_on_after(3 * join_timeout + 30):
                    while min(n.trainer.step for n in swarm.nodes) <= settle + 1:
                        await trio.sleep(0.2)
                await oracles.check_slow()
                oracles.check_fast()
                cases_nursery.cancel_scope.cancel()
            oracles.fuzzing = False
            if control:
                control_out = await positive_control(swarm, results, oracles, stack)
            oracles.check_fast()
            for node in swarm.nodes:
                if node.view is not None:
                    crdt_refused.update(node.view.replica.stats.refusals_by_reason)
            await swarm.stop_within(STOP_TIMEOUT, results)
            nursery.cancel_scope.cancel()
    out = {
        "cases": results.cases,
        "crashes": results.crashes,
        "hangs": results.hangs,
        "nonmember_effects": results.nonmember_effects - (control_out or {}).get("effects_flagged", 0),
        "internal_errors": results.internal_errors,
        "crdt_refused": dict(sorted(crdt_refused.items())),
        "by_protocol": {p: dict(c) for p, c in sorted(results.by_protocol.items())},
        "findings": [f.to_json() for f in results.findings][:MAX_FINDINGS_SHOWN],
        "notes": sorted(results.notes),
        "max_loop_lag_s": round(oracles.loop_lag, 2),
        "seconds": round(time.monotonic() - t_start, 1),
    }
    if control_out is not None:
        out["control"] = control_out
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=DEFAULT_CASES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nodes", type=int, default=DEFAULT_NODES, choices=(2, 3))
    ap.add_argument("--H", type=int, default=DEFAULT_H)
    ap.add_argument("--join-timeout", type=float, default=DEFAULT_JOIN_TIMEOUT)
    ap.add_argument("--stall", type=float, default=DEFAULT_STALL, help="seconds without a step that count as a hang")
    ap.add_argument("--concurrency", type=int, default=CONCURRENCY)
    ap.add_argument("--control", action="store_true", help="afterwards, the positive control (an insider's join)")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from meshtrain.log import configure

    configure(os.environ.get("MESHTRAIN_LOG", "ERROR"))
    logging.getLogger("meshtrain").setLevel(logging.ERROR)
    t0 = time.monotonic()
    try:
        out = trio.run(
            lambda: fuzz(
                args.cases,
                args.seed,
                args.nodes,
                args.H,
                args.join_timeout,
                args.stall,
                args.control,
                concurrency=args.concurrency,
            )
        )
    except Exception as e:  # the trio run itself raised: a crash, whatever the counters said
        out = {
            "cases": None,
            "crashes": 1,
            "hangs": None,
            "nonmember_effects": None,
            "by_protocol": {},
            "findings": [Finding("crash", "trio-run", "oracle", f"{type(e).__name__}: {e}").to_json()],
            "seconds": round(time.monotonic() - t0, 1),
        }
    print(json.dumps(out))
    return 0 if out["crashes"] == out["hangs"] == out["nonmember_effects"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
