"""The pipeline's parameters: one typed model that mirrors params.yaml and holds every default. The CLI, the Prefect
flow's form, the DVC stages and the bench all load it; what the engine and the extraction need are views of it.

`SHARD_BYTES_SETTINGS` is the one list of the settings that decide a shard's bytes: it feeds the shard cache key
(receipts and Prefect), the manifest's engine record and the extract stage's `params:` in dvc.yaml."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

from eagle_states.dataset.codec import NAMES as CODEC_NAMES, STEP_CODECS

DEFAULT_PARAMS_FILE = Path("params.yaml")

# What decides a shard's bytes besides its samples, the model and the capture code. The batching settings are here
# because a step's composition changes the float results (to the bit); `max_model_len` (which rows are accepted),
# `gpu_memory_utilization` (the KV cache's size, which depends on the machine anyway), `write_threads`,
# `host_buffer_gb`, `spill_dir`, `data_parallel_size`, `gpu_ids` and `codec_threads` change where and how fast, not
# what (with more than one Blosc2 thread its frames vary from run to run; the states they decode to do not). The codec
# and its level decide the stored bytes (not the states they decode to). States captured while generating
# (`regenerate.capture`) come from other batches than a prefill's, so they differ in the last bits.
SHARD_BYTES_SETTINGS = ("extract.layer_ids", "extract.dtype", "extract.shard_max_tokens",
                        "extract.max_num_batched_tokens", "extract.max_num_seqs", "extract.tensor_parallel_size",
                        "extract.codec", "extract.codec_level", "regenerate.capture")


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


class RegenerateParams(_Section):
    enabled: bool = Field(False, description="replace every assistant turn by the target model's own reply before "
                                             "the states are captured")
    out: str = Field("work/regenerated", description="the regenerated conversations and their token ids (the "
                                                     "extraction's input when enabled)")
    temperature: float = Field(0.0, ge=0, description="0: greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(512, gt=0, description="tokens per assistant turn")
    seed: int = Field(0, description="sampling seed (each turn draws from its own generator, seeded from this)")
    on_truncated: Literal["keep", "drop"] = Field(
        "keep", description="a turn cut at max_new_tokens (or at prepare.max_length): kept as it is, or its "
                            "conversation dropped (skipped.jsonl)")
    capture: bool = Field(False, description="capture the states while the last assistant turn is generated (no "
                                             "second prefill); the extract step then only finalizes")


class ExtractParams(_Section):
    input: Optional[str] = Field(None, description="prepared directory or JSONL of token ids; default: prepare.out")
    # the string form ("2,16,29,32", as on the command line) is turned into the list before validation; it is in
    # the type so that Prefect's parameter form accepts it too
    layer_ids: Union[Literal["eagle3"], list[int],
                     Annotated[str, StringConstraints(pattern=r"^\s*\d+(\s*,\s*\d+)*\s*$")]] = Field(
        "eagle3", description="'eagle3' = [2, N//2, N-3, N], or layer ids: a list or '2,16,29,32'")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    shard_max_tokens: int = Field(8192, gt=0, description="tokens per shard; a multiple of max_num_batched_tokens "
                                  "(32768 on a GPU)")
    max_model_len: int = Field(4096, gt=1)
    max_num_batched_tokens: int = Field(8192, gt=0)
    max_num_seqs: int = Field(64, gt=0)
    gpu_memory_utilization: float = Field(0.2, gt=0, le=1, description="on the CPU build: share of host memory for KV")
    tensor_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(1, ge=1, description="engine workers started on this machine for the run, each "
                                    "on its own GPU group (CPU build: core group)")
    engine: Literal["auto", "workers", "in-process"] = Field(
        "auto", description="auto: the engine workers serving this model and these settings if the Prefect server "
                            "lists any, else an engine in the flow run; workers: wait for engine workers; "
                            "in-process: always the flow run's own engine")
    gpu_ids: Optional[list[int]] = Field(None, description="GPUs to use, tensor_parallel_size per engine")
    write_threads: int = Field(8, ge=1, description="shard writer threads (8: the H200's figures since 2026-12-01; "
                               "at the DeepSeek-V3 width to the disk 0.283 x plain prefill against 0.226 with 4)")
    host_buffer_gb: float = Field(8.0, gt=0, description="pinned host memory (GiB) for captured steps on their way "
                                  "to the shard writers: the capture's host memory, whatever the samples' length; a "
                                  "sample whose states cannot fit goes through a spill file (extract.spill_dir). "
                                  "With a codec, the compressed tensors kept until their shard's end take up to as "
                                  "much again")
    spill_dir: Optional[str] = Field(None, description="where samples too long for host_buffer_gb are spilled, in "
                                     "files with no name that nothing outlives (a local disk: with shards into RAM, "
                                     "a disk keeps them out of RAM); null: beside their shards")
    codec: Literal[CODEC_NAMES] = Field(
        "none", description="how the hidden states are stored: none; blosc2-zstd, blosc2-lz4 (lossless, on the "
                            "host: byte shuffle, then zstd or lz4); nvcomp-ans (lossless, on the GPU before the copy; "
                            "decodes on a GPU only); fp8-e4m3 (LOSSY, opt-in: a byte per value and a float32 scale "
                            "per token, read back in extract.dtype; its error is measured and validated per layer); "
                            "fp8-e4m3-ans (fp8-e4m3, its codes then coded by nvCOMP's ANS on the GPU: LOSSY, decodes "
                            "on a GPU only). "
                            "bench/RESULTS.md has the ratios and speeds")
    codec_level: int = Field(1, ge=1, le=9, description="the entropy coder's level (1: fastest)")
    codec_threads: int = Field(1, ge=1, description="Blosc2 threads per shard writer (at most write_threads x "
                                                    "codec_threads cores compress)")

    @field_validator("layer_ids", mode="before")
    @classmethod
    def _parse_layer_ids(cls, value):
        if isinstance(value, str) and value.strip() != "eagle3":
            try:
                return [int(part) for part in value.split(",") if part.strip()]
            except ValueError:
                raise ValueError(f"layer ids {value!r}: give 'eagle3' or integers separated by commas") from None
        return value.strip() if isinstance(value, str) else value


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
    overwrite: bool = Field(False, description="replace a finished dataset made with other settings or inputs")


class PipelineParams(_Section):
    model: ModelParams = ModelParams()
    data: DataParams = DataParams()
    prepare: PrepareParams = PrepareParams()
    regenerate: RegenerateParams = RegenerateParams()
    extract: ExtractParams = ExtractParams()
    validate_: ValidateParams = Field(ValidateParams(), alias="validate")
    export: ExportParams = ExportParams()
    publish: PublishParams = PublishParams()
    output: OutputParams = OutputParams()

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _settings_agree(self):
        e = self.extract
        if e.shard_max_tokens % e.max_num_batched_tokens:
            raise ValueError(f"extract.shard_max_tokens ({e.shard_max_tokens}) must be a multiple of "
                             f"extract.max_num_batched_tokens ({e.max_num_batched_tokens}): a shard's last step is "
                             "otherwise part-filled")
        if self.prepare.min_loss_tokens < self.validate_.min_loss_tokens:
            raise ValueError(f"prepare.min_loss_tokens ({self.prepare.min_loss_tokens}) is below "
                             f"validate.min_loss_tokens ({self.validate_.min_loss_tokens}): samples that preparation "
                             "keeps would fail validation after the GPU work")
        if self.regenerate.enabled and e.input:
            raise ValueError(f"extract.input ({e.input}) and regenerate.enabled: the extraction's input is then "
                             f"what regeneration writes ({self.regenerate.out}); give one of them")
        if self.regenerate.capture and not self.regenerate.enabled:
            raise ValueError("regenerate.capture needs regenerate.enabled: it captures the states while the "
                             "responses are regenerated")
        if self.regenerate.capture and e.codec in STEP_CODECS:
            raise ValueError(f"extract.codec {e.codec} and regenerate.capture: the states of generated tokens are "
                             "not encoded on the device; use none or a blosc2 codec with regenerate.capture")
        if self.prepare.max_length > e.max_model_len - 1:
            raise ValueError(f"prepare.max_length ({self.prepare.max_length}) must be below extract.max_model_len "
                             f"({e.max_model_len}): the engine takes at most max_model_len - 1 prompt tokens")
        return self

    @property
    def extract_input(self) -> str:
        """The extraction's input: `extract.input`, else what `regenerate` writes when it is enabled, else what
        `prepare` writes."""
        return self.extract.input or (self.regenerate.out if self.regenerate.enabled else self.prepare.out)

    def setting(self, dotted: str):
        section, key = dotted.split(".", 1)
        return getattr(self.validate_ if section == "validate" else getattr(self, section), key)

    def override(self, overrides: dict) -> "PipelineParams":
        """A copy with dotted overrides such as {"extract.layer_ids": "2,3,5"} (None = not given), checked again."""
        return PipelineParams.model_validate(_apply(self.model_dump(by_alias=True), overrides))

    def shard_bytes_settings(self) -> dict:
        """The settings of SHARD_BYTES_SETTINGS, by their dotted names."""
        return {name: self.setting(name) for name in SHARD_BYTES_SETTINGS}


def load_params(path: Path | None = None, overrides: dict | None = None) -> PipelineParams:
    """`path` (it must exist), else params.yaml if present, then dotted overrides such as
    {"extract.layer_ids": "2,3,5"} (None = not given)."""
    if path is not None and not Path(path).is_file():
        raise FileNotFoundError(errno.ENOENT, "parameters file not found", str(path))
    path = Path(path) if path else DEFAULT_PARAMS_FILE
    return PipelineParams.model_validate(_apply(read_params_file(path) if path.exists() else {}, overrides or {}))


def read_params_file(path: Path) -> dict:
    """A parameters file's mapping; a YAML error or a file that is not a mapping is one line naming the place
    (`safe_load`: a Python tag is refused, never run)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"{path}: not valid parameters YAML{where}: {problem}") from None
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"{path}: a YAML {type(data).__name__}, not a mapping of sections")
    return data or {}


def _apply(data: dict, overrides: dict) -> dict:
    for dotted, value in overrides.items():
        if value is None:
            continue
        section, key = dotted.split(".", 1)
        data.setdefault(section, {})[key] = value
    return data
