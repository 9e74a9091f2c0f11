"""Trainer benchmark: what meshtrain's trainer costs over a bare PyTorch loop, what a round costs,
what bf16 costs in loss, and whether a multi-rank peer trains the same model.

    python scripts/bench/bench_trainer.py [--quick] [--skip-multi-rank]

One JSON object on the last line:

- `trainer_overhead`: samples/s of a bare PyTorch loop (same model, batch, data, clipping, inner
  optimizer and torch thread count) over samples/s of meshtrain's trainer inside a real `Node` — a
  1-peer swarm on loopback, with its host, swarm state, status server and checkpoints — with no
  round due (H beyond the run). Target <= 1.03. Trials alternate bare / node, and the median of
  the trials' paired ratios (bare run, then node run right after) counts: on a shared machine the
  load drifts between trials, less between the two halves of one. `trainer_overhead_cpu` is the
  same ratio in process CPU time per sample (all threads: the node's network, status server and
  CRDT included): far steadier than wall time on a loaded machine, and an upper bound on the
  wall-time overhead where cores are spare.
  `node_background_cpu_share`: in the node run, CPU time of every thread but the trainer's (trio:
  libp2p, CRDT gossip, heartbeats; the status server; this script's 100 ms poll) over the trainer
  thread's, during the timed steps (Linux /proc; median over trials): what the node costs beside
  the loop. `trainer_thread_overhead_cpu`: the trainer thread's CPU time per sample over the bare
  loop's (its thread's): what meshtrain adds to the step itself (median over trials).
  `load_avg` is the 1-minute load average before and after, to read the numbers by.
- `round_overhead`: wall time of H steps that include one DiLoCo round (1-peer swarm on loopback:
  Δ, the collective's round of one, the outer step, the merge, publishing the state for joiners)
  over the same H steps of the no-round run. Reported; no target.
- `bf16_vs_fp32_loss`: |eval loss (bf16) − eval loss (fp32)| / eval loss (fp32) after 300 steps of
  the same run (trainer, 1-peer swarm, H 50). Target <= 0.02.
- `multi_rank_matches`: φ after 3 rounds of a swarm of two node processes, one of them a 2-rank
  torch.distributed group (gloo), equals φ of the same swarm with both peers single-rank, at the
  same global batch (the spec's batch_size, split by the 2-rank peer's ranks), within 1e-5 max abs
  difference (`multi_rank_max_abs_diff`). Target: true.
- `fsdp_matches`: the same with the 2-rank peer under FSDP2 (`--sharding fsdp`, node/ranks/sharding.py):
  `fsdp_max_abs_diff` = max |φ_fsdp − φ_single|, true within 1e-4 (the tests' bound: AdamW grows
  the last-bit differences of another gradient reduction order).
- `peak_rss_mib`: peak resident memory of this process (bare loop and in-process node) and of each
  rank of the 2-rank peer.

On a machine with CUDA the trainer phase also runs on `cuda` and reports `gpu_samples_per_s` and
`gpu_trainer_overhead`. It has only been run on CPU (README, "Running on GPUs").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import trio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from meshtrain import Node, NodeConfig, SignedSpec, SwarmSpec  # noqa: E402
from meshtrain.collective import LocalSwarm  # noqa: E402
from meshtrain.models import GPT, Corpus, GPTConfig  # noqa: E402
from meshtrain.node.state.checkpoint import CheckpointStore  # noqa: E402
from meshtrain.node.trainer import Trainer  # noqa: E402
from meshtrain.transport.identity import Identity  # noqa: E402
from scripts.bench.harness import Daemon, emit  # noqa: E402

MODEL, BATCH, CLIP, LR, WD = "gpt-small", 16, 1.0, 2e-3, 0.01


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- bare loop ------------------------------------------------------------------------------------


def bare_loop(steps: int, warmup: int, device: str) -> tuple[float, float, float]:
    """Samples per wall second, per process CPU second and per thread CPU second of the loop a
    user would write without meshtrain."""
    corpus = Corpus.default()
    model = GPT(GPTConfig.small(corpus.vocab_size), seed=0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    t0 = c0 = h0 = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            t0, c0, h0 = time.perf_counter(), time.process_time(), time.thread_time()
        x, y = corpus.batch(BATCH, 32, seed=0, peer="bare", step=step)
        x, y = x.to(device), y.to(device)
        loss = model(x, y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    _sync(device)
    samples = BATCH * steps
    return (
        samples / (time.perf_counter() - t0),
        samples / (time.process_time() - c0),
        samples / (time.thread_time() - h0),
    )


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- meshtrain: a real node ----------------------------------------------------------------------


def thread_cpu() -> dict[int, float]:
    """CPU seconds of each thread of this process (Linux), by thread id."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def node_run(
    work: Path,
    steps: int,
    warmup: int,
    H: int,
    device: str,
    threads: int,
    background: list[tuple[float, float]] | None = None,
) -> list[tuple[int, float, float]]:
    """Run a 1-peer swarm node for warmup + steps; return (step, wall time, process CPU time)
    samples, polled from the trio thread every 100 ms (`at` interpolates between them). With
    `background`, append (the non-trainer threads' CPU over the trainer thread's, the trainer
    thread's CPU seconds) over the timed steps."""
    shutil.rmtree(work, ignore_errors=True)
    total = warmup + steps
    spec = SwarmSpec(
        model=MODEL, batch_size=BATCH, H=H, steps=total, eval_every=0, clip=CLIP, inner_lr=LR, weight_decay=WD
    )
    signed = SignedSpec.create(spec, Identity.load_or_create(work))
    config = NodeConfig(
        data_dir=work,
        listen=["/ip4/127.0.0.1/tcp/0"],
        status_port=0,
        nat=False,
        upnp=False,
        checkpoint_every=3600,
        threads=threads,
        device=device,
    )
    node = Node(config, spec=signed)
    seen: list[tuple[int, float, float]] = []
    cpu_at: dict[str, dict[int, float]] = {}

    async def main() -> None:
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                await node.run()
                nursery.cancel_scope.cancel()

            nursery.start_soon(run)
            while True:
                t = node.trainer
                if t is not None and (not seen or t.step != seen[-1][0]):
                    seen.append((t.step, time.monotonic(), time.process_time()))
                    if background is not None and t.step >= warmup and "start" not in cpu_at:
                        cpu_at["start"] = thread_cpu()
                    if background is not None and t.step >= warmup + steps and "end" not in cpu_at:
                        cpu_at["end"] = thread_cpu()
                await trio.sleep(0.1)

    trio.run(main)
    if background is not None and {"start", "end"} <= set(cpu_at):
        delta = {t: c - cpu_at["start"].get(t, 0.0) for t, c in cpu_at["end"].items()}
        trainer = max(delta.values())
        if trainer > 0:
            background.append(((sum(delta.values()) - trainer) / trainer, trainer))
    return seen


def at(seen: list[tuple[int, float, float]], step: int, cpu: bool = False) -> float:
    """When (wall, or process CPU time) the trainer reached `step`, interpolated between polls."""
    k = 2 if cpu else 1
    after = next(i for i, s in enumerate(seen) if s[0] >= step)
    if after == 0 or seen[after][0] == step:
        return seen[after][k]
    (s0, *v0), (s1, *v1) = seen[after - 1], seen[after]
    return v0[k - 1] + (v1[k - 1] - v0[k - 1]) * (step - s0) / (s1 - s0)


def phase_trainer(args: argparse.Namespace, work: Path, device: str) -> dict:
    steps, warmup, trials = (60, 10, 2) if args.quick else (args.steps, 100, args.trials)
    H_plain = steps + warmup + 10  # no round due in the run
    bare, node, cpu_ratios, plain_windows, round_windows, background, thread_ratios = [], [], [], [], [], [], []
    H = 50 if not args.quick else 20
    for _ in range(trials):
        wall, cpu, bare_thread = bare_loop(steps, warmup, device)
        bare.append(wall)
        seen = node_run(work / "plain", steps, warmup, H_plain, device, args.threads, background)
        if len(background) > len(thread_ratios):
            thread_ratios.append(bare_thread * background[-1][1] / (BATCH * steps))
        node.append(BATCH * steps / (at(seen, warmup + steps) - at(seen, warmup)))
        cpu_ratios.append(cpu / (BATCH * steps / (at(seen, warmup + steps, cpu=True) - at(seen, warmup, cpu=True))))
        # round overhead: the counter reads s + 1 once step s and any round sent at s are done, so
        # the window from H + 1 to 2H + 1 holds H steps and the round sent at step 2H; the same
        # window of the no-round run holds none
        plain_windows.append(at(seen, 2 * H + 1) - at(seen, H + 1))
        seen_r = node_run(work / "rounds", 2 * H + 5 - warmup, warmup, H, device, args.threads)
        round_windows.append(at(seen_r, 2 * H + 1) - at(seen_r, H + 1))
    best_bare, best_node = max(bare), max(node)
    return {
        "bare_samples_per_s": round(best_bare, 1),
        "node_samples_per_s": round(best_node, 1),
        "trainer_overhead": round(sorted(b / n for b, n in zip(bare, node, strict=True))[trials // 2], 4),
        "trainer_overhead_best_of": round(best_bare / best_node, 4),
        "trainer_overhead_cpu": round(sorted(cpu_ratios)[len(cpu_ratios) // 2], 4),
        "node_background_cpu_share": (
            round(sorted(b for b, _ in background)[len(background) // 2], 4) if background else None
        ),
        "trainer_thread_overhead_cpu": (
            round(sorted(thread_ratios)[len(thread_ratios) // 2], 4) if thread_ratios else None
        ),
        "round_overhead": round(min(round_windows) / min(plain_windows), 4),
        "trials": {"bare": [round(b, 1) for b in bare], "node": [round(n, 1) for n in node]},
    }


# -- precision ------------------------------------------------------------------------------------


def final_eval_loss(precision: str, steps: int, model: str) -> float:
    spec = SwarmSpec(model=model, batch_size=BATCH, H=50, steps=steps, eval_every=0, precision=precision)
    t = Trainer(spec, LocalSwarm(1).member(0), "bench", device="cpu")

    async def main() -> None:
        async with t.outer:
            await trio.to_thread.run_sync(t.run, threading.Event(), steps, lambda _t: None)

    trio.run(main)
    return t.evaluate()


def phase_precision(args: argparse.Namespace) -> dict:
    steps, model = (100, "gpt-tiny") if args.quick else (300, MODEL)
    fp32 = final_eval_loss("fp32", steps, model)
    bf16 = final_eval_loss("bf16", steps, model)
    return {
        "eval_loss_fp32": round(fp32, 4),
        "eval_loss_bf16": round(bf16, 4),
        "bf16_vs_fp32_loss": round(abs(bf16 - fp32) / fp32, 4),
    }


# -- multi-rank equivalence -----------------------------------------------------------------------


def swarm_phi(
    work: Path, nprocs: tuple[int, int], spec_file: Path, keys: list[Path], H: int, rounds: int, sharding: str = "ddp"
) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Run two node processes (peer 0 with nprocs[0] local ranks under `sharding`, peer 1 with
    nprocs[1]) to `rounds` rounds; return peer 0's φ from its final checkpoint and each process's result."""
    shutil.rmtree(work, ignore_errors=True)
    dirs = [work / f"p{i}" for i in range(2)]
    for d, key in zip(dirs, keys, strict=True):
        d.mkdir(parents=True)
        shutil.copy(key, d / "identity.key")
    common = ["--no-nat", "--wait-peers", "2", "--device", "cpu"]
    first = Daemon(
        dirs[0],
        work / "p0.log",
        "--swarm",
        str(spec_file),
        "--nproc-per-node",
        str(nprocs[0]),
        "--sharding",
        sharding,
        *common,
    )
    addr = first.daemon()["addrs"][0]
    second = Daemon(dirs[1], work / "p1.log", "--join", addr, "--nproc-per-node", str(nprocs[1]), *common)
    results = [n.wait(600) or {"error": n.p.returncode} for n in (first, second)]
    ck = CheckpointStore(dirs[0] / "checkpoints").load_latest()
    if ck is None:
        raise RuntimeError(f"no checkpoint; see {work}")
    return ck.state["outer"]["outer_params"], results


def phase_multi_rank(args: argparse.Namespace, work: Path) -> dict:
    H, rounds = 5, 3
    # The 2-rank peer gets the higher peer id, so the other peer coordinates the rounds: a
    # coordinator whose own trainer reaches the first round seconds late (a multi-rank peer
    # starting its ranks) is taken for "past this round" by the all-reduce (tests/test_multi_rank.py).
    ids = [Identity.load_or_create(work / f"key{i}") for i in range(2)]
    order = sorted(range(2), key=lambda i: ids[i].peer_id_str, reverse=True)
    keys = [work / f"key{i}" / "identity.key" for i in order]
    spec = SwarmSpec(model="gpt-tiny", batch_size=8, H=H, steps=H * rounds, eval_every=0)
    signed = SignedSpec.create(spec, ids[order[0]])
    spec_file = signed.save(work / "swarm.json")
    mixed, res_mixed = swarm_phi(work / "mixed", (2, 1), spec_file, keys, H, rounds)
    single, res_single = swarm_phi(work / "single", (1, 1), spec_file, keys, H, rounds)
    sharded, res_sharded = swarm_phi(work / "fsdp", (2, 1), spec_file, keys, H, rounds, sharding="fsdp")
    diff = max(float((mixed[n] - single[n]).abs().max()) for n in mixed)
    fsdp_diff = max(float((sharded[n] - single[n]).abs().max()) for n in sharded)
    ranks_rss = res_mixed[0].get("local_ranks_peak_rss_mib", [])
    all_rounds = all(r.get("rounds") == rounds for r in res_mixed + res_single + res_sharded)
    return {
        "multi_rank_matches": diff <= 1e-5 and all_rounds,
        "multi_rank_max_abs_diff": diff,
        "fsdp_matches": fsdp_diff <= 1e-4 and all_rounds and res_sharded[0].get("sharding") == "fsdp",
        "fsdp_max_abs_diff": fsdp_diff,
        "ranks_peak_rss_mib": ranks_rss,
        "fsdp_ranks_peak_rss_mib": res_sharded[0].get("local_ranks_peak_rss_mib", []),
        "multi_rank_rounds": [r.get("rounds") for r in res_mixed],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="short runs (CI smoke test)")
    p.add_argument("--steps", type=int, default=200, help="timed steps per trial")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads, both loops")
    p.add_argument("--skip-multi-rank", action="store_true")
    p.add_argument("--only-multi-rank", action="store_true", help="only the multi-rank (DDP and FSDP) phase")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out: dict = {"model": MODEL, "batch": BATCH, "threads": args.threads, "device": "cpu"}
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="bench_trainer_"))
    try:
        if not args.only_multi_rank:
            out.update(phase_trainer(args, work, "cpu"))
            if torch.cuda.is_available():
                gpu = phase_trainer(args, work, "cuda")
                out.update(gpu_samples_per_s=gpu["node_samples_per_s"], gpu_trainer_overhead=gpu["trainer_overhead"])
            out.update(phase_precision(args))
        if not args.skip_multi_rank:
            out.update(phase_multi_rank(args, work))
        out["load_avg"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]
        out["peak_rss_mib"] = {
            "bench": round(rss_mib(), 1),
            **{f"rank{i}": r for i, r in enumerate(out.pop("ranks_peak_rss_mib", []))},
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(out)


if __name__ == "__main__":
    main()
