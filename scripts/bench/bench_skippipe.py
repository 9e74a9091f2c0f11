"""SkipPipe benchmark: full pipeline vs SkipPipe (skip ratios 0.25 and 0.5) on real peer processes.

    python scripts/bench/bench_skippipe.py [--quick] [--steps N] [--peers P] [--stages S]

Setup: P peers (separate processes, tests/proc_pipeline_peer.py) on loopback, S stages (stage 0 =
embedding + head on 2 origin peers, the rest spread evenly over stages 1..S-1), the char GPT
(one block per block stage, d 64, context 32) on CPython's pydoc topics. Heterogeneity is
simulated in user space, identically for every configuration:
- links: peers sit in 3 "regions"; within a region 5 ms + 20 MB/s, across regions 40 ms + 2 MB/s;
  each send first sleeps latency + bytes / bandwidth (there is no netem here);
- compute: every visit is padded to the cost model's time (block stage forward 80 ms, stage-0
  forward 30 ms; backward 1.5×, head 0.25×), and one replica of every odd stage is 2.5× slower.
The scheduler is given the same link and compute model.

Runs, each with fresh weights (same seed, same data: `Corpus.batch(seed, step, microbatch)`):
1. full pipeline, N steps -> `full_iter_s` (mean iteration time after the first), its wall time T;
2. SkipPipe at 0.25 and at 0.5, each until another iteration would exceed T (equal wall-clock
   budget), with the weights saved at step N (equal steps) and at the end.
Evaluation in this process on the held-out split, with the stages' saved weights assembled into
one GPT: `loss_gap` (SkipPipe / full − 1 at N steps, per ratio), `loss_gap_equal_time` (at the
best ratio, SkipPipe at time T vs full at N steps = time T), and the perplexity with half of the
block stages (mean over every in-order half subset, `pipeline.omission`) over the perplexity with
all — `half_model_ppl_ratio_full` and `_skippipe` (the best ratio's model at equal steps).
`iter_time_reduction` = 1 − skippipe_iter_s / full_iter_s at the best ratio. Progress goes to
stderr; the last stdout line is one JSON object.

    python scripts/bench/bench_skippipe.py --activation-codec int8 [--quick] [--bandwidth-scale X]

Instead: does compressing activations and gradients pay on a throttled link (pipeline/
hop_codec.py)? The full pipeline (every microbatch crosses every hop) runs N steps twice on the
same peers, links and compute model — activation codec "none", then the one named — with
*serial* links (a link's sends share its bandwidth, as on a real throttled link; links scaled by
`--bandwidth-scale`). Reported: `activation_codec_iter_s_ratio` (codec iteration time ÷ none's),
`activation_codec_bytes_ratio` (hop bytes per iteration, codec ÷ none), each run's train loss at
its last step and the held-out loss of its assembled model at N steps (equal steps), and
`codec_ms_per_hop` (encode + decode of one activation in this process, one thread: the CPU the
codec adds to every hop). Defaults: 4 peers, 3 stages (2 origins).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshtrain.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

BASE_FORWARD = 0.08  # seconds: a block stage's forward of one microbatch (simulated)
ENDS_FORWARD = 0.03  # stage 0: embedding (and a quarter of it for the head)
SLOW_FACTOR = 2.5
NEAR, FAR = (0.005, 20e6), (0.04, 2e6)  # (latency s, bytes/s) within / across regions
RUN_DEADLINE = 400.0  # seconds: a run that takes longer than this is a failure


def progress(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


class Peers:
    """The peer processes, driven over stdio (protocol in tests/proc_pipeline_peer.py)."""

    def __init__(self, n: int, logdir: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", MESHTRAIN_LOG=os.environ.get("MESHTRAIN_LOG", "WARNING"))
        # the peers import this checkout's meshtrain, as this process does (not an installed one)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.logs = [open(os.path.join(logdir, f"peer{i}.log"), "w") for i in range(n)]  # noqa: SIM115
        self.procs = [
            subprocess.Popen(
                [sys.executable, "tests/proc_pipeline_peer.py"],
                cwd=ROOT,
                env=env,
                text=True,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
            )
            for log in self.logs
        ]
        hello = [self._read(p) for p in self.procs]
        self.ids = [h["peer"] for h in hello]
        for p in self.procs:
            self._send(p, {"addrs": [h["addr"] for h in hello]})

    @staticmethod
    def _send(p: subprocess.Popen, obj: object) -> None:
        p.stdin.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
        p.stdin.flush()

    @staticmethod
    def _read(p: subprocess.Popen) -> dict:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"a peer exited with {p.wait()} (see its log)")
        return json.loads(line)

    def run(self, spec: dict) -> dict[str, list[dict]]:
        for p in self.procs:
            self._send(p, spec)
        for p in self.procs:
            self._read(p)  # ready
        for p in self.procs:
            self._send(p, "go")
        out: dict[str, list[dict]] = {}

        def collect(pid: str, p: subprocess.Popen) -> None:
            lines = []
            while True:
                x = self._read(p)
                lines.append(x)
                if "it" in x and pid == self.ids[0]:
                    progress(f"  {spec['run']} it {x['it']} loss {x['loss']:.3f} {x['seconds']:.2f}s")
                if "finished" in x:
                    out[pid] = lines
                    return

        threads = [
            threading.Thread(target=collect, args=(pid, p), daemon=True)
            for pid, p in zip(self.ids, self.procs, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=RUN_DEADLINE)
        if len(out) != len(self.procs):
            raise RuntimeError(f"run {spec['run']}: {len(self.procs) - len(out)} peers did not finish")
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    self._send(p, "quit")
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in self.logs:
            f.close()


def layout(ids: list[str], n_stages: int) -> tuple[dict, dict, list]:
    """Placement (2 origins, the rest round-robin over block stages), compute times, links."""
    placement = {p: (0 if i < 2 else 1 + (i - 2) % (n_stages - 1)) for i, p in enumerate(ids)}
    forward = {}
    for i, p in enumerate(ids):
        s = placement[p]
        t = ENDS_FORWARD if s == 0 else BASE_FORWARD
        if s and s % 2 == 1 and i >= 2 + (n_stages - 1):  # the second replica of odd stages
            t *= SLOW_FACTOR
        forward[p] = t
    region = {p: i % 3 for i, p in enumerate(ids)}
    links = [[a, b, *(NEAR if region[a] == region[b] else FAR)] for a, b in itertools.combinations(ids, 2)]
    return placement, forward, links


def assembled_model(config: GPTConfig, snap: Path, step: int) -> GPT:
    """The whole model at `step` from the stage snapshots the peers wrote to `snap` (the first
    replica's file of each stage)."""
    import torch

    from meshtrain.models import GPT
    from meshtrain.pipeline.stages import load_stage_states

    model = GPT(config, seed=0)
    states, seen = [], set()
    for f in sorted(snap.glob(f"stage*_step{step}.pt")):
        stage = int(f.name.split("_")[0][5:])
        if stage not in seen:
            seen.add(stage)
            states.append(torch.load(f))
    load_stage_states(model, states)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 peers, 4 stages, few steps (~1-2 min)")
    ap.add_argument("--peers", type=int)
    ap.add_argument("--stages", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--activation-codec", help="compare this hop codec with none instead (pipeline/hop_codec.py)")
    ap.add_argument("--bandwidth-scale", type=float, default=1.0, help="--activation-codec: multiply link bandwidths")
    args = ap.parse_args()
    if args.activation_codec:
        codec_comparison(args)
        return
    n_peers = args.peers or (8 if args.quick else 10)
    n_stages = args.stages or (4 if args.quick else 5)
    steps = args.steps or (8 if args.quick else 30)

    import torch

    from meshtrain.models import Corpus, GPTConfig
    from meshtrain.pipeline.omission import omission_report

    torch.set_num_threads(1)
    corpus = Corpus.default()
    config = GPTConfig(corpus.vocab_size, n_layer=n_stages - 1, n_head=4, d_model=64, context=32)
    eval_batches = corpus.eval_batches(8, 16, config.context)
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        progress(f"starting {n_peers} peers, {n_stages} stages, {steps} steps (logs in {tmp})")
        peers = Peers(n_peers, tmp)
        try:
            placement, forward, links = layout(peers.ids, n_stages)
            base = {
                "n_stages": n_stages,
                "placement": placement,
                "forward_time": forward,
                "links": links,
                "microbatches": args.microbatches,
                "microbatch_size": 8,
                "model": config.to_dict(),
                "seed": 0,
                "data": "corpus",
                "data_seed": 7,
                "lr": args.lr,
                "simulate": True,
                "snapshot_steps": [steps],
                "kill": None,
            }
            results: dict[str, dict] = {}

            def run(name: str, mode: str, ratio: float, budget: float | None, max_steps: int) -> dict:
                snap = Path(tmp) / name
                snap.mkdir()
                spec = base | {
                    "run": name,
                    "mode": mode,
                    "skip_ratio": ratio,
                    "steps": max_steps,
                    "budget_s": budget,
                    "snapshot_dir": str(snap),
                }
                progress(f"run {name}")
                out = peers.run(spec)
                origin_lines = [x for x in out[peers.ids[0]] if "it" in x]
                iters = origin_lines
                done = out[peers.ids[0]][-1]["iterations"]
                secs = [
                    max(x["seconds"] for pid in peers.ids[:2] for x in out[pid] if x.get("it") == i)
                    for i in range(1, done)
                ]
                return {
                    "iter_s": sum(secs) / len(secs),
                    "wall_s": iters[-1]["t"],
                    "steps": done,
                    "train_loss": iters[-1]["loss"],
                    "snap": snap,
                }

            full = results["full"] = run("full", "full", 0.0, None, steps)
            for ratio in (0.25, 0.5):
                results[str(ratio)] = run(f"skip{ratio}", "skippipe", ratio, full["wall_s"], 4 * steps)
            progress("evaluating")
            full_model = assembled_model(config, full["snap"], steps)
            full_loss = full_model.evaluate(eval_batches)
            full_om = omission_report(full_model, n_stages, eval_batches)
            out: dict[str, object] = {
                "full_iter_s": round(full["iter_s"], 4),
                "skippipe_iter_s": {},
                "loss_gap": {},
                "loss_gap_equal_time_per_ratio": {},
                "half_model_ppl_ratio_skippipe_per_ratio": {},
            }
            best, best_time = None, float("inf")
            for ratio in ("0.25", "0.5"):
                r = results[ratio]
                eq_steps = assembled_model(config, r["snap"], min(steps, r["steps"]))
                eq_time = assembled_model(config, r["snap"], r["steps"])
                out["skippipe_iter_s"][ratio] = round(r["iter_s"], 4)
                out["loss_gap"][ratio] = round(eq_steps.evaluate(eval_batches) / full_loss - 1, 4)
                out["loss_gap_equal_time_per_ratio"][ratio] = round(eq_time.evaluate(eval_batches) / full_loss - 1, 4)
                r["omission"] = omission_report(eq_steps, n_stages, eval_batches)
                out["half_model_ppl_ratio_skippipe_per_ratio"][ratio] = round(r["omission"].ratio, 4)
                if r["iter_s"] < best_time:
                    best, best_time = ratio, r["iter_s"]
            out |= {
                "best_ratio": float(best),
                "iter_time_reduction": round(1 - best_time / full["iter_s"], 4),
                "loss_gap_equal_time": out["loss_gap_equal_time_per_ratio"][best],
                "half_model_ppl_ratio_skippipe": out["half_model_ppl_ratio_skippipe_per_ratio"][best],
                "half_model_ppl_ratio_full": round(full_om.ratio, 4),
                "full_eval_loss": round(full_loss, 4),
                "steps": {"full": steps, **{k: results[k]["steps"] for k in ("0.25", "0.5")}},
                "peers": n_peers,
                "stages": n_stages,
                "microbatches": args.microbatches,
                "quick": args.quick,
                "wall_s": round(time.monotonic() - t_start, 1),
                "python": sys.version.split()[0],
            }
        finally:
            peers.close()
    print(json.dumps(out), flush=True)


def codec_comparison(args: argparse.Namespace) -> None:
    """The `--activation-codec` benchmark (module docstring): full pipeline, codec none vs the one
    named, on the same serial throttled links; the last stdout line is one JSON object."""
    import torch

    from meshtrain.models import Corpus, GPTConfig
    from meshtrain.pipeline.hop_codec import HopCodec

    codec = HopCodec(args.activation_codec)  # a bad name fails here, before any peer starts
    n_peers = args.peers or 4
    n_stages = args.stages or 3
    steps = args.steps or (6 if args.quick else 12)
    torch.set_num_threads(1)
    corpus = Corpus.default()
    config = GPTConfig(corpus.vocab_size, n_layer=n_stages - 1, n_head=4, d_model=64, context=32)
    microbatch_size = 8
    shape = (microbatch_size, config.context, config.d_model)
    eval_batches = corpus.eval_batches(8, 16, config.context)

    x = torch.randn(shape)
    t0 = time.perf_counter()
    for _ in range(50):
        codec.decode(codec.encode(x), shape)
    codec_ms = (time.perf_counter() - t0) / 50 * 1e3

    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        progress(f"starting {n_peers} peers, {n_stages} stages, {steps} steps, none vs {codec.name} (logs in {tmp})")
        peers = Peers(n_peers, tmp)
        try:
            placement, forward, links = layout(peers.ids, n_stages)
            links = [[a, b, lat, bw * args.bandwidth_scale] for a, b, lat, bw in links]
            runs: dict[str, dict] = {}
            for name in ("none", codec.name):
                snap = Path(tmp) / name
                snap.mkdir()
                spec = {
                    "run": f"codec-{name}",
                    "mode": "full",
                    "skip_ratio": 0.0,
                    "n_stages": n_stages,
                    "placement": placement,
                    "forward_time": forward,
                    "links": links,
                    "serial_links": True,
                    "activation_codec": name,
                    "microbatches": args.microbatches,
                    "microbatch_size": microbatch_size,
                    "model": config.to_dict(),
                    "seed": 0,
                    "data": "corpus",
                    "data_seed": 7,
                    "lr": args.lr,
                    "simulate": True,
                    "steps": steps,
                    "budget_s": None,
                    "snapshot_dir": str(snap),
                    "snapshot_steps": [steps],
                    "kill": None,
                }
                progress(f"run {spec['run']}")
                out = peers.run(spec)
                origins = peers.ids[:2]
                secs = [
                    max(x["seconds"] for pid in origins for x in out[pid] if x.get("it") == i) for i in range(1, steps)
                ]
                finished = [lines[-1] for lines in out.values()]
                model = assembled_model(config, snap, steps)
                digests = {pid: lines[-1]["digest"] for pid, lines in out.items()}
                runs[name] = {
                    "iter_s": sum(secs) / len(secs),
                    "hop_bytes_per_iter": sum(f["hop_bytes"] for f in finished) / steps,
                    "train_loss": [x for x in out[origins[0]] if "it" in x][-1]["loss"],
                    "eval_loss": model.evaluate(eval_batches),
                    "replicas_identical": len({digests[p] for p in origins}) == 1,
                }
        finally:
            peers.close()
    none, coded = runs["none"], runs[codec.name]
    result = {
        "activation_codec": codec.name,
        "activation_codec_iter_s_ratio": round(coded["iter_s"] / none["iter_s"], 4),
        "activation_codec_bytes_ratio": round(coded["hop_bytes_per_iter"] / none["hop_bytes_per_iter"], 4),
        "iter_s": {k: round(r["iter_s"], 4) for k, r in runs.items()},
        "hop_bytes_per_iter": {k: round(r["hop_bytes_per_iter"]) for k, r in runs.items()},
        "train_loss_at_equal_steps": {k: round(r["train_loss"], 4) for k, r in runs.items()},
        "eval_loss_at_equal_steps": {k: round(r["eval_loss"], 4) for k, r in runs.items()},
        "eval_loss_gap": round(coded["eval_loss"] / none["eval_loss"] - 1, 4),
        "replicas_identical": all(r["replicas_identical"] for r in runs.values()),
        "codec_ms_per_hop": round(codec_ms, 3),
        "activation_bytes": {k: HopCodec(k).nbytes(shape) for k in runs},
        "links": {"near": [NEAR[0], NEAR[1] * args.bandwidth_scale], "far": [FAR[0], FAR[1] * args.bandwidth_scale]},
        "serial_links": True,
        "mode": "full",
        "steps": steps,
        "peers": n_peers,
        "stages": n_stages,
        "microbatches": args.microbatches,
        "microbatch_size": microbatch_size,
        "quick": args.quick,
        "cpus": os.cpu_count(),
        "wall_s": round(time.monotonic() - t_start, 1),
        "python": sys.version.split()[0],
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
