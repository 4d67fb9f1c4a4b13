"""Keep freed heap memory in the process instead of handing it back to the kernel (glibc malloc).

Why: a training step makes and frees tensors of several MB each (gate activations, logits,
casts). glibc serves such sizes with fresh `mmap` pages, or trims them off the heap's top when
freed, so the next step touches new pages and the kernel zero-fills each one: on the Gboard-size
CIFG cohort the process spent 2 s of 17 in the kernel, on the main job's 4 s of 23. Raising the
mmap threshold to glibc's ceiling (32 MiB) and never trimming keeps the pages mapped for reuse:
those runs took 0.77x and 0.78x the wall time (`farm-bench`, paired, 1 thread), with the same
bits. The cost is that the process keeps its peak heap mapped until it exits; a training process
reaches its peak every step anyway. This is what PyTorch's CPU tuning guide gets from
jemalloc/tcmalloc through LD_PRELOAD, done here with glibc's own `mallopt` so no one has to set
an environment variable. Off by `DPFLEET_KEEP_HEAP=0`; a no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

# glibc's malloc.h parameter numbers
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_CEILING = 32 * 2**20  # glibc refuses a larger mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
NEVER_TRIM = 2**31 - 1  # mallopt takes an int
TOP_PAD = 64 * 2**20  # grow the heap in steps of 64 MiB: fewer brk calls while it reaches its peak


@functools.cache
def keep_freed_memory() -> str:
    """Set glibc's malloc to keep freed memory (once per process); returns what was done, for logs
    and benchmarks."""
    if os.environ.get("DPFLEET_KEEP_HEAP", "1") == "0":
        return "unchanged: DPFLEET_KEEP_HEAP=0"
    if not sys.platform.startswith("linux"):
        return f"unchanged: {sys.platform} (glibc only)"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        gnu_get_libc_version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return "unchanged: the C library is not glibc"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    gnu_get_libc_version.restype = ctypes.c_char_p
    done = all(mallopt(param, value) == 1 for param, value in (
        (M_MMAP_THRESHOLD, MMAP_CEILING), (M_TRIM_THRESHOLD, NEVER_TRIM), (M_TOP_PAD, TOP_PAD)))
    version = gnu_get_libc_version().decode()
    return f"glibc {version}: freed memory kept" if done else f"glibc {version}: mallopt refused"
