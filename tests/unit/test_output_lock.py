"""One run per dataset directory: a second one is refused at once, naming the holder; a dead holder's lock is
taken over (real processes)."""

import signal
import subprocess
import sys
import time

import pytest

from eagle_states.dataset.output_lock import OutputBusy, lock_paths, output_lock

HOLD = """
import sys, time
from pathlib import Path
from eagle_states.dataset.output_lock import output_lock
with output_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_second_holder_is_refused_and_a_dead_ones_lock_is_taken_over(tmp_path):
    out = tmp_path / "dataset"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with pytest.raises(OutputBusy, match=rf"being written by another run \(pid {holder.pid} on .* since "):
            with output_lock(out):
                pass
        assert time.monotonic() - started < 5, "refused at once, not after a wait (the lock's own wait is unbounded)"
    finally:
        holder.send_signal(signal.SIGKILL)  # dies without unlocking or removing its note
        holder.wait()
    with output_lock(out):  # the kernel released the dead process's lock
        with output_lock(out):  # re-entrant within one process (the flow and the stages it calls)
            pass
        assert lock_paths(out)[1].exists()
    assert not lock_paths(out)[1].exists(), "the note goes with the lock"
    assert not out.exists(), "the lock lives beside the dataset, not in it"
