"""The WAN lab gives each peer the link it was asked for, and our all-reduce works across it.

Real namespaces, real tc rate limits, the real user-space delay line, real meshtrain processes:
the rate is what one TCP stream gets through a shaped link, the latency is what UDP probes saw
one way (all namespaces share the machine's monotonic clock). Bounds are loose (a loaded 2-core
CI machine); bench_wan.py has the precise numbers. Skipped, with the reason, without root.
"""

from __future__ import annotations

import pytest

from scripts.labs.natlab.lab import list_labs
from scripts.labs.natlab.peers import start_peers
from scripts.labs.wanlab.lab import WanLab

from .conftest import require_natlab

pytestmark = pytest.mark.nat


def test_links_have_the_rate_and_latency_asked_and_the_lab_is_removed() -> None:
    require_natlab()
    with WanLab(3, rate_mbit=40, delay_ms=30) as lab:
        lab_id = lab.lab_id
        lab.shape("p2", rate_mbit=10, delay_ms=10)  # one slow, near peer: p0 -> p2 is (30 + 10) / 2
        seen = lab.measure_delay([("p0", "p1"), ("p0", "p2")], probes=10)
        for pair, want in (("p0->p1", 30.0), ("p0->p2", 20.0)):
            assert seen[pair]["configured"] == want
            assert seen[pair]["received"] == 10
            assert want <= seen[pair]["min"] and seen[pair]["median"] <= want + 8, seen
        fast = lab.measure_rate("p0", "p1", seconds=1.5)
        up = lab.measure_rate("p2", "p0", seconds=1.5)  # p2's upload
        down = lab.measure_rate("p1", "p2", seconds=1.5)  # p2's download
        # Goodput counts what the kernel accepted: a short run reads a little high (the send buffer).
        assert 0.75 * 40 <= fast <= 1.15 * 40
        assert 0.75 * 10 <= up <= 1.15 * 10 and 0.75 * 10 <= down <= 1.15 * 10
        assert lab.delay_stats()["packets"] > 0
    assert lab_id not in list_labs()


@pytest.mark.slow
def test_pipelined_allreduce_over_shaped_delayed_links_gives_equal_digests(tmp_path) -> None:
    require_natlab()
    with WanLab(3, rate_mbit=50, delay_ms=20) as lab:
        lab.shape("p2", rate_mbit=20)
        peers = list(start_peers(lab, {n: {} for n in lab.names}, log_dir=str(tmp_path)).values())
        for i, a in enumerate(peers):
            for b in peers[:i]:
                a.call("connect", addr=b.addr, timeout=60)
        ids = [p.peer_id for p in peers]
        # 4 MiB in stripes of 256 KiB: several stripes per part, both phases in flight at once.
        cids = [p.submit("allreduce", peers=ids, round=1, mib=4, stripe_bytes=256 << 10) for p in peers]
        res = [p.result(c, timeout=120) for p, c in zip(peers, cids, strict=True)]
        assert len({r["digest"] for r in res}) == 1
        assert all(sorted(r["contributors"]) == sorted(ids) for r in res)
        for p in peers:
            p.close()


def test_the_lab_sets_and_reports_its_tcp_congestion_control() -> None:
    """`congestion` is every peer's namespace's TCP congestion control (reno is in every kernel);
    without it the namespaces keep what they inherit, and the lab says which that is."""
    require_natlab()
    with WanLab(2, rate_mbit=None, congestion="reno") as lab:
        assert [lab.tcp_congestion(p) for p in lab.names] == ["reno", "reno"]
    with WanLab(1, rate_mbit=None) as lab:
        inherited = lab.tcp_congestion("p0")
    with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
        assert inherited in f.read().split()
    for bad in ("cubic; reboot", "", "b b r"):
        with pytest.raises(ValueError, match="congestion"):
            WanLab(2, congestion=bad)
