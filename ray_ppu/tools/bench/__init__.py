"""``entrypoints/benchmark.py``'s subcommands that live in the library (figures, not tests)."""
