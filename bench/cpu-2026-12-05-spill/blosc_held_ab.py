"""A held Blosc2 sample's shard written: its states as 16 pieces each (a step's rows), side by side in one process
of one checkout (run once per checkout)."""
import sys, time, resource
sys.path.insert(0, sys.argv[1])
import torch
from eagle_states.dataset.codec import Codec
from eagle_states.dataset.shard_file import write_shard_file
torch.manual_seed(0)
pieces = [torch.randn(1024, 7168).to(torch.bfloat16) for _ in range(16)]
tensors = {f"s/hidden_states/{k}": pieces for k in range(4)}
tensors["s/input_ids"] = torch.zeros(16384, dtype=torch.int32)
tensors["s/loss_mask"] = torch.zeros(16384, dtype=torch.uint8)
times = []
for _ in range(3):
    t = time.perf_counter()
    write_shard_file(__import__("pathlib").Path("/work/tmp/held.safetensors"), tensors, Codec("blosc2-zstd"))
    times.append(time.perf_counter() - t)
print(sys.argv[1], "seconds", " ".join(f"{x:.2f}" for x in times), "peak RSS GB",
      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6)
