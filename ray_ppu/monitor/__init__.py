"""Monitoring: what a run shows while it runs and after it ends, for people and dashboards.

Rank 0's rows go to ``metrics.jsonl`` and TensorBoard, with the one-line progress log
(:mod:`~ray_ppu.monitor.metrics_log`); the same figures become Ray gauges for Prometheus
(:mod:`~ray_ppu.monitor.ray_gauges`) and the Grafana dashboard is generated from that list
(:mod:`~ray_ppu.monitor.grafana`); every failure and restart is recorded and reported
(:mod:`~ray_ppu.monitor.restarts`); ``report.html`` is drawn from the files a run leaves
(:mod:`~ray_ppu.monitor.report`). Standard library, Ray's metrics and the files on disk only:
the training loop, recovery and the driver all write through it, and it imports none of them.
"""
