"""Fixtures shared by every test group (demo models built once per session), and the group markers: a test
under tests/unit is marked `unit`, under tests/engine `engine`, tests/prefect `prefect`, tests/dvc `dvc`."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

GROUPS = ("unit", "engine", "prefect", "dvc")


def pytest_collection_modifyitems(items):
    for item in items:
        group = Path(str(item.fspath)).parent.name
        if group in GROUPS:
            item.add_marker(getattr(pytest.mark, group))


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory) -> Path:
    from eagle_states.demo import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(scope="session")
def deepseek_model(tmp_path_factory) -> Path:
    from eagle_states.demo import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("models") / "deepseek-v3", arch="deepseek-v3", num_layers=4)
