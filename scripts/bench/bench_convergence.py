"""Convergence benchmark: the outer optimizers against single-peer and data-parallel training,
with 4 real peers on loopback.

    python scripts/bench/bench_convergence.py [--quick] [--steps 2000] [--methods a,b] [--seed 0]
        [--png runs/bench_convergence.png]

Every method trains docs/algorithms.md's testbed — the small character GPT (4 blocks, d 64, ctx 32) on
the offline corpus (CPython's `pydoc_data.topics`), inner AdamW lr 2e-3, batch 16 per peer, grad
clip 1.0 — for the same number of inner steps, each peer on its own data (`Corpus.batch(peer=i)`).
Each peer is a separate process (tests/proc_trainer.py) with its own libp2p host, data plane and
`SwarmCollective`; torch runs in a worker thread with one torch thread per process (4 processes
share 2 cores). Methods:

  single       one peer alone (the lower baseline; a quarter of the samples)
  dp           synchronous data parallel: gradients all-reduced every step (the upper baseline)
  diloco_h25   DiLoCo, H=25, Nesterov outer SGD (lr 0.7, momentum 0.9), lossless all-reduce
  diloco_h50   DiLoCo, H=50
  streaming    Streaming DiLoCo, H=50, P=2 strided fragments, τ=1, α=0.5, fp4 outer gradients
  noloco       NoLoCo, H=50, one random partner per round, μ 0.5, β = γ = 0.7
  diloco_hb    NoLoCo's outer rule with the whole swarm: heavy-ball DiLoCo, H=50, lr 0.7, μ 0.5 (the
               identity in docs/algorithms.md; the baseline the NoLoCo paper and the reference run use)
  custom       docs/guide.md's user-written `OuterSGD` (outer SGD without momentum, lr 1), H=25
  sparseloco   SparseLoCo, H=25: chunked top-k (64 of every 4096) of the error-feedback accumulator
               (β 0.9), 2-bit values, 12-bit indices, sparse all-gather, outer SGD lr 1
  streaming_eager  `streaming` with eager updates (arXiv 2502.12996)

Held-out loss is measured on the outer parameters φ of every peer (mean over peers; NoLoCo's
replicas differ, so this is the mean replica) every `--eval-every` steps on fixed held-out
windows. Writes a PNG of held-out loss vs step and prints one JSON object last:
  per method: final_eval_loss, bytes_sent_per_peer, peak_bytes_per_sync, wall_s, samples;
  diloco_recovery      (single − diloco_h25) / (single − dp)                          target >= 0.6
  noloco_vs_diloco     noloco / diloco_h50 − 1   (same H, Nesterov μ 0.9)             target <= 0.01
  noloco_vs_heavyball  noloco / diloco_hb − 1    (same H, same outer rule: pairs vs all-reduce)
  streaming_vs_diloco  streaming / diloco_h50 − 1 (same H)                            target <= 0.005
  diloco_bytes_ratio   dp bytes / diloco_h25 bytes                                    target >= 20
  streaming_peak_ratio diloco_h50 peak bytes per sync / streaming's                   target >= P
  sparseloco_vs_diloco sparseloco / diloco_h25 − 1 (same H)                           target <= 0.01
  sparseloco_bytes_ratio diloco_h25 bytes sent per peer / sparseloco's                target >= 50
  streaming_eager_vs_streaming streaming_eager / streaming − 1                        (reported)
The PNG has two panels: held-out loss against inner steps, and against bytes sent per peer.
The default is 2000 steps (the target asks for >= 1000): at 1000 steps DP's lead over DiLoCo has
not closed yet on this testbed (docs/algorithms.md: 13% of DP's gain kept at 500 steps, 64% at 1000),
and the whole run takes ~20 minutes on 2 cores.
`--cosine` decays every method's inner lr to a tenth along a cosine (the NoLoCo reference trains
with a schedule): with it NoLoCo matches heavy-ball DiLoCo, while at a constant lr it drifts ~2.5%
behind late in the run (docs/benchmarks.md).
`--quick` (CI): 150 steps, fewer eval batches — checks the machinery, not the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from meshtrain.node.status.plot import plot_curves

ROOT = Path(__file__).resolve().parents[2]
TRAINER = "tests/proc_trainer.py"


def methods(steps: int) -> dict[str, tuple[int, list[str]]]:
    """name -> (peers, proc_trainer arguments)."""
    return {
        "single": (1, ["--method", "single"]),
        "dp": (4, ["--method", "dp"]),
        "diloco_h25": (4, ["--method", "diloco", "--H", "25"]),
        "diloco_h50": (4, ["--method", "diloco", "--H", "50"]),
        "streaming": (
            4,
            ["--method", "streaming", "--H", "50", "--P", "2", "--delay", "1", "--alpha", "0.5", "--codec", "fp4"],
        ),
        "noloco": (4, ["--method", "noloco", "--H", "50"]),
        "diloco_hb": (4, ["--method", "heavyball", "--H", "50", "--outer-momentum", "0.5"]),
        "custom": (4, ["--method", "custom", "--H", "25", "--custom-lr", "1.0"]),
        "sparseloco": (
            4,
            [
                "--method",
                "sparseloco",
                "--H",
                "25",
                "--outer-lr",
                "1.0",
                "--error-decay",
                "0.9",
                "--sparse-chunk",
                "4096",
                "--sparse-k",
                "64",
            ],
        ),
        "streaming_eager": (
            4,
            [
                "--method",
                "streaming",
                "--H",
                "50",
                "--P",
                "2",
                "--delay",
                "1",
                "--alpha",
                "0.5",
                "--codec",
                "fp4",
                "--eager",
            ],
        ),
    }


def run_method(name: str, n: int, extra: list[str], common: list[str], timeout: float) -> dict:
    logs = []
    phi_files = []
    procs = []
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for i in range(n):
        fd, log = tempfile.mkstemp(prefix=f"conv-{name}-{i}-", suffix=".log")
        os.close(fd)
        fd, phi = tempfile.mkstemp(prefix=f"conv-{name}-{i}-", suffix=".pt")
        os.close(fd)
        logs.append(log)
        phi_files.append(phi)
        with open(log, "w") as err:  # the child keeps its own copy of the descriptor
            procs.append(
                subprocess.Popen(
                    [sys.executable, TRAINER, "--index", str(i), *common, *extra, "--save-phi", phi],
                    cwd=ROOT,
                    env=env,
                    text=True,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                )
            )
    try:
        hello = [json.loads(p.stdout.readline()) for p in procs]
        addrs = json.dumps([h["addr"] for h in hello])
        for p in procs:
            p.stdin.write(addrs + "\n")
            p.stdin.flush()
        for p in procs:
            if not json.loads(p.stdout.readline()).get("ready"):
                raise RuntimeError(f"{name}: a peer did not get ready")
        t0 = time.monotonic()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        curves: list[dict[int, float]] = [{} for _ in procs]
        sent: list[dict[int, float]] = [{} for _ in procs]
        finals: list[dict] = []
        for i, p in enumerate(procs):
            while True:
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError(f"{name}: peer {i} exited early; see {logs[i]}")
                msg = json.loads(line)
                if "eval" in msg:
                    curves[i][msg["eval"]] = msg["loss"]
                    sent[i][msg["eval"]] = msg.get("bytes", 0)
                if msg.get("done"):
                    finals.append(msg)
                    break
                if time.monotonic() - t0 > timeout:
                    raise RuntimeError(f"{name}: timed out")
        steps = sorted(curves[0])
        curve = [(s, sum(c[s] for c in curves) / n) for s in steps]
        total_steps = finals[0]["stats"]["inner_steps"]
        final = sum(f["final_eval_loss"] for f in finals) / n
        curve.append((total_steps, final))
        bytes_curve = [(sum(b[st] for b in sent) / n, loss) for st, loss in curve[:-1]]
        bytes_curve.append((sum(f["stats"]["bytes_sent"] for f in finals) / n, final))
        out = {
            "peers": n,
            "final_eval_loss": final,
            "final_eval_loss_per_peer": [f["final_eval_loss"] for f in finals],
            "bytes_sent_per_peer": sum(f["stats"]["bytes_sent"] for f in finals) / n,
            "peak_bytes_per_sync": max(f["stats"]["peak_bytes_per_sync"] for f in finals),
            "wall_s": max(f["wall_s"] for f in finals),
            "comm_wait_s": max(f["stats"].get("comm_wait_seconds", 0.0) for f in finals),
            "rounds": finals[0]["stats"].get("rounds", 0),
            "curve": curve,
            "bytes_curve": bytes_curve,
        }
        if n > 1:
            out["cross_replica_std"] = cross_replica_std(phi_files)
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for f in phi_files:
            Path(f).unlink(missing_ok=True)


def cross_replica_std(files: list[str]) -> float:
    """Mean over parameters of the std across peers of φ (0 when replicas are identical)."""
    import torch

    states = [torch.load(f) for f in files]
    stds = [torch.stack([s[n].float() for s in states]).std(0, unbiased=False).mean().item() for n in states[0]]
    return sum(stds) / len(stds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI mode: 150 steps, checks the machinery only")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--methods", default="", help="comma-separated subset")
    ap.add_argument("--png", default=str(ROOT / "runs" / "bench_convergence.png"))
    ap.add_argument("--timeout", type=float, default=900.0, help="per method")
    ap.add_argument("--seed", type=int, default=0, help="model initialisation and data order (repeat runs)")
    ap.add_argument(
        "--cosine",
        action="store_true",
        help="inner lr decays to a tenth along a cosine (a testbed variant; the default is constant)",
    )
    args = ap.parse_args()
    steps = args.steps or (150 if args.quick else 2000)
    eval_every = args.eval_every or max(50, steps // 20)
    common = [
        "--steps",
        str(steps),
        "--model",
        "small",
        "--batch",
        "16",
        "--lr",
        "2e-3",
        "--clip",
        "1.0",
        "--eval-every",
        str(eval_every),
        "--eval-batches",
        "8" if args.quick else "24",
        "--threads",
        "1",
        "--join-timeout",
        "60",
        "--part-timeout",
        "30",
        "--linger",
        "2",
        "--seed",
        str(args.seed),
        "--data-seed",
        str(args.seed),
        *(["--cosine"] if args.cosine else []),
    ]
    table = methods(steps)
    chosen = [m for m in args.methods.split(",") if m] or list(table)
    results: dict[str, dict] = {}
    t_start = time.monotonic()
    for name in chosen:
        n, extra = table[name]
        t0 = time.monotonic()
        for attempt in range(3):  # a start-up failure (a peer not ready on a loaded machine) is retried
            try:
                r = run_method(name, n, extra, common, args.timeout)
                break
            except (RuntimeError, ValueError) as e:
                if attempt == 2 or "timed out" in str(e):
                    raise
                print(json.dumps({"method": name, "retry": str(e)[:200]}), file=sys.stderr, flush=True)
        r["samples"] = steps * 16 * n
        results[name] = r
        print(
            json.dumps(
                {
                    "method": name,
                    "final_eval_loss": round(r["final_eval_loss"], 4),
                    "bytes_sent_per_peer": r["bytes_sent_per_peer"],
                    "peak_bytes_per_sync": r["peak_bytes_per_sync"],
                    "wall_s": round(r["wall_s"], 1),
                    "elapsed_s": round(time.monotonic() - t0, 1),
                }
            ),
            file=sys.stderr,
            flush=True,
        )
    png = Path(args.png)
    png.parent.mkdir(parents=True, exist_ok=True)
    plot_curves(
        {name: r["curve"] for name, r in results.items()},
        png,
        title=f"held-out loss (outer params), 4 peers, {steps} steps",
        beside={name: r["bytes_curve"] for name, r in results.items()},
    )

    def loss(m: str) -> float | None:
        return results[m]["final_eval_loss"] if m in results else None

    summary: dict = {
        "steps": steps,
        "seed": args.seed,
        "quick": args.quick,
        "png": str(png),
        "inner_lr": "cosine" if args.cosine else "constant",
        "corpus": "pydoc_data.topics, Python " + sys.version.split()[0],
        "total_wall_s": round(time.monotonic() - t_start, 1),
        "methods": {},
    }
    for name, r in results.items():
        summary["methods"][name] = {
            k: (round(v, 4) if isinstance(v, float) else v)
            for k, v in r.items()
            if k not in ("curve", "bytes_curve", "final_eval_loss_per_peer")
        }
    s, d25, d50, dp = loss("single"), loss("diloco_h25"), loss("diloco_h50"), loss("dp")
    if None not in (s, d25, dp) and s != dp:
        summary["diloco_recovery"] = round((s - d25) / (s - dp), 4)
    if None not in (loss("noloco"), d50):
        summary["noloco_vs_diloco"] = round(loss("noloco") / d50 - 1, 4)
    if None not in (loss("noloco"), loss("diloco_hb")):
        summary["noloco_vs_heavyball"] = round(loss("noloco") / loss("diloco_hb") - 1, 4)
    if None not in (loss("streaming"), d50):
        summary["streaming_vs_diloco"] = round(loss("streaming") / d50 - 1, 4)
    if "dp" in results and "diloco_h25" in results and results["diloco_h25"]["bytes_sent_per_peer"]:
        summary["diloco_bytes_ratio"] = round(
            results["dp"]["bytes_sent_per_peer"] / results["diloco_h25"]["bytes_sent_per_peer"], 2
        )
    if "streaming" in results and "diloco_h50" in results and results["streaming"]["peak_bytes_per_sync"]:
        summary["streaming_peak_ratio"] = round(
            results["diloco_h50"]["peak_bytes_per_sync"] / results["streaming"]["peak_bytes_per_sync"], 2
        )
    if None not in (loss("sparseloco"), d25):
        summary["sparseloco_vs_diloco"] = round(loss("sparseloco") / d25 - 1, 4)
    if "sparseloco" in results and "diloco_h25" in results and results["sparseloco"]["bytes_sent_per_peer"]:
        summary["sparseloco_bytes_ratio"] = round(
            results["diloco_h25"]["bytes_sent_per_peer"] / results["sparseloco"]["bytes_sent_per_peer"], 2
        )
    if None not in (loss("streaming_eager"), loss("streaming")):
        summary["streaming_eager_vs_streaming"] = round(loss("streaming_eager") / loss("streaming") - 1, 4)
    targets = {
        "diloco_recovery": (">=", 0.6),
        "noloco_vs_diloco": ("<=", 0.01),
        "streaming_vs_diloco": ("<=", 0.005),
        "diloco_bytes_ratio": (">=", 20),
        "streaming_peak_ratio": (">=", 2),
        "sparseloco_vs_diloco": ("<=", 0.01),
        "sparseloco_bytes_ratio": (">=", 50),
    }
    summary["targets_met"] = {
        k: (summary[k] >= v if op == ">=" else summary[k] <= v) for k, (op, v) in targets.items() if k in summary
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
