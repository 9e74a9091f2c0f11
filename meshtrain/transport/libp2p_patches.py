"""Workarounds for py-libp2p bugs that live in the library's own code paths, applied by `host.py`.

**A cancelled frame write kills the connection** (py-libp2p 0.8.x, `Yamux._write_frame`). Every
yamux frame goes out through `secured_conn.write`, and Noise *encrypts first* — using up the next
nonce — and only then awaits the socket. A trio cancellation landing in between (any `fail_after`
or `move_on_after` around a stream write or read: RPC deadlines, stream-open timeouts, a nursery
cancelled mid-transfer; reads send window updates from the reader's task) either sends nothing or
half a frame. The peer's next decrypt then fails ("Failed authentication of message"), its read
loop logs "Error reading header" at DEBUG and closes the whole connection; we see only a peer
that dropped. Measured on loopback: 4–6 randomly cancelled writes (one writer) or 17–38 (three)
drop the connection within 0.55 s; a stall alone does not (a peer SIGSTOPped for 65 s, idle or mid-
bulk, stays connected). Under CPU starvation more deadlines expire inside that window, which is
how the convergence benchmark's peers occasionally lost their connection to each other.

The fix: once the write lock is held, the frame is written whole — shielded from cancellation,
bounded by `FRAME_WRITE_LIMIT` so a peer that stops reading cannot hold a cancelled caller
forever (then the connection is closed: it is as good as dead, and a half-written frame would
desynchronise it anyway). Waiting for the lock stays cancellable, as nothing is encrypted yet.
Upstream's proper fix is the same shield inside `_write_frame`.

**No remote address on IPv6** (`TrioTCPStream.get_remote_address`). It accepts only a 2-tuple from
`getpeername()`, and an IPv6 socket returns four (host, port, flowinfo, scope id), so every IPv6
connection reports no address. The data plane dials the peer's IP as our libp2p connection sees
it (`Host.remote_ip`), so two peers on IPv6 sent their tensors over the slow libp2p fallback.
The fix reads the first two fields of either family. Upstream's: `len(remote_addr) >= 2`.
"""

from __future__ import annotations

import contextlib

import trio
from libp2p.io import trio as _io_trio
from libp2p.io.exceptions import IOException
from libp2p.stream_muxer.yamux import yamux as _yamux

FRAME_WRITE_LIMIT = 30.0  # seconds one shielded frame write may take before the connection is closed

_applied = False


async def _write_frame_whole(self: _yamux.Yamux, data: bytes) -> None:
    async with self._write_lock:
        with trio.CancelScope(shield=True):
            with trio.move_on_after(FRAME_WRITE_LIMIT) as limit:
                await self.secured_conn.write(data)
            if limit.cancelled_caught:
                with trio.move_on_after(1), contextlib.suppress(Exception):
                    await self.secured_conn.close()
                raise IOException(f"yamux frame write stalled for {FRAME_WRITE_LIMIT:g} s; connection closed")
    await trio.lowlevel.checkpoint()


def _remote_address_any_family(self: _io_trio.TrioTCPStream) -> tuple[str, int] | None:
    if self._cached_remote_address is None:
        try:
            addr = self.stream.socket.getpeername()
        except (AttributeError, OSError):  # no socket, or closed: no address, as upstream
            return None
        if isinstance(addr, tuple) and len(addr) >= 2:  # IPv4 (host, port); IPv6 adds flowinfo, scope id
            self._cached_remote_address = (str(addr[0]), int(addr[1]))
    return self._cached_remote_address


def apply() -> None:
    """Install the workarounds (idempotent)."""
    global _applied
    if _applied:
        return
    if not hasattr(_yamux.Yamux, "_write_frame"):  # a py-libp2p without the method: nothing to fix here
        raise RuntimeError("py-libp2p's Yamux has no _write_frame; re-check meshtrain/transport/libp2p_patches.py")
    _yamux.Yamux._write_frame = _write_frame_whole  # type: ignore[method-assign]  # the patch itself
    _io_trio.TrioTCPStream.get_remote_address = _remote_address_any_family  # type: ignore[method-assign]
    _applied = True
