"""Does a shard's fsync wait for other files' dirty pages (ext4 ordered mode)? Writes a 'spill' file buffered, then
a 'shard' with O_DIRECT, fsyncs the shard; prints times and Dirty/Writeback."""
import mmap, os, sys, time, numpy as np
def meminfo():
    d = dict(l.split(":") for l in open("/proc/meminfo"))
    return {k: int(d[k].split()[0]) >> 10 for k in ("Dirty", "Writeback")}
spill_gb, shard_gb = float(sys.argv[1]), float(sys.argv[2])
block = np.frombuffer(mmap.mmap(-1, 32 << 20), np.uint8); block[:] = np.random.randint(0, 255, block.size, dtype=np.uint8)
os.sync()
t = time.perf_counter()
fd = os.open("spill.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
for _ in range(int(spill_gb * 32)): os.write(fd, block)
print(f"spill write {time.perf_counter()-t:.2f}s", meminfo(), flush=True)
t = time.perf_counter()
fd2 = os.open("shard.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
for _ in range(int(shard_gb * 32)): os.write(fd2, block)
w = time.perf_counter() - t
print(f"shard write {w:.2f}s ({shard_gb/w:.2f} GB/s)", meminfo(), flush=True)
t = time.perf_counter(); os.fsync(fd2); print(f"shard fsync {time.perf_counter()-t:.2f}s", meminfo(), flush=True)
os.close(fd); os.close(fd2)
t = time.perf_counter(); os.unlink("spill.tmp"); os.unlink("shard.tmp"); print(f"unlink {time.perf_counter()-t:.2f}s", meminfo())
