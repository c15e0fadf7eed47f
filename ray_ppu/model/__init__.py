"""The model side: a RunConfig and Plan turned into Megatron-Core objects on an initialised
process group.

Parallel state and seeds (:mod:`~ray_ppu.model.parallel`), the ``TransformerConfig`` /
``DistributedDataParallelConfig`` / ``OptimizerConfig`` arguments derived from the config
(:mod:`~ray_ppu.model.megatron_settings`), the GPT model with its layer spec, TE or local
(:mod:`~ray_ppu.model.gpt`, MoE pieces in :mod:`~ray_ppu.model.moe_layers`), and the optimizer
with its schedule (:mod:`~ray_ppu.model.optim`); LoRA's adapters on the parallel linears and
the frozen base (:mod:`~ray_ppu.model.lora`); a vision-language model's ViT and projector
around the GPT model (:mod:`~ray_ppu.model.vision_language`) and its pixel values made on the
device (:mod:`~ray_ppu.model.pixels`). It knows nothing of Ray, data or checkpoints:
training (:mod:`ray_ppu.train`) and the one-process tools (:mod:`ray_ppu.offline`) call it.
This face imports nothing, so the config-only modules stay light to import.
"""
