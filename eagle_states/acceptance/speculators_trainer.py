"""A draft trained by speculators' own trainer, `python -m speculators.train` (speculators 0.9.0), with a
`DraftRecipe`'s settings: the trainer users run, where it runs (a CUDA device: its `Trainer` moves the model to
the accelerator of `local_rank`). `draft.train_draft` trains the same draft piece by piece where it does not.

Flags set against speculators' defaults so that both train the same recipe: AdamW (its default is Muon), full
attention in the draft's layer (its default is a sliding window on layer 0), `--on-missing raise` (its default
asks a vLLM server on localhost for a missing sample's states), `--target-layer-ids` from the export's
`eagle3.json` (without it speculators guesses [2, n//2, n-3]), no resuming from an earlier run's checkpoints. It
differs in what speculators does on a GPU: bf16 autocast, flex attention under torch.compile.

Run as a module, this file is speculators' own entry point (`TrainConfig.resolve()`, `main`) with one logging
handler more, writing the metric records speculators logs (one per step, one per validation) as JSON lines:
speculators prints them only through Rich.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from eagle_states.acceptance.draft import TRAINING_FILE, DraftRecipe, eagle3_layers, reported_metrics

METRICS_FILE = "metrics.jsonl"


def train_command(export_dir: Path, target_dir: Path, run_dir: Path, recipe: DraftRecipe) -> list[str]:
    aux = eagle3_layers(export_dir)["aux_layer_ids"]
    args = ["--speculator-type", "eagle3", "--verifier-name-or-path", str(target_dir), "--data-path", str(export_dir),
            "--target-layer-ids", *map(str, aux), "--draft-vocab-size", str(recipe.draft_vocab_size),
            "--num-layers", str(recipe.num_layers), "--draft-arch", "llama", "--draft-hidden-act", "silu",
            "--sliding-window", str(recipe.total_seq_len),
            "--full-attention-indices", *map(str, range(recipe.num_layers)),
            "--norm-before-residual", "--norm-before-fc", "--norm-output", "--no-embed-requires-grad",
            "--ttt-steps", str(recipe.ttt_steps), "--ttt-step-loss-decay", "1.0", "--loss-fn", "kl_div",
            # its fused (Triton) loss inside the compiled forward stops torch 2.11's dynamo ("ListVariable ...
            # already tracked for mutation", H200, 2026-12-02); the eager loss is draft.train_draft's
            "--loss-implementation", "eager",
            "--optimizer", "adamw", "--lr", str(recipe.lr), "--weight-decay", "0.01", "--scheduler-type", "linear",
            "--total-seq-len", str(recipe.total_seq_len), "--train-data-ratio", str(recipe.train_ratio),
            "--epochs", str(recipe.epochs), "--seed", str(recipe.seed), "--on-missing", "raise",
            "--mask-token-id", "0",  # EAGLE-3 never reads it; given, speculators skips loading the tokenizer
            "--save-path", str(run_dir / "checkpoints"), "--log-dir", str(run_dir / "logs"),
            "--no-resume-from-checkpoint"]
    if recipe.max_steps is not None:  # speculators ends the epoch it is in at this step
        args += ["--max-steps", str(recipe.max_steps)]
    return [sys.executable, "-m", __name__, *args]


def train_draft_with_speculators(export_dir: Path, target_dir: Path, out_dir: Path,
                                 recipe: DraftRecipe = DraftRecipe()) -> dict:
    """`speculators train` on `export_dir` into OUT.run/ (its log, checkpoints and metrics), its last epoch's
    checkpoint copied into `out_dir` with TRAINING_FILE (as `draft.train_draft` writes it). Returns that record."""
    export_dir, target_dir, out_dir = Path(export_dir).resolve(), Path(target_dir).resolve(), Path(out_dir)
    run_dir = out_dir.with_name(out_dir.name + ".run")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    # one process, no process group (LOCAL_RANK would start one; a RANK other than 0 silences its logs)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", COLUMNS="250",
               EAGLE_STATES_METRICS=str(run_dir / METRICS_FILE))
    started = time.monotonic()
    with open(run_dir / "train.log", "w") as log:
        done = subprocess.run(train_command(export_dir, target_dir, run_dir, recipe), env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    if done.returncode:
        tail = (run_dir / "train.log").read_text()[-3000:]
        raise RuntimeError(f"speculators train failed (exit {done.returncode}); {run_dir / 'train.log'} ends:\n{tail}")
    last = run_dir / "checkpoints" / str(recipe.epochs - 1)
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(last, staging, ignore=shutil.ignore_patterns("optimizer_state_dict.pt", "scheduler_state_dict.pt"))
    layers = eagle3_layers(export_dir)
    records = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    steps = [r["train"] for r in records if isinstance(r.get("train"), dict) and "loss" in r["train"]]
    vals = [r["val"] for r in records if isinstance(r.get("val"), dict)]
    saved = json.loads((staging / "config.json").read_text())
    record = {"recipe": asdict(recipe), "control": "none", "trainer": "speculators train", "device": "cuda",
              "export": str(export_dir), "target": str(target_dir), "trained_on_layer_ids": layers["aux_layer_ids"],
              "draft_config_layer_ids": saved["eagle_aux_hidden_state_layer_ids"],
              "final_layer_id": layers["final_layer_id"], "steps": len(steps), "first_loss": steps[0]["loss"],
              "final_loss": steps[-1]["loss"], "val": _val_metrics(vals[-1]) if vals else {},
              "run": str(run_dir), "seconds": round(time.monotonic() - started, 1)}
    (staging / TRAINING_FILE).write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return record


def _val_metrics(val: dict) -> dict:
    """speculators' per-epoch validation record (keys ending `_epoch`) in `draft.train_draft`'s names."""
    return reported_metrics({key.removesuffix("_epoch"): value for key, value in val.items()})


def _record_metrics(path: str) -> None:
    """A handler on speculators' metric logger that writes each record (a dict) as a JSON line to `path`; added
    after speculators' own `setup_metric_logger`, whose dictConfig resets that logger's handlers."""
    import speculators.train.cli as cli

    class JsonLines(logging.Handler):
        def __init__(self):
            super().__init__()
            self.file = open(path, "a", buffering=1)

        def emit(self, record):  # before the record reaches Rich's handler, which formats the dict into text
            if isinstance(record.msg, dict):
                self.file.write(json.dumps(record.msg, default=str) + "\n")

    setup = cli.setup_metric_logger

    def setup_then_record(*args, **kwargs):
        setup(*args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(JsonLines())

    cli.setup_metric_logger = setup_then_record


if __name__ == "__main__":  # the guard matters: speculators' data loader workers are spawned and import this file
    _record_metrics(os.environ["EAGLE_STATES_METRICS"])
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    main(TrainConfig.resolve())
