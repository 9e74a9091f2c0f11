"""CRDT phase of the swarm benchmark: partition heal time and steady-state message rate.

    python scripts/bench/crdt_phase.py [--nodes 32] [--procs 4] [--idle 10] [--round-s 0]   # last line: JSON

`run_crdt_phase(n)` (called by scripts/bench/bench_swarm.py) does the same and returns the dict.

What runs: N real libp2p hosts (TCP + Noise + yamux on loopback), each with a `Replica` and a
`SwarmView` at their default settings (gossipsub, anti-entropy every 1.5 s, heartbeats every
3 s stretched in bigger swarms so that the swarm heartbeats 4·max(1, log₁₆ N) times a second:
6.4 s at 32 peers, 32 s at 256 — swarm_view.py's `heartbeat_interval_for`), spread over
`--procs` worker processes as trio tasks; the calling process only coordinates (JSON lines over the workers' stdin/stdout) and starts no host.
Why several processes: py-libp2p spends about 1.5 ms of CPU per gossip frame (yamux and Noise
in Python), so 32 peers heartbeating in one process need more than the one core a process can
use, and a saturated event loop measures itself, not the protocol. Why not one process per peer:
32 interpreters on 2 cores would mostly measure the scheduler. Workers time events with
`time.monotonic()`, which is CLOCK_MONOTONIC and so comparable across processes on Linux.

Topology: a ring plus chords (peer i also links to i+5), about four links per peer, so gossip
crosses several hops. Steps:
1. start, connect, wait until every peer sees all N live;
2. partition into halves [0, N/2) and [N/2, N) by closing every link between them (nothing
   re-dials: the replica never dials, and py-libp2p backs a lost peer off for 60 s);
3. write on both sides (progress with a new outer round, metrics; the owner, peer 0, writes the
   config), wait until each half holds its side's writes, then keep the halves apart 4 s more, so
   that py-libp2p's gossip message cache (3 heartbeats) no longer holds them and the heal must be
   repaired by anti-entropy (a shorter partition heals faster, by cache replay);
4. heal (re-open the links) and time:
   - `crdt_converge_s`: until every peer holds every entry any peer held at the heal (its state
     is >= the join of all states, per CRDT and owner); heartbeats keep running meanwhile;
   - `crdt_identical_s`: until a poll (every ~50 ms, per process) finds all N state digests
     identical — rarer than the above while heartbeats are in flight; null if not within 15 s;
5. `msgs_per_node_s`: messages each peer sends per second over `--idle` seconds of idle
   heartbeating: gossipsub RPC frames written (own publishes, relays, control) plus
   anti-entropy RPC requests and replies; with a breakdown, bytes, and CPU cores used. With
   `round_s` (`--round-s`), every peer also ends an outer round every `round_s` seconds (each at
   its own phase) and reports it as a trainer does — step, samples, round and its last 8 φ
   digests — from the moment all are live, one round before the measurement starts: a training
   swarm's gossip, not an idle one's.

Progress: one line per stage on stderr, so a run cut off says where it stopped.
Diagnosing a run: `BENCH_SCALE_LOG_DIR=dir` writes each worker's log (INFO, or
`BENCH_SCALE_LOG_LEVEL`) to its own file there; the `links` command reports each peer's
connection count.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SWARM = "bench-crdt"
CHORD = 5
PARTITION_HOLD_S = 4.0
CONVERGE_TIMEOUT_S = 15.0
REPLY = "@@"  # marks a worker's reply line (py-libp2p sometimes prints to stdout)


# --- coordinator ----------------------------------------------------------------------------------


class Worker:
    """One worker process (`script --worker`, this file's by default; scripts/bench/bench_scale.py
    runs its own): JSON commands in, one `@@`-prefixed JSON reply line out."""

    def __init__(self, script: Path | None = None) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115  (closed in stop())
        self.proc = subprocess.Popen(
            [sys.executable, str(script or Path(__file__).resolve()), "--worker"],
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
        )
        self._buf = b""

    def send(self, command: dict[str, Any]) -> None:
        self.proc.stdin.write(json.dumps(command).encode() + b"\n")
        self.proc.stdin.flush()

    def receive(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if line.startswith(REPLY.encode()):
                    reply = json.loads(line[len(REPLY) :])
                    if isinstance(reply, dict) and "error" in reply:
                        raise RuntimeError(f"worker failed: {reply['error']}")
                    return reply
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError(f"worker gave no reply within {timeout:g} s{self.stderr_tail()}")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"worker exited ({self.proc.wait()}){self.stderr_tail()}")
            self._buf += chunk

    def stderr_tail(self) -> str:
        self.log.seek(0)
        tail = self.log.read()[-1500:].decode(errors="replace")
        return f"; its stderr ends:\n{tail}" if tail else ""

    def stop(self) -> None:
        try:
            self.send({"cmd": "stop"})
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def ask(workers: list[Worker], commands: list[dict[str, Any]], timeout: float) -> list[Any]:
    for w, c in zip(workers, commands, strict=True):
        w.send(c)
    return [w.receive(timeout) for w in workers]


def ring_with_chords(n: int) -> set[tuple[int, int]]:
    edges = set()
    for i in range(n):
        for j in ((i + 1) % n, (i + CHORD) % n):
            if i != j:
                edges.add((min(i, j), max(i, j)))
    return edges


def _join(digests: list[dict[str, dict[str, list[Any]]]]) -> dict[str, dict[str, list[Any]]]:
    """The digest of the join of several states: per CRDT and owner, the largest (seq, prefix)."""
    out: dict[str, dict[str, list[Any]]] = {}
    for digest in digests:
        for name, owners in digest.items():
            best = out.setdefault(name, {})
            for owner, (seq, prefix) in owners.items():
                if owner not in best or (seq, prefix) > tuple(best[owner]):
                    best[owner] = [seq, prefix]
    return out


def run_crdt_phase(
    n: int = 32,
    procs: int = 4,
    idle_s: float = 10.0,
    *,
    partition: bool = True,
    round_s: float | None = None,
    stretch: int = 1,
) -> dict[str, Any]:
    """Run the benchmark with `n` peers in `procs` worker processes; returns the result dict.
    Without `partition`, steps 2-4 are skipped: start, then the idle measurement (bench_scale).
    With `round_s`, every peer reports a new outer round that often (step 5). `stretch` (a whole
    number): every period of the gossip protocols is that many times longer (`stretched`), so the
    same swarm needs that many times less CPU a second; the rates measured are per stretched
    second, and the caller multiplies them back (bench_scale.py's gossip phase)."""
    from meshtrain.crdt.heartbeat_rate import DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_TTL, heartbeat_interval_for
    from meshtrain.transport.identity import Identity

    if n < 4 or not 1 <= procs <= n:
        raise ValueError("need at least 4 peers and 1..n processes")
    if not isinstance(stretch, int) or stretch < 1:
        raise ValueError("stretch must be a whole number >= 1 (gossipsub's heartbeat is in whole seconds)")
    t_start = time.monotonic()
    seeds = [os.urandom(32) for _ in range(n)]
    owner = Identity.from_seed(seeds[0]).peer_id_str
    groups = [list(range(n))[k * n // procs : (k + 1) * n // procs] for k in range(procs)]
    where = {i: k for k, g in enumerate(groups) for i in g}
    out: dict[str, Any] = {
        "nodes": n,
        "processes": procs,
        "mode": f"{procs} processes, trio tasks in each",
        "topology": f"ring + chords (i, i+{CHORD})",
    }
    # SwarmView stretches the heartbeat with the swarm (see its module docstring)
    interval = heartbeat_interval_for(n) * stretch
    out["stretch"] = stretch
    out["heartbeat_s"] = interval
    out["lease_s"] = interval * DEFAULT_TTL / DEFAULT_HEARTBEAT_INTERVAL
    workers = [Worker() for _ in groups]

    def stage(what: str) -> None:  # progress on stderr: a run cut off says where it stopped
        print(f"crdt phase: {n} peers: {what} ({time.monotonic() - t_start:.1f} s)", file=sys.stderr, flush=True)

    try:
        stage(f"starting {procs} workers")
        replies = ask(
            workers,
            [
                {"cmd": "init", "owner": owner, "nodes": g, "seeds": [seeds[i].hex() for i in g], "stretch": stretch}
                for g in groups
            ],
            60,
        )
        addrs, ids = {}, {}
        for reply in replies:
            for i, addr, pid in reply["nodes"]:
                addrs[i], ids[i] = addr, pid
        edges = ring_with_chords(n)

        def per_worker(items: list[tuple[int, Any]]) -> list[list[Any]]:
            buckets: list[list[Any]] = [[] for _ in groups]
            for i, x in items:
                buckets[where[i]].append([i, x])
            return buckets

        links = per_worker([(j, addrs[i]) for i, j in sorted(edges)])
        stage("hosts up; connecting")
        ask(workers, [{"cmd": "connect", "links": b} for b in links], 60)
        stage("connected; starting the views")
        # Every join is gossiped to every peer while later views still start: at 256 peers on
        # a few cores this storm alone takes minutes, so the deadlines grow with the swarm.
        ask(workers, [{"cmd": "views"} for _ in groups], 120 + 2 * n)
        stage("views up; waiting until every peer sees all live")
        t0 = time.monotonic()
        while True:
            live = [x for r in ask(workers, [{"cmd": "live"}] * procs, 30) for x in r]
            if all(x == n for x in live) or time.monotonic() - t0 > 60 + n / 2:
                break
            time.sleep(0.1)
        out["all_live_s"] = round(time.monotonic() - t0, 2)
        out["startup_s"] = round(time.monotonic() - t_start, 2)
        stage(f"all live after {out['all_live_s']} s")

        if partition:
            # -- partition ---------------------------------------------------------------------------
            half = n // 2
            cut = [(i, j) for i, j in sorted(edges) if (i < half) != (j < half)]
            sides = [[(i, ids[j]) for i, j in cut], [(j, ids[i]) for i, j in cut]]
            cuts = per_worker(sides[0] + sides[1])
            ask(workers, [{"cmd": "cut", "peers": b} for b in cuts], 30)
            ask(workers, [{"cmd": "write"}] * procs, 30)
            digests = {i: d for r in ask(workers, [{"cmd": "digests"}] * procs, 30) for i, d in r}
            left = _join([digests[i] for i in range(half)])
            right = _join([digests[i] for i in range(half, n)])
            targets = per_worker([(i, left if i < half else right) for i in range(n)])
            t0 = time.monotonic()
            done = ask(workers, [{"cmd": "await", "targets": b, "timeout": 20} for b in targets], 40)
            out["partition_sides_agree_s"] = _elapsed(done, t0)
            time.sleep(PARTITION_HOLD_S)
            leaked = ask(workers, [{"cmd": "connected", "peers": b} for b in cuts], 30)
            out["partition_links_cut"] = len(cut)
            out["partition_leaked"] = any(any(r) for r in leaked)

            # -- heal --------------------------------------------------------------------------------
            digests = {i: d for r in ask(workers, [{"cmd": "digests"}] * procs, 30) for i, d in r}
            everything = _join(list(digests.values()))
            heal_links = per_worker([(j, addrs[i]) for i, j in cut])
            heal = time.monotonic()
            for w, b in zip(workers, heal_links, strict=True):
                w.send({"cmd": "heal", "links": b})
            for w, b in zip(workers, per_worker([(i, everything) for i in range(n)]), strict=True):
                w.send({"cmd": "await", "targets": b, "timeout": CONVERGE_TIMEOUT_S})
            connected_at = [w.receive(30)["at"] for w in workers]
            done = [w.receive(CONVERGE_TIMEOUT_S + 10) for w in workers]
            out["heal_connect_s"] = round(max(connected_at) - heal, 3)
            out["crdt_converge_s"] = _elapsed(done, heal)
            identical = None
            while time.monotonic() - heal < CONVERGE_TIMEOUT_S:
                fps = {x for r in ask(workers, [{"cmd": "fp"}] * procs, 30) for x in r}
                if len(fps) == 1:
                    identical = round(time.monotonic() - heal, 3)
                    break
                time.sleep(0.03)
            out["crdt_identical_s"] = identical

        # -- idle: steady-state message rate -----------------------------------------------------
        time.sleep(3.0)  # let the heal's re-gossip settle
        if round_s:
            out["round_s"] = round_s
            ask(workers, [{"cmd": "rounds", "round_s": round_s}] * procs, 30)
            stage(f"every peer ends a round every {round_s:g} s")
            time.sleep(round_s)  # every peer has reported a round before the window opens
        stage(f"measuring {idle_s:g} s of gossip")
        c0 = ask(workers, [{"cmd": "counters"}] * procs, 30)
        t0 = time.monotonic()
        time.sleep(idle_s)
        c1 = ask(workers, [{"cmd": "counters"}] * procs, 30)
        dt = time.monotonic() - t0
        delta = {k: sum(b[k] - a[k] for a, b in zip(c0, c1, strict=True)) for k in c0[0]}
        per = n * dt
        out["msgs_per_node_s"] = round((delta["frames"] + delta["rpc_sent"] + delta["rpc_served"]) / per, 2)
        out["msgs_breakdown_per_node_s"] = {
            "gossipsub_frames": round(delta["frames"] / per, 2),
            "of_which_own_publishes": round(delta["published"] / per, 2),
            "anti_entropy_requests": round(delta["rpc_sent"] / per, 2),
            "anti_entropy_replies": round(delta["rpc_served"] / per, 2),
        }
        out["gossip_bytes_per_node_s"] = round(delta["frame_bytes"] / per)
        out["idle_cpu_cores"] = round(delta["cpu"] / dt, 2)
        out["idle_cpu_ms_per_node_s"] = round(1000 * delta["cpu"] / per, 1)
        final = ask(workers, [{"cmd": "summary"}] * procs, 30)
        out["rejected_entries"] = sum(r["rejected"] for r in final)
        out["config_everywhere"] = all(r["config_ok"] for r in final)
        out["live_after"] = min(r["live_min"] for r in final)
        out["rss_peak_mib_per_process"] = max(r["rss_mib"] for r in final)
    finally:
        for w in workers:
            w.stop()
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    return out


def _elapsed(replies: list[dict[str, Any]], since: float) -> float | None:
    ats = [r["at"] for r in replies]
    return None if any(a is None for a in ats) else round(max(ats) - since, 3)


# --- worker ---------------------------------------------------------------------------------------


async def stdin_commands() -> AsyncIterator[dict[str, Any]]:
    """A worker's commands: JSON objects, one a line on stdin, read without blocking trio."""
    import trio

    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    buf = b""
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield json.loads(line)
        chunk = await stdin.receive_some(1 << 16)
        if not chunk:
            return
        buf += chunk


async def serve_commands(handle: Callable[[str, dict[str, Any], AsyncExitStack], Awaitable[Any]]) -> None:
    """A worker's loop: each command from stdin is answered with what `handle(cmd, command,
    stack)` returns (or its error), until "stop" cancels everything entered on `stack` at once."""
    import trio

    with trio.CancelScope() as scope:
        async with AsyncExitStack() as stack:
            async for command in stdin_commands():
                cmd = command["cmd"]
                if cmd == "stop":
                    scope.cancel()
                    break
                try:
                    reply(await handle(cmd, command, stack))
                except Exception as e:
                    reply({"error": f"{cmd}: {type(e).__name__}: {e}"})


def reply(value: Any) -> None:
    sys.stdout.write(REPLY + json.dumps(value) + "\n")
    sys.stdout.flush()


def _digest_json(replica: Any) -> dict[str, dict[str, list[Any]]]:
    return {name: {o: [s, p.hex()] for o, (s, p) in d.items()} for name, d in replica.digests().items()}


def _covers(replica: Any, target: dict[str, dict[str, list[Any]]]) -> bool:
    for name, owners in target.items():
        crdt = replica.crdt(name)
        for owner, (seq, prefix) in owners.items():
            entry = crdt.entry(owner)
            if entry is None or (entry.seq, entry.signature[:16].hex()) < (seq, prefix):
                return False
    return True


def stretched(config: Any, k: int) -> Any:
    """A `ReplicaConfig` whose periodic work runs k times less often: anti-entropy's interval and
    gossipsub's heartbeat (its message cache and gossip windows count heartbeats) are k times
    longer. Not stretched: `publish_delay`, which coalesces writes made at the same moment."""
    import dataclasses

    return dataclasses.replace(
        config, anti_entropy_interval=config.anti_entropy_interval * k, gossip_heartbeat=config.gossip_heartbeat * k
    )


def stretched_view(k: int) -> dict[str, float]:
    """`SwarmView` arguments whose heartbeat interval, lease and progress gap are k times those of
    the defaults: `heartbeat_interval_for(n, 3k, rate / k, cap)` = k x `heartbeat_interval_for(n)`
    while that stays under the cap. The cap (300 s) is stretched as far as SwarmView's limit on
    leases allows (`MAX_LEASE_MS`: four intervals, so 900 s), so at 256 peers (32 s) the stretch
    is exact up to k = 28."""
    from meshtrain.crdt.heartbeat_rate import (
        DEFAULT_HEARTBEAT_INTERVAL,
        DEFAULT_MAX_HEARTBEAT_INTERVAL,
        DEFAULT_SWARM_HEARTBEAT_RATE,
        DEFAULT_TTL,
    )
    from meshtrain.crdt.swarm_records import MAX_LEASE_MS

    longest = MAX_LEASE_MS / 1000 * DEFAULT_HEARTBEAT_INTERVAL / DEFAULT_TTL
    return {
        "heartbeat_interval": DEFAULT_HEARTBEAT_INTERVAL * k,
        "ttl": DEFAULT_TTL * k,
        "swarm_heartbeat_rate": DEFAULT_SWARM_HEARTBEAT_RATE / k,
        "max_heartbeat_interval": max(DEFAULT_MAX_HEARTBEAT_INTERVAL, min(DEFAULT_MAX_HEARTBEAT_INTERVAL * k, longest)),
    }


async def _report_rounds(view: Any, round_s: float) -> None:
    """Report outer rounds as a trainer does (node/state/run_state.py): step, samples, round, φ digests."""
    import random

    import trio

    from meshtrain.crdt.swarm_view import MAX_PHI_DIGESTS
    from meshtrain.node.state.parity import DIGEST_BYTES

    view.progress_live = True  # as a training node's (node/presence.py)
    await trio.sleep(random.random() * round_s)
    phi: list[tuple[int, bytes]] = []
    r = 0
    while True:
        r += 1
        phi = [*phi, (r, os.urandom(DIGEST_BYTES))][-MAX_PHI_DIGESTS:]
        view.report_progress(step=100 * r, samples=6400 * r, outer_round=r, phi=phi)
        await trio.sleep(round_s)


async def _worker() -> None:
    import resource

    import trio
    from libp2p.peer.id import ID

    from meshtrain.crdt import Replica, ReplicaConfig, SwarmView, swarm_specs
    from meshtrain.log import configure
    from meshtrain.transport.host import Host
    from meshtrain.transport.identity import Identity

    if os.environ.get("BENCH_SCALE_LOG_DIR"):  # diagnosing a run: each worker's log in its own file
        log = Path(os.environ["BENCH_SCALE_LOG_DIR"]) / f"crdt-worker-{os.getpid()}.log"
        os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
        configure(os.environ.get("BENCH_SCALE_LOG_LEVEL", "INFO"))
    else:
        configure("ERROR")
    nodes: dict[int, dict[str, Any]] = {}
    counters = {"frames": 0, "frame_bytes": 0}
    timing = {"stretch": 1}

    async def await_targets(targets: list[list[Any]], timeout: float) -> float | None:
        pending = [(nodes[i]["replica"], t) for i, t in targets]
        with trio.move_on_after(timeout):
            while pending:
                pending = [(r, t) for r, t in pending if not _covers(r, t)]
                if pending:
                    await trio.sleep(0.02)
            return time.monotonic()
        return None

    async def handle(cmd: str, command: dict[str, Any], stack: AsyncExitStack) -> Any:
        if cmd == "init":
            owner = command["owner"]
            timing["stretch"] = int(command.get("stretch", 1))
            for i, seed in zip(command["nodes"], command["seeds"], strict=True):
                host = await stack.enter_async_context(Host(Identity.from_seed(bytes.fromhex(seed))))
                config = stretched(ReplicaConfig(), timing["stretch"])
                replica = await stack.enter_async_context(Replica(host, SWARM, swarm_specs(owner), config=config))
                original = replica.pubsub.write_msg

                async def counted(stream, rpc, original=original):
                    counters["frames"] += 1
                    counters["frame_bytes"] += rpc.ByteSize()
                    return await original(stream, rpc)

                replica.pubsub.write_msg = counted
                nodes[i] = {"host": host, "replica": replica, "owner": owner}
            return {"nodes": [[i, n["host"].addrs[0], n["host"].peer_id] for i, n in nodes.items()]}
        elif cmd == "connect":
            for i, addr in command["links"]:
                await nodes[i]["host"].connect(addr)
            return {"ok": True}
        elif cmd == "views":
            # One after another: each view's start pulls the swarm's state first (`recover`).
            # Started all at once, the join storm on 2 cores left a backlog that the idle
            # window then measured (64 peers: 1.7-2.9x the bytes of a sequential start).
            for n in nodes.values():
                view = SwarmView(n["replica"], n["owner"], **stretched_view(timing["stretch"]))
                n["view"] = await stack.enter_async_context(view)
            return {"ok": True}
        elif cmd == "rounds":  # every peer ends an outer round every round_s s, each at its own phase
            rounds = await stack.enter_async_context(trio.open_nursery())
            stack.callback(rounds.cancel_scope.cancel)  # runs first on exit: LIFO
            for n in nodes.values():
                rounds.start_soon(_report_rounds, n["view"], float(command["round_s"]))
            return {"ok": True}
        elif cmd == "live":
            return [len(n["view"].membership_snapshot()) for n in nodes.values()]
        elif cmd == "links":  # how many peers each of ours is connected to now
            return [len(n["host"].connected_peers()) for n in nodes.values()]
        elif cmd == "cut":  # forget the address too: py-libp2p re-dials on
            for i, peer in command["peers"]:  # a stream to an unconnected peer
                host = nodes[i]["host"]
                host.libp2p.get_peerstore().clear_addrs(ID.from_base58(peer))
                await host.disconnect(peer)
            return {"ok": True}
        elif cmd == "connected":
            return [nodes[i]["host"].is_connected(p) for i, p in command["peers"]]
        elif cmd == "write":
            for i, n in nodes.items():
                n["view"].report_progress(step=1000 + i, samples=64_000 * (i + 1), outer_round=1)
                n["view"].report_metrics({"loss": 3.0 - i / 100, "tok_s": 1e3 + i})
                if i == 0:
                    n["view"].set_config(lr=0.7, outer_steps=500, note="partition")
            return {"ok": True}
        elif cmd == "digests":
            return [[i, _digest_json(n["replica"])] for i, n in nodes.items()]
        elif cmd == "await":
            return {"at": await await_targets(command["targets"], command["timeout"])}
        elif cmd == "heal":
            async with trio.open_nursery() as nursery:
                for i, addr in command["links"]:
                    nursery.start_soon(nodes[i]["host"].connect, addr)
            return {"at": time.monotonic()}
        elif cmd == "fp":
            return [n["replica"].fingerprint().hex() for n in nodes.values()]
        elif cmd == "counters":
            stats = [n["replica"].stats for n in nodes.values()]
            return {
                **counters,
                "published": sum(s.gossip_published for s in stats),
                "rpc_sent": sum(s.ae_rpcs_sent for s in stats),
                "rpc_served": sum(s.ae_rpcs_served for s in stats),
                "cpu": time.process_time(),
            }
        elif cmd == "summary":
            views = [n["view"] for n in nodes.values()]
            return {
                "rejected": sum(n["replica"].stats.entries_rejected for n in nodes.values()),
                "config_ok": all(v.config().get("lr") == 0.7 for v in views),
                "live_min": min(len(v.membership_snapshot()) for v in views),
                "rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            }
        else:
            raise ValueError(f"unknown command {cmd!r}")

    await serve_commands(handle)  # on stop, views exit without a clean leave


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of idle measurement")
    parser.add_argument(
        "--round-s", type=float, default=0.0, help="every peer ends an outer round this often (0: idle)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import trio

        trio.run(_worker)
        return
    result = run_crdt_phase(args.nodes, args.procs, args.idle, round_s=args.round_s or None)
    result["targets"] = {"crdt_converge_s": "< 5"}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
