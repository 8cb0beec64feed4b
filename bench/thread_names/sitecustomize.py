# For the thread samplers (bench/thread_waits.py) only: gives each Python thread its name in the kernel
# (/proc/.../comm, 15 characters), which Python 3.12 does not, so that threads can be told apart by group.
import ctypes
import threading

_libc = ctypes.CDLL(None)
_start = threading.Thread._bootstrap_inner


def _named(self):
    try:
        _libc.prctl(15, self.name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass
    _start(self)


threading.Thread._bootstrap_inner = _named
