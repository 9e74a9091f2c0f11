"""A js-libp2p peer reads a meshtrain peer record (issue 33, ★): the npm packages of
tests/js/package.json (libp2p, @libp2p/kad-dht, noise, yamux, tcp) installed in the test's own
folder, `tests/js/kad_get_record.mjs` dials one of our DHT nodes, fetches another node's record
with kad GET_VALUE and verifies it in JavaScript with the rule of docs/interop.md. Skipped, with
the reason, where Node.js or the npm registry is not there. The Python side of the rule, and its
hostile input, is tests/test_interop_records.py."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from meshtrain.dht import Discovery, DiscoveryConfig
from meshtrain.dht.interop import peer_key

from .js_interop import JS_TIMEOUT_MS, install_js, js_get
from .test_dht import SWARM, swarm_of

pytestmark = pytest.mark.slow

FAST = DiscoveryConfig(role="trainer", ttl=10.0, refresh_interval=2.0)


@pytest.fixture(scope="module")
def js_dir(tmp_path_factory) -> Path:
    """tests/js with its npm packages installed, in a folder of the test's own."""
    where = tmp_path_factory.mktemp("js")
    if (why := install_js(where)) is not None:
        pytest.skip(why)
    return where


async def test_a_js_libp2p_peer_fetches_and_verifies_a_meshtrain_peer_record(js_dir):
    async with AsyncExitStack() as stack:
        nodes = (await stack.enter_async_context(swarm_of(3))).nodes
        announcer = nodes[2]
        await stack.enter_async_context(Discovery(announcer, SWARM, FAST))
        key = peer_key(SWARM, announcer.peer_id)
        with trio.fail_after(20):  # the PUT_VALUE has reached the node the js peer asks
            while await nodes[0].get_interop(key) is None:
                await trio.sleep(0.2)  # sleep: poll interval
        got, _ = await js_get(js_dir, nodes[0].host.addrs[0], key)
        assert got["verified"], got
        record = got["record"]
        assert record["peer"] == announcer.peer_id and record["key"] == key and record["role"] == "trainer"
        assert record["addrs"] == announcer.host.addrs


async def test_a_js_query_does_not_stall_on_a_dead_peer(js_dir):
    """Churn: a node crashed (no goodbye) while the js peer looks a record up; the query ends
    within its own timeout and still finds the record on a live replica."""
    async with AsyncExitStack() as stack:
        swarm = await stack.enter_async_context(swarm_of(5))
        nodes = swarm.nodes
        announcer = nodes[3]
        await stack.enter_async_context(Discovery(announcer, SWARM, FAST))
        key = peer_key(SWARM, announcer.peer_id)
        with trio.fail_after(20):
            while await nodes[0].get_interop(key) is None:
                await trio.sleep(0.2)  # sleep: poll interval
        swarm.kill(4)
        got, wall = await js_get(js_dir, nodes[0].host.addrs[0], key)
        assert wall < JS_TIMEOUT_MS / 1000 + 10, wall  # the reader's deadline, plus Node's start and stop
        assert got["verified"] and got["record"]["peer"] == announcer.peer_id, got
