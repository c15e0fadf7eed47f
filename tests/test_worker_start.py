"""What a process that trains pays before its first step and keeps after its last one.

Every Ray Train worker of every group (restarts included) imports Megatron-Core: an import it
does not need costs each of them. A process that builds more than once (the option matrix, the
benchmarks' variants, these tests) must get each model's memory and process-group threads back
when it drops the model.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref

import torch

from test_options import built

_IMPORTS = """
import json, sys
import ray_ppu
import megatron.core.timers as timers
from megatron.core import jit
from megatron.core.fusions.fused_bias_gelu import bias_gelu
declined = ("wandb" not in sys.modules and timers.wandb is None
            and "torch.utils.tensorboard" not in sys.modules and timers.SummaryWriter is None)
import wandb  # ours still can (the W&B tracker)
from torch.utils.tensorboard import SummaryWriter  # (the TensorBoard tracker)
deferred = not any(m in sys.modules for m in ("torch._dynamo", "torch._inductor"))

import torch
@jit.jit_fuser(backend="eager")  # Megatron-Core's decorator, compiling without a C++ compiler
def gelu_plus_one(x):
    return torch.nn.functional.gelu(x) + 1
x = torch.linspace(-3, 3, 7)
same = torch.equal(gelu_plus_one(x), torch.nn.functional.gelu(x) + 1)
print(json.dumps({"declined": declined,
                  "ours": bool(wandb.__version__) and SummaryWriter.__name__ == "SummaryWriter",
                  "deferred": deferred, "fusion_named": bias_gelu.__name__, "same": same,
                  "compiled_when_called": "torch._dynamo" in sys.modules}))
"""


def test_megatron_core_loads_without_wandb_tensorboard_or_torch_compile_until_used():
    """Megatron-Core's own W&B and TensorBoard writers are unused (ray_ppu's trackers log from
    the driver): its module-level imports of wandb and torch.utils.tensorboard (0.64 s and
    0.15 s of CPU a process) are declined, ours are not. Its ``jit_fuser`` (torch.compile)
    decorates its fusions at import, which imports TorchDynamo and Inductor (1.3 s):
    ray_ppu.lean_imports makes each compile on its function's first call, so neither is
    imported by ``import megatron.core``; a decorated function, called, is compiled and gives
    the eager values."""
    proc = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {
        "declined": True, "ours": True, "deferred": True, "fusion_named": "bias_gelu",
        "same": True, "compiled_when_called": True}


def _gloo_threads() -> int:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sum(name.startswith(("pt_gloo", "gloo_")) for name in names)


def _build_run_and_drop() -> weakref.ref:
    with built("model.vocab_size=1024", "model.make_vocab_size_divisible_by=128",
               "training.seq_length=64", "training.micro_batch_size=2") as (_, _, model, optimizer):
        tokens = torch.randint(0, 1024, (2, 64))
        positions = torch.arange(64).expand(2, -1).contiguous()
        model[0](tokens, positions, None, labels=tokens).sum().backward()
        alive = weakref.ref(model[0])
    del model, optimizer  # (Megatron's optimizer holds the model chunks too)
    gc.collect()  # DDP's backward hooks make a cycle through autograd: collected, not freed
    return alive


def test_a_model_that_ran_is_freed_with_its_groups_threads():
    """Megatron-Core's rotary embedding caches its forward on the class, keyed on the module:
    without ray_ppu.model.parallel.destroy emptying it, the model (and through its DDP, its
    gloo groups: ~50 polling threads) lived as long as the process. Two builds in a row: the
    second leaves no more threads than the first (the first may start gloo's own)."""
    first = _build_run_and_drop()
    after_first = _gloo_threads()
    second = _build_run_and_drop()
    assert first() is None and second() is None
    assert _gloo_threads() <= after_first
