"""``entrypoints/benchmark.py``'s subcommands, which live in the library (figures, not tests).

One module per subcommand: overhead, data_path (``data``), sft, metrics_export (``metrics``),
options, device, moe (its torchrun ranks in moe_rank, the dispatcher timing in
dispatch_clock), and the two multi-node scenarios recovery (its figures in recovery_figures)
and elastic, whose harness (the simulated PPU cluster, the child process) is scenario.py and
which tests/faults/scenarios.py runs for the fault tests too. Each module has ``HELP``,
``add_arguments(parser)`` and ``main(args)``; what several share is in common.py. ``hf-load``
is entrypoints/hf_benchmark.py (also its torchrun ranks' script).
"""
