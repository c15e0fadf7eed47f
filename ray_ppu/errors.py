"""Errors raised inside Ray tasks and actors, brought back as the user's own error.

An exception raised in a Ray task or actor reaches the caller as a ``RayTaskError`` (also an
instance of the cause's class) whose text is the whole remote traceback, often wrapped again
by Ray Data. What the user must fix is the innermost error of ours, with its own message.
"""

from __future__ import annotations

import re
from typing import Optional

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
