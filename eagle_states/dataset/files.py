"""Files as the dataset writes them: atomic (temp name, fsync, rename), streamed to the disk or past the page cache
(O_DIRECT), and hashed. Nothing here knows what a shard holds."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import mmap
import os
import platform
import re
import shutil
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np

from eagle_states import stopping


def libc_function(name: str, argtypes: list):
    """A Linux libc function, or None where there is none."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    return fn


# None where there is none: the final fsync alone then does the writing
_SYNC_FILE_RANGE = libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
_STATFS = libc_function("statfs", [ctypes.c_char_p, ctypes.c_char_p])
_SYNC_WAIT_BEFORE, _SYNC_WRITE, _SYNC_WAIT_AFTER = 1, 2, 4


class StreamingFile:
    """An unbuffered file that hands each 64 MiB it has written to the disk at once and waits for the 64 MiB
    before it.

    Without this the kernel starts writing only past its dirty-memory threshold (10% of RAM: 13 GB on a 128 GB
    host), so the disk idles while a shard is produced and the closing fsync then waits for all of it: a shard
    writer reached a third of the disk's speed that way. Streaming keeps the disk busy while the data is produced
    and bounds dirty memory per file to 128 MiB. Durability still comes from the fsync in `atomic_file`.
    """

    WRITEBACK_BYTES = 64 << 20

    def __init__(self, raw):
        self.raw = raw
        self.written = 0
        self.handed = 0  # bytes handed to the disk
        self.previous: tuple[int, int] | None = None  # the range handed before the last one

    def write(self, data) -> None:
        """Write all of `data` (bytes, memoryview or a contiguous numpy array)."""
        data = memoryview(data).cast("B")
        while data:
            n = self.raw.write(data)
            data = data[n:]
            self.written += n
            if self.written - self.handed >= self.WRITEBACK_BYTES:
                self._hand_to_disk()

    def write_head(self, data) -> None:
        """Overwrite the file's first `len(data)` bytes (a header whose room was written first), once everything
        else is written."""
        os.pwrite(self.raw.fileno(), data, 0)

    def _hand_to_disk(self):
        if _SYNC_FILE_RANGE is not None:  # ctypes releases the GIL during the call
            fd, span = self.raw.fileno(), (self.handed, self.written - self.handed)
            _SYNC_FILE_RANGE(fd, *span, _SYNC_WRITE)
            if self.previous is not None:
                _SYNC_FILE_RANGE(fd, *self.previous, _SYNC_WAIT_BEFORE | _SYNC_WRITE | _SYNC_WAIT_AFTER)
            self.previous = span
        self.handed = self.written


# Filesystems whose files are page-cache pages themselves (Linux statfs f_type): O_DIRECT there keeps nothing out
# of the cache and only adds DirectFile's copy into its buffers. Not a speed-up as measured: one stream into
# /dev/shm on two H200 hosts, 3.3-3.4 GB/s buffered against 2.9-3.0 through DirectFile on one, 2.3 against 2.6
# on the other (bench/disk_check.py); a capture into RAM the same either way.
IN_MEMORY_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}


def in_memory_filesystem(path: Path) -> bool:
    """Whether `path` (an existing file or directory) is on tmpfs or ramfs; False where statfs cannot say."""
    buf = ctypes.create_string_buffer(256)  # struct statfs; its first field is f_type, a C long on 64-bit Linux
    if _STATFS is None or _STATFS(os.fsencode(path), buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value in IN_MEMORY_FILESYSTEMS


def tmpfs_huge_pages(path: Path) -> tuple[str, str] | None:
    """(mount point, its `huge=` option: "never" where none is given) of the tmpfs holding `path` (or the nearest
    folder of it that exists), or None where it is not on tmpfs. Without huge pages the kernel writes a tmpfs file
    a 4 KiB page at a time: a shard's stream ran 2 x faster into tmpfs mounted with `huge=within_size` (through
    the shard writer on the 2-core CI machine, bench/huge_tmpfs_check.py)."""
    import psutil

    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    path = path.resolve()
    holding = [mount for mount in psutil.disk_partitions(all=True)
               if path == Path(mount.mountpoint) or Path(mount.mountpoint) in path.parents]
    if not holding:
        return None
    mount = max(reversed(holding), key=lambda m: len(m.mountpoint))  # the innermost; of equals, the last mounted
    if mount.fstype != "tmpfs":
        return None
    huge = [option.split("=", 1)[1] for option in mount.opts.split(",") if option.startswith("huge=")]
    return mount.mountpoint, huge[-1] if huge else "never"


def growing_file_huge() -> str:
    """The tmpfs `huge=` option that gives a file written from start to end huge pages on this kernel:
    `within_size` counts a write's end from Linux 6.14 on (tmpfs's large folios), only the file's size before."""
    release = tuple(int(part) for part in re.findall(r"\d+", platform.release())[:2])
    return "within_size" if release >= (6, 14) else "always"


def without_huge_pages(mount_point: str) -> str:
    """What a user can do about shards going into a tmpfs mounted without huge pages, and why."""
    return (f"the kernel writes each shard a 4 KiB page at a time; with huge pages a shard's writes took 1.6-1.8 x "
            f"less time, and the capture into RAM at the DeepSeek-V3 width went from 0.87-0.91 to 0.93 x plain prefill "
            f"(bench/RESULTS.md, 2026-12-05): `mount -o remount,huge={growing_file_huge()} {mount_point}`, as root")


class DirectFile:
    """A file written past the page cache (O_DIRECT), for shards on a disk: data is copied into two page-aligned
    buffers, one filling while a helper thread writes the other to the disk; `finish` writes the last, partial
    block padded and truncates the file to its length.

    One stream writes faster this way (bench/disk_check.py: 1.83-2.13 against 0.92-1.72 GB/s buffered and
    streamed on the H200 machine's disk, 2.6-3.0 against 0.4 GB/s on a 2-core CI machine), and shards, written
    once and read later, do not fill the page cache. Copies into the buffers go through numpy, which releases the
    GIL for them.
    """

    ALIGN = 4096  # the largest logical block size O_DIRECT asks of offsets, lengths and addresses
    CHUNK = 32 << 20

    def __init__(self, fd: int):
        self.fd = fd
        self.buffers = [np.frombuffer(mmap.mmap(-1, self.CHUNK), np.uint8) for _ in range(2)]  # page-aligned
        self.pending = [None, None]  # the helper's write of each buffer, until it is done
        self.current, self.fill, self.written = 0, 0, 0
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="direct-io")

    @classmethod
    def open(cls, path: Path) -> "DirectFile | None":
        """None where the filesystem refuses O_DIRECT."""
        try:
            return cls(os.open(path, os.O_WRONLY | os.O_DIRECT))
        except (OSError, AttributeError):  # EINVAL on filesystems without it; no os.O_DIRECT off Linux
            return None

    def write(self, data) -> None:
        """Write all of `data` (bytes, memoryview or a contiguous numpy array)."""
        src = np.frombuffer(data, np.uint8)
        while src.size:
            n = min(src.size, self.CHUNK - self.fill)
            self.buffers[self.current][self.fill:self.fill + n] = src[:n]
            self.fill, self.written, src = self.fill + n, self.written + n, src[n:]
            if self.fill == self.CHUNK:
                self._hand_over(self.CHUNK)

    def _hand_over(self, length: int) -> None:
        """Queue the current buffer's first `length` bytes for the disk and switch to the other buffer."""
        self.pending[self.current] = self._io.submit(self._write_all, self.buffers[self.current][:length])
        self.current, self.fill = 1 - self.current, 0
        if self.pending[self.current] is not None:
            self.pending[self.current].result()  # that buffer's last write is done before it is refilled
            self.pending[self.current] = None

    def _write_all(self, view) -> None:
        view = memoryview(view)
        while view:
            view = view[os.write(self.fd, view):]

    def finish(self) -> None:
        """Write what is left (the last block padded), wait for every write, truncate the padding away."""
        if self.fill:
            self._hand_over(-(-self.fill // self.ALIGN) * self.ALIGN)
        for future in self.pending:
            if future is not None:
                future.result()  # raises the helper's write error
        os.ftruncate(self.fd, self.written)

    def write_head(self, data) -> None:
        """Overwrite the file's first `len(data)` bytes, a multiple of ALIGN (a header whose room was written
        first), once everything else is written: what is left goes out first."""
        if len(data) % self.ALIGN:
            raise ValueError(f"a head of {len(data)} bytes: O_DIRECT writes whole blocks of {self.ALIGN}")
        self.finish()
        head = np.frombuffer(mmap.mmap(-1, len(data)), np.uint8)  # page-aligned
        head[:] = np.frombuffer(data, np.uint8)
        view = memoryview(head)
        while view:
            view = view[os.pwrite(self.fd, view, len(data) - len(view)):]

    def close(self) -> None:
        """After `finish`, or instead of it when the file is given up: no write is left running."""
        self._io.shutdown(wait=True)
        os.close(self.fd)


def unnamed_file(directory: str) -> int | None:
    """A new file with no name in `directory` (O_TMPFILE), opened for reading and writing: nothing of it is left
    once it is closed or its process ends, however that ends. None where the filesystem cannot make one (NFS, some
    FUSE filesystems)."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError as exc:
        # EISDIR: a kernel older than O_TMPFILE took it for O_DIRECTORY
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            return None
        raise


@contextlib.contextmanager
def atomic_file(path: Path, durable: bool = True, direct: bool = False) -> Iterator[StreamingFile | DirectFile]:
    """A file at a temp name in the same directory, written through `StreamingFile` (or `DirectFile` with
    `direct`, where the filesystem takes O_DIRECT and is not in memory); on success it is fsynced and renamed to
    `path`, on failure removed: a crash never leaves a partial file under the final name. `durable=False` skips the
    fsync, for small files that a caller makes durable later with `fsync_path` (an fsync waits for the filesystem
    journal, which can wait for gigabytes of other files' writes in flight). Once a stop on a signal has begun
(`stopping`), no file is renamed into place any more."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = stopping.temp_file(str(path.parent), prefix=f".{path.name}.", suffix=".tmp")  # removed by a stop
    os.fchmod(fd, 0o666 & ~current_umask())  # made 0600, as mkstemp; a trainer's account must read the dataset
    try:
        with os.fdopen(fd, "wb", buffering=0) as raw:
            out = (DirectFile.open(tmp) if direct and not in_memory_filesystem(tmp) else None) or StreamingFile(raw)
            try:
                yield out
                if isinstance(out, DirectFile):
                    out.finish()
            finally:
                if isinstance(out, DirectFile):
                    out.close()
            if durable:
                os.fsync(raw.fileno())
        with stopping.committing():
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        stopping.untrack_temp(tmp)


@contextlib.contextmanager
def staged_directory(path: Path) -> Iterator[Path]:
    """A directory built at a temp name beside `path` (`.NAME.staging-PID`) and moved into place by
    `replace_directory`, or removed if the block fails: a failed or refused step leaves `path` as it was, and no
    half-made or empty directory. Stagings left by a killed process are removed first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.staging-*"):
        if not _process_alive(int(stale.name.rsplit("staging-", 1)[1].split("-")[0] or 0)):
            shutil.rmtree(stale, ignore_errors=True)
    staging = path.parent / f".{path.name}.staging-{os.getpid()}"
    staging.mkdir()
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


def replace_directory(staging: Path, path: Path) -> None:
    """Put a staged directory at `path` (the old one, if any, renamed away first, then removed): a crash between
    the two renames leaves no `path`, which every reader takes for "not made yet"."""
    path = Path(path)
    old = path.parent / f".{path.name}.staging-{os.getpid()}-old"
    with stopping.committing():
        if path.exists():
            os.replace(path, old)
        os.replace(staging, path)
    shutil.rmtree(old, ignore_errors=True)


def current_umask() -> int:
    """The process's umask, read without changing it (`os.umask` sets it, racing other threads' file creation)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    raise OSError("/proc/self/status has no Umask line (Linux 4.7 or later is needed)")


def atomic_write_bytes(path: Path, data: bytes | memoryview, durable: bool = True) -> None:
    with atomic_file(path, durable) as f:
        f.write(data)


def json_bytes(obj) -> bytes:
    """The project's JSON files as bytes: indented, keys sorted (the same object gives the same bytes)."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def atomic_write_json(path: Path, obj, durable: bool = True) -> None:
    atomic_write_bytes(path, json_bytes(obj), durable)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class NotARegularFile(OSError):
    """A FIFO, a device, a socket or a directory where a file is read: refused, never opened for reading (a FIFO
    would block the reader forever, a device would never end)."""


def open_regular(path: Path):
    """`path` opened for reading in binary, refused unless it is a regular file (a link to one is fine). Opened
    without blocking, so that a FIFO is refused at once instead of waiting for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except IsADirectoryError:
        raise NotARegularFile(errno.EISDIR, "a directory, not a file; refused", str(path)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotARegularFile(errno.EINVAL, "not a regular file (a FIFO, device or socket); refused", str(path))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def check_regular(path: Path) -> Path:
    """`path`, if it is a regular file (see `open_regular`); for readers that open the path themselves."""
    open_regular(path).close()
    return Path(path)


def read_regular(path: Path) -> bytes:
    with open_regular(path) as f:
        return f.read()


def sha256_file(path: Path, block: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


# A shard file's digest, as receipts, the index and the manifest record it: {"blake3": hex}. BLAKE3 rather than
# sha256 since 2026-12-02: a writer thread hashes a shard at 3.5 x sha256's rate (5.1 against 1.46 GB/s here) and
# a reader hashes one file on every core; each shard's whole-file sha256 was the capture's largest host cost.
# Records made before say {"sha256": hex} and are checked as such: a finished shard stays finished.
SHARD_DIGEST = "blake3"
SHARD_DIGESTS = (SHARD_DIGEST, "sha256")


def shard_hasher():
    """The incremental hasher a shard writer feeds its stream to (`update`, `hexdigest`), on every core: a run's
    last shards are hashed while the other writers are done. Into a huge-page tmpfs on the H200 (DeepSeek-V3 width,
    uncompressed) the last sample reached its writer 0.17-0.19 s after the last forward pass against 0.24 s with a
    thread per writer, and the capture ran at 0.946 x plain prefill against 0.927, the forward passes as fast
    (bench/RESULTS.md, 2026-12-05, seventeenth)."""
    import blake3

    return blake3.blake3(max_threads=blake3.blake3.AUTO)


def file_digest(path: Path, algorithm: str = SHARD_DIGEST, block: int = 64 << 20) -> str:
    """A file's digest, read through `open_regular`; BLAKE3 hashes each block on every core."""
    if algorithm == "sha256":
        return sha256_file(path)
    import blake3

    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with open_regular(path) as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def recorded_digest(record: dict) -> tuple[str, str]:
    """(algorithm, hex) of a receipt's or a manifest shard entry's digest."""
    for algorithm in SHARD_DIGESTS:
        if isinstance(record.get(algorithm), str):
            return algorithm, record[algorithm]
    raise KeyError(f"no digest ({' or '.join(SHARD_DIGESTS)}) in {sorted(record)}")


def digest_matches(path: Path, record: dict) -> bool:
    """Whether the file at `path` still has the digest `record` (a receipt, a manifest shard entry) holds."""
    algorithm, expected = recorded_digest(record)
    return file_digest(path, algorithm) == expected


def hash_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def hash_files(paths: list[Path], root: Path | None = None) -> str:
    """One hash of several files' names (relative to `root`, else bare) and bytes; missing files are skipped."""
    h = hashlib.sha256()
    named = sorted((str(Path(p).relative_to(root)) if root else Path(p).name, Path(p)) for p in paths)
    for name, p in named:
        if p.exists():
            h.update(name.encode())
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()
