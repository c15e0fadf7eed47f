"""One training rank, Ray-free: the same code under Ray Train and under torchrun.

- :mod:`~ray_ppu.train.rank`: :func:`~ray_ppu.train.rank.train_rank`, one process from device
  binding to the last save (parallel state → model → optimizer → state loaded → loop);
- :mod:`~ray_ppu.train.loop`: :func:`~ray_ppu.train.loop.train`, iterations with their hooks
  (rows, validation, saves);
- :mod:`~ray_ppu.train.schedule`: a global batch through Megatron-Core's forward-backward
  function, losses reduced over DP, validation;
- :mod:`~ray_ppu.train.batch`: one microbatch to Megatron's ``forward_step`` contract.
"""
