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
import json

import pytest
import torch

import meshtrain
from meshtrain.errors import ConfigError
from tests.example_peers import ROOT, loss_fell, run_two_peers, start_peer, stop_peer

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


@pytest.mark.slow
def test_a_torchrun_script_of_two_ranks_is_one_peer(tmp_path):
    """The joiner is `torchrun --nproc-per-node 2` of the same script (DDP on gloo): rank 0 joins
    the swarm, both ranks train their rows, and the swarm sees one peer — two contributors per
    round, the creator's φ equal to both ranks' φ. Then the two-rank peer resumes its data dir
    alone: rank 0 loads the checkpoint at its first step, and rank 1, which started from the
    first weights, must get that state too (else their φ part)."""
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    common = ["--until", "20", "--wait-peers", "2"]
    ra, rb = run_two_peers(
        EXAMPLE,
        ["--data-dir", str(tmp_path / "a"), "--create", "--H", "10", "--steps", "30", *common],
        ["--data-dir", str(tmp_path / "b"), *common, "--join"],
        tmp_path,
        join_launcher=torchrun,
    )
    assert ra["step"] == rb["step"] == 20 and ra["rounds"] == rb["rounds"] == 2
    assert ra["contributors"] == rb["contributors"] == [2, 2]  # the two ranks are one peer
    assert rb["rank_digests"] == [ra["phi_digest"]] * 2  # both ranks hold the swarm's φ
    assert loss_fell(ra["losses"]) and loss_fell(rb["losses"])

    log = tmp_path / "resume.log"
    resumed = start_peer(EXAMPLE, ["--data-dir", str(tmp_path / "b"), "--open"], log, torchrun)
    try:
        out, _ = resumed.communicate(timeout=180)
    finally:
        stop_peer(resumed)
    assert resumed.returncode == 0, log.read_text()[-4000:]
    rc = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    assert rc["step"] == 30 and rc["rounds"] == 3 and rc["contributors"] == [1]
    assert rc["rank_digests"][0] == rc["rank_digests"][1] == rc["phi_digest"]


RANK_REFUSALS = """
import json, sys, torch, torch.distributed as dist
import meshtrain
from meshtrain.errors import ConfigError

dist.init_process_group("gloo")
rank, said = dist.get_rank(), []
model = torch.nn.Linear(4, 4)
try:  # nobody passes the swarm
    meshtrain.SwarmOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), None, model=model)
except ConfigError as e:
    said.append(str(e))
spec = meshtrain.SwarmSpec(name="r", model="user", optimizer="sparseloco", H=5, batch_size=4)
swarm = None
if rank == 0:
    opts = {"listen": ["/ip4/127.0.0.1/tcp/0"], "status_port": 0, "nat": False}
    swarm = meshtrain.Swarm.create(spec, data_dir=sys.argv[1], **opts)
try:  # SparseLoCo's gathered payloads would reach rank 0 only
    meshtrain.SwarmOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), swarm, model=model)
except ConfigError as e:
    said.append(str(e))
if swarm is not None:
    swarm.leave()
print(json.dumps({"rank": rank, "said": said}), flush=True)
"""


@pytest.mark.slow
def test_a_torchrun_misuse_is_refused_on_every_rank_alike(tmp_path):
    """Refusals come on every rank at once (no rank left waiting in a collective call for one that
    raised): no rank holds the swarm; a SparseLoCo swarm across ranks."""
    script = tmp_path / "refusals.py"
    script.write_text(RANK_REFUSALS)
    log = tmp_path / "refusals.log"
    proc = start_peer(
        script, [str(tmp_path / "d")], log, ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    )
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        stop_peer(proc)
    assert proc.returncode == 0, log.read_text()[-4000:]
    said = {r["rank"]: r["said"] for r in map(json.loads, (ln for ln in out.splitlines() if ln.startswith("{")))}
    assert set(said) == {0, 1}
    for rank in (0, 1):
        nobody, sparse = said[rank]
        assert "rank 0 is the swarm's peer" in nobody and "holding one are []" in nobody
        assert "gathers sparse payloads" in sparse and "2 ranks" in sparse


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
