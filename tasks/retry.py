"""Which failures are worth a retry: I/O and engine trouble are; bad input and invalid data are not."""

from eagle_states.capture.protocol import UnsupportedModelError
from eagle_states.dataset.prepared import InputError
from eagle_states.export import ExportRefused
from eagle_states.validate import ValidationFailed

DETERMINISTIC = (ValidationFailed, InputError, ExportRefused, UnsupportedModelError, FileNotFoundError, KeyError)


def transient_only(task, task_run, state) -> bool:
    error = state.result(raise_on_failure=False)
    return not isinstance(error, DETERMINISTIC)
