"""Stage placement (pipeline/placement.py) and the spec's stage cut (pipeline/cut.py): pure
functions, pinned by properties over any order of joins and leaves."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshtrain.errors import ConfigError
from meshtrain.node.spec.swarm import parse_spec
from meshtrain.pipeline.cut import balanced_cut, format_stage_cut, parse_stage_cut
from meshtrain.pipeline.placement import Member, floors, place, stage_map

SPEEDS = st.one_of(st.none(), st.sampled_from([0.05, 0.1, 0.1, 0.25]))


def members_of(announced: dict[str, int | None], speeds: dict[str, float | None]) -> list[Member]:
    return [Member(p, announced.get(p), speeds.get(p)) for p in announced]


def check_floors(placement: dict[str, int], S: int) -> None:
    want = floors(len(placement), S)
    counts = [len(ps) for ps in stage_map(placement, S)]
    assert all(c >= w for c, w in zip(counts, want, strict=True)), (counts, want)


events = st.lists(
    st.one_of(
        st.tuples(st.just("join"), SPEEDS),
        st.tuples(st.just("leave"), st.integers(0, 1000)),
        st.tuples(st.just("burst"), st.lists(SPEEDS, min_size=2, max_size=4)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(S=st.integers(2, 6), events=events)
def test_any_join_and_leave_order_leaves_every_stage_a_replica(S: int, events: list) -> None:
    announced: dict[str, int | None] = {}
    speeds: dict[str, float | None] = {}
    n = 0
    for kind, arg in events:
        before = dict(announced)
        if kind == "join":
            speeds[f"p{n:03d}"] = arg
            announced[f"p{n:03d}"] = None
            n += 1
        elif kind == "leave" and announced:
            gone = sorted(announced)[arg % len(announced)]
            del announced[gone], before[gone]
        elif kind == "burst":
            # peers that join at once each decide before hearing of the others, then announce
            view = dict(announced)
            for sp in arg:
                p = f"p{n:03d}"
                n += 1
                speeds[p] = sp
                mine = place(members_of({**view, p: None}, speeds), S)[p]
                announced[p] = mine
        placement = place(members_of(announced, speeds), S)
        assert set(placement) == set(announced)
        if len(placement) >= S:
            check_floors(placement, S)
        # stability: a peer that held a stage moves only when a stage fell below its floor
        kept = {p: s for p, s in before.items() if s is not None and p in placement}
        want = floors(len(placement), S)
        counts = [sum(1 for p, s in announced.items() if s == t) for t in range(S)]
        if all(c >= w for c, w in zip(counts, want, strict=True)):
            assert all(placement[p] == s for p, s in kept.items())
        announced = dict(placement)  # every peer announces what it computed


@settings(max_examples=100, deadline=None)
@given(S=st.integers(2, 5), n=st.integers(1, 12), seed=st.integers(0, 1000), data=st.data())
def test_placement_is_the_same_whatever_order_peers_list_the_members(S: int, n: int, seed: int, data) -> None:
    members = [
        Member(f"q{i}", data.draw(st.one_of(st.none(), st.integers(-1, S))), data.draw(SPEEDS)) for i in range(n)
    ]
    shuffled = list(members)
    random.Random(seed).shuffle(shuffled)
    assert place(members, S) == place(shuffled, S)


@settings(max_examples=200, deadline=None)
@given(S=st.integers(2, 6), data=st.data())
def test_fresh_peers_that_picked_stages_at_once_are_evened_out_and_trained_ones_stay(S: int, data) -> None:
    n = data.draw(st.integers(S, 14))
    picks = data.draw(st.lists(st.one_of(st.none(), st.integers(0, S - 1)), min_size=n, max_size=n))
    trained = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    speeds = data.draw(st.lists(SPEEDS, min_size=n, max_size=n))
    members = [Member(f"p{i:02d}", picks[i], speeds[i], fresh=not trained[i]) for i in range(n)]
    placement = place(members, S)
    check_floors(placement, S)
    counts = [len(ps) for ps in stage_map(placement, S)]
    if not any(trained):  # a swarm that has not trained: evened out (within one replica)
        assert max(counts) - min(counts) <= 1, counts
    # a trained peer that announced a stage moves only when a stage is below its floor
    announced_counts = [sum(1 for m in members if m.stage == t) for t in range(S)]
    if all(c >= w for c, w in zip(announced_counts, floors(n, S), strict=True)):
        assert all(placement[m.peer_id] == m.stage for m in members if not m.fresh and m.stage is not None)
    assert place(members, S) == place(list(reversed(members)), S)


def test_six_fresh_peers_that_all_picked_at_once_end_two_per_stage() -> None:
    # what the demo met: six daemons started together held 3/2/1 of three stages, kept by rule 1
    members = [Member(f"p{i}", s, 0.1, fresh=True) for i, s in enumerate([0, 0, 0, 1, 1, 2])]
    assert [len(x) for x in stage_map(place(members, 3), 3)] == [2, 2, 2]
    trained = [dataclasses.replace(m, fresh=False) for m in members]
    assert [len(x) for x in stage_map(place(trained, 3), 3)] == [3, 2, 1]  # trained peers stay


def test_fast_peers_join_first_and_stage_zero_gets_two_origins() -> None:
    members = [Member("a", None, 0.3), Member("b", None, 0.1), Member("c", None, None), Member("d", None, 0.2)]
    placement = place(members, 3)
    assert stage_map(placement, 3) == [["b", "c"], ["d"], ["a"]]  # b, d, a first: one per stage, then c
    # a stage that lost its last replica is refilled from the most replicated one
    placement.pop("c")
    moved = place([Member(p, s) for p, s in placement.items()], 3)
    assert [len(x) for x in stage_map(moved, 3)] == [1, 1, 1]


def test_placement_rejects_nonsense() -> None:
    with pytest.raises(ConfigError):
        place([Member("a"), Member("a")], 2)
    with pytest.raises(ConfigError):
        place([Member("a")], 0)


@given(n_layer=st.integers(1, 12), data=st.data())
def test_stage_cut_round_trips(n_layer: int, data) -> None:
    S = data.draw(st.integers(2, n_layer + 1))
    cut = balanced_cut(n_layer, S)
    assert parse_stage_cut(format_stage_cut(cut), S, n_layer) == cut


def test_stage_cut_errors_are_one_line_config_errors() -> None:
    for text, S in (("0-1,3", 3), ("0-1", 3), ("1-3", 2), ("a-b", 2), ("2-1", 2)):
        with pytest.raises(ConfigError):
            parse_stage_cut(text, S, 4)


def test_pipeline_spec_keys_are_checked() -> None:
    spec = parse_spec({"pipeline": "skippipe", "stages": 3, "model": "gpt-small", "skip_ratio": 0.5})
    assert spec.pipeline.replica_sync == "every-step" and spec.pipeline.microbatches == 8
    with pytest.raises(ConfigError, match="stages >= 2"):
        parse_spec({"pipeline": "skippipe"})
    with pytest.raises(ConfigError, match="2..5 stages"):
        parse_spec({"pipeline": "skippipe", "stages": 6, "model": "gpt-small"})
    with pytest.raises(ConfigError, match="built-in GPT"):
        parse_spec({"pipeline": "skippipe", "stages": 2, "model": "user"})
    with pytest.raises(ConfigError, match="stage_cut"):
        parse_spec({"pipeline": "skippipe", "stages": 3, "model": "gpt-small", "stage_cut": "0,1"})
    with pytest.raises(ConfigError, match="replica_sync"):
        parse_spec({"pipeline": "skippipe", "stages": 3, "replica_sync": "sometimes"})


def test_the_activation_codec_spec_key_is_checked_and_reaches_the_cli() -> None:
    """`activation_codec` (pipeline/hop_codec.py): none by default, a dense codec by name, a
    one-line error for an unknown one, for top-k, and for a swarm without a pipeline; `swarm
    create --activation-codec` sets it."""
    from meshtrain.node.cli import build_parser

    base = {"pipeline": "skippipe", "stages": 3, "model": "gpt-small"}
    assert parse_spec(base).pipeline.activation_codec == "none"
    assert parse_spec(base | {"activation_codec": "int8"}).pipeline.activation_codec == "int8"
    for bad in ("zip", "topk"):
        with pytest.raises(ConfigError, match="activation_codec: must be one of none, fp16, bf16, int8") as e:
            parse_spec(base | {"activation_codec": bad})
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="activation_codec compresses a pipeline"):
        parse_spec({"activation_codec": "int8"})
    args = build_parser().parse_args(["swarm", "create", "--activation-codec", "bf16"])
    assert args.spec_activation_codec == "bf16"


def test_a_bf16_pipeline_sends_bf16_hops_unless_told_and_fp16_is_refused() -> None:
    """A pipeline trains in fp32 or bf16: under bf16 its hops default to bf16 (pinned in the spec,
    so a re-read spec keeps them), a named codec stays; fp16 is one line naming bf16."""
    base = {"pipeline": "skippipe", "stages": 3, "model": "gpt-small"}
    spec = parse_spec(base | {"precision": "bf16"})
    assert spec.pipeline.activation_codec == "bf16"
    assert parse_spec(spec.model_dump()) == spec
    assert parse_spec(base | {"precision": "bf16", "activation_codec": "none"}).pipeline.activation_codec == "none"
    assert parse_spec(base).pipeline.activation_codec == "none"
    assert parse_spec({"precision": "bf16"}).pipeline.activation_codec == "none"  # no pipeline, no hops
    with pytest.raises(ConfigError, match="fp32 or bf16, not fp16") as e:
        parse_spec(base | {"precision": "fp16"})
    assert "\n" not in str(e.value)
