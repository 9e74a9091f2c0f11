"""A swarm with a slower peer: what the spec's `pace` "swarm" (node/pace.py) buys.

Four `meshtrain node start` daemons on loopback train a small GPT for `--rounds` outer rounds of
`--H` steps. Each step's forward pass sleeps (scripts/bench/slowed_model.py — the model's own
sleep standing in for GPU time, so four daemons on two cores run at the speeds they are given, not
at what their CPU share allows): `--step-s` for three peers, twice that for the fourth, the peer
at half speed. Three runs, one after the other:

    homogeneous   all four at full speed, pace "swarm" (nobody is behind: it skips nothing)
    hetero        one at half speed, pace "swarm"
    hetero_steps  one at half speed, pace "steps" (the default: every round waits for it)

Measured, from each node's status page (polled) and result:
- `slow_peer_resyncs`: the slow peer's "out of step with the swarm" re-syncs (target 0);
- `fast_peer_idle_fraction`: the share of the fast peers' training time spent waiting on rounds
  (`round_wait_s` over the time between the first and the last status read while training),
  their mean (target <= 0.10); the same for the other runs beside it — `homogeneous`'s is what the
  rounds themselves cost;
- `loss_vs_homogeneous`: the hetero swarm's final held-out loss over the homogeneous swarm's at
  the same number of samples trained (the swarm's, the slow peer's skipped steps not counted;
  interpolated between the homogeneous run's evaluations), target within 2 %.

Usage: python scripts/bench/bench_hetero.py [--rounds 20] [--H 30] [--step-s 0.1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.harness import Daemon, create_swarm, emit  # noqa: E402

SLOWED = ROOT / "scripts" / "bench" / "slowed_model.py"
PEERS = 4
BATCH = 8


def run_swarm(work: Path, *, rounds: int, H: int, step_s: list[float], pace: str) -> dict:
    """One swarm of len(step_s) daemons (peer i sleeps step_s[i] a step); its measurements."""
    steps = rounds * H
    create_swarm(
        work / "p0",
        "--model", f"py:{SLOWED}:make", "--steps", str(steps), "--H", str(H), "--batch-size", str(BATCH),
        "--eval-every", str(H), "--pace", pace,
    )  # fmt: skip
    env = {"SLOWED_MODEL_PRESET": "small"}
    daemons = [
        Daemon(
            work / "p0",
            work / "p0.log",
            "--wait-peers",
            str(len(step_s)),
            env={**env, "SLOWED_MODEL_SLEEP_S": str(step_s[0])},
        )
    ]
    join = daemons[0].daemon()["addrs"][0]
    for i, s in enumerate(step_s[1:], start=1):
        daemons.append(
            Daemon(
                work / f"p{i}",
                work / f"p{i}.log",
                "--join",
                join,
                "--wait-peers",
                str(len(step_s)),
                env={**env, "SLOWED_MODEL_SLEEP_S": str(s)},
            )
        )
    reads: list[list[tuple[float, int, float]]] = [[] for _ in daemons]  # (time, step, round_wait_s)
    t0 = time.monotonic()
    while any(d.p.poll() is None for d in daemons) and time.monotonic() - t0 < 60 + rounds * H * max(step_s) * 3:
        for i, d in enumerate(daemons):
            st = d.status() if d.p.poll() is None else None
            if st is not None and st["node"]["state"] == "training" and st["training"]["step"] > 0:
                t = st["training"]
                reads[i].append((time.monotonic(), t["step"], float(t.get("round_wait_s", 0.0))))
        time.sleep(0.5)
    results = [d.wait(timeout=60) for d in daemons]
    if any(r is None for r in results):
        raise RuntimeError(f"a node failed; see the logs in {work}")
    idle = []
    for i, r in enumerate(reads):
        if step_s[i] == min(step_s) and len(r) >= 2:
            (ta, _, wa), (tb, _, wb) = r[0], r[-1]
            idle.append((wb - wa) / max(tb - ta, 1e-9))
    slow = max(range(len(step_s)), key=lambda i: step_s[i])
    resyncs = (work / f"p{slow}.log").read_text().count("out of step with the swarm")
    skipped = sum(r["skipped_steps"] for r in results if r is not None)
    history = json.loads((work / "p0" / "history.json").read_text())
    evals = [(h["step"], h["eval_loss"]) for h in history if h.get("eval_loss") is not None]
    return {
        "results": results,
        "fast_idle": sum(idle) / len(idle) if idle else None,
        "slow_resyncs": resyncs,
        "samples": BATCH * (len(step_s) * steps - skipped),
        "skipped_steps": skipped,
        "evals": evals,
        "final_eval": evals[-1][1] if evals else None,
        "wall_s": round(time.monotonic() - t0, 1),
    }


def loss_at_samples(evals: list[tuple[int, float]], samples: float, peers: int) -> float:
    """The homogeneous run's held-out loss at `samples` swarm samples (linear between its evaluations)."""
    step = samples / (peers * BATCH)
    for (s0, l0), (s1, l1) in zip(evals, evals[1:], strict=False):
        if s0 <= step <= s1:
            return l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    return evals[0][1] if step < evals[0][0] else evals[-1][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--H", type=int, default=30)
    ap.add_argument("--step-s", type=float, default=0.1, help="a fast peer's sleep per step (the slow one: twice)")
    args = ap.parse_args()
    fast, slow = args.step_s, 2 * args.step_s
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-hetero-") as tmp:
        for name, speeds, pace in (
            ("homogeneous", [fast] * PEERS, "swarm"),
            ("hetero", [fast] * (PEERS - 1) + [slow], "swarm"),
            ("hetero_steps", [fast] * (PEERS - 1) + [slow], "steps"),
        ):
            work = Path(tmp) / name
            work.mkdir()
            out[name] = run_swarm(work, rounds=args.rounds, H=args.H, step_s=speeds, pace=pace)
            print(name, {k: v for k, v in out[name].items() if k not in ("results", "evals")}, flush=True)
    homo, het = out["homogeneous"], out["hetero"]
    ref = loss_at_samples(homo["evals"], het["samples"], PEERS) if homo["evals"] else None
    ratio = het["final_eval"] / ref if ref and het["final_eval"] is not None else None
    emit(
        {
            "rounds": args.rounds,
            "H": args.H,
            "step_s": {"fast": fast, "slow": slow},
            "slow_peer_resyncs": het["slow_resyncs"],
            "fast_peer_idle_fraction": round(het["fast_idle"], 4) if het["fast_idle"] is not None else None,
            "fast_peer_idle_fraction_homogeneous": round(homo["fast_idle"], 4)
            if homo["fast_idle"] is not None
            else None,
            "fast_peer_idle_fraction_pace_steps": (
                round(out["hetero_steps"]["fast_idle"], 4) if out["hetero_steps"]["fast_idle"] is not None else None
            ),
            "slow_peer_skipped_steps": het["skipped_steps"],
            "loss_vs_homogeneous": round(ratio, 4) if ratio is not None else None,
            "hetero_eval_loss": het["final_eval"],
            "homogeneous_eval_loss_at_equal_samples": round(ref, 4) if ref is not None else None,
            "samples": {"hetero": het["samples"], "homogeneous": homo["samples"]},
            "slow_peer_resyncs_pace_steps": out["hetero_steps"]["slow_resyncs"],
            "wall_s": {k: v["wall_s"] for k, v in out.items()},
            "targets": {"slow_peer_resyncs": 0, "fast_peer_idle_fraction": 0.10, "loss_vs_homogeneous": 0.02},
            "targets_met": (
                het["slow_resyncs"] == 0
                and het["fast_idle"] is not None
                and het["fast_idle"] <= 0.10
                and ratio is not None
                and abs(ratio - 1) <= 0.02
            ),
        }
    )


if __name__ == "__main__":
    main()
