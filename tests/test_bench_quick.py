"""The benchmarks' --quick modes run in CI: they exercise the whole machinery (real peer
processes, the JSON summary, the plot) at a size that checks nothing but that it works."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import ROOT


def last_json_line(script: str, *args: str, timeout: float) -> dict:
    """Run scripts/<script> (a path under scripts/) with `args`; its last stdout line, parsed (it must exit 0)."""
    r = subprocess.run(
        [sys.executable, f"scripts/{script}", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, r.stderr[-3000:]
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
    )
    assert set(out["methods"]) == {"diloco_h25", "streaming"}
    assert out["methods"]["streaming"]["peak_bytes_per_sync"] < out["methods"]["diloco_h25"]["peak_bytes_per_sync"]
    assert all(m["final_eval_loss"] < 4.0 for m in out["methods"].values())
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
