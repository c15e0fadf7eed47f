"""One Ray Train worker: Ray Train's ``train_loop_per_worker``, adapting Ray to the Ray-free
:func:`ray_ppu.train.rank.train_rank`: dataset shards, the PPU id Ray assigned, checkpoint reports, stop
and drain notices, and spare workers of an elastic group. Runs in the worker processes; the
driver side is :mod:`ray_ppu.launch.launcher`.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Optional

import ray
import ray.train
import torch
import torch.distributed as dist

from ray_ppu import checkpoint, devices, quiet
from ray_ppu.recovery import snapshot, snapshot_keeper, watchdog
from ray_ppu.monitor import restarts
from ray_ppu.config.schema import RunConfig
from ray_ppu.data import reader_pool
from ray_ppu.data.sampler import valid_start, valid_steps
from ray_ppu.plan import Plan, plan_for_world
from ray_ppu.monitor.ray_gauges import RayMetrics
from ray_ppu.util.net import free_port

log = logging.getLogger("ray_ppu")

# Files in the run's save root, + the launch token:
STOP = "stop_"  # the driver asks the workers to save and stop
_FINISHED = "finished_"  # the training ranks are done: the spares stop waiting


_warned_no_ids: set[str] = set()  # resources assigned_device_id has warned about, per process


def assigned_device_id(resource_name: str) -> int:
    """The PPU id Ray assigned this worker (the lowest, when it holds several); LOCAL_RANK
    when Ray has none, with a warning once per process and resource."""
    ids: list = []
    # Ray's private API (no public one gives a custom resource's instance ids); ids exist only
    # when the raylet knows PPU as a unit resource (launcher.UNIT_INSTANCE_RESOURCES)
    try:
        worker = ray._private.worker.global_worker
        ids = worker.get_accelerator_ids_for_accelerator_resource(
            resource_name, rf"^{resource_name}_group_[0-9A-Za-z]+$"
        )
    except Exception as err:  # pragma: no cover - depends on Ray internals
        log.debug("no %s ids from Ray: %s", resource_name, err)
    if ids:  # Ray answers with a set's order: take the lowest, the same on every call
        return min(int(i) for i in ids)
    local_rank = ray.train.get_context().get_local_rank()
    if resource_name not in _warned_no_ids:
        _warned_no_ids.add(resource_name)
        log.warning(
            "Ray assigned no %s ids to this worker (start raylets with "
            "RAY_custom_unit_instance_resources including %s); using local rank %d",
            resource_name, resource_name, local_rank,
        )
    return local_rank


def _quiet_worker_logs() -> None:
    """Our progress lines once each; Ray Train's per-report INFO lines and Megatron's
    per-parameter listings off (they drown the progress report in the job log)."""
    quiet.show_our_logs()
    from ray.train.v2._internal.execution import context as train_context

    # Ray Train logs every report at INFO under its file's path as the logger name.
    for name in ("ray.train", "megatron.core", train_context.__file__):
        logging.getLogger(name).setLevel(logging.WARNING)
    # torch's c10d deprecation notices repeat on every rank; they say nothing the run can act
    # on (Megatron's import-time notices: ray_ppu.quiet).
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.")


def train_worker(payload: dict) -> dict:
    """Ray Train's train_loop_per_worker: adapt Ray to :func:`ray_ppu.train.rank.train_rank`.

    1. Stop, if the restarts make no progress (:func:`ray_ppu.monitor.restarts.crash_loop`).
    2. The group's plan: an elastic group can be any size (spares past the last usable
       replica leave the process group and only join checkpoint reports); where it starts.
    3. This rank's data streams from its node's readers, threads, PPU id; stop and drain
       notices; the driver's start-up phases; train, then tell the spares."""
    group_started = time.time()
    from ray_ppu.train.rank import train_rank

    _quiet_worker_logs()
    cfg: RunConfig = payload["cfg"]
    backend: devices.Backend = payload["backend"]
    token: str = payload["token"]
    root = checkpoint.save_root(cfg)
    # every rank reads the same records: all stop alike, and the run ends with the reason
    history = restarts.failures(root, token)
    if (looping := restarts.crash_loop(history)) is not None:
        return {"crash_loop": looping}
    context = ray.train.get_context()
    world = context.get_world_size()
    # An elastic group can be smaller than planned, and any size: the workers past the last
    # whole model replica (or past a DP size that divides the global batch) stay spare.
    plan: Plan = payload["plan"] if world == payload["plan"].world_size else plan_for_world(cfg, world)
    if context.get_world_rank() == 0 and world != cfg.cluster.num_workers:
        log.warning("worker group of %d (of %d planned): TP %d × CP %d × PP %d × DP %d = %d train "
                    "with %d microbatches per rank, %d spare", world, cfg.cluster.num_workers,
                    plan.tensor_model_parallel_size, plan.context_parallel_size,
                    plan.pipeline_model_parallel_size, plan.data_parallel_size, plan.world_size,
                    plan.num_microbatches, plan.spare_workers)

    # Where this group starts: every rank asks the same files (ray_ppu.checkpoint's docstring);
    # a newer complete in-memory snapshot of the same layout wins (rank 0 decides for all).
    # The data streams start there; rank 0 records it.
    disk = checkpoint.resume_point(cfg)
    memory = cfg.checkpoint.memory_interval != 0
    resume = (_memory_point(cfg, plan, token, disk) if memory else None) or disk
    start_iteration = resume.iteration if resume else 0
    if context.get_world_rank() == 0:
        checkpoint.record_stream_start(cfg, token, resume, plan.eval_interval, plan.eval_iters)
    _check_against_ray(cfg, disk)
    if plan.spare_workers and not _leave_spares_out(plan.world_size):
        return _idle_as_spare(cfg, token, start_iteration)
    snapshots = _snapshotter(cfg, plan, token, backend) if memory else None
    batches, valid_batches = _streams(payload["readers"], cfg, plan, context.get_world_rank(),
                                      start_iteration)
    # As many compute threads as CPUs Ray reserved for this worker (torchrun sets
    # OMP_NUM_THREADS=1 likewise); torch's default, every core, oversubscribes the node.
    torch.set_num_threads(max(1, int(cfg.cluster.cpus_per_worker)))
    device_id = assigned_device_id(cfg.cluster.resource_name) if backend == "ppu" else 0
    # No ray.train.report per log line: Ray Train drains one report per health-check interval
    # (2 s), so frequent reports would throttle training. Metrics go to metrics.jsonl and
    # TensorBoard; the final metrics come back as the run's return value. Checkpoints are
    # reported (save points only), so Ray Train knows them and deletes the oldest.
    interruption = _Interruptions(root / f"{STOP}{token}", backend,
                                  # get_preemption_info is a barrier over every worker, and the
                                  # spares do not follow the iterations
                                  watch_preemption=cfg.checkpoint.save_on_preemption
                                  and not plan.spare_workers)
    exported = (RayMetrics(checkpoint.run_name(cfg), context.get_world_rank()).export
                if cfg.output.ray_metrics else None)
    # group: Ray Train's controller, placement, the worker processes, Ray's imports in them;
    # setup: ours (Megatron-Core's model code: 2.4 s), where to start, the data streams
    phases = {**payload["phases"], "group": group_started - payload["fit_called_at"],
              "setup": time.time() - group_started}
    # progress files, read by the driver's hang watchdog and the crash-loop guard
    beacon = watchdog.Beacon(root, token, dist.get_rank(), plan.world_size,
                             ray.get_runtime_context().get_node_id())
    try:
        final = train_rank(cfg, plan, backend, device_id, batches, valid_batches,
                           start_iteration, resume, on_checkpoint=_report_checkpoint,
                           failures=history, interruption=interruption,
                           on_metrics=exported, startup=phases, snapshots=snapshots,
                           progress=beacon)
    finally:
        beacon.close()
    if plan.spare_workers and context.get_world_rank() == 0:  # the spares may go now
        (root / f"{_FINISHED}{token}").touch()
    return {**final, "world_size": plan.world_size, "spare_workers": plan.spare_workers}




def _memory_point(cfg: RunConfig, plan: Plan, token: str,
                  disk: Optional[checkpoint.ResumePoint]) -> Optional[snapshot.MemoryPoint]:
    """The newest complete in-memory snapshots this group can restore — its own layout's, or
    a resized group's it reshards — at or after the disk checkpoint ``disk``, or None. Rank 0
    asks the launch's keepers and decides (:func:`ray_ppu.recovery.snapshot_keeper.newest_restorable`);
    every rank takes its answer. At the same layout each rank starts fetching its own copy
    (its node's keeper first) while the model is built."""
    layout = snapshot.layout_of(plan)
    rank = dist.get_rank()

    def propose():
        found = _keepers(cfg, token)
        indexes = {}
        for node_id, keeper in found.items():
            try:
                indexes[node_id] = ray.get(keeper.index.remote(), timeout=30)
            except Exception:  # its node is going: its copies are not reachable
                pass
        best = snapshot_keeper.newest_restorable(indexes, layout,
                                                 not_before=disk.iteration if disk else 0)
        if best is None and any(indexes.values()):
            log.info("no complete in-memory snapshot for this group (layout %s, at or after "
                     "iteration %d) in %d keeper(s): restoring from %s", layout,
                     disk.iteration if disk else 0, len(indexes), disk.path if disk else "scratch")
        elif best is not None and best.layout != layout:
            log.info("restoring the in-memory snapshots of iteration %d of a group of %d (DP %d) "
                     "into this one of %d (DP %d), resharding the optimizer across DP",
                     best.iteration, best.layout[0], best.layout[4], layout[0], layout[4])
        return best

    best: Optional[snapshot_keeper.Found] = snapshot.agree(propose, dist.new_group(backend="gloo"))
    if best is None:
        return None
    here = ray.get_runtime_context().get_node_id()
    handles = snapshot_keeper.keepers(token, sorted({n for held in best.holders.values()
                                                     for n in held}))

    def request(old_rank: int):
        held = [n for n in best.holders[old_rank] if n in handles]
        source = here if here in held else held[0]
        ref = handles[source].get.remote(old_rank, best.iteration)
        ray.wait([ref], timeout=0, fetch_local=True)  # start pulling it here now
        return ref

    same = best.layout == layout
    fetch = _no_fetch
    if rank < plan.world_size:  # a spare restores nothing
        # the transfers run while the model is built: this rank's own snapshot, or (resharding)
        # those of the old ranks at its (PP, TP) place; restore fetches any other it needs
        refs = {r: request(r) for r in ([rank] if same else _same_place(plan, rank, best))}
        fetch = lambda old_rank: ray.get(refs.get(old_rank) or request(old_rank))  # noqa: E731
    return snapshot.MemoryPoint(best.iteration, tuple(sorted(handles)), fetch,
                                sources=None if same else best.coords,
                                origin=checkpoint.origin(cfg, disk))


def _same_place(plan: Plan, rank: int, best: snapshot_keeper.Found) -> list[int]:
    """The old group's ranks at this rank's (PP, TP) place, by the coordinates they recorded
    (``ray_ppu.recovery.snapshot_reshard.Coords``: PP first, TP second)."""
    mine = plan.dims.coordinates(rank)
    return [r for r, (pp, tp, *_) in best.coords.items() if (pp, tp) == (mine["pp"], mine["tp"])]


def _keepers(cfg: RunConfig, token: str) -> dict:
    """``{node_id: keeper}`` of this launch on the PPU nodes still alive."""
    from ray_ppu.launch.preflight import ppu_nodes

    return snapshot_keeper.keepers(token, [n["NodeID"] for n in ppu_nodes(
        cfg.cluster.resource_name)])


def _no_fetch(old_rank: int) -> bytes:
    raise RuntimeError("a spare worker restores no snapshot")


def _snapshotter(cfg: RunConfig, plan: Plan, token: str,
                 backend: devices.Backend) -> snapshot.Snapshotter:
    """This rank's snapshots go to its node's keeper and a replica to the next node's."""
    here = ray.get_runtime_context().get_node_id()
    found = _keepers(cfg, token)
    if here not in found:  # a node that joined after the launch: a keeper outliving us
        found[here] = snapshot_keeper.start(token, [here], detached=True)[0]
    peer = snapshot_keeper.replica_of(here, list(found))
    targets = [found[here]] + ([found[peer]] if peer else [])
    rank, layout = dist.get_rank(), snapshot.layout_of(plan)

    def send(iteration: int, shards: tuple, blob: bytes) -> None:
        ref = ray.put(blob)  # once; each keeper copies it into its own memory
        ray.get([k.put.remote(rank, iteration, layout, shards, len(blob), ref)
                 for k in targets])

    return snapshot.Snapshotter(send, cfg.checkpoint.memory_interval, with_cuda=backend == "ppu",
                                cpu_device=backend == "cpu",
                                group=dist.new_group(backend="gloo"), replica=peer is not None)


def _streams(readers: dict, cfg: RunConfig, plan: Plan, rank: int, start_iteration: int):
    """This rank's train and validation streams from its node's readers (None, None on ranks
    that read no data: they get their batches by broadcast in the TP group)."""
    dp_rank = dict(plan.dims.data_ranks()).get(rank)
    if dp_rank is None:
        return None, None
    pool = reader_pool.node_readers(readers["source"], readers["token"], readers["per_node"],
                                    readers["cpus"])
    window = reader_pool.window(cfg.data.prefetch_batches, plan.num_microbatches)
    args = (dp_rank, plan.data_parallel_size, plan.global_batch_size, plan.micro_batch_size,
            window)
    train = reader_pool.RankStream(pool, "train", start_iteration, plan.train_iters, *args)
    if not plan.eval_iters:
        return train, None
    first = valid_start(start_iteration, plan.eval_interval, plan.eval_iters)
    return train, reader_pool.RankStream(pool, "valid", first, valid_steps(plan), *args)


class _Interruptions:
    """``train_rank``'s ``interruption``: asked after every iteration on every training rank.

    "stop" when the driver has asked the run to stop (its stop file, looked at by rank 0);
    "save" when Ray Train reports that a node of the run is being drained (asked as often as
    Ray Train's drain watcher looks, RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S, default 5 s; once per
    drain). One all-reduce of two flags gives every rank the same answer.
    """

    def __init__(self, stop_file: Path, backend: devices.Backend, watch_preemption: bool) -> None:
        self.stop_file, self.backend = stop_file, backend
        self.watch_preemption = watch_preemption
        self.poll_s = float(os.environ.get("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", 5.0))
        self.last_poll = time.monotonic()

    def __call__(self, iteration: int) -> Optional[str]:
        rank0 = dist.get_rank() == 0
        poll = (rank0 and self.watch_preemption
                and time.monotonic() - self.last_poll >= self.poll_s)
        flags = torch.tensor([float(rank0 and self.stop_file.exists()), float(poll)],
                             device=devices.torch_device(self.backend))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, poll = bool(flags[0]), bool(flags[1])
        if poll:  # every rank calls it: Ray Train agrees on one answer across the workers
            self.last_poll = time.monotonic()
            info = ray.train.get_preemption_info()
            if info is not None:
                self.watch_preemption = False  # one checkpoint per drain
                if rank0:
                    left = (f", {info.deadline_ms / 1000 - time.time():.0f} s before the "
                            f"deadline" if info.deadline_ms else "")
                    log.warning("nodes %s (ranks %s) are being drained%s",
                                [n[:8] for n in info.preempted_node_ids], info.preempted_ranks,
                                left)
                return "stop" if stop else "save"
        return "stop" if stop else None


def _leave_spares_out(active: int) -> bool:
    """Re-form the default process group from world ranks ``0 .. active-1`` only (Megatron's
    groups are cut from the default group's size); True on those ranks, False on spares.

    The new rendezvous port is chosen by rank 0 and shared over a gloo group (with NCCL the
    default group would need a bound device, which comes later).
    """
    rank = dist.get_rank()
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0, group=dist.new_group(backend="gloo"))
    backend = dist.get_backend()
    dist.destroy_process_group()
    if rank >= active:
        return False
    dist.init_process_group(backend, init_method=f"tcp://{os.environ['MASTER_ADDR']}:{port[0]}",
                            rank=rank, world_size=active, timeout=datetime.timedelta(minutes=30))
    return True


def _idle_as_spare(cfg: RunConfig, token: str, start_iteration: int) -> dict:
    """A spare worker's whole job: join every checkpoint report of the active ranks (Ray
    Train's report is a barrier over all workers of the group) until they finish."""
    root = checkpoint.save_root(cfg)
    reported = start_iteration  # complete checkpoints up to here predate this group
    while True:
        finished = (root / f"{_FINISHED}{token}").exists()  # read first: then the last report
        for path, meta in checkpoint.complete_checkpoints(root, warn=False):  # is seen below
            if meta.iteration > reported:
                _report_checkpoint(path, {"iteration": meta.iteration}, rank0=False)
                reported = meta.iteration
        if finished:
            return {}
        time.sleep(0.5)


def _report_checkpoint(path: Path, metrics: dict, rank0: Optional[bool] = None) -> None:
    """Register a complete checkpoint with Ray Train; every rank calls it (report is a barrier).

    The checkpoint is one directory all ranks wrote into, already inside Ray Train's run
    directory (checkpoint.save_root): only rank 0 names it, and NO_UPLOAD registers it where it
    is instead of copying it (Ray 2.60 accepts that only for directories under the run's
    storage path, and requires every rank that names a checkpoint to name the same path).
    """
    if rank0 is None:
        rank0 = ray.train.get_context().get_world_rank() == 0
    ray.train.report(
        {**metrics, "checkpoint": path.name},
        checkpoint=ray.train.Checkpoint.from_directory(str(path)) if rank0 else None,
        checkpoint_dir_name=path.name,
        checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD,
    )


def _check_against_ray(cfg: RunConfig, resume) -> None:
    """Our save root must be Ray Train's run directory (or Ray would not register our
    checkpoints); and say so when Ray's latest registered checkpoint is not the one we load."""
    storage = ray.train.get_context().get_storage()
    ray_dir = Path(storage.experiment_fs_path).resolve()
    if ray_dir != checkpoint.save_root(cfg):
        raise checkpoint.CheckpointError(f"Ray Train's run directory {ray_dir} is not the "
                                         f"checkpoint root {checkpoint.save_root(cfg)}")
    registered = ray.train.get_checkpoint()
    if registered is not None and (resume is None
                                   or Path(registered.path).resolve() != Path(resume.path)):
        # Ray's is newer but incomplete (no meta file), or ours is newer than Ray's (the group
        # died between writing it and Ray registering it): the complete one on disk wins.
        log.warning("Ray Train's latest checkpoint is %s; starting from the latest complete "
                    "one, %s", registered.path, resume.path if resume else "none (from scratch)")
