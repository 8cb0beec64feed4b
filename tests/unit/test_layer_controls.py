"""The layer controls of the acceptance harness: the correct draft's weights with the config's layer ids shifted
by one (up: "after layer k" read as "entering layer k"; down: the other way round)."""

import json

import pytest

from eagle_states.acceptance.draft import TRAINING_FILE, relabel_draft, served_layer_ids


def test_served_layer_ids_shift_by_one_each_way_and_never_below_the_embeddings():
    assert served_layer_ids([1, 4, 7], "none") == served_layer_ids([1, 4, 7], "token-shift") == [1, 4, 7]
    assert served_layer_ids([1, 4, 7], "layer-off-by-one") == [2, 5, 8]
    assert served_layer_ids([1, 4, 7], "layer-off-by-one-down") == [0, 3, 6]
    with pytest.raises(ValueError, match="no layer below"):
        served_layer_ids([0, 4, 7], "layer-off-by-one-down")


def test_a_relabelled_draft_has_the_same_weights_and_the_shifted_ids(tmp_path):
    draft = tmp_path / "draft-none"
    draft.mkdir()
    (draft / "model.safetensors").write_bytes(b"weights")
    (draft / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [1, 4, 7], "other": 1}))
    (draft / TRAINING_FILE).write_text(json.dumps({"control": "none", "trained_on_layer_ids": [1, 4, 7],
                                                   "draft_config_layer_ids": [1, 4, 7], "final_loss": 0.5}))
    record = relabel_draft(draft, tmp_path / "draft-down", "layer-off-by-one-down")
    out = tmp_path / "draft-down"
    assert (out / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((out / "config.json").read_text()) == {"eagle_aux_hidden_state_layer_ids": [0, 3, 6], "other": 1}
    assert record == json.loads((out / TRAINING_FILE).read_text())
    assert record["control"] == "layer-off-by-one-down" and record["trained_on_layer_ids"] == [1, 4, 7]
    assert record["draft_config_layer_ids"] == [0, 3, 6] and record["final_loss"] == 0.5
    assert not list(tmp_path.glob("*.partial"))
    with pytest.raises(ValueError, match="not the correct draft"):
        relabel_draft(out, tmp_path / "again", "layer-off-by-one")
    with pytest.raises(ValueError, match="control"):
        relabel_draft(draft, tmp_path / "x", "token-shift")


def test_the_final_layer_control_trains_towards_the_aux_slot_one_layer_below_the_final_state():
    """TorchSpec #87's mistake: the training target's state is the one entering the last decoder layer."""
    import torch
    from speculators.models.eagle3.data import shift_batch

    from eagle_states.acceptance.draft import _final_from_slot

    T, H = 5, 4
    aux = torch.arange(T * 3 * H, dtype=torch.float32).view(T, 3 * H)
    batch = {"input_ids": torch.arange(T), "hidden_states": aux, "verifier_last_hidden_states": -torch.ones(T, H),
             "loss_mask": torch.ones(T, dtype=torch.long), "lengths": torch.tensor([T]),
             "position_ids": torch.arange(T)}
    right, wrong = shift_batch(batch), _final_from_slot(shift_batch, 2, H)(batch)
    assert torch.equal(wrong["verifier_last_hidden_states"], aux[1:, 2 * H:])  # aligned as the final state was
    assert torch.equal(right["verifier_last_hidden_states"], -torch.ones(T - 1, H))
    for key in ("input_ids", "hidden_states", "loss_mask", "lengths", "position_ids"):
        assert torch.equal(wrong[key], right[key])
