"""Snapshots: the rows a table held before cdcd streamed it, as ``op: "r"`` events.

- :mod:`cdcd.snapshot.initial`: every published table at the slot's exported snapshot, before
  streaming starts (``snapshot.mode``);
- :mod:`cdcd.snapshot.incremental`: tables read in key-ordered chunks while streaming goes on,
  asked for with ``cdcd snapshot --table`` (DBLog): one table's chunks in
  :mod:`cdcd.snapshot.table`, the connections they share in :mod:`cdcd.snapshot.workers`, what
  is recorded once durable in :mod:`cdcd.snapshot.state`, the chunk size in
  :mod:`cdcd.snapshot.chunk_size`;
- :mod:`cdcd.snapshot.watermarks`: the reader's side of those chunks, their watermark windows
  in the replication stream.

What they read from PostgreSQL (the catalog queries, the chunk queries, the state files that
:mod:`cdcd.source.prepare` reads when it opens the slot) is in :mod:`cdcd.source.snapshot`;
the rows as events in :mod:`cdcd.events.snapshot_run`; the rate and ETA in
:mod:`cdcd.progress_rate`; the ``cdcd snapshot`` command in :mod:`cdcd.snapshot_command`.
"""
