# For the thread samplers (bench/thread_waits.py) only: gives each Python thread its name in the kernel
# (/proc/.../comm, 15 characters), which Python 3.12 does not, so that threads can be told apart by group; and,
# for an A/B of how long a thread back from a write waits for the GIL, sets Python's switch interval (5 ms by
# default) from EAGLE_SWITCH_INTERVAL (seconds).
import ctypes
import os
import sys
import threading

if os.environ.get("EAGLE_SWITCH_INTERVAL"):
    sys.setswitchinterval(float(os.environ["EAGLE_SWITCH_INTERVAL"]))

_libc = ctypes.CDLL(None)
_start = threading.Thread._bootstrap_inner


def _named(self):
    try:
        _libc.prctl(15, self.name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass
    _start(self)


threading.Thread._bootstrap_inner = _named
