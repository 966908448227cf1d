"""What every sink, and the encoder, may need to know about the pipeline it is part of."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class SinkContext:
    """What every sink may need to know about the pipeline it is part of."""

    name: str  # the logical server name (config ``name``): topic prefix and ``source.name``
    database: str  # ``source.db``
    config_dir: Path  # relative paths in a sink's config are relative to this folder
