"""How long a round waits for a stopped member, by swarm size: silence detection where heartbeats
are sparse (collective/probe.py, "Sparse heartbeats").

    python scripts/bench/bench_silence.py [--sizes 12,64,256] [--trials 2] [--out FILE]

The last line printed is one JSON object (also written to `--out`).

What runs. A round's coordinator (collective/coordinator.py's `Coordinator`, on a real `Host`)
expects four members; three join (the coordinator's own and two others), and the fourth is a
real peer in its own process (this script with `--child`: a host that answers WHERE from its
loop, as a node does) that was connected and has just been SIGSTOPped — a laptop lid closed as
the round began. Measured: the seconds from the round's creation until its group is fixed
without the stopped member (`fixed_s`), each probe a real RPC over the real connection to the
stopped process, the silence rules the coordinator's own.

What is modelled: the stopped member's heartbeats. The node's rule (node/presence.py
`heartbeats_stopped`) takes a peer for quiet once no membership heartbeat of it arrived for
`QUIET_BEATS` heartbeat intervals + 1 s, and the interval is the swarm's
(crdt/heartbeat_rate.py `heartbeat_interval_for`: 3 s up to 12 peers, 10.7 s at 64, 32 s at 256).
Here the last heartbeat arrived a fraction of an interval before the stop (trial i of k: (i +
0.5) / k), and `quiet` is that rule on it, with those functions and constants — not 256 gossiping
peers. Two modes, side by side at each size: `patient` (the coordinator as it is) and
`heartbeats_only` (its `SilentPeers` without the patient probe: how it was before).

Targets: with the patient probe, `fixed_s` at most `PROBE_AFTER + PROBE_EVERY + QUIET_S`
(11 s: the patient probe goes out with the first one and is given `QUIET_S`, and the coordinator
may act on it at the end of the probe pass under way then; 12 s before the patient probe went out
with the first, stop 66) at every size (`targets_met`); before the patient probe, it grows with the
heartbeat interval up to the join deadline (30 s).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from meshtrain.collective.coordinator import Coordinator  # noqa: E402
from meshtrain.collective.probe import QUIET_S  # noqa: E402
from meshtrain.collective.protocol import (  # noqa: E402
    PROBE_AFTER,
    PROBE_EVERY,
    WHERE_RPC,
    AllReduceConfig,
    Joined,
    RoundKey,
    WhereReply,
)
from meshtrain.crdt.heartbeat_rate import heartbeat_interval_for  # noqa: E402
from meshtrain.node.presence import QUIET_BEATS  # noqa: E402
from meshtrain.transport.host import Host  # noqa: E402
from meshtrain.transport.identity import Identity  # noqa: E402

TARGET_S = PROBE_AFTER + PROBE_EVERY + QUIET_S


async def child() -> None:
    """The member to be stopped: a host that answers WHERE from its loop, as a node does."""

    async def where(sender: str, request: object) -> object:
        return WhereReply(-1, None, 41).to_wire()

    async with Host(Identity.generate()) as host:
        host.rpc.serve(WHERE_RPC, where)
        print(json.dumps({"peer": host.peer_id, "addr": host.addrs[0]}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)


async def one_round(size: int, phase: float, patient: bool) -> dict[str, Any]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        hello = json.loads(proc.stdout.readline())
        stopped = hello["peer"]
        others = [Identity.generate().peer_id_str for _ in range(2)]
        # The coordinator of a round is its lowest id: ours, so that nobody hands it over.
        identity = Identity.generate()
        while identity.peer_id_str > min(stopped, *others):
            identity = Identity.generate()
        async with Host(identity) as host:
            await host.connect(hello["addr"])
            interval = heartbeat_interval_for(size)
            os.kill(proc.pid, signal.SIGSTOP)
            last_beat = trio.current_time() - phase * interval

            def quiet(peer: str) -> bool:
                return peer == stopped and trio.current_time() - last_beat > QUIET_BEATS * interval + 1.0

            members = tuple(sorted([host.peer_id, stopped, *others]))
            c = Coordinator(host, AllReduceConfig(), lambda _round: members, quiet=quiet)
            if not patient:
                c.silent.start_soon = None  # how it was before: no patient probe
            key = RoundKey(7, "", host.peer_id)
            replies: dict[str, Any] = {}
            async with trio.open_nursery() as nursery:
                await nursery.start(c.run)
                t0 = trio.current_time()

                async def join(peer: str) -> None:
                    replies[peer] = (await c.join(peer, key), trio.current_time() - t0)

                async with trio.open_nursery() as joins:
                    for p in [host.peer_id, *others]:
                        joins.start_soon(join, p)
                nursery.cancel_scope.cancel()
        reply, fixed_s = replies[host.peer_id]
        return {
            "fixed_s": round(fixed_s, 2),
            "group": len(reply.group) if isinstance(reply, Joined) else repr(reply)[:120],
            "silent_marked": stopped in c.silent.marks,
        }
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


async def run(sizes: list[int], trials: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size in sizes:
        interval = heartbeat_interval_for(size)
        row: dict[str, Any] = {
            "heartbeat_interval_s": round(interval, 1),
            "quiet_after_s": round(QUIET_BEATS * interval + 1.0, 1),
        }
        for mode, patient in (("patient", True), ("heartbeats_only", False)):
            results = [await one_round(size, (i + 0.5) / trials, patient) for i in range(trials)]
            row[mode] = {
                "fixed_s": [r["fixed_s"] for r in results],
                "groups": [r["group"] for r in results],
                "silent_marked": [r["silent_marked"] for r in results],
            }
            print(f"size {size} {mode}: {row[mode]}", file=sys.stderr, flush=True)
        out[str(size)] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="12,64,256", help="swarm sizes whose heartbeat interval is used")
    parser.add_argument("--trials", type=int, default=2, help="rounds per size and mode")
    parser.add_argument("--out", default="", help="also write the JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        trio.run(child)
        return
    sizes = [int(s) for s in args.sizes.split(",") if s]
    t0 = time.monotonic()
    by_size = trio.run(run, sizes, args.trials)
    patient_max = max(max(r["patient"]["fixed_s"]) for r in by_size.values())
    before_max = max(max(r["heartbeats_only"]["fixed_s"]) for r in by_size.values())
    result = {
        "bench": "silence",
        "sizes": by_size,
        "max_fixed_s_patient": patient_max,
        "max_fixed_s_heartbeats_only": before_max,
        "target_s": TARGET_S,
        "targets_met": patient_max <= TARGET_S
        and all(g == 3 for r in by_size.values() for g in r["patient"]["groups"]),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
