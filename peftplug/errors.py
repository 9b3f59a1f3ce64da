"""User-facing errors of the trainer, data modules and CLI.

Every error a user can cause by a wrong setting, file or piece of data derives from :class:`PeftplugError`. The
Python API raises them; the command-line programs print them as one line (``peftplug: error: ...``, exit status 2)
through one error boundary, :func:`run_command`. Programming errors are never wrapped: they keep their traceback.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence


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


DEBUG_FLAG = "--debug"
DEBUG_ENV = "PEFTPLUG_DEBUG"


def user_error_types() -> tuple[type[BaseException], ...]:
    """The exception types a command prints as one line: :class:`PeftplugError` and the registry's
    ``UnregisteredAdapterError`` (an adapter of a plugin type whose package is not installed).

    The registry is only consulted when it has been imported: if it was not, nothing can have raised its error,
    and this module stays a leaf that imports nothing of the project.
    """
    registry = sys.modules.get("peftplug.registry")
    extra = getattr(registry, "UnregisteredAdapterError", None)
    return (PeftplugError,) if extra is None else (PeftplugError, extra)


def debug_requested(argv: Sequence[str]) -> tuple[list[str], bool]:
    """Removes ``--debug`` from the arguments; returns them and whether tracebacks were asked for.

    Args:
        argv: Command-line arguments. ``--debug`` may stand anywhere before a ``--`` separator;
            ``PEFTPLUG_DEBUG=1`` in the environment asks for tracebacks too.
    """
    argv = list(argv)
    end = argv.index("--") if "--" in argv else len(argv)
    debug = DEBUG_FLAG in argv[:end]
    if debug:
        argv = [a for a in argv[:end] if a != DEBUG_FLAG] + argv[end:]
    return argv, debug or os.environ.get(DEBUG_ENV, "").strip() not in ("", "0", "false", "False")


def _lightning_setting(err: ValueError) -> str | None:
    """The Trainer setting a ``ValueError`` raised inside Lightning's loops is about (its message opens with it in
    backquotes, as Lightning writes them), else ``None``.

    Args:
        err: The exception that ended the command.
    """
    found = re.match(r"\s*`(\w+)`", str(err))
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename if tb is not None else ""
    return found.group(1) if found and f"{os.sep}lightning{os.sep}pytorch{os.sep}" in where else None


def _peer_failed(err: BaseException) -> bool:
    """Whether ``err`` says another process of an initialized multi-process group went away.

    Args:
        err: The exception that ended the command.
    """
    text = str(err)
    # gloo says "closed by peer ... remote worker crashing" or "reset by peer ... remote worker hanging", by timing.
    if not any(mark in text for mark in ("by peer", "remote worker", "NCCL communicator was aborted")):
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def run_command(prog: str, command: Callable[[list[str]], int | None], argv: Sequence[str]) -> int:
    """The error boundary of a command-line program: runs ``command(argv)`` and turns user errors into one line.

    A user error (see :func:`user_error_types`) prints ``<prog>: error: <one line>`` on stderr and returns 2; with
    ``--debug`` or ``PEFTPLUG_DEBUG=1`` its traceback is printed first. Any other exception propagates with its
    traceback: it is a bug. ``SystemExit`` (``--help``, argparse usage errors) passes through. Output into a pipe
    whose reader has gone (``| head``) ends the program quietly with status 141.

    Args:
        prog: Program name shown before ``error:``, e.g. ``"peftplug"``.
        command: Runs the program on the arguments (``--debug`` removed); returns the exit status.
        argv: Command-line arguments without the program name.

    Returns:
        The exit status: what ``command`` returned (``None`` counts as 0), or 2 for a user error.
    """
    argv, debug = debug_requested(argv)
    try:
        return int(command(argv) or 0)
    except user_error_types() as err:
        if debug:
            traceback.print_exception(err, file=sys.stderr)
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr, flush=True)
        return 2
    except ValueError as err:
        name = None if debug else _lightning_setting(err)
        if name is None:
            raise
        # Lightning's check of a Trainer setting against the data (`val_check_interval` (100) must be less than or
        # equal to the number of the training batches (3)...): its message is the whole answer, its traceback noise.
        print(f"{prog}: error: trainer.{name}: {one_line(err)}", file=sys.stderr, flush=True)
        return 2
    except RuntimeError as err:  # (torch's DistBackendError is one)
        if debug or not _peer_failed(err):
            raise
        # Another process of a multi-process run failed and printed its own error; this one's ~100 lines of
        # "Connection closed by peer" tracebacks buried it.
        print(f"{prog}: error: another process of this run failed (its error is printed above); this process "
              f"stopped with it ({one_line(err, 120)})", file=sys.stderr, flush=True)
        return 1
    except BrokenPipeError:
        # The reader of our output left (`peftplug fit --help | head`): stop quietly, as `cat` would. Pointing
        # stdout at /dev/null spares the interpreter's last flush the same error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a process its pipe's reader closed
