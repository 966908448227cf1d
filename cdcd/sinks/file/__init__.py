"""The file sink (``type: file``): one folder per table, JSON Lines or Parquet files, on a local
disk or an object store. :mod:`~cdcd.sinks.file.sink` is the sink, its settings are in
:mod:`~cdcd.sinks.file.config`.

Every module that loads pyarrow is in this package, so this is where Arrow's C++ default memory
pool is chosen: pyarrow picks it once, as it loads, from ``ARROW_DEFAULT_MEMORY_POOL``, and
``pa.set_memory_pool`` (:mod:`~cdcd.sinks.file.parquet`) changes only the pool of pyarrow's
Python calls. The Parquet writer's encoders and compressors allocate from the C++ default, which
in pyarrow's wheels is mimalloc: it keeps what they free, in 2 MiB transparent huge pages
(it asks for them), about 16 MiB of a Parquet daemon's peak RSS at a 32 MiB
``buffer.memory_limit`` (docs/guarantees.md). The system allocator gives it back. A user's own
``ARROW_DEFAULT_MEMORY_POOL`` wins; where pyarrow was loaded before cdcd, nothing changes.
"""

import os

os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
