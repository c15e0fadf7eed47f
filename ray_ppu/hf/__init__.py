"""Hugging Face interop: Qwen2 / Qwen3 (dense) / LLaMA checkpoints in, Hugging Face
checkpoints out.

Data flow, one module per arrow::

    config.json            -> config.py   ModelConfig (derived, or checked against the preset)
    *.safetensors (+index) -> files.py    header-only checks, slice reads, sharded writes
    HF tensor <-> Megatron -> weights.py  the name and layout mapping, per-rank loading
    PEFT adapter <-> LoRA  -> peft.py     q/k/v and gate/up adapters <-> fused ones, both ways

The conversions built on them (a Hugging Face directory into a weights-only torch_dist
checkpoint, and a torch_dist checkpoint back, one layer at a time) are
:mod:`ray_ppu.offline.hf_to_mcore` and :mod:`ray_ppu.offline.mcore_to_hf`.

Training loads through ``checkpoint.pretrained`` (``ray_ppu.train.rank``); generation through
``ray_ppu.offline.inference``; users through ``entrypoints/convert_checkpoint.py`` and ``generate.py``.

The Megatron side is always the *layout-independent* form that ``dist_checkpointing`` stores
(``decoder.layers.self_attention.linear_qkv.weight`` with a leading layer axis, the whole
vocabulary, every TP shard put together): a model at any TP / PP / virtual PP describes which
region of it each of its parameters holds (``sharded_state_dict()``), so one mapping serves
every layout.
"""
