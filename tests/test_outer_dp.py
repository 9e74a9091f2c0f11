"""`DataParallel` as the spec's `optimizer = "dp"`, and the spec's `aggregation` keys, without a
network: a joiner that loads a peer's donor state continues bit-identically (the inner optimizer's
state travels with it), the spec's rules for dp and for robust aggregation, and what the spec
hands the collective."""

from __future__ import annotations

import pytest
import torch
import trio

from meshtrain.collective import AllReduceConfig, LocalSwarm
from meshtrain.collective.spec_section import AGGREGATIONS
from meshtrain.errors import ConfigError
from meshtrain.node.spec.outer import build_outer, check_matches
from meshtrain.node.spec.swarm import SwarmSpec, parse_spec
from meshtrain.optim import DataParallel, OuterStateError

from .test_node_cli import cli
from .test_outer_diloco import backward, tiny


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


async def steps(outers, models, ids, start: int, n: int) -> None:
    """Every worker one inner step on its own data, then the round (all call in)."""
    for step in range(start, start + n):
        async with trio.open_nursery() as nursery:
            for o, m, i in zip(outers, models, ids, strict=True):

                async def one(o=o, m=m, i=i, step=step):
                    backward(m, i, step)
                    await o.astep()

                nursery.start_soon(one)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


async def test_a_dp_joiner_continues_bit_identically_from_a_donor_state():
    swarm = LocalSwarm(2, timeout=None)
    models = [tiny(), tiny()]
    outers = [DataParallel(m, adamw(m), swarm.member(i)) for i, m in enumerate(models)]
    await steps(outers, models, [0, 1], 0, 3)
    assert outers[0].rounds == 3 and same(dict(models[0].named_parameters()), dict(models[1].named_parameters()))
    donor = outers[0].state_dict(inner=False)  # what a late joiner downloads
    assert donor["inner"]["state"], "the inner optimizer's moments are the swarm's state under dp"
    late_model = tiny(seed=7)  # another init: everything must come from the donor state
    late = DataParallel(late_model, adamw(late_model), swarm.add())
    late.join(donor)
    models.append(late_model)
    outers.append(late)
    await steps(outers, models, [0, 1, 2], 3, 3)
    assert [r.contributors for r in late.history] == [3, 3, 3]  # contributes from its first step
    params = [{n: p.detach() for n, p in m.named_parameters()} for m in models]
    assert same(params[0], params[1]) and same(params[0], params[2])
    assert same(outers[0].outer_params, outers[2].outer_params) and same(outers[0].outer_params, params[0])
    s0, s2 = outers[0].inner.state_dict()["state"], late.inner.state_dict()["state"]
    assert all(torch.equal(s0[k]["exp_avg_sq"], s2[k]["exp_avg_sq"]) for k in s0)


def test_a_dp_state_without_the_inner_optimizer_is_refused():
    model = tiny()
    dp = DataParallel(model, adamw(model), LocalSwarm(1).member(0))
    state = dp.state_dict()
    del state["inner"]
    with pytest.raises(OuterStateError, match="inner optimizer"):
        dp.load_state_dict(state)
    with pytest.raises(ValueError, match="H is 1"):
        DataParallel(model, adamw(model), LocalSwarm(1).member(0), H=5)


def test_dp_in_the_spec_syncs_every_step_and_builds_the_baseline():
    spec = parse_spec({"optimizer": "dp", "model": "gpt-tiny"})
    assert spec.outer.H == 1
    model = tiny()
    outer = build_outer(spec, model, adamw(model), LocalSwarm(1).member(0))
    assert type(outer) is DataParallel and outer.replicas_identical
    check_matches(outer, spec)
    with pytest.raises(ConfigError, match="FSDP"):
        build_outer(spec, model, None, LocalSwarm(1).member(0))
    with pytest.raises(ConfigError, match="H must be 1"):
        parse_spec({"optimizer": "dp", "H": 10})
    with pytest.raises(ConfigError, match="bf16"):
        parse_spec({"optimizer": "dp", "precision": "fp16"})


def test_the_spec_aggregation_is_what_every_all_reduce_gets():
    assert AGGREGATIONS == ("mean", "trimmed_mean", "clipped_mean")
    # Robust by default where strangers take part and the all-reduce is dense; mean elsewhere.
    assert SwarmSpec().aggregation.rule == "trimmed_mean" and SwarmSpec().admission.mode == "open"
    for optimizer in ("diloco", "streaming", "dp"):
        assert parse_spec({"optimizer": optimizer}).aggregation.rule == "trimmed_mean"
    for values in (
        {"admission": "allowlist"},
        {"admission": "private"},
        {"optimizer": "noloco"},
        {"optimizer": "sparseloco"},
    ):
        assert parse_spec(values).aggregation.rule == "mean", values
    assert parse_spec({"aggregation": "mean"}).aggregation.rule == "mean"  # an explicit mean stays
    assert AllReduceConfig(**parse_spec({"aggregation": "mean"}).aggregation_options()).screen_norm == 0
    # dp combines robustly but screens nothing unless asked: single-step gradients are too noisy.
    assert parse_spec({"optimizer": "dp"}).aggregation.screen_norm == 0
    assert parse_spec({"optimizer": "dp", "screen_norm": 4.0}).aggregation_options()["screen_norm"] == 4.0
    assert parse_spec({"optimizer": "diloco"}).aggregation_options()["screen_norm"] == 4.0
    with pytest.raises(ConfigError, match="strikes_window"):
        parse_spec({"strikes": 3, "strikes_window": 2})
    for name in AGGREGATIONS:
        spec = parse_spec({"aggregation": name, "aggregation_trim": 2, "aggregation_clip": 3.0})
        config = AllReduceConfig(**spec.aggregation_options())  # as the daemon builds it
        assert config.robust == ("none" if name == "mean" else name) and config.trim == 2 and config.clip == 3.0
    with pytest.raises(ConfigError, match="aggregation"):
        parse_spec({"aggregation": "median"})
    for optimizer in ("noloco", "sparseloco"):
        with pytest.raises(ConfigError, match="use aggregation mean"):
            parse_spec({"aggregation": "trimmed_mean", "optimizer": optimizer})
    assert parse_spec({"aggregation": "clipped_mean", "optimizer": "dp"}).aggregation.rule == "clipped_mean"


def test_dp_and_aggregation_mistakes_are_one_line_cli_errors(tmp_path):
    for args, needle in (
        (["--optimizer", "dp", "--H", "10"], "H must be 1"),
        (["--aggregation", "median"], "aggregation"),
    ):
        r = cli("swarm", "create", "--data-dir", str(tmp_path), *args)
        assert r.returncode == 2 and needle in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
