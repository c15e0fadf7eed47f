"""What the entry points run besides training: benchmarks, the demo corpus, migration."""
