"""benchmark.py overhead's CPU account (ray_ppu.tools.bench.cpu_account): processes named by
their role, a rank's busiest thread counted as its training, the rest by thread name."""

import os
import threading
import time

from ray_ppu.tools.bench import cpu_account


def test_processes_are_named_by_their_role():
    assert cpu_account.role("/venv/lib/ray/core/src/ray/raylet/raylet --node=x") == "raylet"
    assert cpu_account.role("/venv/lib/ray/core/src/ray/gcs/gcs_server --x") == "gcs"
    assert cpu_account.role("python -u /venv/ray/dashboard/agent.py --x") == "dashboard and agents"
    assert cpu_account.role("ray::RayTrainWorker.run_train_fn") == "training ranks"
    assert cpu_account.role("ray::_Reader.read") == "readers"
    assert cpu_account.role("python -u /venv/ray/_private/log_helper.py x") == "other: log_helper.py"
    assert cpu_account.role("ray::TrainController.run") == "ray train controller and helpers"
    assert cpu_account.role("python -m torch.distributed.run --nproc-per-node 2 "
                            "entrypoints/torchrun_pretrain.py") == "driver"
    assert cpu_account.role("python entrypoints/torchrun_pretrain.py --config x") == \
        "training ranks"
    assert cpu_account.role("ray::_StatsActor") == "ray::_StatsActor"


def test_a_ranks_busiest_thread_is_its_training_thread():
    before = {(10, 10): ("rank thread ray_core", 1.0), (10, 11): ("rank thread python", 5.0),
              (10, 12): ("rank thread heartbeat", 0.0), (20, None): ("raylet", 3.0)}
    after = {(10, 10): ("rank thread ray_core", 1.5), (10, 11): ("rank thread python", 25.0),
             (10, 12): ("rank thread heartbeat", 0.1), (20, None): ("raylet", 4.0),
             (30, None): ("readers", 2.0)}  # started in the window: from zero
    got = cpu_account.per_iteration(before, after, iterations=10)
    assert got == {"training ranks: training thread": 2.0, "readers": 0.2, "raylet": 0.1,
                   "rank thread ray_core": 0.05, "rank thread heartbeat": 0.01}
    assert list(got)[0] == "training ranks: training thread"  # largest first


def test_a_snapshot_reads_real_processes_and_threads():
    stop = threading.Event()
    worker = threading.Thread(target=lambda: stop.wait(5), name="probe")
    worker.start()
    try:
        first = cpu_account.snapshot([os.getpid()])
        deadline = time.process_time() + 0.2
        while time.process_time() < deadline:  # burn some CPU in this process
            pass
        second = cpu_account.snapshot([os.getpid()])
    finally:
        stop.set()
        worker.join()
    (key,) = [k for k in second if k[0] == os.getpid()]
    assert second[key][1] - first[key][1] >= 0.15
