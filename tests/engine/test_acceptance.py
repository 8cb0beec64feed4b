"""What the states are for: a draft trained on a fresh extraction (speculators' model, loss and data loading),
served by vLLM's own EAGLE-3 on prompts it was not trained on, is accepted often, and drafts trained on wrong
states are not: states shifted by one token, and a training target one layer low (the final slot naming the state
entering the last decoder layer, TorchSpec #87). The layer ids vLLM captures at serve time are the manifest's,
read back from the draft config and from the loaded target (issue #27).

The target is the demo model trained briefly (`make-demo-model --train-steps`), built once per test session;
the thresholds come from measurement (bench/RESULTS.md, "Acceptance"), with a margin."""

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from eagle_states.acceptance.draft import DraftRecipe
from eagle_states.config import PipelineParams
from eagle_states.demo import write_demo_conversations
from eagle_states.demo_training import TRAINING_FILE
from helpers import BIN

# a budget where the draft has to read the states: it has not yet learnt the target's language from the tokens
RECIPE = DraftRecipe(epochs=1, max_steps=40)
LAYER_IDS = [2, 4, 7, 8]
# measured on the CPU build with this recipe, these layer ids and these prompts (draft seed 0 / 1): 0.551 / 0.576
# (mean length 2.65 / 2.73); the token-shift control 0.50 x / 0.72 x, the final-layer control 0.49 x / 0.52 x of
# it (bench/RESULTS.md, "The final slot one layer low"); the test trains seed 0
ACCEPTED_AT_LEAST = 0.40
CONTROL_AT_MOST = 0.6  # of the correct draft's acceptance


def cli(*args: str) -> str:
    """The command in its own process, as a user runs it: the training's and the serving engines' memory is
    not left in this one (the CPU build sizes a KV cache from what the process already holds)."""
    done = subprocess.run([str(BIN / "eagle-states"), *args], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="session")
def trained_target(tmp_path_factory):
    target = tmp_path_factory.mktemp("models") / "trained-llama"
    cli("make-demo-model", str(target), "--train-steps", "160")
    return target


@pytest.fixture(scope="module")
def work(tmp_path_factory, trained_target):
    """A fresh extraction of 300 demo conversations (95,987 tokens, fp32) from the trained target, validated."""
    work = tmp_path_factory.mktemp("acceptance")
    params = PipelineParams.model_validate({
        "model": {"path": str(trained_target), "build_demo_if_missing": False},
        "data": {"path": str(write_demo_conversations(work / "conversations.jsonl", count=300, seed=0))},
        "prepare": {"out": str(work / "prepared"), "max_length": 1024},
        # the high layer is the last decoder layer's input, which the final-layer control trains towards
        "extract": {"dtype": "float32", "max_model_len": 1280, "max_num_batched_tokens": 4096,
                    "shard_max_tokens": 16384, "layer_ids": LAYER_IDS},
        "validate": {"report": str(work / "validation.json")},
        "output": {"dir": str(work / "dataset"), "prefect_results": str(work / ".prefect-results")}})
    (work / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json", by_alias=True)))
    for step in ("prepare", "extract", "validate"):
        cli(step, "--params", str(work / "params.yaml"), *(["--no-progress"] if step != "validate" else []))
    return work


@pytest.fixture(scope="module")
def report(work):
    # 16 held-out prompts: opening turns of demo conversations of seed 2 (the dataset's are seed 0)
    return json.loads(cli("acceptance", str(work / "dataset"), "--out", str(work / "acceptance"), "--controls",
                          "token-shift,final-layer-off-by-one", "--epochs", str(RECIPE.epochs), "--max-steps", str(RECIPE.max_steps),
                          "--prompts", "16", "--prompt-seed", "2", "--max-tokens", "48", "--dtype", "float32",
                          "--json").strip().splitlines()[-1])


def test_the_trained_target_is_seeded_and_recorded(trained_target):
    record = json.loads((trained_target / TRAINING_FILE).read_text())
    assert record["steps"] == 160 and record["final_loss"] < record["loss_every_10_steps"][0] / 3


def test_a_draft_trained_on_the_dataset_is_accepted_and_the_controls_are_not(report):
    drafts = {row["draft"]: row for row in report["drafts"]}
    right, shifted, final = drafts["none"], drafts["token-shift"], drafts["final-layer-off-by-one"]
    assert right["acceptance_rate"] >= ACCEPTED_AT_LEAST, right
    assert shifted["acceptance_rate"] <= CONTROL_AT_MOST * right["acceptance_rate"], (right, shifted)
    assert final["acceptance_rate"] <= CONTROL_AT_MOST * right["acceptance_rate"], (right, final)
    assert final["tokens_sha256"] == right["tokens_sha256"]
    assert right["mean_acceptance_length"] == pytest.approx(1 + right["accepted"] / right["drafts"], abs=1e-4)
    assert len(right["per_position"]) == 3 and right["per_position"][0] >= right["per_position"][-1]
    assert right["tokens_sha256"] == shifted["tokens_sha256"], "greedy: the target's own tokens whatever the draft"


def test_the_layer_ids_vllm_captures_are_the_manifests(report):
    """manifest -> export's eagle3.json -> the draft config's eagle_aux_hidden_state_layer_ids -> vLLM."""
    aux = report["manifest_layer_ids"][:-1]
    draft = next(row for row in report["drafts"] if row["draft"] == "none")
    assert draft["trained_on_layer_ids"] == aux
    assert draft["draft_config_layer_ids"] == aux  # the config vLLM loaded, read back from vLLM's own config
    assert draft["captured_layer_ids"] == aux  # what the loaded target model captures
    saved = json.loads((Path(draft["dir"]) / "config.json").read_text())
    assert saved["eagle_aux_hidden_state_layer_ids"] == aux  # as speculators saved it, no default [2, n//2, n-3]


def test_vllms_own_capture_at_the_manifests_layer_ids_gives_the_same_states(work, report):
    """The layer convention against vLLM itself: its `extract_hidden_states` (speculators' data generation path,
    bench/peer_extract.py) at the manifest's layer ids gives our states bit for bit; one layer down, it does not."""
    peer = Path(__file__).resolve().parents[2] / "bench" / "peer_extract.py"
    export = work / "acceptance" / "export"

    def extract(ids: str, out: str) -> dict:
        done = subprocess.run([str(BIN / "python"), str(peer), report["target"], str(export), str(work / out),
                               "--layer-ids", ids, "--dtype", "float32"], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(next(line for line in done.stdout.splitlines() if line.startswith('{"seconds"')))
    same = extract(",".join(map(str, report["manifest_layer_ids"])), "peer")
    assert same["bitwise_equal_to_ours"] == same["samples"] == 300
    shifted = extract(",".join(str(k - 1) for k in report["manifest_layer_ids"][:-1]) + ",8", "peer-shifted")
    assert shifted["bitwise_equal_to_ours"] == 0
