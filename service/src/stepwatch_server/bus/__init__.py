"""The bus between ingest replicas and detection workers (Redis Streams), for collectors that outgrow one
process (README, "Running at scale").

`serve --bus URL` stores each batch, then adds it to one of `PARTITIONS` streams chosen by a hash of its run
(`streams.py`) before it answers (`publisher.py`); `detect --bus URL` processes own the streams one worker
at a time under leases and keep each run's detector state, with snapshots another worker takes over from
(`worker.py`). Without `--bus` the collector detects in its own process, as before.
"""
