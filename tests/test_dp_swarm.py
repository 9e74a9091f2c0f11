"""`optimizer = "dp"` (synchronous data parallelism) end to end: through the CLI, through your own
loop over `meshtrain.Swarm`, and with a late joiner through the daemon. Every peer trains on its
own data, so replicas that stay bit-identical — parameters, φ and the inner optimizer's moments —
prove every step applied the one averaged gradient."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch
import trio

import meshtrain
from meshtrain.node.state import run_state
from meshtrain.node.state.checkpoint import CheckpointStore
from meshtrain.transport.identity import Identity

from .test_node_cli import create, finish, start, wait_daemon

pytestmark = pytest.mark.slow


def _latest(data_dir) -> dict:
    ck = CheckpointStore(data_dir / "checkpoints").load_latest()
    assert ck is not None
    return ck.state


def _identical(a: dict, b: dict) -> bool:
    """Two checkpoints hold the same θ, φ and inner optimizer moments, bit for bit."""
    if a["outer"]["inner_steps"] != b["outer"]["inner_steps"]:
        return False
    pairs = [(a["model"], b["model"]), (a["outer"]["outer_params"], b["outer"]["outer_params"])]
    sa, sb = a["outer"]["inner"]["state"], b["outer"]["inner"]["state"]
    pairs += [(sa[k], sb[k]) for k in sa]
    return all(set(x) == set(y) and all(torch.equal(x[n], y[n]) for n in x) for x, y in pairs)


def test_dp_trains_through_the_cli_and_both_replicas_stay_bit_identical(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    create(a, "--model", "gpt-tiny", "--optimizer", "dp", "--steps", "30", "--batch-size", "4", "--eval-every", "10")
    la, lb = tmp_path / "a.log", tmp_path / "b.log"
    pa = start("--data-dir", str(a), "--wait-peers", "2", log=la)
    info = wait_daemon(a, pa, la)
    pb = start("--data-dir", str(b), "--join", info["addrs"][0], "--wait-peers", "2", log=lb)
    ra, rb = finish(pa, la), finish(pb, lb)
    assert ra["step"] == rb["step"] == 30 and ra["rounds"] == rb["rounds"] == 30  # a round every step
    assert ra["eval_loss"] == rb["eval_loss"] and ra["eval_loss"] < 5.0
    sa, sb = _latest(a), _latest(b)
    assert sa["outer"]["algorithm"] == "DataParallel" and sa["outer"]["H"] == 1
    assert _identical(sa, sb), "dp replicas must be bit-identical"


def _tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def test_dp_trains_your_own_loop_through_the_python_api(tmp_path, monkeypatch):
    monkeypatch.setattr(run_state, "ENTER_WAIT", 1.0)  # a fresh swarm: nobody to wait for
    # A robust rule from the spec reaches a loop's collective too (with two peers it is the mean).
    spec = meshtrain.SwarmSpec(name="dp-own", model="user", optimizer="dp", batch_size=4, aggregation="clipped_mean")
    opts = {"listen": ["/ip4/127.0.0.1/tcp/0"], "status_port": 0, "nat": False, "checkpoint_every": 3600}
    a = meshtrain.Swarm.create(spec, data_dir=tmp_path / "a", wait_peers=2, **opts)
    b = meshtrain.Swarm.join(a.addrs[0], data_dir=tmp_path / "b", wait_peers=2, **opts)
    assert a.node.collective.config.robust == b.node.collective.config.robust == "clipped_mean"
    steps = 20
    out: dict[int, tuple] = {}
    errors: list[BaseException] = []

    # The same start on both peers (a fresh swarm has no state to download), built here: two
    # threads seeding torch's global generator at once would interleave and start apart.
    models = [_tiny(), _tiny()]

    def loop(i: int, swarm: meshtrain.Swarm) -> None:
        try:
            model = models[i]
            opt = meshtrain.DataParallel(model, torch.optim.AdamW(model.parameters(), lr=1e-2), swarm)
            g = torch.Generator().manual_seed(i)  # each peer its own data
            x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
            while swarm.step < steps:
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            out[i] = (model, opt, swarm.leave())
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(i, s)) for i, s in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    (ma, oa, ra), (mb, ob, rb) = out[0], out[1]
    assert ra.step == rb.step == steps
    assert [r.contributors for r in oa.history] == [2] * steps == [r.contributors for r in ob.history]
    assert all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters(), strict=True))
    assert all(torch.equal(oa.outer_params[n], ob.outer_params[n]) for n in oa.outer_params)
    assert _identical(_latest(tmp_path / "a"), _latest(tmp_path / "b"))


def _config(data_dir, **kw) -> meshtrain.NodeConfig:
    return meshtrain.NodeConfig(
        data_dir=data_dir,
        listen=["/ip4/127.0.0.1/tcp/0"],
        status_port=0,
        threads=1,
        nat=False,
        checkpoint_every=3600,
        **kw,
    )


async def test_a_dp_node_resumes_its_checkpoint_bit_exactly(tmp_path):
    spec = meshtrain.SwarmSpec(model="gpt-tiny", optimizer="dp", steps=20, batch_size=4, eval_every=0)
    signed = meshtrain.SignedSpec.create(spec, Identity.load_or_create(tmp_path / "a"))
    first = await meshtrain.Node(_config(tmp_path / "a", max_steps=10), spec=signed).run()
    assert first.step == first.rounds == 10
    second = await meshtrain.Node(_config(tmp_path / "a"), spec=signed).run()
    assert second.step == 20
    # The same 20 steps in one go, under the same identity (the same data): the same bits.
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "a" / "identity.key", tmp_path / "b" / "identity.key")
    os.chmod(tmp_path / "b" / "identity.key", 0o600)
    straight = await meshtrain.Node(_config(tmp_path / "b"), spec=signed).run()
    assert straight.step == 20
    assert _identical(_latest(tmp_path / "a"), _latest(tmp_path / "b"))


async def test_a_late_dp_joiner_downloads_the_inner_state_and_stays_bit_identical(tmp_path, monkeypatch):
    monkeypatch.setattr(run_state, "ENTER_WAIT", 1.0)
    # Long enough that the joiner still has 20 rounds to go when it gets in: two peers on loopback
    # run ~20 rounds a second, and a joiner whose two donors answer a round apart (it dials the
    # second one first) retries — seen once to join at step 59 of 60.
    steps = 120
    spec = meshtrain.SwarmSpec(model="gpt-tiny", optimizer="dp", steps=steps, batch_size=4, eval_every=0)
    signed = meshtrain.SignedSpec.create(spec, Identity.load_or_create(tmp_path / "a"))

    def config(name: str, **kw) -> meshtrain.NodeConfig:
        return _config(tmp_path / name, **kw)

    with trio.fail_after(150):
        async with trio.open_nursery() as nursery:
            a = meshtrain.Node(config("a", wait_peers=2), spec=signed)
            nursery.start_soon(a.run)
            while a.host is None:
                await trio.sleep(0.05)  # sleep: poll interval
            b = meshtrain.Node(config("b", wait_peers=2), join=a.host.addrs[0])
            nursery.start_soon(b.run)
            while a.trainer is None or a.trainer.step < 10:  # the swarm is under way
                await trio.sleep(0.05)  # sleep: poll interval
            c = meshtrain.Node(config("c"), join=a.host.addrs[0])
            nursery.start_soon(c.run)
    assert c.joined_from is not None and c.joined_from["step"] >= 10, c.joined_from
    assert a.trainer.step == b.trainer.step == c.trainer.step == steps
    # Once in, the joiner contributes to the rounds (a dp joiner holds the exact state): a round
    # per step races on 2 cores, so one it reaches after its group formed (then re-synced) is
    # allowed; a peer struck out or left behind would miss them all.
    last = [r.contributors for r in list(c.trainer.outer.history)[-20:]]
    assert sum(n == 3 for n in last) >= 18, last
    assert a.parity.resyncs == b.parity.resyncs == 0  # parity hashed φ every step and agreed
    states = [_latest(tmp_path / n) for n in "abc"]
    assert _identical(states[0], states[1]) and _identical(states[0], states[2])
