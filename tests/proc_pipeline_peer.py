"""A real pipeline peer in its own process: host, data plane, one stage of the GPT and the
`PipelineRuntime`, for the runtime's multi-process tests and scripts/bench/bench_skippipe.py.

    python tests/proc_pipeline_peer.py

Protocol on stdio (one JSON object per line):
  out {"peer": id, "addr": multiaddr}
  in  {"addrs": [every peer's multiaddr]}   we dial the peers with lower ids; all end connected
  then, for each run:
  in  a run spec (below) or "quit"
  out {"ready": run}                        the runtime serves; wait for every peer's ready
  in  "go"
  out {"it": i, "loss": x, "seconds": s, "committed": n, "dropped": n, "restarts": n, "dead": n,
       "t": seconds since go}               per iteration
  out {"finished": run, "iterations": n, "digest": hex of this stage's weights,
       "hop_bytes": n, "hops_sent": n}      hop payload bytes and hops this peer sent

Run spec: run, mode ("full" | "skippipe"), skip_ratio, n_stages, placement {peer: stage},
forward_time {peer: seconds}, links [[a, b, latency_s, bytes_per_s]], microbatches,
microbatch_size, model (GPTConfig dict), seed, data ("corpus" | "random"), data_seed, lr, steps,
budget_s (null, or stop once another iteration would exceed it), simulate (throttle links and pad
compute to the cost model), serial_links (optional: a link's sends share its bandwidth),
activation_codec (optional, default "none": pipeline/hop_codec.py), snapshot_dir + snapshot_steps (save this stage's weights after those
iterations and after the last), kill {"peer", "iteration", "after_s"} (that peer SIGKILLs itself
`after_s` seconds into that iteration).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import blake3
import torch
import trio

from meshtrain.log import configure
from meshtrain.models import GPT, Corpus, GPTConfig
from meshtrain.pipeline.hop_codec import HopCodec
from meshtrain.pipeline.run import PipelineRun
from meshtrain.pipeline.runtime import PipelineRuntime, SimulatedLinks
from meshtrain.pipeline.scheduler import Link, PipelineProblem
from meshtrain.pipeline.stages import StageReplica
from meshtrain.transport.host import ConnectError, Host
from meshtrain.transport.identity import Identity
from meshtrain.transport.tensor_streams import TensorStreams


def say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


async def readline() -> str:
    line = await trio.to_thread.run_sync(sys.stdin.readline)
    if not line:
        raise SystemExit(0)
    return line.strip()


def make_data(spec: dict):
    config = GPTConfig.from_dict(spec["model"])
    B, T, seed = spec["microbatch_size"], config.context, spec["data_seed"]
    if spec["data"] == "corpus":
        corpus = Corpus.default()
        return lambda it, mb: corpus.batch(B, T, seed=seed, peer="pipeline", step=it, microbatch=mb)

    def random_batch(it: int, mb: int):
        g = torch.Generator().manual_seed(seed * 1_000_003 + it * 1009 + mb)
        rows = torch.randint(0, config.vocab_size, (B, T + 1), generator=g)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    return random_batch


def pipeline_run(spec: dict) -> PipelineRun:
    config = GPTConfig.from_dict(spec["model"])
    links = {(a, b): Link(lat, bw) for a, b, lat, bw in spec["links"]}
    codec = spec.get("activation_codec", "none")
    problem = PipelineProblem(
        num_stages=spec["n_stages"],
        placement=spec["placement"],
        forward_time=spec["forward_time"],
        links=links,
        activation_bytes=HopCodec(codec).nbytes((spec["microbatch_size"], config.context, config.d_model)),
        microbatches=spec["microbatches"],
        skip_ratio=spec["skip_ratio"],
    )
    return PipelineRun(spec["run"], problem, spec["mode"], spec["microbatch_size"], config.context, codec)


def stage_digest(replica: StageReplica) -> str:
    h = blake3.blake3()
    for t in replica.stage_state().values():
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


async def one_run(host: Host, ts: TensorStreams, spec: dict) -> None:
    me = host.peer_id
    run = pipeline_run(spec)
    model = GPT(GPTConfig.from_dict(spec["model"]), seed=spec["seed"])
    replica = StageReplica(model, spec["n_stages"], spec["placement"][me], lr=spec["lr"])
    simulate = spec.get("simulate", False)
    links = SimulatedLinks(run.problem.links, serial=spec.get("serial_links", False)) if simulate else None
    floor = spec["forward_time"][me] if simulate else None
    budget = spec.get("budget_s")
    steps = spec["steps"]

    def should_stop(it: int, elapsed: float) -> bool:
        return budget is not None and elapsed * (it + 2) / (it + 1) > budget

    snap_dir = Path(spec["snapshot_dir"]) if spec.get("snapshot_dir") else None
    kill = spec.get("kill") or {}
    async with PipelineRuntime(
        host, ts, replica, run, make_data(spec), links=links, compute_floor=floor, should_stop=should_stop
    ) as rt:
        say({"ready": run.run})
        if await readline() != "go":
            return
        t0 = time.monotonic()
        it = 0
        async with trio.open_nursery() as nursery:
            while it < steps:
                if kill.get("peer") == me and kill.get("iteration") == it:

                    async def die(after: float = kill["after_s"]) -> None:
                        await trio.sleep(after)  # sleep: the kill lands after_s into the iteration (fault injection)
                        os.kill(os.getpid(), signal.SIGKILL)

                    nursery.start_soon(die)
                rep = await rt.run_iteration(it)
                say(
                    {
                        "it": it,
                        "loss": rep.loss,
                        "seconds": rep.seconds,
                        "committed": rep.committed,
                        "dropped": rep.dropped,
                        "restarts": rep.restarts,
                        "dead": len(rep.dead),
                        "t": time.monotonic() - t0,
                    }
                )
                it += 1
                last = rep.stop or it >= steps
                if snap_dir is not None and (it in spec.get("snapshot_steps", []) or last):
                    path = snap_dir / f"stage{replica.index}_{me[-10:]}_step{it}.pt"
                    await trio.to_thread.run_sync(torch.save, replica.stage_state(), path)
                if rep.stop:
                    break
            nursery.cancel_scope.cancel()
        say(
            {
                "finished": run.run,
                "iterations": it,
                "digest": stage_digest(replica),
                "hop_bytes": rt.stats["hop_bytes"],
                "hops_sent": rt.stats["hops_sent"],
            }
        )


async def main() -> None:
    configure()
    torch.set_num_threads(1)
    async with Host(Identity.generate()) as host, TensorStreams(host) as ts:
        say({"peer": host.peer_id, "addr": host.addrs[0]})
        addrs = json.loads(await readline())["addrs"]
        for a in addrs:
            pid = a.rsplit("/", 1)[1]
            if pid < host.peer_id:
                for attempt in range(3):  # a loaded machine may take more than one dial's 10 s
                    try:
                        await host.connect(a)
                        break
                    except ConnectError:
                        if attempt == 2:
                            raise
        while True:
            line = await readline()
            if line == "quit":
                return
            await one_run(host, ts, json.loads(line))


if __name__ == "__main__":
    trio.run(main)
    # Exit without the interpreter's teardown: with torch and libp2p loaded it costs up to a
    # second of CPU per process (more on a busy machine) while the harness waits for our exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
