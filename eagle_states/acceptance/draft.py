"""An EAGLE-3 draft trained on a `speculators` export with speculators' own model, loss and data loading
(speculators 0.9.0; never a draft architecture of our own), saved in the speculators format vLLM serves.

What `speculators train` wires together, called here piece by piece: the vocabulary mapping from the export's
token frequencies (`build_vocab_mappings_from_distribution`), the draft's decoder config from the verifier's
(`create_transformer_layer_config`), `Eagle3DraftModel.from_training_args` with the layer ids the export names
(never speculators' default [2, n//2, n-3]: a head with guessed ids is the failure of vLLM PR #50170), its
`ArrowDataset` and multipack data loader with `shift_batch`, its loss (`get_trainer_kwargs`), and its save
(`save_pretrained`, `patch_config_dtype`). Only the training loop is ours: speculators' `Trainer` moves the model
to the accelerator of `local_rank` (`self.model.to(self.local_rank)`), so it does not run on a CPU; on a GPU,
`speculators train` on the same export does the same.

Controls (`control`) train on deliberately wrong states through the same pipeline, so that a measurement that
cannot tell them from the real thing is seen to be too weak:
    token-shift        each state paired with the token after the one it belongs to
    layer-off-by-one   the draft names the layer after each captured one ("after layer k" read as "entering
                       layer k"), so vLLM feeds it states of other layers than it was trained on
    layer-off-by-one-down  the draft names the layer before each captured one (the other direction of the same
                       mistake: "entering layer k" read as "after layer k")
    final-layer-off-by-one  trained towards the state entering the last decoder layer instead of the final state
                       before the norm (the training target's slot one layer low, TorchSpec #87: an extractor
                       that named the final state num_layers - 1); needs that layer among the captured ones
The two layer controls train exactly what the correct draft trains (same states, same seed: the same weights);
only the layer ids in the saved config differ, so `relabel_draft` makes them from the correct draft.
"""

from __future__ import annotations

import json
import logging
import random
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle_states.training import optimizer_step

log = logging.getLogger(__name__)
CONTROLS = ("none", "token-shift", "layer-off-by-one", "layer-off-by-one-down", "final-layer-off-by-one")
LAYER_SHIFT = {"layer-off-by-one": 1, "layer-off-by-one-down": -1}  # served id - trained id
TRAINING_FILE = "draft_training.json"  # beside the saved draft: recipe, control, losses


@dataclass(frozen=True)
class DraftRecipe:
    """The training budget and shape: the same recipe for every draft compared side by side."""

    epochs: int = 3
    max_steps: int | None = None  # stop early (for the CI's smallest runs)
    lr: float = 1e-3
    draft_vocab_size: int = 256
    ttt_steps: int = 3  # training-time test steps (the draft's own predictions fed back, as when serving)
    num_layers: int = 1
    total_seq_len: int = 2048  # tokens per packed batch
    train_ratio: float = 0.9
    seed: int = 0


def eagle3_layers(export_dir: Path) -> dict:
    """The export's EAGLE-3 layer record: `aux_layer_ids` (what the draft reads and vLLM must capture) and
    `final_layer_id` (the state before the norm, the training target)."""
    from eagle_states.export import EAGLE3_FILE

    return json.loads((Path(export_dir) / EAGLE3_FILE).read_text())


def served_layer_ids(trained_on: list[int], control: str) -> list[int]:
    """The layer ids the draft's config names (what vLLM feeds it) for a draft trained on `trained_on`."""
    served = [k + LAYER_SHIFT.get(control, 0) for k in trained_on]
    if min(served) < 0:
        raise ValueError(f"{control}: layer ids {trained_on} have no layer below {min(trained_on)}")
    return served


def relabel_draft(trained_dir: Path, out_dir: Path, control: str) -> dict:
    """A layer control from the correct draft in `trained_dir`: the same weights (what `train_draft` would train
    for it, step for step), its config naming the shifted layer ids. Returns its TRAINING_FILE record."""
    import shutil

    if control not in LAYER_SHIFT:
        raise ValueError(f"control {control!r}: one of {', '.join(LAYER_SHIFT)}")
    trained_dir, out_dir = Path(trained_dir), Path(out_dir)
    record = json.loads((trained_dir / TRAINING_FILE).read_text())
    if record["control"] != "none":
        raise ValueError(f"{trained_dir} is the {record['control']} control, not the correct draft")
    served = served_layer_ids(record["trained_on_layer_ids"], control)
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(trained_dir, staging)
    config = json.loads((staging / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == record["trained_on_layer_ids"], config
    config["eagle_aux_hidden_state_layer_ids"] = served
    (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    record = {**record, "control": control, "draft_config_layer_ids": served, "relabelled_from": str(trained_dir)}
    (staging / TRAINING_FILE).write_text(json.dumps(record, indent=2) + "\n")
    staging.rename(out_dir)
    return record


def _shift_one_more(shift_batch):
    """speculators' `shift_batch`, then each state paired with the token after its own (the token-shift control)."""
    def shifted(batch):
        batch = shift_batch(batch)
        out = {"input_ids": batch["input_ids"][1:], "hidden_states": batch["hidden_states"][:-1],
               "verifier_last_hidden_states": batch["verifier_last_hidden_states"][1:],
               "loss_mask": batch["loss_mask"][1:], "position_ids": batch["position_ids"][1:]}
        import torch

        out["lengths"] = torch.clamp(batch["lengths"] - 1, min=0)
        return {**batch, **out}
    return shifted


def _final_from_slot(shift_batch, slot: int, hidden_size: int):
    """speculators' `shift_batch` on a sample whose training-target state is aux slot `slot` (the
    final-layer-off-by-one control); `hidden_states` holds the aux slots side by side, [T, slots * hidden]."""
    def replaced(batch):
        aux = batch["hidden_states"][:, slot * hidden_size:(slot + 1) * hidden_size]
        return shift_batch({**batch, "verifier_last_hidden_states": aux})
    return replaced


def train_draft(export_dir: Path, target_dir: Path, out_dir: Path, recipe: DraftRecipe = DraftRecipe(),
                control: str = "none", device: str = "cpu") -> dict:
    """Train one draft on `export_dir` (a `speculators` export) for `target_dir` on `device` (float32); saved into
    `out_dir` with TRAINING_FILE. Returns that record (recipe, control, layer ids, validation metrics, seconds)."""
    import numpy as np
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.checkpointer import convert_float_dtype, patch_config_dtype
    from speculators.train.cli import create_transformer_layer_config
    from speculators.train.data import ArrowDataset
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
    from transformers import AutoConfig

    if control not in CONTROLS:
        raise ValueError(f"control {control!r}: one of {', '.join(CONTROLS)}")
    started = time.monotonic()
    random.seed(recipe.seed)
    np.random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)
    export_dir, target_dir, out_dir = Path(export_dir).resolve(), Path(target_dir).resolve(), Path(out_dir)
    layers = eagle3_layers(export_dir)
    trained_on = list(layers["aux_layer_ids"])
    served_as = served_layer_ids(trained_on, control)
    verifier = AutoConfig.from_pretrained(target_dir)
    d2t = t2d = None
    if recipe.draft_vocab_size != verifier.vocab_size:
        freq = torch.load(export_dir / "token_freq.pt", weights_only=True)
        d2t, t2d = build_vocab_mappings_from_distribution(freq, recipe.draft_vocab_size, verifier.vocab_size)
    decoder = create_transformer_layer_config(
        verifier_name_or_path=str(target_dir), num_layers=recipe.num_layers, draft_arch="llama", hidden_act="silu",
        sliding_window=recipe.total_seq_len, full_attention_indices=list(range(recipe.num_layers)))
    # speculators' EAGLE-3 defaults (TrainConfig): norms before the residual, before fc, on the output; SDPA
    # attention (flex attention does not run on the CPU build; on a CPU SDPA gave eager's losses to the 4th decimal
    # in 0.42 x its time, the dense masked matmuls being most of a step)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=decoder, t2d=t2d, d2t=d2t, verifier_name_or_path=str(target_dir),
        draft_vocab_size=recipe.draft_vocab_size, norm_before_residual=True, norm_before_fc=True, fc_norm=False,
        norm_output=True, embed_requires_grad=False, target_layer_ids=served_as, draft_attn_impl="sdpa",
        ttt_steps=recipe.ttt_steps).float().to(device)
    call, _ = Eagle3DraftModel.get_trainer_kwargs(loss_fn="kl_div", loss_implementation="eager",
                                                  ttt_steps=recipe.ttt_steps, ttt_step_loss_decay=1.0)
    preprocess = _shift_one_more(shift_batch) if control == "token-shift" else shift_batch
    if control == "final-layer-off-by-one":
        below = layers["final_layer_id"] - 1
        if below not in trained_on:
            raise ValueError(f"{control}: the export's aux layers {trained_on} do not hold layer {below}, the "
                             f"state one below the final {layers['final_layer_id']}")
        preprocess = _final_from_slot(shift_batch, trained_on.index(below), model.hidden_size)

    def loader(split: str):
        data = ArrowDataset(max_len=recipe.total_seq_len, datapath=str(export_dir), on_missing="raise",
                            train_ratio=recipe.train_ratio, split=split, hidden_states_dtype=torch.float32)
        return _setup_dataloader(data, recipe.total_seq_len, model.hidden_size, num_workers=0,
                                 num_target_layers=len(trained_on), prefetch_factor=None, preprocess=preprocess,
                                 seed=recipe.seed)
    train, val = loader("train"), loader("val")
    with warnings.catch_warnings():  # speculators' loader pins memory for an accelerator: none here, nothing to do
        warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator")
        losses = _fit(model, train, call, recipe, device)
        metrics = _evaluate(model, val, call, device)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, state_dict=convert_float_dtype(model.state_dict(), torch.bfloat16))
    patch_config_dtype(out_dir / "config.json", torch.bfloat16)
    record = {"recipe": asdict(recipe), "control": control, "trainer": "eagle-states loop", "device": device,
              "export": str(export_dir), "target": str(target_dir),
              "trained_on_layer_ids": trained_on, "draft_config_layer_ids": served_as,
              "final_layer_id": layers["final_layer_id"], "steps": len(losses), "first_loss": losses[0],
              "final_loss": losses[-1], "val": metrics, "seconds": round(time.monotonic() - started, 1)}
    (out_dir / TRAINING_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return record


def _on(batch: dict, device: str) -> dict:
    return {k: v.to(device) for k, v in batch.items() if k != "error_records"}


def _fit(model, train, call: dict, recipe: DraftRecipe, device: str) -> list[float]:
    import torch
    from transformers import get_linear_schedule_with_warmup

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.01)
    total = recipe.epochs * len(train) if recipe.max_steps is None else min(recipe.max_steps,
                                                                            recipe.epochs * len(train))
    schedule = get_linear_schedule_with_warmup(optimizer, max(1, total // 100), total)
    losses: list[float] = []
    model.train()
    for epoch in range(recipe.epochs):
        train.batch_sampler.set_epoch(epoch)
        for batch in train:
            _, loss, _ = model(**_on(batch, device), **call)
            losses.append(optimizer_step(model, optimizer, schedule, loss))
            if len(losses) % 25 == 0:
                log.info("draft training: step %d/%d, loss %.3f", len(losses), total, losses[-1])
            if len(losses) >= total:
                return losses
    return losses


def _evaluate(model, val, call: dict, device: str) -> dict:
    import torch
    from speculators.train.utils import normalize_counted_metrics

    model.eval()
    sums: dict = {}
    batches = 0
    with torch.no_grad():
        for batch in val:
            _, _, metrics = model(**_on(batch, device), **call)
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value)
            batches += 1
    means = normalize_counted_metrics({k: v / max(1, batches) for k, v in sums.items()})
    return reported_metrics(means)


def reported_metrics(means: dict) -> dict:
    """Of speculators' validation means, the ones a draft's record keeps: loss, full_acc_k, cond_acc_k."""
    return {k: round(float(v), 4) for k, v in sorted(means.items())
            if k == "loss" or k.startswith(("full_acc", "cond_acc"))}
