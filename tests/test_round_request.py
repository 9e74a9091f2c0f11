"""`RoundRequest` (collective/contract.py): a collective call's arguments, checked once when built."""

from dataclasses import FrozenInstanceError, replace

import pytest
import torch
import trio

from meshtrain.collective.contract import RoundRequest
from meshtrain.collective.local import LocalSwarm
from meshtrain.node.trust.adversary import AdversarialCollective

X = {"w": torch.ones(3)}


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("tensors", {"tensors": [torch.ones(3)]}),
        ("tensors", {"tensors": {"w": [1.0, 2.0]}}),
        ("tensors", {"tensors": {1: torch.ones(3)}}),
        ("tensors", {"tensors": {"w": torch.ones(3, device="meta")}}),  # off the host: CUDA's case on CPU
        ("round_id", {"round_id": -1}),
        ("round_id", {"round_id": 1.0}),
        ("round_id", {"round_id": True}),
        ("tag", {"tag": None}),
        ("codec", {"codec": "zstd"}),
        ("weight", {"weight": -0.5}),
        ("weight", {"weight": float("nan")}),
        ("weight", {"weight": float("inf")}),
        ("weight", {"weight": "1"}),
    ],
)
def test_request_refuses_a_bad_field_and_names_it(field, kwargs):
    args = {"tensors": X, "round_id": 3, **kwargs}
    with pytest.raises(ValueError, match=f"RoundRequest.{field}"):
        RoundRequest(**args)


def test_request_defaults_and_weight_zero_are_valid():
    r = RoundRequest(X, 0)
    assert (r.tag, r.codec, r.weight) == ("", "none", 1.0)
    assert RoundRequest({}, 5, "f0", "int8", 0).weight == 0


def test_request_is_frozen_and_replace_checks_again():
    r = RoundRequest(X, 3, "f0")
    with pytest.raises(FrozenInstanceError):
        r.tag = "other"  # type: ignore[misc]
    assert replace(r, tag="s1/" + r.tag).tag == "s1/f0"
    with pytest.raises(ValueError, match="RoundRequest.weight"):
        replace(r, weight=-1.0)


def test_one_request_serves_all_reduce_and_average_with():
    """NoLoCo asks for either with the same request; a pair's mean ignores the weight."""
    swarm = LocalSwarm(2, timeout=5)
    a, b = swarm.member(0), swarm.member(1)
    out: dict[str, object] = {}

    async def main():
        async with trio.open_nursery() as n:

            async def reduce(col, x, w):
                out[col.peer_id] = await col.all_reduce(RoundRequest({"w": x}, 1, weight=w))

            n.start_soon(reduce, a, torch.zeros(2), 1.0)
            n.start_soon(reduce, b, torch.full((2,), 4.0), 3.0)
        assert torch.equal(out[a.peer_id].tensors["w"], torch.full((2,), 3.0))
        async with trio.open_nursery() as n:

            async def pair(col, other, x):
                out[col.peer_id] = await col.average_with(other.peer_id, RoundRequest({"w": x}, 2, weight=0.0))

            n.start_soon(pair, a, b, torch.zeros(2))
            n.start_soon(pair, b, a, torch.full((2,), 4.0))
        assert torch.equal(out[b.peer_id].tensors["w"], torch.full((2,), 2.0))

    trio.run(main)


def test_a_wrapper_changes_one_field_of_the_request():
    """The adversary's hook replaces the contribution (`replace(request, tensors=...)`) and keeps the rest."""
    swarm = LocalSwarm(2, timeout=5)
    honest, zeros = swarm.member(0), AdversarialCollective(swarm.member(1), "zeros")
    out = {}

    async def main():
        async with trio.open_nursery() as n:

            async def reduce(name, col):
                out[name] = await col.all_reduce(RoundRequest({"w": torch.full((2,), 6.0)}, 4, "f0"))

            n.start_soon(reduce, "honest", honest)
            n.start_soon(reduce, "zeros", zeros)

    trio.run(main)
    assert torch.equal(out["honest"].tensors["w"], torch.full((2,), 3.0))
    assert out["honest"].digest == out["zeros"].digest


async def test_a_hook_that_returns_device_tensors_is_named_not_a_type_error_in_the_codec():
    """An outer optimizer whose pseudo_gradient leaves its tensors on a device (the meta device
    stands in for CUDA here) fails its round with the request's one-line ValueError naming the
    hook, before any byte is encoded."""
    from meshtrain.models import GPT, Corpus, GPTConfig
    from meshtrain.optim import DiLoCo

    class OnDevice(DiLoCo):
        def pseudo_gradient(self, names):
            return {k: v.to("meta") for k, v in super().pseudo_gradient(names).items()}

    corpus = Corpus.default()
    model = GPT(GPTConfig.tiny(corpus.vocab_size), seed=0)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = OnDevice(model, inner, LocalSwarm(1).member(0), H=1)
    x, y = corpus.batch(4, 16, seed=0, peer=0, step=0)
    model(x, y).loss.backward()
    async with outer:
        with pytest.raises(ValueError, match=r"on meta: a collective takes host \(CPU\) tensors.*pseudo_gradient"):
            await outer.astep()
