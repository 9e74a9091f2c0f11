"""Collectives over WAN-shaped links: the WAN lab (scripts/labs/wanlab), root only.

    sudo .venv/bin/python scripts/bench/bench_wan.py [--peers 8] [--mb 100] [--rounds 3] [--quick]
        [--congestion cubic|bbr]
        [--only-hetero] [--no-hetero] [--no-training] [--no-allreduce] [--train-models medium,small]

Every peer is a real meshtrain process (tests/proc_nat_peer.py, or tests/proc_trainer.py for the
training part) in its own network namespace, behind its own link: tc tbf in both directions and
a user-space packet delay line (this kernel has no netem; scripts/labs/wanlab/lab.py says how and why).
With B a peer's link rate and M the payload, the bandwidth-optimal all-reduce time is
2(N−1)/N·M/B. Measured, in one run:

- `allreduce_ratio_to_link_bound`: N peers at 100 Mbit/s and 20 ms one-way, M = 100 MB fp32;
  median over `--rounds` timed rounds (after an untimed warm-up round that opens connections) of
  the round's wall time ÷ the bound. Target ≤ 1.15. A round's wall time runs from the first peer
  entering the all-reduce to the last one leaving it (all peers are asked at once; the lab shares
  one monotonic clock); `asked_s` beside it also counts each peer building its 100 MB input.
- `hetero_ratio_to_bound`: the same with 2 of the N peers at 20 Mbit/s, ÷ the bound of the best
  schedule for those rates (`best_schedule_bound`: reduce-scatter/all-gather with part sizes
  chosen for the rates, every link busy both ways all the time; no schedule can beat M / B_min,
  since the slowest peer must upload its whole input and download the whole result). Target ≤ 1.3.
  Three rounds (`bench_hetero`): the first after the links changed (the peers' rates are stale or
  unknown: equal parts), one with the rates the peers measured in it
  (`hetero_measured_ratio_to_bound`), and one with each peer's rate configured (`uplink_mbit`),
  whose ratio is `hetero_ratio_to_bound`. `--only-hetero` runs only these of the all-reduce part.
- `hivemind_ratio_to_link_bound`: hivemind's DecentralizedAverager (scripts/bench/hivemind_probe_allreduce.py,
  in its own venv, scripts/bench/hivemind_anchor.py) in a lab of the same shape, the same payload: N workers,
  each inside its peer's namespace, time from the last trigger to the last peer done (matchmaking
  excluded, as ours excludes group formation), median over `--rounds` ÷ the same bound; or null
  with the reason (`--no-hivemind`, or no venv: `--hivemind-venv-create` makes one, ~1.2 GB).
- `single_stream_fill`: one tensor stream (M bytes, warm connection) between two peers at
  100 Mbit/s and 100 ms RTT, goodput ÷ link rate, from `send` called to `send` returned (the
  header's and the ACK's round trips count). Target ≥ 0.9. Transfers this large have their own
  connection pool (tensor_streams.py: bulk connections), so the connection is warmed by the same
  transfer just before: `single_stream_fill_cold` is that first one, its connection's handshakes
  and ramp included. `tcp_fill` beside them is a plain Python TCP socket on the same path, timed
  after a second of warm-up: what the link and the kernel's TCP give at all.
- `streaming_overlap_ratio`: wall time of 200 inner steps of Streaming DiLoCo (P = 4, fp4, H =
  40) between 2 peers on 10 Mbit/s links (20 ms one-way) ÷ the same 200 steps with no
  communication at all (2 `single` peers run at the same time, so CPU contention is the same;
  they run first and again last, and the mean of the two is the baseline: `silent_runs_s`).
  Target ≤ 1.10. The overlap τ is the largest the schedule allows (H/P − 1 = 9 steps).
  `streaming_overlap_ratio_tau1` is the same at τ = 1 (the paper's default),
  `diloco_overlap_ratio` DiLoCo (H = 40, fp32) on the same link, and under `training`:
  `final_eval_loss` what each overlap cost in loss, `cpu_s_per_peer` the process CPU each peer
  used, `delay_line_cpu_s` what the lab's user-space delay line used meanwhile (a lab cost on the
  same cores, which a real WAN does not charge the peers), `step_ms` the silent run's step.
  Models (`--train-models`, default `medium,small`; the first gives the headline keys, the others
  the same keys with their name as suffix, `streaming_overlap_ratio_small`, `training_small`):
  `medium` (0.8M parameters, a step of 90–100 ms here) and `small` (0.2M, ~20 ms). Overlap hides
  the link's time, not the round's CPU: each round costs a peer ~20–60 ms of CPU in control
  messages and the data plane, and here the two peers' training already fills both cores, so that
  CPU lengthens the run whatever the overlap. Beside a 90 ms step it is a few per cent; beside
  the small model's 20 ms step it is 10–40 % (its ratio), which a machine with a core to spare
  per peer does not pay (0.97 measured on 16 cores).
- `tcp_congestion`: the TCP congestion control the lab's peers ran (`--congestion`; by default
  what new namespaces inherit from the machine: bbr on this project's machines, cubic on most).
- `delay_measured_ms`: one-way latency UDP probes saw per configured delay (the lab checks
  itself); `digests_equal`: every peer ended every round with the same result digest.

Progress goes to stderr; the last stdout line is one JSON object. `--quick` shrinks everything
(4 peers, 20 MB, 1 round, 60 steps) for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.hivemind_anchor import run_probe, venv_dir  # noqa: E402
from scripts.labs.natlab.lab import LabUnavailable, check_support, cleanup_stale  # noqa: E402
from scripts.labs.natlab.peers import LabPeer, start_peers  # noqa: E402
from scripts.labs.wanlab.lab import WanLab  # noqa: E402

MBIT = 1e6 / 8  # bytes/s per Mbit/s


def progress(msg: str) -> None:
    print(f"[bench_wan] {msg}", file=sys.stderr, flush=True)


def link_bound(n: int, m_bytes: float, rate_mbit: float) -> float:
    """2(N−1)/N · M / B: every peer sends and receives 2(N−1)/N · M over its own link."""
    return 2 * (n - 1) / n * m_bytes / (rate_mbit * MBIT)


def best_schedule_bound(m_bytes: float, rates_mbit: list[float]) -> float:
    """The best reduce-scatter/all-gather time for these per-peer link rates (symmetric links).

    Peer i owning a fraction f_i of the vector sends (1 − f_i)·M in the reduce-scatter and
    (N − 1)·f_i·M in the all-gather, and receives as much: T_i = M·(1 + (N − 2)·f_i) / B_i. The
    best split equalises T_i over the peers that own anything (water-filling), and a peer that
    owns nothing still needs M / B_i — a floor for every schedule, not just this family."""
    n = len(rates_mbit)
    rates = sorted((r * MBIT for r in rates_mbit), reverse=True)
    if n == 1:
        return 0.0
    if n == 2:
        return m_bytes / rates[-1]
    best = None
    for k in range(1, n + 1):  # the k fastest own parts
        t = m_bytes * (n - 2 + k) / sum(rates[:k])
        if all(t * b / m_bytes >= 1 for b in rates[:k]):
            best = t if best is None else min(best, t)
    assert best is not None  # k = 1 always qualifies once t·B_max ≥ M
    return max(best, m_bytes / rates[-1])


def connect_mesh(peers: list[LabPeer]) -> None:
    for i, a in enumerate(peers):
        for b in peers[:i]:
            a.call("connect", addr=b.addr, timeout=60)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes so far (Linux /proc)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def allreduce_round(
    peers: list[LabPeer],
    round_id: int,
    mib: float,
    timeout: float,
    extra_pids: tuple = (),
    uplinks: dict[str, float] | None = None,
) -> dict:
    """One round, all peers asked at once. `cpu_s`: CPU time our peers (and `extra_pids`, the
    delay line) used during it; `cpu_share`: that ÷ (wall × cores) — near 1 means CPU-bound.
    `uplinks`: peer name -> the uplink (Mbit/s, 0: measured) it is told to join with from now on;
    `uplink_measured_mbit`: what each peer measured on its own sends (None: not yet)."""
    ids = [p.peer_id for p in peers]
    pids = [p.proc.pid for p in peers] + list(extra_pids)
    cpu0 = cpu_seconds(pids)
    t0 = time.monotonic()
    extra = {p.name: {"uplink_mbit": uplinks[p.name]} if uplinks else {} for p in peers}
    cids = {p.name: p.submit("allreduce", peers=ids, round=round_id, mib=mib, **extra[p.name]) for p in peers}
    res = {name: p.result(cids[name], timeout=timeout, check=False) for name, p in zip(cids, peers, strict=True)}
    asked = time.monotonic() - t0
    cpu = cpu_seconds(pids) - cpu0
    errors = {n: r.get("error") for n, r in res.items() if not r.get("ok")}
    digests = {r.get("digest") for r in res.values()}
    # The round: from the first peer entering the all-reduce to the last one leaving it (every lab
    # namespace shares this machine's monotonic clock). `asked_s` adds what happens around it: the
    # commands' trip through the peers' stdin and each peer building its seeded input.
    spans = [(r["started"], r["ended"]) for r in res.values() if "started" in r]
    wall = max(e for _, e in spans) - min(s for s, _ in spans) if len(spans) == len(res) else asked
    return {
        "wall_s": wall,
        "asked_s": round(asked, 2),
        "cpu_s": round(cpu, 1),
        "cpu_share": round(cpu / (asked * (os.cpu_count() or 1)), 2),
        "load_avg_1m": round(os.getloadavg()[0], 1),
        "peer_max_s": max((r.get("seconds") or 0) for r in res.values()),
        "digests_equal": not errors and len(digests) == 1,
        "contributors": min(len(r.get("contributors") or []) for r in res.values()),
        "uplink_measured_mbit": {n: r.get("uplink_measured_mbit") for n, r in res.items()},
        "errors": errors,
    }


def bench_allreduce(args: argparse.Namespace, log_dir: str, out: dict) -> None:
    n, mb = args.peers, args.mb
    mib = mb * 1e6 / (1 << 20)
    with WanLab(n, rate_mbit=100, delay_ms=20, congestion=args.congestion) as lab:
        out["tcp_congestion"] = lab.tcp_congestion("p0")
        progress(
            f"lab up: {n} peers, 100 Mbit/s, 20 ms one-way, TCP {out['tcp_congestion']} ({lab.build_seconds:.2f} s)"
        )
        out["delay_measured_ms"] = {
            k: {"configured": v["configured"], "median": round(v["median"], 2)}
            for k, v in lab.measure_delay([("p0", f"p{n - 1}")]).items()
        }
        peers = list(start_peers(lab, {name: {} for name in lab.names}, log_dir=log_dir).values())
        connect_mesh(peers)
        progress("peers connected; warm-up round")
        warm = allreduce_round(peers, 1, 4.0, timeout=300)
        ok = warm["digests_equal"]
        if args.only_hetero:
            out["digests_equal"] = bench_hetero(args, lab, peers, out) and ok
            for p in peers:
                p.close()
            return
        rounds = []
        for r in range(args.rounds):
            rounds.append(allreduce_round(peers, 10 + r, mib, timeout=600, extra_pids=(lab.delay_pid,)))
            x = rounds[-1]
            progress(
                f"round {r}: {x['wall_s']:.2f} s, cpu {x['cpu_s']} s ({x['cpu_share']} of the machine), load {x['load_avg_1m']}"
            )
        bound = link_bound(n, mb * 1e6, 100)
        wall = statistics.median(x["wall_s"] for x in rounds)
        out["allreduce"] = {
            "rounds_s": [round(x["wall_s"], 2) for x in rounds],
            "asked_s": [x["asked_s"] for x in rounds],
            "bound_s": round(bound, 2),
            "cpu_share": [x["cpu_share"] for x in rounds],
            "load_avg_1m": [x["load_avg_1m"] for x in rounds],
        }
        out["allreduce_ratio_to_link_bound"] = round(wall / bound, 3)
        ok = ok and all(x["digests_equal"] for x in rounds)
        if args.hetero:
            ok = bench_hetero(args, lab, peers, out) and ok
        out["digests_equal"] = ok
        # One tensor stream at 100 Mbit/s and 100 ms RTT (50 ms each way), then a plain TCP socket.
        a, b = peers[0], peers[1]
        for p in ("p0", "p1"):
            lab.shape(p, delay_ms=50)
        fill_mib = min(mib, 100e6 / (1 << 20))
        cold = fill_mib * (1 << 20) / stream_once(a, b, fill_mib, "cold") / MBIT
        rate = fill_mib * (1 << 20) / stream_once(a, b, fill_mib, "timed") / MBIT
        out["single_stream"] = {
            "mbit_s": round(rate, 1),
            "cold_mbit_s": round(cold, 1),
            "mb": round(fill_mib * (1 << 20) / 1e6, 1),
            "rtt_ms": 100,
        }
        out["single_stream_fill"] = round(rate / 100, 3)
        out["single_stream_fill_cold"] = round(cold / 100, 3)
        out["tcp_fill"] = round(lab.measure_rate("p0", "p1", seconds=8) / 100, 3)
        for p in peers:
            p.close()


def bench_hetero(args: argparse.Namespace, lab: WanLab, peers: list[LabPeer], out: dict) -> bool:
    """2 of the peers at 20 Mbit/s, three rounds: `first` with the rates the peers measured
    before the links changed (none, or the homogeneous rounds': equal parts), `measured` with
    the rates measured in `first`, `configured` with each peer told its link rate (uplink_mbit).
    `hetero_ratio_to_bound` is the configured round's; whether every digest agreed is returned."""
    n, mb = args.peers, args.mb
    mib = mb * 1e6 / (1 << 20)
    slow = lab.names[-2:]
    for p in slow:
        lab.shape(p, rate_mbit=20)
    rates = {p: 20.0 if p in slow else 100.0 for p in lab.names}
    hb = best_schedule_bound(mb * 1e6, list(rates.values()))
    runs = {}
    for i, (name, uplinks) in enumerate((("first", None), ("measured", None), ("configured", rates))):
        h = allreduce_round(peers, 100 + i, mib, timeout=900, extra_pids=(lab.delay_pid,), uplinks=uplinks)
        progress(f"hetero round ({name}): {h['wall_s']:.2f} s, best-schedule bound {hb:.2f} s")
        progress(f"  measured uplinks after it (Mbit/s): {h['uplink_measured_mbit']}")
        runs[name] = h
    h = runs["configured"]
    out["hetero"] = {
        "slow_peers": len(slow),
        "wall_s": round(h["wall_s"], 2),
        "bound_s": round(hb, 2),
        "cpu_share": h["cpu_share"],
        "equal_parts_bound_s": round(mb * 1e6 * (1 + (n - 2) / n) / (20 * MBIT), 2),
        "rounds_wall_s": {k: round(v["wall_s"], 2) for k, v in runs.items()},
        "uplink_measured_mbit": runs["measured"]["uplink_measured_mbit"],
    }
    out["hetero_ratio_to_bound"] = round(h["wall_s"] / hb, 3)
    out["hetero_measured_ratio_to_bound"] = round(runs["measured"]["wall_s"] / hb, 3)
    for p in slow:
        lab.shape(p, rate_mbit=100)
    return all(x["digests_equal"] for x in runs.values())


def stream_once(a: LabPeer, b: LabPeer, mib: float, tag: str) -> float:
    rid = b.submit("recv", peer=a.peer_id, tag=tag, timeout=300)
    sent = a.call("send", peer=b.peer_id, tag=tag, mib=mib, timeout=300)
    b.result(rid, timeout=300)
    return float(sent["seconds"])


def run_trainers(lab: WanLab, name: str, method: list[str], steps: int, log_dir: str) -> list[dict]:
    """Two proc_trainer peers (p0, p1) with `method`, logging to trainer-`name`-i.log; their final
    JSON lines."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = []
    for i, host in enumerate(("p0", "p1")):
        log = open(os.path.join(log_dir, f"trainer-{name}-{i}.log"), "w")  # noqa: SIM115
        argv = [sys.executable, str(ROOT / "tests" / "proc_trainer.py"), "--index", str(i), "--steps", str(steps)]
        argv += ["--listen", lab.addr(host), "--join-timeout", "60", "--part-timeout", "60", *method]
        procs.append(
            lab.run(
                host, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, cwd=str(ROOT), env=env
            )
        )
    hello = [json.loads(p.stdout.readline()) for p in procs]
    for p in procs:
        p.stdin.write(json.dumps([h["addr"] for h in hello]) + "\n")
        p.stdin.flush()
    for p in procs:
        assert json.loads(p.stdout.readline()).get("ready")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    done = []
    for p in procs:
        for line in p.stdout:
            msg = json.loads(line)
            if msg.get("done"):
                done.append(msg)
                break
        p.stdin.close()
        p.wait(timeout=60)
    return done


def bench_streaming(args: argparse.Namespace, log_dir: str, out: dict) -> None:
    """The overlap comparison for each of `--train-models`: the first one's ratios are the headline
    keys, each other's carry its name as a suffix (`streaming_overlap_ratio_small`)."""
    with WanLab(2, rate_mbit=10, delay_ms=20, congestion=args.congestion) as lab:
        for i, model in enumerate(args.train_models):
            suffix = "" if i == 0 else f"_{model}"
            training = overlap_runs(args, lab, model, log_dir)
            out[f"training{suffix}"] = training
            walls = training["wall_s"]
            out[f"streaming_overlap_ratio{suffix}"] = round(walls["streaming"] / walls["none"], 3)
            out[f"streaming_overlap_ratio_tau1{suffix}"] = round(walls["streaming_tau1"] / walls["none"], 3)
            out[f"diloco_overlap_ratio{suffix}"] = round(walls["diloco"] / walls["none"], 3)


def overlap_runs(args: argparse.Namespace, lab: WanLab, model: str, log_dir: str) -> dict:
    """No exchange, Streaming DiLoCo at the largest overlap and at τ = 1, and DiLoCo: two peers of
    `model` on the lab's two links, one variant after the other."""
    steps = args.steps
    H, P = 40, 4
    most = H // P - 1  # the largest overlap the schedule allows: τ < H/P
    streaming = ["--method", "streaming", "--H", str(H), "--P", str(P), "--codec", "fp4"]
    runs = {
        "none": ["--method", "single"],
        "streaming": [*streaming, "--delay", str(most)],
        "streaming_tau1": [*streaming, "--delay", "1"],
        "diloco": ["--method", "diloco", "--H", str(H)],
    }
    walls, cpus, lab_cpus, stats, losses = {}, {}, {}, {}, {}
    silent_walls: list[float] = []
    delay_line = [lab.delay_pid] if lab.delay_pid else []
    # The silent run goes first and again last, and the mean of the two is the baseline of every
    # ratio, so that it does not carry one run's noise (two runs here differed by up to 22 %).
    for name, method in [*runs.items(), ("none", runs["none"])]:
        lab_cpu0 = cpu_seconds(delay_line)
        done = run_trainers(lab, f"{model}-{name}", ["--model", model, *method], steps, log_dir)
        lab_cpu = cpu_seconds(delay_line) - lab_cpu0
        wall = max(d["wall_s"] for d in done)
        cpu = sum(d["cpu_s"] for d in done) / len(done)
        progress(f"{model} {name}: {steps} steps in {wall:.2f} s")
        if name == "none":
            silent_walls.append(wall)
            if len(silent_walls) == 2:  # the second silent run: average it in
                wall, cpu, lab_cpu = (wall + walls[name]) / 2, (cpu + cpus[name]) / 2, (lab_cpu + lab_cpus[name]) / 2
        walls[name], cpus[name], lab_cpus[name] = wall, cpu, lab_cpu
        stats[name] = {k: done[0]["stats"].get(k) for k in ("rounds", "bytes_sent", "comm_wait_seconds")}
        losses[name] = round(statistics.mean(d["final_eval_loss"] for d in done), 4)
    return {
        "model": model,
        "steps": steps,
        "step_ms": round(1000 * walls["none"] / steps, 1),
        "link_mbit": 10,
        "H": H,
        "P": P,
        "delay_steps": {"streaming": most, "streaming_tau1": 1},
        "wall_s": {k: round(v, 2) for k, v in walls.items()},
        "silent_runs_s": [round(w, 2) for w in silent_walls],
        "cpu_s_per_peer": {k: round(v, 2) for k, v in cpus.items()},
        "delay_line_cpu_s": {k: round(v, 2) for k, v in lab_cpus.items()},
        "final_eval_loss": losses,
        "stats": stats,
    }


def bench_hivemind(args: argparse.Namespace, log_dir: str, out: dict) -> None:
    """hivemind's all-reduce in a lab like `bench_allreduce`'s: its probe runs worker i inside
    peer i's namespace, listening on the peer's lab address."""
    out["hivemind_ratio_to_link_bound"] = None
    hv = venv_dir()
    if not args.hivemind or args.only_hetero:
        out["hivemind_reason"] = "--no-hivemind" if not args.hivemind else "--only-hetero"
        return
    if not (hv / "bin" / "python").exists() and not args.hivemind_venv_create:
        out["hivemind_reason"] = f"no hivemind venv at {hv} (--hivemind-venv-create makes one: downloads ~1.2 GB)"
        return
    n, mb = args.peers, args.mb
    with WanLab(n, rate_mbit=100, delay_ms=20, congestion=args.congestion) as lab:
        progress(f"hivemind: lab up, {n} peers, 100 Mbit/s, 20 ms one-way")
        spec = Path(log_dir) / "hivemind_lab.json"
        spec.write_text(
            json.dumps({"netns": [lab.netns(x) for x in lab.names], "hosts": [lab.addr(x) for x in lab.names]})
        )
        argv = ["--peers", n, "--mb", int(mb), "--rounds", args.rounds, "--lab", spec, "--timeout", 1500]
        res = run_probe("hivemind_probe_allreduce.py", argv, timeout=1600)
    bound = link_bound(n, int(mb) * 1e6, 100)
    out["hivemind"] = res
    if "hivemind_s" in res:
        out["hivemind_ratio_to_link_bound"] = round(res["hivemind_s"] / bound, 3)
        progress(f"hivemind: {res['hivemind_s']:.2f} s per round, bound {bound:.2f} s")
    else:
        out["hivemind_reason"] = res.get("error", "no result")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=8)
    ap.add_argument("--mb", type=float, default=100.0, help="all-reduce payload per peer, MB of fp32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--congestion",
        default=None,
        help="TCP congestion control in the lab (default: what the machine's namespaces inherit)",
    )
    ap.add_argument("--steps", type=int, default=200, help="inner steps of the training comparison")
    ap.add_argument(
        "--train-models",
        default="medium,small",
        type=lambda v: v.split(","),
        help="models of the overlap comparison, the headline first (tests/proc_trainer.py --model)",
    )
    ap.add_argument("--no-hetero", dest="hetero", action="store_false")
    ap.add_argument("--no-training", dest="training", action="store_false")
    ap.add_argument("--no-allreduce", dest="allreduce", action="store_false")
    ap.add_argument("--no-hivemind", dest="hivemind", action="store_false")
    ap.add_argument("--hivemind-venv-create", action="store_true", help="create hivemind's venv if missing")
    ap.add_argument("--only-hetero", action="store_true", help="of the all-reduce part, only the hetero rounds")
    ap.add_argument("--quick", action="store_true", help="4 peers, 20 MB, 1 round, 60 steps")
    ap.add_argument("--keep-logs", default=None, help="directory for peer logs (default: a temp dir)")
    args = ap.parse_args()
    if args.quick:
        args.peers, args.mb, args.rounds, args.steps = 4, 20.0, 1, 60
    unknown = [m for m in args.train_models if m not in ("small", "medium")]  # P = 4 needs 4 blocks
    if unknown:
        ap.error(f"--train-models: unknown model(s) {', '.join(unknown)}; choose from medium, small")
    if os.geteuid() != 0:
        msg = "bench_wan.py must run as root: the WAN lab needs network namespaces and tc (sudo ...)"
        print(msg, file=sys.stderr)
        print(json.dumps({"error": msg}))
        return 2
    try:
        check_support()
    except LabUnavailable as e:
        print(json.dumps({"error": f"WAN lab unavailable: {e}"}))
        return 2
    cleanup_stale()
    log_dir = args.keep_logs or tempfile.mkdtemp(prefix="bench-wan-")
    os.makedirs(log_dir, exist_ok=True)
    out: dict = {"peers": args.peers, "mb": args.mb, "link_mbit": 100, "one_way_ms": 20, "logs": log_dir}
    t0 = time.monotonic()
    if args.allreduce:
        bench_allreduce(args, log_dir, out)
    bench_hivemind(args, log_dir, out)
    if args.training:
        bench_streaming(args, log_dir, out)
    out["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
