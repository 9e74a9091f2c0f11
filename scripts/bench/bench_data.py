"""Data pipeline benchmark: is the pipeline ever the bottleneck, does its memory stay bounded, and
does a peer killed with SIGKILL resume on exactly the samples it would have trained?

    nice -n 10 python scripts/bench/bench_data.py [--quick] [--mib 50] [--rss-mib 500] [--small-mib 5]

Every dataset is a JSONL file generated in a temporary directory (slices of the built-in English
corpus as documents, 200 to 3,000 characters each). One JSON object on the last line:

- `tokens_per_s`: the data pipeline alone — `meshtrain.data.open_dataset` on a fresh cache: the
  content digest, streaming through Hugging Face `datasets`, tokenising, packing into the token
  cache (written and fsynced) — over a `--mib` (50) MB JSONL, in tokens per second of wall time,
  for the slower of two tokenizers (`tokens_per_s_by_tokenizer`): UTF-8 bytes, and a byte-level
  BPE (4,096 ids, trained here with `tokenizers` on the built-in corpus, encoding one document
  at a time as the `Tokenizer` protocol does). `sample_tokens_per_s`: tokens per second of
  `PackedDataset.batch` (the demo's batch, positioned reads from the token cache): what the trainer
  waits on at every step once the cache exists. `restart_prepare_s`: a second `open_dataset` of
  the same files into the same cache (the slower tokenizer's) — what a restarted node spends on
  its data: the digest comes from the manifest (the files' samples, not their bytes), the cache is
  reused.
- `trainer_tokens_per_s`: what the trainer consumes — the demo's model (gpt-small, batch 16,
  context 32) in meshtrain's `Trainer`, a 1-peer swarm in process, no round due, timed over
  `--trainer-steps` steps. `pipeline_vs_trainer` = tokens_per_s / trainer_tokens_per_s (target
  >= 5; the cache is built once, so this is the worst case, the first start).
- `rss_mib`: peak resident memory of a process that builds the cache of a `--rss-mib` (500) MB
  dataset and then samples 500 batches from it (bytes tokenizer: BPE would take minutes here);
  `rss_small_mib` the same for `--small-mib` (5) MB; `rss_ratio` = rss_mib / rss_small_mib (target
  < 2). `rss_dataset_mib` is the size actually generated (the flags' value).
- `resume_exact`: a trainer process (gpt-tiny on a JSONL dataset, checkpoints every 20 steps to a
  `CheckpointStore`, logging every step's (step, sample ids) as it draws them) is SIGKILLed mid-run
  (`killed_after_step`), restarted (it resumes from `resumed_from_step`), and finishes; the steps
  its lineage trained — the first process's up to the checkpoint, then the second's — must equal,
  as (step, sample ids), those of one uninterrupted process, each step exactly once, and its final
  outer parameters must equal the uninterrupted run's bit for bit (`resume_phi_equal`).

`--quick` shrinks everything (CI checks the machinery, not the numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import blake3  # noqa: E402

RESUME_STEPS = 300
RESUME_KILL_AFTER = 150
RESUME_CHECKPOINT_EVERY = 20


# -- datasets and tokenizers ------------------------------------------------------------------------


def builtin_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def write_jsonl(path: Path, mib: float, seed: int = 0) -> Path:
    """Documents: random slices of the built-in corpus, 200 to 3,000 characters, until `mib` MiB."""
    text, rng, target, size = builtin_text(), random.Random(seed), int(mib * 2**20), 0
    with open(path, "w") as f:
        while size < target:
            lines = []
            for _ in range(256):
                n = rng.randint(200, 3000)
                start = rng.randrange(len(text) - n)
                lines.append(json.dumps({"text": text[start : start + n]}) + "\n")
            chunk = "".join(lines)
            f.write(chunk)
            size += len(chunk.encode())
    return path


class BPE:
    """A byte-level BPE trained with `tokenizers` on the built-in corpus, with an end-of-text id."""

    def __init__(self, vocab_size: int = 4096) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(builtin_text().split("\n\n"), trainer)
        self.tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = tok.token_to_id("<|endoftext|>")
        self.digest = blake3.blake3(tok.to_str().encode()).hexdigest()[:32]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids


def tokenizer(name: str):
    from meshtrain.models import Vocab

    return Vocab.of_bytes() if name == "bytes" else BPE()


def rss_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


# -- children -----------------------------------------------------------------------------------------


def child_pipeline(data: Path, cache: Path, tokenizer_name: str, batches: int) -> None:
    """Build the cache of `data` from scratch, then sample `batches` demo batches; print a JSON line."""
    from meshtrain.data import open_dataset

    tok = tokenizer(tokenizer_name)
    t0 = time.perf_counter()
    ds = open_dataset(data, tok, cache)
    seconds = time.perf_counter() - t0
    t_restart = time.perf_counter()
    open_dataset(data, tok, cache)  # a restart: nothing changed
    restart_seconds = time.perf_counter() - t_restart
    tokens = ds.meta["train_tokens"] + ds.meta["held_out_tokens"]
    t1 = time.perf_counter()
    for step in range(batches):
        ds.batch(16, 32, seed=0, peer="bench", step=step)
    sample_s = time.perf_counter() - t1
    print(
        json.dumps(
            {
                "tokens": tokens,
                "seconds": seconds,
                "restart_seconds": restart_seconds,
                "tokens_per_s": tokens / seconds,
                "sample_tokens_per_s": batches * 16 * 32 / sample_s,
                "rss_mib": rss_mib(),
                "documents": ds.meta["train_documents"] + ds.meta["held_out_documents"],
            }
        )
    )


def child_train(data: Path, work: Path, steps: int, log_path: Path) -> None:
    """A trainer on `data` that resumes from `work`'s latest checkpoint, logs every step's
    (step, sample ids) to `log_path` as it draws them, checkpoints every 20 steps."""
    import torch
    import trio

    from meshtrain.collective import LocalSwarm
    from meshtrain.node.spec.swarm import SwarmSpec
    from meshtrain.node.state.checkpoint import CheckpointStore
    from meshtrain.node.trainer import Trainer

    torch.set_num_threads(1)
    spec = SwarmSpec(model="gpt-tiny", dataset=str(data), steps=steps, H=10, eval_every=0, batch_size=8)
    trainer = Trainer(spec, LocalSwarm(1).member(0), "bench-peer", data_dir=work)
    store = CheckpointStore(work / "checkpoints")
    ckpt = store.load_latest()
    if ckpt is not None:
        trainer.load_checkpoint(ckpt.state)
    log = open(log_path, "a")  # noqa: SIM115 — lives as long as the process (which may be killed)
    draw = trainer.batch

    def logged(step: int):
        ids = trainer.corpus.sample_ids(
            spec.data.batch_size, trainer.context, seed=spec.seed, peer=trainer.peer_id, step=step
        )
        log.write(json.dumps({"pid": os.getpid(), "step": step, "ids": ids.tolist()}) + "\n")
        log.flush()
        return draw(step)

    trainer.batch = logged  # type: ignore[method-assign]

    def after_step(t: Trainer) -> None:
        if t.step % RESUME_CHECKPOINT_EVERY == 0:
            store.save(t.checkpoint_state(), step=t.step, round=t.outer.rounds)

    async def main() -> None:
        async with trainer.outer:
            await trio.to_thread.run_sync(trainer.run, threading.Event(), steps, after_step)

    trio.run(main)
    h = blake3.blake3()
    for name, t in sorted(trainer.outer.outer_params.items()):
        h.update(name.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    print(
        json.dumps({"phi": h.hexdigest(), "resumed_from": ckpt.step if ckpt is not None else 0, "step": trainer.step})
    )


# -- measurements -------------------------------------------------------------------------------------


def run_child(*args: str, timeout: float = 1800) -> dict:
    r = subprocess.run(
        [sys.executable, __file__, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    if r.returncode != 0:
        raise SystemExit(f"child {args[:2]} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def trainer_tokens_per_s(steps: int) -> float:
    import torch
    import trio

    from meshtrain.collective import LocalSwarm
    from meshtrain.node.spec.swarm import SwarmSpec
    from meshtrain.node.trainer import Trainer

    spec = SwarmSpec(model="gpt-small", steps=steps + 10, H=100_000, eval_every=0, batch_size=16)
    trainer = Trainer(spec, LocalSwarm(1).member(0), "bench", device="cpu")
    torch.manual_seed(0)
    timing: dict[str, float] = {}

    async def main() -> None:
        async with trainer.outer:
            await trio.to_thread.run_sync(trainer.run, threading.Event(), 10, lambda _t: None)  # warm up
            t0 = time.perf_counter()
            await trio.to_thread.run_sync(trainer.run, threading.Event(), steps + 10, lambda _t: None)
            timing["s"] = time.perf_counter() - t0

    trio.run(main)
    return steps * spec.data.batch_size * trainer.context / timing["s"]


def resume_exact(tmp: Path, data: Path) -> dict:
    straight_dir, killed_dir = tmp / "straight", tmp / "killed"
    straight_dir.mkdir()
    killed_dir.mkdir()
    straight = run_child(
        "--child-train", str(data), str(straight_dir), str(RESUME_STEPS), str(straight_dir / "trained.jsonl")
    )
    log = killed_dir / "trained.jsonl"
    cmd = [sys.executable, __file__, "--child-train", str(data), str(killed_dir), str(RESUME_STEPS), str(log)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1")
    )
    killed_after = -1
    while proc.poll() is None:
        rows = _rows(log)
        if rows and rows[-1]["step"] >= RESUME_KILL_AFTER:
            proc.send_signal(signal.SIGKILL)
            killed_after = rows[-1]["step"]
            break
        time.sleep(0.005)
    proc.wait()
    if killed_after < 0:
        raise SystemExit(f"the trainer ended before it could be killed:\n{proc.stderr.read().decode()[-2000:]}")
    resumed = run_child(*cmd[2:])
    first_pid = _rows(log)[0]["pid"]
    lineage = [r for r in _rows(log) if r["pid"] != first_pid or r["step"] < resumed["resumed_from"]]
    want = [(r["step"], tuple(r["ids"])) for r in _rows(straight_dir / "trained.jsonl")]
    got = [(r["step"], tuple(r["ids"])) for r in lineage]
    exact = (
        sorted(got) == sorted(want)
        and len({s for s, _ in got}) == len(got) == RESUME_STEPS
        and straight["phi"] == resumed["phi"]
    )
    return {
        "resume_exact": exact,
        "resume_phi_equal": straight["phi"] == resumed["phi"],
        "killed_after_step": killed_after,
        "resumed_from_step": resumed["resumed_from"],
        "resume_steps": RESUME_STEPS,
    }


def _rows(path: Path) -> list[dict]:
    rows = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:  # the line being written when the process was killed
                    break
    except FileNotFoundError:
        pass
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--mib", type=float, default=50.0)
    p.add_argument("--rss-mib", type=float, default=500.0)
    p.add_argument("--small-mib", type=float, default=5.0)
    p.add_argument("--trainer-steps", type=int, default=200)
    p.add_argument("--child-pipeline", nargs=4, metavar=("DATA", "CACHE", "TOKENIZER", "BATCHES"))
    p.add_argument("--child-train", nargs=4, metavar=("DATA", "WORK", "STEPS", "LOG"))
    args = p.parse_args()
    if args.child_pipeline:
        data, cache, name, batches = args.child_pipeline
        return child_pipeline(Path(data), Path(cache), name, int(batches))
    if args.child_train:
        data, work, steps, log = args.child_train
        return child_train(Path(data), Path(work), int(steps), Path(log))
    if args.quick:
        args.mib, args.rss_mib, args.small_mib, args.trainer_steps = 2.0, 4.0, 1.0, 30
    out: dict = {"load_avg_before": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp_name:
        tmp = Path(tmp_name)
        t0 = time.monotonic()
        data = write_jsonl(tmp / "pipeline.jsonl", args.mib)
        out["generate_s"] = round(time.monotonic() - t0, 1)
        by_tokenizer = {}
        for name in ("bytes", "bpe"):
            r = run_child("--child-pipeline", str(data), str(tmp / f"cache-{name}"), name, "500")
            by_tokenizer[name] = r
            print(json.dumps({"pipeline": name, **r}), file=sys.stderr, flush=True)
        out["dataset_mib"] = args.mib
        out["tokens_per_s_by_tokenizer"] = {k: round(v["tokens_per_s"]) for k, v in by_tokenizer.items()}
        out["tokens_per_s"] = min(out["tokens_per_s_by_tokenizer"].values())
        out["sample_tokens_per_s"] = round(min(v["sample_tokens_per_s"] for v in by_tokenizer.values()))
        out["restart_prepare_s"] = round(max(v["restart_seconds"] for v in by_tokenizer.values()), 3)
        out["trainer_tokens_per_s"] = round(trainer_tokens_per_s(args.trainer_steps))
        out["pipeline_vs_trainer"] = round(out["tokens_per_s"] / out["trainer_tokens_per_s"], 1)
        for label, mib in (("small", args.small_mib), ("large", args.rss_mib)):
            path = write_jsonl(tmp / f"rss-{label}.jsonl", mib, seed=1)
            r = run_child("--child-pipeline", str(path), str(tmp / f"cache-rss-{label}"), "bytes", "500")
            out[f"rss_{label}_run"] = {"mib": mib, "rss_mib": r["rss_mib"], "tokenise_s": round(r["seconds"], 1)}
            path.unlink()
            print(json.dumps({"rss": label, **r}), file=sys.stderr, flush=True)
        out["rss_mib"] = out["rss_large_run"]["rss_mib"]
        out["rss_small_mib"] = out["rss_small_run"]["rss_mib"]
        out["rss_ratio"] = round(out["rss_mib"] / out["rss_small_mib"], 2)
        out["rss_dataset_mib"] = args.rss_mib
        out["rss_tokenizer"] = "bytes"
        out.update(resume_exact(tmp, write_jsonl(tmp / "resume.jsonl", 1.0, seed=2)))
    out["load_avg_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
