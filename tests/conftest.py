"""Shared fixtures: demo models built once per session, engines shared per module (an engine start costs ~30 s)."""

import json
import os
import random
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory) -> Path:
    from eagle_states.demo_model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(scope="session")
def deepseek_model(tmp_path_factory) -> Path:
    from eagle_states.demo_model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("models") / "deepseek-v3", arch="deepseek-v3", num_layers=4)


def random_prompts(lengths, vocab_size, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab_size) for _ in range(n)] for n in lengths]


def write_prompt_jsonl(path: Path, prompts, ids=None) -> Path:
    with open(path, "w") as f:
        for i, prompt in enumerate(prompts):
            row = {"id": ids[i] if ids else f"p{i:03d}", "input_ids": prompt,
                   "loss_mask": [int(j % 3 != 0) for j in range(len(prompt))]}
            f.write(json.dumps(row) + "\n")
    return path
