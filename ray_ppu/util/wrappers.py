"""The model inside Megatron's wrappers (DDP, Float16Module), without importing Megatron: the
checkpoint, snapshot and Hugging Face code all need it, and the driver imports the first two."""


def unwrap(chunk):
    """The GPTModel inside Megatron's DDP wrapper: DDP has no sharded_state_dict of its own,
    so the default one would prefix every key with ``module.``; GPTModel's keys are Megatron's
    canonical ones (``decoder.layers.…``), the ones other Megatron tools read."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk
