"""A round's flat input without a copy: an outer optimizer writes Δ into one flat buffer, and the
collective takes it as its flat fp32 vector as it is (collective/flat.py `flat_view`,
collective/contribution.py) — 4 bytes per parameter less at every round's peak."""

from __future__ import annotations

import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.collective import LocalSwarm
from meshtrain.collective.contribution import Contribution
from meshtrain.collective.flat import flat_view, flatten_fp32
from meshtrain.optim import DiLoCo, NoLoCo

from .test_outer_diloco import tiny


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=5),
    gap=st.integers(0, 2),
    where=st.integers(0, 4),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    transpose=st.booleans(),
)
def test_a_flat_view_is_the_flattened_input_itself_or_nothing(sizes, gap, where, dtype, transpose):
    """Views back to back in one fp32 storage come back as one view of that memory; anything
    else (a gap, another dtype, a non-contiguous tensor, separate storages) as None, and the
    caller flattens a copy. Whatever comes back equals `flatten_fp32`."""
    buf = torch.arange(sum(sizes) + gap + 4, dtype=torch.float32).to(dtype)
    tensors, pos = {}, 0
    for i, n in enumerate(sizes):
        if i == where % len(sizes):
            pos += gap  # a hole in the layout (none when gap is 0)
        tensors[f"t{i}"] = buf[pos : pos + n]
        pos += n
    if transpose and sizes[0] >= 4:
        tensors["t0"] = buf[: sizes[0] - sizes[0] % 2].view(2, -1).t()  # not contiguous
    view = flat_view(tensors)
    contiguous = all(t.is_contiguous() for t in tensors.values())
    if view is None:
        assert dtype != torch.float32 or gap or not contiguous or (transpose and sizes[0] >= 4)
        return
    assert torch.equal(view, flatten_fp32(tensors))
    assert view.numel() == 0 or view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def test_separate_tensors_are_not_a_flat_view():
    assert flat_view({"a": torch.zeros(3), "b": torch.zeros(2)}) is None
    assert flat_view({}) is None


def test_diloco_and_noloco_hand_the_collective_their_delta_as_one_buffer():
    model = tiny()
    diloco = DiLoCo(model, None, LocalSwarm(1).member(0), H=1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    names = list(diloco.outer_params)
    delta = diloco.pseudo_gradient(names)
    view = flat_view(delta)
    assert view is not None and view.numel() == sum(t.numel() for t in delta.values())
    for n in names:
        assert torch.equal(delta[n], diloco.outer_params[n] - dict(model.named_parameters())[n].detach())
    noloco = NoLoCo(tiny(), None, LocalSwarm(2).member(0), H=1)
    both = noloco.pseudo_gradient(list(noloco.outer_params))
    assert flat_view(both) is not None and len(both) == 2 * len(noloco.outer_params)
    for n, phi in noloco.outer_params.items():
        assert torch.equal(both["phi/" + n], phi)  # φ itself, after every Δ


async def test_non_finite_input_contributes_zeros_of_its_own_and_leaves_the_callers_memory():
    buf = torch.tensor([1.0, float("nan"), 3.0, 4.0])
    tensors = {"a": buf[:2], "b": buf[2:]}
    contribution = Contribution(tensors, 1.0, round_id=1)
    async with trio.open_nursery() as nursery:
        contribution.start(nursery)
    flat, weight = await contribution.ready()
    assert weight == 0.0 and torch.equal(flat, torch.zeros(4))
    assert buf[0] == 1.0 and buf[3] == 4.0  # the caller's Δ is not zeroed
    whole = torch.arange(4.0)
    finite = {"a": whole[:2], "b": whole[2:]}
    ok = Contribution(finite, 1.0, round_id=2)
    async with trio.open_nursery() as nursery:
        ok.start(nursery)
    flat, weight = await ok.ready()
    assert weight == 1.0 and flat.untyped_storage().data_ptr() == finite["a"].untyped_storage().data_ptr()
