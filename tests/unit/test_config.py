"""One chain of settings: params.yaml holds config's defaults, settings that cannot go together are refused when
loaded, what decides a shard's bytes is declared once (and dvc.yaml agrees), layer ids resolve once, and only the
capture package imports vLLM."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from pydantic import ValidationError

from eagle_states.config import SHARD_BYTES_SETTINGS, PipelineParams, load_params
from eagle_states.dataset.layout import LayerSelection
from eagle_states.extraction.driver import CaptureConfig
from helpers import REPO

PACKAGE = REPO / "eagle_states"


def test_params_yaml_is_the_defaults():
    assert load_params(REPO / "params.yaml") == PipelineParams()


def test_dvc_extract_stage_depends_on_exactly_the_byte_deciding_settings():
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    format_file = {"eagle_states/dataset/capture_format.py": ["CAPTURE_FORMAT_VERSION"]}
    assert stages["extract"]["params"] == [format_file, *SHARD_BYTES_SETTINGS]
    assert not [dep for dep in stages["extract"]["deps"] if dep.endswith(".py")], "source text keys no shard"
    for stage in stages.values():  # exact keys that exist, never a whole section
        for key in stage.get("params", []):
            if isinstance(key, str):
                PipelineParams().setting(key)


@pytest.mark.parametrize("overrides, message", [
    ({"extract.shard_max_tokens": 1000, "extract.max_num_batched_tokens": 512}, "must be a multiple of"),
    ({"prepare.max_length": 4096}, "must be below extract.max_model_len"),
    ({"extract.layer_ids": "1,2,x"}, "give 'eagle3' or integers separated by commas"),
    ({"extract.write_thread": 2}, "Extra inputs are not permitted"),
    ({"prepare.min_loss_tokens": 0, "validate.min_loss_tokens": 2}, "would fail validation after the GPU work"),
    ({"regenerate.capture": True}, "regenerate.capture needs regenerate.enabled"),
    ({"regenerate.enabled": True, "extract.input": "x.jsonl"}, "give one of them"),
])
def test_settings_that_do_not_go_together_are_refused_when_loaded(overrides, message):
    with pytest.raises(ValidationError, match=message):
        PipelineParams().override(overrides)


def test_layer_ids_are_parsed_from_a_string_and_resolved_once():
    assert PipelineParams().override({"extract.layer_ids": "2, 4,6"}).extract.layer_ids == [2, 4, 6]
    # Prefect's parameter form is built from the JSON schema: it must offer the string the CLI takes
    forms = PipelineParams.model_json_schema()["$defs"]["ExtractParams"]["properties"]["layer_ids"]["anyOf"]
    assert any(f.get("type") == "string" and "pattern" in f for f in forms)
    layers = LayerSelection.resolve("eagle3", 8)
    assert layers.layer_ids == (2, 4, 5, 8) and layers.layer_id(3) == 8 and layers.ends_with_final_state()
    assert not LayerSelection.resolve([1, 2], 8).ends_with_final_state()
    with pytest.raises(ValueError, match=r"outside 0..8"):
        LayerSelection.resolve([1, 9], 8)
    with pytest.raises(ValueError, match="duplicates"):
        LayerSelection.resolve([1, 1], 8)


def test_the_shard_key_is_made_of_declared_things_not_source_text(tmp_path, llama_model):
    """A comment in every file of the capture leaves the shard cache key (and the Prefect task key) as it was: it
    is computed by a copy of the package with those edits, in another interpreter."""
    copy = tmp_path / "eagle_states"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("capture/worker.py", "capture/engine.py", "dataset/layout.py", "dataset/shard_file.py",
                 "dataset/codec.py", "extraction/driver.py"):
        with open(copy / name, "a") as f:
            f.write("\n# an edit that changes no shard\n")
    params = PipelineParams.model_validate({"model": {"path": str(llama_model), "build_demo_if_missing": False}})
    script = ("import sys; from eagle_states.config import PipelineParams; "
              "from eagle_states.extraction.driver import CaptureConfig; "
              "c = CaptureConfig(PipelineParams.model_validate_json(sys.argv[1])); "
              "import eagle_states; print(eagle_states.__file__, c.config_hash, c.serving_key)")
    done = subprocess.run([sys.executable, "-c", script, params.model_dump_json(by_alias=True)], capture_output=True,
                          text=True, check=True, env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    where, config_hash, serving_key = done.stdout.split()
    assert where == str(copy / "__init__.py")
    here = CaptureConfig(params)
    assert (config_hash, serving_key) == (here.config_hash, here.serving_key)

def test_only_the_capture_package_imports_vllm():
    importing = sorted(str(path.relative_to(REPO)) for folder in ("eagle_states", "flows", "tasks")
                       for path in (REPO / folder).rglob("*.py")
                       if re.search(r"^\s*(import vllm|from vllm)", path.read_text(), re.M))
    assert importing and all(path.startswith("eagle_states/capture/") for path in importing), importing


# the layers, bottom up, with what each must not import: the stages and below (eagle_states/), the engine-worker
# coordination (eagle_states/coordination/), the thin Prefect tasks (tasks/), the flow (flows/); the command line
# (eagle_states/cli.py) is the top
ABOVE = {"eagle_states": ("eagle_states.coordination", "tasks", "flows"),
         "eagle_states/coordination": ("tasks", "flows"), "tasks": ("flows",)}


def test_no_layer_imports_one_above_it():
    """#28: stages -> tasks.local_workers -> tasks.dispatch -> stages was a circle."""
    upward = []
    for path in sorted(p for folder in ("eagle_states", "tasks") for p in (REPO / folder).rglob("*.py")):
        where = path.relative_to(REPO).as_posix()
        if where == "eagle_states/cli.py":
            continue
        layer = "eagle_states/coordination" if where.startswith("eagle_states/coordination/") else where.split("/")[0]
        names = "|".join(re.escape(name) for name in ABOVE[layer])
        if re.search(rf"^\s*(import ({names})\b|from ({names})[. ])", path.read_text(), re.M):
            upward.append(where)
    assert not upward, upward


def test_a_model_that_is_not_what_its_config_says_is_refused(tmp_path):
    from eagle_states.capture.protocol import CaptureError, Setup
    from eagle_states.capture.forward import check_loaded_model

    setup = Setup(layer_ids=[2, 4], num_layers=8, hidden_size=256, write_threads=1, host_buffer_bytes=1 << 30)
    check_loaded_model(8, 256, setup)
    with pytest.raises(CaptureError, match="the loaded model has 7 decoder layers of width 256, config.json says 8"):
        check_loaded_model(7, 256, setup)


def test_max_model_len_beyond_the_models_context_is_refused(tmp_path):
    import json

    from eagle_states.extraction.driver import CaptureConfig

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 8, "hidden_size": 256, "vocab_size": 500,
                                                      "max_position_embeddings": 2048}))
    params = PipelineParams().override({"model.path": str(tmp_path)})
    with pytest.raises(ValueError, match=r"max_model_len \(4096\) is beyond the model's context \(2048"):
        CaptureConfig(params)


def test_an_export_refuses_aux_layers_in_an_order_vllm_would_not_feed():
    from eagle_states.export import ExportRefused, check_layers

    check_layers(LayerSelection.resolve([2, 4, 5, 8], 8), "speculators")
    with pytest.raises(ExportRefused, match="not in ascending order"):
        check_layers(LayerSelection.resolve([4, 2, 5, 8], 8), "speculators")
    check_layers(LayerSelection.resolve([4, 2, 5], 8), "speculators-legacy")  # a plain list: any order
