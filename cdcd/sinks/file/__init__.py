"""The file sink (``type: file``): one folder per table, JSON Lines or Parquet files, on a local
disk or an object store. :mod:`~cdcd.sinks.file.sink` is the sink, its settings are in
:mod:`~cdcd.sinks.file.config`."""
