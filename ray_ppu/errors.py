"""The errors a user can fix, and the way they are brought back from Ray tasks.

Every problem with the user's input (config, cluster, corpus, checkpoint, preprocessing input,
migration script) is a :class:`UserError`: the entry points catch that one class and print its
message as one ``error:`` line (exit status 2) instead of a traceback. Each subclass keeps the
builtin base it always had (``ValueError`` / ``RuntimeError``), so callers that catch those still
do. This module imports nothing of ours, so any module can raise these without an import cycle.

An exception raised in a Ray task or actor reaches the caller as a ``RayTaskError`` (also an
instance of the cause's class) whose text is the whole remote traceback, often wrapped again
by Ray Data. What the user must fix is the innermost error of ours, with its own message.
"""

from __future__ import annotations

import re
from typing import Optional

class UserError(Exception):
    """A problem the user fixes (input, config, cluster); its message says what and where."""


class ConfigError(UserError, ValueError):
    """A configuration problem found before any worker starts."""


class ClusterError(UserError, RuntimeError):
    """The cluster cannot run the requested job (found before any worker is placed)."""


class CorpusError(UserError, ValueError):
    """One or more idxmap corpora are unusable; the message has one line per problem."""


class BlendError(UserError, ValueError):
    """``data_path`` is neither prefixes nor Megatron's ``[weight, prefix, ...]`` blend."""


class CrashLoop(UserError, RuntimeError):
    """The run stopped restarting: its last restarts made no progress (the same failure, or
    none reaching an iteration: ``ray_ppu.monitor.restarts.crash_loop``)."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used the way the run asks (found before or while loading)."""


class TransformerEngineMissing(UserError, RuntimeError):
    """The config asks for options only Transformer Engine provides, and it is not here."""


class MigrationError(UserError, ValueError):
    """The launch cannot be migrated; the message names the script argument at fault."""


class PreprocessError(UserError, ValueError):
    """Bad preprocessing input: no such file, a malformed file, or a record ``--strict`` rejects."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        # Ray appends its retry advice to args when the error crosses from a worker; keep ours.
        self.message = message

    def __str__(self) -> str:
        return self.message


# Ray Data appends retry advice to a read error's message: not the user's.
_RETRY_ADVICE = re.compile(r"\nFailed to .* after \d+/\d+ attempts.*", re.S)


def remote_cause(err: BaseException, kinds: tuple = (ValueError,)) -> Optional[BaseException]:
    """The first exception of ``kinds`` inside ``err``'s Ray wrappers (``RayTaskError.cause``
    first, then the chained ``__cause__`` / ``__context__``), re-made with its own message
    alone; None when ``err`` is not from Ray or holds none."""
    from ray.exceptions import RayError

    if not (isinstance(err, RayError) or type(err).__module__.startswith("ray.")):
        return None
    todo, seen = [err], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, kinds) and not isinstance(e, RayError):
            message = getattr(e, "message", None) or (str(e.args[0]) if e.args else str(e))
            return type(e)(_RETRY_ADVICE.sub("", message))
        todo += [e.__context__, e.__cause__, getattr(e, "cause", None)]  # .cause looked at first
    return None


def report_before_group(err: BaseException, wait_s: float = 30.0) -> int:
    """Print the ``error:`` line of a problem found before the process group; returns exit
    status 2.

    Under torchrun every rank finds the same problem (same arguments, same files): the node's
    first process (LOCAL_RANK 0) prints it, once. The others wait for torchrun to stop them
    after it fails (at most ``wait_s``), then exit 2 too: one that exited first would have
    torchrun stop LOCAL_RANK 0 before it printed.
    """
    import os
    import signal
    import sys
    import time

    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print(f"error: {err}", file=sys.stderr)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(2))
        time.sleep(wait_s)
    return 2


def entry_point(main) -> int:
    """Run an entry point's ``main()`` as users meet it: a :class:`UserError` that escapes it
    becomes one ``error:`` line and exit status 2, and output piped into a reader that went
    away (``| head``) ends quietly with 141, the status of a process killed by SIGPIPE, as
    ``cat`` and ``grep`` end, instead of a BrokenPipeError traceback."""
    import os
    import sys

    try:
        status = main()
        sys.stdout.flush()  # a closed pipe found here, not in the interpreter's exit
        return status
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush is silent
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
