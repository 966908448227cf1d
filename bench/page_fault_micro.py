"""What a page of fresh memory costs on this machine, against writing to a page already mapped.

Run: ``python bench/page_fault_micro.py [--mib N]``. Maps ``N`` MiB anonymously four times,
touching one byte per 4 KiB page each time (each mapping new: a page fault and a zeroed page per
page), then touches one mapping four more times (no fault). Prints microseconds per page for
both; the difference is the fault. docs/benchmarks.md (``minor_faults_per_krow``) and "Initial
snapshot" use it: on the development VM a fault costs about 2 µs, so output written into fresh
memory, rather than into memory reused, was most of a large snapshot's time. No assertions.
"""

from __future__ import annotations

import argparse
import mmap
import time

PAGE = 4096


def _touch(m: mmap.mmap, size: int) -> None:
    for i in range(0, size, PAGE):
        m[i] = 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    size = parser.parse_args().mib << 20
    pages = size // PAGE
    t0 = time.perf_counter()
    for _ in range(4):
        fresh = mmap.mmap(-1, size)
        _touch(fresh, size)
        fresh.close()
    t1 = time.perf_counter()
    reused = mmap.mmap(-1, size)
    _touch(reused, size)
    t2 = time.perf_counter()
    for _ in range(4):
        _touch(reused, size)
    t3 = time.perf_counter()
    print(
        f"fresh pages: {(t1 - t0) / 4 / pages * 1e6:.2f} us/page; "
        f"pages already mapped: {(t3 - t2) / 4 / pages * 1e6:.2f} us/page "
        f"(the loop's own cost); {pages} pages of 4 KiB"
    )


if __name__ == "__main__":
    main()
