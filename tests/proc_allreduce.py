"""A real all-reduce peer in its own process, with optional fault injection at a named step.

    python tests/proc_allreduce.py --index I --numel M --rounds R [--fault F --fault-round r] [--group-size g]

Protocol on stdio (one JSON object per line):
  out {"peer": id, "addr": multiaddr, "index": I}
  in  a JSON list of every peer's multiaddr; we connect to all
  out {"ready": true}
  in  "go"
  out per round {"round": r, "digest": hex, "contributors": [...], "excluded": [...], "seconds": s}
      or {"round": r, "error": "..."} / {"round": r, "cancelled": true}

Faults (applied only in the process whose rank among the sorted peer ids is `--victim-rank`,
at round `--fault-round`; rank 0 is the round's coordinator), in the spirit of hivemind's
FaultyAverager and torchft's named failure points:
  before_start    SIGKILL ourselves before joining the round
  while_sending   SIGKILL ourselves 30 ms into our first reduce-scatter send
  while_reducing  SIGKILL ourselves when our part's reduction starts (after receiving)
  slow_sender     never send our reduce-scatter parts (stall while staying connected)
  cancel          cancel our own all_reduce 50 ms in, then carry on with later rounds
  nan             send NaN as our contribution and as our reduced part (a hostile peer)
  huge            send 1e30 as our contribution (finite garbage, for robust aggregation)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import trio

import meshtrain.collective.contribution as contribution
import meshtrain.collective.data_phase as data_phase
from meshtrain.collective.allreduce import AllReduceConfig, SwarmCollective
from meshtrain.collective.contract import RoundRequest
from meshtrain.collective.groups import GroupPlan
from meshtrain.log import configure
from meshtrain.transport.host import Host
from meshtrain.transport.identity import Identity
from meshtrain.transport.tensor_streams import TensorStreams


def inputs(index: int, round_id: int, numel: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(index * 100_003 + round_id)
    a, b = numel // 2, numel // 3
    return {
        "big": torch.randn(a, generator=g),
        "mid": torch.randn(b, generator=g),
        "odd": torch.randn(numel - a - b, generator=g),
    }


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def install_fault(fault: str, ts: TensorStreams, col: SwarmCollective, armed: dict) -> None:
    real_send = ts.send

    async def send(peer, tag, tensors, **kw):
        if armed["on"] and fault == "while_sending" and "/ag/" in tag:
            # Dying mid-round: a small round could otherwise finish (its all-gather sent) within
            # the 30 ms before the kill, and the victim would count as a contributor.
            await trio.sleep_forever()
        if armed["on"] and "/rs/" in tag:
            if fault == "while_sending":
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(lambda: real_send(peer, tag, tensors, **kw))
                    await trio.sleep(0.03)  # sleep: the kill lands 30 ms into the send (fault injection)
                    os.kill(os.getpid(), signal.SIGKILL)
            if fault == "slow_sender":
                await trio.sleep_forever()
        return await real_send(peer, tag, tensors, **kw)

    ts.send = send
    real_reduce = data_phase.reduce_contributions

    def reduce(*a, **kw):
        if armed["on"] and fault == "while_reducing":
            os.kill(os.getpid(), signal.SIGKILL)
        return real_reduce(*a, **kw)

    data_phase.reduce_contributions = reduce
    if fault in ("nan", "huge"):
        # Hostile at the protocol level: what we contribute and, as the owner of a part, what we
        # hand back as its reduced value are garbage (our own input passed the honest checks).
        value = float("nan") if fault == "nan" else 1e30
        real_flatten = contribution.flatten_checked

        def hostile_flatten(tensors):
            flat, finite = real_flatten(tensors)
            return (torch.full_like(flat, value), True) if armed["on"] else (flat, finite)

        contribution.flatten_checked = hostile_flatten

        def hostile_reduce(*a, **kw):
            out = real_reduce(*a, **kw)
            return torch.full_like(out, value) if armed["on"] else out

        data_phase.reduce_contributions = hostile_reduce


async def main(args: argparse.Namespace) -> None:
    config = AllReduceConfig(
        join_timeout=args.join_timeout,
        part_timeout=args.part_timeout,
        report_timeout=args.part_timeout,
        robust=args.robust,
    )
    async with Host(Identity.generate()) as host, TensorStreams(host) as ts:
        say({"peer": host.peer_id, "addr": host.addrs[0], "index": args.index})
        addrs = json.loads(await trio.to_thread.run_sync(sys.stdin.readline))
        ids = sorted(a.rsplit("/", 1)[1] for a in addrs)
        for a in addrs:
            if not a.endswith(host.peer_id):
                await host.connect(a)
        if args.group_size:
            # As the node does: groups from the whole roster, candidates the peers still connected.
            me = host.peer_id
            col = SwarmCollective(
                host,
                ts,
                lambda r: [p for p in ids if p == me or host.is_connected(p)],
                config,
                grouping=GroupPlan(group_size=args.group_size),
                roster=lambda r: ids,
            )
        else:
            col = SwarmCollective(host, ts, lambda r: ids, config)
        armed = {"on": False}
        victim = ids.index(host.peer_id) == args.victim_rank
        fault = args.fault if victim else "none"
        install_fault(fault, ts, col, armed)
        say({"ready": True})
        await trio.to_thread.run_sync(sys.stdin.readline)
        for r in range(args.rounds):
            armed["on"] = fault != "none" and r == args.fault_round
            if armed["on"] and fault == "before_start":
                os.kill(os.getpid(), signal.SIGKILL)
            t0 = time.monotonic()
            try:
                with trio.move_on_after(0.05 if armed["on"] and fault == "cancel" else 1e9) as scope:
                    res = await col.all_reduce(
                        RoundRequest(inputs(args.index, r, args.numel), round_id=r, codec=args.codec)
                    )
                if scope.cancelled_caught:
                    say({"round": r, "cancelled": True})
                    continue
                say(
                    {
                        "round": r,
                        "digest": res.digest.hex(),
                        "contributors": list(res.contributors),
                        "excluded": sorted(res.excluded),
                        "seconds": time.monotonic() - t0,
                    }
                )
            except Exception as e:
                detail = e
                while isinstance(detail, BaseExceptionGroup):
                    detail = detail.exceptions[0]
                say(
                    {
                        "round": r,
                        "error": f"{type(e).__name__}: {type(detail).__name__}: {detail}",
                        "seconds": time.monotonic() - t0,
                    }
                )
        # Keep serving the others' last round: until the harness says "stop" (every peer has
        # printed its rounds) or `--linger` seconds pass.
        with trio.move_on_after(args.linger):
            await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)


if __name__ == "__main__":
    configure()  # MESHTRAIN_LOG (the test sets INFO and keeps the log for a failed run)
    p = argparse.ArgumentParser()
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--numel", type=int, default=1 << 20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--fault", default="none")
    p.add_argument("--fault-round", type=int, default=1)
    p.add_argument("--victim-rank", type=int, default=-1)
    p.add_argument("--codec", default="none")
    p.add_argument("--robust", default="none")
    p.add_argument("--join-timeout", type=float, default=5)
    p.add_argument("--part-timeout", type=float, default=5)
    p.add_argument("--linger", type=float, default=3)
    p.add_argument("--group-size", type=int, default=0, help="grouped rounds (collective/groups.py); 0: none")
    trio.run(main, p.parse_args())
    # Exit without the interpreter's teardown: with torch and libp2p loaded it costs up to a
    # second of CPU per process (more on a busy machine) while the harness waits for our exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
