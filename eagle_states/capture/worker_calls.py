"""The driver's side of the capture workers: the typed calls of `protocol.py` to every rank through vLLM's
`collective_rpc`, and the shards the workers are writing, until every rank has reported each one and its samples
are checked against the prompts. Reads nothing of vLLM but `LLM.collective_rpc`."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from eagle_states.capture import protocol as p
from eagle_states.capture.protocol import CaptureError
from eagle_states.dataset.codec import Codec
from eagle_states.dataset.layout import shard_sample_order
from eagle_states.dataset.prepared import InputSample


@dataclass
class ShardJob:
    name: str
    path: Path
    samples: list[InputSample]
    codec: Codec = Codec()
    spill_dir: str | None = None  # extract.spill_dir


@dataclass
class ShardResult:
    name: str
    digest: str  # dataset.files.SHARD_DIGEST
    bytes: int
    num_tokens: dict[str, int]
    path: Path  # the shard's file (names repeat across datasets)


def ids_crc(input_ids) -> int:
    """The checksum workers report for the token ids they saw (int32, as the runner holds them)."""
    return zlib.crc32(np.asarray(input_ids, dtype=np.int32).tobytes())


def in_file_order(job: ShardJob) -> list[InputSample]:
    """A shard's samples in its file's order: admitted so, they are captured in the order they are written."""
    by_id = {s.sample_id: s for s in job.samples}
    return [by_id[sid] for sid in shard_sample_order(list(by_id))]


class CaptureWorkers:
    """Every rank's capture worker of one engine, and the shards queued with them until reported."""

    def __init__(self, llm, world_size: int):
        self.llm, self.world_size = llm, world_size
        self.queued: dict[str, ShardJob] = {}  # shard path -> job whose file is being written
        self.reports: dict[str, dict[int, p.ShardReport]] = {}  # shard path -> rank -> that rank's report

    def call_all(self, call: p.Message) -> list[p.Envelope]:
        """Call every worker; returns their envelopes once checked (`protocol.check_replies`)."""
        return p.check_replies(self.llm.collective_rpc(p.ENTRY_POINT, args=(call,)), call, self.world_size)

    def call(self, call: p.Message):
        """Call every worker; returns the writer rank's reply."""
        return p.writer_payload(self.call_all(call))

    @property
    def writing(self) -> bool:
        return bool(self.queued)

    def begin_shard(self, job: ShardJob) -> list[InputSample]:
        """Queue a shard's plan with the workers and await its report; returns its samples in the file's order."""
        samples = in_file_order(job)
        self.call(p.BeginShard(path=str(job.path), sample_ids=[s.sample_id for s in samples],
                               num_tokens=[len(s.input_ids) for s in samples],
                               loss_masks=[s.loss_mask.tolist() for s in samples], codec=job.codec,
                               spill_dir=job.spill_dir))
        self.queued[str(job.path)] = job
        self.reports[str(job.path)] = {}
        return samples

    def collect(self, wait: bool, unlaunched: set[str] | None = None) -> Iterator[ShardResult]:
        """Shards every rank has reported (the writer with the file's hash), checked against the prompts; samples
        the writer rank saw launched leave `unlaunched`."""
        if not self.queued:
            return
        for reply in self.call_all(p.Poll(wait=wait)):
            if reply.writer and unlaunched is not None:
                unlaunched.difference_update(reply.payload.launched)
            for path, report in reply.payload.shards.items():
                self.reports[path][reply.rank] = report
        for path in list(self.queued):
            if len(self.reports[path]) < self.world_size:
                if wait:
                    raise CaptureError(f"shard {path}: ranks {sorted(self.reports[path])} reported after waiting")
                continue
            report = p.check_shard_agreement(self.reports.pop(path), self.world_size, path)
            job = self.queued.pop(path)
            for sample in job.samples:
                seen, expected = report.samples.get(sample.sample_id), (len(sample.input_ids),
                                                                        ids_crc(sample.input_ids))
                if seen != expected:
                    raise CaptureError(f"shard {job.name}, sample {sample.sample_id}: the worker captured "
                                       f"(tokens, ids crc) = {seen}, the prompt is {expected}")
            yield ShardResult(job.name, report.digest, report.bytes,
                              {s.sample_id: len(s.input_ids) for s in job.samples}, job.path)

    def discard(self) -> None:
        """Drop what the workers hold (half-captured samples, unfinished shards) and forget the queued shards."""
        self.call(p.Discard())
        self.queued, self.reports = {}, {}
