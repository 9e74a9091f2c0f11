"""A multi-GPU machine as one peer, on CPU ranks over gloo (node/local_ranks.py), as real node
processes started through the CLI: a 2-rank peer trains the same φ as a single-rank one at the
same global batch, under DDP and under FSDP2 (node/ranks/sharding.py); an FSDP peer's checkpoint
resumes with another rank count; killing a non-gateway rank ends the whole peer within one
deadline, the swarm trains on without it, and the restarted peer resumes from its checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from meshtrain.node.spec.signed import SignedSpec
from meshtrain.node.spec.swarm import SwarmSpec
from meshtrain.node.state.checkpoint import CheckpointStore
from meshtrain.node.status.client import fetch_status, request_stop
from meshtrain.transport.identity import Identity

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["--listen", "/ip4/127.0.0.1/tcp/0", "--status-port", "0", "--threads", "1", "--no-nat"]
PEER_DOWN_DEADLINE = 30.0  # seconds from kill -9 of a local rank to the whole peer's exit

pytestmark = pytest.mark.slow


class Proc:
    def __init__(self, data_dir: Path, *args: str, device: str = "cpu") -> None:
        self.dir, self.log = data_dir, data_dir.with_suffix(".log")
        self.tmp = data_dir.with_suffix(".tmp")  # the peer's temp folder: empty again when it has exited
        self.tmp.mkdir(parents=True, exist_ok=True)
        env = dict(
            os.environ,
            TMPDIR=str(self.tmp),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        with open(self.log, "a") as err:
            self.p = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "meshtrain.node.cli",
                    "--log-level",
                    "INFO",
                    "node",
                    "start",
                    "--data-dir",
                    str(data_dir),
                    *COMMON,
                    "--device",
                    device,
                    *args,
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )

    def daemon(self, timeout: float = 120) -> dict:
        return wait_for(lambda: self._daemon(), timeout, f"{self.dir.name} to start; log {self.log}")

    def _daemon(self) -> dict | None:
        if self.p.poll() is not None:
            raise AssertionError(
                f"{self.dir.name} exited early ({self.p.returncode}); log:\n{self.log.read_text()[-3000:]}"
            )
        try:
            return json.loads((self.dir / "daemon.json").read_text())
        except (OSError, ValueError):
            return None

    def status(self) -> dict | None:
        try:
            return fetch_status(self.daemon()["status_url"], timeout=5)
        except Exception:  # noqa: BLE001 - between states; the caller polls again
            return None

    def result(self, timeout: float) -> dict:
        out, _ = self.p.communicate(timeout=timeout)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        assert self.p.returncode == 0 and lines, (
            f"{self.dir.name}: rc {self.p.returncode}; log:\n{self.log.read_text()[-3000:]}"
        )
        self.assert_left_no_temp_files()
        return json.loads(lines[-1])

    def assert_left_no_temp_files(self) -> None:
        """torch's elastic agent makes a log folder under the temp folder and never removes it: one
        per start, until the node gave it one it removes itself. (torch's compile cache,
        `torchinductor_<user>`, one per user and reused by every run, is not a leftover.)"""
        left = sorted(
            str(p.relative_to(self.tmp))
            for p in self.tmp.rglob("*")
            if not p.relative_to(self.tmp).parts[0].startswith("torchinductor_")
        )
        assert not left, f"{self.dir.name} left in its temp folder: {left}"

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


def wait_for(cond, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(poll)  # sleep: poll interval
    raise AssertionError(f"timed out waiting for {what}")


def fixed_identity(directory: Path, n: int) -> Identity:
    """Identity number `n`, the same in every run, saved as `directory`'s key. The swarm's id and
    so every peer's data follow from the keys: with fresh keys each run trained other batches, and
    the rounding difference between rank counts after 30 steps ranged over 1e-5 – 7e-4 from run to
    run (the resume test below failed about one run in three at its 3e-4 bound; load played no part)."""
    ident = Identity.from_seed(bytes([n]) * 32)
    directory.mkdir(parents=True, exist_ok=True)
    ident.save(directory / "identity.key")
    return ident


def setup_swarm(tmp: Path, **spec: object) -> tuple[Path, list[Path]]:
    """Two identities and the signed spec file. Peer 0 (the multi-rank one) owns the swarm and has
    the higher peer id: the lower id coordinates the rounds, and a coordinator whose own trainer
    reaches a round seconds after the other peer (a multi-rank peer's first round) is taken for
    "past this round" by the all-reduce, which then re-syncs both — a collective issue of its own."""
    ids = [fixed_identity(tmp / f"key{i}", i + 1) for i in range(2)]
    order = sorted(range(2), key=lambda i: ids[i].peer_id_str, reverse=True)
    keys = [tmp / f"key{i}" / "identity.key" for i in order]
    signed = SignedSpec.create(SwarmSpec(model="gpt-tiny", eval_every=0, **spec), ids[order[0]])
    return signed.save(tmp / "swarm.json"), keys


def data_dirs(base: Path, keys: list[Path]) -> list[Path]:
    dirs = []
    for i, key in enumerate(keys):
        d = base / f"p{i}"
        d.mkdir(parents=True)
        shutil.copy(key, d / "identity.key")
        dirs.append(d)
    return dirs


def run_pair(
    base: Path, spec_file: Path, keys: list[Path], nprocs: tuple[int, int], device: str = "cpu", sharding: str = "ddp"
) -> tuple[dict, list[dict]]:
    dirs = data_dirs(base, keys)
    first = Proc(
        dirs[0],
        "--swarm",
        str(spec_file),
        "--wait-peers",
        "2",
        "--nproc-per-node",
        str(nprocs[0]),
        "--sharding",
        sharding,
        device=device,
    )
    addr = first.daemon()["addrs"][0]
    second = Proc(dirs[1], "--join", addr, "--wait-peers", "2", "--nproc-per-node", str(nprocs[1]), device=device)
    results = [first.result(300), second.result(300)]
    phi = CheckpointStore(dirs[0] / "checkpoints").load_latest().state["outer"]["outer_params"]
    return phi, results


@pytest.fixture(scope="module")
def single_rank_pair(tmp_path_factory) -> tuple[Path, list[Path], dict, list[dict]]:
    """One swarm's spec and keys, and what two single-rank peers train in it: the reference the
    DDP and FSDP peers below must match (run once for both)."""
    tmp = tmp_path_factory.mktemp("single")
    spec_file, keys = setup_swarm(tmp, H=5, steps=15, batch_size=8)
    single, r_single = run_pair(tmp / "single", spec_file, keys, (1, 1))
    assert [r["rounds"] for r in r_single] == [3] * 2
    return spec_file, keys, single, r_single


def test_two_rank_peer_trains_the_same_phi_as_a_single_rank_peer(tmp_path, single_rank_pair):
    spec_file, keys, single, _ = single_rank_pair
    mixed, r_mixed = run_pair(tmp_path / "mixed", spec_file, keys, (2, 1))
    assert r_mixed[0]["local_ranks"] == 2 and len(r_mixed[0]["local_ranks_peak_rss_mib"]) == 2
    assert [r["rounds"] for r in r_mixed] == [3] * 2
    diff = max(float((mixed[n] - single[n]).abs().max()) for n in mixed)
    # Not bit-identical: two ranks sum half-batch gradients in another order, and AdamW's 1/sqrt(v)
    # grows those last-bit differences over 15 steps (3e-6 to 3e-5 seen, depending on the thread
    # count torch picks under load). A wrong split (a half batch lost, a rank not averaged) moves
    # φ by about the learning rate per step, 1e-3 or more.
    assert diff <= 1e-4, diff


@pytest.mark.cuda
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices; torch sees fewer here (CPU-only CI): run on a GPU machine with -m cuda",
)
def test_two_gpu_peer_over_nccl_trains_close_to_a_single_gpu_peer(tmp_path):
    spec_file, keys = setup_swarm(tmp_path, H=5, steps=15, batch_size=8)
    mixed, _ = run_pair(tmp_path / "mixed", spec_file, keys, (2, 1), device="cuda")
    single, _ = run_pair(tmp_path / "single", spec_file, keys, (1, 1), device="cuda")
    # GPU kernels are not bit-reproducible across batch splits; the match is looser than on CPU
    assert max(float((mixed[n] - single[n]).abs().max()) for n in mixed) <= 1e-3


def max_phi_difference(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_two_rank_fsdp_peer_trains_the_same_phi_as_a_single_rank_peer(tmp_path, single_rank_pair):
    spec_file, keys, single, _ = single_rank_pair
    sharded, r_sharded = run_pair(tmp_path / "fsdp", spec_file, keys, (2, 1), sharding="fsdp")
    assert r_sharded[0]["local_ranks"] == 2 and r_sharded[0]["sharding"] == "fsdp"
    assert [r["rounds"] for r in r_sharded] == [3] * 2
    # The same bound as under DDP (above): FSDP reduce-scatters the half-batch gradients in
    # another order; a lost half batch or a shard not pushed back moves φ by 1e-3 or more.
    assert max_phi_difference(sharded, single) <= 1e-4


def assert_saved_in_halves(directory: Path) -> None:
    """The inner state of a 2-rank FSDP peer, as DCP saved it: each AdamW moment in two chunks,
    one half of its rows each, written by two ranks (one file per rank) — so each rank held only
    its shard, and the state was never gathered whole to save it."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(directory).read_metadata()
    files: dict[tuple[str, tuple[int, ...]], str] = {
        (index.fqn, tuple(index.offset)): info.relative_path
        for index, info in metadata.storage_data.items()
        if index.offset is not None  # tensors; AdamW's step counts are saved as bytes
    }
    moments = {k: m for k, m in metadata.state_dict_metadata.items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert moments, sorted(metadata.state_dict_metadata)[:5]
    for key, meta in moments.items():
        rows = meta.size[0]
        assert [c.sizes[0] for c in meta.chunks] == [(rows + 1) // 2, rows // 2], (key, meta.chunks)
        assert len({files[(key, tuple(c.offsets))] for c in meta.chunks}) == 2, key


def test_fsdp_peer_resumes_its_checkpoint_with_another_rank_count(tmp_path):
    """Two peers, each alone, train 30 steps in runs of 10: one as 2 FSDP ranks, again as 2 FSDP
    ranks, then as one rank; the other 20 steps as one rank, then 10 as 2 FSDP ranks. Each
    resumes the other kind's checkpoint, and the first its own FSDP one (θ, φ and the outer
    state in the checkpoint file, the inner optimizer's moments sharded beside it with DCP), so
    both end on the same φ — which they would not if the sharded moments were not read back
    (by 2 ranks, or whole by one) or not cut into shards from a single rank's checkpoint (a
    fresh AdamW moves φ by ~1e-3)."""
    ident = fixed_identity(tmp_path / "key", 1)
    spec_file = SignedSpec.create(SwarmSpec(model="gpt-tiny", eval_every=0, H=5, steps=30, batch_size=8), ident).save(
        tmp_path / "swarm.json"
    )
    # FSDP legs checkpoint at every report (every round here): every rank saves its shard in
    # the middle of a run, not only at its end, and old saves are pruned with their checkpoints
    fsdp = ("--nproc-per-node", "2", "--sharding", "fsdp", "--checkpoint-every", "0.01")
    single = ("--nproc-per-node", "1")

    def legs(name: str, *runs: tuple[int, tuple[str, ...]]) -> dict:
        data_dir = data_dirs(tmp_path / name, [tmp_path / "key" / "identity.key"])[0]
        store = CheckpointStore(data_dir / "checkpoints", readonly=True)
        for i, (until, args) in enumerate(runs):
            proc = Proc(data_dir, *(("--swarm", str(spec_file)) if i == 0 else ()), "--max-steps", str(until), *args)
            try:
                assert proc.result(120)["step"] == until
            finally:
                proc.kill()
            if i:
                assert f"resumed from checkpoint step={runs[i - 1][0]}" in proc.log.read_text()
            saved = store.load_latest()
            # the stop's own checkpoint, not an earlier periodic one (a stop that cancels a round
            # in flight saves none: then φ would trail by that round)
            assert saved is not None and saved.step == until, (name, saved and saved.step, proc.log.read_text()[-3000:])
            if args == fsdp:
                shards = saved.state["inner_shards"]
                assert shards["step"] == until and "inner" not in saved.state["outer"]
                assert_saved_in_halves(data_dir / "checkpoints" / shards["dir"])
                # every kept checkpoint's save is there; older saves are pruned at the next save
                # after the checkpoint store dropped the checkpoint that named them
                named = {ck.step for p in store.list() if "inner_shards" in (ck := store.load(p)).state}
                inner = {int(p.name.split("-")[1]) for p in (data_dir / "checkpoints").glob("inner-*")}
                assert named <= inner and len(inner) <= len(named) + 1, (inner, named)
            else:
                assert saved.state["outer"]["inner"]["state"], "a single rank's inner state is in its checkpoint"
        return saved.state["outer"]["outer_params"]

    # The two peers are independent (each alone in its own swarm, its own data dir): they run
    # side by side, each node process on one thread.
    with ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(legs, "fsdp-first", (10, fsdp), (20, fsdp), (30, single)),
            pool.submit(legs, "single-first", (20, single), (30, fsdp)),
        ]
        phi = [r.result() for r in runs]
    # With these fixed keys the two differ by 7.1e-5, the same in every run, loaded or not (the
    # rank counts' rounding); what this test guards against moves φ by ~1e-3.
    assert max_phi_difference(*phi) <= 1.5e-4


@pytest.mark.cuda
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices; torch sees fewer here (CPU-only CI): run on a GPU machine with -m cuda",
)
def test_two_gpu_fsdp_peer_over_nccl_trains_close_to_a_single_gpu_peer(tmp_path):
    spec_file, keys = setup_swarm(tmp_path, H=5, steps=15, batch_size=8)
    sharded, _ = run_pair(tmp_path / "fsdp", spec_file, keys, (2, 1), device="cuda", sharding="fsdp")
    single, _ = run_pair(tmp_path / "single", spec_file, keys, (1, 1), device="cuda")
    assert max_phi_difference(sharded, single) <= 1e-3


def test_killing_a_non_gateway_rank_ends_the_peer_and_the_swarm_goes_on(tmp_path):
    spec_file, keys = setup_swarm(tmp_path, H=5, steps=0, batch_size=8)
    dirs = data_dirs(tmp_path / "run", keys)
    # A round that began while the peer was alive waits for it up to the hard join deadline
    # (3 × --join-timeout) before it completes without it: keep that short here.
    peer = Proc(
        dirs[0],
        "--swarm",
        str(spec_file),
        "--wait-peers",
        "2",
        "--nproc-per-node",
        "2",
        "--checkpoint-every",
        "0.5",
        "--join-timeout",
        "3",
    )
    other = Proc(dirs[1], "--join", peer.daemon()["addrs"][0], "--wait-peers", "2", "--join-timeout", "3")
    try:
        st = wait_for(
            lambda: (s := peer.status()) and s["checkpoint"]["last_step"] and s["training"]["round"] >= 2 and s,
            120,
            "the 2-rank peer to train rounds and checkpoint",
        )
        pids = st["node"]["local_rank_pids"]
        assert len(pids) == 2 and st["node"]["local_ranks"] == 2 and st["node"]["device"] == "cpu"
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        peer.p.wait(timeout=PEER_DOWN_DEADLINE)
        assert time.monotonic() - t0 < PEER_DOWN_DEADLINE
        err = peer.log.read_text().strip().splitlines()[-1]
        assert peer.p.returncode == 1 and err.startswith(
            "meshtrain: local rank 1 of this peer ended (signal SIGKILL)"
        ), err
        for pid in pids:  # no rank is left behind
            wait_for(lambda pid=pid: not _alive(pid), 10, f"rank process {pid} to exit")
        peer.assert_left_no_temp_files()
        saved = CheckpointStore(dirs[0] / "checkpoints").load_latest()
        # The swarm saw the peer leave and trains on without it.
        wait_for(lambda: (s := other.status()) and len(s["peers"]) == 1, 30, "the other peer to see it leave")
        r0 = other.status()["training"]["round"]
        wait_for(lambda: other.status()["training"]["round"] >= r0 + 2, 30, "the other peer's rounds to go on")
        # Restarted, the peer resumes from its checkpoint and trains with the swarm again.
        (dirs[0] / "daemon.json").unlink(missing_ok=True)
        restarted = Proc(dirs[0], "--nproc-per-node", "2", "--join-timeout", "3")
        restarted.daemon()
        wait_for(
            lambda: f"resumed from checkpoint step={saved.step}" in peer.log.read_text(),
            60,
            "the restarted peer to resume from its checkpoint",
        )
        rr = wait_for(lambda: (s := restarted.status()) and s["training"]["round"] or None, 60, "a round after restart")
        wait_for(lambda: (s := restarted.status()) and s["training"]["round"] >= rr + 2, 60, "rounds after restart")
        request_stop(restarted.daemon()["status_url"], (dirs[0] / "control.token").read_text().strip(), timeout=5)
        assert restarted.result(60)["local_ranks"] == 2
    finally:
        for proc in (peer, other, locals().get("restarted")):
            if proc is not None:
                proc.kill()


AGENT_CLOSE_S = 30.0  # the elastic agent's wait for ranks after passing SIGTERM on, before it kills them
AGENT_KILLED = "Unable to shutdown process"  # what the agent logs as it kills a rank that outlived that wait


def test_sigterm_during_start_up_ends_the_peer_within_seconds(tmp_path):
    """The node has started and waits for a peer that never comes: SIGTERM to the launcher ends
    every rank by itself (the elastic agent would otherwise wait 30 s for ranks that wait for it to
    read their results, then kill them). What the stop does take is the ranks' start-up work still
    under way — each rank's trainer is built in one piece (model, data), and rank 0's "done" reaches
    a follower only once the follower's is built (py-spy, stop 59): ~3 s here, 11 s on a loaded
    machine (a whole-suite run beside `stress-ng`) — so the bound is the agent's wait, and the sign
    that the stop relied on it, the agent's kill, is looked for in the log."""
    spec_file, keys = setup_swarm(tmp_path, H=5, steps=0, batch_size=8)
    peer = Proc(
        data_dirs(tmp_path / "run", keys[:1])[0],
        "--swarm",
        str(spec_file),
        "--wait-peers",
        "2",
        "--nproc-per-node",
        "2",
    )
    try:
        pids = wait_for(lambda: (s := peer.status()) and s["node"]["local_rank_pids"], 120, "the peer's status page")
        peer.p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        out, _ = peer.p.communicate(timeout=60)
        took = time.monotonic() - t0
        assert AGENT_KILLED not in peer.log.read_text(), peer.log.read_text()[-3000:]
        assert took < AGENT_CLOSE_S, f"took {took:.1f} s"
        assert peer.p.returncode == 0 and json.loads(out.splitlines()[-1]) == {"stopped": True, "signal": "SIGTERM"}
        for pid in pids:
            wait_for(lambda pid=pid: not _alive(pid), 5, f"rank process {pid} to exit")
        peer.assert_left_no_temp_files()
    finally:
        peer.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
