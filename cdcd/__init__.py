"""cdcd: change-data-capture daemon for PostgreSQL (pgoutput) into Kafka and files."""

from cdcd._purepy import install_import_finder

__version__ = "0.1.0"

install_import_finder()
