"""The benchmarks' --quick modes run in CI: the whole machinery (real peer processes, the JSON
summary, the plot) at a size too small for the benchmarks' targets, checked for what such a run
does show — the rounds the schedule says, replicas that agree to the bit, byte counts that add up
and a compression that shows, a loss well below an untrained model's — and the sweep's pairing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshtrain.models import Corpus

from .conftest import ROOT


def last_json_line(script: str, *args: str, timeout: float, tmp: Path | None = None) -> dict:
    """Run scripts/<script> (a path under scripts/) with `args`; its last stdout line, parsed (it
    must exit 0). `tmp`: its temp folder (TMPDIR), which a run that passed must leave empty."""
    env = dict(os.environ, TMPDIR=str(tmp)) if tmp is not None else None
    if tmp is not None:
        tmp.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        [sys.executable, f"scripts/{script}", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    if tmp is not None:  # torch's compile cache (one per user, reused) is not a leftover
        left = sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))
        assert not left, f"{script} left in its temp folder: {left}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_convergence_benchmark_quick(tmp_path):
    png = tmp_path / "conv.png"
    out = last_json_line(
        "bench/bench_convergence.py",
        *[
            "--quick",
            "--steps",
            "50",
            "--eval-every",
            "25",
            "--methods",
            "diloco_h25,streaming",
            "--png",
            str(png),
        ],
        timeout=400,
        tmp=tmp_path / "tmp",
    )
    diloco, streaming = out["methods"]["diloco_h25"], out["methods"]["streaming"]
    assert set(out["methods"]) == {"diloco_h25", "streaming"} and out["steps"] == 50
    for m in (diloco, streaming):
        assert m["peers"] == 4 and m["rounds"] == 2  # 50 steps: H = 25; Streaming's H = 50 in P = 2 fragments
        assert m["cross_replica_std"] == 0.0  # four processes, one φ
        assert m["final_eval_loss"] < math.log(Corpus.default().vocab_size) - 1  # a uniform guess: ln(vocab)
    assert diloco["bytes_sent_per_peer"] == 2 * diloco["peak_bytes_per_sync"]  # every round the whole model
    # Streaming sends half the model per sync, in fp4: at least 8x under DiLoCo's fp32 peak (16x less scales)
    assert streaming["peak_bytes_per_sync"] * 8 <= diloco["peak_bytes_per_sync"]
    assert abs(streaming["final_eval_loss"] / diloco["final_eval_loss"] - 1) < 0.05  # and learns as much
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_sparseloco_sweep_prints_one_json_line_with_paired_gaps():
    out = last_json_line(
        "studies/sweep_sparseloco.py",
        *[
            "--steps",
            "8",
            "--model",
            "tiny",
            "--seeds",
            "0,1",
            "--base",
            "H=4",
            "--configs",
            "beta=0.9;vector_k=8,range=3",
        ],
        timeout=300,
    )
    assert [c["config"] for c in out["configs"]] == ["beta=0.9", "vector_k=8,range=3"]
    for c in out["configs"]:
        assert len(c["gap_per_seed"]) == 2 and c["bytes_ratio"] > 1
        pairs = zip(c["gap_per_seed"], c["per_seed"], out["diloco"]["per_seed"], strict=True)
        assert all(abs(g - (s / d - 1)) < 1e-3 for g, s, d in pairs)  # paired: the same seed's DiLoCo
    assert out["best"] in {"beta=0.9", "vector_k=8,range=3"}


def test_a_trainer_started_from_saved_weights_holds_them_and_refuses_another_models(tmp_path):
    """tests/proc_trainer.py --init (bench_convergence.py --text --warm-start): every parameter
    of the saved model, none of the fresh one's; a file of another model's tensors is refused."""
    from meshtrain.models import GPT

    from .proc_trainer import load_parameters, model_config

    config = model_config("tiny", Corpus.default().vocab_size)
    trained, fresh = GPT(config, seed=1), GPT(config, seed=2)
    torch.save({n: p.detach().clone() for n, p in trained.named_parameters()}, tmp_path / "warm.pt")
    assert not all(torch.equal(a, b) for a, b in zip(trained.parameters(), fresh.parameters(), strict=True))
    load_parameters(fresh, str(tmp_path / "warm.pt"))
    for (name, a), (_, b) in zip(trained.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    torch.save({"other.weight": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(SystemExit, match="not this model's parameters"):
        load_parameters(fresh, str(tmp_path / "other.pt"))
