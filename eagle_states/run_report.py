"""The end-of-run summary (a markdown artifact in the Prefect UI, printed by `eagle-states run`)."""

from __future__ import annotations


def length_histogram(lengths: list[int], bins: int = 8, width: int = 30) -> list[tuple[str, int, str]]:
    """(range label, count, bar) rows: a small text plot of token lengths."""
    if not lengths:
        return []
    low, high = min(lengths), max(lengths)
    step = max(1, -(-(high - low + 1) // bins))
    counts = [0] * bins
    for n in lengths:
        counts[min((n - low) // step, bins - 1)] += 1
    top = max(counts)
    return [(f"{low + i * step}-{low + (i + 1) * step - 1}", c, "█" * round(width * c / top))
            for i, c in enumerate(counts)]


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000


def human_rate(nbytes: float, seconds: float) -> str:
    return human_bytes(nbytes / seconds) + "/s" if seconds > 0 else "n/a"


def render_markdown(*, dataset: str, manifest: dict, validation: dict, outcomes: list, stage_seconds: dict,
                    lengths: list[int], model: str = "", manifest_sha256: str = "") -> str:
    computed = [o for o in outcomes if o.computed]
    extract_s = stage_seconds.get("extract", 0.0)
    computed_tokens = sum(o.num_tokens for o in computed)
    validation_text = "valid" if validation.get("valid") else "INVALID"
    validation_text += (", unchanged since it was last found valid (not read again)" if validation.get("reused") else
                        f", {human_rate(validation.get('bytes', 0), validation.get('seconds') or 0)} read")
    lines = [
        f"# Hidden states: `{dataset}`", "",
        "| | |", "|---|---|",
        f"| model | `{model}` |",
        f"| manifest sha256 | `{manifest_sha256[:16]}` |",
        f"| samples | {manifest['num_samples']:,} |",
        f"| tokens | {manifest['num_tokens']:,} (loss tokens {manifest['num_loss_tokens']:,}) |",
        f"| layers | {manifest['layer_ids']} ({manifest['dtype']}) |",
        f"| shards | {len(outcomes)}: {len(outcomes) - len(computed)} cache hits, {len(computed)} computed "
        f"({sum(getattr(o, 'repaired', False) for o in computed)} of them rewritten) |",
        f"| tokens/s (computed shards) | {computed_tokens / extract_s:,.0f} |" if computed and extract_s else
        "| tokens/s | no shard computed: every shard was cached |",
        f"| bytes written | {human_bytes(sum(o.bytes for o in computed))} of "
        f"{human_bytes(sum(o.bytes for o in outcomes))} |",
        f"| validation | {validation_text} |",
        "", "## Time per stage", "", "| stage | seconds |", "|---|---|",
        *[f"| {stage} | {seconds:.1f} |" for stage, seconds in stage_seconds.items()],
        "", "## Token lengths", "", "| tokens | samples | |", "|---|---:|---|",
        *[f"| {label} | {count} | `{bar}` |" for label, count, bar in length_histogram(lengths)],
        *worker_table(computed, extract_s),
    ]
    return "\n".join(lines) + "\n"


def render_text(result: dict) -> str:
    """The end of `eagle-states run` on the terminal: what was done, the counts, speed, time, where things are."""
    extract, validation = result["extract"], result["validation"]
    prepared = result["regenerate"] or result["prepare"]  # the step that made the extraction's input
    made = "regenerated" if result["regenerate"] else "prepared"
    stages = result["stage_seconds"]
    lines = [f"{result['dataset']}: {extract['num_samples']:,} samples, {extract['num_tokens']:,} tokens "
             f"({extract['num_loss_tokens']:,} loss tokens), layers {extract['layer_ids']} ({extract['dtype']}), "
             f"{'valid' if validation['valid'] else 'INVALID'}"
             + (" (unchanged since last validated)" if validation.get("reused") else "")]
    lines.append(f"  shards       {result['computed'] + result['cache_hits']}: {result['computed']} computed "
                 f"({result['repaired']} of them rewritten after damage), {result['cache_hits']} already on disk")
    if result["computed"] and stages.get("extract"):
        lines.append(f"  speed        {result['computed_tokens'] / stages['extract']:,.0f} tokens/s over the computed "
                     "shards")
    regenerated = result["regenerate"]
    if regenerated and not regenerated["reused"]:
        lines.append(f"  regenerated  {regenerated['turns_generated']:,} turns, {regenerated['tokens_generated']:,} "
                     f"tokens ({regenerated['truncated_turns']:,} turns cut at their limit)"
                     + (f"; {regenerated['shards_captured']} shards captured while generating"
                        if regenerated["shards_captured"] else ""))
    lines.append(f"  {made:<12} {prepared['rows_written']:,} of {prepared['rows_read']:,} rows"
                 + (f"; {prepared['rows_skipped']:,} skipped "
                    f"({', '.join(f'{k}: {v}' for k, v in prepared['skipped_by_reason'].items())}), reasons per row "
                    f"in {prepared['out']}/skipped.jsonl" if prepared["rows_skipped"] else ""))
    lines.append("  time         " + ", ".join(f"{k} {v:.1f} s" for k, v in stages.items()))
    lines.append(f"  outputs      dataset {result['dataset']}, {made} {prepared['out']}, "
                 f"validation report {result['validation_report']}"
                 + "".join(f", {e['format']} {e['out']}" for e in result["exports"]))
    return "\n".join(lines)


def worker_table(computed: list, extract_s: float) -> list[str]:
    """Who computed what, when engine workers did: shards, tokens and tokens/s over the extract stage's time."""
    by_worker: dict[tuple[str, str], list] = {}
    for outcome in computed:
        if outcome.worker:
            by_worker.setdefault((outcome.worker, outcome.devices), []).append(outcome)
    if not by_worker:
        return []
    rows = ["", "## Engine workers", "", "| worker (host-pid) | devices | shards | tokens | tokens/s |",
            "|---|---|---:|---:|---:|"]
    for (worker, devices), done in sorted(by_worker.items()):
        tokens = sum(o.num_tokens for o in done)
        rows.append(f"| {worker} | {devices} | {len(done)} | {tokens:,} | "
                    f"{tokens / extract_s if extract_s else 0:,.0f} |")
    return rows
