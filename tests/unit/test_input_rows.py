"""The extraction input: both forms (a prepared directory's samples.parquet, a JSONL of token ids) give the same
checked samples, held as arrays, under the same hashes as before; every broken row is refused naming its row and
why."""

import json

import numpy as np
import pytest

from eagle_states.dataset.prepared import (InputError, InputSample, input_hash, load_input, prepared_input_hash,
                                           write_samples)

pytestmark = pytest.mark.unit

VOCAB, MAX_TOKENS = 1000, 64
ROWS = [{"id": "a", "input_ids": [5, 999, 3], "loss_mask": [0, 1, 1]},
        {"id": "b.2", "input_ids": [0] * 64, "loss_mask": [1] * 64},
        {"id": "c", "input_ids": [7], "loss_mask": [1]}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_table(directory, rows):
    directory.mkdir()
    write_samples(directory, [{"sample_id": r["id"], "source_row": n, "input_ids": r["input_ids"],
                               "loss_mask": r["loss_mask"], "num_tokens": len(r["input_ids"]),
                               "num_loss_tokens": 0} for n, r in enumerate(rows, start=1)])
    return directory


def test_the_hashes_are_those_recorded_before_samples_were_arrays():
    """Content hashes key finished shards and the manifest's input_sha256: held as arrays, a sample hashes as it
    did as lists (the value pinned here was computed by the list-based code)."""
    samples = [InputSample("a", [5, 70000, 3], [0, 1, 1], 1), InputSample("b-2", [1], [1], 7)]
    assert input_hash(samples) == "4bfb85b5839854226f0ab0d3a4863fd9891ac0c78737af31c8656d0c2cc53b98"


def test_both_forms_give_the_same_samples_as_arrays(tmp_path):
    jsonl = load_input(write_jsonl(tmp_path / "rows.jsonl", ROWS), VOCAB, MAX_TOKENS)
    table = load_input(write_table(tmp_path / "prepared", ROWS), VOCAB, MAX_TOKENS)
    assert input_hash(jsonl) == input_hash(table) == prepared_input_hash(tmp_path / "prepared")
    for ours, theirs, row in zip(jsonl, table, ROWS):
        assert ours.input_ids.dtype == np.int32 and ours.loss_mask.dtype == np.uint8
        assert theirs.input_ids.dtype == np.int32 and theirs.loss_mask.dtype == np.uint8
        assert ours.input_ids.tolist() == theirs.input_ids.tolist() == row["input_ids"]
        assert ours.num_loss_tokens == theirs.num_loss_tokens == sum(row["loss_mask"])
    without_masks = [{"id": r["id"], "input_ids": r["input_ids"]} for r in ROWS]
    every_token = load_input(write_jsonl(tmp_path / "plain.jsonl", without_masks), VOCAB, MAX_TOKENS)
    assert [s.loss_mask.tolist() for s in every_token] == [[1] * len(r["input_ids"]) for r in ROWS]
    assert prepared_input_hash(tmp_path / "plain.jsonl") == input_hash(every_token)


BROKEN = [  # (the second row replaced by, what the error says)
    ({"id": "b", "input_ids": [], "loss_mask": []}, "(id b): 'input_ids' must be a non-empty list of integers"),
    ({"id": "b", "input_ids": [5, 1000], "loss_mask": [1, 1]},
     "(id b): token ids [1000] outside the vocabulary 0..999"),
    ({"id": "b", "input_ids": [-1, 4], "loss_mask": [1, 1]}, "(id b): token ids [-1] outside the vocabulary 0..999"),
    ({"id": "b", "input_ids": [5] * 65, "loss_mask": [1] * 65}, "(id b): 65 tokens, the engine takes at most 64"),
    ({"id": "b", "input_ids": [5, 6], "loss_mask": [1]},
     "(id b): 'loss_mask' must be a list of 0/1 as long as input_ids (2)"),
    ({"id": "b", "input_ids": [5, 6], "loss_mask": [1, 2]},
     "(id b): 'loss_mask' must be a list of 0/1 as long as input_ids (2)"),
    ({"id": "b", "input_ids": [5, 6], "loss_mask": [0, 0]}, "(id b): 0 loss tokens; validation needs at least 1"),
    ({"id": "b c", "input_ids": [5], "loss_mask": [1]}, "sample id 'b c': use 1-200 characters"),
    ({"id": "a", "input_ids": [5], "loss_mask": [1]}, ": sample id a already used by row 1"),
]


@pytest.mark.parametrize("row, message", BROKEN, ids=[m for _, m in BROKEN])
def test_a_broken_row_is_named_in_either_form(tmp_path, row, message):
    rows = [ROWS[0], row, ROWS[2]]
    with pytest.raises(InputError) as jsonl:
        load_input(write_jsonl(tmp_path / "rows.jsonl", rows), VOCAB, MAX_TOKENS, min_loss_tokens=1)
    assert "rows.jsonl line 2" in str(jsonl.value) and message in str(jsonl.value)
    with pytest.raises(InputError) as table:
        load_input(write_table(tmp_path / "prepared", rows), VOCAB, MAX_TOKENS, min_loss_tokens=1)
    assert "samples.parquet sample 2" in str(table.value) and message in str(table.value)


@pytest.mark.parametrize("ids, mask, message", [
    ([True, 5], [1, 1], "'input_ids' must be a non-empty list of integers"),
    ([1.5, 5], [1, 1], "'input_ids' must be a non-empty list of integers"),
    ([5, 2**70], [1, 1], "token ids [-1] outside the vocabulary"),  # past int64
    ("5 6", [1, 1], "'input_ids' must be a non-empty list of integers"),
    ([5, 6], [True, False], "'loss_mask' must be a list of 0/1"),
    ([5, 6], [1, 2**70], "'loss_mask' must be a list of 0/1"),
    ([5, 6], None, "'loss_mask' must be a list of 0/1"),  # null, not absent
])
def test_json_values_that_are_not_integers(tmp_path, ids, mask, message):
    """JSON's own types: numpy would take booleans and floats for integers."""
    path = write_jsonl(tmp_path / "rows.jsonl", [ROWS[0], {"id": "b", "input_ids": ids, "loss_mask": mask}])
    with pytest.raises(InputError, match="line 2 \\(id b\\): " + message.replace("[", "\\[").replace("]", "\\]")):
        load_input(path, VOCAB, MAX_TOKENS)


def test_a_table_with_a_null_or_without_a_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "nulls"
    folder.mkdir()
    pq.write_table(pa.table({"sample_id": ["a", "b"], "source_row": [4, 9], "input_ids": [[5, 6], [7, None]],
                             "loss_mask": [[1, 1], [1, 1]]}), folder / "samples.parquet")
    with pytest.raises(InputError, match="samples.parquet sample 9: 'input_ids' holds a null"):
        load_input(folder, VOCAB, MAX_TOKENS)
    pq.write_table(pa.table({"sample_id": ["a", "b"], "source_row": [4, 9], "input_ids": [[5, 6], [7, 1.5]],
                             "loss_mask": [[1, 1], [1, 1]]}), folder / "samples.parquet")
    with pytest.raises(InputError, match="samples.parquet: column 'input_ids' holds lists of double, not of integers"):
        load_input(folder, VOCAB, MAX_TOKENS)
    pq.write_table(pa.table({"sample_id": ["a"], "source_row": [4], "input_ids": [[5, 6]]}), folder / "samples.parquet")
    with pytest.raises(InputError, match="no column loss_mask"):
        load_input(folder, VOCAB, MAX_TOKENS)
    assert prepared_input_hash(folder) is None
    pq.write_table(pa.table({"sample_id": ["a", None], "source_row": [4, 9], "input_ids": [[5, 6], [7]],
                             "loss_mask": [[1, 1], [1]]}), folder / "samples.parquet")
    with pytest.raises(InputError, match="samples.parquet sample 9: no 'id'"):
        load_input(folder, VOCAB, MAX_TOKENS)
