"""The extraction: plan shards from the prepared input, skip finished ones, drive the engine over the rest,
record receipts and finalize (`driver.py`); serve them one at a time to a caller per shard (`stream.py`)."""
