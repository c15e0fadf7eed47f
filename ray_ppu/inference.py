"""Forward passes outside training: a prompt's logits and greedy decoding, from a Hugging Face
directory or a ray_ppu (torch_dist) checkpoint, at any TP × PP on an initialised process group
(one process, or torchrun).

A sanity check after training, not a serving engine: every new token runs the whole sequence
through Megatron's forward-only pipeline schedule again (no KV cache).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal, Optional

import torch
import torch.distributed as dist

from ray_ppu import checkpoint, devices, parallel
from ray_ppu.errors import ConfigError
from ray_ppu.config.schema import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
)
from ray_ppu.plan import Plan, build_plan


@dataclass(frozen=True)
class Source:
    """Weights to run: a Hugging Face directory or a complete ray_ppu checkpoint."""

    path: Path
    kind: Literal["hf", "mcore"]
    model: ModelConfig
    meta: Optional[checkpoint.Meta] = None
    hf_config: Optional[dict] = None
    """hf: the parsed config.json."""

    @property
    def hf_dir(self) -> Optional[Path]:
        """The Hugging Face directory behind it (its tokenizer), if known and still there."""
        if self.kind == "hf":
            return self.path
        source = self.meta.hf_source if self.meta else None
        return Path(source) if source and Path(source).is_dir() else None


def open_source(path: str | Path) -> Source:
    """What ``path`` holds: a Hugging Face directory (config.json + safetensors, its tensors
    checked against config.json) or a checkpoint (or a directory of them: the latest complete
    one)."""
    from ray_ppu.hf import config as hf_config
    from ray_ppu.hf.files import INDEX_FILE, SINGLE_FILE

    path = Path(path).expanduser().resolve()
    if (path / hf_config.CONFIG_FILE).is_file() and any(
            (path / f).is_file() for f in (SINGLE_FILE, INDEX_FILE)):
        from ray_ppu.hf.weights import check_checkpoint

        raw = hf_config.read(path)
        model = hf_config.model_from_hf(raw, str(path / hf_config.CONFIG_FILE))
        check_checkpoint(str(path), model)  # headers only: before any model is built
        return Source(path, "hf", model, hf_config=raw)
    meta = checkpoint.read_meta(path)
    if meta is None:
        found = checkpoint.latest(path)
        if found is None:
            raise ConfigError(f"{path}: neither a Hugging Face model directory (config.json + "
                              f"safetensors) nor a complete ray_ppu checkpoint (or a directory "
                              f"of them)")
        path, meta = found
    if meta.model is None:
        raise ConfigError(f"{path} does not record its model config (saved by an older "
                          f"ray_ppu): load it in a run (checkpoint.load) and save it again")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    model = ModelConfig(**{k: v for k, v in meta.model.items() if k in known})
    return Source(path, "mcore", model, meta)


def inference_config(model: ModelConfig, world_size: int, tp: int = 1, pp: int = 1,
                     layers_per_virtual_stage: Optional[int] = None,
                     precision: str = "fp32", device: str = "auto", ep: int = 1,
                     etp: Optional[int] = None) -> tuple[RunConfig, Plan]:
    """A RunConfig and Plan for forward passes of ``model`` at TP × PP (DP = the rest), a MoE
    model's experts at EP × ETP (ETP None: TP)."""
    cfg = RunConfig(
        model=model,
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                num_layers_per_virtual_pipeline_stage=layers_per_virtual_stage,
                                sequence_parallel=False, expert_model_parallel_size=ep,
                                expert_tensor_parallel_size=etp),
        # one sequence per DP replica (a replica beyond the first repeats the first's work)
        training=TrainingConfig(micro_batch_size=1,
                                global_batch_size=max(world_size // (tp * pp), 1),
                                seq_length=model.max_position_embeddings, train_iters=1,
                                eval_iters=0, precision=precision,
                                use_distributed_optimizer=False),
        cluster=ClusterConfig(num_workers=world_size, device=device),
        data=DataConfig(data_path=["(inference: no data)"]),
    )
    return cfg, build_plan(cfg, forward_only=True)


@contextlib.contextmanager
def built_model(cfg: RunConfig, plan: Plan, backend: str,
                local_rank: int = 0) -> Iterator[list]:
    """This rank's model chunks for forward passes or conversion: bound to its device, in
    Megatron's parallel groups, zeros until weights are loaded, no DDP (no gradient buffers);
    the groups are torn down at exit."""
    from ray_ppu.model import build_model

    with devices.bound(backend, local_rank):
        parallel.initialize(plan, cfg.training.seed)
        try:
            yield build_model(cfg, plan, backend, initialize=False, ddp=False)[0]
        finally:
            parallel.destroy()


def load_weights(chunks: list, source: Source, cfg: RunConfig, plan: Plan) -> None:
    """Fill the model chunks from ``source`` (each rank reads its own part)."""
    if source.kind == "hf":
        from ray_ppu.hf.weights import load_pretrained

        load_pretrained(chunks, str(source.path), cfg.model, plan.padded_vocab_size)
    else:
        resume = checkpoint.ResumePoint(str(source.path), source.meta, weights_only=True)
        checkpoint.load(resume, chunks, None, None, plan, cfg)


@torch.no_grad()
def prompt_logits(chunks: list, tokens: list[int], vocab_size: int,
                  device: torch.device) -> torch.Tensor:
    """Logits [len(tokens), vocab_size] (fp32) of every position of ``tokens``, on every rank.

    1. Megatron's forward-only schedule over the pipeline (one microbatch; for interleaved
       stages one per pipeline stage, all the same sequence, as the schedule needs).
    2. The last stage gathers its vocabulary slices over TP; the padding is cut off.
    3. Broadcast from the last stage to the rest of each pipeline.
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n = len(tokens)
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    positions = torch.arange(n, device=device).unsqueeze(0)

    def forward_step(_data, model):
        output = model(ids, positions, None)

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


def greedy(chunks: list, prompt: list[int], vocab_size: int, device: torch.device,
           max_new_tokens: int, stop: tuple[int, ...] = ()) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation of ``prompt`` (up to ``max_new_tokens``, ending early at a ``stop``
    id), and the prompt's own logits [len(prompt), vocab_size]."""
    ids = list(prompt)
    first = None
    for _ in range(max_new_tokens):
        logits = prompt_logits(chunks, ids, vocab_size, device)
        if first is None:
            first = logits
        token = int(logits[-1].argmax())
        ids.append(token)
        if token in stop:
            break
    if first is None:
        first = prompt_logits(chunks, ids, vocab_size, device)
    return ids[len(prompt):], first
