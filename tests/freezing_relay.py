"""A TCP relay on loopback whose connections can be frozen: a connection that a cut cable, a
partition or a NAT rebinding left stalled.

After `freeze()`, the relay stops moving bytes both ways on every connection open at that moment,
and keeps their sockets open: no FIN, no RST, so neither end learns anything — what the sender
writes sits in kernel buffers, as it sits in TCP's retransmission queue behind a dead path (after
a partition heals, TCP's backed-off retransmission timer keeps it stalled for many seconds
more). Connections opened after `freeze()` pass: the path itself works again, as it does once a
partition heals. Real sockets, real kernels; the only user-space part is the copying.
"""

from __future__ import annotations

import trio


class FreezingRelay:
    """Relays 127.0.0.1:`port` (once `serve` started) to 127.0.0.1:`target_port`."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.opened = 0  # connections accepted so far
        self.frozen: set[int] = set()  # their numbers, from 0

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._relay, listeners)

    def freeze(self) -> None:
        """Stall every connection open now; later ones pass."""
        self.frozen.update(range(self.opened))

    async def _relay(self, client: trio.SocketStream) -> None:
        number = self.opened
        self.opened += 1
        server = await trio.open_tcp_stream("127.0.0.1", self.target_port)
        async with client, server, trio.open_nursery() as nursery:
            nursery.start_soon(self._pump, number, client, server)
            nursery.start_soon(self._pump, number, server, client)

    async def _pump(self, number: int, source: trio.SocketStream, sink: trio.SocketStream) -> None:
        while True:
            if number in self.frozen:
                await trio.sleep_forever()
            try:
                data = await source.receive_some(1 << 16)
                if number in self.frozen:
                    await trio.sleep_forever()  # what arrived as it froze is lost in the stall
                if not data:
                    await sink.send_eof()
                    return
                await sink.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
