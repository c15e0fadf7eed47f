"""Derived numbers of a run: parallel layout, batch arithmetic, schedule length, FLOPs, size.

Everything here is pure arithmetic on the RunConfig (no Ray, no torch), so ``--dry-run`` can
print it on a laptop and the launcher can reject a bad run before placing any worker. Field
names are Megatron-Core's (``num_microbatches``, ``train_iters``, ``lr_warmup_iters``, ...).

- :mod:`~ray_ppu.plan.layout`: TP × CP × DP × PP and elastic group sizes;
- :mod:`~ray_ppu.plan.sizes`: every size's bound, as its docstring states it;
- :mod:`~ray_ppu.plan.rules`: every cross-field rule, each problem one line;
- :mod:`~ray_ppu.plan.derived`: the numbers both the rules and the plan need;
- :mod:`~ray_ppu.plan.arithmetic`: parameters and FLOPs;
- :mod:`~ray_ppu.plan.lora`: a LoRA run's rules, what trains, and the FLOPs of a frozen base;
- :mod:`~ray_ppu.plan.build`: :class:`Plan`, :func:`build_plan`, :func:`plan_for_world`;
- :mod:`~ray_ppu.plan.memory`: what one device holds; :mod:`~ray_ppu.plan.fit`: whether that
  fits, and the nearest layout that does;
- :mod:`~ray_ppu.plan.summary`: the plan in the lines the launch logs and ``--dry-run`` prints.
"""

from ray_ppu.plan.arithmetic import attention_flops_coefficient, flops_per_iteration, stage_parameters
from ray_ppu.plan.build import Plan, build_plan, plan_for_world
from ray_ppu.plan.layout import ParallelDims, active_workers
from ray_ppu.plan.rules import problems

__all__ = ["Plan", "ParallelDims", "active_workers", "attention_flops_coefficient", "build_plan",
           "flops_per_iteration", "plan_for_world", "problems", "stage_parameters"]
