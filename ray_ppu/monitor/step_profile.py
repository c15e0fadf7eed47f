"""Where a training step's time goes: ``output.profile_iters`` iterations under torch's profiler
on rank 0, summed into the categories a person tunes by.

MFU says how far a run is from the device's peak; this says why. Each kernel (on a device:
its device time; on the CPU: each operator's own CPU time) is filed under the first category
its call stack names, outermost scopes first, then the operator itself:

* **attention** (core attention: SDPA, varlen, flash, Megatron's softmax path), **loss** (the
  output layer and cross entropy), **optimizer** (the step, clipping, parameter all-gather),
  **communication** (NCCL / gloo collectives), from the scopes and autograd nodes around them;
* then by the operator: **GEMMs** (linear layers, the experts' grouped GEMMs), **norms**,
  **copies** (copies, casts, concatenation, permutes made contiguous), **elementwise / other**.

The wall-clock time of the profiled iterations minus the kernels' time is reported as
**idle** (launch gaps, host synchronisation, the CPU not keeping the device busy). The table
goes to ``<output>/profile.txt``, the numbers to ``<output>/profile.json``.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Optional

import torch

SCOPES = {  # category ← lower-case substrings of an enclosing scope or autograd node
    "attention": ("core_attention", "attention", "sdpa", "flash", "varlen", "fmha",
                  "scaledmaskedsoftmax"),
    "loss": ("ray_ppu.loss", "chunkedcrossentropy", "crossentropy", "vocab_parallel"),
    "optimizer": ("ray_ppu.optimizer", "optimizer", "adam", "multi_tensor", "clip_grad"),
    "communication": ("nccl", "c10d::", "all_reduce", "allreduce", "all_gather", "allgather",
                      "reduce_scatter", "broadcast", "gloo"),
}
OPERATORS = {  # then by the operator's own name
    "GEMMs": ("mm", "matmul", "linear", "gemm", "grouped", "cublas", "cutlass", "xmma", "nvjet",
              "baddbmm"),
    "norms": ("rms_norm", "layer_norm", "norm"),
    "copies": ("copy", "cat", "contiguous", "clone", "_to_copy", "memcpy", "stack", "index",
               "scatter", "gather"),
}
CATEGORIES = [*SCOPES, *OPERATORS, "elementwise / other"]


def category(names: list[str]) -> str:
    """The category of a kernel whose call stack, innermost first, is ``names``."""
    lowered = [n.lower() for n in names]
    for name in reversed(lowered):  # outermost scope first
        for cat, keys in SCOPES.items():
            if any(key in name for key in keys):
                return cat
    for name in lowered:  # then the operator nearest the kernel
        for cat, keys in OPERATORS.items():
            if any(key in name for key in keys):
                return cat
    return "elementwise / other"


def _stack(event) -> list[str]:
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def summarize(events, wall_s: float, iterations: int, device: bool) -> dict:
    """Per-iteration milliseconds by category from the profiler's function events."""
    times = dict.fromkeys(CATEGORIES, 0.0)
    top: dict[str, dict[str, float]] = {c: {} for c in CATEGORIES}
    for event in events:
        if device:
            spans = [(k.name, k.duration) for k in getattr(event, "kernels", [])]
        else:
            spans = [(event.name, event.self_cpu_time_total)] if event.self_cpu_time_total else []
        if not spans:
            continue
        cat = category(_stack(event))
        for name, us in spans:
            times[cat] += us / 1e3
            top[cat][name] = top[cat].get(name, 0.0) + us / 1e3
    busy = sum(times.values())
    per = {c: t / iterations for c, t in times.items()}
    step_ms = 1e3 * wall_s / iterations
    return {"iterations": iterations, "step_ms": step_ms, "device_time": device,
            "ms_per_iteration": per, "idle_ms": max(0.0, step_ms - busy / iterations),
            "top": {c: sorted(((n, t / iterations) for n, t in top[c].items()),
                              key=lambda x: -x[1])[:3] for c in CATEGORIES}}


def table(summary: dict) -> str:
    """The summary as lines: each category's ms per iteration and share of the step."""
    step = summary["step_ms"]
    lines = [f"{'category':<22}{'ms/iter':>10}{'share':>8}  top kernels",
             f"{'step (wall clock)':<22}{step:>10.2f}{'100%':>8}"]
    rows = [*summary["ms_per_iteration"].items(), ("idle", summary["idle_ms"])]
    for name, ms in sorted(rows, key=lambda r: -r[1]):
        tops = ", ".join(f"{n[:40]} {t:.1f}" for n, t in summary["top"].get(name, [])[:2])
        lines.append(f"{name:<22}{ms:>10.2f}{ms / step:>8.1%}  {tops}")
    return "\n".join(lines)


class StepProfiler:
    """Profiles iterations ``first .. first + count − 1`` of this rank's loop (1-based, as the
    loop counts them done) and writes the summary under ``out``."""

    def __init__(self, out: str | Path, count: int, first: int = 3) -> None:
        self.out, self.count, self.first = Path(out), count, first
        self._profiler: Optional[torch.profiler.profile] = None
        self._started = 0.0

    @contextlib.contextmanager
    def iteration(self, done: int):
        """Around the step that makes ``done`` iterations done."""
        if done == self.first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                torch.cuda.synchronize()
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.__enter__()
            self._started = time.perf_counter()
        try:
            yield
        finally:
            if self._profiler is not None and done == self.first + self.count - 1:
                self.finish()

    def finish(self) -> None:
        """Stop profiling and write the summary (of the iterations profiled so far, if the
        loop ended before the last one); nothing when not profiling."""
        if self._profiler is None:
            return
        device = torch.cuda.is_available()
        if device:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._started
        self._profiler.__exit__(None, None, None)
        profiled = sum(1 for e in self._profiler.events() if e.name == "ray_ppu.optimizer")
        summary = summarize(self._profiler.events(), wall, max(1, profiled), device)
        self._profiler = None
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "profile.json").write_text(json.dumps(summary, indent=2))
        (self.out / "profile.txt").write_text(table(summary) + "\n")
