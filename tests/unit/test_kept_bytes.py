"""The limit on compressed tensors kept until their shard's end (`dataset.kept_bytes`): younger shards wait for
room, the oldest never does, and room comes back when a shard closes; and what is freed leaves the process."""

import subprocess
import sys
import threading

from eagle_states.dataset.kept_bytes import KeptBytes

# A writer's stored tensors: once a 16 MiB block is freed, glibc's default serves blocks under 16 MiB from its heap;
# twenty of 8 MiB are made and all but the youngest freed. What the process still holds then, above where it started,
# is the youngest (8 MiB) and what the C library kept (152 MiB by default: below the youngest, its heap cannot shrink).
CHURN = """
import sys, psutil, torch
from eagle_states.dataset.kept_bytes import return_freed_memory
if sys.argv[1] == "returned":
    assert return_freed_memory()
torch.empty(16 << 20, dtype=torch.uint8).fill_(1)
before = psutil.Process().memory_info().rss
blocks = [torch.empty(8 << 20, dtype=torch.uint8).fill_(1) for _ in range(20)]
del blocks[:-1]
print((psutil.Process().memory_info().rss - before) >> 20)
"""


def taken_in_a_thread(room, nbytes):
    done = threading.Event()
    threading.Thread(target=lambda: (room.take(nbytes), done.set()), daemon=True).start()
    return done


def test_a_younger_shard_waits_for_room_and_the_oldest_never_does():
    kept = KeptBytes(100)
    oldest, younger, youngest = kept.shard(), kept.shard(), kept.shard()
    younger.take(60)  # within the limit: no wait, whatever its age
    youngest_took = taken_in_a_thread(youngest, 50)
    assert not youngest_took.wait(0.3)  # 60 + 50 > 100
    oldest.take(500)  # past the limit: the oldest goes on
    assert kept.used == 560
    younger.close()  # its 60 back; 500 + 50 is still past the limit
    assert not youngest_took.wait(0.3)
    oldest.close()  # youngest is the oldest now: it goes on
    assert youngest_took.wait(5) and kept.used == youngest.held == 50


def test_what_an_encoding_did_not_need_is_given_back_and_a_close_returns_the_rest():
    kept = KeptBytes(100)
    first, second = kept.shard(), kept.shard()
    first.take(80)
    first.give_back(50)  # 30 stored of 80 captured
    second.take(70)  # fits now
    second.give_back(-10)  # stored past its bound: taken without a wait
    assert (kept.used, first.held, second.held) == (110, 30, 80)
    first.close()
    second.close()
    assert kept.used == 0 and kept.in_flight == []


def test_the_captures_shard_writers_past_their_limit_write_the_same_shards_and_give_all_room_back(tmp_path):
    """`ShardWriter` as the capture uses it (rooms taken in submit order, closed whatever happens), with room for
    less than one shard's kept tensors: every shard waits for the ones before it, none waits forever, and each is
    the shard written with room to spare."""
    import torch

    from eagle_states.capture.forward import PinnedPool
    from eagle_states.capture.handoff import CapturedSample, ShardPlan
    from eagle_states.capture.shard_writer import ShardWriter
    from eagle_states.dataset.codec import Codec

    torch.manual_seed(0)
    rows = {f"s{i}": 20 + 7 * i for i in range(8)}
    states = {sid: torch.randn(3, n, 64).to(torch.bfloat16) for sid, n in rows.items()}

    def take(sample_id):  # complete samples, as the assembler hands them over (in two pieces: chunked prefill)
        n, stacked = rows[sample_id], states[sample_id]
        chunks = [[stacked[slot, :n // 2] for slot in range(3)], [stacked[slot, n // 2:] for slot in range(3)]]
        return CapturedSample(torch.arange(n), chunks, [])

    def write(limit):
        writer = ShardWriter(3, write_threads=3, pinned=PinnedPool(3, 64, 1 << 20, 3 * 64 * 2),
                             kept_limit=limit)
        futures = []
        for k in range(4):  # four shards of two samples, all submitted before any is written
            ids = [f"s{2 * k}", f"s{2 * k + 1}"]
            plan = ShardPlan(ids, {s: rows[s] for s in ids}, {s: [1] * rows[s] for s in ids}, Codec("blosc2-zstd"))
            futures.append(writer.submit(str(tmp_path / str(limit) / f"shard-{k}.safetensors"), plan, take))
        written = [future.result(timeout=60) for future in futures]
        assert writer.kept.used == 0 and writer.kept.in_flight == []
        return written

    assert write(1) == write(1 << 30)


def test_freed_stored_tensors_go_back_to_the_system():
    def held_after(mode: str) -> int:  # MiB, in a fresh process: the setting is process-wide
        done = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True)
        return int(done.stdout)

    returned, default = held_after("returned"), held_after("default")
    assert returned < 40, returned
    assert default > 120, f"glibc kept {default} MiB by default: the control no longer shows what this fixes"
