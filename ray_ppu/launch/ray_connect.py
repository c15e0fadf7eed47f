"""Joining the cluster in RAY_ADDRESS, or starting a local Ray, with a failure as one line.

Two ways a launch used to fail that were not the user's data or config, and did not say so:
an unreachable ``RAY_ADDRESS`` (a typo, a cluster not started) kept Ray's client retrying the
GCS for minutes, printing only its retries; and a local Ray that did not come up in time on a
loaded machine ended in Ray's raw ``Exception: The current node timed out during startup``
traceback. :func:`check_reachable` probes the address's GCS port for
``cluster.connect_timeout_s`` before Ray's client is asked to, and :func:`starting` turns a
start failure into a :class:`~ray_ppu.errors.ClusterError` that names what to do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from typing import Optional

from ray_ppu.errors import ClusterError


def gcs_endpoint(address: str) -> Optional[tuple[str, int]]:
    """``(host, port)`` of a ``host:port`` or ``ray://host:port`` address; None for the forms
    Ray resolves itself (``auto``, ``local``) and any other scheme (Ray's own error names it)."""
    address = address.strip().removeprefix("ray://")
    if "://" in address:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout_s: float) -> None:
    """Return once ``address``'s port accepts a TCP connection; ClusterError, naming the
    address and the last error, when it has not for ``timeout_s`` (a cluster still starting
    gets that long)."""
    endpoint = gcs_endpoint(address)
    if endpoint is None:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(endpoint, timeout=min(5.0, timeout_s)):
                return
        except socket.gaierror as err:  # a name that does not resolve will not start to
            raise ClusterError(f"cannot reach the Ray cluster at RAY_ADDRESS={address}: "
                               f"{endpoint[0]}: {err.strerror or err}") from None
        except OSError as err:
            last = err.strerror or str(err) or type(err).__name__
        if time.monotonic() >= deadline:
            raise ClusterError(
                f"cannot reach the Ray cluster at RAY_ADDRESS={address}: {last} for "
                f"{timeout_s:g} s (cluster.connect_timeout_s); is it running there (`ray status` "
                f"on its head node), or unset RAY_ADDRESS to start a local Ray")
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


@contextlib.contextmanager
def starting():
    """Ray's failure to start a local instance as one line (the machine's load, its
    /tmp/ray, its ports) instead of Ray's traceback."""
    try:
        yield
    except ClusterError:
        raise
    except Exception as err:  # Ray raises plain Exception, RuntimeError or ConnectionError
        logging.getLogger("ray_ppu").debug("Ray's start failure", exc_info=err)  # its traceback
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ClusterError(f"Ray could not start on this machine: {cause} (on a loaded "
                           f"machine or with /tmp/ray full, try again; or start Ray with `ray "
                           f"start --head` and set RAY_ADDRESS)") from None


# Ray's state API (list_actors, get_actor) finds "the" local cluster by scanning this
# machine's processes when no address is given: beside a second local Ray (another run, a test
# session's) it finds two and raises, in the driver and in Ray Train's placement-group cleaner,
# whose monitor thread then dies with a traceback. Ray's clients take the API server from this
# variable first; workers inherit it from the raylet, which inherits it from the driver.
API_SERVER_ENV = "RAY_API_SERVER_ADDRESS"
_pinned: list[Optional[str]] = []  # what API_SERVER_ENV was before start_local set it


def start_local(**init_args) -> None:
    """``ray.init(address="local", **init_args)`` with its dashboard (the state API's server)
    on a port chosen here, and every client of that API in this process and in the workers
    pinned to it: a run talks only to the Ray it started. A start failure is one line
    (:func:`starting`). :func:`unpin` after ``ray.shutdown()``."""
    import ray

    from ray_ppu.util.net import free_port

    # A port of the OS's choosing, not Ray's 8265: two runs starting at once both found 8265
    # free, and the second one's dashboard (given a port, Ray does not try another) failed.
    # Ray's start line names it.
    port = free_port("127.0.0.1")
    _pinned.append(os.environ.get(API_SERVER_ENV))
    os.environ[API_SERVER_ENV] = f"http://127.0.0.1:{port}"
    try:
        with starting():
            ray.init(address="local", dashboard_port=port, **init_args)
    except BaseException:
        unpin()
        raise


def unpin() -> None:
    """Put back what :func:`start_local` found in the environment."""
    if not _pinned:
        return
    previous = _pinned.pop()
    if previous is None:
        os.environ.pop(API_SERVER_ENV, None)
    else:
        os.environ[API_SERVER_ENV] = previous
