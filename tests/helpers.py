"""What the tests share besides fixtures: paths, prompt files, parameters, the Hugging Face reference, and an
engine factory that counts the models it loads."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from eagle_states.capture.engine import CaptureEngine
from eagle_states.config import PipelineParams

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
BIN = Path(sys.executable).parent


def random_prompts(lengths, vocab_size, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab_size) for _ in range(n)] for n in lengths]


def write_prompt_jsonl(path: Path, prompts, ids=None) -> Path:
    with open(path, "w") as f:
        for i, prompt in enumerate(prompts):
            row = {"id": ids[i] if ids else f"p{i:03d}", "input_ids": prompt,
                   "loss_mask": [int(j % 3 != 2) for j in range(len(prompt))]}  # every row has a loss token
            f.write(json.dumps(row) + "\n")
    return path


def model_too_big_for_the_disk(model: Path, folder: Path) -> Path:
    """A copy of `model` whose config says hidden size 2^26 (1 GiB per token and layer in fp32): 1,600 tokens of it
    in 4 layers (1.7 TB) fit on no disk these tests run on. Only the size check reads it; no engine loads it."""
    import shutil

    huge = shutil.copytree(model, folder / "huge")
    config = json.loads((huge / "config.json").read_text())
    config["hidden_size"] = 2 ** 26
    (huge / "config.json").write_text(json.dumps(config))
    assert 1600 * 4 * 2 ** 26 * 4 > shutil.disk_usage(folder).free, "the test needs a disk of less than 1.7 TB"
    return huge


def refuse_a_write(monkeypatch, nth: int) -> None:
    """The `nth` write to any file `atomic_file` opens fails as a full disk does (ENOSPC), the others go through:
    what a writer does when the disk fills mid-shard."""
    import errno
    import itertools

    from eagle_states.dataset import files

    calls, original = itertools.count(1), {cls: cls.write for cls in (files.StreamingFile, files.DirectFile)}

    def write(self, data):
        if next(calls) == nth:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original[type(self)](self, data)

    for cls in original:
        monkeypatch.setattr(cls, "write", write)


def identity_ans(codes: torch.Tensor, spans: list[tuple[int, int]]):
    """A stand-in for nvCOMP's ANS (which needs a CUDA device) on a step's uint8 [L, R, H] codes: each (layer,
    span)'s codes as they are, one buffer each."""
    from eagle_states.dataset.step_codecs import EncodedStep

    blobs = [codes[slot, start:stop].reshape(-1) for slot in range(codes.shape[0]) for start, stop in spans]
    return EncodedStep(torch.cat(blobs), *codes.shape, codes.dtype, tuple(spans), tuple(b.numel() for b in blobs))


def extraction_params(model: Path, source: Path, out: Path, **extract) -> PipelineParams:
    """Parameters for extracting `source` (a prompt JSONL or a prepared directory) with `model` into `out`;
    `extract` overrides the extract section (everything else is config's defaults)."""
    max_model_len = extract.get("max_model_len", 4096)
    return PipelineParams.model_validate({
        "model": {"path": str(model), "build_demo_if_missing": False},
        "prepare": {"max_length": min(2048, max_model_len - 1)},
        "extract": {"input": str(source), **extract},
        "output": {"dir": str(out), "prefect_results": str(Path(out).parent / ".prefect-results")}})


class CountingEngines:
    """An engine factory that counts the engines it creates (`engine_class`: the real engine or a subclass of it
    that injects a fault)."""

    def __init__(self, engine_class=CaptureEngine):
        self.engine_class = engine_class
        self.created = 0

    def __call__(self, settings):
        self.created += 1
        return self.engine_class(settings)


# -- the independent reference: Hugging Face transformers on the same weights ---------------------------------------
# Layer semantics as in eagle_states.dataset.layout: k < N is HF's hidden_states[k]; k = N is the input of the final
# norm (HF's last entry is after the norm).
def load_hf(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@torch.no_grad()
def hf_states(model, input_ids: list[int], layer_ids: list[int]) -> list[torch.Tensor]:
    captured = {}
    handle = model.model.norm.register_forward_pre_hook(lambda m, args: captured.__setitem__("pre_norm", args[0]))
    try:
        out = model(torch.tensor([input_ids], device=model.device), output_hidden_states=True)
    finally:
        handle.remove()
    n = model.config.num_hidden_layers
    return [(captured["pre_norm"] if k == n else out.hidden_states[k])[0].float() for k in layer_ids]


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.norm(a.float() - b.float()) / torch.linalg.norm(b.float())).item()


# -- a real Prefect server on loopback --------------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def prefect_server(home: Path):
    """`prefect server start` on a free loopback port (another, should the port be taken before the server binds
    it); yields the environment that points at it."""
    home.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
        port = free_port()
        env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
        env.pop("PREFECT_API_KEY", None)
        proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                                 "--port", str(port)], env=env, stdout=open(home / "server.log", "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        if _serving(proc, port):
            break
        stop(proc)
    else:
        raise RuntimeError("the Prefect server did not start: " + (home / "server.log").read_text()[-2000:])
    try:
        yield env
    finally:
        stop(proc)


def _serving(proc: subprocess.Popen, port: int, seconds: float = 120) -> bool:
    """Whether the server answers its health check before it exits or `seconds` pass."""
    import httpx

    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return False


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM the process group, then SIGKILL if it does not go."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


class SlowEngine(CaptureEngine):
    """The real engine, slowed by SLOW_ENGINE_DELAY_S seconds per shard (an engine worker's --engine-factory)."""

    def serve(self, next_job):
        from eagle_states.capture.engine import END

        delay = float(os.environ.get("SLOW_ENGINE_DELAY_S", "3"))

        def slowed(wait):
            job = next_job(wait)
            if job is not None and job is not END:
                time.sleep(delay)
            return job
        return super().serve(slowed)


class SlowLoadingEngine(CaptureEngine):
    """The real engine, SLOW_LOAD_S seconds slower to load (a big model's minutes of loading, in small)."""

    def __init__(self, settings):
        time.sleep(float(os.environ.get("SLOW_LOAD_S", "20")))
        super().__init__(settings)
