"""Pipeline swarms through the daemon: `meshtrain node start` processes on throttled links.

    python scripts/bench/bench_pipeline_swarm.py [--steps N] [--quick] [--activation-codec none|bf16|int8] [--kill-only]
        [--codec-only bf16|int8] [--loss-only] [--daemons 6] [--stages 3] [--model gpt-small|wide|deep]

Sized down from the full setting by default: 10 daemons, 5 stages, 3
regions (`--daemons 10 --stages 5`: gpt-small's 4 blocks, one per block stage). This machine has
2 cores shared with other work, and 10 daemons (each a torch process with its host, DHT and CRDT
membership) measure CPU contention as much as the daemon. So the default is **6 daemons, 3 stages
(gpt-small: stage 0 = embedding + head, two blocks per block stage), 3 regions**. The JSON says
which (`daemons`, `stages`, `regions`).

Throttling is bench_skippipe.py's, in user space (there is no netem here), given to every daemon
through `NodeConfig.pipeline_lab` (node/stages/lab.py): peer i sits in region i % 3; links within
a region 5 ms + 20 MB/s, across regions 40 ms + 2 MB/s; each pipeline hop first waits latency +
bytes / bandwidth, and the replica sync waits for its bytes over the slowest link to a replica.
Compute is padded to the cost model (daemons 0 and 1 forward 30 ms, the others 80 ms, daemon 5
2.5x slower); placement and the scheduler see these speeds. SkipPipe with skip ratio 0.5, 8
microbatches of 8 sequences per iteration.

Runs (each with fresh data dirs, the same swarm spec but for `replica_sync`):
1. every-step: N iterations, per-iteration gradient all-reduce among each stage's replicas;
2. diloco: N iterations, DiLoCo among each stage's replicas every H = 20;
2b. equal wall: the slower of runs 1 and 2 again, for only the steps it had made when the faster
   one ended (a DiLoCo run cut at a round's end), so that both assembled models can be evaluated
   at equal wall time. The inner learning rate is constant, so the short run is the long one's
   prefix, up to run-to-run noise (placement follows join order);
3. library: the same placement (as the daemons agreed it in run 1), speeds, links, model and
   microbatches on `tests/proc_pipeline_peer.py` processes — bench_skippipe.py's runtime without
   the daemon — for N iterations;
4. kill: an every-step swarm; at step 8 a stage-0 origin and a stage-1 peer are SIGKILLed (mid-
   iteration: iterations take most of the time); later the remaining stage-1 peer too, so stage 1
   loses its last replica and placement moves a peer there.

The model (`--model`). gpt-small by default. Its block stages hold ~0.2 MB of parameters, about
3x one microbatch's activations, so the every-step replica sync is a small part of an iteration
here, and DiLoCo's replicas save little wall time. A pipeline of a real LLM is the other way
round: a 1B model's 4-layer stage is ~800 MB of parameters against ~30 MB of activations per
microbatch, and its every-step sync over a WAN link takes many times an iteration's compute.
`wide` and `deep` are LLaMAs (`hf-config:`, d 128, 8 and 16 layers) whose block stages are 12x
and 24x a microbatch's activations, with the same links, microbatches and padded compute. The
library run (run 3) builds the built-in GPT only, so with another model it is left out
(`daemon_vs_library_iter_s` null). `--loss-only` runs 1 and 2 alone.

`--codec-only CODEC` runs run 1 twice instead, activation codec none and then CODEC, side by side,
and reports `activation_codec_iter_s_ratio` (CODEC's median iteration time over none's),
`activation_codec_hop_bytes_ratio` (pipeline hop bytes crossing regions per iteration) and
`activation_codec_loss_gap` (held-out loss after the same steps, CODEC / none - 1).

Reported (last stdout line, one JSON object):
- `daemon_vs_library_iter_s`: median seconds between two iterations, daemon (run 1) / library (run
  3); `daemon_iter_s`, `library_iter_s`.
- `diloco_replicas_bytes_ratio`: replica-sync bytes crossing regions per iteration, every-step /
  diloco; `cross_region_bytes_per_iter` (hops + sync) of both runs, and the ratio of those totals.
- `diloco_replicas_loss_gap_equal_steps`: held-out loss of the model assembled from the stages'
  final checkpoints (after N steps, N a multiple of H), diloco / every-step − 1.
  `diloco_replicas_loss_gap_equal_wall_train`: the *training* loss (mean of 5 iterations) at the
  wall time the faster run ended, diloco / every-step − 1 — a pipeline swarm has no peer with
  the whole model to evaluate mid-run, so equal wall time is judged on the training loss;
  `steps_at_equal_wall`: how far each run got by then.
  `diloco_replicas_loss_gap_equal_wall`: the target's measure, held-out loss at equal wall time
  (run 2b against the faster run), diloco / every-step − 1; `eval_loss_equal_wall`,
  `equal_wall_steps`.
- `kill_recovery_s`: from the SIGKILL to the next completed iteration on a survivor;
  `kill_new_epoch_s`: to the first iteration completed by the re-placed swarm (two steps later).
- `refill_ok`: after stage 1's last replica died, a survivor holds stage 1 and the swarm trained
  on to the spec's last step; `refill_s`: from that kill to the first step after the refill;
  `refill_from`: the mover's `joined_from` (`from_backup`: the state came from a stage backup,
  `step`: its step; `initial_weights`: nobody held the stage, it restarted from θ0), beside
  `refill_killed_at_step`.
Progress goes to stderr; logs of every daemon in the temporary directory (kept with --keep).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.bench_skippipe import FAR, NEAR, SLOW_FACTOR, Peers  # noqa: E402

N_DAEMONS, N_STAGES, N_REGIONS = 6, 3, 3
ORIGIN_FORWARD, BLOCK_FORWARD = 0.03, 0.08  # bench_skippipe's ENDS_FORWARD, BASE_FORWARD
SKIP_RATIO, MICROBATCHES, MICROBATCH_SIZE, INNER_LR, H = 0.5, 8, 8, 3e-3, 20
STARTUP_TIMEOUT = 90.0
RUN_DEADLINE = 400.0


@dataclass(frozen=True)
class BenchModel:
    """The model every run trains (`--model`): its spec value and how many blocks it has."""

    name: str
    blocks: int
    hf_config: dict[str, Any] | None = None  # written beside the runs, trained as hf-config:<file>

    def spec(self, root: Path) -> str:
        if self.hf_config is None:
            return self.name
        path = root / f"{self.name}.json"
        path.write_text(json.dumps(self.hf_config))
        return f"hf-config:{path}"


LLAMA_D128 = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}
MODELS = {
    # docs/algorithms.md's reference model: a stage holds ~0.2 MB of parameters and a microbatch's
    # activations are 65 kB, so the replica sync is a small part of an iteration in this lab
    "gpt-small": BenchModel("gpt-small", 4),
    # Heavier stages: LLaMAs of d 128 (~0.8 MB of fp32 parameters per layer) whose block stages
    # outweigh a microbatch's activations (131 kB) by 12x ("wide", 8 layers: 2 per block stage
    # of 5) or 24x ("deep", 16 layers: 4 per block stage). An LLM pipeline is there or beyond: a
    # 1B model's 4-layer stage holds ~800 MB against ~30 MB of activations a microbatch. Same
    # context (32), microbatches, links and padded compute as gpt-small; a block visit's real CPU
    # is 8x / 16x gpt-small's (one block of d 64), still mostly under the cost model's padding.
    "wide": BenchModel("wide", 8, {**LLAMA_D128, "num_hidden_layers": 8}),
    "deep": BenchModel("deep", 16, {**LLAMA_D128, "num_hidden_layers": 16}),
}
MODEL = MODELS["gpt-small"]


def progress(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def forward_of(i: int) -> float:
    t = ORIGIN_FORWARD if i < 2 else BLOCK_FORWARD
    return t * SLOW_FACTOR if i == N_DAEMONS - 1 else t


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "meshtrain.node.cli", *args]


class Daemons:
    """N `meshtrain node start` processes in `root`, on the lab's links (module docstring)."""

    def __init__(self, root: Path, n: int, identities: Path, spec_args: tuple[str, ...] = ()) -> None:
        from meshtrain.transport.identity import KEY_FILE_NAME, Identity

        self.root, self.n, self.spec_args = root, n, spec_args  # spec_args: extra `swarm create` flags
        self.dirs = [root / f"node{i}" for i in range(n)]
        for i, d in enumerate(self.dirs):  # every run the same peers: the same regions and speeds
            key = identities / f"node{i}" / KEY_FILE_NAME
            Identity.load_or_create(key.parent)
            d.mkdir(parents=True)
            shutil.copy2(key, d / KEY_FILE_NAME)
        self.ids = [Identity.load_or_create(d).peer_id_str for d in self.dirs]  # known before start
        self.region = {p: i % N_REGIONS for i, p in enumerate(self.ids)}
        self.lab = root / "lab.json"
        self.lab.write_text(
            json.dumps(
                {
                    "regions": {p: f"r{r}" for p, r in self.region.items()},
                    "near": list(NEAR),
                    "far": list(FAR),
                    "forward_s": {p: forward_of(i) for i, p in enumerate(self.ids)},
                }
            )
        )
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str | None] = [None] * n
        self.last: list[dict | None] = [None] * n  # the last status each answered
        self.epoch_maps: dict[str, list[list[str]]] = {}  # epoch key -> stage map, as polled

    def create(self, steps: int, replica_sync: str) -> Path:
        r = subprocess.run(
            cli(
                "swarm",
                "create",
                "--data-dir",
                str(self.dirs[0]),
                "--model",
                MODEL.spec(self.root),
                "--pipeline",
                "skippipe",
                "--stages",
                str(N_STAGES),
                "--skip-ratio",
                str(SKIP_RATIO),
                "--microbatches",
                str(MICROBATCHES),
                "--batch-size",
                str(MICROBATCH_SIZE),
                "--inner-lr",
                str(INNER_LR),
                "--replica-sync",
                replica_sync,
                "--H",
                str(H),
                "--steps",
                str(steps),
                "--eval-every",
                "0",
                *self.spec_args,
            ),
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if r.returncode:
            raise RuntimeError(f"swarm create failed: {r.stderr.strip()[-500:]}")
        return self.dirs[0] / "swarm.json"

    def start(self, swarm: Path) -> None:
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            MESHTRAIN_PIPELINE_LAB=str(self.lab),
            MESHTRAIN_KEEP_CHECKPOINTS="2",
        )
        for i in range(self.n):
            where = ["--swarm", str(swarm)] if i == 0 else ["--join", self._addr0()]
            with open(self.root / f"node{i}.log", "w") as err:
                self.procs.append(
                    subprocess.Popen(
                        cli(
                            "node",
                            "start",
                            "--data-dir",
                            str(self.dirs[i]),
                            "--listen",
                            "/ip4/127.0.0.1/tcp/0",
                            "--status-port",
                            "0",
                            "--threads",
                            "1",
                            "--wait-peers",
                            str(self.n),
                            "--checkpoint-every",
                            "600",
                            *where,
                        ),
                        cwd=ROOT,
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                        env=env,
                        start_new_session=True,
                    )
                )
            if i == 0:
                self._wait_daemon(0)
        for i in range(1, self.n):
            self._wait_daemon(i)

    def _daemon_file(self, i: int) -> dict | None:
        try:
            return json.loads((self.dirs[i] / "daemon.json").read_text())
        except (OSError, ValueError):
            return None

    def _addr0(self) -> str:
        info = self._daemon_file(0)
        assert info is not None  # waited for
        return info["addrs"][0]

    def _wait_daemon(self, i: int) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.procs[i].poll() is not None:
                raise RuntimeError(f"node{i} exited at start-up; see {self.root / f'node{i}.log'}")
            info = self._daemon_file(i)
            if info is not None:
                self.urls[i] = info["status_url"]
                return
            time.sleep(0.1)
        raise RuntimeError(f"node{i} did not start within {STARTUP_TIMEOUT:.0f} s")

    def poll(self) -> list[dict | None]:
        from meshtrain.errors import MeshtrainError
        from meshtrain.node.status.client import fetch_status

        out: list[dict | None] = []
        for i, (url, p) in enumerate(zip(self.urls, self.procs, strict=True)):
            st = None
            if url is not None and p.poll() is None:
                with contextlib.suppress(MeshtrainError, OSError):
                    st = fetch_status(url, timeout=2)
            if st is not None:
                self.last[i] = st
                pipe = st.get("pipeline") or {}
                if pipe.get("epoch") and pipe.get("stage_map"):  # a running epoch's placement
                    self.epoch_maps[pipe["epoch"]] = pipe["stage_map"]
            out.append(st)
        return out

    def stage_of(self, i: int) -> int | None:
        st = self.last[i]
        return (st.get("pipeline") or {}).get("stage") if st else None

    def step_of(self, i: int) -> int:
        st = self.last[i]
        return (st["training"]["step"] or 0) if st else 0

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait()

    def wait(self, deadline: float = RUN_DEADLINE) -> None:
        end = time.monotonic() + deadline
        while any(p.poll() is None for p in self.procs):
            if time.monotonic() > end:
                raise RuntimeError(f"the daemons did not finish within {deadline:.0f} s; see {self.root}")
            self.poll()
            time.sleep(0.5)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def history(self, i: int) -> list[dict]:
        try:
            return json.loads((self.dirs[i] / "history.json").read_text())
        except (OSError, ValueError):
            return []

    def placement(self) -> dict[str, int]:
        """Peer -> stage of the fullest epoch the daemons reported running (a daemon between
        epochs or done reports only the members still announcing, so the last status will not do)."""
        if not self.epoch_maps:
            raise RuntimeError("no daemon reported a running epoch")
        best = max(self.epoch_maps.values(), key=lambda m: sum(len(peers) for peers in m))
        return {p: s for s, peers in enumerate(best) for p in peers}


def iteration_gaps(times: list[float], skip: int = 2) -> float:
    """Median seconds between consecutive iterations (the first `skip` left out: warm-up)."""
    gaps = [b - a for a, b in zip(times[skip:], times[skip + 1 :], strict=False)]
    return statistics.median(gaps)


def cross_region_bytes(d: Daemons, key: str) -> float:
    """Bytes per iteration that crossed regions, summed over the daemons (their last status)."""
    total = 0.0
    for i, st in enumerate(d.last):
        if not st:
            continue
        step = st["training"]["step"] or 1
        sent = (st.get("pipeline") or {}).get("traffic", {}).get(key, {})
        me = d.ids[i]
        total += sum(n for p, n in sent.items() if d.region.get(p, d.region[me]) != d.region[me]) / step
    return total


def assembled_eval_loss(d: Daemons) -> float:
    """Held-out loss of the model assembled from every stage's latest checkpoint (one replica each;
    φ when the replicas sync by DiLoCo), as `meshtrain export` assembles it."""
    import torch

    from meshtrain.models.sources import loss_of, resolve_context
    from meshtrain.node.spec.signed import SignedSpec
    from meshtrain.node.stages.export import assemble, stage_weights
    from meshtrain.node.state.checkpoint import CheckpointStore
    from meshtrain.node.trainer import load_data

    signed = SignedSpec.load(d.dirs[0] / "swarm.json")
    weights: dict[int, dict[str, torch.Tensor]] = {}
    for i in range(d.n):
        ck = CheckpointStore(d.dirs[i] / "checkpoints", readonly=True).load_latest()
        if ck is not None:
            stage = ck.state["pipeline"]["stage"]
            weights.setdefault(stage, stage_weights(ck.state, stage))
    model, _ = assemble(signed, weights)
    corpus = load_data(signed.spec, d.dirs[0])
    context = resolve_context(model, signed.spec.model.context, signed.spec.model.source)
    with torch.no_grad():
        losses = [model(x, y) for x, y in corpus.eval_batches(8, 16, context)]
    return float(torch.stack([loss_of(out) for out in losses]).mean())


def daemon_run(root: Path, replica_sync: str, steps: int, spec_args: tuple[str, ...] = ()) -> dict[str, Any]:
    root.mkdir(parents=True)
    d = Daemons(root, N_DAEMONS, root.parent / "identities", spec_args)
    progress(f"run {replica_sync}: {N_DAEMONS} daemons, {steps} steps (logs in {root})")
    t0 = time.monotonic()
    try:
        d.start(d.create(steps, replica_sync))
        d.wait(max(RUN_DEADLINE, 6.0 * steps))
    finally:
        d.close()
    histories = [d.history(i) for i in range(d.n)]
    h0 = max(histories, key=len)
    times = [x["t"] for x in h0]
    out = {
        "iter_s": iteration_gaps(times),
        "wall_s": times[-1] - times[0],
        "t": times,
        "loss": [x["loss"] for x in h0],
        "steps": len(h0),
        "placement": d.placement(),
        "ids": d.ids,
        "sync_cross": cross_region_bytes(d, "sync_bytes_to"),
        "hop_cross": cross_region_bytes(d, "hop_bytes_to"),
        "eval_loss": assembled_eval_loss(d),
        "total_s": time.monotonic() - t0,
    }
    progress(
        f"  {replica_sync}: iter {out['iter_s']:.2f}s, eval {out['eval_loss']:.3f}, "
        f"sync {out['sync_cross'] / 1e3:.0f} kB/it, hops {out['hop_cross'] / 1e3:.0f} kB/it across regions"
    )
    return out


def library_run(root: Path, every: dict[str, Any], steps: int) -> float:
    """bench_skippipe's runtime on the daemons' placement, speeds and links (by daemon index)."""
    import itertools

    from meshtrain.models import Corpus, GPTConfig

    root.mkdir(parents=True)
    # The daemons the epoch placed (a daemon still joining when the placement was recorded is
    # left out of it; a library peer outside the placement would exit), by daemon index.
    placed = sorted(i for i, p in enumerate(every["ids"]) if p in every["placement"])
    progress(f"run library: {len(placed)} tests/proc_pipeline_peer.py processes, {steps} steps")
    peers = Peers(len(placed), str(root))
    try:
        daemon = dict(zip(peers.ids, placed, strict=True))  # library peer -> the daemon it stands for
        placement = {q: every["placement"][every["ids"][i]] for q, i in daemon.items()}
        forward = {q: forward_of(i) for q, i in daemon.items()}
        region = {q: i % N_REGIONS for q, i in daemon.items()}
        links = [[a, b, *(NEAR if region[a] == region[b] else FAR)] for a, b in itertools.combinations(peers.ids, 2)]
        config = GPTConfig.small(Corpus.default().vocab_size)
        spec = {
            "run": "library",
            "mode": "skippipe",
            "skip_ratio": SKIP_RATIO,
            "n_stages": N_STAGES,
            "placement": placement,
            "forward_time": forward,
            "links": links,
            "microbatches": MICROBATCHES,
            "microbatch_size": MICROBATCH_SIZE,
            "model": config.to_dict(),
            "seed": 0,
            "data": "corpus",
            "data_seed": 7,
            "lr": INNER_LR,
            "steps": steps,
            "budget_s": None,
            "simulate": True,
            "snapshot_dir": None,
            "kill": None,
        }
        out = peers.run(spec)
    finally:
        peers.close()
    origin = next(q for q in peers.ids if placement[q] == 0)
    times = [x["t"] for x in out[origin] if "it" in x]
    iter_s = iteration_gaps(times)
    progress(f"  library: iter {iter_s:.2f}s")
    return iter_s


def kill_run(root: Path, steps: int, spec_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run 4 (module docstring): two SIGKILLs at step 8, the last stage-1 replica later."""
    root.mkdir(parents=True)
    d = Daemons(root, N_DAEMONS, root.parent / "identities", spec_args)
    progress(f"run kill: {N_DAEMONS} daemons, {steps} steps")
    out: dict[str, Any] = {"kill_recovery_s": None, "kill_new_epoch_s": None, "refill_ok": False, "refill_s": None}
    try:
        d.start(d.create(steps, "every-step"))

        def live() -> list[int]:
            return [i for i in range(d.n) if d.procs[i].poll() is None]

        def wait_until(pred, limit: float = 120.0) -> float | None:
            t0 = time.monotonic()
            while time.monotonic() - t0 < limit:
                d.poll()
                if pred():
                    return time.monotonic() - t0
                time.sleep(0.1)
            return None

        if wait_until(lambda: max(d.step_of(i) for i in live()) >= 8) is None:
            raise RuntimeError("the kill run did not reach step 8")
        origin = next(i for i in live() if d.stage_of(i) == 0)
        mid = next(i for i in live() if d.stage_of(i) == 1)
        at = max(d.step_of(i) for i in live())
        progress(f"  step {at}: SIGKILL node{origin} (stage 0) and node{mid} (stage 1)")
        d.kill(origin)
        d.kill(mid)
        out["kill_recovery_s"] = wait_until(lambda: max(d.step_of(i) for i in live()) > at)
        out["kill_new_epoch_s"] = wait_until(lambda: max(d.step_of(i) for i in live()) > at + 2)
        if out["kill_new_epoch_s"] is not None and out["kill_recovery_s"] is not None:
            out["kill_new_epoch_s"] += out["kill_recovery_s"]
        wait_until(lambda: all(d.stage_of(i) is not None for i in live()), 30)
        last = [i for i in live() if d.stage_of(i) == 1]
        before = {i: d.stage_of(i) for i in live()}
        at = max(d.step_of(i) for i in live())
        progress(f"  step {at}: SIGKILL node(s) {last}, stage 1's last replica(s)")
        for i in last:
            d.kill(i)
        movers: list[int] = []

        def refilled() -> bool:
            movers[:] = [i for i in live() if d.stage_of(i) == 1 and before.get(i) != 1]
            return bool(movers) and max(d.step_of(i) for i in movers) > at

        out["refill_s"] = wait_until(refilled)
        took = [((d.last[i] or {}).get("pipeline") or {}).get("joined_from") or {} for i in movers]
        # where the mover's stage state came from (node/stages/state.py): a backup, and its step,
        # against the step the last replica died at; step 0 and initial_weights: nobody held it
        out["refill_from"] = next(
            ({k: t.get(k) for k in ("from_backup", "initial_weights", "step")} for t in took if t.get("stage") == 1),
            None,
        )
        out["refill_killed_at_step"] = at
        d.wait()
        finished = [i for i in range(d.n) if d.procs[i].returncode == 0]
        ends = [h[-1]["step"] for h in (d.history(i) for i in finished) if h]
        out["refill_ok"] = bool(movers) and out["refill_s"] is not None and bool(ends) and min(ends) >= steps
        out["kill_survivors"] = len(finished)
    finally:
        d.close()
    progress(f"  kill: {out}")
    return out


def codec_comparison(tmp: Path, steps: int, codec: str) -> dict[str, Any]:
    """`--codec-only`: the every-step run with activation codec none, then with `codec`, on the
    same identities, links and compute model; does compressing the hops pay on these links?"""
    from meshtrain.pipeline.hop_codec import HopCodec

    HopCodec(codec)  # a bad name fails here, before any daemon starts
    runs = {
        name: daemon_run(tmp / f"codec-{name}", "every-step", steps, ("--activation-codec", name))
        for name in ("none", codec)
    }
    plain, coded = runs["none"], runs[codec]
    return {
        "activation_codec": codec,
        "activation_codec_iter_s_ratio": round(coded["iter_s"] / plain["iter_s"], 4),
        "activation_codec_hop_bytes_ratio": round(coded["hop_cross"] / max(plain["hop_cross"], 1.0), 4),
        "iter_s": {name: round(r["iter_s"], 4) for name, r in runs.items()},
        "cross_region_hop_bytes_per_iter": {name: round(r["hop_cross"]) for name, r in runs.items()},
        "eval_loss_equal_steps": {name: round(r["eval_loss"], 4) for name, r in runs.items()},
        "activation_codec_loss_gap": round(coded["eval_loss"] / plain["eval_loss"] - 1, 4),
    }


def replica_sync_comparison(every: dict[str, Any], diloco: dict[str, Any]) -> dict[str, Any]:
    """Runs 1 and 2 side by side: bytes across regions, and the loss at equal steps and wall time."""
    t_end = min(every["t"][-1] - every["t"][0], diloco["t"][-1] - diloco["t"][0])

    def train_loss_at(run: dict[str, Any], wall: float) -> float:
        n = max(i for i, t in enumerate(run["t"]) if t - run["t"][0] <= wall + 1e-9) + 1
        window = [x for x in run["loss"][max(0, n - 5) : n] if x is not None]
        return sum(window) / len(window)

    def steps_by(run: dict[str, Any], wall: float) -> int:
        return sum(1 for t in run["t"] if t - run["t"][0] <= wall + 1e-9)

    return {
        "daemon_iter_s": round(every["iter_s"], 4),
        "daemon_diloco_iter_s": round(diloco["iter_s"], 4),
        "diloco_replicas_bytes_ratio": round(every["sync_cross"] / max(diloco["sync_cross"], 1.0), 2),
        "cross_region_bytes_per_iter": {
            "every-step": {"sync": round(every["sync_cross"]), "hops": round(every["hop_cross"])},
            "diloco": {"sync": round(diloco["sync_cross"]), "hops": round(diloco["hop_cross"])},
        },
        "cross_region_total_bytes_ratio": round(
            (every["sync_cross"] + every["hop_cross"]) / max(diloco["sync_cross"] + diloco["hop_cross"], 1.0), 3
        ),
        "diloco_replicas_loss_gap_equal_steps": round(diloco["eval_loss"] / every["eval_loss"] - 1, 4),
        "eval_loss_equal_steps": {"every-step": round(every["eval_loss"], 4), "diloco": round(diloco["eval_loss"], 4)},
        "diloco_replicas_loss_gap_equal_wall_train": round(
            train_loss_at(diloco, t_end) / train_loss_at(every, t_end) - 1, 4
        ),
        "equal_wall_s": round(t_end, 1),
        "steps_at_equal_wall": {"every-step": steps_by(every, t_end), "diloco": steps_by(diloco, t_end)},
    }


def equal_wall_eval(
    tmp: Path, runs: dict[str, dict[str, Any]], compared: dict[str, Any], spec_args: tuple[str, ...]
) -> dict[str, Any]:
    """Run 2b: the slower of runs 1 and 2 again, for only the steps it had made when the faster
    one ended, and the held-out loss of both assembled models: eval loss at equal wall time.
    (The inner learning rate is constant, so a shorter run is the longer one's prefix, up to run
    to run noise.) A DiLoCo run is cut at a round's end, where its φ exists."""
    slower = max(runs, key=lambda name: runs[name]["t"][-1] - runs[name]["t"][0])
    faster = next(name for name in runs if name != slower)
    n = compared["steps_at_equal_wall"][slower]
    if slower == "diloco":
        n -= n % H
    if not 0 < n < runs[slower]["steps"]:
        return {"diloco_replicas_loss_gap_equal_wall": None, "equal_wall_steps": {slower: n}}
    again = daemon_run(tmp / f"{slower}-equal-wall", slower, n, spec_args)
    evals = {slower: again["eval_loss"], faster: runs[faster]["eval_loss"]}
    return {
        "diloco_replicas_loss_gap_equal_wall": round(evals["diloco"] / evals["every-step"] - 1, 4),
        "eval_loss_equal_wall": {k: round(v, 4) for k, v in evals.items()},
        "equal_wall_steps": {slower: again["steps"], faster: runs[faster]["steps"]},
    }


def main() -> None:
    global N_DAEMONS, N_STAGES, MODEL  # the run's size and model (module docstring); every run reads them
    from meshtrain.optim.spec_section import OuterSection

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="iterations of runs 1-3 (a multiple of H = 20)")
    ap.add_argument("--quick", action="store_true", help="20 steps, for a smoke test")
    ap.add_argument("--keep", action="store_true", help="keep the logs and data dirs")
    ap.add_argument("--activation-codec", default="none", help="the spec's activation_codec for every daemon run")
    ap.add_argument("--kill-only", action="store_true", help="run 4 alone (its keys only)")
    ap.add_argument("--loss-only", action="store_true", help="runs 1 and 2 alone (bytes and loss keys only)")
    ap.add_argument(
        "--codec-only",
        metavar="CODEC",
        help="run 1 twice, activation_codec none then CODEC, side by side (the codec keys only)",
    )
    ap.add_argument("--daemons", type=int, default=N_DAEMONS, help="daemons (the full size: 10)")
    ap.add_argument("--stages", type=int, default=N_STAGES, help="pipeline stages (the full size: 5)")
    ap.add_argument("--model", choices=sorted(MODELS), default=MODEL.name, help="the model (module docstring)")
    ap.add_argument(
        "--outer-lr", type=float, help="the spec's outer_lr for the DiLoCo replica sync (default: the spec's)"
    )
    ap.add_argument("--outer-momentum", type=float, help="the spec's outer_momentum (default: the spec's)")
    args = ap.parse_args()
    MODEL = MODELS[args.model]
    if not (2 <= args.stages <= MODEL.blocks + 1 and args.daemons >= args.stages + 1):
        ap.error(
            f"--stages must be 2..{MODEL.blocks + 1} ({MODEL.name} has {MODEL.blocks} blocks) "
            "and --daemons at least stages + 1"
        )
    N_DAEMONS, N_STAGES = args.daemons, args.stages
    steps = 20 if args.quick else args.steps
    spec_args: tuple[str, ...] = ("--activation-codec", args.activation_codec)
    for flag, value in (("--outer-lr", args.outer_lr), ("--outer-momentum", args.outer_momentum)):
        if value is not None:
            spec_args += (flag, str(value))
    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="bench_pipeline_swarm-"))
    size = {
        "model": MODEL.name,
        "outer": {  # the DiLoCo replica sync's outer optimizer
            "lr": args.outer_lr if args.outer_lr is not None else OuterSection.model_fields["outer_lr"].default,
            "momentum": args.outer_momentum
            if args.outer_momentum is not None
            else OuterSection.model_fields["outer_momentum"].default,
        },
        "steps": steps,
        "H": H,
        "daemons": N_DAEMONS,
        "stages": N_STAGES,
        "regions": N_REGIONS,
        "sized_down_from": None if (N_DAEMONS, N_STAGES) == (10, 5) else {"daemons": 10, "stages": 5, "regions": 3},
    }
    if args.codec_only:
        try:
            line = codec_comparison(tmp, steps, args.codec_only)
        finally:
            if not args.keep:
                shutil.rmtree(tmp, ignore_errors=True)
        print(json.dumps(line | size | {"wall_s": round(time.monotonic() - t_start, 1)}), flush=True)
        return
    if args.kill_only:
        try:
            kill = kill_run(tmp / "kill", max(steps, 40), spec_args)
        finally:
            if not args.keep:
                shutil.rmtree(tmp, ignore_errors=True)
        line = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in kill.items()}
        line |= {"activation_codec": args.activation_codec, "wall_s": round(time.monotonic() - t_start, 1)}
        print(json.dumps(line | size), flush=True)
        return
    library_iter: float | None = None
    kill: dict[str, Any] = {}
    try:
        every = daemon_run(tmp / "every-step", "every-step", steps, spec_args)
        diloco = daemon_run(tmp / "diloco", "diloco", steps, spec_args)
        compared = replica_sync_comparison(every, diloco)
        compared |= equal_wall_eval(tmp, {"every-step": every, "diloco": diloco}, compared, spec_args)
        if not args.loss_only:
            # the library runtime (tests/proc_pipeline_peer.py) builds the built-in GPT only
            library_iter = library_run(tmp / "library", every, steps) if MODEL.name == "gpt-small" else None
            kill = kill_run(tmp / "kill", max(steps, 40), spec_args)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    out = {
        "daemon_vs_library_iter_s": round(every["iter_s"] / library_iter, 4) if library_iter else None,
        "library_iter_s": round(library_iter, 4) if library_iter else None,
        **compared,
        **{k: (round(v, 2) if isinstance(v, float) else v) for k, v in kill.items()},
        **size,
        "skip_ratio": SKIP_RATIO,
        "microbatches": MICROBATCHES,
        "activation_codec": args.activation_codec,
        "placement_stage_sizes": [sum(1 for s in every["placement"].values() if s == k) for k in range(N_STAGES)],
        "wall_s": round(time.monotonic() - t_start, 1),
        "python": sys.version.split()[0],
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
