"""From a dataset to vLLM's acceptance of a draft trained on it, beside controls trained on wrong states.

    dataset --export (speculators)--> --train_draft (speculators' model, loss, data)--> draft
            --measure_acceptance (vLLM's EAGLE-3, greedy, held-out prompts)--> acceptance rate, length per position

Every draft of a run gets the same recipe and the same prompts; the controls (`draft.CONTROLS`) must score
clearly lower, or the measurement cannot tell a right dataset from a wrong one. The layer convention is followed
end to end and recorded: the manifest's layer ids -> the export's `eagle3.json` -> the draft config's
`eagle_aux_hidden_state_layer_ids` -> the layers vLLM's target model captures at serve time (read from the
loaded model).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from eagle_states.acceptance.draft import LAYER_SHIFT, TRAINING_FILE, DraftRecipe, relabel_draft, train_draft
from eagle_states.acceptance.speculators_trainer import train_draft_with_speculators
from eagle_states.capture.speculative import measure_acceptance
from eagle_states.dataset.files import atomic_write_json
from eagle_states.dataset.manifest import read_manifest
from eagle_states.export import export_dataset

log = logging.getLogger(__name__)
REPORT_FILE = "acceptance.json"


def heldout_prompts(model_dir: Path, count: int, seed: int) -> list[list[int]]:
    """The opening turns (system and user, up to the first reply) of `count` demo conversations of `seed`, with the
    chat template's generation prompt: prompts the drafts were not trained on when `seed` is not the dataset's.
    Of the recipe the target was trained on (its `target_training.json`; the default recipe without one).

    The tokens are those the opening turns have inside the whole conversation as `prepare` renders it (the
    rendering up to the first reply token), not the opening turns tokenized by themselves: where BPE merges across
    the end of a string, those differ at the last token (the demo tokenizer ends "<|end_header_id|>\n\n" alone
    with one merged token 'ĊĊ', inside a conversation with 'Ċ', 'Ċ'), and a prompt ending in a token that the
    target and the draft never saw before a reply is a prompt of another distribution than the training data's."""
    from transformers import AutoTokenizer

    from eagle_states.demo import demo_conversations
    from eagle_states.demo_training import TRAINING_FILE
    from eagle_states.prepare import renderer

    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    render, _ = renderer(tokenizer)
    prompts = []
    trained = Path(model_dir) / TRAINING_FILE
    recipe = json.loads(trained.read_text()).get("recipe", "chat") if trained.exists() else "chat"
    for row in demo_conversations(count, seed, recipe):
        through_reply = []
        for turn in row["conversations"]:
            through_reply.append({"role": roles[turn["from"]], "content": turn["value"]})
            if turn["from"] == "gpt":
                break
        ids, mask = render(tokenizer, through_reply)
        prompts.append(ids[:mask.index(1)])
    return prompts


def run_acceptance(dataset: Path, out: Path, *, recipe: DraftRecipe = DraftRecipe(), controls=(),
                   prompts: list[list[int]], num_speculative_tokens: int = 3, max_tokens: int = 96,
                   model: Path | None = None, dtype: str = "auto", device: str = "cpu",
                   speculators_train: bool = False) -> dict:
    """Export `dataset`, train a draft on it (and one per control), serve each with the target on `prompts`;
    the report (also OUT/acceptance.json) has one row per draft. `model`: the target (default: the manifest's);
    `dtype`: the serving engine's (float32 on a CPU, where bf16 is emulated); `device`: where the drafts train;
    `speculators_train`: one row more, the correct draft trained by `speculators train` itself (a CUDA device)."""
    dataset, out = Path(dataset), Path(out)
    manifest = read_manifest(dataset)
    target = Path(model or manifest["model"]["path"])
    export = out / "export"
    export_dataset(dataset, export, "speculators", progress=False)
    rows = []
    for control in ("none", *(["speculators-train"] if speculators_train else []), *controls):
        draft_dir = out / f"draft-{control}"
        if not (draft_dir / TRAINING_FILE).exists():  # a run stopped after some drafts resumes after them
            if control in LAYER_SHIFT:  # the correct draft's weights: only the config's layer ids differ
                relabel_draft(out / "draft-none", draft_dir, control)
            elif control == "speculators-train":
                train_draft_with_speculators(export, target, draft_dir, recipe)
            else:
                train_draft(export, target, draft_dir, recipe, control, device=device)
        trained = json.loads((draft_dir / TRAINING_FILE).read_text())
        served = measure_acceptance(target, draft_dir, prompts, num_speculative_tokens=num_speculative_tokens,
                                    max_tokens=max_tokens, dtype=dtype)
        rows.append({"draft": control, "dir": str(draft_dir), **served.summary(),
                     "train_final_loss": trained["final_loss"], "train_steps": trained["steps"], "val": trained["val"],
                     "trained_on_layer_ids": trained["trained_on_layer_ids"]})
        log.info("acceptance of the %s draft: %.3f (mean length %.2f)", control, served.acceptance_rate,
                 served.mean_acceptance_length)
    report = {"dataset": str(dataset), "target": str(target), "manifest_layer_ids": manifest["layer_ids"],
              "layer_semantics": manifest["layer_semantics"], "recipe": trained["recipe"],
              "num_speculative_tokens": num_speculative_tokens, "max_tokens": max_tokens, "dtype": dtype,
              "prompts": len(prompts), "drafts": rows}
    atomic_write_json(out / REPORT_FILE, report)
    return report


def table(report: dict) -> str:
    """The report as a few lines a person reads."""
    lines = [f"{'draft':<18}{'accept':>8}{'length':>8}  per position        loss   layers (trained -> served)"]
    for row in report["drafts"]:
        per = " ".join(f"{x:.2f}" for x in row["per_position"])
        lines.append(f"{row['draft']:<18}{row['acceptance_rate']:>8.3f}{row['mean_acceptance_length']:>8.2f}  "
                     f"{per:<18}{row['train_final_loss']:>6.3f}   {row['trained_on_layer_ids']} -> "
                     f"{row['captured_layer_ids']}")
    return "\n".join(lines)
