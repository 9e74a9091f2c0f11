"""A GPT (gpt-tiny's shape unless `SLOWED_MODEL_PRESET` says "small") that sleeps
`SLOWED_MODEL_SLEEP_S` seconds in every forward pass: a peer with a slower GPU, for
scripts/bench/bench_hetero.py and tests/test_pace.py. Swarms name it in their spec
(`--model py:<this file>:make`); each daemon's environment says how slow it is. The sleep is the
model's, not meshtrain's: nothing in the package knows a peer is slowed."""

from __future__ import annotations

import os
import time

import torch

from meshtrain.models import GPT, GPTConfig


class SlowedGPT(GPT):
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, block_order=None):  # type: ignore[override]
        delay = float(os.environ.get("SLOWED_MODEL_SLEEP_S", "0") or 0)
        if delay > 0 and targets is not None and self.training:  # training steps, not evaluation
            time.sleep(delay)
        return super().forward(idx, targets, block_order)


def make(vocab_size: int) -> torch.nn.Module:
    preset = os.environ.get("SLOWED_MODEL_PRESET", "tiny")
    config = GPTConfig.small(vocab_size) if preset == "small" else GPTConfig.tiny(vocab_size)
    return SlowedGPT(config)
