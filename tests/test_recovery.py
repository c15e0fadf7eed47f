"""The restart record (ray_ppu.monitor.restarts), without Ray: what the controller writes on a failure,
and the row the next worker group derives from it and from metrics.jsonl; and what the
controller unpickles stays free of torch."""

import json

from ray_ppu.monitor import restarts


class WorkerHealthCheckFailedError(RuntimeError):
    """Shaped like Ray Train's: the reason the health check failed rides along."""

    def __init__(self, message, failure):
        super().__init__(message)
        self.health_check_failure = failure


def test_failures_are_kept_per_launch_and_name_their_cause(tmp_path):
    died = WorkerHealthCheckFailedError("A worker health check failed.",
                                        ConnectionError("The actor died unexpectedly\nmore"))
    restarts.record_failure(tmp_path, "launch-a", {3: died, 1: ValueError("bad batch")})
    restarts.record_failure(tmp_path, "launch-b", {0: died})
    (tmp_path / restarts.FAILURES_FILE).open("a").write('{"token": "launch-a", "cut')  # a crash
    mine = restarts.failures(tmp_path, "launch-a")
    assert len(mine) == 1 and mine[0].ranks == (1, 3)
    assert mine[0].cause == "rank 1: ValueError: bad batch"  # the lowest failed rank
    other = restarts.failures(tmp_path, "launch-b")[0]
    assert other.cause == ("rank 0: WorkerHealthCheckFailedError: A worker health check failed. "
                           "(ConnectionError: The actor died unexpectedly)")
    assert restarts.failures(tmp_path, "launch-c") == []


def test_restart_row_counts_lost_iterations_and_recovery_time(tmp_path):
    failure = restarts.Failure(token="t", detected_at=100.0, cause="rank 1: X", ranks=(1,))
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"iteration": i, "lm_loss": 1.0, "time": 90.0 + i} for i in range(1, 8)]  # 91..97
    rows.append({"iteration": 4, "valid_lm_loss": 1.0, "time": 99.0})  # not a training row
    rows.append({"iteration": 5, "lm_loss": 1.0, "time": 130.0})  # the restarted group's
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    row = restarts.restart_row([failure, failure], 4, "iter_0000004", metrics, 112.5,
                               restored_from="disk")
    assert row == {"event": "restart", "iteration": 4, "restarts": 2, "cause": "rank 1: X",
                   "failed_ranks": [1], "resumed_from": "iter_0000004",
                   "restored_from": "disk", "iterations_lost": 7 - 4, "recovery_s": 12.5}
    assert restarts.restart_line(row) == (
        "restart 2 after rank 1: X: resumed at iteration 4 from iter_0000004, 3 iteration(s) "
        "lost, first iteration done 12.5 s after the failure was detected")
    # nothing logged past the checkpoint: nothing lost
    assert restarts.restart_row([failure], 7, None, metrics, 101.0)["iterations_lost"] == 0


def test_a_declared_hang_is_the_cause_of_the_failure_that_follows(tmp_path):
    """The driver's watchdog writes the hang's cause; the controller's record of the stalled
    workers' deaths takes it (once), so the restart row says why the group was failed."""
    restarts.record_hang(tmp_path, "t", "hang: no iteration completed for 12 s; rank 1 …")
    first = restarts.record_failure(tmp_path, "t", {1: RuntimeError("actor died")})
    second = restarts.record_failure(tmp_path, "t", {0: RuntimeError("actor died")})
    assert first.cause.startswith("hang: no iteration completed for 12 s")
    assert second.cause == "rank 0: RuntimeError: actor died"


def _failure(reached, cause="rank 1: RuntimeError: boom", user_error=None):
    return restarts.Failure(token="t", detected_at=1.0, cause=cause, ranks=(1,),
                            reached=reached, user_error=user_error)


def test_restarts_that_make_progress_go_on():
    assert restarts.crash_loop([]) is None
    assert restarts.crash_loop([_failure(None), _failure(None)]) is None  # only 2 so far
    # the same cause, but each group got further: a flaky node, not a loop
    assert restarts.crash_loop([_failure(4), _failure(9), _failure(14)]) is None
    # the same iteration, other causes: not the same failure
    assert restarts.crash_loop([_failure(4, "rank 0: ActorDiedError: x"), _failure(4),
                                _failure(4)]) is None
    assert restarts.crash_loop([_failure(None), _failure(3), _failure(None)]) is None


def test_a_crash_loop_stops_the_run_naming_the_cause_and_the_iteration():
    loop = restarts.crash_loop([_failure(2), _failure(None), _failure(None), _failure(None)])
    assert loop.startswith("the run stopped restarting: 3 worker groups in a row failed before "
                           "completing an iteration (restarts 2-4); the last: rank 1: "
                           "RuntimeError: boom. Fix the cause"), loop
    # numbers aside (an allocation size, a pid), the same failure in iteration 8, 3 times
    same = [_failure(7, f"rank 1: OutOfMemoryError: tried to allocate {n} MiB") for n in (20, 21, 22)]
    loop = restarts.crash_loop(same)
    assert ("the same failure 3 times in a row in iteration 8 (restarts 1-3); the last: rank 1: "
            "OutOfMemoryError: tried to allocate 22 MiB") in loop, loop
    assert "\n" not in loop


def test_a_user_error_in_a_worker_is_not_restarted(tmp_path):
    from ray_ppu.errors import ConfigError

    failure = restarts.record_failure(tmp_path, "t", {
        0: RuntimeError("collateral: peer gone"),
        1: _wrapped(ConfigError("checkpoint.load x: no"))})
    assert failure.user_error == "checkpoint.load x: no"
    assert restarts.failures(tmp_path, "t")[0].user_error == "checkpoint.load x: no"
    assert restarts.crash_loop([failure]) == (
        "checkpoint.load x: no (not restarted: the same run fails the same way)")
    plain = restarts.record_failure(tmp_path, "t", {0: RuntimeError("actor died")})
    assert plain.user_error is None and restarts.crash_loop([plain]) is None


def _wrapped(err):
    """What a worker's exception looks like at the controller: Ray's wrapper, the cause inside."""
    from ray.exceptions import RayTaskError

    try:
        raise err
    except Exception as inner:
        return RayTaskError("train_fn", "traceback text", inner).as_instanceof_cause()


def test_the_controller_records_how_far_the_failed_group_got(tmp_path):
    from ray_ppu.launch.train_controller import FailureRecorder
    from ray_ppu.recovery.watchdog import Beacon

    recorder = FailureRecorder(tmp_path, "t")
    recorder.after_exception(None, {0: RuntimeError("early")})  # no progress files: none
    beacons = [Beacon(tmp_path, "t", rank=r, world=2, node_id="n") for r in (0, 1)]
    try:
        beacons[0].after(6)
        beacons[1].after(5)
        beacons[0].saving([])  # written at once, with the iteration the thread may not have
        beacons[1].saving([])
    finally:
        for b in beacons:
            b.close()
    recorder.after_exception(None, {1: RuntimeError("later")})
    first, second = restarts.failures(tmp_path, "t")
    assert (first.reached, second.reached) == (None, 6)


def test_what_the_controller_unpickles_imports_no_torch(tmp_path, corpus):
    """Ray Train's controller unpickles the trainer's failure recorder and backend config
    before it asks for any worker: unpickled in a fresh interpreter (as the controller does),
    they pull in neither torch nor Megatron-Core, whose imports would delay every worker
    group's start (Ray's own TorchConfig, from ray.train.torch, imports torch)."""
    import pickle
    import subprocess
    import sys

    from test_training import overrides

    from ray_ppu.config.loader import load
    from ray_ppu.launch.launcher import build_trainer
    from ray_ppu.plan import build_plan

    cfg = load(None, overrides(corpus, tmp_path / "run", "cluster.num_workers=2"))
    trainer = build_trainer(cfg, build_plan(cfg), "cpu", {}, token="launch-a")
    blob = tmp_path / "controller.pkl"
    blob.write_bytes(pickle.dumps((trainer.run_config.callbacks, trainer.backend_config)))
    code = ("import pickle, sys\n"
            f"callbacks, backend = pickle.loads(open({str(blob)!r}, 'rb').read())\n"
            "assert [c.token for c in callbacks] == ['launch-a'], callbacks\n"
            "assert (backend.backend, backend.to_dict()['init_method']) == ('gloo', 'env')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out
