"""The data: corpora on disk to the microbatches each data-parallel rank trains on.

Pretraining corpora are Megatron idxmap files (``.bin`` / ``.idx``): checked without reading
them whole (:mod:`~ray_ppu.data.checks`), indexed once by Megatron-Core's own dataset builder
(:mod:`~ray_ppu.data.idxmap`), made from raw text by a Ray Data job
(:mod:`~ray_ppu.data.preprocess`). Fine-tuning corpora are raw JSON conversations, templated,
tokenized and packed by Ray Data (:mod:`~ray_ppu.data.sft`) and stored as flat columns
(:mod:`~ray_ppu.data.sft_store`). Either way the order is Megatron-LM's sampler's
(:mod:`~ray_ppu.data.sampler`) and the reader actors on each node serve every local rank by
sample id (:mod:`~ray_ppu.data.reader_pool`, :mod:`~ray_ppu.data.sample_reader`); under torchrun
the same samples are read in-process (:mod:`~ray_ppu.data.inprocess`). Below everything but the
config: no torch, and no module here imports the model or the loop.
"""
