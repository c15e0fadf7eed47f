"""Preflight: before any index is built or worker placed, ask every PPU node whether it can
run this job.

One small Ray task per alive node that advertises ``cluster.resource_name``, pinned to it
(``NodeAffinitySchedulingStrategy(soft=False)``, no CPU), checks there:

* ``output.dir`` and the index cache (``data.index_cache_dir``, default
  ``<output.dir>/index_cache``) exist or can be created, and take a new file;
* every data path can be read: idxmap prefixes' ``.bin`` and ``.idx``; SFT files, directories
  and globs match at least one readable data file; ``data.tokenizer`` and ``checkpoint.load``
  exist and can be listed; ``checkpoint.pretrained``'s config.json and safetensors files read,
  and a LoRA run's ``lora.adapter`` files;
* whether Transformer Engine imports, whether ``torch.cuda`` sees a device, and what
  ``cluster.device`` resolves to — and, when the run asks for options only Transformer Engine
  provides (:func:`ray_ppu.plan.te_options.needs_transformer_engine`), that this node can
  give them.

:func:`node_reports` returns the per-node report (``--dry-run`` prints it); :func:`check` raises
``ClusterError`` listing every problem per node. :func:`check_capacity` asks Ray's view of the
cluster, before anything is placed, whether it has the PPUs and the CPUs beside them. A node that does not answer within
``cluster.placement_timeout_s`` is a problem too: nothing waits forever. The node side imports
only the standard library, torch and (for SFT) the SFT input resolver.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ray_ppu.config.schema import RunConfig
from ray_ppu.data import reader_pool
from ray_ppu.errors import ClusterError
from ray_ppu.plan import ParallelDims

log = logging.getLogger("ray_ppu")


def _abs(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def plan_checks(cfg: RunConfig) -> dict:
    """What every node checks, as plain data (paths made absolute here, on the driver)."""
    from ray_ppu.data.idxmap import parse_blend
    from ray_ppu.plan.te_options import needs_transformer_engine

    d = cfg.data
    files: list[tuple[str, str]] = []  # (config key, file that must be readable)
    inputs: list[tuple[str, str]] = []  # (config key, SFT file / directory / glob)
    dirs: list[tuple[str, str]] = []  # (config key, directory that must exist and be listable)
    for key, items in (("data.data_path", d.data_path),
                       ("data.valid_data_path", d.valid_data_path)):
        if not items:
            continue
        if d.dataset == "sft":
            inputs += [(key, str(Path(i).expanduser().absolute())) for i in items]
        else:
            prefixes, _ = parse_blend(items, key)
            files += [(key, _abs(p) + ext) for p in prefixes for ext in (".bin", ".idx")]
    if d.tokenizer:
        dirs.append(("data.tokenizer", _abs(d.tokenizer)))
    if cfg.checkpoint.load:
        dirs.append(("checkpoint.load", _abs(cfg.checkpoint.load)))
    if cfg.checkpoint.pretrained:  # config.json and every safetensors file the ranks read
        from ray_ppu.hf.files import Checkpoint

        pretrained = _abs(cfg.checkpoint.pretrained)
        weights = sorted({str(p) for p in Checkpoint(pretrained).files.values()})
        files += [("checkpoint.pretrained", p)
                  for p in [str(Path(pretrained) / "config.json"), *weights]]
    if cfg.lora.adapter:  # every rank reads the PEFT adapter a LoRA run starts from
        adapter = Path(_abs(cfg.lora.adapter))
        files += [("lora.adapter", str(adapter / name))
                  for name in ("adapter_config.json", "adapter_model.safetensors")]
    return {
        "writable": [("output.dir", _abs(cfg.output.dir)),
                     ("data.index_cache_dir", _abs(cfg.index_cache_dir()))],
        "files": files,
        "inputs": inputs,
        "dirs": dirs,
        "device": cfg.cluster.device,
        "needs_te": needs_transformer_engine(cfg),
    }


# --- on the node ------------------------------------------------------------------------------


def _why(err: BaseException) -> str:
    return getattr(err, "strerror", None) or str(err) or type(err).__name__


def _check_writable(key: str, path: str) -> Optional[str]:
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"{key} {path}: cannot create the directory: {_why(err)}"
    if not os.path.isdir(path):
        return f"{key} {path}: not a directory"
    try:
        fd, name = tempfile.mkstemp(prefix=".ray_ppu_preflight_", dir=path)
        try:
            os.write(fd, b"ok")
        finally:
            os.close(fd)
        os.unlink(name)
    except OSError as err:
        return f"{key} {path}: not writable (cannot create a file there: {_why(err)})"
    return None


def _check_readable_file(key: str, path: str) -> Optional[str]:
    if not os.path.exists(path):
        return f"{key} {path}: missing"
    if not os.path.isfile(path):
        return f"{key} {path}: not a file"
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as err:
        return f"{key} {path}: not readable: {_why(err)}"
    return None


def _check_listable_dir(key: str, path: str) -> Optional[str]:
    if not os.path.exists(path):
        return f"{key} {path}: missing"
    if not os.path.isdir(path):
        return f"{key} {path}: not a directory"
    try:
        os.listdir(path)
    except OSError as err:
        return f"{key} {path}: not readable: {_why(err)}"
    return None


def _check_input(key: str, spec: str) -> Optional[str]:
    """An SFT file / directory / glob: at least one data file, every one of them readable."""
    from ray_ppu.data.readers import resolve_inputs
    from ray_ppu.errors import PreprocessError

    if not os.path.exists(spec) and not glob.has_magic(spec):
        return f"{key} {spec}: missing"
    try:
        found = resolve_inputs([spec])
    except (PreprocessError, OSError) as err:  # PreprocessError's message starts with the path
        return f"{key} {err}" if str(err).startswith(spec) else f"{key} {spec}: {_why(err)}"
    for path in found:
        problem = _check_readable_file(key, path)
        if problem:
            return problem
    return None


def _device_facts(requested: str) -> dict:
    """torch.cuda, Transformer Engine and what ``cluster.device`` resolves to, on this node
    (the workers' own rules: ``devices.resolve``, ``devices.transformer_engine_error``)."""
    import torch

    from ray_ppu import devices

    facts: dict = {"cuda": bool(torch.cuda.is_available()), "device": None, "device_error": None}
    facts["cuda_devices"] = torch.cuda.device_count() if facts["cuda"] else 0
    facts["transformer_engine_error"] = devices.transformer_engine_error()
    facts["transformer_engine"] = facts["transformer_engine_error"] is None
    try:
        facts["device"] = devices.resolve(requested)
    except (RuntimeError, ValueError) as err:
        facts["device_error"] = str(err)
    return facts


def node_check(checks: dict) -> dict:
    """Run on one node: its problems (one line each) and device facts."""
    started = time.perf_counter()
    problems: list[str] = []
    for key, path in checks["writable"]:
        problems.append(_check_writable(key, path))
    for key, path in checks["files"]:
        problems.append(_check_readable_file(key, path))
    for key, spec in checks["inputs"]:
        problems.append(_check_input(key, spec))
    for key, path in checks["dirs"]:
        problems.append(_check_listable_dir(key, path))
    facts = _device_facts(checks["device"])
    if facts["device_error"]:
        problems.append(facts["device_error"])
    needs = checks["needs_te"]
    if needs and not (facts["device"] == "ppu" and facts["transformer_engine"]):
        why = ("cluster.device=cpu" if checks["device"] == "cpu"
               else f"cluster.device={checks['device']} resolves to cpu here (torch.cuda sees "
                    f"no device)" if facts["device"] == "cpu"
               else f"Transformer Engine does not import here "
                    f"({facts['transformer_engine_error']})" if facts["device"] == "ppu"
               else "no usable device here")
        problems.append("the run asks for options only Transformer Engine provides: "
                        + "; ".join(needs) + f"; but {why}")
    return {"problems": [p for p in problems if p], **facts,
            "host_available_gib": _host_available_gib(),
            "seconds": round(time.perf_counter() - started, 3)}


def _host_available_gib() -> Optional[float]:
    """Host memory available on this node now (the in-memory snapshots' budget)."""
    try:
        import psutil  # a Ray dependency

        return psutil.virtual_memory().available / 1024 ** 3
    except Exception:  # pragma: no cover - no psutil, or no /proc
        return None


# --- on the driver ----------------------------------------------------------------------------

_node_check_task = ray.remote(node_check)


def ppu_nodes(resource_name: str) -> list[dict]:
    """Alive nodes that advertise ``resource_name``."""
    return [n for n in ray.nodes()
            if n.get("Alive") and n.get("Resources", {}).get(resource_name, 0) > 0]


def _node_name(node: dict) -> str:
    return f"{node['NodeManagerAddress']}/{node['NodeID'][:8]}"


def node_reports(cfg: RunConfig) -> dict:
    """Check every PPU node; ``{"ok", "nodes": [{"node", "problems", cuda / TE / device
    facts}], "problems": [one line per problem, node first]}``. Never waits longer than
    ``cluster.placement_timeout_s``."""
    c = cfg.cluster
    checks = plan_checks(cfg)
    nodes = ppu_nodes(c.resource_name)
    refs = {}
    for node in nodes:
        refs[_node_check_task.options(
            num_cpus=0, max_retries=0, name="ray_ppu_preflight",
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
        ).remote(checks)] = node
    pending = (ray.wait(list(refs), num_returns=len(refs), timeout=c.placement_timeout_s)[1]
               if refs else [])
    reports = []
    for ref, node in refs.items():
        name = _node_name(node)
        if ref in pending:
            ray.cancel(ref, force=True)
            report = {"problems": [f"no answer within {c.placement_timeout_s:g} s "
                                   f"(cluster.placement_timeout_s)"]}
        else:
            try:
                report = ray.get(ref)
            except Exception as err:  # the node died, or the check itself failed
                report = {"problems": [f"the check failed: {type(err).__name__}: "
                                       f"{str(err).splitlines()[0] if str(err) else ''}"]}
        reports.append({"node": name, "node_id": node["NodeID"], **report})
    problems = [f"{r['node']}: {p}" for r in reports for p in r["problems"]]
    if not nodes:
        problems.append(f"no alive node advertises the {c.resource_name} resource")
    for r in reports:
        if "device" in r:
            log.info("preflight %s: %d problem(s); device %s, torch.cuda %s (%d), Transformer "
                     "Engine %s", r["node"], len(r["problems"]), r["device"] or "-",
                     r["cuda"], r["cuda_devices"], "yes" if r["transformer_engine"] else "no")
    return {"ok": not problems, "nodes": reports, "problems": problems}


def check(cfg: RunConfig) -> dict:
    """:func:`node_reports`, raising ``ClusterError`` with every problem on every node."""
    result = node_reports(cfg)
    if not result["ok"]:
        bad = [r["node"] for r in result["nodes"] if r["problems"]]
        where = f" on {len(bad)} of {len(result['nodes'])} PPU node(s)" if bad else ""
        raise ClusterError(f"preflight found {len(result['problems'])} problem(s){where}:\n  "
                           + "\n  ".join(result["problems"]))
    return result


def check_capacity(cfg: RunConfig) -> None:
    """Fail at once, with what each node has, if the cluster lacks the PPUs for this run, or
    the CPUs beside them: a worker takes ``cluster.cpus_per_worker`` and the node's readers
    ``data.reader_cpus`` each, and a group that cannot be placed would only time out."""
    c = cfg.cluster
    workers = c.min_workers or c.num_workers  # elastic: the run starts with what fits
    need = workers * c.ppu_per_worker
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    per_node = {n["NodeManagerAddress"] + "/" + n["NodeID"][:8]: n["Resources"].get(c.resource_name, 0)
                for n in nodes}
    have = sum(per_node.values())
    fits = sum(int(v // c.ppu_per_worker) for v in per_node.values()) if c.ppu_per_worker else workers
    if have < need or fits < workers:
        listing = ", ".join(f"{k}: {v:g}" for k, v in per_node.items()) or "no alive nodes"
        raise ClusterError(
            f"the run needs {workers} workers × {c.ppu_per_worker:g} {c.resource_name} = "
            f"{need:g} {c.resource_name}, but the cluster has {have:g} ({listing}); "
            f"lower cluster.num_workers or add nodes started with --resources='{{\"{c.resource_name}\": 16}}'"
        )
    slots, short = 0, []
    for n in nodes:
        ppus = n["Resources"].get(c.resource_name, 0)
        if not ppus:
            continue
        by_ppu = int(ppus // c.ppu_per_worker) if c.ppu_per_worker else workers
        readers = readers_per_node(cfg, ppus) * cfg.data.reader_cpus
        cpus = n["Resources"].get("CPU", 0) - readers
        by_cpu = int(cpus // c.cpus_per_worker) if c.cpus_per_worker else by_ppu
        slots += min(by_ppu, by_cpu)
        if by_cpu < by_ppu:
            short.append(f"{n['NodeManagerAddress']}/{n['NodeID'][:8]}: {ppus:g} "
                         f"{c.resource_name}, {n['Resources'].get('CPU', 0):g} CPU of which the "
                         f"readers take {readers:g}: room for {max(by_cpu, 0)} worker(s)")
    if slots < workers:
        raise ClusterError(
            f"the run needs {workers} workers × {c.cpus_per_worker:g} CPU "
            f"(cluster.cpus_per_worker) beside their {c.resource_name}, but the PPU nodes hold "
            f"{slots}: " + "; ".join(short) + "; lower cluster.cpus_per_worker or "
            "data.reader_cpus, or start the nodes with more --num-cpus")


def readers_per_node(cfg: RunConfig, ppus_per_node: float) -> int:
    """Readers each node starts: ``data.reader_actors``, or sized by the node's data ranks
    (the workers one node holds × the fraction of ranks that read data)."""
    c, p = cfg.cluster, cfg.parallel
    dims = ParallelDims(c.num_workers, p.tensor_model_parallel_size,
                        p.pipeline_model_parallel_size, p.context_parallel_size,
                        every_stage_reads=(cfg.model.mrope_section is not None
                                           or (cfg.data.dataset == "sft" and cfg.data.packing)))
    fraction = len(list(dims.data_ranks())) / max(1, dims.world_size)
    workers = min(c.num_workers, int(ppus_per_node // c.ppu_per_worker) if c.ppu_per_worker
                  else c.num_workers)
    return reader_pool.readers_per_node(cfg.data.reader_actors, math.ceil(workers * fraction))
