"""The capture refuses, at engine start and with what to do, a model runner its hooks were not written for: checked
against the model runner classes of the installed vLLM (the CPU build has both)."""

import pytest

from eagle_states.capture.protocol import UnsupportedRunnerError
from eagle_states.capture.worker import check_model_runner


def test_the_v1_runner_is_accepted_and_the_v2_runner_refused():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner as V1CpuRunner
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    check_model_runner(V1Runner)
    check_model_runner(V1CpuRunner)
    with pytest.raises(UnsupportedRunnerError, match=r"runs the model runner vllm\.v1\.worker\.gpu\.model_runner\."
                                                     r"GPUModelRunner; .* VLLM_USE_V2_MODEL_RUNNER=0"):
        check_model_runner(V2Runner)
    with pytest.raises(UnsupportedRunnerError, match="checked on"):
        check_model_runner(object)


def test_only_the_versions_it_was_checked_on_count_as_checked():
    from eagle_states.capture import was_checked

    assert was_checked("0.26.0") and was_checked("0.32.0+cpu") and was_checked("0.32.0")
    assert not was_checked("0.33.1") and not was_checked("0.26.1")
