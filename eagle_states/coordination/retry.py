"""Which failures are worth a retry: I/O hiccups and engine trouble are; bad input, invalid data, a full or
read-only disk, a missing permission, a broken model file and a stop on a signal are not (a retry would only
fail again, later)."""

import errno

from eagle_states.capture.protocol import UnsupportedModelError
from eagle_states.capture.spill import SpillDirUnusable
from eagle_states.dataset.identity import ModelError
from eagle_states.dataset.output_lock import OutputBusy
from eagle_states.dataset.prepared import InputError
from eagle_states.export import ExportRefused
from eagle_states.extraction.driver import DatasetExists
from eagle_states.stopping import Stopping
from eagle_states.validate import ValidationFailed

DETERMINISTIC = (ValidationFailed, InputError, ExportRefused, UnsupportedModelError, ModelError, DatasetExists,
                 SpillDirUnusable, OutputBusy, Stopping, FileNotFoundError, IsADirectoryError, PermissionError,
                 KeyError)
# errors of the file system that stay until someone acts (room.NoRoomError is an OSError with ENOSPC)
PERMANENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EISDIR,
                    errno.ENOTDIR}


def is_permanent(error: BaseException) -> bool:
    return isinstance(error, DETERMINISTIC) or (isinstance(error, OSError) and error.errno in PERMANENT_ERRNOS)


def transient_only(task, task_run, state) -> bool:
    return not is_permanent(state.result(raise_on_failure=False))
