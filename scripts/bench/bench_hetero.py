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

A single pair of runs was a noisy comparison (three read 0.967 to 1.007), mostly because of the
data: a peer's batches follow from (swarm seed, peer id, step), and every run made new peer ids.
`--repeats N` runs the homogeneous and hetero swarms N times, pair k with the swarm seed k and the
homogeneous run's four identity keys in the hetero run — the same θ0, peer ids and batches at
every step, so a pair differs only in the slow peer's speed — and judges the targets on the pairs'
means; `pairs` holds each pair's figures. `hetero_steps` runs once: it only shows what the
default pace costs.

Usage: python scripts/bench/bench_hetero.py [--rounds 20] [--H 30] [--step-s 0.1] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from meshtrain.transport.identity import KEY_FILE_NAME  # noqa: E402
from scripts.bench.harness import Daemon, create_swarm, emit  # noqa: E402

SLOWED = ROOT / "scripts" / "bench" / "slowed_model.py"
PEERS = 4
BATCH = 8


def run_swarm(
    work: Path, *, rounds: int, H: int, step_s: list[float], pace: str, seed: int = 0, keys_from: Path | None = None
) -> dict:
    """One swarm of len(step_s) daemons (peer i sleeps step_s[i] a step); its measurements. With
    `keys_from`, peer i takes the identity key of that run's peer i (its peer id, so its data)."""
    steps = rounds * H
    if keys_from is not None:
        for i in range(len(step_s)):
            (work / f"p{i}").mkdir(mode=0o700)
            shutil.copy2(keys_from / f"p{i}" / KEY_FILE_NAME, work / f"p{i}" / KEY_FILE_NAME)
    create_swarm(
        work / "p0",
        "--model", f"py:{SLOWED}:make", "--steps", str(steps), "--H", str(H), "--batch-size", str(BATCH),
        "--eval-every", str(H), "--pace", pace, "--seed", str(seed),
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
    ap.add_argument("--repeats", type=int, default=1, help="pairs of homogeneous and hetero runs (seeds 0..N-1)")
    args = ap.parse_args()
    fast, slow = args.step_s, 2 * args.step_s
    runs: dict[str, dict] = {}
    pairs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-hetero-") as tmp:
        plan = [(f"{name}_{k}", name, speeds, pace, k) for k in range(args.repeats) for name, speeds, pace in (
            ("homogeneous", [fast] * PEERS, "swarm"),
            ("hetero", [fast] * (PEERS - 1) + [slow], "swarm"),
        )] + [("hetero_steps", "hetero_steps", [fast] * (PEERS - 1) + [slow], "steps", 0)]  # fmt: skip
        for label, name, speeds, pace, seed in plan:
            work = Path(tmp) / label
            work.mkdir()
            keys = Path(tmp) / f"homogeneous_{seed}" if name != "homogeneous" else None
            runs[label] = run_swarm(
                work, rounds=args.rounds, H=args.H, step_s=speeds, pace=pace, seed=seed, keys_from=keys
            )
            print(label, {k: v for k, v in runs[label].items() if k not in ("results", "evals")}, flush=True)
    for k in range(args.repeats):
        homo, het = runs[f"homogeneous_{k}"], runs[f"hetero_{k}"]
        ref = loss_at_samples(homo["evals"], het["samples"], PEERS) if homo["evals"] else None
        ratio = het["final_eval"] / ref if ref and het["final_eval"] is not None else None
        pairs.append(
            {
                "seed": k,
                "loss_vs_homogeneous": round(ratio, 4) if ratio is not None else None,
                "hetero_eval_loss": het["final_eval"],
                "homogeneous_eval_loss_at_equal_samples": round(ref, 4) if ref is not None else None,
                "fast_peer_idle_fraction": het["fast_idle"],
                "fast_peer_idle_fraction_homogeneous": homo["fast_idle"],
                "slow_peer_resyncs": het["slow_resyncs"],
                "slow_peer_skipped_steps": het["skipped_steps"],
                "samples": {"hetero": het["samples"], "homogeneous": homo["samples"]},
                "wall_s": {"homogeneous": homo["wall_s"], "hetero": het["wall_s"]},
            }
        )
    ratios = [p["loss_vs_homogeneous"] for p in pairs if p["loss_vs_homogeneous"] is not None]
    idles = [p["fast_peer_idle_fraction"] for p in pairs if p["fast_peer_idle_fraction"] is not None]
    idles_homo = [
        p["fast_peer_idle_fraction_homogeneous"] for p in pairs if p["fast_peer_idle_fraction_homogeneous"] is not None
    ]
    resyncs = sum(p["slow_peer_resyncs"] for p in pairs)
    ratio = mean(ratios) if len(ratios) == len(pairs) else None
    idle = mean(idles) if len(idles) == len(pairs) else None
    steps_idle = runs["hetero_steps"]["fast_idle"]
    for p in pairs:
        for key in ("fast_peer_idle_fraction", "fast_peer_idle_fraction_homogeneous"):
            p[key] = round(p[key], 4) if p[key] is not None else None
    emit(
        {
            "rounds": args.rounds,
            "H": args.H,
            "step_s": {"fast": fast, "slow": slow},
            "repeats": args.repeats,
            "pairs": pairs,
            "slow_peer_resyncs": resyncs,
            "fast_peer_idle_fraction": round(idle, 4) if idle is not None else None,
            "fast_peer_idle_fraction_homogeneous": round(mean(idles_homo), 4) if idles_homo else None,
            "fast_peer_idle_fraction_pace_steps": round(steps_idle, 4) if steps_idle is not None else None,
            "slow_peer_skipped_steps": round(mean([p["slow_peer_skipped_steps"] for p in pairs]), 1),
            "loss_vs_homogeneous": round(ratio, 4) if ratio is not None else None,
            "loss_vs_homogeneous_range": [min(ratios), max(ratios)] if ratios else None,
            "slow_peer_resyncs_pace_steps": runs["hetero_steps"]["slow_resyncs"],
            "targets": {"slow_peer_resyncs": 0, "fast_peer_idle_fraction": 0.10, "loss_vs_homogeneous": 0.02},
            "targets_met": (
                resyncs == 0 and idle is not None and idle <= 0.10 and ratio is not None and abs(ratio - 1) <= 0.02
            ),
        }
    )


if __name__ == "__main__":
    main()
