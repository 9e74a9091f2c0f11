"""IPv6: two daemons on the IPv6 loopback (`::1`) train together, their libp2p connection and
their tensors' data plane both over IPv6, direct — before, the data plane's session setup
(`/meshtrain/dataplane-punch/1`, transport/holepunch.py) refused any address but IPv4, and the
tensors went over the libp2p fallback."""

from __future__ import annotations

import time

import pytest
import torch

from meshtrain.node.status.client import fetch_status

from .test_node_cli import create, finish, phi, start, wait_daemon
from .test_tensor_streams import has_ipv6_loopback


@pytest.mark.slow
@pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_two_daemons_on_the_ipv6_loopback_train_with_their_tensors_direct(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    create(a, "--model", "gpt-tiny", "--steps", "60", "--H", "10", "--eval-every", "0")
    la, lb = tmp_path / "a.log", tmp_path / "b.log"
    v6 = ["--listen", "/ip6/::1/tcp/0"]
    pa = start("--data-dir", str(a), *v6, "--wait-peers", "2", log=la)
    info = wait_daemon(a, pa, la)
    addr = next(x for x in info["addrs"] if x.startswith("/ip6/::1/"))
    pb = start("--data-dir", str(b), *v6, "--join", addr, "--wait-peers", "2", log=lb)
    url = wait_daemon(b, pb, lb)["status_url"]
    # b's tensors to a: the data path of its newest connection, once a round has moved them
    deadline, seen = time.monotonic() + 120, None
    while seen is None:
        assert time.monotonic() < deadline and pb.poll() is None, lb.read_text()[-3000:]
        try:
            st = fetch_status(url, timeout=5)
        except Exception:  # noqa: BLE001 — between states, or done
            st = None
        if st is not None and st["training"]["round"] >= 1:
            seen = next((p for p in st["peers"] if p["peer_id"] == info["peer_id"] and p.get("data_path")), None)
        time.sleep(0.3)  # sleep: poll interval
    assert seen["data_path"] == "direct" and seen["addr"].startswith("/ip6/"), seen
    ra, rb = finish(pa, la), finish(pb, lb)
    assert ra["rounds"] == rb["rounds"] == 6
    for log in (la, lb):
        assert "no direct data path" not in log.read_text(), log.read_text()[-3000:]
    pa_, pb_ = phi(a), phi(b)
    assert all(torch.equal(pa_[n], pb_[n]) for n in pa_)


@pytest.mark.parametrize(
    "addr, ok",
    [
        (["::1", 4002], True),
        (["2001:db8::7", 4002], True),
        (["203.0.113.9", 4002], True),
        (["::", 4002], False),  # unspecified
        (["0.0.0.0", 4002], False),
        (["ff02::1", 4002], False),  # multicast
        (["224.0.0.1", 4002], False),
        (["::1", 0], False),
        (["::1", 70000], False),
        (["not-an-ip", 4002], False),
        (["::1"], False),
        ("::1:4002", False),
    ],
)
def test_the_punch_rpc_takes_a_unicast_ipv4_or_ipv6_address_and_refuses_the_rest(addr, ok):
    from meshtrain.transport.holepunch import punch_addr
    from meshtrain.transport.rpc import RemoteError

    if ok:
        assert punch_addr(addr) == (addr[0], addr[1])
    else:
        with pytest.raises(RemoteError) as e:
            punch_addr(addr)
        assert e.value.code == "malformed"
