"""Per-worker PPU binding (ray_ppu.launch.ray_worker.assigned_device_id) under real Ray Train workers.

Two TorchTrainers of 2 workers × 1 PPU run at the same time on the session cluster's simulated
PPUs (their workers wait for each other, so all four hold a PPU at once): Ray must hand out
four distinct ids. The same workers then ask for a resource name Ray gave them no ids
for: the fallback is the local rank, with one warning per process however often it is asked.
"""

import logging
import sys
import threading
import time
from pathlib import Path

import pytest
from ray import cloudpickle as ray_cloudpickle

from conftest import SIMULATED_PPUS

# The train functions below travel to the workers by value (this test module is not importable
# there).
ray_cloudpickle.register_pickle_by_value(sys.modules[__name__])

WORKERS = 2  # per trainer
NOT_HELD = "NOT_A_RESOURCE"  # no node advertises it: Ray has no ids for it


def _gather(value):
    """Every rank's ``value`` (in world-rank order) on every rank, over the trainer's gloo group."""
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _bound_ppu(config: dict) -> list:
    """Train function: this worker's PPU id, held until all four PPU workers have theirs; then
    the fallback, asked twice for a resource Ray gave no ids for, with the warnings logged."""
    import ray.train

    from ray_ppu.launch.ray_worker import assigned_device_id

    device = assigned_device_id("PPU")
    rank = ray.train.get_context().get_world_rank()
    rendezvous = Path(config["rendezvous"])
    (rendezvous / f"{config['name']}-{rank}").write_text(str(device))
    deadline = time.monotonic() + 120
    while len(list(rendezvous.iterdir())) < config["expected"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {sorted(p.name for p in rendezvous.iterdir())} arrived")
        time.sleep(0.05)

    logged: list[str] = []

    class Record(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logged.append(record.getMessage())

    handler = Record(level=logging.WARNING)
    logging.getLogger("ray_ppu").addHandler(handler)
    try:
        fallback = [assigned_device_id(NOT_HELD), assigned_device_id(NOT_HELD)]
    finally:
        logging.getLogger("ray_ppu").removeHandler(handler)
    return _gather({"ppu": device, "fallback": fallback,
                    "local_rank": ray.train.get_context().get_local_rank(),
                    "warnings": [m for m in logged if f"Ray assigned no {NOT_HELD} ids" in m]})


def _trainer(fn, name: str, storage: Path, resources: dict, config: dict):
    import ray.train
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(
        fn, train_loop_config={**config, "name": name},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False,
                                     resources_per_worker=resources),
        run_config=ray.train.RunConfig(name=name, storage_path=str(storage)),
    )


@pytest.fixture(scope="module")
def concurrent_trainers(ray_cluster, tmp_path_factory):
    """The two PPU trainers' return values, fitted at the same time from two threads."""
    root = tmp_path_factory.mktemp("ppu_binding")
    rendezvous = root / "rendezvous"
    rendezvous.mkdir()
    # Four PPUs must be free (a prelaunched run may hold others): the trainers fit together.
    deadline = time.monotonic() + 60
    while ray_cluster.available_resources().get("PPU", 0) < 2 * WORKERS:
        assert time.monotonic() < deadline, f"PPUs still held: {ray_cluster.available_resources()}"
        time.sleep(0.5)
    config = {"rendezvous": str(rendezvous), "expected": 2 * WORKERS}
    trainers = {
        "a": _trainer(_bound_ppu, "binding_a", root, {"PPU": 1, "CPU": 1}, config),
        "b": _trainer(_bound_ppu, "binding_b", root, {"PPU": 1, "CPU": 1}, config),
    }
    results: dict = {}

    def fit(key):
        try:
            results[key] = trainers[key].fit()
        except BaseException as err:  # noqa: BLE001 - reported by the test
            results[key] = err

    threads = [threading.Thread(target=fit, args=(key,)) for key in trainers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    for key in trainers:
        result = results.get(key)
        assert result is not None and not isinstance(result, BaseException), (key, result)
        assert result.error is None, (key, result.error)
    return {key: results[key].return_value for key in trainers}


def test_concurrent_trainers_get_distinct_ppus(concurrent_trainers):
    a, b = ([w["ppu"] for w in concurrent_trainers[k]] for k in ("a", "b"))
    assert len(a) == len(b) == WORKERS
    ids = a + b
    assert all(isinstance(i, int) for i in ids), ids
    # distinct within a trainer and across the two: each worker drives its own PPU
    assert len(set(ids)) == 2 * WORKERS and set(ids) <= set(range(SIMULATED_PPUS)), (a, b)


def test_no_ids_falls_back_to_local_rank_with_one_warning(concurrent_trainers):
    for workers in concurrent_trainers.values():
        assert sorted(w["local_rank"] for w in workers) == list(range(WORKERS))
        for w in workers:
            assert w["fallback"] == [w["local_rank"]] * 2
            assert len(w["warnings"]) == 1, w["warnings"]  # once per process, not per call
            assert f"using local rank {w['local_rank']}" in w["warnings"][0]
