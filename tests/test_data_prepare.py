"""Preparing a file dataset at start-up: the digest is reused when no file changed (and recomputed,
to the same function of the content, when one did), a tokenising killed with SIGKILL resumes from
its committed shards to the very cache an uninterrupted build writes, and progress is reported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from meshtrain.data import PackedDataset, Progress, dataset_digest, open_dataset, resolve_dataset
from meshtrain.data import files as data_files
from meshtrain.data.cache import PROGRESS, Split, build_token_cache
from meshtrain.data.files import ETA_AFTER_S, READS, SAMPLE_BYTES, ProgressMeter
from meshtrain.errors import ConfigError

from .test_node_cli import cli, create, no_daemon_outlives_its_test, start, wait_daemon  # noqa: F401 — a fixture
from .test_startup import SLOW_FACTORY

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


class BytesWithEos:
    """UTF-8 bytes plus an end-of-text token 256; counts the documents it encodes."""

    vocab_size = 257
    eos_id = 256
    digest = "bytes+eos"

    def __init__(self) -> None:
        self.encoded = 0

    def encode(self, text: str) -> list[int]:
        self.encoded += 1
        return list(text.encode("utf-8"))


def big_text(path: Path, mib: int) -> Path:
    line = b"the quick brown fox jumps over the lazy dog\n" * 9 + b"\n"  # a paragraph: a document
    path.write_bytes((line * (mib * MIB // len(line) + 1))[: mib * MIB])
    return path


def reads(action) -> tuple[object, int]:
    before = READS.bytes
    result = action()
    return result, READS.bytes - before


def test_unchanged_files_are_not_reread_on_a_second_open(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    big_text(data / "a.txt", 8)
    big_text(data / "b.txt", 5)
    files = resolve_dataset(data)
    manifest = tmp_path / "cache" / "digests" / "data.json"
    first, first_read = reads(lambda: files.digest(manifest=manifest))
    again, again_read = reads(lambda: resolve_dataset(data).digest(manifest=manifest))
    assert first == again == dataset_digest(data)  # the pinned function of the content, cached
    assert first_read >= 13 * MIB
    assert again_read == 2 * 3 * SAMPLE_BYTES  # the samples, not the 13 MiB


def test_a_touched_file_is_redigested_to_the_same_digest(tmp_path):
    path = big_text(tmp_path / "corpus.txt", 8)
    manifest = tmp_path / "digests.json"
    first = resolve_dataset(path).digest(manifest=manifest)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    touched, touched_read = reads(lambda: resolve_dataset(path).digest(manifest=manifest))
    assert touched == first and touched_read >= 8 * MIB
    _, after_read = reads(lambda: resolve_dataset(path).digest(manifest=manifest))
    assert after_read == 3 * SAMPLE_BYTES  # the manifest now records the new mtime


def test_an_edited_file_changes_the_digest_even_with_its_mtime_restored_in_a_sample(tmp_path):
    path = big_text(tmp_path / "corpus.txt", 8)
    manifest = tmp_path / "digests.json"
    first = resolve_dataset(path).digest(manifest=manifest)
    st = path.stat()
    with open(path, "r+b") as f:  # same size, in the middle MiB, mtime put back
        f.seek(4 * MIB)
        f.write(b"THE")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    edited = resolve_dataset(path).digest(manifest=manifest)
    assert edited != first and edited == dataset_digest(path)
    with open(path, "ab") as f:  # an ordinary edit: size and mtime move
        f.write(b"more\n")
    assert resolve_dataset(path).digest(manifest=manifest) == dataset_digest(path) != edited


def test_what_the_manifest_lets_past_an_unsampled_edit_with_size_and_mtime_restored(tmp_path):
    """The documented limit (files.py): such an edit keeps the recorded digest until the manifest
    goes; without a manifest the digest sees it."""
    path = big_text(tmp_path / "corpus.txt", 8)
    manifest = tmp_path / "digests.json"
    first = resolve_dataset(path).digest(manifest=manifest)
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(2 * MIB)  # between the first and the middle sampled MiB
        f.write(b"THE")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert resolve_dataset(path).digest(manifest=manifest) == first
    assert dataset_digest(path) != first
    manifest.unlink()
    assert resolve_dataset(path).digest(manifest=manifest) == dataset_digest(path)


def test_open_dataset_keeps_its_manifest_under_the_cache_root(tmp_path):
    path = big_text(tmp_path / "corpus.txt", 4)
    tok = BytesWithEos()
    first = open_dataset(path, tok, tmp_path / "cache", held_out=0.1)
    assert len(list((tmp_path / "cache" / "digests").glob("*.json"))) == 1
    again, again_read = reads(lambda: open_dataset(path, tok, tmp_path / "cache", held_out=0.1))
    assert again.directory == first.directory and again_read == 3 * SAMPLE_BYTES


def test_progress_rises_to_total_digesting_then_tokenising(tmp_path, monkeypatch):
    monkeypatch.setattr(data_files, "PROGRESS_EVERY_S", 0.0)  # every advance, not every 0.5 s
    path = big_text(tmp_path / "corpus.txt", 12)
    seen: list[Progress] = []
    open_dataset(path, BytesWithEos(), tmp_path / "cache", held_out=0.1, progress=seen.append)
    assert [p.phase for p in seen] == sorted((p.phase for p in seen), key=["digesting", "tokenising"].index)
    for phase in ("digesting", "tokenising"):
        mine = [p for p in seen if p.phase == phase]
        assert len(mine) >= 2 and all(p.total == 12 * MIB for p in mine)
        assert all(a.done < b.done for a, b in zip(mine, mine[1:], strict=False))
        assert mine[-1].done == mine[-1].total
    seen.clear()
    open_dataset(path, BytesWithEos(), tmp_path / "cache", held_out=0.1, progress=seen.append)
    assert seen == []  # nothing to digest or tokenise


def test_progress_reads_as_a_line_for_people():
    p = Progress("tokenising", "data/corpus.txt", 1_200_000_000, 4_000_000_000, eta_s=180.0)
    assert p.describe() == "tokenising data/corpus.txt, 1.2 of 4.0 GB (30 %), about 3 min left"
    assert Progress("digesting", "d", 0, 500).describe() == "digesting d, 0 of 500 B (0 %)"


def test_a_finished_phase_says_nothing_is_left_however_long_it_took():
    seen: list[str] = []
    meter = ProgressMeter("tokenising", "d", 1000, callback=lambda p: seen.append(p.describe()))
    meter.t0 -= 10 * ETA_AFTER_S  # a slow build: long enough for a measured rate
    meter.advance(500)
    meter.t_call = 0.0  # due for a callback
    meter.advance(600)
    meter.finish()
    assert "left" in seen[0], seen
    assert seen[-1] == "tokenising d, 1.0 of 1.0 kB (100 %)", seen


KILLED_BUILD = """
import sys, time
from pathlib import Path
from meshtrain.data.cache import Split, build_token_cache
from meshtrain.data.files import resolve_dataset

class SlowBytesWithEos:
    vocab_size, eos_id, digest = 257, 256, "bytes+eos"
    def encode(self, text):
        time.sleep(0.001)  # sleep: a slow tokenizer, so the build still runs when it is killed
        return list(text.encode("utf-8"))

build_token_cache(resolve_dataset(sys.argv[1]), SlowBytesWithEos(), Path(sys.argv[2]), key="k",
                  split=Split(0.2), shard_tokens=1000)
"""


def test_a_build_killed_mid_tokenising_resumes_to_an_uninterrupted_builds_cache(tmp_path):
    docs = [f"document {i} " + "lorem ipsum " * (i % 9) for i in range(8000)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    script = tmp_path / "build.py"
    script.write_text(textwrap.dedent(KILLED_BUILD))
    work = tmp_path / "killed" / ".building-k"
    child = subprocess.Popen(
        [sys.executable, str(script), str(data), str(tmp_path / "killed")], env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    try:
        deadline = time.monotonic() + 120
        while child.poll() is None and time.monotonic() < deadline:
            try:
                if json.loads((work / PROGRESS).read_text())["documents"] >= 2048:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.01)  # sleep: poll interval
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL and not (tmp_path / "killed" / "k").exists()
    committed = json.loads((work / PROGRESS).read_text())
    assert 2048 <= committed["documents"] < len(docs)
    with open(work / "train.bin", "ab") as f:  # a torn write past the last commit
        f.write(b"\xff" * 1001)

    tok = BytesWithEos()
    resumed = PackedDataset.open(
        build_token_cache(resolve_dataset(data), tok, tmp_path / "killed", key="k", split=Split(0.2))
    )
    whole = PackedDataset.open(
        build_token_cache(resolve_dataset(data), BytesWithEos(), tmp_path / "whole", key="k", split=Split(0.2))
    )
    assert tok.encoded == len(docs) - committed["documents"]  # finished shards kept, not redone
    assert (resumed.directory / "train.bin").read_bytes() == (whole.directory / "train.bin").read_bytes()
    assert (resumed.directory / "held_out.bin").read_bytes() == (whole.directory / "held_out.bin").read_bytes()
    assert {k: v for k, v in resumed.meta.items() if k != "seconds"} == {
        k: v for k, v in whole.meta.items() if k != "seconds"
    }
    assert not (tmp_path / "killed" / ".building-k").exists()
    for step in range(5):
        a = resumed.batch(4, 16, seed=3, peer="p", step=step)
        b = whole.batch(4, 16, seed=3, peer="p", step=step)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert np.array_equal(resumed.eval_batches(2, 2, 16)[0][0].numpy(), whole.eval_batches(2, 2, 16)[0][0].numpy())


@pytest.mark.parametrize("garbage", ["{not json", json.dumps({"key": "other", "dtype": "uint16"})])
def test_a_foreign_or_broken_progress_record_starts_the_build_afresh(tmp_path, garbage):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(50)))
    work = tmp_path / "cache" / ".building-k"
    work.mkdir(parents=True)
    (work / PROGRESS).write_text(garbage)
    (work / "train.bin").write_bytes(b"\x01" * 64)
    built = PackedDataset.open(build_token_cache(resolve_dataset(data), BytesWithEos(), tmp_path / "cache", key="k"))
    fresh = PackedDataset.open(build_token_cache(resolve_dataset(data), BytesWithEos(), tmp_path / "fresh", key="k"))
    assert (built.directory / "train.bin").read_bytes() == (fresh.directory / "train.bin").read_bytes()


@pytest.mark.slow
def test_a_preparing_node_says_how_far_its_data_is_on_status(tmp_path, monkeypatch):
    factory = tmp_path / "slow_model.py"
    factory.write_text(SLOW_FACTORY)
    monkeypatch.setenv("MESHTRAIN_TEST_GATE", str(tmp_path / "never"))  # the model never finishes
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(500)))
    d, log = tmp_path / "a", tmp_path / "a.log"
    create(d, "--model", f"py:{factory}:make", "--dataset", str(data), "--steps", "0", "--eval-every", "0")
    p = start("--data-dir", str(d), log=log)
    wait_daemon(d, p, log)
    deadline = time.monotonic() + 60
    while not (tmp_path / "building").exists():  # the data is ready: the model is being built
        assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)  # sleep: poll interval
    r = cli("node", "status", "--data-dir", str(d), "--json")
    assert r.returncode == 0, r.stderr
    waiting = json.loads(r.stdout)["training"]["waiting"]
    assert waiting.startswith(f"preparing: tokenising {data}, ") and waiting.endswith("(100 %); loading the model")
    assert cli("node", "stop", "--data-dir", str(d)).returncode == 0
    p.communicate(timeout=30)


def test_a_build_that_fails_on_a_bad_record_leaves_nothing_to_resume(tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(ConfigError, match="cannot read it as json"):
        open_dataset(tmp_path / "broken.jsonl", BytesWithEos(), tmp_path / "cache")
    assert not list((tmp_path / "cache").glob(".building-*"))


def test_local_ranks_opening_at_once_digest_once(tmp_path):
    path = big_text(tmp_path / "corpus.txt", 8)
    manifest = tmp_path / "digests" / "corpus.json"
    digests: list[str] = []
    before = READS.bytes

    def rank() -> None:
        digests.append(resolve_dataset(path).digest(manifest=manifest))

    ranks = [threading.Thread(target=rank) for _ in range(2)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join()
    read = READS.bytes - before
    assert read == 8 * MIB + 2 * 3 * SAMPLE_BYTES  # one full read; each rank's samples
    assert digests == [dataset_digest(path)] * 2
