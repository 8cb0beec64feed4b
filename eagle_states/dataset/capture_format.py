"""The capture format: what a shard's bytes are made of, as a number that is raised on purpose.

Raise CAPTURE_FORMAT_VERSION in the change that alters the bytes of a shard made from the same samples, model
and settings (the hooks, the assembly of rows into samples, how shards are admitted into engine steps, the shard
file's layout, its writer or a codec's framing). Finished shards of an older format are then computed again;
nothing else in the source decides that, so an edit that leaves the bytes as they were (a comment, a rename, a
faster writer) keeps every finished shard. The golden-bytes tests (tests/engine/test_golden_bytes.py) pin, for a
fixed extraction, every byte of its shards that this code decides (layout, keys, dtypes, shapes, metadata, token
ids, masks; the states' values are the engine's numerics, held to Hugging Face's by other tests) and fail on a
change that alters them without raising the version.

An engine upgrade (vLLM, torch, the CPU or GPU it runs on) is not a format change: finished shards are kept (their
states match Hugging Face's within the tolerance the tests hold them to, and a recomputation of a 20-minute model
load for the last bits is not worth it); each receipt records the engine versions that made its shard, and the
manifest lists every version its shards came from. Set `output.overwrite` with a new output to recompute.

This file is read by DVC as a parameters file (dvc.yaml's extract stage): keep its values literals."""

CAPTURE_FORMAT_VERSION = 2

# Format 2 changed the shards written with a codec only: their header is written last, into room reserved at the
# file's start (so their tensors go to the disk as they are compressed rather than at the shard's end). Shards
# without a codec have been the same bytes since the format below, and its receipts are honoured for them.
UNCOMPRESSED_SAME_SINCE = 1

# Shards written before the format was declared were keyed by a hash of the capture's source files; the releases
# below wrote format-1 bytes (the demo dataset's shards 37f74e9c, 810ede48, 8132afba held across all of them), so
# their receipts are honoured as format 1.
CAPTURE_CODE_HASHES_OF_FORMAT_1 = ["2c350a1192a31ad3", "32cba5ee0446448d", "1ec5e5267f618106", "e75f9ff439f81e3c",
                                   "8e6cbedb89ec4225", "3c4738932e6d398c", "b697f1f930941d05"]
