"""Low-communication replica sync (pipeline/replica_sync.py) on real peers: the runtime without
its per-iteration all-reduce, and DiLoCo among each stage's replicas every H iterations."""

from __future__ import annotations

from contextlib import AsyncExitStack

import blake3
import torch
import trio

from meshtrain.models.gpt import GPT
from meshtrain.pipeline.replica_sync import StageOuterSync
from meshtrain.pipeline.runtime import PipelineRuntime
from meshtrain.pipeline.stages import StageReplica

from .conftest import start_peers
from .test_pipeline_runtime import CONFIG, batch, iterate, make_run

torch.set_num_threads(1)


def digest(replica: StageReplica) -> str:
    h = blake3.blake3()
    for t in replica.stage_state().values():
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


async def test_replicas_of_a_stage_are_bit_identical_after_each_diloco_round():
    H = 2
    async with AsyncExitStack() as stack:
        peers = await start_peers(stack, 4, full_mesh=True)
        ids = [p.id for p in peers]
        run = make_run(ids, [0, 0, 1, 1], microbatches=4, mode="skippipe")
        rts, syncs = [], []
        for p in peers:
            replica = StageReplica(GPT(CONFIG, seed=0), 2, run.problem.placement[p.id])
            rt = await stack.enter_async_context(
                PipelineRuntime(p.host, p.ts, replica, run, batch, sync_gradients=False)
            )
            rts.append(rt)
            syncs.append(StageOuterSync(replica, lambda rt=rt: rt.collective, "diloco", H=H))
        stages = {0: [0, 1], 1: [2, 3]}
        for it in range(2 * H):
            reports = await iterate(rts, it)
            assert all(r.committed == 4 for r in reports)
            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    for s in syncs:
                        nursery.start_soon(s.after_iteration)
            for members in stages.values():
                digests = {digest(syncs[i].replica) for i in members}
                if (it + 1) % H == 0:
                    assert len(digests) == 1, f"replicas differ after the round at iteration {it}"
                    # and their outer state too: the next round starts from the same φ and momentum
                    a, b = (syncs[i].outer.state_dict(inner=False) for i in members)
                    for name in a["outer_params"]:
                        assert torch.equal(a["outer_params"][name], b["outer_params"][name])
                else:
                    # between rounds each replica stepped on its own microbatches
                    assert len(digests) == 2
        # one round per H iterations, each among the stage's two replicas only
        for s in syncs:
            assert s.outer.rounds == 2
            assert all(r.contributors == 2 for r in s.outer.history)
        # the frozen parameters of other stages never moved
        fresh = dict(GPT(CONFIG, seed=0).named_parameters())
        for s in syncs:
            for name, p in s.replica.model.named_parameters():
                if name not in s.replica.names:
                    assert torch.equal(p, fresh[name]), name
