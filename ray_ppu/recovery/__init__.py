"""Recovery: what lets a run lose seconds, not the run, when a worker, a node or a rank fails.

Every few iterations each rank's state is copied into host memory and handed to a keeper actor
on another node (:mod:`~ray_ppu.recovery.snapshot`, :mod:`~ray_ppu.recovery.snapshot_keeper`),
so a restarted group restores without reading the disk, resharded across DP when the group
changed size (:mod:`~ray_ppu.recovery.snapshot_reshard`); a rank that stops answering is found
by the driver's watchdog, which turns a silent hang into a restart with a named cause
(:mod:`~ray_ppu.recovery.watchdog`). Durable checkpoints stay in :mod:`ray_ppu.checkpoint`, which
this package builds on; the record of each restart is monitoring's
(:mod:`ray_ppu.monitor.restarts`). Nothing here imports the driver or the training loop.
"""
