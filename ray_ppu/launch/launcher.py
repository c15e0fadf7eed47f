"""The driver side: Ray cluster, preflight checks, data preparation, readers, and the Ray
Train TorchTrainer.

Workers run :func:`ray_ppu.launch.ray_worker.train_worker`, which adapts Ray Train to the Ray-free
:func:`ray_ppu.train.rank.train_rank`. What the driver does before the group starts overlaps
where it can: the preflight tasks, the index build (a thread here) and the readers' process
start run at once, and the readers read the first iterations while the workers import and
build the model. Each phase's
duration reaches rank 0, which logs them once at the first iteration (``start: …``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

import ray
import ray.train
from ray.train import FailureConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from ray_ppu import checkpoint, devices, quiet
from ray_ppu.launch import job_stop, local_checks, preflight, ray_connect, ray_worker
from ray_ppu.recovery import snapshot_keeper, watchdog
from ray_ppu.errors import ClusterError, ConfigError, CrashLoop
from ray_ppu.config.schema import RunConfig
from ray_ppu.data import idxmap, reader_pool, sft_store
from ray_ppu.data.sampler import valid_start, valid_steps
from ray_ppu.plan import Plan
from ray_ppu.plan.memory import memory_plan
from ray_ppu.plan.summary import summary_lines
from ray_ppu.launch.process_group import ProcessGroupConfig
from ray_ppu.launch.output import prepare_output
from ray_ppu.launch.train_controller import FailureRecorder

log = logging.getLogger("ray_ppu")

# Ray's default list of accelerator resources whose units get instance ids, plus PPU: with this
# in the raylet's environment, Ray hands each worker distinct PPU ids (RAY_custom_unit_instance_resources,
# read by the raylet at start: cluster/start-*.sh export it).
UNIT_INSTANCE_RESOURCES = "neuron_cores,TPU,NPU,HPU,RBLN,FURIOSA,TTNPU,MBLT,PPU"


_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
# Ray Train's controller polls its worker group every 2 s by default, so a finished or failed
# group is noticed up to 2 s late (measured: a 2-iteration launch 33.0 → 30.5 s at 0.2 s). A
# poll is one small actor call per worker; twice a second costs nothing measurable.
_HEALTH_CHECK_ENV, _HEALTH_CHECK_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5"
_ENV_AT_IMPORT = frozenset(os.environ)


_connected_in_s = 0.0  # how long this process's connect() took (the start line's "ray")


def connect(cfg: RunConfig) -> bool:
    """Join the cluster in RAY_ADDRESS (as under ``ray job submit``), else start a local Ray.

    The local Ray advertises simulated PPUs (``cluster.simulated_ppus``, default: as many as
    the run needs) with per-unit ids. Returns True when this call started Ray.
    """
    global _connected_in_s
    if ray.is_initialized():
        return False
    started = time.perf_counter()
    try:
        return _connect(cfg)
    finally:
        _connected_in_s = time.perf_counter() - started


def _connect(cfg: RunConfig) -> bool:
    if os.environ.get("RAY_ADDRESS"):
        ray_connect.check_reachable(os.environ["RAY_ADDRESS"], cfg.cluster.connect_timeout_s)
        ray.init(log_to_driver=True)
        quiet.filter_forwarded_logs()
        return False
    os.environ.setdefault("RAY_custom_unit_instance_resources", UNIT_INSTANCE_RESOURCES)
    c = cfg.cluster
    ppus = c.simulated_ppus or int(c.num_workers * c.ppu_per_worker)
    # Logical CPUs: the workers' own plus the readers' (one node: readers_per_node ×
    # reader_cpus) plus one for Ray's own tasks (preflight, index, SFT tokenizing); the OS
    # shares the cores. Too few and a reader waits for a CPU forever while its ranks wait.
    readers = preflight.readers_per_node(cfg, ppus) * cfg.data.reader_cpus
    cpus = max(os.cpu_count() or 1, math.ceil(c.num_workers * c.cpus_per_worker + readers) + 1)
    # address="local": a new Ray even when `ray start` left a cluster on this machine
    ray_connect.start_local(num_cpus=cpus, resources={c.resource_name: ppus}, log_to_driver=True)
    quiet.filter_forwarded_logs()
    return True


class _Trainer(TorchTrainer):
    """TorchTrainer without Ray Train's datasets callback. That callback starts a
    DatasetManager actor at every worker group start (a process importing Ray Data: 2.1 CPU-s
    beside the workers' own start), for Ray Datasets this trainer never has: our readers feed
    the ranks (ray_ppu.data.reader_pool), and ``ray.train.get_dataset_shard`` is not used."""

    def _create_default_callbacks(self):
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

        return [c for c in super()._create_default_callbacks()
                if not isinstance(c, DatasetsCallback)]


def build_trainer(cfg: RunConfig, plan: Plan, backend: devices.Backend, readers: dict,
                  token: str = "", phases: Optional[dict] = None) -> TorchTrainer:
    """TorchTrainer with one worker per PPU, checkpoints and the failure policy. ``readers``:
    how the workers reach this launch's readers (:func:`_prepare`); ``token``
    identifies this launch; ``phases``: the driver's start-up figures, for rank 0's log."""
    c = cfg.cluster
    root = checkpoint.save_root(cfg)
    return _Trainer(
        ray_worker.train_worker,
        train_loop_config={"cfg": cfg, "plan": plan, "backend": backend, "token": token,
                           "readers": readers, "phases": phases or {},
                           # the group's start (the start line's "group") is measured from here
                           "fit_called_at": time.time()},
        # not Ray's TorchConfig, whose module imports torch into the controller on the start's
        # critical path (ray_ppu.launch.process_group); the backend is explicit: nccl on PPUs
        torch_config=ProcessGroupConfig(backend=devices.dist_backend(backend)),
        scaling_config=ScalingConfig(
            # elastic: Ray Train restarts the group on whatever fits between the two
            num_workers=(c.min_workers, c.num_workers) if c.min_workers else c.num_workers,
            elastic_resize_monitor_interval_s=c.elastic_resize_interval_s,
            use_gpu=False,  # PPUs are a custom resource; binding is ours (assigned_device_id)
            resources_per_worker={c.resource_name: c.ppu_per_worker, "CPU": c.cpus_per_worker},
        ),
        run_config=ray.train.RunConfig(
            name=root.name,
            storage_path=str(root.parent),  # checkpoints are written straight into <this>/<name>
            failure_config=FailureConfig(max_failures=c.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.checkpoint.keep_last),
            callbacks=[FailureRecorder(root, token)],
        ),
    )


def launch(cfg: RunConfig, plan: Plan) -> dict:
    """Run the job on Ray; returns rank 0's last logged metrics.

    1. The plan's summary, and what ``--dry-run`` checks too (:mod:`ray_ppu.launch.local_checks`):
       the memory plan against the device, the corpora on the driver (files, headers, sizes,
       token ids, splits) or the SFT files and tokenizer, the checkpoint settings and where
       the run starts (its own latest complete checkpoint, ``checkpoint.load``, or scratch;
       the workers decide again at every (re)start).
    3. Connect to the cluster (or start a local Ray with simulated PPUs); enough PPU?
    4. At once: the preflight on every PPU node (:mod:`ray_ppu.launch.preflight`: output, index
       cache, data and checkpoint paths, Transformer Engine and the device), Megatron's sample
       indices built once, here, into the shared cache (skipped when the cache already holds
       them), and the readers' processes starting on every PPU node.
    5. The readers read the first iterations of both splits; TorchTrainer.fit() meanwhile:
       one worker per PPU, each joining the Megatron worker group.
    6. SIGTERM (``ray job stop``): the workers save after their iteration and stop; Ctrl-C,
       a second signal or ``checkpoint.stop_timeout_s`` later: Ray Train aborts them.
    """
    for line in summary_lines(cfg, plan, memory_plan(cfg, plan)):
        log.info("%s", line)
    checked = local_checks.check(cfg, plan)
    for line in checked.lines:
        log.info("%s", line)
    for line in checked.warnings:
        log.warning("%s", line)
    cfg, resume = checked.cfg, checked.resume
    prepare_output(cfg, plan)  # config.yaml and plan.json, once the checks passed
    sft = cfg.data.dataset == "sft"
    spec = sft_store.spec_for(cfg, plan) if sft else idxmap.spec_for(cfg, plan)
    job_stop.check_stop_wait(cfg)
    started = connect(cfg)
    phases = {"ray": _connected_in_s}  # here, or by the caller before (the demo's corpus)
    # ray job stop sends SIGTERM: the workers save and stop (then, or before training starts,
    # it is Ctrl-C: Ray Train's abort of the worker group). Only the main thread can set
    # handlers (a launch from another thread, as in tests, keeps the default).
    token = uuid.uuid4().hex
    graceful = job_stop.GracefulStop(checkpoint.save_root(cfg) / f"{ray_worker.STOP}{token}",
                             cfg.checkpoint.stop_timeout_s)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, graceful) if main else None
    owned: list = []  # the actors this launch owns (the readers): they outlive the groups
    try:
        preflight.check_capacity(cfg)
        cfg, backend, reader_info = _prepare(cfg, plan, spec, token, resume, phases, owned)
        # Ray Train passes this from the driver to its controller: how long a new worker group
        # may take to start before the controller decides again (elastic: after a node loss
        # it may first try the old size while Ray still counts the lost node).
        if _START_TIMEOUT_ENV not in _ENV_AT_IMPORT:  # the user's own setting wins
            os.environ[_START_TIMEOUT_ENV] = f"{cfg.cluster.group_start_timeout_s:g}"
        if _HEALTH_CHECK_ENV not in _ENV_AT_IMPORT:
            os.environ[_HEALTH_CHECK_ENV] = _HEALTH_CHECK_S
        trainer = build_trainer(cfg, plan, backend, reader_info, token=token, phases=phases)
        graceful.training = True
        hangs = (watchdog.Watchdog(checkpoint.save_root(cfg), token, cfg.cluster.hang_timeout_s,
                                   plan.eval_iters).start()
                 if cfg.cluster.hang_timeout_s != 0 else None)
        try:
            result = trainer.fit()
        except SystemExit:  # Ray Train's SIGINT handler aborts the workers, then exits
            raise KeyboardInterrupt from None
        finally:
            graceful.training = False
            graceful.stop_file.unlink(missing_ok=True)
            if hangs is not None:
                hangs.stop()
        final = _outcome(result)
        if "stopped_at" in final:
            log.warning("stopped at iteration %d of %d with a checkpoint: run the same config "
                        "again to resume", final["stopped_at"], plan.train_iters)
        if sft:  # the end-of-run account of the records: read, used, dropped and why
            final["data"] = sft_store.summaries(spec)
            for split in final["data"].values():
                log.info("%s", split["line"])
        return final
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        for actor in owned:
            ray.kill(actor)
        if ray.is_initialized() and cfg.checkpoint.memory_interval != 0:  # late nodes' keepers
            snapshot_keeper.stop_all(token, [n["NodeID"] for n in ray.nodes() if n["Alive"]])
        if started:
            shutdown()


def _outcome(result) -> dict:
    """Rank 0's final metrics; the run's error, or the crash-loop guard's, raised."""
    if result.error is not None:
        raise result.error
    final = result.return_value or {}
    if "crash_loop" in final:  # the ranks stopped instead of restarting again
        raise CrashLoop(final["crash_loop"])
    return final


def shutdown() -> None:
    """``ray.shutdown()`` once Ray Train's helper actors have gone: its placement-group
    cleaner (a detached actor the controller stops as it exits) would otherwise print a
    "Timed out while waiting for GCS" traceback when the GCS goes first."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and _alive_train_helpers():
        time.sleep(0.1)
    ray.shutdown()
    ray_connect.unpin()


def _alive_train_helpers() -> bool:
    try:
        from ray.util.state import list_actors

        alive = list_actors(filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)
    except Exception:  # no state API (no dashboard): nothing to wait for
        return False
    return any(a.class_name == "PlacementGroupCleaner" for a in alive)


def _prepare(cfg: RunConfig, plan: Plan, spec, token: str,
             resume: Optional[checkpoint.ResumePoint], phases: dict, owned: list):
    """The preflight, the data (indices or SFT rows) and the readers, overlapped, and the
    snapshots' keepers; returns ``cfg`` (without snapshots when the nodes lack the memory),
    the device backend and what the workers need to reach the readers (their handles and the
    keepers' go into ``owned`` as they start: the driver owns them)."""
    from ray_ppu.launch import preflight

    sft = isinstance(spec, sft_store.SFTSpec)
    index = cached = None
    started = time.perf_counter()
    if not sft:
        cached = idxmap.prepared(spec)  # a cache hit needs no Megatron at all
    if not sft and cached is None:
        # In this process, beside the preflight's tasks: it already read the corpus (the
        # checks above) and holds torch; a task would start a process and import both again.
        pool = concurrent.futures.ThreadPoolExecutor(1)
        index = pool.submit(_timed_prepare, spec)
        pool.shutdown(wait=False)  # the build finishes; no thread is kept after it
    nodes = preflight.ppu_nodes(cfg.cluster.resource_name)
    per_node = preflight.readers_per_node(cfg, max((n["Resources"][cfg.cluster.resource_name]
                                           for n in nodes), default=0))
    source = {"sft": spec} if sft else {"manifest": str(idxmap.manifest(spec))}
    reader_info = {"source": source, "token": token, "per_node": per_node,
                   "cpus": cfg.data.reader_cpus}
    readers = reader_pool.start(source, token, [n["NodeID"] for n in nodes], per_node,
                                cfg.data.reader_cpus)  # their processes start meanwhile
    owned += readers
    checked = preflight.check(cfg)
    backend = _backend(checked)
    if cfg.checkpoint.memory_interval != 0:
        if _snapshots_fit(cfg, plan, checked, nodes):
            owned += snapshot_keeper.start(token, [n["NodeID"] for n in nodes])  # one per node
        else:  # the workers take none either
            cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(
                cfg.checkpoint, memory_interval=0))
    phases["preflight"] = time.perf_counter() - started
    if sft:  # Ray Data tokenizes the JSON shards across the cluster, once per corpus
        rows = _as_config_error(sft_store.prepare, spec, Path(cfg.output.dir) / "bad_records")
        log.info("SFT rows: %d train (%d samples needed: %.2f epochs), %d validation",
                 rows["train"], plan.train_samples, plan.train_samples / rows["train"],
                 rows["valid"])
    else:
        samples = cached if index is None else _built_indices(index)
        if index is None:
            log.info("Megatron sample indices found in %s", spec.index_cache_dir)
        log.info("index cache %s: %d training samples for %d needed, %d validation for %d",
                 spec.index_cache_dir, samples["train"], plan.train_samples,
                 samples["valid"], plan.valid_samples)
    phases["index"] = time.perf_counter() - started - phases["preflight"]  # what it added
    ray.data.DataContext.get_current().enable_progress_bars = False  # log lines, not bars
    iteration = resume.iteration if resume else 0
    starts = {"train": (iteration, plan.train_iters)}
    if plan.eval_iters:
        starts["valid"] = (valid_start(iteration, plan.eval_interval, plan.eval_iters),
                           valid_steps(plan))
    ahead = reader_pool.window(cfg.data.prefetch_batches, plan.num_microbatches)
    first = reader_pool.first_requests(
        [dp for _, dp in plan.dims.data_ranks()], plan.data_parallel_size,
        plan.global_batch_size, plan.micro_batch_size, starts, ahead)
    reader_pool.read_ahead(readers, per_node, first)
    log.info("readers: %d per PPU node on %d node(s), reading the first %d iteration(s) of "
             "%s ahead", per_node, len(nodes), ahead, " and ".join(starts))
    return cfg, backend, reader_info


def _snapshots_fit(cfg: RunConfig, plan: Plan, checked: dict, nodes: list[dict]) -> bool:
    """Whether every PPU node has the host memory its in-memory snapshots take (the memory
    plan's ``snapshot_host_gib`` × its PPUs, within 80 % of what it has available); if not,
    the run keeps durable checkpoints only and says so. (Without keepers the workers find
    none and take no snapshots.)"""

    per_device = memory_plan(cfg, plan).snapshot_host_gib
    available = {r["node_id"]: r.get("host_available_gib") for r in checked["nodes"]}
    short = []
    for n in nodes:
        ppus = n["Resources"].get(cfg.cluster.resource_name, 0)
        need, have = per_device * min(ppus, plan.world_size), available.get(n["NodeID"])
        if have is not None and need > 0.8 * have:
            short.append(f"{n['NodeManagerAddress']}/{n['NodeID'][:8]} needs {need:.1f} GiB, "
                         f"has {have:.1f} available")
    if short:
        log.warning("in-memory snapshots off: the nodes lack the host memory for them ("
                    + "; ".join(short) + "); restarts load the durable checkpoints "
                    "(checkpoint.memory_interval=0 silences this)")
    return not short


def _as_config_error(fn, *args):
    """Bad data found while preparing it is the user's to fix: a ConfigError, not a traceback."""
    from ray_ppu.errors import PreprocessError

    try:
        return fn(*args)
    except (PreprocessError, ValueError) as err:
        raise ConfigError(str(err)) from None


def _timed_prepare(spec: idxmap.SampleSpec) -> tuple[dict, float]:
    # Megatron's builder logs every split and index file at INFO: the launch logs its summary
    logging.getLogger("megatron.core.datasets").setLevel(logging.WARNING)
    started = time.perf_counter()
    return idxmap.prepare(spec, checked=True), time.perf_counter() - started  # checked in launch


def _built_indices(index: concurrent.futures.Future) -> dict:
    """Samples per split of Megatron's indices, built once by the driver (never by every rank
    at once); ``index``: the future of that build."""
    try:
        samples, seconds = index.result()
    except ValueError as err:  # the corpus cannot give what the run asks
        raise ConfigError(str(err)) from None
    log.info("Megatron sample indices ready in %.1f s", seconds)
    return samples


def _backend(preflight_result: dict) -> devices.Backend:
    """The device backend, as the preflight resolved ``cluster.device`` on the PPU nodes (where
    the workers will run); nodes that disagree are an error naming them."""
    found = {r["device"]: r["node"] for r in preflight_result["nodes"]}
    if len(found) != 1:
        raise ClusterError("cluster.device resolves differently across the PPU nodes: "
                           + ", ".join(f"{device} on {node}" for device, node in found.items())
                           + "; set cluster.device explicitly or fix the nodes' drivers")
    return next(iter(found))
