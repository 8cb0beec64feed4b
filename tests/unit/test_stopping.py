"""A stop on a signal while a writer thread goes on: no temp file outlives the process. CI once found one, made
by a writer thread that got its shard's first sample after the handler had removed the tracked temp files."""

import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import os, signal, sys, threading, time
    from pathlib import Path
    from eagle_states import stopping
    from eagle_states.dataset.files import atomic_file

    out = Path(sys.argv[1])
    stopping.install()
    committed, sample = threading.Event(), threading.Event()

    def write_shards():  # a writer thread: a file committed, then one opened once its first sample comes
        with atomic_file(out / "first") as f:
            f.write(b"x")
        committed.set()
        sample.wait()
        with atomic_file(out / "second") as f:
            f.write(b"x")

    threading.Thread(target=write_shards, daemon=True).start()
    committed.wait()
    # the sample comes while the stop tells a server how the run ended (which takes a while)
    with stopping.on_stop(callback=lambda signum: (sample.set(), time.sleep(0.5))):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)
""")


def test_no_temp_file_is_made_once_a_stop_has_begun(tmp_path):
    run = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 130, run.stderr
    assert "stopped by SIGINT." in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first"]
