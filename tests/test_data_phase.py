"""The data phase's `AttemptPlan`: what one attempt is, decided before bytes move — the same
transfers for every member, derived from the coordinator's layout alone (no network here)."""

from __future__ import annotations

import pytest

from meshtrain.collective.contract import CollectiveError
from meshtrain.collective.data_phase import AttemptPlan, scatter_slots
from meshtrain.collective.flat import part_bounds
from meshtrain.collective.protocol import AllReduceConfig, Joined, Retry, RoundKey

KEY = RoundKey(7, "outer", "peer-a")
GROUP = ("peer-a", "peer-b", "peer-c")
SMALL_STRIPES = AllReduceConfig(stripe_bytes=4096)  # 1024 fp32 elements a stripe


def plans(layout: Joined | Retry, numel: int, config: AllReduceConfig, codec: str = "none") -> list[AttemptPlan]:
    return [AttemptPlan.of(KEY, layout, me, numel, config, codec) for me in layout.group]


def test_every_member_plans_the_same_parts_stripes_and_deadline():
    layout = Joined(0, GROUP, shares=(1, 3, 0), taper=3)
    every = plans(layout, 10_000, SMALL_STRIPES)
    first = every[0]
    assert {(p.bounds, p.stripes, p.deadline, p.tag) for p in every} == {
        (first.bounds, first.stripes, first.deadline, first.tag)
    }
    assert first.bounds == tuple(part_bounds(10_000, 3, (1, 3, 0)))
    assert [p.index for p in every] == [0, 1, 2]
    assert every[1].others == ("peer-a", "peer-c")
    assert first.deadline == SMALL_STRIPES.transfer_deadline(10_000)


def test_the_stripes_of_each_part_cut_exactly_that_part_and_an_empty_part_has_none():
    plan = plans(Joined(0, GROUP, shares=(1, 3, 0), taper=3), 10_000, SMALL_STRIPES)[0]
    for j in range(len(GROUP)):
        cut = [plan.stripe(j, s) for s in range(plan.stripe_count(j))]
        covered = [i for a, b in cut for i in range(a, b)]
        assert covered == list(range(plan.bounds[j], plan.bounds[j + 1]))
        assert all(b - a <= 1024 for a, b in cut)
    assert plan.stripe_count(2) == 0  # the share-0 member owns nothing: nobody sends to it
    sizes = [b - a for a, b in (plan.stripe(1, s) for s in range(plan.stripe_count(1)))]
    assert sizes[-3:] == [512, 256, 128]  # the taper: the last stripes shrink by halves


def test_robust_modes_move_each_part_as_one_stripe():
    robust = AllReduceConfig(stripe_bytes=4096, robust="trimmed_mean")
    plan = plans(Joined(0, GROUP), 10_000, robust)[0]
    assert [plan.stripe_count(j) for j in range(3)] == [1, 1, 1]
    assert plan.stripe(1, 0) == (plan.bounds[1], plan.bounds[2])


def test_transfer_names_differ_between_attempts_and_phases_but_not_between_members():
    first, retry = Joined(0, GROUP), Retry(1, GROUP[:2], ("peer-c",))
    a, b = plans(first, 4096, SMALL_STRIPES)[:2]
    again = plans(retry, 4096, SMALL_STRIPES)[0]
    assert a.subtag("rs", 1, 0) == b.subtag("rs", 1, 0) == "ar/7/outer/peer-a/0/rs/1/0"
    assert again.subtag("rs", 1, 0) == "ar/7/outer/peer-a/1/rs/1/0"
    assert a.subtag("ag", 1, 0) != a.subtag("rs", 1, 0)
    assert again.group == ("peer-a", "peer-b") and again.attempt == 1


def test_the_codec_decides_whether_stripes_travel_as_views():
    assert plans(Joined(0, GROUP), 4096, SMALL_STRIPES, "none")[0].lossless
    fp16 = plans(Joined(0, GROUP), 4096, SMALL_STRIPES, "fp16")[0]
    assert not fp16.lossless and fp16.codec.name == "fp16"


def test_scatter_slots_follow_the_uplink_over_the_widest_encoded_stripe():
    config = AllReduceConfig()  # 2 MiB stripes
    unknown = AttemptPlan.of(KEY, Joined(0, GROUP), "peer-b", 30_000_000, config, "none")
    assert unknown.scatter_slots == config.scatter_window
    uplink = 100e6 / 8  # 100 Mbit/s
    known = AttemptPlan.of(KEY, Joined(0, GROUP), "peer-b", 30_000_000, config, "none", uplink)
    widest = max(b - a for part in known.stripes for a, b in zip(part, part[1:], strict=False))
    assert known.scatter_slots == scatter_slots(config, uplink, 4 * widest) == 6
    half = AttemptPlan.of(KEY, Joined(0, GROUP), "peer-b", 30_000_000, config, "fp16", uplink)
    assert half.scatter_slots == scatter_slots(config, uplink, 2 * widest) == 12


def test_an_unknown_codec_or_shares_that_do_not_fit_are_collective_errors():
    with pytest.raises(CollectiveError, match="unknown codec"):
        AttemptPlan.of(KEY, Joined(0, GROUP), "peer-a", 4096, SMALL_STRIPES, "zip")
    with pytest.raises(CollectiveError, match="shares do not fit"):
        AttemptPlan.of(KEY, Joined(0, GROUP, shares=(1, 2)), "peer-a", 4096, SMALL_STRIPES, "none")
