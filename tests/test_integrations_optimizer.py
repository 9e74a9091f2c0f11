"""`meshtrain.SwarmOptimizer` (integrations/optimizer.py): the swarm as a torch optimizer around yours.

Two peers in separate processes run examples/swarm_optimizer.py (a tiny transformers LLaMA, an
AdamW and a cosine schedule; the joiner under Accelerate): every round has both contributors,
both end with the same φ, and the loss fell. In process, on one swarm: a scheduler drives the
inner optimizer's learning rate through the wrapper, Accelerate's micro-steps inside
`accumulate` count no inner step (H counts updates), `state_dict` round-trips, and a second
optimizer on the same swarm is refused.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import meshtrain
from meshtrain.errors import ConfigError
from tests.example_peers import ROOT, loss_fell, run_two_peers

EXAMPLE = ROOT / "examples" / "swarm_optimizer.py"
HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None


@pytest.mark.slow
def test_two_processes_train_a_tiny_llama_through_swarm_optimizer(tmp_path):
    common = ["--steps", "20", "--wait-peers", "2"]
    joiner = ["--accelerate"] if HAS_ACCELERATE else []
    ra, rb = run_two_peers(
        EXAMPLE,
        ["--data-dir", str(tmp_path / "a"), "--create", "--H", "10", *common],
        ["--data-dir", str(tmp_path / "b"), *common, *joiner, "--join"],
        tmp_path,
    )
    assert ra["step"] == rb["step"] == 20 and ra["rounds"] == rb["rounds"] == 2
    assert ra["contributors"] == rb["contributors"] == [2, 2]
    assert ra["phi_digest"] == rb["phi_digest"]
    assert loss_fell(ra["losses"]) and loss_fell(rb["losses"])


def test_schedulers_accumulation_and_state_pass_through_the_wrapper(tmp_path):
    spec = meshtrain.SwarmSpec(name="wrap", model="user", optimizer="diloco", H=5, batch_size=4)
    opts = {"listen": ["/ip4/127.0.0.1/tcp/0"], "status_port": 0, "nat": False, "checkpoint_every": 3600}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    with meshtrain.Swarm.create(spec, data_dir=tmp_path / "d", **opts) as swarm:
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        micro = 1
        if HAS_ACCELERATE:
            from accelerate import Accelerator

            micro = 2
            accelerator = Accelerator(gradient_accumulation_steps=micro, cpu=True)
            model, inner = accelerator.prepare(model, inner)
        opt = meshtrain.SwarmOptimizer(inner, swarm, model=model)
        assert isinstance(opt, torch.optim.Optimizer) and opt.param_groups is inner.param_groups
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
        for _ in range(10 * micro):
            if HAS_ACCELERATE:
                with accelerator.accumulate(model):
                    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                    opt.step()
            else:
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
            opt.zero_grad()
        schedule.step()
        assert inner.param_groups[0]["lr"] == pytest.approx(5e-3)  # the scheduler set the inner lr
        assert swarm.step == 10 and opt.outer.rounds == 2  # updates, not micro-steps
        state = opt.state_dict()
        assert state["inner_steps"] == 10 and "inner" in state
        phi = {n: t.clone() for n, t in opt.outer.outer_params.items()}
        opt.load_state_dict(state)
        assert all(torch.equal(opt.outer.outer_params[n], phi[n]) for n in phi)
        with pytest.raises(ConfigError, match="already has an outer optimizer"):
            meshtrain.SwarmOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), swarm, model=model)
