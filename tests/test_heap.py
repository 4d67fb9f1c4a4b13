"""dpfleet.heap: freed multi-MB tensors are reused by the next step instead of fresh pages."""

import os
import subprocess
import sys

import pytest

from dpfleet.heap import keep_freed_memory

# a training step's pattern: temporaries of 1 to 16 MiB made, written and freed, 60 times over;
# the page faults of those 60 steps counted (kept, the faults do not grow with the steps)
SCRIPT = """
import resource, torch
from dpfleet.heap import keep_freed_memory
print(keep_freed_memory())
torch.set_num_threads(1)
sizes = [2**18, 2**20, 3 * 2**20, 2**21, 4 * 2**20]
def step():
    ts = [torch.empty(n).fill_(1.0) for n in sizes]
    del ts
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()  # the first step maps its pages in either case
before = faults()
for _ in range(20):
    step()
middle = faults()
for _ in range(40):
    step()
print(middle - before, faults() - middle)
"""


def _faults(keep: str) -> tuple[str, int, int]:
    """(what keep_freed_memory said, page faults of steps 2-21, of steps 22-61)."""
    env = {**os.environ, "DPFLEET_KEEP_HEAP": keep}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    early, late = out[1].split()
    return out[0], int(early), int(late)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_tensors_are_reused_without_page_faults():
    said, kept, kept_late = _faults("1")
    off, fresh, fresh_late = _faults("0")
    assert "freed memory kept" in said and off == "unchanged: DPFLEET_KEEP_HEAP=0"
    # a step touches 11.25 MiB (2,880 pages). Kept: no fresh page once warm (steps 22-61: 0 to a
    # few faults); glibc's default adapts its mmap threshold only sometimes: 20 steps gave 14,586
    # to 186,010 faults without, 256 to 8,192 kept (the kernel's huge pages vary the counts)
    assert kept_late < 2880 // 2, (kept, kept_late)
    assert fresh + fresh_late > kept + kept_late, (kept, kept_late, fresh, fresh_late)


def test_it_is_set_once_per_process_and_says_what_it_did():
    first = keep_freed_memory()
    assert keep_freed_memory() == first and (first.startswith("glibc") or first.startswith("unchanged"))
