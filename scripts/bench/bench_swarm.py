"""Swarm benchmark: DHT get latency and success with 10% of the nodes killed.

    python scripts/bench/bench_swarm.py [--nodes 32] [--keys 64] [--gets 300] [--kill 0.1] [--seed 0]

The last line printed is one JSON object: the union of the dicts returned by each phase in
`PHASES`, so a further phase is one function and one entry in that list. A phase takes the
parsed arguments and returns a dict; an `async def` phase runs in its own `trio.run`, a plain
function (e.g. one that drives worker processes) is called as is. `--phases dht` runs a subset.

DHT phase (`dht_phase`). What runs: N real libp2p hosts (TCP + Noise + yamux on loopback), each
with a `Dht` at its default settings (replication 5, alpha 5), as trio tasks in **one process**.
Why one process: the gets are issued one at a time, so at any moment only one lookup and the
replicas it queries are busy and a single event loop is not saturated; killing a node is then
exact (its scope is cancelled, its listener and connections close, as after a crash — nothing
tells the others it left), and there is no orchestration protocol to get wrong. It is a
pessimistic setup for latency: the client and the replicas it queries share one core, so their
CPU time adds up instead of overlapping as it would on separate machines.

Steps:
1. start N nodes; node i bootstraps from node 0 and from a random earlier node; wait until kad's
   background refresh has settled;
2. store `--keys` plain keys, each from a random node (`dht_store_p50_ms`);
3. kill `--kill` (10%) of the nodes, chosen at random, never the reader of a get;
4. issue `--gets` gets one after another, each from a random live node for a random key; a get
   succeeds if it returns exactly the stored value. Reported: `dht_get_p50_ms`,
   `dht_get_p99_ms`, `dht_success_rate`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from meshtrain.dht import Dht, DhtConfig  # noqa: E402
from meshtrain.log import configure  # noqa: E402
from meshtrain.transport.host import Host  # noqa: E402
from meshtrain.transport.identity import Identity  # noqa: E402

SWARM_ID = "bench-swarm"
SETTLE_SECONDS = 2.0
KEY_TTL = 600.0


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


@dataclass
class _Node:
    host: Host
    dht: Dht
    scope: trio.CancelScope
    stopped: trio.Event


async def _run_node(config: DhtConfig, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    stopped = trio.Event()
    try:
        with trio.CancelScope() as scope:
            async with Host(Identity.generate()) as host, Dht(host, SWARM_ID, config) as dht:
                task_status.started(_Node(host, dht, scope, stopped))
                await trio.sleep_forever()
    finally:
        stopped.set()


async def dht_phase(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    config = DhtConfig()
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nodes: list[_Node] = []
        for _ in range(args.nodes):
            nodes.append(await nursery.start(_run_node, config))
        for i, node in enumerate(nodes[1:], start=1):
            boot = {nodes[0].host.addrs[0], nodes[rng.randrange(i)].host.addrs[0]}
            await node.dht.bootstrap(sorted(boot))
        await trio.sleep(SETTLE_SECONDS)
        setup_s = time.perf_counter() - t0
        tables = [len(n.dht.routing_table_peers()) for n in nodes]

        expected: dict[str, Any] = {}
        store_ms = []
        for k in range(args.keys):
            key, value = f"/bench/key/{k}", {"k": k, "blob": rng.randbytes(64)}
            writer = rng.choice(nodes)
            t = time.perf_counter()
            await writer.dht.store(key, value, time.time() + KEY_TTL)
            store_ms.append((time.perf_counter() - t) * 1000)
            expected[key] = value

        n_kill = round(args.kill * args.nodes)
        killed = rng.sample(range(args.nodes), n_kill)
        for i in killed:
            nodes[i].scope.cancel()
        for i in killed:
            await nodes[i].stopped.wait()
        alive = [n for i, n in enumerate(nodes) if i not in killed]

        get_ms, ok = [], 0
        keys = sorted(expected)
        for _ in range(args.gets):
            reader, key = rng.choice(alive), rng.choice(keys)
            t = time.perf_counter()
            value = await reader.dht.get(key)
            get_ms.append((time.perf_counter() - t) * 1000)
            ok += value == expected[key]
        nursery.cancel_scope.cancel()

    return {
        "dht_nodes": args.nodes,
        "dht_killed": n_kill,
        "dht_keys": args.keys,
        "dht_gets": args.gets,
        "dht_get_p50_ms": round(statistics.median(get_ms), 2),
        "dht_get_p99_ms": round(_percentile(get_ms, 99), 2),
        "dht_success_rate": round(ok / args.gets, 4),
        "dht_store_p50_ms": round(statistics.median(store_ms), 2),
        "dht_setup_s": round(setup_s, 2),
        "dht_routing_table_min": min(tables),
        "dht_routing_table_median": statistics.median(tables),
        "dht_processes": 1,
    }


Phase = Callable[[argparse.Namespace], Awaitable[dict[str, Any]] | dict[str, Any]]


def crdt_phase(args: argparse.Namespace) -> dict[str, Any]:
    """CRDT phase: partition N peers (4 worker processes) into halves, write on both, heal; see
    scripts/bench/crdt_phase.py for what `crdt_converge_s` and `msgs_per_node_s` measure."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from scripts.bench.crdt_phase import run_crdt_phase

    return run_crdt_phase(n=args.nodes)


PHASES: list[tuple[str, Phase]] = [("dht", dht_phase), ("crdt", crdt_phase)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--gets", type=int, default=300)
    parser.add_argument("--kill", type=float, default=0.1, help="fraction of nodes killed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--phases", default=",".join(name for name, _ in PHASES), help="comma-separated phases to run")
    args = parser.parse_args(argv)
    configure()
    wanted = set(args.phases.split(","))
    result: dict[str, Any] = {}
    for name, phase in PHASES:
        if name in wanted:
            if inspect.iscoroutinefunction(phase):
                result.update(trio.run(phase, args))
            else:
                result.update(phase(args))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
