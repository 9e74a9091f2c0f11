"""A state donor in its own process, for late-joiner tests that kill a donor mid-transfer.

python tests/proc_donor.py --kib 49152 --seed 0 --round 3 [--upload-mib 16]
    publishes `make_state(...)` (deterministic: every process with the same arguments serves
    the same bytes), prints {"peer": id, "addr": multiaddr} once its manifest is ready, and
    serves until stdin closes or the process is killed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import trio

from meshtrain.node.state.donor import StateDonor
from meshtrain.node.state.sync import DEFAULT_CHUNK_BYTES
from meshtrain.transport.host import Host
from meshtrain.transport.identity import Identity
from meshtrain.transport.tensor_streams import TensorStreams


def make_state(kib: int, *, seed: int = 0, round: int = 3) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A deterministic outer state of about `kib` KiB with awkward tensors: odd sizes (chunks
    cut through them), several dtypes, a scalar, an empty tensor; names not in sorted order."""
    g = torch.Generator().manual_seed(seed)
    n = kib * 1024 // 4
    tensors = {
        "outer_params.w": torch.randn(n * 6 // 10 + 3, generator=g),
        "buffers.momentum.w": torch.randn(n // 4 + 7, generator=g).bfloat16(),
        "outer_params.odd": torch.randn(12_345, generator=g),
        "counters": torch.randint(-(2**40), 2**40, (513,), generator=g, dtype=torch.int64),
        "mask": torch.rand(1001, generator=g) > 0.5,
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5 + seed),
        "a.first": torch.randn(17, 3, generator=g).half(),
    }
    meta = {
        "round": round,
        "step": round * 10,
        "lr": 0.7,
        "skeleton": {"__dict__": [[k, {"__tensor__": k}] for k in tensors]},
    }
    return meta, tensors


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    meta, tensors = make_state(args.kib, seed=args.seed, round=args.round)
    async with Host(Identity.generate()) as host, TensorStreams(host) as ts:
        rate = args.upload_mib * (1 << 20) if args.upload_mib > 0 else None
        donor = StateDonor(host, ts, upload_limit=rate)
        donor.publish(meta, tensors)
        await donor._snapshots[0].digests(args.chunk_bytes)  # ready before we announce ourselves
        print(json.dumps({"peer": host.peer_id, "addr": host.addrs[0]}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)  # until the test closes our stdin


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--kib", type=int, default=48 << 10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--round", type=int, default=3)
    p.add_argument("--upload-mib", type=float, default=0)
    p.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES)
    trio.run(main, p.parse_args())
    # Exit without the interpreter's teardown: with torch and libp2p loaded it costs up to a
    # second of CPU per process (more on a busy machine) while the harness waits for our exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
