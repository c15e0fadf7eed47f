"""``benchmark.py recovery``'s figures: from the scenario's result and its timestamped output
lines to the time from the node loss to the first completed iteration after it (detection,
worker-group restart, checkpoint load, first step), the iterations lost, and the checkpoint
save/load throughput against the raw write/read speed of the same disk.

The spans are between log lines the parent timestamped as they arrived (the controller's, Ray
core's, rank 0's "loaded ... in ... s"); the throughput is the bytes of each saved directory
that still exists divided by the save time rank 0 logged.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from pathlib import Path

from ray_ppu.tools.bench.common import metrics_rows, write_json
from ray_ppu.tools.bench.scenario import LOSS_AFTER

_ASCTIME = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
_LOADED = re.compile(_ASCTIME + r" loaded (\S+) in ([\d.]+) s: training continues at iteration (\d+)")
_SAVED = re.compile(_ASCTIME + r" checkpoint at iteration (\d+) saved to (\S+) in ([\d.]+) s")
# Ray Train V2's controller on a worker-group failure (its log lines reach the driver's output).
_DETECTED = re.compile(r"Training failed due to worker errors|health check failed|ActorDiedError")
_ATTEMPT = re.compile(r"Attempting to start training worker group")
_STARTED = re.compile(r"Started training worker group")


def report(res: dict, lines: list[tuple[float, str]], start: float, hard: bool,
           json_path: str | None) -> dict:
    """The figures into ``res`` (under "figures", the headline ones at the top level too),
    printed, and ``res`` written to ``json_path``."""
    res["total_wall_s"] = time.time() - start
    res["hard"] = hard
    if "removed" not in res["events"]:
        raise SystemExit("the node was never removed: the run ended before the checkpoint at "
                         f"iteration {LOSS_AFTER} was complete")
    t_loss = _loss_time(res["events"])
    loads = [(_asctime(m[1]), m[2], float(m[3]), int(m[4]))
             for _, l in lines if (m := _LOADED.search(l))]
    load = next((x for x in loads if x[0] > t_loss), None)
    saves = [(_asctime(m[1]), int(m[2]), m[3], float(m[4]))
             for _, l in lines if (m := _SAVED.search(l))]
    figures = _timings(res, lines, load)
    figures.update(_throughput(res, saves, load))
    res["figures"] = figures
    # the headline figures at the top level too
    res.update({k: figures[k] for k in ("recovery_s", "iterations_lost", "restored_from",
                                        "snapshot_blocking_s", "save_vs_raw_write")})
    _print(figures, res)
    if json_path:
        write_json(json_path, res, indent=1)
    return res


def _loss_time(events: dict) -> float:
    """When the node started going: the remove_node call (its processes get their signal at
    once; Ray Train can see the failure before the call returns)."""
    return events.get("loss_start", events["removed"])


def _timings(res: dict, lines: list[tuple[float, str]], load) -> dict:
    """Loss → detection → group restart → load → first step, and the iterations lost."""
    ev = res["events"]
    t_loss = _loss_time(ev)
    rows = metrics_rows(Path(res["dir"]))
    train = [r for r in rows if "lm_loss" in r]
    before = [r for r in train if r["time"] <= t_loss]
    last_before = max((r["iteration"] for r in before), default=0)
    resumed_at = res["stream_start"]["iteration"]
    after = [r for r in train if r["time"] > t_loss]
    first_after = after[0] if after else None
    # Detection: the first line after the loss that is about the failure (controller / Ray core),
    # else the restarted group's rank 0 writing stream_start.json.
    detect_line = next(((t, l) for t, l in lines
                        if t > t_loss and "RECOVERY" not in l and _DETECTED.search(l)), None)
    t_detect = detect_line[0] if detect_line else res["stream_start_mtime"]
    t_attempt = next((t for t, l in lines if t > t_loss and _ATTEMPT.search(l)), None)
    t_started = next((t for t, l in lines if t > t_loss and _STARTED.search(l)), None)
    t_load_end = load[0] if load else None
    t_load_start = t_load_end - load[2] if load else None
    t_first = first_after["time"] if first_after else None

    def span(a, b):
        return None if a is None or b is None else b - a

    figures = {
        "detection_s": span(t_loss, t_detect),
        "group_restart_s": span(t_detect, t_load_start),
        "restart_attempt_after_detection_s": span(t_detect, t_attempt),
        "group_started_after_detection_s": span(t_detect, t_started),
        "stream_start_written_after_loss_s": span(t_loss, res["stream_start_mtime"]),
        "checkpoint_load_s": load[2] if load else None,
        "first_step_s": span(t_load_end, t_first),
        "recovery_s": span(t_loss, t_first),
        "remove_node_call_s": ev["removed"] - ev["loss_start"],
        "last_iteration_before_loss": last_before,
        "resumed_from_iteration": resumed_at,
        "iterations_lost": last_before - resumed_at,
        "restored_from": next((r.get("restored_from") for r in rows
                               if r.get("event") == "restart"), None),
        "snapshot_blocking_s": (statistics.median(b) if (b := [
            r["snapshot_blocking_s"] for r in train if "snapshot_blocking_s" in r]) else None),
        "detect_line": (re.sub(r"\x1b\[[0-9;]*m", "", detect_line[1])[:200] if detect_line
                        else "(stream_start.json mtime)"),
    }
    if "drained" in ev:  # --drain: the preemption notice → the checkpoint it caused
        figures["drain_saved_iteration"] = ev.get("drain_saved_iteration")
        figures["drain_to_saved_s"] = span(ev["drained"], ev.get("drain_saved"))
    return figures


def _throughput(res: dict, saves: list, load) -> dict:
    """Checkpoint save and load bytes/s beside the raw disk's."""
    figures: dict = {}
    # Bytes of each saved directory that still exists ÷ its logged time.
    ckpt_bytes, save_rates = 0, []
    for _, iteration, path, secs in saves:
        if Path(path).is_dir() and secs > 0:
            b = _dir_bytes(Path(path))
            ckpt_bytes = max(ckpt_bytes, b)
            save_rates.append(b / secs)
    if load and Path(load[1]).is_dir():
        ckpt_bytes = ckpt_bytes or _dir_bytes(Path(load[1]))
        figures["load_Bps"] = _dir_bytes(Path(load[1])) / max(load[2], 1e-9)
    figures["checkpoint_bytes"] = ckpt_bytes
    figures["save_times_s"] = [s[3] for s in saves]
    figures["save_Bps"] = statistics.median(save_rates) if save_rates else None
    figures["save_best_Bps"] = max(save_rates) if save_rates else None  # least disturbed save
    write, read = raw_disk_speed(Path(res["root"]), ckpt_bytes)
    figures.update(raw_write_Bps=write, raw_read_Bps=read)
    figures["save_vs_raw_write"] = (figures["save_Bps"] / write
                                    if figures["save_Bps"] and write else None)
    return figures


def _print(f: dict, res: dict) -> None:
    def sec(x):
        return "   n/a" if x is None else f"{x:6.1f} s"

    def mbs(x):
        return "n/a" if x is None else f"{x / 1e6:,.0f} MB/s"

    rec = f["recovery_s"]
    ratio = (f["save_Bps"] / f["raw_write_Bps"]) if f["save_Bps"] else None
    if "drain_to_saved_s" in f:
        print(f"\ndrain notice → checkpoint at iteration {f['drain_saved_iteration']} "
              f"{sec(f['drain_to_saved_s'])}; then the node was removed")
    lost_ok = f["iterations_lost"] <= 1
    print(f"\nnode loss → first completed iteration after it (tiny model, DP 2, "
          f"{'SIGKILL' if res.get('hard') else 'node removed'}):")
    print(f"  detection (loss → Ray Train notices)     {sec(f['detection_s'])}"
          f"   [{f['detect_line'][:90]}]")
    print(f"  worker-group restart                     {sec(f['group_restart_s'])}"
          f"   (restart attempted +{sec(f['restart_attempt_after_detection_s']).strip()},"
          f" group started +{sec(f['group_started_after_detection_s']).strip()},"
          f" then workers build the model until the load starts)")
    print(f"  restore from {f['restored_from'] or 'scratch':<8}                    "
          f"{sec(f['checkpoint_load_s'])}")
    print(f"  first step                               {sec(f['first_step_s'])}")
    print(f"  total recovery                           {sec(rec)}   target ≤ 10 s: "
          f"{'OK' if rec is not None and rec <= 10 else 'MISSED'}")
    print(f"  iterations lost  {f['last_iteration_before_loss']} reached − restored "
          f"{f['resumed_from_iteration']} = {f['iterations_lost']}   target ≤ 1: "
          f"{'OK' if lost_ok else 'MISSED'}")
    if f["snapshot_blocking_s"] is not None:
        print(f"  in-memory snapshot: training blocked {1e3 * f['snapshot_blocking_s']:.1f} ms "
              f"per snapshot (median)")
    print(f"checkpoint {f['checkpoint_bytes'] / 1e6:.1f} MB; save times {f['save_times_s']} s "
          f"(logged to 0.1 s)")
    print(f"  save  {mbs(f['save_Bps']):>14}  (median) vs raw write (fsync) {mbs(f['raw_write_Bps'])}"
          f"  = {'n/a' if ratio is None else f'{100 * ratio:.0f} %'}   target ≥ 50 %: "
          f"{'OK' if ratio is not None and ratio >= 0.5 else 'MISSED'}")
    if f.get("save_best_Bps"):
        print(f"  save (fastest of the saves) {mbs(f['save_best_Bps'])} = "
              f"{100 * f['save_best_Bps'] / f['raw_write_Bps']:.0f} % of raw write")
    print(f"  load  {mbs(f.get('load_Bps')):>14}  vs raw read (cache dropped) "
          f"{mbs(f['raw_read_Bps'])}")
    print(f"wall: interrupted run {res['wall_s']:.1f} s"
          + (f", reference {res['reference_wall_s']:.1f} s" if "reference_wall_s" in res else "")
          + f", all {res['total_wall_s']:.1f} s")


def _asctime(text: str) -> float:
    import datetime

    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def raw_disk_speed(directory: Path, size: int) -> tuple[float, float]:
    """(write, read) bytes/s of ``directory``'s disk: a ``size``-byte file written with fsync,
    dropped from the page cache, read back."""
    size = max(size, 16 << 20)
    chunk = os.urandom(4 << 20)
    path = Path(directory) / "raw_disk_probe.bin"
    try:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            written = 0
            while written < size:
                f.write(chunk)
                written += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        write = written / (time.perf_counter() - t0)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: really dropped
        finally:
            os.close(fd)
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(4 << 20):
                pass
        read = written / (time.perf_counter() - t0)
    finally:
        path.unlink(missing_ok=True)
    return write, read
