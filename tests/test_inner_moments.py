"""A joiner's fresh inner optimizer seeded with the donors' moments (optim/inner_moments.py): what
is described, what is seeded and how Adam then steps, hostile descriptions, the median."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.optim.inner_moments import MAX_MEAN, InnerMoments


def model_and_adamw(seed: int = 0, **kw) -> tuple[dict[str, torch.nn.Parameter], torch.optim.Optimizer]:
    torch.manual_seed(seed)
    params = {"w": torch.nn.Parameter(torch.randn(4, 3)), "b": torch.nn.Parameter(torch.randn(3))}
    return params, torch.optim.AdamW(params.values(), lr=1e-2, weight_decay=0.0, **kw)


def train(params, opt, steps: int, scale: float = 1.0) -> None:
    for _ in range(steps):
        for p in params.values():
            p.grad = torch.randn_like(p) * scale
        opt.step()


def test_an_adamw_is_described_by_its_mean_second_moments_and_step():
    params, opt = model_and_adamw()
    assert InnerMoments.of(opt, params) is None  # no step yet: nothing to describe
    train(params, opt, 5, scale=3.0)
    m = InnerMoments.of(opt, params)
    assert m is not None and m.step == 5
    for name, p in params.items():
        assert m.means[name] == pytest.approx(float(opt.state[p]["exp_avg_sq"].mean()))
    sgd = torch.optim.SGD(params.values(), lr=0.1)
    assert InnerMoments.of(sgd, params) is None and InnerMoments.of(None, params) is None


def test_a_seeded_adamw_takes_the_step_adam_takes_from_those_moments():
    veteran, vopt = model_and_adamw(1)
    train(veteran, vopt, 50, scale=10.0)  # a history of large gradients: large second moments
    moments = InnerMoments.of(vopt, veteran)
    params, opt = model_and_adamw(2)
    assert moments.seed(opt, params) == 2
    for name, p in params.items():
        st_ = opt.state[p]
        assert int(st_["step"]) == 50 and torch.all(st_["exp_avg"] == 0)
        assert torch.allclose(st_["exp_avg_sq"], torch.full_like(p, moments.means[name]))
    before = {n: p.detach().clone() for n, p in params.items()}
    grads = {n: torch.randn_like(p) for n, p in params.items()}
    for n, p in params.items():
        p.grad = grads[n].clone()
    opt.step()
    beta1, beta2, lr, eps = 0.9, 0.999, 1e-2, 1e-8
    t = 51
    for n, p in params.items():
        m = (1 - beta1) * grads[n] / (1 - beta1**t)
        v = (beta2 * moments.means[n] + (1 - beta2) * grads[n] ** 2) / (1 - beta2**t)
        expected = before[n] - lr * m / (v.sqrt() + eps)
        assert torch.allclose(p.detach(), expected, atol=1e-6), n
    # The veteran's scale, not a fresh Adam's ~lr·sign(g) per coordinate.
    fresh, fopt = model_and_adamw(2)
    for n, p in fresh.items():
        p.grad = grads[n].clone()
    fopt.step()
    seeded_step = sum(float((params[n].detach() - before[n]).norm()) for n in params)
    fresh_step = sum(float((fresh[n].detach() - before[n]).norm()) for n in fresh)
    assert seeded_step < fresh_step / 3, (seeded_step, fresh_step)


def test_seeding_leaves_state_that_exists_and_names_it_was_not_told():
    params, opt = model_and_adamw()
    params["w"].grad = torch.ones_like(params["w"])
    opt.step()  # w has state of its own (a peer that re-syncs keeps it), b none
    own = opt.state[params["w"]]["exp_avg_sq"].clone()
    assert InnerMoments(7, {"w": 5.0, "b": 2.0}).seed(opt, params) == 1
    assert torch.equal(opt.state[params["w"]]["exp_avg_sq"], own)
    assert float(opt.state[params["b"]]["exp_avg_sq"][0]) == 2.0
    params2, opt2 = model_and_adamw()
    assert InnerMoments(7, {"other": 1.0}).seed(opt2, params2) == 0 and not opt2.state
    assert InnerMoments(7, {"w": 1.0}).seed(torch.optim.SGD(params2.values(), lr=0.1), params2) == 0


def test_amsgrad_and_bf16_parameters_are_seeded_in_their_own_dtype():
    params, opt = model_and_adamw(amsgrad=True)
    InnerMoments(3, {"w": 0.5, "b": 0.25}).seed(opt, params)
    assert float(opt.state[params["b"]]["max_exp_avg_sq"][0]) == 0.25
    train(params, opt, 1)
    p = torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    adam = torch.optim.Adam([p])
    InnerMoments(3, {"p": 0.5}).seed(adam, {"p": p})
    assert adam.state[p]["exp_avg_sq"].dtype == torch.bfloat16
    p.grad = torch.randn_like(p)
    adam.step()
    assert torch.isfinite(p).all()


def test_the_median_keeps_a_lying_minority_inside_the_honest_range():
    honest = [InnerMoments(100, {"w": 1.0, "b": 2.0}), InnerMoments(120, {"w": 1.5, "b": 2.5})]
    liar = InnerMoments(1, {"w": 0.0, "b": MAX_MEAN, "extra": 9.0})
    m = InnerMoments.median([*honest, liar])
    assert 1.0 <= m.means["w"] <= 1.5 and 2.0 <= m.means["b"] <= 2.5 and m.step == 100
    assert InnerMoments.median([]) is None


@pytest.mark.parametrize(
    "raw",
    [
        None,
        [],
        {"step": 0, "means": {"w": 1.0}},
        {"step": True, "means": {"w": 1.0}},
        {"step": 2**41, "means": {"w": 1.0}},
        {"step": 3, "means": {}},
        {"step": 3, "means": {"w": math.nan}},
        {"step": 3, "means": {"w": -1.0}},
        {"step": 3, "means": {"w": math.inf}},
        {"step": 3, "means": {"w": "1"}},
        {"step": 3, "means": {1: 1.0}},
        {"step": 3, "means": {"": 1.0}},
        {"step": 3, "means": {"x" * 600: 1.0}},
        {"step": 3, "means": [["w", 1.0]]},
    ],
)
def test_a_malformed_description_is_ignored(raw):
    assert InnerMoments.from_wire(raw) is None


def test_a_huge_mean_is_capped_and_a_description_round_trips():
    m = InnerMoments.from_wire({"step": 3, "means": {"w": 1e30, "b": 2}})
    assert m == InnerMoments(3, {"w": MAX_MEAN, "b": 2.0})
    assert InnerMoments.from_wire(m.to_wire()) == m


wire_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(raw=wire_values)
def test_any_description_parses_or_is_ignored(raw):
    m = InnerMoments.from_wire(raw)
    assert m is None or (m.step >= 1 and all(0 <= v <= MAX_MEAN for v in m.means.values()))
