"""User-facing errors of the trainer, data modules and CLI.

Every error a user can cause by a wrong setting derives from :class:`PeftplugError`; the CLI prints such errors
as one line (``peftplug: error: ...``) instead of a traceback. Programming errors are never wrapped.
"""

from __future__ import annotations


class PeftplugError(Exception):
    """Base of the errors caused by user input (settings, paths, data)."""


class ConfigError(PeftplugError, ValueError):
    """A setting has an invalid value; the message names the field and what it accepts."""


class MissingFileError(PeftplugError, FileNotFoundError):
    """A file or model the settings point at does not exist."""


class DataError(PeftplugError, ValueError):
    """The data does not fit the settings (a missing column, an unknown label, an empty split, a malformed row)."""


class CheckpointError(PeftplugError, ValueError):
    """A checkpoint or adapter folder is not what was expected; the message names the file and what was expected."""


def one_line(message: str, limit: int = 400) -> str:
    """Collapses a (possibly multi-line) message into one line of at most ``limit`` characters.

    Args:
        message: Any message, e.g. ``str(exc)`` of a library error.
        limit: Maximum length; longer messages are cut and end with an ellipsis.
    """
    text = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
    return text if len(text) <= limit else text[: limit - 1] + "…"
