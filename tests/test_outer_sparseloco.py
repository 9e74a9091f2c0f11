"""SparseLoCo, error feedback and the sparse wire format: the codec's layout and
validation, error feedback's invariants (a hypothesis property), docs/algorithms.md's identity
(density 1, no quantisation, β = 0 is DiLoCo with momentum 0), what a joiner gets, the
aggregation's byte rule, the gather through every wrapper of a `SwarmCollective` on real hosts,
and bit-identical φ across 4 real peer processes."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.collective import LocalSwarm
from meshtrain.collective.allreduce import AllReduceConfig, SwarmCollective
from meshtrain.collective.compression import get_codec
from meshtrain.collective.sparse_codec import ChunkedTopK, SparseCodecError, _pack12, _unpack12
from meshtrain.errors import ConfigError
from meshtrain.optim import DiLoCo, OuterOptimizer, SparseLoCo

from .conftest import start_peers
from .test_grouped_rounds import WRAPPERS
from .test_outer_diloco import eval_loss, sgd, simulate, tiny, workers

# -- the wire format ------------------------------------------------------------------------------


def test_chunked_topk_keeps_k_per_chunk_and_sends_14_bits_per_value():
    c = ChunkedTopK(chunk=4096, k=64, bits=2)
    x = torch.randn(3 * 4096 + 100)
    parts = c.encode(x)
    assert {k: (v.dtype, v.numel()) for k, v in parts.items()} == {k: spec for k, spec in c.layout(x.numel()).items()}
    K = 3 * 64 + 2  # the short last chunk keeps ceil(64·100/4096) = 2
    assert c.num_kept(x.numel()) == K
    assert c.encoded_nbytes(x.numel()) == -(-12 * K // 8) + -(-K // 4) + 16
    dense = c.decode(parts, x.shape)
    for j in range(3):
        chunk = dense[j * 4096 : (j + 1) * 4096]
        kept = chunk.nonzero().view(-1)
        assert kept.numel() <= 64
        top = x[j * 4096 : (j + 1) * 4096].abs().topk(64).indices
        assert set(kept.tolist()) <= set(top.tolist())
    big = 4096 * 256
    assert big * 4 / c.encoded_nbytes(big) > 145  # ~146x fewer bytes than fp32


def test_unquantised_full_density_is_lossless():
    c = ChunkedTopK(chunk=32, k=32, bits=None)
    x = torch.randn(5, 19)
    assert torch.equal(c.decode(c.encode(x), x.shape), x)


def test_two_bit_values_are_their_bins_means_and_keep_the_sign_of_large_values():
    c = ChunkedTopK(chunk=1024, k=32, bits=2)
    x = torch.randn(1024)
    where, values = c.decode_sparse(c.encode(x), 1024)
    assert set(where.tolist()) == set(x.abs().topk(32).indices.tolist())
    assert len(set(values.tolist())) <= 4
    assert bool((torch.sign(values) == torch.sign(x[where])).float().mean() > 0.9)


@given(st.lists(st.integers(0, 4095), min_size=0, max_size=40))
def test_twelve_bit_index_packing_round_trips(idx):
    t = torch.tensor(idx, dtype=torch.int64)
    packed = _pack12(t)
    assert packed.numel() == -(-12 * len(idx) // 8)
    assert torch.equal(_unpack12(packed, len(idx)), t)


def test_decode_rejects_malformed_parts():
    c = ChunkedTopK(chunk=64, k=4, bits=2)
    parts = c.encode(torch.randn(128))
    with pytest.raises(SparseCodecError):
        c.decode({**parts, "levels": torch.tensor([float("nan"), 0, 0, 0])}, (128,))
    with pytest.raises(SparseCodecError):
        c.decode({k: v for k, v in parts.items() if k != "levels"}, (128,))
    with pytest.raises(SparseCodecError):
        c.decode({**parts, "idx": parts["idx"][:-1]}, (128,))
    dup = ChunkedTopK(chunk=64, k=4, bits=None)
    p = dup.encode(torch.randn(64))
    p["idx"] = _pack12(torch.tensor([3, 3, 5, 9]))  # not strictly increasing
    with pytest.raises(SparseCodecError):
        dup.decode(p, (64,))
    with pytest.raises(SparseCodecError):
        c.encode(torch.tensor([1.0, float("inf")]))
    with pytest.raises(ConfigError):
        ChunkedTopK(chunk=64, k=65)


# -- error feedback in the base class -----------------------------------------------------------


class _Fed(OuterOptimizer):
    """The base class with error feedback and the given codec (its default `compress`)."""


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["topk", "int4", "fp4"]), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_error_feedback_beta_1_carries_exactly_what_the_codec_dropped(codec, rounds, seed):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(16, 8)
    outer = _Fed(model, None, LocalSwarm(1).member(0), H=1, codec=codec)
    outer.error_feedback = 1.0
    names = list(outer.params)
    c = get_codec(codec)
    total_delta = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in outer.params.items()}
    total_sent = {n: torch.zeros_like(t) for n, t in total_delta.items()}
    for _ in range(rounds):
        delta = {n: torch.randn(p.shape, generator=g) for n, p in outer.params.items()}
        before = {n: outer.residual.get(n, torch.zeros_like(delta[n])).clone() for n in names}
        sent = outer.feed_back(delta, names)
        for n in names:
            acc = before[n] + delta[n]
            # the residual is exactly what the codec dropped of e + Δ
            assert torch.equal(outer.residual[n], acc - c.decode(c.encode(acc), acc.shape, torch.float32))
            assert torch.equal(sent[n], c.decode(c.encode(acc), acc.shape, torch.float32))
            total_delta[n] += delta[n]
            total_sent[n] += sent[n]
    for n in names:  # over R rounds: Σ sent + e = Σ Δ
        torch.testing.assert_close(total_sent[n] + outer.residual[n], total_delta[n], atol=1e-5, rtol=1e-5)


def test_sparseloco_residual_is_zero_where_sent_and_the_accumulator_elsewhere():
    model = torch.nn.Linear(64, 64, bias=False)
    outer = SparseLoCo(model, None, LocalSwarm(1).member(0), H=1, chunk=256, k=8, bits=None, beta=0.5)
    e0 = torch.randn(64, 64)
    outer.residual["weight"] = e0.clone()
    delta = torch.randn(64, 64)
    payload = outer.feed_back({"weight": delta}, ["weight"])
    acc = 0.5 * e0 + delta
    sent = outer._sent[("weight",)]["weight"]
    kept = sent != 0
    assert int(kept.sum()) == 16 * 8
    assert torch.equal(sent[kept], acc[kept]) and bool((outer.residual["weight"][kept] == 0).all())
    assert torch.equal(outer.residual["weight"][~kept], acc[~kept])
    assert set(payload) == {"weight|idx", "weight|codes"}


# -- the identity and the swarm (simulated) --------------------------------------------------------


@pytest.mark.parametrize("aggregation,aggregate", [("gather", "index_mean"), ("gather", "mean"), ("allreduce", "mean")])
async def test_density_1_no_quantisation_beta_0_is_diloco_momentum_0_bit_for_bit(aggregation, aggregate):
    k, steps = 4, 12
    _, models, outers = workers(
        k,
        lambda m, o, c: SparseLoCo(
            m, o, c, H=3, lr=0.7, beta=0.0, chunk=64, k=64, bits=None, aggregation=aggregation, aggregate=aggregate
        ),
    )
    await simulate(outers, models, steps)
    _, ref_models, refs = workers(k, lambda m, o, c: DiLoCo(m, o, c, H=3, lr=0.7, momentum=0.0))
    await simulate(refs, ref_models, steps)
    assert outers[0].rounds == steps // 3
    for i in range(k):
        for n in outers[i].outer_params:
            assert torch.equal(outers[i].outer_params[n], refs[i].outer_params[n]), n
        for p, q in zip(models[i].parameters(), ref_models[i].parameters(), strict=True):
            assert torch.equal(p, q)


async def test_sparse_swarm_keeps_phi_identical_and_learns_with_a_fraction_of_the_bytes():
    k = 4
    _, models, outers = workers(
        k,
        lambda m, o, c: SparseLoCo(m, o, c, H=4, lr=1.0, chunk=256, k=8),
        inner=lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3),
    )
    before = eval_loss(models[0])
    await simulate(outers, models, 40)
    for o in outers[1:]:
        for n, phi in o.outer_params.items():
            assert torch.equal(phi, outers[0].outer_params[n])
    assert outers[0].last_aggregation == "gather"
    with outers[0].outer_weights():
        assert eval_loss(models[0]) < before - 0.3
    numel = sum(p.numel() for p in outers[0].outer_params.values())
    dense = 10 * 2 * (k - 1) / k * 4 * numel  # 10 rounds of a lossless all-reduce
    assert outers[0].bytes_sent * 8 < dense
    assert outers[0].residual and all(bool(e.abs().sum() > 0) for e in outers[0].residual.values())


def test_aggregation_follows_the_bytes_at_n_peers():
    model = torch.nn.Linear(256, 256, bias=False)  # 65536 values
    o = SparseLoCo(model, None, LocalSwarm(1).member(0), H=1, aggregate="mean")
    payload = o.sparse.encoded_nbytes(65536)
    assert o.choose_aggregation(4, ["weight"]) == "gather"
    n_even = 8 * 65536 // payload
    assert o.choose_aggregation(n_even, ["weight"]) == "gather"
    assert o.choose_aggregation(n_even + 1, ["weight"]) == "allreduce"
    assert 250 < n_even < 300  # ~292 peers at 1.56 % (sparse_gather.py)
    both = SparseLoCo(model, None, LocalSwarm(1).member(0), H=1)  # index_mean: values and mask
    assert both.choose_aggregation(2 * n_even, ["weight"]) == "gather"
    assert both.choose_aggregation(2 * n_even + 2, ["weight"]) == "allreduce"


async def test_dense_index_mean_matches_the_gather():
    """Above the break-even N the index mean travels densely (values and a mask): same update."""
    runs = []
    for aggregation in ("gather", "allreduce"):
        _, models, outers = workers(
            4, lambda m, o, c, a=aggregation: SparseLoCo(m, o, c, H=3, chunk=256, k=8, aggregation=a)
        )
        await simulate(outers, models, 6)
        runs.append(outers[0])
    assert runs[1].last_aggregation == "allreduce"
    for n, phi in runs[0].outer_params.items():
        torch.testing.assert_close(runs[1].outer_params[n], phi, atol=1e-6, rtol=1e-5)


async def test_a_peer_that_leaves_mid_gather_is_out_for_every_survivor():
    k = 4
    swarm, models, outers = workers(k, lambda m, o, c: SparseLoCo(m, o, c, H=2, chunk=256, k=8), timeout=2.0)
    await simulate(outers, models, 2)
    swarm.kill(swarm.members[3])
    await simulate(outers[:3], models[:3], 2, start=2)
    last = [o.history[-1] for o in outers[:3]]
    assert {r.contributors for r in last} == {3}
    for o in outers[1:3]:
        for n, phi in o.outer_params.items():
            assert torch.equal(phi, outers[0].outer_params[n])


async def test_late_joiner_gets_phi_and_outer_state_but_no_residual():
    k = 2
    swarm, models, outers = workers(k, lambda m, o, c: SparseLoCo(m, o, c, H=2, chunk=256, k=8))
    await simulate(outers, models, 4)
    donor = outers[0]
    assert donor.residual
    shared = donor.state_dict(inner=False)
    assert "residual" not in shared
    joiner_model = tiny(seed=5)
    joiner = SparseLoCo(
        joiner_model, torch.optim.SGD(joiner_model.parameters(), lr=0.05), swarm.add(), H=2, chunk=256, k=8
    )
    joiner.residual = {n: torch.ones_like(t) for n, t in joiner.outer_params.items()}  # stale, its own
    joiner.join(shared)
    assert joiner.residual == {}
    for n, phi in donor.outer_params.items():
        assert torch.equal(joiner.outer_params[n], phi)
        assert torch.equal(dict(joiner_model.named_parameters())[n], phi)
    # a checkpoint (inner=True) is this peer's own: it keeps the residual, bit for bit
    ckpt = donor.state_dict(inner=True)
    assert set(ckpt["residual"]) == set(donor.residual)
    other = SparseLoCo(tiny(), None, LocalSwarm(1).member(0), H=2, chunk=256, k=8)
    other.load_state_dict(ckpt)
    for n, e in donor.residual.items():
        assert torch.equal(other.residual[n], e)
    # and joining with a full checkpoint still leaves the residual behind
    other.join(ckpt)
    assert other.residual == {}


def test_bad_options_are_rejected():
    m = torch.nn.Linear(2, 2)
    c = LocalSwarm(1).member(0)
    with pytest.raises(ValueError):
        SparseLoCo(m, None, c, H=1, beta=1.5)
    with pytest.raises(ValueError):
        SparseLoCo(m, None, c, H=1, aggregation="ring")
    with pytest.raises(ValueError):
        SparseLoCo(m, None, c, H=1, aggregate="sum")


async def test_index_mean_aggregation_averages_each_index_over_its_senders():
    """The reference code's rule: an index sent by one peer of two is not halved."""
    swarm = LocalSwarm(2)
    models = [torch.nn.Linear(4, 1, bias=False) for _ in range(2)]
    for m in models:
        with torch.no_grad():
            m.weight.zero_()
    outers = [
        SparseLoCo(m, None, swarm.member(i), H=1, lr=1.0, beta=0.0, chunk=4, k=1, bits=None, aggregate="index_mean")
        for i, m in enumerate(models)
    ]
    with torch.no_grad():
        models[0].weight.copy_(torch.tensor([[-1.0, 0.0, 0.0, 0.0]]))  # Δ_0 = e_0 at index 0: 1
        models[1].weight.copy_(torch.tensor([[0.0, 0.0, -2.0, 0.0]]))  # Δ_1 at index 2: 2
    async with trio.open_nursery() as nursery:
        for o in outers:
            nursery.start_soon(o.astep)
    assert outers[0].outer_params["weight"].tolist() == [[-1.0, 0.0, -2.0, 0.0]]


# -- real peers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
async def test_the_sparse_gather_runs_through_every_wrapper_of_a_swarm_collective(wrapper):
    """Real hosts on loopback: SparseLoCo's all-gather is a capability of `SwarmCollective`
    (`GathersPayloads`) that a wrapper must forward like any other; one that hid it left every
    peer to proceed alone, round after round."""
    k = 3
    async with AsyncExitStack() as stack:
        peers = sorted(await start_peers(stack, k, full_mesh=True), key=lambda p: p.id)
        ids = [p.id for p in peers]
        models, outers = [], []
        for p in peers:
            col = await stack.enter_async_context(
                SwarmCollective(p.host, p.ts, lambda r: ids, AllReduceConfig(join_timeout=5))
            )
            model = tiny()
            models.append(model)
            outers.append(SparseLoCo(model, sgd(model), WRAPPERS[wrapper](col), H=2, chunk=256, k=8))
        with trio.fail_after(60):
            await simulate(outers, models, 2)
    assert [o.last_aggregation for o in outers] == ["gather"] * k
    assert [o.history[-1].contributors for o in outers] == [k] * k
    for o in outers[1:]:
        for n, phi in o.outer_params.items():
            assert torch.equal(phi, outers[0].outer_params[n])


async def test_a_gather_gives_up_on_a_peer_that_ended_the_round_without_us():
    """Real hosts: the third peer ran round 7 alone (its view of the members left the others
    out, as a peer's does for a joiner whose record has not reached it yet), then counts them in.
    The other two, whose round 7 includes it, ask it where it is and give up on it within
    seconds, not after their transfers' deadline (30 s here; CI saw such a round wait 20 s)."""
    async with AsyncExitStack() as stack:
        peers = sorted(await start_peers(stack, 3, full_mesh=True), key=lambda p: p.id)
        ids = [p.id for p in peers]
        views = [ids, ids, [ids[2]]]
        config = AllReduceConfig(join_timeout=5, part_timeout=30)
        cols = [
            await stack.enter_async_context(SwarmCollective(p.host, p.ts, lambda r, i=i: views[i], config))
            for i, p in enumerate(peers)
        ]

        def payload(i: int) -> dict[str, torch.Tensor]:
            return {"v": torch.full((64,), float(i))}

        alone = await cols[2].all_gather(payload(2), round_id=7, tag="t")
        assert list(alone.payloads) == [ids[2]]
        views[2] = ids  # its record of the others arrives
        results = {}

        async def gather(i: int) -> None:
            results[i] = await cols[i].all_gather(payload(i), round_id=7, tag="t")

        t0 = trio.current_time()
        with trio.fail_after(25):
            async with trio.open_nursery() as nursery:
                for i in (0, 1):
                    nursery.start_soon(gather, i)
        took = trio.current_time() - t0
    assert took < 15, took
    for i in (0, 1):
        assert sorted(results[i].payloads) == ids[:2]
        assert results[i].excluded[ids[2]] == "it was past this round's exchange"
        assert torch.equal(results[i].payloads[ids[1]]["v"], payload(1)["v"])


@pytest.mark.slow
def test_four_real_peers_hold_bit_identical_phi(tmp_path):
    from .conftest import tail
    from .test_outer_swarm import run_swarm

    finals, logs = run_swarm(
        tmp_path,
        "sparseloco",
        4,
        ["--steps", "20", "--H", "5", "--outer-lr", "1.0", "--sparse-chunk", "1024", "--sparse-k", "16"],
    )
    assert all(f is not None for f in finals), "\n".join(tail(p) for p in logs)
    assert len({f["phi_digest"] for f in finals}) == 1
    for f in finals:
        assert f["contributors"] == [4, 4, 4, 4] and not f["errors"]
        assert f["final_eval_loss"] < 4.2  # learning (4.55 at init)
    numel = sum(p.numel() for p in tiny().parameters())
    dense = 4 * 2 * 3 / 4 * 4 * numel  # 4 rounds of a lossless all-reduce among 4 peers
    assert finals[0]["stats"]["bytes_sent"] * 20 < dense


@pytest.mark.slow
def test_peer_killed_mid_gather_is_excluded_or_included_by_every_survivor_alike(tmp_path):
    from .conftest import tail
    from .test_outer_swarm import run_swarm

    steps, kill_at = 30, 10
    finals, logs = run_swarm(
        tmp_path,
        "sparseloco",
        4,
        [
            "--steps",
            str(steps),
            "--H",
            "5",
            "--outer-lr",
            "1.0",
            "--sparse-chunk",
            "1024",
            "--sparse-k",
            "16",
            "--victim-rank",
            "1",
            "--kill-at-step",
            str(kill_at),
        ],
    )
    survivors = [f for f in finals if f is not None]
    assert len(survivors) == 3, "\n".join(tail(p) for p in logs)
    assert len({f["phi_digest"] for f in survivors}) == 1
    for f in survivors:
        assert f["stats"]["inner_steps"] == steps
        rounds = dict(zip(f["steps_of_rounds"], f["contributors"], strict=True))
        assert all(c == 4 for s, c in rounds.items() if s < kill_at)
        assert rounds[kill_at] in (3, 4)
        assert all(c == 3 for s, c in rounds.items() if s > kill_at)
    assert len({tuple(f["contributors"]) for f in survivors}) == 1


# -- selectable from the swarm spec, the CLI and the demo --------------------------------------


def test_swarm_create_optimizer_sparseloco_builds_sparseloco(tmp_path):
    import json
    import subprocess
    import sys

    from meshtrain.node.cli import build_parser
    from meshtrain.node.spec.signed import SignedSpec
    from meshtrain.node.spec.swarm import parse_spec
    from meshtrain.node.trainer import Trainer

    from .conftest import ROOT

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshtrain.node.cli",
            "swarm",
            "create",
            "--data-dir",
            str(tmp_path),
            "--model",
            "gpt-tiny",
            "--optimizer",
            "sparseloco",
            "--H",
            "30",
            "--outer-lr",
            "1.0",
            "--error-decay",
            "0.9",
            "--sparse-k",
            "32",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    spec = SignedSpec.load(json.loads(r.stdout.splitlines()[0])["spec"]).spec
    assert (spec.outer.optimizer, spec.outer.error_decay, spec.outer.sparse_k, spec.outer.sparse_chunk) == (
        "sparseloco",
        0.9,
        32,
        4096,
    )
    outer = Trainer(spec, LocalSwarm(1).member(0), "peer-a").outer
    assert isinstance(outer, SparseLoCo)
    assert (outer.H, outer.lr, outer.error_feedback, outer.sparse.k) == (30, 1.0, 0.9, 32)
    eager = Trainer(
        parse_spec({"model": "gpt-tiny", "optimizer": "streaming", "H": 20, "eager": True}),
        LocalSwarm(1).member(0),
        "peer-a",
    ).outer
    assert eager.eager
    with pytest.raises(ConfigError):
        parse_spec({"optimizer": "sparseloco", "sparse_k": 5000})
    demo = build_parser().parse_args(["demo", "--optimizer", "sparseloco", "--quick"])
    assert demo.optimizer == "sparseloco"


def test_spec_outer_lr_and_beta_default_to_sparselocos_own():
    import inspect

    from meshtrain.node.spec.swarm import parse_spec

    own = inspect.signature(SparseLoCo).parameters
    spec = parse_spec({"optimizer": "sparseloco"})
    assert (spec.outer.outer_lr, spec.outer.error_decay) == (own["lr"].default, own["beta"].default) == (1.0, 0.9)
    given = parse_spec({"optimizer": "sparseloco", "outer_lr": 0.65, "error_decay": 0.95})
    assert (given.outer.outer_lr, given.outer.error_decay) == (0.65, 0.95)
    for other in ("diloco", "streaming", "noloco"):  # their specs (and swarm ids) unchanged
        assert (
            parse_spec({"optimizer": other}).outer.outer_lr,
            parse_spec({"optimizer": other}).outer.error_decay,
        ) == (0.7, 0.95)


def test_vectors_keep_vector_k_of_every_vector_chunk_and_matrices_k_of_every_chunk():
    model = torch.nn.Linear(256, 64)  # weight 16384 values, bias 64
    outer = SparseLoCo(model, None, LocalSwarm(1).member(0), H=1, chunk=4096, k=64, bits=None, vector_k=16)
    delta = {"weight": torch.randn(64, 256), "bias": torch.randn(64)}
    outer.feed_back(delta, ["weight", "bias"])
    sent = outer._sent[("weight", "bias")]
    assert int((sent["weight"] != 0).sum()) == 4 * 64
    assert int((sent["bias"] != 0).sum()) == 16  # 16 of its one chunk of 64 (vector_chunk)
    plain = SparseLoCo(model, None, LocalSwarm(1).member(0), H=1, chunk=4096, k=64, bits=None, vector_k=None)
    plain.feed_back(delta, ["weight", "bias"])
    assert int((plain._sent[("weight", "bias")]["bias"] != 0).sum()) == 1  # ceil(64·64/4096): as a matrix's tail
