"""The next shard is admitted beside the current shard's finishing requests only where they cannot change its
first step (the step's content decides its float results, and so the shard's bytes)."""

import pytest

from eagle_states.engine import EngineSettings, InputSample, first_step_fits_beside

KV = {"kv_cache_blocks": 1000, "kv_cache_groups": 1, "kv_block_tokens": 16}


def samples(*lengths: int) -> list[InputSample]:
    return [InputSample(f"s{i}", [5] * n, [1] * n, i) for i, n in enumerate(lengths)]


def settings() -> EngineSettings:
    return EngineSettings(model="m", layer_ids=(1,), max_num_seqs=8, max_num_batched_tokens=256)


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
    kv = {"kv_cache_blocks": 90, "kv_cache_groups": groups, "kv_block_tokens": 16}
    assert first_step_fits_beside(samples(200, 200), samples(300, 300), settings(), kv) is fits
