"""What a forward-only run (generation, conversion) runs and at what layout, checked before
anything heavy is imported: the weights a path holds (:class:`Source`, :func:`open_source`) and
the RunConfig + Plan for a TP × PP over a world (:func:`inference_config`).

Split from :mod:`ray_ppu.offline.inference` because that module imports Megatron-Core (through
``ray_ppu.model.parallel``), 8 s per process here: a user's impossible ``--tp`` under torchrun should be
one error line in a second, not after every rank has imported Megatron-Core. Nothing here
imports Megatron-Core; torch only comes in with the readers that need it (the safetensors header
check, the checkpoint package), inside :func:`open_source`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional

from ray_ppu.config.schema import (
    ClusterConfig,
    LoraConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
    VisionConfig,
)
from ray_ppu.errors import ConfigError
from ray_ppu.plan import Plan, build_plan

if TYPE_CHECKING:
    from ray_ppu.checkpoint import Meta


@dataclass(frozen=True)
class Source:
    """Weights to run: a Hugging Face directory or a complete ray_ppu checkpoint."""

    path: Path
    kind: Literal["hf", "mcore"]
    model: ModelConfig
    meta: Optional[Meta] = None
    hf_config: Optional[dict] = None
    """hf: the parsed config.json."""
    vision: VisionConfig = VisionConfig()
    """A vision-language model's vision section (encoder None: a text model)."""

    @property
    def hf_dir(self) -> Optional[Path]:
        """The Hugging Face directory behind it (its tokenizer), if known and still there."""
        if self.kind == "hf":
            return self.path
        source = self.meta.hf_source if self.meta else None
        return Path(source) if source and Path(source).is_dir() else None

    @property
    def processor_dir(self) -> Optional[Path]:
        """Where its tokenizer, chat template and image processor are: a checkpoint's own
        copies (:mod:`ray_ppu.checkpoint.processor`), else :attr:`hf_dir`."""
        if self.kind == "mcore":
            from ray_ppu.checkpoint.processor import carried

            own = carried(self.path)
            if own is not None:
                return own
        return self.hf_dir


def open_source(path: str | Path) -> Source:
    """What ``path`` holds: a Hugging Face directory (config.json + safetensors, its tensors
    checked against config.json) or a checkpoint (or a directory of them: the latest complete
    one)."""
    from ray_ppu.hf import config as hf_config, llava
    from ray_ppu.hf.files import INDEX_FILE, SINGLE_FILE

    path = Path(path).expanduser().resolve()
    if (path / hf_config.CONFIG_FILE).is_file() and any(
            (path / f).is_file() for f in (SINGLE_FILE, INDEX_FILE)):
        from ray_ppu.hf.weights import check_checkpoint

        raw = hf_config.read(path)
        where = str(path / hf_config.CONFIG_FILE)
        if raw.get("model_type") == "qwen2_5_vl":
            from ray_ppu.hf import qwen_vl

            # the tower from config.json, the pixel bounds from preprocessor_config.json
            model, vision = qwen_vl.qwen_vl_from_hf(raw, where)[0], qwen_vl.directory_vision(path)
            qwen_vl.Parts.of(str(path)).check(model, vision)
            return Source(path, "hf", model, hf_config=raw, vision=vision)
        if llava.is_llava(raw):
            from ray_ppu.hf.llava_weights import Parts

            model, vision = llava.llava_from_hf(raw, where)
            Parts.of(str(path)).check(model, vision)
            return Source(path, "hf", model, hf_config=raw, vision=vision)
        model = hf_config.model_from_hf(raw, where)
        check_checkpoint(str(path), model)  # headers only: before any model is built
        return Source(path, "hf", model, hf_config=raw)
    from ray_ppu import checkpoint  # the package imports torch: only for this branch

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
    vision = VisionConfig(**meta.vision) if meta.vision else VisionConfig()
    return Source(path, "mcore", model, meta, vision=vision)


def inference_config(model: ModelConfig, world_size: int, tp: int = 1, pp: int = 1,
                     layers_per_virtual_stage: Optional[int] = None,
                     precision: str = "fp32", device: str = "auto", ep: int = 1,
                     etp: Optional[int] = None, lora: Optional[LoraConfig] = None,
                     sequence_parallel: bool = False,
                     vision: Optional[VisionConfig] = None) -> tuple[RunConfig, Plan]:
    """A RunConfig and Plan for forward passes of ``model`` at TP × PP (DP = the rest), a MoE
    model's experts at EP × ETP (ETP None: TP), with ``lora``'s adapters if given, and
    ``vision``'s encoder and projector for a vision-language model."""
    cfg = RunConfig(
        model=model,
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                num_layers_per_virtual_pipeline_stage=layers_per_virtual_stage,
                                sequence_parallel=sequence_parallel,
                                expert_model_parallel_size=ep, expert_tensor_parallel_size=etp),
        # one sequence per DP replica (a replica beyond the first repeats the first's work)
        training=TrainingConfig(micro_batch_size=1,
                                global_batch_size=max(world_size // (tp * pp), 1),
                                seq_length=model.max_position_embeddings, train_iters=1,
                                eval_iters=0, precision=precision,
                                use_distributed_optimizer=False),
        cluster=ClusterConfig(num_workers=world_size, device=device),
        data=DataConfig(data_path=["(inference: no data)"]),
        lora=lora or LoraConfig(),
        # nothing frozen: forward passes, or a conversion that must write every part
        vision=(vision or VisionConfig()).with_(freeze=[]),
    )
    return cfg, build_plan(cfg, forward_only=True)


def lora_base(source: Source, base: Optional[str] = None) -> str:
    """The directory of a LoRA checkpoint's base (generation, merging): ``base`` if given
    (where it is now: its fingerprint must be the recorded one, adapters on another base are
    meaningless), else the recorded path, which must still be there."""
    from ray_ppu.checkpoint.base import fingerprint

    recorded = source.meta.base or {}
    if base is None:
        path = recorded.get("path")
        if not path or not Path(path).is_dir():
            raise ConfigError(f"{source.path} holds LoRA adapters; their base {path} is not "
                              f"there: pass --base DIR where it is now")
        return path
    found = Path(base).expanduser().resolve()
    if not found.is_dir():
        raise ConfigError(f"--base {base}: no such directory")
    if recorded.get("kind") == "mcore":
        opened = open_source(found)  # a directory of checkpoints: the latest, as training
        found = opened.path if opened.kind == "mcore" else found
    ours = fingerprint(found) if recorded.get("fingerprint") else None
    if ours is not None and ours != recorded["fingerprint"]:
        raise ConfigError(f"--base {base}: not the base {source.path} was trained on (its "
                          f"fingerprint {ours} is not the recorded "
                          f"{recorded['fingerprint']} of {recorded.get('path')})")
    return str(found)
