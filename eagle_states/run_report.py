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


def render_markdown(*, dataset: str, manifest: dict, validation: dict, outcomes: list, stage_seconds: dict,
                    lengths: list[int]) -> str:
    computed = [o for o in outcomes if o.computed]
    extract_s = stage_seconds.get("extract", 0.0)
    computed_tokens = sum(o.num_tokens for o in computed)
    lines = [
        f"# Hidden states: `{dataset}`", "",
        "| | |", "|---|---|",
        f"| samples | {manifest['num_samples']:,} |",
        f"| tokens | {manifest['num_tokens']:,} (loss tokens {manifest['num_loss_tokens']:,}) |",
        f"| layers | {manifest['layer_ids']} ({manifest['dtype']}) |",
        f"| shards | {len(outcomes)}: {len(outcomes) - len(computed)} cache hits, {len(computed)} computed |",
        f"| tokens/s (computed shards) | {computed_tokens / extract_s:,.0f} |" if computed and extract_s else
        "| tokens/s | no shard computed: every shard was cached |",
        f"| bytes written | {sum(o.bytes for o in computed):,} of {sum(o.bytes for o in outcomes):,} |",
        f"| validation | {'valid' if validation.get('valid') else 'INVALID'}, "
        f"{validation.get('gb_per_s') or 0:.2f} GB/s |",
        "", "## Time per stage", "", "| stage | seconds |", "|---|---|",
        *[f"| {stage} | {seconds:.1f} |" for stage, seconds in stage_seconds.items()],
        "", "## Token lengths", "", "| tokens | samples | |", "|---|---:|---|",
        *[f"| {label} | {count} | `{bar}` |" for label, count, bar in length_histogram(lengths)],
        *worker_table(computed, extract_s),
    ]
    return "\n".join(lines) + "\n"


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
