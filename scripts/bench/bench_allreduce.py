"""All-reduce benchmark: 8 peers (separate processes) on loopback average 100 MB of fp32.

    python scripts/bench/bench_allreduce.py [--peers 8] [--mb 100] [--rounds 3] [--no-hivemind]

Measures, in one run:
- `allreduce_s`: median over `--rounds` timed rounds of the slowest peer's `all_reduce` time
  (after one untimed warm-up round that opens connections);
- `single_stream_mib_s` (B): our tensor stream between two processes, measured in the same run;
- `bound_s` = 2(N−1)/N · M / B, the bandwidth-optimal bound, which assumes every peer has
  its own link of bandwidth B. On this machine 8 peers share 2 cores and one stream already keeps
  both busy (one encrypts, one decrypts), so the real floor is all bytes moved by all peers through
  that one stream: `machine_bound_s` = 2(N−1) · M / B. Both ratios are reported;
- `with_failure_s`: a round in which one (non-coordinator) peer SIGKILLs itself 200 ms into its
  first send — the survivors' slowest time, including detection and the redo;
- `digests_equal`: every surviving peer ended every round with the same result digest;
- `hivemind_s`: the same payload through hivemind's `DecentralizedAverager` (its own venv, see
  scripts/bench/hivemind_anchor.py), or null with the reason.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


async def _worker(args) -> None:
    import torch
    import trio

    from meshtrain.collective.allreduce import AllReduceConfig, SwarmCollective
    from meshtrain.collective.contract import RoundRequest
    from meshtrain.log import configure
    from meshtrain.transport.host import Host
    from meshtrain.transport.identity import Identity
    from meshtrain.transport.tensor_streams import TensorStreams

    configure()
    torch.set_num_threads(1)
    numel = args.mb * 1_000_000 // 4
    g = torch.Generator().manual_seed(args.index)
    # A model-like dict: a few big matrices and many small vectors.
    sizes = [numel // 4] * 3
    sizes += [4096] * ((numel - sum(sizes)) // 4096)
    sizes.append(numel - sum(sizes))
    tensors = {f"p{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes) if n}
    config = AllReduceConfig(join_timeout=20, part_timeout=20)
    async with Host(Identity.generate()) as host, TensorStreams(host) as ts:
        _say({"peer": host.peer_id, "addr": host.addrs[0]})
        addrs = json.loads(await trio.to_thread.run_sync(sys.stdin.readline))
        ids = sorted(a.rsplit("/", 1)[1] for a in addrs)
        for a in addrs:
            if not a.endswith(host.peer_id) and ids.index(a.rsplit("/", 1)[1]) < ids.index(host.peer_id):
                await host.connect(a)
        col = SwarmCollective(host, ts, lambda r: ids, config)
        victim = ids.index(host.peer_id) == args.victim_rank
        real_send = ts.send
        armed = {"on": False}

        async def send(peer, tag, t, **kw):
            if armed["on"]:
                armed["on"] = False
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(lambda: real_send(peer, tag, t, **kw))
                    await trio.sleep(0.2)
                    os.kill(os.getpid(), signal.SIGKILL)
            return await real_send(peer, tag, t, **kw)

        ts.send = send
        _say({"ready": True})
        await trio.to_thread.run_sync(sys.stdin.readline)
        for r in range(args.rounds + 2):
            armed["on"] = victim and r == args.rounds + 1
            t0 = time.perf_counter()
            try:
                res = await col.all_reduce(RoundRequest(tensors, round_id=r))
                _say(
                    {
                        "round": r,
                        "s": time.perf_counter() - t0,
                        "digest": res.digest.hex(),
                        "contributors": len(res.contributors),
                    }
                )
            except Exception as e:
                _say({"round": r, "error": repr(e)[:300]})
        await trio.sleep(1)


def _spawn(*argv: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        cwd=ROOT,
    )


def run_swarm(peers: int, mb: int, rounds: int) -> dict:
    procs = [
        _spawn("--worker", "--index", str(i), "--mb", str(mb), "--rounds", str(rounds), "--victim-rank", str(peers - 1))
        for i in range(peers)
    ]
    try:
        infos = [json.loads(p.stdout.readline()) for p in procs]
        addrs = json.dumps([i["addr"] for i in infos])
        for p in procs:
            p.stdin.write(addrs + "\n")
            p.stdin.flush()
        for p in procs:
            json.loads(p.stdout.readline())  # ready
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        rows = [[json.loads(line) for line in p.stdout] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    by_round: dict[int, list[dict]] = {}
    for out in rows:
        for row in out:
            by_round.setdefault(row["round"], []).append(row)
    # A round in which every peer failed has no time: it is reported under `errors`, not timed.
    timed = [max(ok) for r in range(1, rounds + 1) if (ok := [x["s"] for x in by_round.get(r, []) if "s" in x])]
    fail_rows = [x for x in by_round.get(rounds + 1, []) if "s" in x]
    digests_equal = all(len({x.get("digest") for x in by_round[r] if "s" in x}) == 1 for r in by_round)
    errors = [x for r in by_round.values() for x in r if "error" in x]
    return {
        "allreduce_s": statistics.median(timed) if timed else None,
        "rounds_s": timed,
        "with_failure_s": max(x["s"] for x in fail_rows) if fail_rows else None,
        "failure_round_contributors": fail_rows[0]["contributors"] if fail_rows else None,
        "digests_equal": digests_equal,
        "errors": errors[:3],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", type=int, default=8)
    p.add_argument("--mb", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-hivemind", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--victim-rank", type=int, default=-1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        import trio

        trio.run(_worker, args)
        return

    from scripts.bench.bench_transport import run_mode

    print(f"[bench_allreduce] single stream, {args.mb} MB ...", file=sys.stderr, flush=True)
    stream = run_mode("tensor", max(1, args.mb * 1_000_000 >> 20), 3)
    b = stream["mib_s"] * 2**20  # bytes/s
    m = args.mb * 1_000_000
    n = args.peers
    print(
        f"[bench_allreduce] B = {stream['mib_s']:.0f} MiB/s; {n} peers x {args.mb} MB ...", file=sys.stderr, flush=True
    )
    t = time.perf_counter()
    swarm = run_swarm(n, args.mb, args.rounds)
    print(f"[bench_allreduce] swarm done in {time.perf_counter() - t:.0f} s: {swarm}", file=sys.stderr, flush=True)
    bound = 2 * (n - 1) / n * m / b
    machine_bound = 2 * (n - 1) * m / b
    if args.no_hivemind:
        hm, why = None, "skipped (--no-hivemind)"
    else:
        print("[bench_allreduce] hivemind DecentralizedAverager (own venv) ...", file=sys.stderr, flush=True)
        try:
            from scripts.bench.hivemind_anchor import run_probe

            out = run_probe("hivemind_probe_allreduce.py", ["--peers", str(n), "--mb", str(args.mb)], timeout=1200)
            hm, why = out.get("hivemind_s"), out.get("error")
        except Exception as e:
            hm, why = None, f"hivemind harness unavailable: {e}"
    result = {
        "peers": n,
        "mb": args.mb,
        "allreduce_s": round(swarm["allreduce_s"], 3),
        "rounds_s": [round(x, 3) for x in swarm["rounds_s"]],
        "single_stream_mib_s": round(stream["mib_s"], 1),
        "bound_s": round(bound, 3),
        "ratio_to_bound": round(swarm["allreduce_s"] / bound, 2),
        "machine_bound_s": round(machine_bound, 3),
        "ratio_to_machine_bound": round(swarm["allreduce_s"] / machine_bound, 2),
        "with_failure_s": None if swarm["with_failure_s"] is None else round(swarm["with_failure_s"], 3),
        "failure_round_contributors": swarm["failure_round_contributors"],
        "digests_equal": swarm["digests_equal"],
        "hivemind_s": None if hm is None else round(hm, 3),
        "hivemind_reason": why,
        "vs_hivemind": None if not hm else round(swarm["allreduce_s"] / hm, 2),
        "errors": swarm["errors"],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
