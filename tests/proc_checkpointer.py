"""Saves checkpoints in a loop until killed; prints {"saved": step, "digest": hex} after each.

    python tests/proc_checkpointer.py DIR
The state at step s is a pure function of s, so a test can rebuild it and compare bit for bit.
"""

from __future__ import annotations

import json
import sys

import torch

from meshtrain.node.state.checkpoint import CheckpointStore


def state_at(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    model = torch.nn.Linear(64, 32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64, generator=g)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "inner": opt.state_dict(),
        "big": torch.randn(1 << 20, generator=g),
        "meta": {"step": step, "note": "x" * 100},
    }


if __name__ == "__main__":
    store = CheckpointStore(sys.argv[1], keep=2)
    start = store.load_latest()
    step = 0 if start is None else start.step + 1
    while True:
        ck = store.save(state_at(step), step=step, round=step // 10)
        print(json.dumps({"saved": step, "digest": ck.digest}), flush=True)
        step += 1
