"""A node's data dir: made once, usable, run by one node at a time, and belonging to one swarm.

The problem. A data dir holds a swarm's spec (`swarm.json`) and the checkpoints a node resumes at
start (`checkpoints/`). Checkpoints carry no swarm id, so a dir reused for another swarm — `swarm
create` run again into it, or `node start --swarm <another spec>` — would resume the first swarm's
state as the second's: its weights trained on as if they were the new swarm's, or, under another
schedule, a start that fails on "state was made with a different H".

Design. `make_data_dir(dir)` creates it (with its parents) where a node, `swarm create` or
`Swarm.create` first writes to it; a path that cannot be a data dir (a file in its place, a
parent that does not exist on a read-only filesystem, a dir we may not write) is a one-line
`ConfigError`, not an `OSError`'s traceback.

One node at a time. Two nodes on one dir would be one peer id twice in the swarm, write
checkpoints into one directory, and the second would overwrite `daemon.json` and `control.token`,
so `node stop` could no longer reach the first (found by starting a node twice). A running node
holds `DataDirLock`: an exclusive POSIX record lock (`lockf`) on `node.lock`, which the kernel
lets go when the process ends however it ends (`kill -9` included), so a stale lock cannot outlive
its node. Not `flock`: a child forked without exec (a data loader's worker, a tokenising pool)
would share a `flock` and keep it past a killed node; a record lock belongs to the process alone.
Record locks do not exclude their own process, so the lock also keeps the dirs this process holds
(two `Swarm`s of the Python API on one dir). The file holds the holder's pid, which the refusal
names. A filesystem without record locks (some network or FUSE mounts: `ENOLCK`) runs the node
unlocked and says so once. Local ranks other than 0 run no node and take no lock
(node/local_ranks.py).

`claim_data_dir(dir, swarm_id)` before a spec is written into a dir: where the dir holds
checkpoints beside a spec of another swarm (or a spec that does not read, whose checkpoints are
nobody's we know), it refuses with a `ConfigError` that names both swarms and the fix. A dir
without checkpoints is free to take: nothing in it would be resumed. `swarm create` and the
node's start (node/spec/resolve.py) both call it, so the check is one.

Not here: locking the files themselves against other programs (`node export` reads a running
node's checkpoints, which are written atomically), what is inside a checkpoint (both
node/state/checkpoint.py), the address book's own swarm check (node/state/address_book.py: it
starts afresh, as addresses are cheap to learn again).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import ClassVar, NoReturn

from meshtrain.errors import ConfigError
from meshtrain.log import get_logger, kv
from meshtrain.node.spec.signed import SignedSpec

log = get_logger(__name__)

SPEC_FILE = "swarm.json"  # the spec a data dir runs (`node start` without one given)
CHECKPOINT_DIR = "checkpoints"  # the node's checkpoints, under the data dir
LOCK_FILE = "node.lock"  # locked by the node running on the dir; holds its pid


def make_data_dir(data_dir: str | os.PathLike[str]) -> Path:
    """`data_dir`, created if new; `ConfigError` where it cannot be a data dir (module docstring)."""
    return make_writable_dir(data_dir, "the data dir", "--data-dir")


def make_writable_dir(path: str | os.PathLike[str], what: str, flag: str) -> Path:
    """`path`, created (with its parents) if new; a one-line `ConfigError` naming `what` it is and
    the `flag` that chooses another where it cannot be made or written (a user's mistake)."""
    root = Path(path).expanduser()
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{what} {root} is a file, not a directory ({flag} chooses another)")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot make {what} {root}: {e.strerror or e} ({flag} chooses another)") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {root} is not writable by this user ({flag} chooses another)")
    return root


def claim_data_dir(data_dir: str | os.PathLike[str], swarm_id: str) -> None:
    """`ConfigError` unless `data_dir` may hold swarm `swarm_id` (module docstring)."""
    root = Path(data_dir).expanduser()
    if not (root / SPEC_FILE).exists() or not (root / CHECKPOINT_DIR).exists():
        return
    try:
        held: str | None = SignedSpec.load(root / SPEC_FILE).swarm_id
    except ConfigError:  # a spec that does not read: whose checkpoints these are is unknown
        held = None
    if held != swarm_id:
        whose = f"swarm {held}" if held else f"a swarm whose {SPEC_FILE} does not read"
        raise ConfigError(
            f"{root} holds the checkpoints of {whose}, not of {swarm_id}: use another --data-dir for "
            f"another swarm (or move {root / CHECKPOINT_DIR} away to start this one afresh there)"
        )


class DataDirLock:
    """Held while a node runs on `data_dir` (a context manager): `ConfigError` naming the holder's
    pid where another process holds it (module docstring)."""

    held: ClassVar[set[Path]] = set()  # the lock files this process holds

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.path = (Path(data_dir).expanduser() / LOCK_FILE).resolve()
        self.fd: int | None = None

    def __enter__(self) -> DataDirLock:
        if self.path in DataDirLock.held:
            raise ConfigError(
                f"this process already runs a node with the data dir {self.path.parent} (a `Swarm` not yet "
                f"left: `swarm.leave()`, or leave its `with swarm:` block, before opening the dir again)"
            )
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):  # ENOLCK: this filesystem has no locks
                log.warning(kv("cannot lock the data dir; running without the lock", path=str(self.path), error=str(e)))
            else:  # another process holds it
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                self._refuse(holder)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        DataDirLock.held.add(self.path)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            DataDirLock.held.discard(self.path)
            os.close(self.fd)  # closing our only descriptor of the file lets the lock go
            self.fd = None

    def _refuse(self, holder: str) -> NoReturn:
        root = self.path.parent
        raise ConfigError(
            f"a node{f' (pid {holder})' if holder.isdigit() else ''} already runs with the data dir {root}: "
            f"stop it (`meshtrain node stop --data-dir {root}`) or give this one another --data-dir"
        ) from None
