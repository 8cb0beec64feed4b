"""`eagle-states` command line. Flags override params.yaml; each command calls the same function as its
Prefect task and DVC stage."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from eagle_states.params import load_params


def _overrides(args) -> dict:
    out = {}
    if getattr(args, "model", None):
        out["model.path"], out["model.build_demo_if_missing"] = args.model, False
    if getattr(args, "data", None):
        out["data.path"], out["data.build_demo_if_missing"] = args.data, False
    for flag, key in (("input", "extract.input"), ("layer_ids", "extract.layer_ids"), ("dtype", "extract.dtype")):
        value = getattr(args, flag, None)
        if value is not None:
            out[key] = value
    return out


def cmd_make_demo_model(args) -> int:
    from eagle_states.demo_model import make_demo_model

    make_demo_model(Path(args.dir), seed=args.seed, arch=args.arch, num_layers=args.layers,
                    hidden_size=args.hidden, num_heads=args.hidden // 64, device=args.device)
    print(f"demo model written to {args.dir}")
    return 0


def cmd_extract(args) -> int:
    from eagle_states.extract import run_extraction
    from eagle_states.pipeline import extraction_settings

    overrides = _overrides(args)
    overrides["output.dir"] = args.out
    params = load_params(args.params, overrides)
    if not (Path(params.model.path) / "config.json").exists():
        raise FileNotFoundError(f"model directory {params.model.path} has no config.json")
    if params.extract.data_parallel_size > 1:
        from eagle_states.parallel import run_data_parallel

        manifest = run_data_parallel(extraction_settings(params), Path(params.extract_input),
                                     Path(params.output.dir), params.extract.data_parallel_size,
                                     params.extract.gpu_ids)
    else:
        manifest = run_extraction(extraction_settings(params), Path(params.extract_input), Path(params.output.dir),
                                  progress=not args.no_progress)
    print(json.dumps({k: manifest[k] for k in ("num_samples", "num_tokens", "layer_ids", "dtype")}))
    print(f"dataset written to {params.output.dir}")
    return 0


def cmd_prepare(args) -> int:
    from eagle_states.pipeline import prepare_step

    overrides = _overrides(args)
    overrides["prepare.out"] = args.out
    overrides["data.format"] = args.format
    params = load_params(args.params, overrides)
    report = prepare_step(params, progress=not args.no_progress)
    print(json.dumps({k: report[k] for k in ("format", "rows_read", "rows_written", "rows_skipped",
                                             "skipped_by_reason")}))
    return 0


def cmd_validate(args) -> int:
    from eagle_states.validate import validate_dataset

    params = load_params(args.params, {"output.dir": args.dir, "validate.report": args.report})
    try:
        result = validate_dataset(Path(params.output.dir), Path(args.prepared) if args.prepared else None,
                                  min_loss_tokens=params.validate_.min_loss_tokens,
                                  report=Path(params.validate_.report))
    except (OSError, ValueError, KeyError) as exc:
        print(f"eagle-states validate: could not run: {exc}", file=sys.stderr)
        return 2
    if result.valid:
        print(json.dumps(result.summary))
        return 0
    print(result.failures.to_string(index=False, max_rows=50), file=sys.stderr)
    from eagle_states.validate import failures_path

    print(f"INVALID: {len(result.failures)} failures (all listed in {failures_path(params.validate_.report)})",
          file=sys.stderr)
    return 1


def cmd_bench(args) -> int:
    from eagle_states.bench import format_result, run_benchmark

    result = run_benchmark(Path(args.model), Path(args.out), num_prompts=args.prompts, prompt_len=args.prompt_len,
                           layer_ids=args.layer_ids, rounds=args.rounds, dtype=args.dtype,
                           max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                           gpu_memory_utilization=args.gpu_memory_utilization,
                           shard_max_tokens=args.shard_max_tokens, write_threads=args.write_threads,
                           disk_probe_bytes=int(args.disk_probe_gb * 2**30), free_written=args.free_written)
    print(format_result(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def cmd_run(args) -> int:
    import os

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # avoids a SQLite lock at server start
    overrides = _overrides(args)
    overrides["output.dir"] = args.out
    params = load_params(args.params, overrides)
    from flows.extract_hidden_states import extract_hidden_states

    result = extract_hidden_states(params=params)
    print(json.dumps({"dataset": result["dataset"], "samples": result["manifest"]["num_samples"],
                      "tokens": result["manifest"]["num_tokens"], "layer_ids": result["manifest"]["layer_ids"],
                      "cache_hits": result["cache_hits"], "computed": result["computed"],
                      "valid": result["validation"]["valid"]}))
    return 0


def cmd_inputs(args) -> int:
    from eagle_states.pipeline import record_inputs

    params = load_params(args.params)
    record_inputs(params, Path(args.out))
    return 0


def cmd_publish(args) -> int:
    from eagle_states.publish import publish

    params = load_params(args.params, {"output.dir": args.dir})
    result = publish(Path("."), Path(params.output.dir), Path(params.validate_.report), push=not args.no_push,
                     push_retries=params.publish.push_retries)
    print(json.dumps(result))
    return 0 if result["pushed"] or args.no_push else 3


def cmd_export(args) -> int:
    from eagle_states.export import export_dataset

    params = load_params(args.params, {"output.dir": args.dir})
    formats = [args.format] if args.format else params.export.formats
    if not args.format:
        Path(args.out or params.export.out).mkdir(parents=True, exist_ok=True)  # the DVC stage's output
    for fmt in formats:
        out = Path(args.out) if args.out and args.format else Path(args.out or params.export.out) / fmt
        info = export_dataset(Path(params.output.dir), out, fmt, Path(params.validate_.report),
                              progress=not args.no_progress)
        print(json.dumps({"format": fmt, "out": str(out), "samples": info["samples"],
                          "source_manifest_sha256": info["manifest_sha256"]}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle-states", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-demo-model", help="write the built-in small random-weight model")
    p.add_argument("dir")
    p.add_argument("--device", default="cpu", help="where to initialise the weights (cuda is faster for big shapes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arch", choices=["llama", "deepseek-v3", "deepseek-v3-real"], default="llama",
                   help="deepseek-v3-real: DeepSeek-V3's real widths (hidden 7168, 128 MLA heads), 32 experts")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256, help="hidden size (heads of 64)")
    p.set_defaults(func=cmd_make_demo_model)

    p = sub.add_parser("run", help="the whole pipeline as a Prefect flow (ephemeral server unless one is set)")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--data")
    p.add_argument("--model")
    p.add_argument("--out", help="dataset directory (default: output.dir)")
    p.add_argument("--layer-ids", help="comma-separated ids, or 'eagle3'")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("prepare", help="conversations -> token ids and assistant loss masks")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--data", help="conversations: JSON array or JSONL (ShareGPT, messages, prompt/text)")
    p.add_argument("--model", help="model directory whose tokenizer and chat template are used")
    p.add_argument("--out", help="output directory (default: prepare.out)")
    p.add_argument("--format", choices=["auto", "sharegpt", "messages", "prompt"])
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("extract", help="capture hidden states of prepared prompts into a dataset directory")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--model")
    p.add_argument("--input", help="prepared directory or JSONL of {id, input_ids, loss_mask}")
    p.add_argument("--out", help="dataset directory (default: output.dir)")
    p.add_argument("--layer-ids", help="comma-separated ids, or 'eagle3'")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_extract)

    p = sub.add_parser("bench", help="plain prefill vs capture to disk, interleaved on one engine")
    p.add_argument("--model", required=True)
    p.add_argument("--out", default="work/bench")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--layer-ids", default="eagle3")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--shard-max-tokens", type=int, default=32768)
    p.add_argument("--write-threads", type=int, default=4)
    p.add_argument("--disk-probe-gb", type=float, default=2.0)
    p.add_argument("--free-written", action="store_true",
                   help="free each shard's disk blocks once it is fsynced and recorded (the file keeps its size), "
                        "for rounds that write more than the disk holds")
    p.add_argument("--json", help="also write the figures as JSON here")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("inputs", help="build the demo inputs if asked for; record the model and data identity")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--out", default="work/inputs.json")
    p.set_defaults(func=cmd_inputs)

    p = sub.add_parser("publish", help="DVC-commit, git-tag and push a validated dataset (exit 3: push failed)")
    p.add_argument("dir", nargs="?", help="dataset directory (default: output.dir)")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--no-push", action="store_true")
    p.set_defaults(func=cmd_publish)

    p = sub.add_parser("export", help="write a validated dataset in a trainer's layout")
    p.add_argument("dir", nargs="?", help="dataset directory (default: output.dir)")
    p.add_argument("--format", choices=["speculators", "speculators-legacy", "specforge"],
                   help="default: every format in export.formats")
    p.add_argument("--out", help="output directory (with --format) or parent directory (default: export.out)")
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("validate", help="check a dataset against the data contract (exit 0 valid, 1 invalid, 2 error)")
    p.add_argument("dir", nargs="?", help="dataset directory (default: output.dir)")
    p.add_argument("--prepared", help="the prepared input, to check that no sample is missing or extra")
    p.add_argument("--report", help="where the summary goes (default: validate.report)")
    p.add_argument("--params", default="params.yaml")
    p.set_defaults(func=cmd_validate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:  # bad input, settings or state: exit 2
        print(f"eagle-states {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
