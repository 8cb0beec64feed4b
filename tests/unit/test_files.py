"""Files as the dataset writes them: every byte written, across the streaming and O_DIRECT paths, and nothing
left behind by a failed write."""

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from eagle_states.dataset.files import (DirectFile, StreamingFile, atomic_file, atomic_write_bytes,
                                        in_memory_filesystem, tmpfs_huge_pages)

ON_A_DISK = pytest.mark.skipif(in_memory_filesystem(tempfile.gettempdir()),
                               reason="the temp directory is in memory, where shards are not written with O_DIRECT")


def test_free_disk_blocks_keeps_the_size_and_gives_the_blocks_back(tmp_path):
    from eagle_states.bench import free_disk_blocks

    path = tmp_path / "shard.bin"
    atomic_write_bytes(path, os.urandom(8 << 20))
    assert path.stat().st_blocks * 512 >= 8 << 20
    free_disk_blocks(path)
    assert path.stat().st_size == 8 << 20 and path.stat().st_blocks * 512 < 1 << 20
    assert path.read_bytes() == bytes(8 << 20)  # a hole reads as zeros


def test_the_disks_count_of_bytes_written_grows_by_a_fsynced_files_size(tmp_path):
    """The bench says what the disk took while a capture ran (its shards, and spill files the kernel wrote back
    before they were removed): the kernel's count for the block device under a path; none in memory."""
    from eagle_states.bench import disk_bytes_written

    before = disk_bytes_written(tmp_path)
    atomic_write_bytes(tmp_path / "f.bin", os.urandom(8 << 20))  # fsynced
    after = disk_bytes_written(tmp_path)
    if os.major(os.stat(tmp_path).st_dev) == 0:  # a tmpfs or an overlay: no device of its own
        assert before is None and after is None
    else:
        assert after - before >= 8 << 20
    if os.path.isdir("/dev/shm") and in_memory_filesystem("/dev/shm"):
        assert disk_bytes_written(Path("/dev/shm")) is None


def test_streaming_file_writes_every_byte(tmp_path, monkeypatch):
    monkeypatch.setattr(StreamingFile, "WRITEBACK_BYTES", 4096)  # hand ranges to the disk often
    pieces = [os.urandom(n) for n in (1, 4095, 4097, 10_000, 65_536, 3)]
    pieces.append(torch.arange(5000, dtype=torch.int32).view(torch.uint8).numpy())
    with atomic_file(tmp_path / "f.bin") as f:
        for piece in pieces:
            f.write(piece)
        assert f.handed > 0 and f.previous is not None
    expected = b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
    data = (tmp_path / "f.bin").read_bytes()
    assert hashlib.sha256(data).digest() == hashlib.sha256(expected).digest()
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]  # no temp file left


def test_a_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_file(tmp_path / "f.bin") as f:
            f.write(b"x" * 100)
            raise RuntimeError("writer died")
    assert list(tmp_path.iterdir()) == []


@ON_A_DISK
def test_direct_file_writes_every_byte_across_buffers_and_an_unaligned_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(DirectFile, "CHUNK", 2 * DirectFile.ALIGN)  # switch buffers often
    pieces = [os.urandom(n) for n in (1, 4095, 4097, 10_000, 65_536, 8192, 3)]
    pieces.append(torch.arange(5000, dtype=torch.int32).view(torch.uint8).numpy())
    with atomic_file(tmp_path / "f.bin", direct=True) as f:
        assert isinstance(f, DirectFile), "this filesystem refused O_DIRECT"
        for piece in pieces:
            f.write(piece)
    expected = b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
    assert (tmp_path / "f.bin").read_bytes() == expected
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


@ON_A_DISK
@pytest.mark.parametrize("direct", [True, False])
def test_a_head_is_written_over_its_room_once_the_rest_is_written(tmp_path, monkeypatch, direct):
    monkeypatch.setattr(DirectFile, "CHUNK", 2 * DirectFile.ALIGN)
    body = os.urandom(3 * DirectFile.ALIGN + 123)
    with atomic_file(tmp_path / "f.bin", direct=direct) as f:
        assert isinstance(f, DirectFile) == direct
        f.write(bytes(2 * DirectFile.ALIGN))  # the room
        f.write(body)
        f.write_head(b"h" * (2 * DirectFile.ALIGN))
        if direct:
            with pytest.raises(ValueError, match="whole blocks of 4096"):
                f.write_head(b"h" * 100)
    assert (tmp_path / "f.bin").read_bytes() == b"h" * (2 * DirectFile.ALIGN) + body


@ON_A_DISK
def test_a_failed_direct_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_file(tmp_path / "f.bin", direct=True) as f:
            f.write(os.urandom(DirectFile.CHUNK + 100))  # one buffer on its way to the disk
            raise RuntimeError("writer died")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_files_get_the_users_umask(tmp_path, umask, mode):
    before = os.umask(umask)
    try:
        atomic_write_bytes(tmp_path / "a.bin", b"x" * 10)
        with atomic_file(tmp_path / "b.bin", direct=True) as f:
            f.write(b"y" * 5000)
    finally:
        os.umask(before)
    assert [(tmp_path / name).stat().st_mode & 0o777 for name in ("a.bin", "b.bin")] == [mode, mode]


def test_a_shard_record_is_checked_by_the_digest_it_names(tmp_path):
    """BLAKE3 since 2026-12-02; a receipt or manifest entry made before names sha256 and is checked by it, so a
    finished shard stays finished across the change. A record without a digest is refused."""
    from eagle_states.dataset.files import digest_matches, file_digest, recorded_digest, sha256_file
    from eagle_states.dataset.shard_file import write_shard_file

    path = tmp_path / "shard.safetensors"
    digest, _ = write_shard_file(path, {"a": torch.arange(70_000, dtype=torch.float32), "b": torch.ones(3, 5)})
    assert digest == file_digest(path) != sha256_file(path)
    assert recorded_digest({"blake3": digest, "sha256": "x"}) == ("blake3", digest)
    assert digest_matches(path, {"blake3": digest}) and digest_matches(path, {"sha256": sha256_file(path)})
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"\x01")
    assert not digest_matches(path, {"blake3": digest})
    with pytest.raises(KeyError, match="no digest"):
        recorded_digest({"bytes": 10})


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not in_memory_filesystem("/dev/shm"), reason="no tmpfs here")
def test_a_file_in_memory_is_written_buffered_even_where_o_direct_is_asked_for():
    """tmpfs takes O_DIRECT on recent kernels, but its files are page-cache pages: DirectFile's copy would buy
    nothing there."""
    directory = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        with atomic_file(directory / "f.bin", direct=True) as f:
            assert isinstance(f, StreamingFile)
            f.write(b"x" * 5000)
        assert (directory / "f.bin").read_bytes() == b"x" * 5000
    finally:
        shutil.rmtree(directory)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root: there it fails)")
def test_tmpfs_huge_pages_names_the_mount_holding_a_path_and_its_pages(tmp_path):
    """The bench says where shards into RAM went and whether the kernel writes them a 4 KiB page at a time; a
    mount point with a space in its name is written `\\040` in /proc/mounts."""
    for options, huge in (("size=1M", "never"), ("size=1M,huge=within_size", "within_size")):
        point = tmp_path / f"in {huge}"
        point.mkdir()
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True,
                                 text=True)
        assert mounted.returncode == 0, f"cannot mount a tmpfs as root: {mounted.stderr.strip()}"
        try:
            assert tmpfs_huge_pages(point / "dataset" / "shards") == (str(point), huge)  # not made yet
            assert tmpfs_huge_pages(point) == (str(point), huge)
        finally:
            subprocess.run(["umount", str(point)], check=True)
        assert tmpfs_huge_pages(point) == tmpfs_huge_pages(tmp_path)  # unmounted: whatever holds tmp_path


def test_the_huge_option_named_is_the_one_that_gives_a_growing_file_huge_pages_on_this_kernel(monkeypatch):
    import platform

    from eagle_states.dataset.files import growing_file_huge

    for release, option in (("6.18.44-fc-v1252", "within_size"), ("6.14.0", "within_size"),
                            ("6.8.0-45-generic", "always"), ("5.15.0-119-generic", "always")):
        monkeypatch.setattr(platform, "release", lambda: release)
        assert growing_file_huge() == option, release
