"""The next shard is admitted beside the current shard's finishing requests only where they cannot change its
first step (the step's content decides its float results, and so the shard's bytes)."""

import pytest

from eagle_states.capture.engine import EngineSettings, first_step_fits_beside
from eagle_states.capture.protocol import SetupReply
from eagle_states.dataset.prepared import InputSample


def kv_cache(blocks: int, groups: int = 1) -> SetupReply:
    return SetupReply(num_layers=1, hidden_size=64, device="cpu", vllm_version="test", model_runner="test",
                      kv_cache_blocks=blocks, kv_cache_groups=groups, kv_block_tokens=16)


KV = kv_cache(1000)


def samples(*lengths: int) -> list[InputSample]:
    return [InputSample(f"s{i}", [5] * n, [1] * n, i) for i, n in enumerate(lengths)]


def settings() -> EngineSettings:
    return EngineSettings(model="m", layer_ids=(1,), num_layers=2, hidden_size=64, dtype="float32", max_model_len=4096,
                          max_num_seqs=8, max_num_batched_tokens=256, gpu_memory_utilization=0.2,
                          tensor_parallel_size=1, write_threads=1, host_buffer_bytes=1 << 30)


def test_a_first_step_with_room_for_the_running_requests_fits():
    # first step: 3 of 4 samples (100 + 100 + 100 tokens reach the 256-token budget); 5 running + 3 <= 8
    assert first_step_fits_beside(samples(*[10] * 5), samples(100, 100, 100, 100), settings(), KV)


def test_running_requests_that_would_take_a_sequence_slot_of_the_first_step_do_not_fit():
    # 6 running + 3 in the first step > 8: alone the step would hold 3 requests, beside them only 2
    assert not first_step_fits_beside(samples(*[10] * 6), samples(100, 100, 100, 100), settings(), KV)


def test_a_first_step_capped_by_max_num_seqs_never_fits_beside_running_requests():
    # 20 short samples: alone the step holds max_num_seqs = 8 of them, so any running request takes a slot
    assert first_step_fits_beside([], samples(*[4] * 20), settings(), KV)
    assert not first_step_fits_beside(samples(10), samples(*[4] * 20), settings(), KV)


@pytest.mark.parametrize("groups, fits", [(1, True), (2, False)])
def test_kv_cache_blocks_count_whole_prompts_per_group(groups, fits):
    # running: 2 x (ceil(200 / 16) + 1) = 28 blocks per group; the first step holds only the first 300-token
    # sample (the 256-token budget is spent, the rest of it is chunked later) but reserves its whole prompt: 20
    kv = kv_cache(90, groups)
    assert first_step_fits_beside(samples(200, 200), samples(300, 300), settings(), kv) is fits
