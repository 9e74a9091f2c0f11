"""Freed tensor memory goes back to the operating system: glibc's mmap threshold, fixed.

Problem. glibc's malloc serves a large block with a mapping of its own and unmaps it when it is
freed — but only above its mmap threshold, which starts at 128 KiB and then *rises* to the size
of the largest mapped block freed so far (up to 32 MiB on 64-bit). A node allocates and frees
tensors of a few MiB every round and every checkpoint (the pseudo-gradient, its flattened
contribution, codec buffers, donor snapshots, checkpoint copies). After the first such free,
blocks of that size come from malloc's arenas instead, whose freed pages mostly stay in the
process: resident memory climbs to the peak of the rounds and checkpoints and stays there.
Measured with scripts/bench/bench_memory.py (two daemons, a 103 M-parameter DiLoCo peer): 70.5
bytes per parameter held beyond a bare training loop with glibc's default, 50.2 with the
threshold fixed at 1 MiB (docs/benchmarks.md, "Memory").

Design. `release_freed_memory()` sets `M_MMAP_THRESHOLD` to `MMAP_THRESHOLD` (1 MiB) through
`mallopt`, which also turns the dynamic adjustment off, once per process: every node calls it
as it is built (`Node.__init__`), every local rank as it starts. A block of 1 MiB or more is
then mapped and unmapped with its tensor: a mmap/munmap pair per large allocation, small beside
what the tensor is for. The same setting as `MALLOC_MMAP_THRESHOLD_=1048576` in the environment,
without asking users to set it. Where the C library is not glibc (macOS, musl), nothing is done.

Not here: which copies a node keeps (the memory budget, docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import functools
import sys

M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 1 << 20  # bytes: blocks this large or larger are mapped on their own


@functools.cache
def release_freed_memory() -> bool:
    """Fix glibc's mmap threshold for this process (module docstring); whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 — glibc only: musl has mallopt as a no-op stub
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
