"""Forward passes outside training: a prompt's logits, from a Hugging Face directory or a
ray_ppu (torch_dist) checkpoint, at any TP × PP on an initialised process group (one process,
or torchrun). Decoding token by token is :mod:`ray_ppu.offline.generation`'s.

A sanity check after training, not a serving engine: every new token runs the whole sequence
through Megatron's forward-only pipeline schedule again (no KV cache).

What to run and at what layout (:class:`Source`, :func:`open_source`, :func:`inference_config`)
lives in :mod:`ray_ppu.offline.source`, which imports no Megatron-Core (this module does, through
``ray_ppu.model.parallel``), so the entry points check a user's layout first; re-exported here.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from ray_ppu import checkpoint, devices
from ray_ppu.model import parallel
from ray_ppu.config.schema import RunConfig
from ray_ppu.offline.source import Source, inference_config, open_source
from ray_ppu.plan import Plan

__all__ = ["Source", "built_model", "inference_config", "load_weights", "open_source",
           "prompt_logits"]


@contextlib.contextmanager
def built_model(cfg: RunConfig, plan: Plan, backend: str,
                local_rank: int = 0) -> Iterator[list]:
    """This rank's model chunks for forward passes or conversion: bound to its device, in
    Megatron's parallel groups, zeros until weights are loaded, no DDP (no gradient buffers);
    the groups are torn down at exit."""
    from ray_ppu.model.gpt import build_model

    with devices.bound(backend, local_rank), parallel.groups(plan, cfg.training.seed):
        chunks = build_model(cfg, plan, backend, initialize=False, ddp=False)[0]
        for chunk in chunks:  # no dropout; a MoE layer at TP > 1 trains only with SP
            chunk.eval()
        yield chunks


def load_weights(chunks: list, source: Source, cfg: RunConfig, plan: Plan,
                 adapter=None, trained: Optional[str] = None) -> dict:
    """Fill the model chunks from ``source`` (each rank reads its own part), and their LoRA
    adapters from a PEFT ``adapter`` (:func:`ray_ppu.hf.peft.read_adapter`) or from the LoRA
    checkpoint ``trained`` if given (after the base: a LoRA run may have trained base parts).
    Returns a Hugging Face source's read summary (``bytes_read``; empty for a checkpoint)."""
    read = {}
    if source.kind == "hf" and cfg.vision.native:
        from ray_ppu.hf import qwen_vl

        read = qwen_vl.load_pretrained(chunks, qwen_vl.Parts.of(str(source.path)), cfg.model,
                                       cfg.vision, plan.padded_vocab_size)
    elif source.kind == "hf" and cfg.vision.enabled:
        from ray_ppu.hf import llava_weights

        read = llava_weights.load_pretrained(chunks, llava_weights.Parts.of(str(source.path)),
                                             cfg.model, cfg.vision, plan.padded_vocab_size)
    elif source.kind == "hf":
        from ray_ppu.hf.weights import load_pretrained

        read = load_pretrained(chunks, str(source.path), cfg.model, plan.padded_vocab_size)
    else:
        resume = checkpoint.ResumePoint(str(source.path), source.meta, weights_only=True)
        checkpoint.load(resume, chunks, None, None, plan, cfg)
    if adapter is not None:
        from ray_ppu.hf.peft import load_into

        load_into(chunks, adapter, cfg.model, cfg.lora, cfg.vision)
    if trained is not None:
        checkpoint.load_trained(trained, chunks)
    return read


@torch.no_grad()
def prompt_logits(chunks: list, tokens: list[int], vocab_size: int, device: torch.device,
                  images=None, positions_of: Optional[Callable] = None,
                  image_positions: Optional[int] = None) -> torch.Tensor:
    """Logits [len(tokens), vocab_size] (fp32) of every position of ``tokens``, on every rank;
    ``images``: a vision-language model's pixel values [n, 3, H, W] for the image tokens
    (Qwen2.5-VL: patches and grid_thw), ``positions_of(tokens)``: the M-RoPE positions
    [3, len(tokens)] of a model with ``mrope_section`` (else 0 … n-1). ``image_positions``:
    the prompt's length when ``tokens`` continue it: only its image tokens take the images,
    and the M-RoPE positions of the tokens after it go on from its largest, one by one (as
    transformers' decoding does).

    1. Megatron's forward-only schedule over the pipeline (one microbatch; for interleaved
       stages one per pipeline stage, all the same sequence, as the schedule needs).
    2. The last stage gathers its vocabulary slices over TP; the padding is cut off.
    3. Broadcast from the last stage to the rest of each pipeline.
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n = len(tokens)
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    if positions_of is not None:  # [3, 1, n]: temporal, height, width of the one row
        known = n if image_positions is None else image_positions
        positions = torch.as_tensor(positions_of(tokens[:known]))
        after = positions.max() + torch.arange(1, n - known + 1, dtype=positions.dtype)
        positions = torch.cat([positions, after.expand(3, -1)], 1).to(device)[:, None, :]
    else:
        positions = torch.arange(n, device=device).unsqueeze(0)
    on_device = (None if images is None else tuple(t.to(device) for t in images)
                 if isinstance(images, tuple) else images.to(device))

    def forward_step(_data, model):
        extra = {} if images is None else {"images": on_device,
                                           "image_positions": image_positions}
        output = model(ids, positions, None, **extra)

        def gather(output_tensor, non_loss_data=True):
            return tensor_parallel.gather_from_tensor_model_parallel_region(output_tensor)

        return output, gather

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    interleaved = len(chunks) > 1
    collected = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=[None] * len(chunks) if interleaved else None,
        model=chunks, num_microbatches=pp if interleaved else 1, seq_length=n, micro_batch_size=1,
        forward_only=True, collect_non_loss_data=True)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        logits = collected[0][0, :, :vocab_size].float().contiguous()
    else:
        logits = torch.empty(n, vocab_size, dtype=torch.float32, device=device)
    if pp > 1:
        dist.broadcast(logits, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                       group=parallel_state.get_pipeline_model_parallel_group())
    return logits
