"""What the roles pass each other, at the bottom of troupe.rlhf: the recipe's data (the bundled
task, JSON-lines and parquet rows: ``datasets``), token batches (``batch``), and the dataclasses
that cross Ray between the driver and the roles (``experience``). Imports troupe.rlhf.config
and nothing else of troupe.rlhf."""
