"""Checkpoints: bit-exact round trip, corruption detected, atomic under kill -9."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from meshtrain.allocator import release_freed_memory
from meshtrain.node.state.checkpoint import CheckpointStore

from .conftest import spawn
from .proc_checkpointer import state_at


def assert_state_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_state_equal(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_state_equal(x, y)
    else:
        assert a == b


def test_round_trip_is_bit_exact_with_optimizer_state(tmp_path):
    store = CheckpointStore(tmp_path)
    state = state_at(5)
    state["bf16"] = torch.randn(7).bfloat16()
    store.save(state, step=5, round=0)
    loaded = store.load_latest()
    assert loaded.step == 5
    assert_state_equal(state, loaded.state)
    model = torch.nn.Linear(64, 32)
    model.load_state_dict(loaded.state["model"])  # real torch objects accept it
    torch.optim.AdamW(model.parameters()).load_state_dict(loaded.state["inner"])


def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(state_at(1), step=1, round=0)
    newest = store.save(state_at(2), step=2, round=0)
    blob = newest.path / "tensors.safetensors"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    loaded = store.load_latest()
    assert loaded.step == 1
    assert_state_equal(state_at(1), loaded.state)


def test_keeps_only_newest(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for s in range(4):
        store.save({"x": torch.tensor(s)}, step=s, round=0)
    assert [p.name for p in store.list()] == ["ckpt-000000002", "ckpt-000000003"]


def test_a_state_larger_than_a_shard_is_written_in_shards_that_load_back_bit_exact(tmp_path):
    """A 7B model's checkpoint is ~140 GB: it goes to disk in shards (huggingface_hub's split),
    each with its digest in the manifest; a corrupt shard fails the checkpoint, and the previous
    one is loaded instead."""
    store = CheckpointStore(tmp_path, shard_bytes=4096)  # 1 KiB tensors: several per shard
    weight = torch.randn(256)
    state = {
        "model": {"embed": weight, "head": weight, "big": torch.randn(3000), "empty": torch.zeros(0)},
        "inner": [torch.randn(256).bfloat16() for _ in range(8)],
        "step": 9,
    }
    first = store.save(state, step=9, round=4)
    files = sorted(p.name for p in first.path.glob("tensors*.safetensors"))
    assert len(files) >= 3 and all(f.startswith("tensors-0000") for f in files), files
    manifest = json.loads((first.path / "manifest.json").read_text())
    assert manifest["format"] == 2 and sorted(manifest["tensor_files"]) == files
    loaded = store.load_latest()
    assert loaded is not None and loaded.digest == first.digest
    assert_state_equal(state, loaded.state)
    assert loaded.state["model"]["head"] is loaded.state["model"]["embed"]

    second = store.save(state, step=10, round=5)
    shard = second.path / files[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert store.load_latest().step == 9


def test_a_checkpoint_of_the_first_format_still_loads(tmp_path):
    """Format 1 (one tensor file, `tensors_blake3`), as every checkpoint before shards was."""
    from safetensors.torch import save_file

    from meshtrain.node.state.checkpoint import file_digest, flatten_state
    from meshtrain.transport.framing import packb

    state = state_at(3)
    folder = tmp_path / "ckpt-000000003"
    folder.mkdir()
    skeleton, tensors = flatten_state(state)
    save_file(tensors, str(folder / "tensors.safetensors"))
    (folder / "state.msgpack").write_bytes(packb(skeleton))
    manifest = {
        "format": 1,
        "step": 3,
        "round": 1,
        "tensors_blake3": file_digest(folder / "tensors.safetensors"),
        "state_blake3": file_digest(folder / "state.msgpack"),
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    loaded = CheckpointStore(tmp_path, readonly=True).load_latest()
    assert loaded is not None and loaded.step == 3 and loaded.digest == manifest["tensors_blake3"]
    assert_state_equal(state, loaded.state)


@pytest.mark.parametrize(
    "tensor_files", [{}, {"../x.safetensors": "ab"}, {"state.msgpack": "ab"}, ["tensors.safetensors"], {"a": 1}]
)
def test_a_manifest_naming_files_outside_the_checkpoint_is_a_bad_checkpoint(tmp_path, tensor_files):
    store = CheckpointStore(tmp_path)
    store.save(state_at(1), step=1, round=0)
    newest = store.save(state_at(2), step=2, round=0)
    manifest = json.loads((newest.path / "manifest.json").read_text())
    manifest["tensor_files"] = tensor_files
    (newest.path / "manifest.json").write_text(json.dumps(manifest))
    assert store.load_latest().step == 1


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak-RSS reset")
def test_a_checkpoint_is_written_from_the_live_tensors_without_a_copy(tmp_path):
    """The write takes no memory of the state's size: the process's peak RSS (reset first) grows
    by less than the smallest tensor while 96 MiB of tensors are written and digested; a tied
    tensor is written once and loads as one tensor under both names."""
    release_freed_memory()  # as a node does: freed blocks leave RSS at once
    mib32 = (32 << 20) // 4
    weight = torch.randn(mib32)
    state = {
        "model": {"embed.weight": weight, "lm_head.weight": weight, "norm": torch.randn(mib32)},
        "inner": {"exp_avg": torch.randn(mib32)},
    }
    store = CheckpointStore(tmp_path)
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    before = _status_kib("VmRSS")
    pending = store.write(state, step=7, round=1)
    pending.commit()
    grown_mib = (_status_kib("VmHWM") - before) / 1024
    assert grown_mib < 16, f"peak RSS grew {grown_mib:.1f} MiB while writing 96 MiB of tensors"
    loaded = store.load_latest()
    assert loaded is not None and loaded.step == 7
    assert loaded.state["model"]["lm_head.weight"] is loaded.state["model"]["embed.weight"]
    assert_state_equal(state, loaded.state)


KILLS = 6  # each a fresh interpreter (~1.2 s of imports) killed 1.5-3 s in: ~20 s in all


@pytest.mark.slow
def test_kill_9_at_random_moments_never_corrupts(tmp_path):
    rng = random.Random(1)
    corrupt, resumed = 0, 0
    for _ in range(KILLS):
        proc = spawn("tests/proc_checkpointer.py", str(tmp_path))
        saved = []
        deadline = time.monotonic() + rng.uniform(1.5, 3.0)
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line:
                saved.append(json.loads(line))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for line in proc.stdout:  # what it announced before dying
            saved.append(json.loads(line))
        loaded = CheckpointStore(tmp_path, keep=2).load_latest()
        if loaded is None:
            corrupt += 1
            continue
        # The newest checkpoint is the last announced one or the one being written after it.
        last = saved[-1]["saved"] if saved else -1
        assert loaded.step in (last, last + 1)
        assert_state_equal(state_at(loaded.step), loaded.state)
        resumed += 1
    assert corrupt == 0 and resumed == KILLS
