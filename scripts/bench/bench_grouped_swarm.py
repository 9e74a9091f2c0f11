"""A grouped swarm of daemons as users run it: connections per daemon against `--max-peers`.

`--daemons` (12) `meshtrain node start` processes on loopback train one swarm whose spec sets
`group_size` (4), every daemon with the same connection bound (`--max-peers`, 6); once they all
train (started in waves of four on this machine), one more joins late through the first one's
address. Each step's forward pass sleeps
`--step-s` (scripts/bench/slowed_model.py: the model's sleep standing in for GPU time, so a dozen
daemons on two cores run rounds of the length asked for, `--H` steps, not of what their CPU share
allows). For `--minutes` after the joiner trains, every daemon's status page is read about once a
second: its connections (`node.connections`: how many, how many its presence plan wants now, how
many it keeps outside the plan) and the peers of its newest exchanges (`training.round_peers`).

Measured (last-line JSON):
- `connections_max`, `connections_p50`, `connections_p95`: over every read of every daemon;
  `over_bound_fraction`: the share of reads above the bound; `over_bound_s_max`: the longest
  stretch one daemon stayed above it (consecutive reads); `wanted_max`: the largest plan;
  `connections_growth_cap`: the daemons' count minus one (a full mesh), for scale;
  `closes_per_min`: connections a daemon closed over the bound per minute (median over daemons;
  `node.connections.closed`), the churn of connections that something else reopens;
- `groups_ok`: for the newest rounds every daemon lists, each daemon averaged with exactly its
  group of `round_groups` (the trainers, the round, the spec's seed); `rounds_checked`;
- `joiner_rounds`: rounds the late joiner averaged in with partners; `joiner_to_training_s`: from
  its start to its first trained step (its roster round's lead included);
- `state_downloads`: "state downloaded" lines over all logs: the joiners' (one each, counting the
  twelve that joined the first) and the re-syncs of daemons left out of a round;
- `median_round_s`, `wall_s`; `targets_met`: connections_max <= the bound, groups_ok, the joiner
  in rounds;
- with `--log-level DEBUG`, `over_bound_census`: what held the daemons over the bound while
  measured, from presence's census line at every pass over it (node/bound.py): the passes, and
  per pass the mean connections held, wanted by the plan, kept for a peer whose plan keeps us
  (`needs_us`), a syncing member's, graced past partners (`past_partners`), graced connections
  others opened (`others`), and closed at that pass.

Usage: python scripts/bench/bench_grouped_swarm.py [--daemons 12] [--group-size 4] [--max-peers 6]
           [--H 20] [--step-s 0.1] [--minutes 3]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.harness import Daemon, create_swarm, emit, wait_for  # noqa: E402

SLOWED = ROOT / "scripts" / "bench" / "slowed_model.py"
SEED = 7
WAVE = 4  # daemons started at once


CENSUS = re.compile(
    r"^(\S+ \S+),\d+ DEBUG meshtrain\.node\.bound over the bound held=(\d+) wanted=(\d+) "
    r"needs_us=(\d+) syncing=(\d+) graced=(\S*) closing=(\d+)"
)


def over_bound_census(logs: list[str], since: float, until: float) -> dict | None:
    """The daemons' census lines between `since` and `until` (wall clock), summed up (module
    docstring); None where the logs hold none (not DEBUG)."""
    totals: dict[str, float] = dict.fromkeys(
        ("held", "wanted", "needs_us", "syncing", "past_partners", "others", "closing"), 0.0
    )
    passes = 0
    for log in logs:
        for line in log.splitlines():
            m = CENSUS.match(line)
            if m is None:
                continue
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
            if not since <= t <= until:
                continue
            passes += 1
            graced = [g.split(":") for g in m.group(6).split(",") if g]
            for key, value in zip(("held", "wanted", "needs_us", "syncing"), m.groups()[1:5], strict=True):
                totals[key] += int(value)
            totals["past_partners"] += sum(kind == "former" for _, kind, _ in graced)
            totals["others"] += sum(kind == "other" for _, kind, _ in graced)
            totals["closing"] += int(m.group(7))
    if not passes:
        return None
    return {"passes": passes} | {k: round(v / passes, 2) for k, v in totals.items()}


def averaged(st: dict, H: int) -> dict[int, list[str]]:
    """Round (index) -> who took part in that exchange, for a daemon's newest exchanges."""
    return {step // H: peers for step, peers in st["training"]["round_peers"]}


def run(
    work: Path,
    *,
    daemons: int,
    group_size: int,
    max_peers: int,
    H: int,
    step_s: float,
    minutes: float,
    log_level: str = "INFO",
) -> dict:
    from meshtrain.collective.groups import round_groups

    create_swarm(
        work / "n0",
        "--model", f"py:{SLOWED}:make", "--steps", "0", "--H", str(H), "--eval-every", "0",
        "--seed", str(SEED), "--group-size", str(group_size),
    )  # fmt: skip
    env = {"SLOWED_MODEL_SLEEP_S": str(step_s)}
    bound = ("--max-peers", str(max_peers))
    kw = {"env": env, "log_level": log_level}
    t0 = time.monotonic()
    nodes = [Daemon(work / "n0", work / "n0.log", *bound, **kw)]
    join = ("--join", nodes[0].daemon()["addrs"][0])

    def all_train(k: int) -> list[dict] | None:
        sts = [n.status() for n in nodes[:k]]
        return sts if all(s and s["node"]["state"] == "training" and s["training"]["step"] > 0 for s in sts) else None  # type: ignore[return-value]

    # In waves of WAVE, each training before the next starts: a dozen processes importing torch
    # at once on two cores starve each other (and the one donor) past the joins' deadlines.
    for first in range(1, daemons, WAVE):
        wave = range(first, min(first + WAVE, daemons))
        nodes += [Daemon(work / f"n{i}", work / f"n{i}.log", *join, *bound, **kw) for i in wave]
        k = len(nodes)
        wait_for(lambda k=k: all_train(k), 300, f"{k} daemons training")
    start_s = time.monotonic() - t0
    nodes.append(Daemon(work / f"n{daemons}", work / f"n{daemons}.log", *join, *bound, **kw))
    wait_for(lambda: all_train(daemons + 1), 300, "the late joiner training")
    joiner_s = time.monotonic() - t0 - start_s
    ids = [n.daemon()["peer_id"] for n in nodes]
    reads: list[list[dict]] = [[] for _ in nodes]  # per daemon: its connection counts, read by read
    newest: list[dict | None] = [None] * len(nodes)
    measured_from = time.time()
    end = time.monotonic() + minutes * 60
    while time.monotonic() < end:
        for i, n in enumerate(nodes):
            st = n.status()
            if st is not None and st["node"]["state"] == "training":
                reads[i].append(dict(st["node"]["connections"], t=time.monotonic(), round=st["training"]["round"]))
                newest[i] = st
        time.sleep(1.0)
    for n in nodes:
        n.interrupt()
    for n in nodes:
        n.wait(timeout=60)

    counts = [r["connections"] for rs in reads for r in rs]
    over_s = 0.0
    for rs in reads:
        since = None
        for r in rs:
            if r["connections"] > max_peers:
                since = r["t"] if since is None else since
                over_s = max(over_s, r["t"] - since)
            else:
                since = None
    sts = [s for s in newest if s is not None]
    rounds = sorted(set.intersection(*(set(averaged(s, H)) for s in sts))) if len(sts) == len(nodes) else []
    groups_ok = bool(rounds)
    for r in rounds:
        groups = round_groups(ids, r, group_size, SEED)
        for peer, s in zip(ids, sts, strict=True):
            groups_ok &= averaged(s, H)[r] == list(groups.groups[groups.index_of(peer)])
    joiner = newest[-1]
    joiner_rounds = sum(len(p) > 1 for p in averaged(joiner, H).values()) if joiner else 0
    per_round = [
        (rs[-1]["t"] - rs[0]["t"]) / (rs[-1]["round"] - rs[0]["round"])
        for rs in reads
        if len(rs) >= 2 and rs[-1]["round"] > rs[0]["round"]
    ]
    measured_until = time.time()
    texts = [(work / f"n{i}.log").read_text(errors="replace") for i in range(len(nodes))]
    logs = "".join(texts)
    result = {
        "daemons": daemons + 1,
        "group_size": group_size,
        "max_peers": max_peers,
        "H": H,
        "step_s": step_s,
        "connections_max": max(counts, default=0),
        "connections_p50": statistics.median(counts) if counts else 0,
        "connections_p95": sorted(counts)[int(0.95 * (len(counts) - 1))] if counts else 0,
        "over_bound_fraction": round(sum(c > max_peers for c in counts) / max(len(counts), 1), 4),
        "over_bound_s_max": round(over_s, 1),
        "wanted_max": max((r["wanted"] for rs in reads for r in rs), default=0),
        "unwanted_max": max((r["unwanted"] for rs in reads for r in rs), default=0),
        # connections closed over the bound per daemon and minute, while measured (the churn)
        "closes_per_min": round(
            statistics.median(
                (rs[-1].get("closed", 0) - rs[0].get("closed", 0)) / max((rs[-1]["t"] - rs[0]["t"]) / 60, 1e-9)
                for rs in reads
                if len(rs) >= 2
            ),
            1,
        )
        if any(len(rs) >= 2 for rs in reads)
        else None,
        "connections_growth_cap": daemons,
        "groups_ok": groups_ok,
        "rounds_checked": rounds,
        "joiner_rounds": joiner_rounds,
        "joiner_to_training_s": round(joiner_s, 1),
        "state_downloads": logs.count("state downloaded"),
        "median_round_s": round(statistics.median(per_round), 2) if per_round else None,
        "reads": len(counts),
        "start_s": round(start_s, 1),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    census = over_bound_census(texts, measured_from, measured_until)
    if census is not None:
        result["over_bound_census"] = census
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--daemons", type=int, default=12, help="daemons before the late joiner")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-peers", type=int, default=6)
    ap.add_argument("--H", type=int, default=20)
    ap.add_argument("--step-s", type=float, default=0.1, help="each training step's sleep (the model's)")
    ap.add_argument("--minutes", type=float, default=3.0, help="how long to read the daemons after the joiner trains")
    ap.add_argument("--log-level", default="INFO", help="the daemons' (DEBUG: presence's closes and dials too)")
    ap.add_argument("--keep", help="a folder to keep the daemons' data and logs in (default: a temporary one)")
    args = ap.parse_args()
    kw = dict(
        daemons=args.daemons,
        group_size=args.group_size,
        max_peers=args.max_peers,
        H=args.H,
        step_s=args.step_s,
        minutes=args.minutes,
        log_level=args.log_level,
    )
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        result = run(Path(args.keep), **kw)  # type: ignore[arg-type]
    else:
        with tempfile.TemporaryDirectory(prefix="bench-grouped-") as tmp:
            result = run(Path(tmp), **kw)  # type: ignore[arg-type]
    result["targets_met"] = {
        "connections_within_bound": result["connections_max"] <= args.max_peers,
        "groups_ok": result["groups_ok"],
        "joiner_in_rounds": result["joiner_rounds"] > 0,
    }
    emit(result)


if __name__ == "__main__":
    main()
