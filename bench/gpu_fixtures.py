"""Small datasets made on a GPU, for the CPU tests (`tests/fixtures/gpu-made/`, `tests/unit/test_gpu_made.py`):
what the device writes with nvCOMP's codecs, checked where CI runs, which cannot decode them. The demo Llama in
bf16, a few prompts of mixed lengths, one engine, extracted with codecs none, nvcomp-ans and fp8-e4m3-ans, each
validated on the device (its record beside each, as `validate` leaves it). OUT's contents, the records
included, go into tests/fixtures/gpu-made/.

    python3 bench/gpu_fixtures.py OUT
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import extraction_params, random_prompts, write_prompt_jsonl  # noqa: E402

from eagle_states.capture.engine import EngineHolder  # noqa: E402
from eagle_states.demo import make_demo_model  # noqa: E402
from eagle_states.extraction.driver import Extraction, run_extraction  # noqa: E402
from eagle_states.validate import validate_dataset  # noqa: E402

LENGTHS = [1, 5, 17, 64, 65]  # a single token, a sample across 64-token chunks (max_num_batched_tokens 64)
LAYERS = [0, 4, 8]  # entering layer 0 (the embeddings), a middle layer, the final state before the norm
CODECS = ["none", "nvcomp-ans", "fp8-e4m3-ans"]


def main():
    out = Path(sys.argv[1])
    work = Path(tempfile.mkdtemp(prefix="gpu-fixtures-"))
    model = make_demo_model(work / "demo-model")
    source = write_prompt_jsonl(work / "prompts.jsonl", random_prompts(LENGTHS, 500, seed=3))
    engines = EngineHolder()
    for codec in CODECS:
        params = extraction_params(model, source, out / codec, layer_ids=LAYERS, dtype="bfloat16",
                                   shard_max_tokens=128, max_model_len=256, max_num_batched_tokens=64,
                                   max_num_seqs=4, gpu_memory_utilization=0.2, codec=codec)
        manifest = run_extraction(Extraction(params), progress=False, engines=engines)
        verdict = validate_dataset(out / codec)
        size = sum(s["bytes"] for s in manifest["shards"])
        print(json.dumps({"codec": codec, "valid": verdict.valid, "shards": len(manifest["shards"]), "bytes": size,
                          **{k: v for k, v in verdict.summary.items() if k == "relative_error_per_layer"}}))
        assert verdict.valid, verdict.failures
    engines.close()
    shutil.rmtree(out / ".prefect-results", ignore_errors=True)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
