"""Ingest: the batch format, its validation and the bulk writer."""

from stepwatch_server.ingest.schema import Batch, Column
from stepwatch_server.ingest.store import BatchWriter, IngestResult, insert_points
from stepwatch_server.ingest.validate import parse_batch

__all__ = ["Batch", "BatchWriter", "Column", "IngestResult", "insert_points", "parse_batch"]
