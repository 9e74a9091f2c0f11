"""`meshtrain.Swarm`: your own training loop on a swarm (node/user_loop.py).

Two peers in separate processes run examples/own_training_loop.py (a tiny transformers LLaMA and
a plain torch loop): the second joins through the first's address, both train with DiLoCo over
the swarm, every round has both contributors, both end with the same φ, and each leaves a
checkpoint that `Swarm.open` resumes. In process: an optimizer that does not match the swarm's
spec is refused at once, with a message that says why; a late joiner downloads the state; with
`group_size`, rounds through the swarm run in groups and the optimizer adds the consensus term.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

import meshtrain
from meshtrain.errors import ConfigError
from meshtrain.node.state.checkpoint import CheckpointStore

from .example_peers import run_two_peers

ROOT = Path(__file__).resolve().parents[1]

EXAMPLE = ROOT / "examples" / "own_training_loop.py"


@pytest.mark.slow
def test_two_processes_train_a_tiny_llama_in_their_own_loops(tmp_path):
    ra, rb = run_two_peers(
        EXAMPLE,
        ["--data-dir", str(tmp_path / "a"), "--create", "--steps", "30", "--H", "10", "--wait-peers", "2"],
        ["--data-dir", str(tmp_path / "b"), "--steps", "30", "--wait-peers", "2", "--join"],
        tmp_path,
    )
    assert ra["step"] == rb["step"] == 30 and ra["rounds"] == rb["rounds"] == 3
    assert ra["contributors"] == rb["contributors"] == [2, 2, 2]
    assert ra["phi_digest"] == rb["phi_digest"]  # one φ: the all-reduce's promise, through your loop
    for name in ("a", "b"):
        ck = CheckpointStore(tmp_path / name / "checkpoints").load_latest()
        assert ck is not None and ck.step == 30 and "model" in ck.state and "outer" in ck.state


def _tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def test_an_optimizer_other_than_the_spec_says_is_refused_and_a_resume_continues(tmp_path):
    spec = meshtrain.SwarmSpec(name="own", model="user", optimizer="diloco", H=5, batch_size=4)
    opts = {"listen": ["/ip4/127.0.0.1/tcp/0"], "status_port": 0, "nat": False, "checkpoint_every": 3600}
    model = _tiny()
    with meshtrain.Swarm.create(spec, data_dir=tmp_path / "d", **opts) as swarm:
        with pytest.raises(ConfigError, match="spec says diloco"):
            meshtrain.NoLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), swarm, H=5)
        with pytest.raises(ConfigError, match="H = 5"):
            meshtrain.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), swarm, H=7)
        opt = meshtrain.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), swarm, H=5)
        x, y = torch.randn(64, 8), torch.randn(64, 1)
        for _ in range(10):
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        swarm.report(loss=1.0)
        assert swarm.step == 10 and opt.rounds == 2
        phi = {n: t.clone() for n, t in opt.outer_params.items()}
    # A new process would do the same: open the data dir, build the optimizer, step on.
    model2 = _tiny(seed=1)
    with meshtrain.Swarm.open(tmp_path / "d", **opts) as swarm2:
        opt2 = meshtrain.DiLoCo(model2, torch.optim.SGD(model2.parameters(), lr=0.1), swarm2, H=5)
        torch.nn.functional.mse_loss(model2(x), y).backward()
        opt2.step()  # the first step joins the state: this data dir's checkpoint
        assert swarm2.step == 11 and opt2.rounds == 2
        assert all(torch.equal(opt2.outer_params[n], phi[n]) for n in phi)


def test_a_swarm_left_before_any_optimizer_was_built_returns_at_once(tmp_path):
    """A script that fails between `Swarm.create` and its optimizer (here: a refused one) leaves
    through `with`: the node stops at once, nothing is saved, `leave()` returns None."""
    spec = meshtrain.SwarmSpec(name="own", model="user", optimizer="diloco", H=5, batch_size=4)
    opts = {"listen": ["/ip4/127.0.0.1/tcp/0"], "status_port": 0, "nat": False}
    model = _tiny()
    swarm = meshtrain.Swarm.create(spec, data_dir=tmp_path / "d", **opts)
    with pytest.raises(ConfigError, match="spec says diloco"), swarm:
        meshtrain.NoLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), swarm, H=5)
    t0 = time.monotonic()
    assert swarm.leave() is None  # idempotent, after the `with` left
    assert time.monotonic() - t0 < 1.0
    assert CheckpointStore(tmp_path / "d" / "checkpoints").load_latest() is None


def test_a_late_joiner_downloads_the_swarms_state_at_its_first_step(tmp_path):
    """Swarm b joins a swarm whose only peer has trained past its first rounds: b's first step
    downloads the state (φ, outer optimizer, step counter) from a, as a daemon would."""
    import threading

    spec = meshtrain.SwarmSpec(name="own", model="user", optimizer="diloco", H=5, batch_size=4)
    opts = {"listen": ["/ip4/127.0.0.1/tcp/0"], "status_port": 0, "nat": False, "checkpoint_every": 3600}
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    joined = threading.Event()
    with meshtrain.Swarm.create(spec, data_dir=tmp_path / "a", **opts) as a:
        model_a = _tiny()
        opt_a = meshtrain.DiLoCo(model_a, torch.optim.SGD(model_a.parameters(), lr=0.1), a, H=5)

        def train_a() -> None:  # a trains on (a peer that trains now is a donor) until b is in
            while not joined.is_set() or opt_a.rounds < 3:
                torch.nn.functional.mse_loss(model_a(x), y).backward()
                opt_a.step()
                opt_a.zero_grad()

        t = threading.Thread(target=train_a)
        t.start()
        try:
            while opt_a.rounds < 2:
                time.sleep(0.05)  # sleep: poll interval
            with meshtrain.Swarm.join(a.addrs[0], data_dir=tmp_path / "b", **opts) as b:
                model_b = _tiny(seed=7)  # another θ0: the download replaces it
                opt_b = meshtrain.DiLoCo(model_b, torch.optim.SGD(model_b.parameters(), lr=0.1), b, H=5)
                torch.nn.functional.mse_loss(model_b(x), y).backward()
                opt_b.step()
                assert b.node.joined_from is not None and b.node.joined_from["donors"] == 1
                assert b.step >= 10 and opt_b.rounds >= 2 and b.spec == a.spec
                joined.set()
        finally:
            joined.set()
            t.join(60)


def test_a_grouped_round_through_your_loop_adds_the_consensus_term(tmp_path):
    """Three peers with `group_size` 2: every round runs in groups (of two and of one). The outer
    optimizer built over `meshtrain.Swarm` must see that (`GroupsRounds`, through the swarm to its
    node's `SwarmCollective`) and average φ in the group too (the consensus term, optim/outer.py
    "Grouped rounds"); a swarm that hid it left the groups' φ to drift apart."""
    import threading

    spec = meshtrain.SwarmSpec(name="grouped", model="user", optimizer="diloco", H=2, batch_size=4, group_size=2)
    opts = {"listen": ["/ip4/127.0.0.1/tcp/0"], "status_port": 0, "nat": False, "checkpoint_every": 3600}
    opts["wait_peers"] = 3  # the first round's groups are formed from all three
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    with ExitStack() as stack:
        a = stack.enter_context(meshtrain.Swarm.create(spec, data_dir=tmp_path / "a", **opts))
        swarms = [a] + [
            stack.enter_context(meshtrain.Swarm.join(a.addrs[0], data_dir=tmp_path / n, **opts)) for n in "bc"
        ]
        seen: dict[str, list[tuple[int, str, bool]]] = {s.peer_id: [] for s in swarms}
        for s in swarms:  # what each node's SwarmCollective is asked, and whether the round is grouped
            col, calls = s.node.collective, seen[s.peer_id]
            real = col.all_reduce

            async def all_reduce(request, _real=real, _calls=calls, _col=col):
                _calls.append((request.round_id, request.tag, _col.round_is_grouped(request.round_id)))
                return await _real(request)

            col.all_reduce = all_reduce
        models = [_tiny(seed=0) for _ in swarms]
        outers = [
            meshtrain.DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), s, H=2)
            for m, s in zip(models, swarms, strict=True)
        ]
        errors: list[BaseException] = []

        def train(model: torch.nn.Module, opt: meshtrain.DiLoCo) -> None:
            try:
                for _ in range(4):
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=train, args=(m, o)) for m, o in zip(models, outers, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert all(o.rounds == 2 for o in outers), [o.rounds for o in outers]
        groups = {r: a.node.collective.round_groups(r) for r in (2, 4)}
    for peer, calls in seen.items():  # both rounds ran in groups, each with φ averaged in the group
        assert [c for c in calls if c[1] == "f0"] == [(2, "f0", True), (4, "f0", True)], (peer, calls)
        # ... where the group holds another peer: a group of one has no φ to average with.
        paired = [(r, "f0.phi", True) for r in (2, 4) if len(groups[r].groups[groups[r].index_of(peer)]) > 1]
        assert [c for c in calls if c[1] == "f0.phi"] == paired, (peer, calls, groups)
    assert all(not g.whole_swarm for g in groups.values())
