"""Meet users in their own training scripts: the swarm inside a loop, an Accelerate script or a
`transformers.Trainer` they already have.

- `SwarmOptimizer` (optimizer.py): a torch optimizer that wraps theirs, in the style of
  `hivemind.Optimizer`: `opt.step()` is the inner step and, every H steps, the swarm's outer
  round. Plain PyTorch, Accelerate, LR schedulers.
- `hf.MeshtrainCallback` (hf.py): a `transformers.TrainerCallback` that makes a `Trainer` script a
  swarm peer, with `hf.MeshtrainArguments` for `HfArgumentParser`.

Both stand on `meshtrain.Swarm` (node/user_loop.py) and build the outer optimizer the swarm's spec
names (node/spec/outer.py `build_outer`): the swarm keeps membership, the fault-tolerant collective,
late joining, parity and checkpoints, exactly as for a loop written around `Swarm` by hand.

The top layer: it imports node/ and everything below it; nothing of ours imports it. `transformers`
is imported by hf.py alone, so `SwarmOptimizer` works without it.

Not here: the daemon's own trainer (node/trainer.py), multi-rank peers (one process per peer here;
a multi-GPU peer is `meshtrain node start --nproc-per-node N`).
"""
