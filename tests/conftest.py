"""Shared fixtures: real hosts on loopback, each with its data plane; and the hooks of
tests/failure_reports.py (a failure inside exception groups leads with its assertion, and a
failed test's report ends with the tails of its daemons' log files)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from meshtrain.log import configure
from meshtrain.transport.host import Host, HostConfig
from meshtrain.transport.identity import Identity
from meshtrain.transport.tensor_streams import DataPlaneConfig, TensorStreams
from tests.failure_reports import (  # noqa: F401 (hooks)
    SPAWNED_LOGS,
    pytest_runtest_logreport,
    pytest_runtest_makereport,
    pytest_runtest_setup,
)

ROOT = Path(__file__).resolve().parent.parent
# In-process peers log at WARNING; `MESHTRAIN_TEST_LOG=DEBUG pytest -s ...` shows a flaky test's
# protocol steps (how the regroup loop of test_grouped_rounds was found).
configure(os.environ.get("MESHTRAIN_TEST_LOG", "WARNING"))

# A trio test is cancelled from inside its own run this long before pytest-timeout would stop it.
# pytest-timeout raises into trio's event loop, which leaves the run half torn down: every later
# trio test in the process then fails with "Attempted to call run() from inside a run()". A test
# cancelled from inside fails alone, and says which tasks were waiting where.
DEADLINE_MARGIN = 30.0


def timeout_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and (marker.args or "timeout" in marker.kwargs):
        return float(marker.kwargs.get("timeout", marker.args[0] if marker.args else 0))
    option = item.config.getoption("timeout", None)
    return float(option if option is not None else item.config.getini("timeout") or 0)


def task_tree() -> str:
    """Every task of the current trio run, indented by nursery, with the innermost project frames
    it awaits in."""
    lines: list[str] = []

    def walk(task: trio.lowlevel.Task, depth: int) -> None:
        frames = [
            f"{Path(f.f_code.co_filename).name}:{lineno} {f.f_code.co_name}"
            for f, lineno in task.iter_await_frames()
            if "/meshtrain/" in f.f_code.co_filename or "/tests/" in f.f_code.co_filename
        ]
        lines.append(f"{'  ' * depth}{task.name}: {' > '.join(frames[-3:])}")
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child, depth + 1)

    walk(trio.lowlevel.current_root_task(), 0)
    return "\n".join(lines)


def with_deadline(test, seconds: float):
    """`test`, cancelled after `seconds` of wall-clock time (a thread's timer: a test on trio's
    MockClock may jump its virtual clock far past any deadline)."""

    @functools.wraps(test)
    async def guarded(*args, **kwargs):
        scope = trio.CancelScope()
        fired: list[str] = []
        token = trio.lowlevel.current_trio_token()

        def on_deadline() -> None:  # in the trio thread
            fired.append(task_tree())
            print(f"test deadline ({seconds:.0f} s) passed; the tasks:\n{fired[0]}", file=sys.stderr)
            scope.cancel()

        def expire() -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(on_deadline)

        timer = threading.Timer(seconds, expire)
        timer.daemon = True
        timer.start()
        try:
            with scope:
                result = await test(*args, **kwargs)
        finally:
            timer.cancel()
        if fired:
            pytest.fail(f"cancelled at the test deadline ({seconds:.0f} s); the tasks then:\n{fired[0]}")
        return result

    return guarded


# `make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadfile
# --no-loadscope-reorder`): a module is one unit of work (its module-scoped fixtures are built
# once), handed out in the order below (xdist would otherwise start with the modules of most
# tests). The modules that start processes or NAT labs go first, the short in-process ones fill
# the end: a long module started last would leave one worker idle while the other runs it. Two
# NAT labs may run side by side: each lives in namespaces of its own (every link and sysctl is
# made with `ip -n`), `cleanup_stale` removes only labs whose owner process is gone, and
# `root_untouched` compares the root namespace, which no lab touches. (`--dist loadgroup` would
# let the labs share one unit, but pytest-xdist 3.8 cannot set a group in a test's id under
# pytest 9.2: the tests were handed out one by one.)
def starts_processes(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is not None or item.get_closest_marker("nat") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    module = {item: item.nodeid.split("::", 1)[0] for item in items}
    first = {module[item] for item in items if starts_processes(item)}
    items.sort(key=lambda item: module[item] not in first)  # stable: the order within a module is kept


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item):
    """Runs before pytest-trio wraps the test into its trio.run: guard the test itself."""
    test = getattr(item, "obj", None)
    limit = timeout_of(item)
    if (
        item.get_closest_marker("trio") is not None
        and inspect.iscoroutinefunction(test)
        and not hasattr(test, "hypothesis")
        and limit > 2 * DEADLINE_MARGIN
    ):
        item.obj = with_deadline(test, limit - DEADLINE_MARGIN)
    yield


class Peer:
    def __init__(self, host: Host, streams: TensorStreams | None) -> None:
        self.host = host
        self.ts = streams

    @property
    def id(self) -> str:
        return self.host.peer_id


async def start_peers(
    stack: AsyncExitStack,
    n: int,
    *,
    host_config: HostConfig | None = None,
    dp: DataPlaneConfig | None = None,
    streams: bool = True,
    full_mesh: bool = False,
    identities: list[Identity] | None = None,
) -> list[Peer]:
    """`n` running peers, each connected to the first — or, with `full_mesh`, to every other;
    with fresh identities, or `identities` (a test whose plan depends on the peer ids)."""
    peers = []
    for i in range(n):
        identity = identities[i] if identities is not None else Identity.generate()
        host = await stack.enter_async_context(Host(identity, host_config))
        ts = await stack.enter_async_context(TensorStreams(host, dp)) if streams else None
        peers.append(Peer(host, ts))
    for i, p in enumerate(peers):
        for q in peers[:i] if full_mesh else peers[: min(i, 1)]:
            if not p.host.is_connected(q.id):
                await p.host.connect(q.host.addrs[0])
    return peers


@pytest.fixture
async def pair() -> AsyncIterator[list[Peer]]:
    async with AsyncExitStack() as stack:
        yield await start_peers(stack, 2)


def spawn(*args: str, stderr_path: str | None = None) -> subprocess.Popen:
    """Start `python <args>` from the project root with unbuffered text pipes; stderr goes to
    `stderr_path` (for diagnosing a failed test) or nowhere."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", MESHTRAIN_LOG="INFO" if stderr_path else "WARNING")
    if stderr_path:
        SPAWNED_LOGS.append(Path(stderr_path).absolute())
    with open(stderr_path or os.devnull, "a") as err:
        return subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
        )


def start_swarm_processes(procs: list[subprocess.Popen]) -> list[dict]:
    """The stdio handshake of the tests/proc_*.py peers: read each one's hello (with its "addr"),
    hand every peer the list of all addresses, wait until each says it is ready, then say "go".
    Returns the hellos, in `procs` order."""
    hello = [read_json(p) for p in procs]
    addrs = json.dumps([h["addr"] for h in hello])
    for p in procs:
        p.stdin.write(addrs + "\n")
        p.stdin.flush()
    for p in procs:
        assert read_json(p)["ready"]
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    return hello


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """Kill the ones still running and reap them all."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def tail(path: str, lines: int = 15) -> str:
    try:
        with open(path) as f:
            keep = [x for x in f.read().splitlines() if "meshtrain" in x or "Error" in x or "Traceback" in x]
        return "\n".join(keep[-lines:])
    except OSError:
        return ""


def read_json(proc: subprocess.Popen) -> dict:
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"process exited with {proc.wait()} before printing")
    return json.loads(line)


def require_natlab() -> None:
    """Skip the calling test or fixture unless the NAT lab can run here (root, ip, nft, tc, a
    namespace that really holds a veth pair); then clear the labs of runs that were killed."""
    from scripts.labs.natlab.lab import LabUnavailable, check_support, cleanup_stale

    try:
        check_support()
    except LabUnavailable as e:
        pytest.skip(f"NAT lab unavailable: {e}")
    cleanup_stale()


def natlab_root_state() -> dict[str, str]:
    """What the caller's namespace looks like (IPv6 routes too: a lab with `ipv6=True` must not
    touch them either); a NAT lab must leave it exactly so."""
    from scripts.labs.natlab.lab import run_command

    links = run_command(["ip", "-o", "link"]).stdout
    names = sorted(line.split(":")[1].strip() for line in links.splitlines())
    return {
        "links": "\n".join(names),
        "routes": run_command(["ip", "route"]).stdout,
        "routes6": run_command(["ip", "-6", "route"], check=False).stdout,
        "nft": run_command(["nft", "list", "ruleset"]).stdout,
    }


@pytest.fixture(scope="module")
def root_untouched() -> Iterator[None]:
    """Skips without a NAT lab; fails the module whose labs changed the caller's namespace."""
    require_natlab()
    before = natlab_root_state()
    yield
    assert natlab_root_state() == before, "the NAT lab changed the root namespace"
