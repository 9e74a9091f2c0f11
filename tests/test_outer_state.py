"""A state a peer loads — from a donor it does not know, or its own disk — is checked before any
of our tensors changes (optim/outer_state.py): whatever arrives either loads and trains, or is
refused as `OuterStateError` (a skeleton that does not unflatten: `MalformedStateError`), never
another exception, now or at the next outer step."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshtrain.collective.local import LocalSwarm
from meshtrain.node.state.checkpoint import MalformedStateError, flatten_state, unflatten_state
from meshtrain.optim import DataParallel, DiLoCo, OuterOptimizer
from meshtrain.optim.outer_state import OuterStateError

property_settings = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class OuterAdam(OuterOptimizer):
    """An outer optimizer of a user's own, as a `py:` class would be: AdamW over φ (betas, a step
    count per parameter)."""

    def build_outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=0.1, betas=(0.8, 0.9))


def diloco() -> OuterOptimizer:
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    return DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), LocalSwarm(1).member(0), H=1, lr=0.7, momentum=0.9)


def adam() -> OuterOptimizer:
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    return OuterAdam(m, torch.optim.SGD(m.parameters(), lr=0.1), LocalSwarm(1).member(0), H=1)


async def train_step(outer: OuterOptimizer) -> None:
    """One inner step, which with H = 1 is an outer round too (its outer step reads the state)."""
    async with outer:
        outer.model(torch.ones(1, 3)).sum().backward()
        await outer.astep()
        outer.zero_grad()


async def trained_state(make) -> dict[str, Any]:
    """A donor's state after two rounds: the outer optimizer's per-parameter state exists."""
    donor = make()
    for _ in range(2):
        await train_step(donor)
    return donor.state_dict(inner=False)


def phi(outer: OuterOptimizer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in outer.outer_params.items()}


def refused(outer: OuterOptimizer, state: Any, match: str) -> None:
    before = phi(outer)
    with pytest.raises(OuterStateError, match=match):
        outer.join(state)
    assert all(torch.equal(before[n], t) for n, t in outer.outer_params.items()), "refused, yet φ changed"


def put(state: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        state = state[key]
    state[path[-1]] = value


async def test_a_trained_state_loads_and_steps_for_each_outer_optimizer():
    for make in (diloco, adam):
        state = await trained_state(make)
        joiner = make()
        joiner.join(state)
        await train_step(joiner)


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        (("outer_optimizer", "state", 0, "momentum_buffer"), torch.zeros(5), "'momentum_buffer' of parameter 0"),
        (("outer_optimizer", "state", 7), {"momentum_buffer": torch.zeros(2)}, "a parameter this optimizer lacks"),
        (("outer_optimizer", "state"), 3, "not a torch optimizer state"),
        (("outer_optimizer", "param_groups"), [], "other parameter groups"),
        (("outer_optimizer", "param_groups", 0, "params"), [0, 1, 2], "groups other parameters"),
        (("outer_optimizer", "param_groups", 0, "lr"), "x", "'lr' is 'x'"),
        (("outer_optimizer", "param_groups", 0, "momentum"), math.nan, "'momentum' is 'nan'"),
        (("outer_optimizer", "param_groups", 0, "nesterov"), "yes", "'nesterov'"),
        (("outer_optimizer", "param_groups", 0, "a_newer_torchs_flag"), [1, 2], "'a_newer_torchs_flag'"),
        (("outer_optimizer",), None, "outer optimizer does not match"),
        (("outer_params", "weight"), torch.zeros(3, 2), "weight has the wrong shape"),
        (("outer_params", "weight"), [[0.0] * 3] * 2, "weight has the wrong shape"),
        (("inner_steps",), "12", "inner_steps must be a non-negative integer"),
        (("rounds",), -1, "rounds must be a non-negative integer"),
        (("H",), 2, "different H"),
        (("format",), "meshtrain.outer/0", "not a meshtrain.outer/1 state"),
    ],
)
async def test_a_hostile_state_is_refused_naming_what_differs_and_changes_nothing(path, value, match):
    state = copy.deepcopy(await trained_state(diloco))
    put(state, path, value)
    refused(diloco(), state, match)


async def test_adam_betas_and_step_counts_are_checked_too():
    good = await trained_state(adam)
    state = copy.deepcopy(good)
    put(state, ("outer_optimizer", "param_groups", 0, "betas"), [0.8])
    refused(adam(), state, "'betas'")
    state = copy.deepcopy(good)
    put(state, ("outer_optimizer", "state", 1, "exp_avg_sq"), torch.zeros(2, 3))
    refused(adam(), state, "'exp_avg_sq' of parameter 1")


async def test_a_state_from_another_torch_release_with_a_flag_ours_lacks_loads():
    state = copy.deepcopy(await trained_state(diloco))
    put(state, ("outer_optimizer", "param_groups", 0, "a_newer_torchs_flag"), False)
    joiner = diloco()
    joiner.join(state)
    await train_step(joiner)


def paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a state a value can be swapped (dict values and list items, nested)."""
    out = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        out.append((*prefix, key))
        out.extend(paths(value, (*prefix, key)))
    return out


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
)
tensors = st.sampled_from([(), (1,), (2,), (5,), (2, 3), (3, 2)]).map(lambda shape: torch.ones(shape))
values = st.recursive(
    st.one_of(scalars, tensors),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["lr", "params", 0, 1]), inner),
    max_leaves=6,
)
GOOD: dict[str, Any] = {}


@property_settings
@given(data=st.data())
async def test_any_value_anywhere_in_a_state_is_refused_or_loads_and_steps(data):
    if not GOOD:
        GOOD.update(await trained_state(diloco))
    state = copy.deepcopy(GOOD)
    path = data.draw(st.sampled_from(paths(state)))
    put(state, path, data.draw(values))
    joiner = diloco()
    try:
        joiner.join(state)
    except OuterStateError:
        return
    await train_step(joiner)


@property_settings
@given(
    skeleton=st.recursive(
        st.one_of(scalars, st.binary(max_size=4)),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(st.sampled_from(["__dict__", "__tensor__", "x"]), inner, max_size=2)
        ),
        max_leaves=12,
    )
)
def test_any_skeleton_unflattens_or_is_malformed(skeleton):
    try:
        state = unflatten_state(skeleton, {"t": torch.zeros(2)})
    except MalformedStateError:
        return
    again, flat = flatten_state(state)  # what unflattens is a state: it round-trips
    assert same(unflatten_state(again, flat), state)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    return a == b or a != a and b != b  # NaN is itself here


def test_a_flattened_state_unflattens_to_itself_and_a_deep_one_is_malformed():
    state = {"a": [1, 2.5, None, "x", {"t": torch.arange(3.0)}], 0: {"b": torch.zeros(2, 2)}}
    skeleton, flat = flatten_state(state)
    back = unflatten_state(skeleton, flat)
    assert back.keys() == state.keys() and back["a"][:4] == state["a"][:4]
    assert torch.equal(back["a"][4]["t"], state["a"][4]["t"]) and torch.equal(back[0]["b"], state[0]["b"])
    deep: Any = 1
    for _ in range(100):
        deep = [deep]
    with pytest.raises(MalformedStateError, match="deeper"):
        unflatten_state(deep, {})
    with pytest.raises(MalformedStateError, match="does not hold"):
        unflatten_state({"__tensor__": "missing"}, flat)


class Factored(torch.optim.Optimizer):
    """A user's optimizer: its constructor needs `rank`, so no twin of it is built, and it keeps
    state of its own shapes (a row and a column vector per tensor, as a factored moment would) and
    a hyper-parameter that is a dict."""

    def __init__(self, params, rank: int, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr, "rank": rank, "extra": {"decay": 0.5}})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["row"], state["col"] = torch.zeros(p.shape[0]), torch.zeros(p.shape[-1])
                state["row"].add_(p.grad.reshape(p.shape[0], -1).mean(1))
                state["col"].add_(p.grad.reshape(-1, p.shape[-1]).mean(0))
                p.add_(p.grad, alpha=-group["lr"])


class OuterFactored(OuterOptimizer):
    def build_outer_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return Factored(params, rank=2)


def factored() -> OuterOptimizer:
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    return OuterFactored(m, torch.optim.SGD(m.parameters(), lr=0.1), LocalSwarm(1).member(0), H=1)


async def test_a_users_optimizer_of_its_own_shapes_loads_and_only_its_structure_is_checked():
    good = await trained_state(factored)
    assert good["outer_optimizer"]["state"][0]["col"].shape == (3,)  # neither param-shaped nor one value
    joiner = factored()
    joiner.join(copy.deepcopy(good))
    await train_step(joiner)
    state = copy.deepcopy(good)
    put(state, ("outer_optimizer", "state", 0, "row"), [0.0, 0.0])
    refused(factored(), state, "'row' of parameter 0")
    state = copy.deepcopy(good)
    put(state, ("outer_optimizer", "param_groups", 0, "extra"), "decay")
    refused(factored(), state, "'extra'")


async def test_a_dp_donors_inner_optimizer_state_is_checked_whole_too():
    def dp() -> OuterOptimizer:
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 2)
        return DataParallel(m, torch.optim.AdamW(m.parameters(), lr=0.01), LocalSwarm(1).member(0))

    good = await trained_state(dp)
    joiner = dp()
    joiner.join(copy.deepcopy(good))
    await train_step(joiner)
    state = copy.deepcopy(good)
    put(state, ("inner", "state", 0, "exp_avg"), torch.zeros(3, 2))
    refused(dp(), state, "state's inner optimizer 'exp_avg' of parameter 0")
