"""One checkpoint, one process group, no training: generation and format conversion.

What a path holds and at what TP × PP to open it, checked before Megatron-Core is imported
(:mod:`~ray_ppu.offline.source`); a model built from it for greedy generation
(:mod:`~ray_ppu.offline.inference`, ``generate.py``); a Hugging Face directory into a
weights-only ray_ppu checkpoint (:mod:`~ray_ppu.offline.hf_to_mcore`) and back
(:mod:`~ray_ppu.offline.mcore_to_hf`, ``convert_checkpoint.py``), and a LoRA run's checkpoint
as a PEFT adapter or a merged model (:mod:`~ray_ppu.offline.lora_export`). It sits above the
model side, :mod:`ray_ppu.checkpoint` and :mod:`ray_ppu.hf`, whose name mappings it uses;
training never imports it.
"""
