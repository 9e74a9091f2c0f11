"""The SkipPipe runtime: stages compute what the single-process model computes, microbatches move
between real peers over the data plane, a killed peer's microbatches are re-routed, and hostile
pipeline messages are refused with typed errors without hurting the peer."""

from __future__ import annotations

import json
import math
import os
import queue
import tempfile
import threading
import time
from contextlib import AsyncExitStack, suppress

import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.collective.compression import CodecError
from meshtrain.errors import ConfigError
from meshtrain.models.gpt import GPT, GPTConfig
from meshtrain.pipeline.hop import HOP_RPC
from meshtrain.pipeline.hop_codec import ACTIVATION_CODECS, HopCodec
from meshtrain.pipeline.omission import block_order_for, omission_report
from meshtrain.pipeline.run import PipelineError, PipelineRun
from meshtrain.pipeline.runtime import HopRejected, PipelineRuntime, parse_hop
from meshtrain.pipeline.scheduler import Link, PipelineProblem
from meshtrain.pipeline.stages import (
    StageError,
    StageReplica,
    cut_blocks,
    load_stage_states,
    reference_gradients,
)
from meshtrain.transport.rpc import RemoteError
from meshtrain.transport.tensor_layout import specs_of
from meshtrain.transport.tensor_streams import TransferError

from .conftest import read_json, spawn, start_peers, tail
from .proc_pipeline_peer import pipeline_run

torch.set_num_threads(1)

CONFIG = GPTConfig(vocab_size=64, n_layer=4, n_head=2, d_model=32, context=16)
MB_SIZE = 4


def batch(it: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * it + mb)
    rows = torch.randint(0, CONFIG.vocab_size, (MB_SIZE, CONFIG.context + 1), generator=g)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def make_run(
    ids: list[str],
    stages: list[int],
    *,
    microbatches: int,
    mode: str = "full",
    skip_ratio: float = 0.0,
    name: str = "t",
    activation_codec: str = "none",
) -> PipelineRun:
    placement = dict(zip(ids, stages, strict=True))
    links = {(a, b): Link(0.001, 1e9) for a in ids for b in ids if a < b}
    problem = PipelineProblem(
        num_stages=max(stages) + 1,
        placement=placement,
        forward_time={p: 1.0 for p in ids},
        links=links,
        activation_bytes=4 * MB_SIZE * CONFIG.context * CONFIG.d_model,
        microbatches=microbatches,
        skip_ratio=skip_ratio,
    )
    return PipelineRun(name, problem, mode, MB_SIZE, CONFIG.context, activation_codec)


async def runtimes(stack: AsyncExitStack, peers, run: PipelineRun, data=batch, **kw) -> list[PipelineRuntime]:
    out = []
    for p in peers:
        replica = StageReplica(GPT(CONFIG, seed=0), run.problem.num_stages, run.problem.placement[p.id])
        out.append(await stack.enter_async_context(PipelineRuntime(p.host, p.ts, replica, run, data, **kw)))
    return out


async def iterate(rts: list[PipelineRuntime], it: int):
    reports = [None] * len(rts)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for i, rt in enumerate(rts):

                async def one(i=i, rt=rt):
                    reports[i] = await rt.run_iteration(it)

                nursery.start_soon(one)
    return reports


# ---------------------------------------------------------------------------------------------
# Stages in one process


def test_stages_in_sequence_equal_the_whole_model_forward_and_gradients():
    torch.manual_seed(0)
    model = GPT(CONFIG, seed=3)
    replicas = [StageReplica(GPT(CONFIG, seed=3), 3, s) for s in range(3)]
    batches = [batch(0, mb) for mb in range(2)]
    want = reference_gradients(model, batches)
    total: dict[str, torch.Tensor] = {}
    for x, y in batches:
        t0 = replicas[0].embed(x)
        t1 = replicas[1].forward(t0.output.detach())
        t2 = replicas[2].forward(t1.output.detach())
        loss, g2, head_grads = replicas[0].head(t2.output.detach(), y)
        assert math.isclose(loss, model(x, y).loss.item(), rel_tol=1e-6)
        g1, grads2 = replicas[2].backward(t2, g2)
        g0, grads1 = replicas[1].backward(t1, g1)
        none, embed_grads = replicas[0].backward(t0, g0)
        assert none is None
        for r, grads in (
            (replicas[0], head_grads),
            (replicas[0], embed_grads),
            (replicas[1], grads1),
            (replicas[2], grads2),
        ):
            for name, g in r.grads_by_name(grads).items():
                total[name] = total.get(name, 0) + g / len(batches)
    assert set(total) == set(want)
    for name in want:
        assert torch.allclose(total[name], want[name], rtol=1e-5, atol=1e-7), name


def test_cut_blocks_balances_runs_and_shares_modules():
    blocks = [torch.nn.Linear(4, 4) for _ in range(7)]
    runs = cut_blocks(blocks, 3)
    assert [len(r) for r in runs] == [3, 2, 2]
    assert runs[1][0] is blocks[3]


def test_stage_refuses_wrong_role_shape_and_non_finite_input():
    r0 = StageReplica(GPT(CONFIG, seed=0), 3, 0)
    r1 = StageReplica(GPT(CONFIG, seed=0), 3, 1)
    with pytest.raises(StageError):
        r1.embed(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(StageError):
        r0.forward(torch.zeros(2, 4, CONFIG.d_model))
    with pytest.raises(StageError):
        r1.forward(torch.zeros(2, 4, CONFIG.d_model + 1))
    with pytest.raises(StageError):
        r1.forward(torch.full((2, 4, CONFIG.d_model), float("nan")))
    tape = r1.forward(torch.zeros(2, 4, CONFIG.d_model))
    with pytest.raises(StageError):
        r1.backward(tape, torch.zeros(2, 5, CONFIG.d_model))


def test_omission_report_compares_every_half_subset_with_the_full_model():
    model = GPT(CONFIG, seed=0)
    batches = [batch(9, 0)]
    rep = omission_report(model, 5, batches)
    assert rep.kept == 2 and len(rep.per_subset) == 6
    assert block_order_for(CONFIG.n_layer, 5, (1, 3)) == [0, 2]
    assert math.isclose(rep.full_ppl, math.exp(model.evaluate(batches)), rel_tol=1e-9)
    assert math.isclose(rep.ratio, rep.subset_ppl / rep.full_ppl)


def test_load_stage_states_rebuilds_the_model_from_its_stages():
    src = GPT(CONFIG, seed=5)
    states = [StageReplica(src, 3, s).stage_state() for s in range(3)]
    dst = GPT(CONFIG, seed=6)
    load_stage_states(dst, states)
    for (n, a), (_, b) in zip(src.named_parameters(), dst.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    with pytest.raises(StageError):
        load_stage_states(dst, states[:2])


# ---------------------------------------------------------------------------------------------
# Real peers: hosts on loopback, activations and gradients over the data plane


async def test_three_peers_full_path_gradients_equal_the_single_process_model():
    async with AsyncExitStack() as stack:
        peers = await start_peers(stack, 3, full_mesh=True)
        run = make_run([p.id for p in peers], [0, 1, 2], microbatches=3)
        rts = await runtimes(stack, peers, run, keep_grads=True)
        reports = await iterate(rts, 0)
        want = reference_gradients(GPT(CONFIG, seed=0), [batch(0, mb) for mb in range(3)])
        got = {}
        for rep in reports:
            assert rep.committed == 3 and rep.dropped == 0 and rep.restarts == 0
            got |= rep.grads
        assert set(got) == set(want)
        for name, g in want.items():
            assert torch.allclose(got[name], g, rtol=1e-5, atol=1e-7), name
        ref = GPT(CONFIG, seed=0)
        expect_loss = sum(ref(*batch(0, mb)).loss.item() for mb in range(3)) / 3
        assert math.isclose(reports[0].loss, expect_loss, rel_tol=1e-6)
        # the step applied those gradients; a second iteration runs on the updated weights
        reports = await iterate(rts, 1)
        assert all(r.committed == 3 for r in reports)


async def test_skippipe_paths_match_the_model_run_on_each_microbatchs_blocks():
    async with AsyncExitStack() as stack:
        peers = await start_peers(stack, 5, full_mesh=True)
        run = make_run(
            [p.id for p in peers], [0, 1, 2, 3, 4], microbatches=4, mode="skippipe", skip_ratio=0.5, name="skip"
        )
        rts = await runtimes(stack, peers, run, keep_grads=True)
        reports = await iterate(rts, 0)
        schedule = run.schedule()
        # per stage: the mean over the microbatches that visited it of each one's gradient
        want: dict[str, torch.Tensor] = {}
        for s in range(run.problem.num_stages):
            visiting = [p for p in schedule.plans if s == 0 or any(t == s for t, _ in p.path)]
            for plan in visiting:
                order = block_order_for(CONFIG.n_layer, 5, [t for t, _ in plan.path[1:-1]])
                grads = reference_gradients(GPT(CONFIG, seed=0), [batch(0, plan.microbatch)], order)
                for name in StageReplica(GPT(CONFIG, seed=0), 5, s).names:
                    want[name] = want.get(name, 0) + grads[name] / len(visiting)
        got = {}
        for rep in reports:
            assert rep.committed == 4
            got |= rep.grads or {}
        for name, g in got.items():
            assert torch.allclose(g, want[name], rtol=1e-5, atol=1e-7), name
        assert len(got) == len(want)


async def test_hostile_pipeline_messages_get_typed_errors_and_the_peer_keeps_working():
    async with AsyncExitStack() as stack:
        peers = await start_peers(stack, 3, full_mesh=True)
        hostile = (await start_peers(stack, 1))[0]
        for p in peers:
            await hostile.host.connect(p.host.addrs[0])
        run = make_run([p.id for p in peers], [0, 1, 2], microbatches=2)
        rts = await runtimes(stack, peers, run)
        victim = peers[1]
        good = {
            "run": "t",
            "it": 0,
            "mb": 0,
            "att": 0,
            "kind": "fwd",
            "pos": 1,
            "route": [peers[0].id, peers[1].id, peers[2].id],
            "shape": [MB_SIZE, CONFIG.context, CONFIG.d_model],
            "codec": "none",
        }
        cases = {
            "malformed": "garbage",
            "unknown-run": good | {"run": "other"},
            "bad-codec": good | {"codec": "int8"},
            "unknown-microbatch": good | {"mb": 99},
            "stale-iteration": good | {"it": 50},
            "bad-route": good,  # the hostile peer is not the previous hop of that route
        }
        for code, req in cases.items():
            with pytest.raises(RemoteError) as e:
                await hostile.host.rpc.call(victim.id, HOP_RPC, req)
            assert e.value.code == code, (code, e.value)
        # The real previous hop turned hostile: wrong and oversized shapes.
        origin = peers[0]
        for code, shape in (
            ("bad-shape", [MB_SIZE, CONFIG.context, CONFIG.d_model + 1]),
            ("too-large", [MB_SIZE, 1 << 40, CONFIG.d_model]),
            ("too-large", [MB_SIZE + 1, 2, CONFIG.d_model]),
        ):
            with pytest.raises(RemoteError) as e:
                await origin.host.rpc.call(victim.id, HOP_RPC, good | {"shape": shape})
            assert e.value.code == code, (code, e.value)
        # It announces one shape and sends another: the data plane refuses the tensors.
        small = good | {"shape": [1, 2, CONFIG.d_model]}
        await origin.host.rpc.call(victim.id, HOP_RPC, small)
        with pytest.raises(TransferError):
            await origin.ts.send(
                victim.id, "pp/t/0/0/0/fwd/1", {"h": torch.zeros(MB_SIZE, CONFIG.context, CONFIG.d_model)}, timeout=10
            )
        with pytest.raises(RemoteError) as e:
            await origin.host.rpc.call(victim.id, HOP_RPC, small)
        assert e.value.code == "duplicate"
        # A gradient for a microbatch the victim never ran forward.
        with pytest.raises(RemoteError) as e:
            await peers[2].host.rpc.call(victim.id, HOP_RPC, good | {"kind": "bwd", "mb": 1})
        assert e.value.code == "unknown-microbatch"
        for name, req in (
            ("pipeline/done", {"run": "t", "it": 0, "final": [[7, 0]]}),
            ("pipeline/abandon", {"run": "t", "it": 0, "mb": 0, "floor": 1}),
            ("pipeline/failed", {"run": "t", "it": 0, "mb": 0, "att": 0, "suspect": "x"}),
        ):
            with pytest.raises(RemoteError) as e:
                await hostile.host.rpc.call(victim.id, name, req)
            assert e.value.code in ("malformed", "not-origin", "unknown-microbatch"), (name, e.value)
        assert rts[1].stats["rejected"] >= len(cases) + 7
        # The victim still trains: a full iteration completes on all three peers. Microbatch 0's
        # forward hop was already announced by the test above, so that microbatch is re-run as
        # attempt 1 — the rejection path is exercised as well.
        reports = await iterate(rts, 0)
        assert all(r.committed == 2 for r in reports), reports
        assert reports[0].restarts >= 1


def test_parse_hop_rejects_a_hop_that_is_not_addressed_to_us():
    run = make_run(["a", "b", "c"], [0, 1, 2], microbatches=2)
    req = {
        "run": "t",
        "it": 0,
        "mb": 1,
        "att": 0,
        "kind": "fwd",
        "pos": 1,
        "route": ["a", "b", "c"],
        "shape": [MB_SIZE, CONFIG.context, CONFIG.d_model],
        "codec": "none",
    }
    hop = parse_hop(req, run=run, me="b", caller="a", d_model=CONFIG.d_model, current=0)
    assert hop.tag("t") == "pp/t/0/1/0/fwd/1" and hop.nbytes == 4 * MB_SIZE * CONFIG.context * CONFIG.d_model
    for bad, code in (
        (req | {"route": ["a", "c", "b"]}, "bad-route"),
        (req | {"route": ["b", "a"]}, "bad-route"),
        (req | {"route": ["a", "b", "b"]}, "bad-route"),
        (req | {"pos": 5}, "bad-route"),
        (req | {"att": 9}, "stale-attempt"),
        (req | {"kind": "sideways"}, "malformed"),
        (req | {"shape": [1, 2]}, "bad-shape"),
        (req | {"mb": True}, "malformed"),
        (req | {"codec": "fp16"}, "bad-codec"),
        (req | {"codec": 7}, "malformed"),
    ):
        with pytest.raises(HopRejected) as e:
            parse_hop(bad, run=run, me="b", caller="a", d_model=CONFIG.d_model, current=0)
        assert e.value.code == code, (bad, e.value)


# ---------------------------------------------------------------------------------------------
# The hop codec (activation_codec): activations and gradients compressed on every hop

HOP_SHAPE = (MB_SIZE, CONFIG.context, CONFIG.d_model)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(ACTIVATION_CODECS),
    shape=st.tuples(st.integers(1, 4), st.integers(1, 16), st.sampled_from([1, 32, 33])),
    scale=st.sampled_from([1e-6, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_every_hop_codec_round_trips_through_the_receivers_buffers_within_its_bound(name, shape, scale, seed):
    """What a sender's `encode` puts on the wire is exactly what the receiver's `buffers` for the
    announced shape accept (names, dtypes, shapes: the data plane's check), `nbytes` long, and
    decodes to the tensor within the codec's documented bound ("none": bit for bit)."""
    codec = HopCodec(name)
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    payload = codec.encode(t)
    assert specs_of(payload) == specs_of(codec.buffers(shape))
    assert sum(p.numel() * p.element_size() for p in payload.values()) == codec.nbytes(shape)
    got = codec.decode({k: v.clone() for k, v in payload.items()}, shape)
    assert got.dtype == torch.float32 and tuple(got.shape) == shape
    if codec.codec is None:
        assert torch.equal(got, t)
    else:
        assert bool(((got - t).abs().double() <= codec.codec.error_bound(t)).all()), name
    assert HopCodec("int8").nbytes(HOP_SHAPE) < HopCodec("none").nbytes(HOP_SHAPE) / 3


def test_a_hostile_hop_payload_is_refused_with_a_codec_error():
    """Payloads a broken or hostile previous hop could send: NaN, ±inf or negative scales, NaN
    values, truncated or missing parts, wrong dtypes or shapes. Each is a `CodecError` (which the
    runtime logs and reports to the origin), never another exception and never a tensor."""
    t = torch.randn(HOP_SHAPE)
    int8, fp16, none = HopCodec("int8"), HopCodec("fp16"), HopCodec("none")
    good = int8.encode(t)

    def scale(value: float) -> dict[str, torch.Tensor]:
        absmax = good["absmax"].clone()
        absmax[1] = value
        return good | {"absmax": absmax}

    values = fp16.encode(t)["values"].clone()
    values[5] = math.nan
    cases = [
        (int8, scale(math.nan)),
        (int8, scale(math.inf)),
        (int8, scale(-1.0)),
        (int8, good | {"codes": good["codes"][:-1]}),  # truncated
        (int8, {"codes": good["codes"]}),  # a part missing
        (int8, good | {"codes": good["codes"].view(torch.uint8)}),
        (int8, good | {"extra": good["absmax"]}),
        (fp16, {"values": values}),
        (none, {"h": t[:, :-1]}),
        (none, {"h": t.double()}),
        (none, {"h": t, "x": t}),
    ]
    for codec, payload in cases:
        with pytest.raises(CodecError):
            codec.decode(payload, HOP_SHAPE)
    with pytest.raises(CodecError):  # a sender never puts a non-finite tensor on the wire
        int8.encode(torch.full(HOP_SHAPE, math.inf))
    with pytest.raises(ConfigError, match="top-k"):
        HopCodec("topk")
    with pytest.raises(PipelineError):
        make_run(["a", "b"], [0, 1], microbatches=1, activation_codec="zip")


async def test_a_hop_payload_that_does_not_decode_is_refused_and_the_peer_keeps_training():
    """In an int8 run the real previous hop turns hostile: a hop announced with another codec is
    refused (`bad-codec`); a payload with a NaN scale arrives (it is a valid data-plane transfer)
    but is refused by the decoder and counted, and a truncated one is refused by the data plane.
    The victim still trains: the iteration completes, those microbatches re-run as attempt 1."""
    async with AsyncExitStack() as stack:
        peers = await start_peers(stack, 3, full_mesh=True)
        run = make_run([p.id for p in peers], [0, 1, 2], microbatches=2, activation_codec="int8")
        rts = await runtimes(stack, peers, run)
        origin, victim = peers[0], peers[1]
        hop = {
            "run": "t",
            "it": 0,
            "mb": 0,
            "att": 0,
            "kind": "fwd",
            "pos": 1,
            "route": [p.id for p in peers],
            "shape": list(HOP_SHAPE),
            "codec": "int8",
        }
        with pytest.raises(RemoteError) as e:
            await origin.host.rpc.call(victim.id, HOP_RPC, hop | {"codec": "none"})
        assert e.value.code == "bad-codec"
        payload = HopCodec("int8").encode(torch.randn(HOP_SHAPE))
        poisoned = payload | {"absmax": payload["absmax"].clone().fill_(math.nan)}
        await origin.host.rpc.call(victim.id, HOP_RPC, hop)
        await origin.ts.send(victim.id, "pp/t/0/0/0/fwd/1", poisoned, timeout=10)
        await origin.host.rpc.call(victim.id, HOP_RPC, hop | {"mb": 1})
        with pytest.raises(TransferError):
            await origin.ts.send(victim.id, "pp/t/0/1/0/fwd/1", payload | {"codes": payload["codes"][:-8]}, timeout=10)
        with trio.fail_after(10):
            while rts[1].stats["rejected"] < 2:  # bad-codec, then the NaN scale once decoded
                await trio.sleep(0.01)  # sleep: poll interval
        reports = await iterate(rts, 0)
        assert all(r.committed == 2 and math.isfinite(r.loss) for r in reports), reports
        assert reports[0].restarts >= 2


async def test_an_int8_pipeline_trains_like_the_model_and_its_replicas_stay_identical():
    """Four peers (two origins: stage 0 has two replicas) train one repeated batch with int8
    hops: the first iteration's gradients are the single-process model's within a few percent,
    the loss falls, the stage-0 replicas hold the same bits after every step, and each hop sent
    int8's bytes (about a quarter of float32's)."""
    async with AsyncExitStack() as stack:
        peers = await start_peers(stack, 4, full_mesh=True)
        run = make_run([p.id for p in peers], [0, 0, 1, 2], microbatches=4, activation_codec="int8")
        rts = await runtimes(stack, peers, run, data=lambda it, mb: batch(0, mb), keep_grads=True)
        want = reference_gradients(GPT(CONFIG, seed=0), [batch(0, mb) for mb in range(4)])
        losses = []
        for it in range(6):
            reports = await iterate(rts, it)
            assert all(r.committed == 4 and r.restarts == 0 for r in reports), reports
            losses.append(reports[0].loss)
            if it == 0:
                got = {}
                for rep in reports:
                    got |= rep.grads
                for name, g in want.items():
                    assert (got[name] - g).norm() <= 0.05 * g.norm() + 1e-6, name
            a, b = (rt.replica.stage_state() for rt in rts[:2])
            assert all(torch.equal(a[k], b[k]) for k in a), it
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.1, losses
        sent = sum(rt.stats["hops_sent"] for rt in rts)
        assert sent == 6 * 4 * 6  # per microbatch: 0 -> 1 -> 2 -> 0 forward, 0 -> 2 -> 1 -> 0 backward
        assert sum(rt.stats["hop_bytes"] for rt in rts) == sent * HopCodec("int8").nbytes(HOP_SHAPE)


# ---------------------------------------------------------------------------------------------
# Separate processes: a peer SIGKILLed mid-iteration


class ProcSwarm:
    """Pipeline peers in their own processes (tests/proc_pipeline_peer.py), driven over stdio.
    Their output lines are read by one thread each, so a run has a deadline of its own
    (`RUN_DEADLINE_S`): a peer that hangs fails the test with every peer's log while the logs
    still exist (the timeout of pytest-timeout fires after the log directory is gone)."""

    RUN_DEADLINE_S = 100.0  # a run of three iterations takes 10–30 s, loaded

    def __init__(self, n: int, logdir: str) -> None:
        self.logs = [os.path.join(logdir, f"peer{i}.log") for i in range(n)]
        self.procs = [spawn("tests/proc_pipeline_peer.py", stderr_path=log) for log in self.logs]
        hello = [read_json(p) for p in self.procs]
        self.ids = [h["peer"] for h in hello]
        self.lines: list[queue.Queue[str | None]] = [queue.Queue() for _ in self.procs]
        for p, q in zip(self.procs, self.lines, strict=True):
            threading.Thread(target=self._pump, args=(p, q), daemon=True).start()
        for p in self.procs:
            self.send(p, {"addrs": [h["addr"] for h in hello]})

    @staticmethod
    def _pump(proc, lines: queue.Queue[str | None]) -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)  # it exited

    def _next(self, i: int, give_up: float) -> dict | None:
        """Peer `i`'s next output line, None once it exited; fails the test at `give_up`."""
        try:
            line = self.lines[i].get(timeout=max(0.0, give_up - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"peer {i} said nothing more within the run's deadline\n{self.diag()}") from None
        return None if line is None else json.loads(line)

    def diag(self) -> str:
        return "\n".join(
            f"--- peer {i} ({pid[-8:]})\n{tail(log, 40)}"
            for i, (pid, log) in enumerate(zip(self.ids, self.logs, strict=True))
        )

    @staticmethod
    def send(proc, obj) -> None:
        proc.stdin.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
        proc.stdin.flush()

    def run(self, spec: dict) -> list[list[dict] | None]:
        """Run one spec on every peer; each peer's output lines, or None for a peer that died."""
        give_up = time.monotonic() + self.RUN_DEADLINE_S
        for p in self.procs:
            self.send(p, spec)
        for i in range(len(self.procs)):
            assert self._next(i, give_up) == {"ready": spec["run"]}
        for p in self.procs:
            self.send(p, "go")
        out: list[list[dict] | None] = []
        for i in range(len(self.procs)):
            lines = []
            while True:
                line = self._next(i, give_up)
                if line is None:
                    out.append(None)
                    break
                lines.append(line)
                if "finished" in line:
                    out.append(lines)
                    break
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with suppress(OSError):
                    self.send(p, "quit")
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except Exception:
                p.kill()


def proc_spec(ids: list[str], stages: list[int], **over) -> dict:
    placement = dict(zip(ids, stages, strict=True))
    spec = {
        "run": "kill",
        "mode": "full",
        "skip_ratio": 0.0,
        "n_stages": max(stages) + 1,
        "placement": placement,
        "forward_time": {p: 0.15 for p in ids},
        "links": [[a, b, 0.01, 50e6] for a in ids for b in ids if a < b],
        "microbatches": 4,
        "microbatch_size": MB_SIZE,
        "model": CONFIG.to_dict(),
        "seed": 0,
        "data": "random",
        "data_seed": 1,
        "lr": 1e-3,
        "steps": 3,
        "budget_s": None,
        "simulate": True,
        "snapshot_dir": None,
        "snapshot_steps": [],
        "kill": None,
    }
    return spec | over


def run_killing(swarm: ProcSwarm, spec: dict, victim: str) -> dict[str, list[dict]]:
    """Run `spec` (which kills `victim`): every survivor must finish its three iterations with all
    four microbatches committed, none dropped, finite losses. Returns the survivors' output."""
    out = dict(zip(swarm.ids, swarm.run(spec), strict=True))
    diag = "\n".join(tail(log) for log in swarm.logs)
    assert out.pop(victim) is None, "the victim should have died"
    assert all(o is not None for o in out.values()), diag
    for lines in out.values():
        its = [x for x in lines if "it" in x]
        assert [x["it"] for x in its] == [0, 1, 2], diag
        assert all(x["committed"] == 4 and x["dropped"] == 0 for x in its), (its, diag)
        assert all(math.isfinite(x["loss"]) for x in its)
    return out


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["full", "skippipe"])
def test_killed_peers_microbatches_are_rerouted_and_the_iteration_completes(mode):
    with tempfile.TemporaryDirectory() as logdir:
        swarm = ProcSwarm(5, logdir)
        try:
            ids = swarm.ids
            # an origin and two replicas of stage 1 (full: two of stage 2; SkipPipe: stages 2 and
            # 3, each path skipping 2 of the 3 block stages); 0.5 s into iteration 1, kill the
            # stage-1 replica the schedule sends the most microbatches to, while they are on it
            stages = [0, 1, 1, 2, 2] if mode == "full" else [0, 1, 1, 2, 3]
            spec = proc_spec(ids, stages, mode=mode, run=f"kill-{mode}", skip_ratio=0.5 if mode == "skippipe" else 0.0)
            plans = pipeline_run(spec).schedule().plans
            use = {p: sum(p in [q for _, q in plan.path] for plan in plans) for p in ids[1:3]}
            victim = max(sorted(use), key=lambda p: use[p])
            assert use[victim] > 0
            spec["kill"] = {"peer": victim, "iteration": 1, "after_s": 0.5}
            out = run_killing(swarm, spec, victim)
            for lines in out.values():
                its = [x for x in lines if "it" in x]
                assert its[1]["dead"] == 1 and its[2]["dead"] == 1
            origin = [x for x in out[ids[0]] if "it" in x]
            assert origin[1]["restarts"] >= 1, origin  # the victim's microbatches were re-run
            assert origin[2]["restarts"] == 0  # the next iteration is scheduled without it
            if mode == "full":  # replicas of stage 2 stayed bit-identical through the failure
                assert out[ids[3]][-1]["digest"] == out[ids[4]][-1]["digest"]
        finally:
            swarm.close()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_skippipe_skips_a_stage_whose_only_peer_died_and_the_iteration_completes():
    with tempfile.TemporaryDirectory() as logdir:
        swarm = ProcSwarm(4, logdir)
        try:
            ids = swarm.ids
            # one peer per stage: stage 0 (origin) and block stages 1, 2, 3; every path skips one
            # of the three, so a path through the dead stage can skip it instead — no replica
            # is left to take its microbatches over. Kill the busiest block peer mid-iteration 1,
            # the last one (a stage without peers cannot be scheduled again).
            spec = proc_spec(ids, [0, 1, 2, 3], mode="skippipe", run="skip-dead", skip_ratio=0.34, steps=2)
            plans = pipeline_run(spec).schedule().plans
            use = {p: sum(p in [q for _, q in plan.path] for plan in plans) for p in ids[1:]}
            victim = max(sorted(use), key=lambda p: use[p])
            spec["kill"] = {"peer": victim, "iteration": 1, "after_s": 0.5}
            out = dict(zip(ids, swarm.run(spec), strict=True))
            diag = "\n".join(tail(log) for log in swarm.logs)
            assert out.pop(victim) is None, "the victim should have died"
            assert all(o is not None for o in out.values()), diag
            origin = [x for x in out[ids[0]] if "it" in x]
            assert [x["it"] for x in origin] == [0, 1], diag
            assert origin[1]["committed"] == 4 and origin[1]["dropped"] == 0, (origin, diag)
            assert origin[1]["restarts"] >= 1 and origin[1]["dead"] == 1, origin
            assert all(math.isfinite(x["loss"]) for x in origin)
        finally:
            swarm.close()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_dead_origins_microbatches_are_taken_over_by_the_other_origin():
    """Two origins (stage 0) and one peer on each of stages 1 and 2; 0.5 s into iteration 1 one
    origin is SIGKILLed while its microbatches are in flight. The other origin re-runs them from
    their data (a pure function of iteration and microbatch): iteration 1 commits all four
    microbatches on every survivor, none dropped, and the next one is scheduled without the dead."""
    with tempfile.TemporaryDirectory() as logdir:
        swarm = ProcSwarm(4, logdir)
        try:
            ids = swarm.ids
            victim, heir = ids[1], ids[0]
            spec = proc_spec(ids, [0, 0, 1, 2], run="takeover", kill={"peer": victim, "iteration": 1, "after_s": 0.5})
            plans = pipeline_run(spec).schedule().plans
            assert sorted(p.origin for p in plans) == sorted([heir, heir, victim, victim])
            out = run_killing(swarm, spec, victim)
            origin = [x for x in out[heir] if "it" in x]
            assert origin[1]["restarts"] >= 2, origin  # the victim's two microbatches, re-run here
            assert origin[2]["restarts"] == 0 and origin[2]["dead"] == 1, origin
        finally:
            swarm.close()
