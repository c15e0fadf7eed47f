"""The driver side: everything between ``pretrain.py`` and a running worker group, and the only
part of ray_ppu that drives Ray.

Before it needs a cluster, the driver runs the checks ``--dry-run`` shares
(:mod:`~ray_ppu.launch.local_checks`: memory plan, data, tokenizer, starting checkpoint). It
then connects to the cluster and checks it (:mod:`~ray_ppu.launch.preflight`), writes the
run's bookkeeping (:mod:`~ray_ppu.launch.output`), starts the readers and snapshot keepers and
hands Ray Train a ``TorchTrainer`` (:mod:`~ray_ppu.launch.launcher`); Ray Train's controller gets
only what it must unpickle (:mod:`~ray_ppu.launch.train_controller`,
:mod:`~ray_ppu.launch.process_group`, both torch-free); each worker then runs
:func:`~ray_ppu.launch.ray_worker.train_worker`, which adapts Ray Train to the Ray-free
:mod:`ray_ppu.train`. ``ray job stop`` is turned into a save (:mod:`~ray_ppu.launch.job_stop`).
Imports run one way: this package uses training, recovery, the model side, monitoring, the plan
and the data; none of those imports it.
"""
