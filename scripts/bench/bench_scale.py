"""Scale benchmark: per-peer costs of grouped outer rounds and of membership gossip, 16 to 256 peers.

    python scripts/bench/bench_scale.py [--sizes 16,64,256] [--procs 4 | --peers-per-process K] [--rounds 2]
                                  [--group-size 0] [--max-peers 32]
                                  [--gossip-sizes 16,32,64] [--idle 8] [--gossip-round-s 5]
                                  [--gossip-stretch K | --gossip-stretch 256:8,...]
                                  [--out docs/bench/bench_scale_issue20.json]

The last line printed is one JSON object (also written to `--out`).

What it measures, and why per peer. On one 2-core machine every peer's work shares the same two
cores, so the wall time of a round grows with N whatever the design (the trap of the old
collectives target). A design that scales keeps each *peer's* costs flat as N grows, so those are
what is reported, at each size N:
- `cpu_s_per_peer_round`: CPU time of every worker process during the rounds ÷ N ÷ rounds, over
  the rounds after the first (which also pays each process's one-time costs; it is reported as
  `first_round_cpu_s_per_peer`). Beside it, `idle_cpu_per_peer_s`: the same peers' CPU per
  second over `IDLE_S` (10 s) connected and idle (libp2p's keep-alives and RTT pings, the data
  plane's sessions; the lower of a window just before the rounds and one just after,
  `idle_cpu_per_peer_s_windows`: each also pays for the tail of what came before it), and
  `cpu_s_per_peer_round_net`, the round's CPU less that idle rate × `round_s`: here a round at
  256 peers lasts ~30 s because all peers share two cores, so costs that accrue per second
  (constant per peer in a swarm of machines, whose rounds last minutes anyway) are counted ~40
  times more per round than at 16 peers (0.8 s rounds). The libp2p connections and data-plane
  sessions to every partner
  of the rounds run are opened before, outside the measurement (`connect_s`): all of one
  machine's peers opening their sessions in the same second would time out the 10 s session RPC
  here, which says nothing about a swarm of machines. The message and byte counts are over the
  same rounds;
- `gc_s_per_peer_round`: the part of that CPU spent in Python's cyclic garbage collector (its
  `gc.callbacks`), and `gc_share` per size: ~20 % at 16 peers, ~18 % at 256 in one run;
- `msgs_per_peer_round`: control RPCs (join, watch, report, where) plus data-plane tensor
  transfers a peer sends per round;
- `bytes_per_peer_round_over_m`: data-plane bytes a peer sends per round ÷ M, the bytes of its own
  input (the bandwidth-optimal all-reduce of a group of g sends 2(g−1)/g·M);
- `mixing_rounds`: rounds until every peer's update has reached every peer, counted from the
  first round of an epoch (the model has one extra parameter per peer, `reach`; peer i's first
  update is −1 at its own entry, and an entry of φ is non-zero once that update got there),
  beside `d`, the grid's dimensions (collective/groups.py: at most d + 1);
- `round_s`: wall time of a round — CPU-bound here (all N peers on two cores), reported only to
  show that it is not the measure;
- `gossip_bytes_per_peer_s`: gossipsub bytes a peer writes per second while the swarm trains
  (each peer a `Replica` + `SwarmView` at its defaults, ending an outer round every
  `--gossip-round-s` s, 5 by default, and reporting it as a trainer does: step, samples, round,
  φ digests — the swarm heartbeats 4·max(1, log₁₆ N) times a second, swarm_view.py's
  `heartbeat_interval_for`, and a peer's progress writes are at least `progress_gap()` apart;
  ring + chords topology, as scripts/bench/crdt_phase.py; `0`: idle peers), with `gossip_cpu_cores`
  (a saturated machine sends less than it should: read the bytes beside it). Anti-entropy RPCs are counted in `gossip_msgs_per_peer_s`,
  not in the bytes. `--gossip-stretch` k runs a size with every period of the gossip protocols k
  times longer — membership heartbeats, leases and the progress gap (`SwarmView`'s arguments),
  anti-entropy's interval and gossipsub's heartbeat (`ReplicaConfig`), the rounds and the window —
  so it needs k times less CPU a second, and multiplies its rates back by k
  (`gossip_cpu_cores_unstretched` is what it would use unstretched). The messages and their sizes
  are the same, only k times rarer; a size that fits this machine both ways checks that (the
  README's runs: 16 peers at k = 1 and 4);
- set-up: `connect_s`, `dial_retries` and `session_retries` (dials and data-plane session RPCs
  that failed on a starved machine and were tried again, up to `SETUP_ATTEMPTS` each; an error
  that outlives them names the peer and the step), `fds_per_process` (descriptors of the busiest
  worker once connected: about 6 per link and worker at 256 peers; the soft limit is lifted to the
  hard one), `rss_mib_per_process` (the largest worker's peak) and `rss_mib_per_peer` (that × the
  processes ÷ N, each process's torch included).
Summary: `cpu_growth`, `net_cpu_growth`, `idle_cpu_growth` and `msgs_growth` (largest size ÷
smallest), `max_bytes_per_peer_round_over_m`,
`gossip_growth` (largest valid gossip size ÷ smallest; a size whose peers never all saw each other
live measured a starved machine and is listed in `gossip_invalid_sizes`), `gossip_model_growth`
(the records the swarm writes a second by the heartbeat and progress rules at the largest size ÷
at 16 peers: what per-peer gossip grows by where this machine cannot run the gossip phase — 1.62
from 16 to 256 with 5 s rounds, 2.0 idle), `mixing_ok`
(mixing_rounds ≤ d + 1 at every size), `all_rounds_complete` (every peer got a result in every
round, none alone).

256 peers on this machine (2 cores, shared with other work; runs from before the links came from
`ConnectionPlan`, when each peer was linked to its groups' partners only). The set-up fits: with `--rounds 2`
(3,840 links; a third round starts a new epoch on a new grid, 5,535 links) the hosts connected in
143 and 199 s (two runs) with no failed dial, about 5.9k descriptors per worker (limit 20,000) and
up to 2.9-3.5 GB RSS per worker (~45 MB per peer). One earlier run that failed in the set-up
after 3 minutes kept no error; a dial or a session RPC failing on a starved machine was its only
way to fail, and both are now retried. `BENCH_SCALE_LOG_DIR=dir` keeps every worker's log there;
`BENCH_SCALE_PROFILE_DIR=dir` a cProfile of each worker's rounds (`worker-PID-rROUND.prof`; the
CPU it reports then includes the profiler's), timed by the process's CPU clock
(`BENCH_SCALE_PROFILE_CLOCK=wall` for cProfile's default, wall time: on a saturated machine that
charges a call for the time the worker was preempted during it). `--peers-per-process K` runs ceil(N / K) workers at
every size instead of `--procs` (the same number of peers share a trio loop, a heap and an epoll
set at 16 and at 256 peers): it tells a cost of packing 64 peers into one process from one of the
swarm's size. At K = 16 it measured 0.069 → 0.263 CPU-s per peer-round from 16 to 256 (×3.8,
above the ×2.4–3.6 of four workers): packing is not what grows. That run lost 10 of its 16
workers after its second round (cause not found); 16 → 64 at K = 16 completes (×1.17).
What does not fit is CPU: every round at 256 took 124-172 s of CPU (two all-reduces of 16 per
peer, and the coordinators' reviews and probes for as long as a round lasts), and while other
work kept the load average at 4-8 the workers got ~0.2 core each, so rounds took 3-6 minutes,
RPC deadlines passed, 1-5 peers a round were excluded from their group's round (`failed`,
`alone` > 0) and φ did not mix within the two rounds. Gossip at 64 peers (and at 32 in the
last run) could not be measured: its workers need more CPU than they got, every anti-entropy RPC
timed out (5 s), and some peer never saw the others live (`live_after` 1, "invalid"). Stretched
(`--gossip-stretch 256:24 --gossip-intervals 1`), 256 gossiping peers fit: ~7 minutes of set-up
(the views start one after another, each join gossiped to all), then a round and one heartbeat
interval (768 s at K = 24), with all 256 live at the end; the workers still used both cores.

What runs. N real libp2p hosts, each with its data plane (`TensorStreams`) and a `SwarmCollective`
grouped by `GroupPlan(group_size)` (0: automatic — the whole swarm up to 32 peers, groups of 16
above), spread over `--procs` worker processes as trio tasks; this process only coordinates
(JSON lines, scripts/bench/crdt_phase.py's `Worker`). Each peer runs the real outer round: `DiLoCo`
(lr 1, momentum 0, H 1) over the built-in `gpt-tiny` (~34k fp32 parameters, M ≈ 136 KiB) whose θ
moves a little before each `astep()` — so a grouped round costs what it costs a node: the group's
all-reduce of Δ and the consensus all-reduce of φ in fp16 (optim/outer.py, "Grouped rounds"). Who
is connected to whom is the daemon's own presence code: each peer's `ConnectionPlan.wanted`
(node/connections.py — the group partners of the rounds under way, then the next round's
partners and a gossip sample where both ends keep them, at most `--max-peers`; the full mesh up
to that many), united over the rounds run (`presence_links`; no DHT here, so no DHT neighbours).
A link either end's plan wants is a link both hold: presence keeps a peer whose own plan keeps it
(`ConnectionPlan.wanted_by`). The dialling itself is this script's
(retried set-up, above), not the daemon's `Dialler`: all of a machine's peers opening every link
in the same second would time out here, which says nothing about a swarm of machines.
`max_connections_per_peer` is the largest number of links one peer has (its wants and the peers
that want it; target ≤ 40 at 256), `presence_is_daemons` says the links come from that code.
Deadlines are long (join 300 s): a round here is slow because the CPU is shared, not because a
peer failed.

Not here: links with real bandwidth and latency (scripts/bench/bench_wan.py), faults
(tests/test_grouped_rounds.py).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.crdt_phase import Worker, ask, run_crdt_phase, serve_commands  # noqa: E402

SEED = 20
DEFAULT_MAX_PEERS = 32  # node/connections.py's (not imported at start-up: workers import lazily)
DIALS_IN_FLIGHT = 16  # per worker process: libp2p dials (Noise + yamux handshakes) at once
SESSIONS_IN_FLIGHT = 4  # per worker process: data-plane session RPCs at once
SETUP_ATTEMPTS = 10  # tries per dial and per session before the set-up gives up
IDLE_S = 10.0  # seconds the connected peers are measured idle, before the rounds and after them


def _groups_plan(group_size: int):
    from meshtrain.collective.groups import GroupPlan

    return GroupPlan(group_size=group_size, seed=SEED, period=1)


# --- coordinator ----------------------------------------------------------------------------------


def presence_links(ids: list[str], plan: Any, first: int, rounds: int, max_peers: int) -> set[tuple[int, int]]:
    """The links the daemon's presence keeps while the rounds run (node/connections.py
    `ConnectionPlan.wanted`, with the rounds under way as presence tracks them: the round and the
    one before it, and the next one's partners ahead), as index pairs (a < b): each peer's wants
    over the rounds, united, and a link either end wants. No DHT here, so no DHT neighbours."""
    from meshtrain.node.connections import ConnectionPlan

    index = {p: i for i, p in enumerate(ids)}
    links: set[tuple[int, int]] = set()
    for me in ids:
        wants = ConnectionPlan(me, max_peers=max_peers, grouping=plan)
        for r in range(first, first + rounds):
            for peer in wants.wanted(ids, ids, [x for x in (r - 1, r) if x >= first]):
                a, b = sorted((index[me], index[peer]))
                links.add((a, b))
    return links


def idle_cpu_per_peer_s(workers: list[Worker], n: int) -> float:
    """CPU seconds a peer spends per second while connected and idle, over `IDLE_S`."""
    idle = ask(workers, [{"cmd": "idle", "seconds": IDLE_S}] * len(workers), 300)
    return sum(x["cpu"] for x in idle) / n / IDLE_S


def rounds_phase(n: int, procs: int, rounds: int, group_size: int, max_peers: int) -> dict[str, Any]:
    """N peers in `procs` workers run `rounds` grouped all-reduces; per-peer costs (module docstring)."""
    from meshtrain.collective.groups import epoch_length
    from meshtrain.transport.identity import Identity

    t_start = time.monotonic()
    procs = min(procs, n)
    seeds = [os.urandom(32) for _ in range(n)]
    ids = [Identity.from_seed(s).peer_id_str for s in seeds]
    parts = [list(range(n))[k * n // procs : (k + 1) * n // procs] for k in range(procs)]
    plan = _groups_plan(group_size)
    grid = plan.groups(ids, 0)
    first = epoch_length(n, grid.sides)  # round ids start at an epoch's first round (ids are >= 1)
    links = presence_links(ids, plan, first, rounds, max_peers)
    degree = [0] * n
    for a, b in links:
        degree[a] += 1
        degree[b] += 1
    workers = [Worker(Path(__file__).resolve()) for _ in parts]
    out: dict[str, Any] = {"peers": n, "processes": procs, "sides": list(grid.sides), "d": len(grid.sides)}
    out["epoch_rounds"] = epoch_length(n, grid.sides)
    out["max_connections_per_peer"] = max(degree)
    out["mean_connections_per_peer"] = round(sum(degree) / n, 1)
    out["max_group"] = max(len(g) for g in grid.groups)
    try:
        replies = ask(
            workers,
            [{"cmd": "init", "nodes": p, "seeds": [seeds[i].hex() for i in p], "roster": ids} for p in parts],
            300,
        )
        addrs = {i: addr for rep in replies for i, addr in rep["nodes"]}
        where = {i: k for k, p in enumerate(parts) for i in p}
        dial: list[list[list[Any]]] = [[] for _ in parts]
        partners: list[dict[int, list[str]]] = [{} for _ in parts]
        for a, b in sorted(links):  # the higher index dials the lower
            dial[where[b]].append([b, addrs[a]])
            partners[where[a]].setdefault(a, []).append(ids[b])
            partners[where[b]].setdefault(b, []).append(ids[a])
        t0 = time.monotonic()
        setup = ask(
            workers,
            [
                {"cmd": "connect", "links": d, "partners": pa, "group_size": group_size, "first_round": first}
                for d, pa in zip(dial, partners, strict=True)
            ],
            1800,
        )
        print(f"bench_scale: {n} peers connected ({len(links)} links)", file=sys.stderr, flush=True)
        out["links"] = len(links)
        out["connect_s"] = round(time.monotonic() - t0, 1)
        out["dial_retries"] = sum(x["dial_retries"] for x in setup)
        out["session_retries"] = sum(x["session_retries"] for x in setup)
        out["fds_per_process"] = max(x["fds"] for x in setup)
        idle_before = idle_cpu_per_peer_s(workers, n)
        per_round = []
        mixed_at = None
        rss = 0  # the largest worker's peak RSS, MiB
        for r in range(rounds):
            t0 = time.monotonic()
            reps = ask(workers, [{"cmd": "round", "round": r}] * len(parts), 1800)
            wall = time.monotonic() - t0
            total = {
                k: sum(rep[k] for rep in reps) for k in ("cpu", "gc", "msgs", "sent", "ok", "failed", "alone", "mixed")
            }
            rss = max(rss, *(rep["rss_mib"] for rep in reps))
            errors = [e for rep in reps for e in rep["errors"]][:3]
            per_round.append({"round": r, "round_s": round(wall, 2), **total, "errors": errors})
            print(f"bench_scale: {n} peers, round {r}: {per_round[-1]}", file=sys.stderr, flush=True)
            if mixed_at is None and total["mixed"] == n:
                mixed_at = r + 1
        m_bytes = reps[0]["m_bytes"]
        out["m_bytes"] = m_bytes
        out["rounds"] = rounds
        # The first round also pays each process's one-time costs (torch's first calls, lazy
        # imports), which a small swarm would divide among fewer peers: costs are over the rest.
        steady = per_round[1:]
        out["cpu_s_per_peer_round"] = round(sum(x["cpu"] for x in steady) / n / len(steady), 4)
        out["first_round_cpu_s_per_peer"] = round(per_round[0]["cpu"] / n, 4)
        out["gc_s_per_peer_round"] = round(sum(x["gc"] for x in steady) / n / len(steady), 4)
        out["msgs_per_peer_round"] = round(sum(x["msgs"] for x in steady) / n / len(steady), 2)
        out["bytes_per_peer_round_over_m"] = round(sum(x["sent"] for x in steady) / n / len(steady) / m_bytes, 3)
        out["mixing_rounds"] = mixed_at
        out["round_s"] = round(sum(x["round_s"] for x in steady) / len(steady), 2)
        # Idle before the rounds still pays for the set-up's tail (identify, late sessions), after
        # them for the rounds' (background sends): the lower of the two is the links' own cost.
        idle_after = idle_cpu_per_peer_s(workers, n)
        idle_per_peer_s = min(idle_before, idle_after)
        out["idle_cpu_per_peer_s_windows"] = [round(idle_before, 7), round(idle_after, 7)]
        out["idle_cpu_per_peer_s"] = round(idle_per_peer_s, 7)  # ~1e-5 at 16 peers: keep digits for the ratio
        # What a round's own work costs a peer: its CPU less what its connections cost it idle
        # for as long as the round lasted (module docstring).
        net = out["cpu_s_per_peer_round"] - idle_per_peer_s * out["round_s"]
        out["cpu_s_per_peer_round_net"] = round(max(net, 0.0), 4)
        out["all_rounds_complete"] = all(x["ok"] == n and x["alone"] == 0 for x in per_round)
        out["rss_mib_per_process"] = rss
        out["rss_mib_per_peer"] = round(rss * procs / n, 1)
        out["per_round"] = per_round
    finally:
        for w in workers:
            w.stop()
    out["wall_s"] = round(time.monotonic() - t_start, 1)
    return out


def gossip_phase(
    n: int, procs: int, idle_s: float, round_s: float | None = None, stretch: int = 1, intervals: float = 2.0
) -> dict[str, Any]:
    """N peers gossiping membership and progress (scripts/bench/crdt_phase.py, no partition), each
    ending an outer round every `round_s` s (None: idle), measured over at least two heartbeat
    intervals (10.7 s at 64 peers): a shorter window sees only some peers' heartbeats, and its
    rate swings by 2x between runs. With `stretch` k, every period of the gossip protocols and the
    rounds is k times longer and so is the window (a swarm that does not fit this machine's CPU
    at full speed fits in k times less CPU a second); the rates are multiplied back by k, to what
    a peer sends per second of the unstretched protocol. Same messages, same sizes, k times
    rarer: `--gossip-stretch` checks that at a size that fits both ways."""
    from meshtrain.crdt.heartbeat_rate import heartbeat_interval_for

    idle_s = max(idle_s, intervals * heartbeat_interval_for(n)) * stretch
    out = run_crdt_phase(
        n, min(procs, n), idle_s, partition=False, round_s=round_s * stretch if round_s else None, stretch=stretch
    )
    return {
        "peers": n,
        "stretch": stretch,
        "heartbeat_s": out["heartbeat_s"] / stretch,
        "round_s": round_s,
        "gossip_bytes_per_peer_s": round(out["gossip_bytes_per_node_s"] * stretch),
        "gossip_msgs_per_peer_s": round(out["msgs_per_node_s"] * stretch, 2),
        "gossip_cpu_cores": out["idle_cpu_cores"],
        "gossip_cpu_cores_unstretched": round(out["idle_cpu_cores"] * stretch, 2),
        "idle_s": round(idle_s, 1),
        "all_live_s": out["all_live_s"],
        "live_after": out["live_after"],
    }


def parse_stretch(value: str) -> dict[int, int] | int:
    """`--gossip-stretch`: one whole number for every gossip size, or `size:k,...` (1 elsewhere)."""
    try:
        if ":" not in value:
            k = int(value)
            if k < 1:
                raise ValueError
            return k
        pairs = dict(tuple(int(x) for x in item.split(":")) for item in value.split(",") if item)
        if any(k < 1 for k in pairs.values()):
            raise ValueError
        return pairs
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1 or size:k pairs, got {value!r}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="16,64,256", help="sizes of the rounds phase ('' to skip)")
    parser.add_argument("--procs", type=int, default=4, help="worker processes of every size")
    parser.add_argument(
        "--peers-per-process",
        type=int,
        default=0,
        help="rounds phase: as many workers as hold this many peers each, at every size (overrides --procs)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="outer rounds per size (>= 2; the first is not costed)")
    parser.add_argument("--group-size", type=int, default=0, help="the spec's group_size (0: automatic)")
    parser.add_argument(
        "--max-peers", type=int, default=DEFAULT_MAX_PEERS, help="each peer's connection bound (NodeConfig.max_peers)"
    )
    parser.add_argument("--gossip-sizes", default="16,32,64", help="sizes of the gossip phase ('' to skip)")
    parser.add_argument("--idle", type=float, default=8.0, help="seconds of gossip measured")
    parser.add_argument(
        "--gossip-round-s",
        type=float,
        default=5.0,
        help="each peer of the gossip phase ends a round this often (0: idle)",
    )
    parser.add_argument(
        "--gossip-stretch",
        type=parse_stretch,
        default=1,
        help="gossip phase: every protocol period k times longer, rates multiplied back (k, or size:k,...)",
    )
    parser.add_argument(
        "--gossip-intervals",
        type=float,
        default=2.0,
        help="gossip phase: the window is at least this many heartbeat intervals (2: stable to a few per cent)",
    )
    parser.add_argument("--out", default="", help="also write the JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import trio

        trio.run(_worker)
        return
    t0 = time.monotonic()
    sizes = sorted(int(x) for x in args.sizes.split(",") if x)
    gossip_sizes = sorted(int(x) for x in args.gossip_sizes.split(",") if x)
    # The largest swarm runs last, and the JSON so far is written after every step: a run cut
    # short keeps what it measured.
    steps = (
        [("rounds", n) for n in sizes[:-1]]
        + [("gossip", n) for n in gossip_sizes]
        + [("rounds", n) for n in sizes[-1:]]
    )
    if not steps:
        parser.error("nothing to run: --sizes and --gossip-sizes are both empty")
    scale: dict[int, dict[str, Any]] = {}
    gossip: dict[int, dict[str, Any]] = {}
    for kind, n in steps:
        if kind == "rounds":
            procs = -(-n // args.peers_per_process) if args.peers_per_process > 0 else args.procs
            scale[n] = rounds_phase(n, procs, args.rounds, args.group_size, args.max_peers)
            print(json.dumps({"progress": kind, **{k: v for k, v in scale[n].items() if k != "per_round"}}), flush=True)
        else:
            k = args.gossip_stretch if isinstance(args.gossip_stretch, int) else args.gossip_stretch.get(n, 1)
            gossip[n] = gossip_phase(n, args.procs, args.idle, args.gossip_round_s or None, k, args.gossip_intervals)
            print(json.dumps({"progress": kind, **gossip[n]}), flush=True)
        result = summarize(args, scale, gossip, time.monotonic() - t0)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result), flush=True)


def summarize(
    args: argparse.Namespace, scale: dict[int, dict[str, Any]], gossip: dict[int, dict[str, Any]], wall: float
) -> dict[str, Any]:
    """The result so far: every size's numbers and the summary keys over the sizes measured."""
    result: dict[str, Any] = {"group_size": args.group_size, "max_peers": args.max_peers, "cpu_cores": os.cpu_count()}
    result["peers_per_process"] = args.peers_per_process or None
    result["presence_is_daemons"] = True  # links: node/connections.py's ConnectionPlan, as a node's presence
    result["sizes"] = {str(n): v for n, v in scale.items()}
    result["gossip"] = {str(n): v for n, v in gossip.items()}
    if scale:
        lo, hi = min(scale), max(scale)
        result["growth_sizes"] = [lo, hi]
        result["cpu_growth"] = round(scale[hi]["cpu_s_per_peer_round"] / scale[lo]["cpu_s_per_peer_round"], 2)
        result["gc_share"] = {
            str(n): round(v["gc_s_per_peer_round"] / v["cpu_s_per_peer_round"], 3) for n, v in scale.items()
        }
        result["net_cpu_growth"] = round(
            scale[hi]["cpu_s_per_peer_round_net"] / max(scale[lo]["cpu_s_per_peer_round_net"], 1e-6), 2
        )
        result["idle_cpu_growth"] = round(
            scale[hi]["idle_cpu_per_peer_s"] / max(scale[lo]["idle_cpu_per_peer_s"], 1e-6), 2
        )
        result["msgs_growth"] = round(scale[hi]["msgs_per_peer_round"] / scale[lo]["msgs_per_peer_round"], 2)
        result["max_bytes_per_peer_round_over_m"] = max(v["bytes_per_peer_round_over_m"] for v in scale.values())
        result["mixing_ok"] = all(
            v["mixing_rounds"] is not None and v["mixing_rounds"] <= v["d"] + 1 for v in scale.values()
        )
        result["all_rounds_complete"] = all(v["all_rounds_complete"] for v in scale.values())
        result["max_connections_per_peer"] = max(v["max_connections_per_peer"] for v in scale.values())
    # A gossip size whose peers never all saw each other live (a starved machine) measured itself;
    # one that sent nothing idled for less than a heartbeat (--idle).
    valid = {n: v for n, v in gossip.items() if v["live_after"] == n and v["gossip_bytes_per_peer_s"] > 0}
    result["gossip_invalid_sizes"] = sorted(set(gossip) - set(valid))
    if len(valid) >= 2:
        g_lo, g_hi = min(valid), max(valid)
        result["gossip_growth"] = round(
            valid[g_hi]["gossip_bytes_per_peer_s"] / valid[g_lo]["gossip_bytes_per_peer_s"], 2
        )
        result["gossip_growth_sizes"] = [g_lo, g_hi]
    # What the rules predict where a machine cannot measure it: per-peer gossip is proportional
    # to the records the swarm writes a second (each reaches every peer once) — a membership
    # record per heartbeat, and progress: one per progress gap where rounds are shorter than the
    # gap, else one per round plus the heartbeats' rewrites (a trainer's `progress_live`) that
    # find the last write a gap old (about 1 − gap/round of them).
    from meshtrain.crdt.heartbeat_rate import heartbeat_interval_for, progress_gap_for

    def records_per_s(n: int) -> float:
        beat, gap, rnd = heartbeat_interval_for(n), progress_gap_for(n), args.gossip_round_s
        if not rnd:
            return n / beat
        progress = 1 / gap if rnd < gap else 1 / rnd + (1 - gap / rnd) / beat
        return n / beat + n * progress

    model = sorted({16, 256, *scale, *gossip})
    result["gossip_model_records_per_s"] = {str(n): round(records_per_s(n), 2) for n in model}
    result["gossip_model_growth"] = round(records_per_s(model[-1]) / records_per_s(model[0]), 2)
    result["gossip_model_growth_sizes"] = [model[0], model[-1]]
    result["round_s_note"] = "CPU-bound: every peer shares this machine's cores; per-peer costs are the measure"
    result["wall_s"] = round(wall, 1)
    return result


# --- worker ---------------------------------------------------------------------------------------


async def _worker() -> None:
    import resource

    import torch
    import trio

    from meshtrain.collective.allreduce import AllReduceConfig, SwarmCollective
    from meshtrain.log import configure
    from meshtrain.models.gpt import GPT
    from meshtrain.models.sources import PRESETS
    from meshtrain.optim.diloco import DiLoCo
    from meshtrain.transport.host import ConnectError, Host, HostConfig
    from meshtrain.transport.identity import Identity
    from meshtrain.transport.tensor_streams import TensorStreams, TransferError

    # Every link costs each of its two ends a libp2p socket plus `window` data-plane sessions
    # (about 6 descriptors per link and worker at 256 peers): lift the soft limit to the hard one.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    def _rss_mib() -> int:
        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)

    if os.environ.get("BENCH_SCALE_LOG_DIR"):  # diagnosing a run: each worker's log in its own file
        log = Path(os.environ["BENCH_SCALE_LOG_DIR"]) / f"worker-{os.getpid()}.log"
        os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
        configure("INFO")
    else:
        configure("ERROR")
    torch.set_num_threads(1)
    nodes: dict[int, dict[str, Any]] = {}
    counters = {"msgs": 0, "sent": 0}
    gc_time = {"s": 0.0, "start": 0.0}  # the cyclic collector's time, per round (its callbacks)

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_time["start"] = time.process_time()
        else:
            gc_time["s"] += time.process_time() - gc_time["start"]

    gc.callbacks.append(on_gc)
    setup = {"dial_retries": 0, "session_retries": 0}

    class TinyPeerModel(torch.nn.Module):
        """gpt-tiny, plus `reach`: one value per peer, 0 until that peer's update got here."""

        def __init__(self, n: int) -> None:
            super().__init__()
            self.gpt = GPT(PRESETS["gpt-tiny"]())
            self.reach = torch.nn.Parameter(torch.zeros(n))

    roster: list[str] = []

    def count(obj: Any, name: str) -> None:
        original = getattr(obj, name)

        async def counted(*a: Any, **kw: Any) -> Any:
            counters["msgs"] += 1
            return await original(*a, **kw)

        setattr(obj, name, counted)

    async def one_round(node: dict[str, Any], r: int, result: dict[str, int]) -> None:
        """One outer round of DiLoCo (lr 1, momentum 0, H 1) on this peer: "train" (move θ), step."""
        outer, model = node["outer"], node["model"]
        g = torch.Generator().manual_seed(SEED * 1_000_003 + node["index"] * 1009 + r)
        with torch.no_grad():
            for prm in model.gpt.parameters():
                prm.add_(torch.randn(prm.shape, generator=g), alpha=1e-3)
            if r == 0:  # our update: Δ_reach = e_me, once; it spreads through φ from then on
                model.reach[node["me"]] -= 1.0
        reports = await outer.astep()
        rep = reports[-1]
        counters["sent"] += rep.bytes_sent
        result["ok"] += not rep.error
        result["failed"] += bool(rep.error)
        if rep.error and len(result["errors"]) < 3:
            result["errors"].append(rep.error[:300])
        result["alone"] += rep.contributors <= 1
        result["mixed"] += bool((outer.outer_params["reach"] != 0).all())

    async def handle(cmd: str, command: dict[str, Any], stack: AsyncExitStack) -> Any:
        nonlocal roster
        if cmd == "init":
            roster = command["roster"]
            for i, seed in zip(command["nodes"], command["seeds"], strict=True):
                host = await stack.enter_async_context(
                    Host(Identity.from_seed(bytes.fromhex(seed)), HostConfig(max_connections=1000))
                )
                streams = await stack.enter_async_context(TensorStreams(host))
                me = roster.index(host.peer_id)
                nodes[i] = {"host": host, "streams": streams, "index": i, "me": me}
            return {"nodes": [[i, n["host"].addrs[0]] for i, n in nodes.items()]}
        elif cmd == "connect":
            config = AllReduceConfig(join_timeout=300, part_timeout=300, report_timeout=120)
            sem = trio.Semaphore(DIALS_IN_FLIGHT)

            async def dial(i: int, addr: str, sem: trio.Semaphore = sem) -> None:
                async with sem:
                    for attempt in range(SETUP_ATTEMPTS):  # py-libp2p's 30 s negotiation can time out
                        try:  # on a starved machine: a dial that failed is retried, and counted
                            await nodes[i]["host"].connect(addr, timeout=120)
                            return
                        except ConnectError as e:
                            setup["dial_retries"] += 1
                            if attempt == SETUP_ATTEMPTS - 1:
                                raise ConnectError(f"peer {i} dialling {addr}: {e}") from None
                            await trio.sleep(1.0 + attempt)

            opening = trio.Semaphore(SESSIONS_IN_FLIGHT)

            async def session(i: int, peer: str, sem: trio.Semaphore = opening) -> None:
                async with sem:
                    for _ in range(config.window):  # as many as a round keeps in flight to a peer
                        for attempt in range(SETUP_ATTEMPTS):  # a busy machine can miss the 10 s session RPC
                            try:
                                await nodes[i]["streams"].prepare(peer)
                                break
                            except TransferError as e:
                                setup["session_retries"] += 1
                                if attempt == SETUP_ATTEMPTS - 1:
                                    raise TransferError(f"peer {i} opening a session to {peer}: {e}") from None
                                await trio.sleep(1.0 + attempt)

            async with trio.open_nursery() as nursery:
                for i, addr in command["links"]:
                    nursery.start_soon(dial, i, addr)
            # Data-plane sessions too: all of a machine's peers opening theirs at once in the
            # first round would time out here (the 10 s session RPC; one shared CPU), not on a WAN.
            async with trio.open_nursery() as nursery:
                for i, peers in command["partners"].items():
                    for peer in peers:
                        nursery.start_soon(session, int(i), peer)
            for n in nodes.values():
                col = SwarmCollective(
                    n["host"],
                    n["streams"],
                    lambda r, roster=roster: roster,
                    config,
                    grouping=_groups_plan(command["group_size"]),
                )
                n["collective"] = await stack.enter_async_context(col)
                torch.manual_seed(SEED)  # one φ for the swarm, as after a start or a download
                n["model"] = TinyPeerModel(len(roster))
                n["outer"] = DiLoCo(n["model"], None, col, H=1, lr=1.0, momentum=0.0)
                n["outer"].inner_steps = command["first_round"] - 1
                count(n["host"].rpc, "call")
                count(n["streams"], "send")
            return {**setup, "fds": len(os.listdir("/proc/self/fd")), "rss_mib": _rss_mib()}
        elif cmd == "idle":  # connected, collectives entered, no round: the links' own cost
            cpu0 = time.process_time()
            await trio.sleep(command["seconds"])  # sleep: the window measured
            return {"cpu": time.process_time() - cpu0}
        elif cmd == "round":
            result: dict[str, Any] = {"ok": 0, "failed": 0, "alone": 0, "mixed": 0, "errors": []}
            counters.update(msgs=0, sent=0)
            gc_time["s"] = 0.0
            profile_dir = os.environ.get("BENCH_SCALE_PROFILE_DIR", "")
            clock = time.perf_counter if os.environ.get("BENCH_SCALE_PROFILE_CLOCK") == "wall" else time.process_time
            profiler = cProfile.Profile(clock) if profile_dir else None
            cpu0 = time.process_time()
            if profiler is not None:
                profiler.enable()
            async with trio.open_nursery() as nursery:
                for n in nodes.values():
                    nursery.start_soon(one_round, n, command["round"], result)
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(Path(profile_dir) / f"worker-{os.getpid()}-r{command['round']}.prof")
            m_bytes = 4 * sum(p.numel() for p in next(iter(nodes.values()))["model"].parameters())
            return {
                **result,
                **counters,
                "cpu": time.process_time() - cpu0,
                "gc": gc_time["s"],
                "m_bytes": m_bytes,
                "rss_mib": _rss_mib(),
            }
        else:
            raise ValueError(f"unknown command {cmd!r}")

    await serve_commands(handle)


if __name__ == "__main__":
    main()
