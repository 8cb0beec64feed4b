"""Room for an extraction, checked before any model loads: the disk for its unfinished shards (again with a codec,
once the first shard has measured its ratio), the capture's host buffer for its samples (those too long for it go
through spill files), the disk for those spill files, and huge pages where shards go into RAM."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from eagle_states.capture.handoff import blocks_held, fits_host_buffer, pinned_blocks
from eagle_states.capture.spill import check_spill_dir
from eagle_states.dataset.files import tmpfs_huge_pages, without_huge_pages
from eagle_states.dataset.prepared import InputSample
from eagle_states.dataset.shard_file import DTYPE_OF_NAME

if TYPE_CHECKING:
    from eagle_states.extraction.driver import Extraction, PlannedShard

log = logging.getLogger(__name__)
TOLD_TMPFS: set[str] = set()  # tmpfs mount points this process has said have no huge pages (`tell_tmpfs_pages`)


class NoRoomError(OSError):
    """The output's disk does not have room for the unfinished shards."""


def existing_folder(path: Path) -> Path:
    """`path`, or the nearest folder above it that exists: where its file system is asked for room."""
    return next(p for p in (path, *path.resolve().parents) if p.exists())


def shards_need(extraction: Extraction) -> tuple[int, str, tuple[float, int] | None]:
    """(bytes, how they were counted, the codec's measured ratio and its shards) for the unfinished shards:
    uncompressed, or with the codec's ratio once a finished shard has measured it."""
    lengths = [len(s.input_ids) for shard in extraction.unfinished() for s in shard.samples]
    needed = extraction.uncompressed_bytes(lengths)
    how = (f"{sum(lengths):,} tokens x {len(extraction.layers)} layers x hidden {extraction.model['hidden_size']} "
           f"x {extraction.dtype}")
    measured = extraction.measured_codec_ratio()
    if measured is not None:
        needed = int(needed * measured[0])
        how += (f" x {measured[0]:.3f}, the ratio of {extraction.codec.name} measured on {measured[1]} finished "
                f"shard{'s' if measured[1] != 1 else ''}")
    return needed, how, measured


def check_free_space(extraction: Extraction) -> None:
    """Refuse when the unfinished shards clearly do not fit on the output's disk: before any model load, and
    with a codec again once the first shard has measured the codec's ratio (until then the uncompressed size
    only warns, since the codec may well make it fit)."""
    needed, how, measured = shards_need(extraction)
    folder = existing_folder(extraction.out)
    free = shutil.disk_usage(folder).free
    if needed <= free:
        return
    message = (f"{extraction.out}: the unfinished shards need {needed / 1e9:,.2f} GB ({how}); {folder}'s file "
               f"system has {free / 1e9:,.2f} GB free")
    if extraction.codec.enabled and measured is None:
        log.warning("%s uncompressed; checked again with %s's ratio after the first shard", message,
                    extraction.codec.name)
        return
    raise NoRoomError(errno.ENOSPC, message)


def check_host_buffer(extraction: Extraction, shards: list[PlannedShard]) -> None:
    """Samples whose steps cannot all fit the capture's host buffer (held there from their first step to their last:
    `handoff.fits_host_buffer`) are spilled, their rows written to a file (in `extract.spill_dir`, or beside their
    shard) as they are captured and read back when the shard's file reaches them: uncompressed, or as a step codec
    encoded them (a CPU codec compresses them as they are read back). Host memory is the setting's, whatever the
    samples' length; a spill directory that cannot hold them is refused here, before any model load."""
    e = extraction.params.extract
    row_bytes = len(extraction.layers) * extraction.model["hidden_size"] * DTYPE_OF_NAME[extraction.dtype].itemsize
    budget, steps = int(e.host_buffer_gb * 2**30), e.max_num_batched_tokens
    spilled = [s for shard in shards for s in shard.samples
               if not fits_host_buffer(len(s.input_ids), budget, row_bytes, steps)]
    if not spilled:
        return
    longest = max(spilled, key=lambda s: len(s.input_ids))
    needed = blocks_held(len(longest.input_ids), steps) * pinned_blocks(budget, row_bytes, steps)[0] / 2**30
    what = (f"sample {longest.sample_id} (input row {longest.source_row}): {len(longest.input_ids):,} tokens x "
            f"{len(extraction.layers)} layers x hidden {extraction.model['hidden_size']} x {extraction.dtype} are "
            f"held in the capture's host buffer until its last step, in steps of {steps:,} tokens: it needs "
            f"{needed:.3g} GiB, extract.host_buffer_gb is {e.host_buffer_gb:g}")
    if e.spill_dir is not None:
        check_spill_dir(e.spill_dir)
    if extraction.told_spilled:
        return
    extraction.told_spilled = True
    total = sum(len(shard.samples) for shard in shards)
    in_ram = tmpfs_huge_pages(Path(e.spill_dir) if e.spill_dir else extraction.out)
    log.warning("samples too long for the capture's host buffer go through spill files %s (their states "
                "written and read once more, twice with a GPU codec): %d of %d. The longest: %s; raise it "
                "to keep them in memory%s", f"in {e.spill_dir}" if e.spill_dir else "beside their shards",
                len(spilled), total, what,
                f". The spill files are in RAM (tmpfs {in_ram[0]}), where spilling saves no memory: set "
                "extract.spill_dir to a directory on a disk" if in_ram else "")
    tell_spill_room(extraction, spilled)


def tell_spill_room(extraction: Extraction, spilled: list[InputSample]) -> None:
    """A warning where the spill files' file system lacks room for every spilled sample at once (beside the
    unfinished shards, where they share it). A spill file goes once its shard's writer has read it back, so that
    many are only there together when the writers fall behind the capture: no refusal, but a full disk there
    stops the run."""
    spill_dir = extraction.params.extract.spill_dir
    folder, shards_folder = existing_folder(Path(spill_dir or extraction.out)), existing_folder(extraction.out)
    need = extraction.uncompressed_bytes([len(s.input_ids) for s in spilled])
    measured = extraction.measured_codec_ratio() if extraction.codec.on_device else None
    if measured is not None:  # a step codec's spill files hold what it encoded; a CPU codec's are uncompressed
        need = int(need * measured[0])
    free, beside = shutil.disk_usage(folder).free, ""
    if os.stat(folder).st_dev == os.stat(shards_folder).st_dev:
        shards = shards_need(extraction)[0]
        free, beside = free - shards, f" beyond the unfinished shards' {shards / 1e9:,.2f} GB"
    if need > free:
        log.warning("spill files may hold up to %s GB at once in %s (the states of %d spilled sample%s, if the "
                    "shards' writers fall behind the capture); its file system has %s GB free%s: set "
                    "extract.spill_dir to a disk with room", f"{need / 1e9:,.2f}", folder, len(spilled),
                    "s" if len(spilled) != 1 else "", f"{max(free, 0) / 1e9:,.2f}", beside)


def tell_tmpfs_pages(out: Path) -> None:
    """Shards into RAM: where the tmpfs has no huge pages, how to give it some (the capture's writes wait for
    the kernel's 4 KiB pages there). Once a process for each mount: a bench runs an extraction per round, an
    engine worker one per flow run."""
    tmpfs = tmpfs_huge_pages(out)
    if tmpfs and tmpfs[1] == "never" and tmpfs[0] not in TOLD_TMPFS:
        TOLD_TMPFS.add(tmpfs[0])
        log.info("shards go into tmpfs %s, mounted without huge pages: %s", tmpfs[0], without_huge_pages(tmpfs[0]))
