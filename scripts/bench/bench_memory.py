"""Memory benchmark: the bytes per parameter a peer holds beyond what training alone needs.

    python scripts/bench/bench_memory.py [--hidden 1024] [--layers 8] [--optimizers diloco,streaming,noloco,sparseloco]
                                         [--score-samples 0]   # loss scoring off: its share of the figures

A peer of a 1-8B model lives or dies by what the swarm adds to a bare training loop: φ, outer
momentum, a round's pseudo-gradient and its codec buffers, loss scoring's and spot-checks' copies
of φ, and whatever the donor and the checkpoints hold (nothing by design: the donor lends the live
φ and momentum, copying them only while a joiner fetches across a round; a checkpoint is written
from the live tensors between two steps — docs/guide.md, "Memory"). This benchmark measures that
addition on a LLaMA-family model of ~100 M parameters built here (`transformers`, random init from
a config file: `hf-config:`; a byte-level BPE trained on the built-in corpus), on CPU, where the
device *is* the host.

Method, side by side on one machine:
- **node**: two `meshtrain node start` daemons on loopback train the model together (H 2, batch 2,
  context 64, a checkpoint every 3 s, an open swarm: loss scoring on, as its default; no joiner,
  so the donor never copies). Every 0.1 s
  the script reads each daemon's `VmRSS` from /proc. Once both train, it resets the kernel's peak
  (`/proc/<pid>/clear_refs` 5, so model loading at start-up does not count) and reads `VmHWM` at
  the end: the peak of rounds and checkpoints. Steady = the median `VmRSS` while training.
- **bare**: the same model, built the same way (`models.sources.build_model`), its AdamW, and the
  same inner steps in a plain loop in one process, with the same imports (meshtrain, trio, libp2p
  loaded): its steady `VmRSS` and peak `VmHWM` after the first step.
- The fixed cost of a node (libp2p, the status server, the CRDTs, the corpus) is not per parameter:
  it is measured the same way with the built-in gpt-tiny (node minus bare, ~0.3 M parameters) and
  subtracted, so `host_bytes_per_param_*` = (node − bare − fixed) / parameters.

Last line, one JSON object: `checkpoint_pause_s` (the longest a checkpoint paused training, from
the daemons' logs: it is written from the live tensors on the training thread), `host_bytes_per_param_steady` and `host_bytes_per_param_peak` for
DiLoCo (targets <= 16 and <= 24: the real-scale issue's budget), the same under `by_optimizer`
for the others, `parameters`, the raw MiB figures, and `device_extra_bytes_per_param`: null here —
on CPU the device's extra copies are part of the host figures above; a CUDA run
(`torch.cuda.max_memory_allocated`) is the GPU check's (scripts/gpu_check.sh).

RSS counts what the allocator holds, not only live tensors: glibc returns big blocks (over its
mmap threshold) to the kernel at once, so tensor-sized allocations show up and go away in RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from scripts.bench.harness import Daemon, create_swarm, emit, wait_for  # noqa: E402

MiB = 2**20
BATCH, CONTEXT, H = 2, 64, 2
TARGET_STEADY, TARGET_PEAK = 16.0, 24.0  # bytes per parameter, DiLoCo, fp32 master weights


def proc_kib(pid: int, field: str) -> int | None:
    """A `/proc/<pid>/status` memory field (VmRSS, VmHWM) in KiB; None once the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak(pid: int) -> None:
    """Reset the kernel's VmHWM of `pid` to its current RSS (Linux >= 4.0; our own processes)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def build_artefacts(work: Path, hidden: int, layers: int) -> tuple[Path, Path]:
    """A LLaMA config of the given size and a BPE tokenizer directory, both offline."""
    from transformers import LlamaConfig

    from tests.tiny_hf import BPE_VOCAB, train_bpe

    tok = train_bpe(work / "tokenizer")
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=CONTEXT,
        vocab_size=BPE_VOCAB,
        tie_word_embeddings=False,
    )
    model_dir = work / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(model_dir / "config.json"))
    return model_dir / "config.json", tok


# -- the bare loop (a subprocess: its own RSS) -------------------------------------------------


def bare(model: str, tokenizer: str, steps: int) -> None:
    """Build `model` as a node does, train `steps` inner steps with AdamW; print its memory."""
    import torch

    import meshtrain.node.daemon  # noqa: F401 — the node's imports, so they are not counted as the swarm's
    from meshtrain.models.sources import build_model
    from meshtrain.models.tokenizers import load_tokenizer

    torch.set_num_threads(1)
    vocab = load_tokenizer(tokenizer).vocab_size
    net = build_model(model, vocab_size=vocab, seed=0, context=CONTEXT)
    inner = torch.optim.AdamW(net.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    rss: list[int] = []
    for step in range(steps):
        x = torch.randint(0, vocab, (BATCH, CONTEXT), generator=gen)
        out = net(x, x)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        inner.step()
        inner.zero_grad(set_to_none=False)  # as the trainer keeps them
        if step == 0:
            reset_peak(os.getpid())
        rss.append(proc_kib(os.getpid(), "VmRSS") or 0)
    params = sum(p.numel() for p in net.parameters())
    print(
        json.dumps(
            {
                "parameters": params,
                "steady_kib": statistics.median(rss[1:] or rss),
                "peak_kib": proc_kib(os.getpid(), "VmHWM"),
            }
        )
    )


def run_bare(model: str, tokenizer: str, steps: int) -> dict:
    r = subprocess.run(
        [sys.executable, __file__, "--bare", model, "--tokenizer", tokenizer, "--steps", str(steps)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    if r.returncode:
        raise RuntimeError(f"bare loop failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- two daemons -------------------------------------------------------------------------------


class Sampler:
    """Each daemon's VmRSS every 0.1 s in a thread, from the moment `training()` is called."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.samples: dict[int, list[int]] = {p: [] for p in pids}
        self._on = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def training(self) -> None:
        for p in self.pids:
            reset_peak(p)
        self._on.set()

    def peaks(self) -> dict[int, int | None]:
        return {p: proc_kib(p, "VmHWM") for p in self.pids}

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(0.1):
            if self._on.is_set():
                for p in self.pids:
                    if (kib := proc_kib(p, "VmRSS")) is not None:
                        self.samples[p].append(kib)


def run_nodes(
    work: Path, model: str, tokenizer: str, optimizer: str, steps: int, score_samples: int | None = None
) -> dict:
    """Two daemons train `steps` steps; each one's steady RSS (median) and peak (KiB).
    `score_samples`: the spec's (None: its default; 0: loss scoring off)."""
    dirs = [work / f"p{i}" for i in range(2)]
    spec = ["--name", "memory", "--model", model, "--tokenizer", tokenizer, "--optimizer", optimizer]
    spec += ["--H", str(H), "--steps", str(steps), "--batch-size", str(BATCH), "--context", str(CONTEXT)]
    spec += ["--eval-every", "0", "--pow-bits", "0"]
    if score_samples is not None:
        spec += ["--score-samples", str(score_samples)]
    if optimizer == "streaming":
        spec += ["--fragments", "2", "--delay", "0"]
    create_swarm(dirs[0], *spec)
    common = ["--checkpoint-every", "3", "--wait-peers", "2"]
    first = Daemon(dirs[0], work / "p0.log", "--swarm", str(dirs[0] / "swarm.json"), *common)
    nodes = [first, Daemon(dirs[1], work / "p1.log", "--join", first.daemon(600)["addrs"][0], *common)]
    try:
        pids = [d.daemon(600)["pid"] for d in nodes]
        sampler = Sampler(pids)

        def both_training() -> bool:
            docs = [d.status() for d in nodes]
            return all(doc is not None and doc["training"]["step"] >= 1 for doc in docs)

        wait_for(both_training, 1800, "both peers to train their first step", poll=0.2)
        sampler.training()
        peaks: dict[int, int | None] = {}

        def finished() -> bool:
            # VmHWM is read while the process lives: after its last step, before it exits.
            nonlocal peaks
            peaks = peaks | {p: k for p, k in sampler.peaks().items() if k is not None}
            return all(d.p.poll() is not None for d in nodes)

        wait_for(finished, 3600, "both peers to finish", poll=0.2)
        sampler.stop()
        results = [d.wait(10) for d in nodes]
        if any(r is None for r in results):
            raise RuntimeError(f"a peer failed; see {work}/p*.log")
        return {
            "steady_kib": max(statistics.median(sampler.samples[p]) for p in pids),
            "peak_kib": max(peaks.values()),
            "rounds": min(r.get("rounds", 0) for r in results if r is not None),
            "checkpoint_pause_s": max(checkpoint_pauses(d.log) for d in nodes),
        }
    finally:
        for d in nodes:
            d.kill()


def checkpoint_pauses(log: Path) -> float:
    """The longest pause a checkpoint cost the training thread, from a daemon's log (0: none)."""
    found = re.findall(r"training paused for a checkpoint .*?pause_s=([0-9.]+)", log.read_text(errors="replace"))
    return max((float(x) for x in found), default=0.0)


def per_param(node: dict, bare_: dict, fixed: dict, params: int) -> dict:
    steady = (node["steady_kib"] - bare_["steady_kib"] - fixed["steady_kib"]) * 1024 / params
    peak = (node["peak_kib"] - bare_["peak_kib"] - fixed["peak_kib"]) * 1024 / params
    return {"steady": round(steady, 2), "peak": round(peak, 2), "checkpoint_pause_s": node["checkpoint_pause_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="inner steps of each node run (H 2: steps/2 rounds)")
    ap.add_argument("--optimizers", default="diloco,streaming,noloco,sparseloco")
    ap.add_argument(
        "--score-samples",
        type=int,
        help="the spec's score_samples (default: its own; 0: loss scoring off, to see its share)",
    )
    ap.add_argument("--bare", help=argparse.SUPPRESS)  # internal: the bare loop's process
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare:
        bare(args.bare, args.tokenizer, args.steps)
        return
    work = Path(tempfile.mkdtemp(prefix="bench_memory_"))
    started = time.monotonic()
    failed = False
    try:
        config, tok = build_artefacts(work, args.hidden, args.layers)
        model, tokenizer = f"hf-config:{config}", f"hf:{tok}"
        tiny_node = run_nodes(work / "tiny", "gpt-tiny", tokenizer, "diloco", args.steps)
        tiny_bare = run_bare("gpt-tiny", tokenizer, args.steps)
        fixed = {k: tiny_node[k] - tiny_bare[k] for k in ("steady_kib", "peak_kib")}
        big_bare = run_bare(model, tokenizer, args.steps)
        params = big_bare["parameters"]
        by_optimizer, raw = {}, {"bare": big_bare, "fixed": fixed}
        failed = False
        for optimizer in args.optimizers.split(","):
            try:
                node = run_nodes(work / optimizer, model, tokenizer, optimizer, args.steps, args.score_samples)
            except RuntimeError as e:  # one optimizer's failure is reported, the others still measured
                by_optimizer[optimizer] = {"error": str(e)}
                failed = True
                continue
            raw[optimizer] = node
            by_optimizer[optimizer] = per_param(node, big_bare, fixed, params)
        diloco = {k: v for k, v in by_optimizer.get("diloco", {}).items() if k != "error"}
        emit(
            {
                "parameters": params,
                "host_bytes_per_param_steady": diloco.get("steady"),
                "host_bytes_per_param_peak": diloco.get("peak"),
                "checkpoint_pause_s": diloco.get("checkpoint_pause_s"),
                "targets": {"steady": TARGET_STEADY, "peak": TARGET_PEAK},
                "targets_met": bool(diloco) and diloco["steady"] <= TARGET_STEADY and diloco["peak"] <= TARGET_PEAK,
                "by_optimizer": by_optimizer,
                "device_extra_bytes_per_param": None,
                "device": "cpu (the device is the host: its extra copies are in the host figures)",
                "raw_mib": {
                    k: {kk.removesuffix("_kib"): round(vv / 1024, 1) for kk, vv in v.items() if kk.endswith("_kib")}
                    for k, v in raw.items()
                },
                "score_samples": args.score_samples,
                "batch": BATCH,
                "context": CONTEXT,
                "H": H,
                "load_avg": os.getloadavg()[0],
                "wall_s": round(time.monotonic() - started, 1),
            }
        )
    except BaseException:
        failed = True
        raise
    finally:
        if failed:  # the logs say why
            print(f"kept {work} (a run failed)", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
