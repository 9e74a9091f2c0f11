"""pipeline layer of meshtrain (see shared/ARCHITECTURE.md): SkipPipe.

- `scheduler`: which peers each microbatch visits, and when (pure; no I/O).
- `stages`: a model cut into stages; one peer's replica of one stage (compute, per-microbatch
  gradients, the optimizer step).
- `runtime`: the microbatch protocol over RPC + tensor streams, executing the schedule's per-peer
  order, re-routing around dead peers, and the replicas' per-iteration gradient all-reduce.
- `omission`: evaluating a trained model with some of its stages left out.

Submodules are imported explicitly (`from meshtrain.pipeline.runtime import PipelineRuntime`) so
that the pure scheduler does not pull in the network stack.
"""
