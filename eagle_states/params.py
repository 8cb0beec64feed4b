"""Pipeline parameters: a typed model that mirrors params.yaml (the Prefect UI form, the CLI and DVC all use it)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_PARAMS_FILE = Path("params.yaml")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelParams(_Section):
    path: str = Field("work/demo-model", description="HF-format model directory (config.json, safetensors, tokenizer)")
    build_demo_if_missing: bool = Field(True, description="build the built-in random-weight demo model at `path`")


class DataParams(_Section):
    path: str = Field("work/demo-data/conversations.jsonl", description="conversations (JSON or JSONL)")
    format: Literal["auto", "sharegpt", "messages", "prompt"] = "auto"
    build_demo_if_missing: bool = Field(True, description="write the built-in demo conversations at `path`")


class PrepareParams(_Section):
    out: str = "work/prepared"
    max_length: int = Field(2048, gt=0, description="tokens per sample")
    overlong: Literal["truncate", "drop"] = Field("truncate", description="what happens to a longer conversation")
    min_loss_tokens: int = Field(1, ge=0)
    limit: Optional[int] = Field(None, gt=0, description="keep at most this many samples")
    shuffle_seed: Optional[int] = Field(None, description="shuffle before the limit (null keeps file order)")
    dedup: bool = Field(True, description="drop conversations identical to an earlier one")


class ExtractParams(_Section):
    input: Optional[str] = Field(None, description="prepared directory or JSONL of token ids; default: prepare.out")
    layer_ids: Union[Literal["eagle3"], list[int]] = Field("eagle3", description="'eagle3' = [2, N//2, N-3, N]")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    shard_max_tokens: int = Field(32768, gt=0)
    max_model_len: int = Field(4096, gt=1)
    max_num_batched_tokens: int = Field(8192, gt=0)
    max_num_seqs: int = Field(64, gt=0)
    gpu_memory_utilization: float = Field(0.2, gt=0, le=1, description="on the CPU build: share of host memory for KV")
    tensor_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(1, ge=1, description="engines, each on its own GPU group (CLI extract)")
    gpu_ids: Optional[list[int]] = Field(None, description="GPUs to use, tensor_parallel_size per engine")
    write_threads: int = Field(4, ge=1, description="shard writer threads (4 kept the H200 disk busiest)")

    @field_validator("layer_ids", mode="before")
    @classmethod
    def _parse_layer_ids(cls, value):
        if isinstance(value, str) and value != "eagle3":
            return [int(part) for part in value.split(",") if part.strip()]
        return value


class ValidateParams(_Section):
    min_loss_tokens: int = Field(1, ge=0)
    report: str = Field("work/validation.json", description="summary (DVC metrics); failures go beside it")


class ExportParams(_Section):
    formats: list[Literal["speculators", "speculators-legacy", "specforge"]] = Field(
        default_factory=list, description="trainer layouts to export after validation")
    out: str = Field("work/exports", description="one subdirectory per format")


class PublishParams(_Section):
    enabled: bool = Field(False, description="commit the dataset to DVC, tag it in git and push it (flow only)")
    push: bool = True
    push_retries: int = Field(3, ge=1)


class OutputParams(_Section):
    dir: str = "work/dataset"
    prefect_results: str = Field("work/.prefect-results", description="where Prefect keeps shard results (small)")


class PipelineParams(_Section):
    model: ModelParams = ModelParams()
    data: DataParams = DataParams()
    prepare: PrepareParams = PrepareParams()
    extract: ExtractParams = ExtractParams()
    validate_: ValidateParams = Field(ValidateParams(), alias="validate")
    export: ExportParams = ExportParams()
    publish: PublishParams = PublishParams()
    output: OutputParams = OutputParams()

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @property
    def extract_input(self) -> str:
        return self.extract.input or self.prepare.out


def load_params(path: Path | None = None, overrides: dict | None = None) -> PipelineParams:
    """params.yaml (if present), then dotted overrides such as {"extract.layer_ids": "2,3,5"} (None = not given)."""
    path = Path(path) if path else DEFAULT_PARAMS_FILE
    data = yaml.safe_load(path.read_text()) if path.exists() else {}
    data = data or {}
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, key = dotted.split(".", 1)
        data.setdefault(section, {})[key] = value
    return PipelineParams.model_validate(data)
