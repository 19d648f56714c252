"""keep_freed_memory: the CPU allocator setting `qkvlab train` and `qkvlab bench` apply."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # two child processes, each allocating and freeing 160 MiB 20 times

# A step-like pattern: six 16 MiB activations and a 64 MiB one alive at once, then all freed, 10
# times over; print the page faults it took. With glibc's defaults the blocks go back to the
# kernel and are faulted in again every time (~4,000 faults per 16 MiB).
PROBE = """
import resource, sys, torch
from qkvlab.perf import freed_memory_kept, keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() and freed_memory_kept()

def step():
    acts = [torch.ones(4 << 20) for _ in range(6)] + [torch.ones(16 << 20)]  # and one 64 MiB
    del acts

for _ in range(10):  # the first steps fault either way, while the heap settles (3-6 steps)
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True, timeout=120)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_keep_freed_memory_stops_the_page_faults():
    default, kept = _faults("default"), _faults("keep")
    assert default > 10 * 4 * 2000  # most blocks of every step faulted in again
    assert kept < 2000  # served from the heap: at most a few stray pages
