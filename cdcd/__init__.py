"""cdcd: change-data-capture daemon for PostgreSQL (pgoutput) into Kafka and files."""

__version__ = "0.1.0"
