"""What the entry points run besides training, one sub-package or module per program: the
benchmarks (:mod:`~ray_ppu.tools.bench`, ``benchmark.py``), the demo corpus and tokenizer
(:mod:`~ray_ppu.tools.demo`, ``make demo``), the option matrix (:mod:`~ray_ppu.tools.option_matrix`)
and the migration from a PAI-Megatron-Patch launch script (:mod:`~ray_ppu.tools.pai_migration`,
``from_pai_script.py``). The top of the house: it may use any package, and none imports it.
"""
