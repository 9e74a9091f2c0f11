"""pipeline layer of meshtrain (see docs/architecture.md): SkipPipe.

- `scheduler`: which peers each microbatch visits, and when (pure; no I/O): the entry points and
  `validate`. Its parts: `schedule_types` (the problem, the schedule, the errors; re-exported by
  `scheduler`) and `schedule_search` (problem compilation and the A* search).
- `stages`: a model cut into stages (a GPT or a transformers causal LM, as
  `models/staged.py` cuts it); one peer's replica of one stage (compute on the device it is
  given, in fp32 or under bf16 autocast; per-microbatch gradients; the optimizer step).
- `runtime`: the microbatch protocol over RPC + tensor streams, executing the schedule's per-peer
  order, re-routing around dead peers, and the replicas' per-iteration gradient all-reduce.
  Its parts: `run` (the `PipelineRun` the peers agree on), `hop` (the RPC names and the `Hop` a
  hop request announces), `iteration` (`IterationWorker`: runs a peer's visits in schedule order,
  and the end of an iteration), `rerouting` (`Rerouter`: restarts microbatches around dead peers,
  takes a dead origin's over); the runtime composes the two and hands each what it needs.
- `hop_codec`: how an activation or gradient hop is encoded (the run's `activation_codec`: none,
  or a dense codec of collective/compression.py), and the checks on what a peer sent; where a
  hop leaves a stage's device for the host, and comes back.
- `omission`: evaluating a trained model with some of its stages left out.
- `cut`: how a swarm spec writes the stage cut (`stage_cut`, e.g. "0-1,2-3").
- `placement`: which stage each peer of a pipeline swarm holds (pure; over the membership).
- `replica_sync`: DiLoCo / NoLoCo among one stage's replicas every H iterations, instead of the
  runtime's per-iteration gradient all-reduce.

Submodules are imported explicitly (`from meshtrain.pipeline.runtime import PipelineRuntime`) so
that the pure scheduler does not pull in the network stack.
"""
