"""How many rows an incremental snapshot reads per chunk: adapted as it goes.

Each chunk costs a fixed price besides its rows: a low watermark (a commit), the read's
transaction, the high watermark committed with it, and the reader's wait for that watermark in
the stream. Small chunks pay it often; large ones keep their window open longer, so more of the
stream's changes fall inside it (each dropping a row that was read for nothing) and more rows
wait in memory. :class:`ChunkSizer` starts at ``start`` rows and, after each chunk:

- doubles while the chunk's read took less than :data:`TARGET_SECONDS` and its window dropped
  at most :data:`FEW_DROPPED` of its rows (the price per chunk still weighs);
- halves when the window dropped more than :data:`MANY_DROPPED` (the stream changes the table
  faster than the window is worth keeping open), or the read took longer than twice the target;
- stays between ``least`` and ``most`` rows (``snapshot.chunk_rows``, a limit), and within
  ``memory`` bytes at the mean row size seen so far.

Pure: the snapshot feeds it what each chunk cost (tests/unit/test_chunk_size.py).
"""

from __future__ import annotations

#: seconds a chunk's read may take before it stops growing
TARGET_SECONDS = 0.25
#: share of a chunk's rows its window may drop and still let it grow
FEW_DROPPED = 0.01
#: share of a chunk's rows dropped beyond which it shrinks
MANY_DROPPED = 0.05


class ChunkSizer:
    """See the module docstring; ``rows`` is the size of the next chunk."""

    def __init__(self, start: int, most: int, memory: int, least: int = 256) -> None:
        self.most = max(1, most)
        self.least = min(least, self.most)
        self.memory = memory
        self.rows = min(max(start, self.least), self.most)
        self._row_bytes = 0.0  # mean bytes per row read so far (0: none yet)
        self._seen = 0

    def observe(self, rows: int, row_bytes: int, read_seconds: float, dropped: int) -> int:
        """One chunk read: its rows, their bytes, the seconds its read took, the rows its
        window dropped. Returns the size of the next chunk."""
        if rows:
            self._seen += rows
            self._row_bytes += (row_bytes / rows - self._row_bytes) * min(1.0, rows / self._seen)
        if (rows and dropped > MANY_DROPPED * rows) or read_seconds > 2 * TARGET_SECONDS:
            self.rows //= 2
        elif rows >= self.rows and dropped <= FEW_DROPPED * rows and read_seconds < TARGET_SECONDS:
            self.rows *= 2
        ceiling = self.most
        if self._row_bytes > 0:
            ceiling = min(ceiling, int(self.memory / self._row_bytes))
        self.rows = max(self.least, min(self.rows, ceiling))
        return self.rows
