"""Bad input found after the flags parse, and how a script reports it: one line naming the culprit, no traceback.

Flags and recipes fail with `utils.core.config.ConfigError` while they parse. What is found later (a data row, a prompt
over its length, a model path that does not load) raises an `InputError` whose message names the file, row,
column, sample or flag; a script's `__main__` runs under `exit_on_bad_input`, which ends the run with that line.
"""

import contextlib
import sys

from utils.core.config import ConfigError


class InputError(ValueError):
    """Bad input data, prompt or model path; the message names the culprit."""


@contextlib.contextmanager
def exit_on_bad_input(prog: str):
    """For a script's `__main__`: an InputError ends the run with `prog: error: <message>` instead of a
    traceback (exit status 1); any other exception keeps its traceback."""
    try:
        yield
    except InputError as exc:
        sys.stderr.flush()
        raise ConfigError(f"{prog}: error: {exc}") from None


class DataValidationError(InputError):
    """Bad input data; the message names the file, the row and the column at fault."""


class ImageTokenError(InputError):
    """A prompt whose image tokens do not match its images: cut (a length limit fell inside an image) or repeated
    without its pixels. Raised before any forward, never dropped silently."""
