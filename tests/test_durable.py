"""`write_atomic` (meshtrain/durable.py): whole files only, and a secret is never readable by others."""

from __future__ import annotations

import stat

from meshtrain.durable import write_atomic


def test_a_secret_is_created_0600_and_replaces_a_crash_leftover(tmp_path):
    path = tmp_path / "control.token"
    leftover = tmp_path / ".tmp-control.token"
    leftover.write_bytes(b"half")
    leftover.chmod(0o644)  # a crash left a readable temp file behind: it is not reused
    write_atomic(path, b"secret", mode=0o600)
    assert path.read_bytes() == b"secret" and not leftover.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_file_is_replaced_whole(tmp_path):
    path = tmp_path / "peers.json"
    write_atomic(path, b"old")
    write_atomic(path, b"new content")
    assert path.read_bytes() == b"new content"
    assert [p.name for p in tmp_path.iterdir()] == ["peers.json"]
