"""The run configuration: typed sections with a docstring on every field.

Field names follow Megatron-Core (``TransformerConfig``, ``OptimizerConfig``,
``initialize_model_parallel``) wherever Megatron has a name for the thing, so a Megatron user
can read a config file without a dictionary, and ``--dry-run`` output matches Megatron's words.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from ray_ppu.config.lora import LoraConfig  # noqa: F401 (a section of RunConfig)
from ray_ppu.config.vision import VisionConfig  # noqa: F401 (a section of RunConfig)
from ray_ppu.config.model import ModelConfig  # noqa: F401 (a section of RunConfig)


@dataclass(frozen=True)
class ParallelConfig:
    """How the world is cut into Megatron-Core parallel groups (DP is derived)."""

    tensor_model_parallel_size: int = 1
    """TP: each layer's matrices split across this many devices (keep within a node). [≥ 1]"""
    pipeline_model_parallel_size: int = 1
    """PP: layers split into this many sequential stages. [≥ 1]"""
    context_parallel_size: int = 1
    """CP: the sequence split across this many devices (needs Transformer Engine). [≥ 1]"""
    sequence_parallel: bool = False
    """Shard LayerNorm/dropout activations along the sequence inside the TP group (TP > 1 only)."""
    expert_model_parallel_size: int = 1
    """EP: a MoE layer's experts split across this many devices, each holding
    num_moe_experts / EP whole experts; tokens travel to their experts' devices. EP × ETP
    ranks are carved out of the TP × CP × DP ones (Megatron-Core's expert layout). [≥ 1]"""
    expert_tensor_parallel_size: Optional[int] = None
    """ETP: each expert's matrices split across this many devices; None = TP (Megatron-Core's
    default). 1 is the usual choice with EP (Pai-Megatron-Patch's Qwen3-MoE examples). [≥ 1]"""
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach their experts' EP ranks: all-to-all exchanges of the routed tokens
    (Megatron-Core's choice for EP > 1), or all-gathering every token (fewer, larger messages)."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Interleaved pipeline: layers per virtual stage (reference MP_VP); None = not interleaved. [≥ 1]"""
    overlap_grad_reduce: bool = True
    """Reduce-scatter / all-reduce gradient buckets while the backward pass goes on (Megatron
    DDP). Pai-Megatron-Patch's run_mcore_qwen.sh turns it on; the PAI guide's no-overlap copy
    of it does not pass it (from_pai_script.py writes false for that script)."""
    overlap_param_gather: bool = True
    """With the distributed optimizer: all-gather updated parameters bucket by bucket during the
    next forward pass instead of after the optimizer step (on in run_mcore_qwen.sh, as
    overlap_grad_reduce; no effect without the distributed optimizer)."""
    ddp_bucket_size: Optional[int] = None
    """Parameters per bucket of Megatron DDP's gradient reductions and parameter gathers
    (Megatron-LM's --ddp-bucket-size); None = Megatron-Core's default, max(40 M, 1 M × DP). [≥ 1]"""


@dataclass(frozen=True)
class TrainingConfig:
    """Batch sizes, length of training, optimizer and schedule."""

    micro_batch_size: int = 1
    """Samples per forward/backward pass on one DP rank. [≥ 1]"""
    global_batch_size: int = 8
    """Samples per optimizer step across all DP ranks (= micro × DP × microbatches). [≥ 1]"""
    seq_length: int = 128
    """Tokens per sample. [≥ 1]"""
    train_tokens: Optional[int] = None
    """Pretraining length in tokens; train_iters = train_tokens // global_batch_size //
    seq_length. Set this or train_iters, not both. [≥ 1]"""
    train_iters: Optional[int] = None
    """Training length in iterations. Set this or train_tokens, not both (a command-line
    override of one replaces the other from the file, with a note). [≥ 1]"""
    lr_warmup_tokens: Optional[int] = None
    """Linear warmup in tokens (pretraining); converted like train_tokens (a warmup shorter
    than one iteration is none: the plan says so). Set this or lr_warmup_iters. [≥ 0]"""
    lr_warmup_iters: Optional[int] = None
    """Linear warmup in iterations; None = none (0), unless lr_warmup_tokens is set. [≥ 0]"""
    lr_decay_iters: Optional[int] = None
    """The iteration the decay reaches min_lr at, counted from the start with the warmup
    (Megatron-LM's --lr-decay-iters); later iterations train at min_lr. None = train_iters
    (pretraining; SFT: train_iters − warmup, as the reference's SFT script passes it). Set
    this or lr_decay_tokens. [≥ 1]"""
    lr_decay_tokens: Optional[int] = None
    """Where the decay ends, in tokens (pretraining); converted like train_tokens. [≥ 1]"""
    lr: float = 1e-5
    """Peak learning rate. [≥ 0]"""
    min_lr: float = 1e-6
    """Learning rate at the end of the cosine decay. [≥ 0]"""
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape of the decay after warmup."""
    weight_decay: float = 0.1
    """Decoupled (AdamW) weight decay. [≥ 0]"""
    adam_beta1: float = 0.9
    """Adam β1."""
    adam_beta2: float = 0.95
    """Adam β2."""
    adam_eps: float = 1e-8
    """Adam epsilon. [> 0]"""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 = off). [≥ 0]"""
    use_distributed_optimizer: bool = True
    """Shard optimizer state across DP ranks (ZeRO-1, Megatron's distributed optimizer)."""
    precision: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16"
    """Parameter/compute dtype; bf16 and fp16 keep fp32 master weights in the optimizer. fp8:
    bf16 parameters with Transformer Engine's FP8 GEMMs (reference PR=fp8; PPU/GPU only)."""
    fp8_format: Literal["hybrid", "e4m3"] = "hybrid"
    """fp8: E4M3 forward and E5M2 gradients (hybrid, the reference) or E4M3 for both."""
    fp8_amax_history_len: int = 1024
    """fp8: steps of amax history the delayed scaling recipe keeps (the reference: 1024). [≥ 1]"""
    fp8_amax_compute_algo: Literal["max", "most_recent"] = "max"
    """fp8: scale from the max over the history (the reference) or the latest amax."""
    loss_scale: Optional[float] = None
    """fp16: a fixed loss scale; None = dynamic loss scaling (the reference). [> 0]"""
    initial_loss_scale: float = 2.0 ** 32
    """fp16, dynamic: the scale to start from (halved on every overflow). [> 0]"""
    min_loss_scale: float = 1.0
    """fp16, dynamic: the scale never drops below this. [> 0]"""
    loss_scale_window: int = 1000
    """fp16, dynamic: iterations without overflow before the scale doubles. [≥ 1]"""
    hysteresis: int = 2
    """fp16, dynamic: overflows tolerated before the scale is lowered. [≥ 1]"""
    apply_query_key_layer_scaling: Optional[bool] = None
    """Scale QKᵀ by the layer number (softmax in fp32) against fp16 overflow; None = on with
    fp16 only, as the reference sets it."""
    attention_backend: Literal["auto", "flash", "fused", "unfused", "sdpa", "local"] = "auto"
    """Core attention: flash / fused / unfused are Transformer Engine's kernels (reference FL=true
    → flash, false → fused); sdpa is torch's scaled_dot_product_attention (flash / cuDNN /
    memory-efficient kernels on a device, the fused CPU kernel on the CPU; causal without a
    mask, GQA without copying K/V) and, for packed rows, a kernel given the sample boundaries
    (torch's varlen flash attention on a device, one call per sample on the CPU); local is
    Megatron-Core's reference attention (s × s scores, unfused softmax, an s × s mask for packed
    rows). auto = Transformer Engine's own choice where it imports, else sdpa. A backend this
    device cannot run is an error, never a silent fallback."""
    cross_entropy: Literal["chunked", "megatron"] = "chunked"
    """The language-model loss: chunked runs the output layer and a vocabulary-parallel cross
    entropy a chunk of tokens at a time and recomputes a chunk's logits in the backward pass,
    so the fp32 logits of a whole microbatch (seq × mbs × vocab / TP × 4 bytes: 2.3 GiB at
    Qwen2.5's 152k vocabulary, seq 4096, TP 1) are never held; megatron is Megatron-Core's own
    (the output layer's logits for the microbatch, then its vocab_parallel_cross_entropy)."""
    cross_entropy_chunk_tokens: int = 0
    """chunked: tokens per chunk; 0 = as many as keep one chunk's fp32 logits under 512 MiB
    (880 tokens of a 152k vocabulary at TP 1). [≥ 0]"""
    moe_grouped_gemm: bool = True
    """MoE: every local expert in one grouped GEMM per linear (Transformer Engine's, or torch's
    _grouped_mm without it) instead of one expert after another (Megatron-Core's
    SequentialMLP). LoRA on the experts always runs them one after another (its adapters hook
    each expert's linears)."""
    seed: int = 1234
    """Base RNG seed (Megatron adds 100 × pipeline rank). [≥ 0]"""
    log_interval: int = 1
    """Iterations between progress lines, metrics.jsonl rows and Ray Train reports. [≥ 1]"""
    eval_interval: int = 10_000
    """Iterations between validation passes (and one at the end); the reference uses 10000. [≥ 1]"""
    eval_iters: int = 10
    """Global batches of validation data per pass (0 = no validation). [≥ 0]"""


@dataclass(frozen=True)
class MemoryConfig:
    """Trading compute or host memory for device memory: activation recompute and offload,
    optimizer offload. ``--dry-run`` prints the memory plan these lead to."""

    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute (reference AC): selective recomputes core attention (the s² part)
    in the backward pass; full keeps only each recompute unit's input and recomputes the layers."""
    recompute_method: Literal["uniform", "block"] = "uniform"
    """full: uniform splits each model chunk's layers into units of recompute_num_layers and
    keeps one input per unit (the reference); block recomputes only the first
    recompute_num_layers layers of each chunk and stores the rest."""
    recompute_num_layers: int = 1
    """full: layers per recompute unit (uniform) or recomputed layers per chunk (block); the
    reference's MP_AC_LAYERS. Uniform needs it to divide the layers of a chunk. [≥ 1]"""
    activation_offload_layers: int = 0
    """Offload the activations of this many layers to host memory during the forward pass
    (reference AC=offload with MP_AC_LAYERS; Transformer Engine only, PP 1, no recompute; turns
    grad-reduce / param-gather overlap off, as the reference does). 0 = off. [≥ 0]"""
    optimizer_offload: Literal["none", "static", "auto"] = "none"
    """Keep (part of) the optimizer states and their update on the host (Megatron-Core's
    hybrid-device optimizer; reference OPTIMIZER_OFFLOAD). static: offload
    optimizer_offload_fraction of them; auto: the smallest fraction that makes the memory plan
    fit the device. Needs the distributed optimizer."""
    optimizer_offload_fraction: float = 1.0
    """static: fraction of the optimizer states kept on the host (the reference: 1.0)."""
    device_memory_gib: Optional[float] = None
    """Memory of one device for the memory plan and auto offload; None = the device table's
    value (PPU 810E 96 GiB, H100 80, H200 141, A100 80). [> 0]"""
    require_fit: bool = True
    """Refuse a run whose memory plan exceeds 90 % of device_memory_gib before any worker
    starts (the error names the biggest terms and a layout that fits); false: launch anyway
    (the plan leaves out allocator fragmentation and communication buffers, in the 10 %).
    Not checked on cluster.device=cpu, whose workers use host memory."""


@dataclass(frozen=True)
class DataConfig:
    """Where training samples come from."""

    dataset: Literal["idxmap", "sft"] = "idxmap"
    """idxmap: pretraining on Megatron .bin/.idx corpora; sft: fine-tuning on raw JSON (alpaca
    or chat records) read and tokenized by Ray Data (the reference's MP_DATASET_TYPE=raw)."""
    data_path: list[str] = field(default_factory=list)
    """idxmap: Megatron idxmap prefixes (``prefix.bin`` / ``prefix.idx``): ``[prefix, ...]`` (each read
    once, in proportion to its size) or a blend ``[weight, prefix, weight, prefix, ...]``."""
    valid_data_path: list[str] = field(default_factory=list)
    """Validation prefixes or blend, same forms; empty = the validation share of ``split``.
    sft: both are JSON / JSONL / Parquet files, directories or globs."""
    tokenizer: Optional[str] = None
    """sft: Hugging Face tokenizer (or checkpoint) directory with tokenizer.json and a chat
    template in tokenizer_config.json (the reference's PRETRAIN_CHECKPOINT_PATH)."""
    max_padding_length: Optional[int] = None
    """sft without packing: each sample padded to this many tokens (reference PAD_LEN, ≤
    seq_length; default seq_length); it is then the length the model trains on. [≥ 1]"""
    packing: bool = False
    """sft: several samples per seq_length row, attention kept within each (MP_SFT_PACKING)."""
    on_bad_record: Literal["skip", "fail"] = "skip"
    """sft: a malformed or unusable record is skipped and counted (skip) or stops the run (fail).
    Either way every bad record is listed in <dir>/bad_records/<split>.jsonl."""
    max_dropped_share: float = 0.5
    """sft, skip: the largest share of records that may be dropped (for any reason) before the
    run is refused: checked on the sample ``--dry-run`` and the launch read (check_records),
    then on the whole corpus. 1.0 = never refused; the default refuses a corpus a model cannot
    use (records with images for a text model, a wrong image_root)."""
    check_records: int = 200
    """sft: records of each file read before any Ray starts (``--dry-run`` and the launch): the
    first check_records, and as many spread over the rest of the file (JSON Lines and Parquet;
    a compressed file: the first only), read, templated, tokenized and their images opened as
    the pipeline does; over 16 files, 16 files' worth shared out among them (at least 1 + 1
    each). 0 = no sample. [≥ 0]"""
    split: str = "99,1,0"
    """Train/validation/test split of ``data_path``'s documents, Megatron's "a,b,c" form (ignored
    when ``valid_data_path`` is set: training then uses all of ``data_path``)."""
    index_cache_dir: Optional[str] = None
    """Where Megatron's document/sample/shuffle indices are cached (default: <output>/index_cache)."""
    eod_token_id: int = 151_643
    """End-of-document token appended between documents (Qwen2: <|endoftext|> = 151643). [≥ 0]"""
    reader_cpus: float = 0.5
    """Logical CPUs each reader actor reserves (ray_ppu.data.reader_pool). [> 0]"""
    reader_actors: int = 0
    """Reader actors per PPU node, serving every data rank of the node and both splits; 0: one
    per 8 data-reading ranks of a node (a reader delivers far more than 8 ranks consume:
    ``benchmark.py data``). [≥ 0]"""
    prefetch_batches: int = 4
    """Microbatches each data-reading rank keeps requested ahead of the training loop (in whole
    iterations, at least 2). [≥ 1]"""
    image_root: Optional[str] = None
    """sft with a vision model: directory that relative image paths of the records are under;
    None = the directory of the JSON file naming them (LLaVA's image_folder)."""
    max_image_pixels: int = 50_000_000
    """sft with a vision model: an image of more pixels (by its header, before decoding) is
    skipped and counted as image_too_large. [≥ 1]"""
    image_processor: Optional[str] = None
    """sft with a vision model: the directory whose preprocessor_config.json prepares the
    images (resize, resampling, mean / std). None = checkpoint.pretrained's, else the one
    checkpoint.load's checkpoint carries (a stage-2 or LoRA run on a stage-1 or converted
    checkpoint), else the encoder's default; the launch fills it in."""


@dataclass(frozen=True)
class OutputConfig:
    """Where the run writes."""

    dir: str = "outputs/run"
    """Output directory: resolved config, metrics.jsonl, TensorBoard events, index cache."""
    name: Optional[str] = None
    """Run name shown by Ray Train (default: the output directory's name)."""
    tensorboard: bool = True
    """Write TensorBoard event files under <dir>/tensorboard."""
    ray_metrics: bool = True
    """Export each logged row to Ray's metrics pipeline (``ray.util.metrics``: the dashboard's
    Metrics view, Prometheus, cluster/grafana/ray_ppu.json), tagged by run name and rank."""
    report: bool = True
    """Write <dir>/report.html (plots, config, events) when the run ends."""
    sample_log: bool = False
    """Record the sample ids every iteration trained on, per data-reading rank, in
    <dir>/samples/rank_NNNNN.jsonl (an audit of the data the run saw; restarts re-log the
    iterations they train again)."""
    profile_iters: int = 0
    """Rank 0 runs this many iterations under torch's profiler, from ``profile_start``, and
    writes <dir>/profile.txt and profile.json: the step's time by category (attention, GEMMs,
    norms, loss, optimizer, communication, copies, idle; ``ray_ppu.monitor.step_profile``).
    Those iterations run slower (the profiler's overhead). 0 = off. [≥ 0]"""
    profile_start: int = 3
    """The first profiled iteration (counted from 1; the first two build caches). [≥ 1]"""
    trackers: list[str] = field(default_factory=list)
    """Experiment trackers the driver sends the run to (``ray_ppu.monitor.trackers``):
    ``mlflow``, ``wandb``; each needs its package (``pip install 'ray-ppu[trackers]'``).
    Empty: none, and none is imported."""
    mlflow_tracking_uri: Optional[str] = None
    """MLflow tracking server or store; None: ``sqlite:///<dir>/mlflow.db``."""
    mlflow_experiment: str = "ray_ppu"
    """MLflow experiment the run is filed under (created if missing)."""
    wandb_project: str = "ray_ppu"
    """Weights & Biases project."""
    wandb_entity: Optional[str] = None
    """Weights & Biases team or user; None: the logged-in user's default."""
    wandb_mode: Literal["online", "offline"] = "online"
    """online: sent as the run goes; offline: written under <dir>/wandb for ``wandb sync``."""


@dataclass(frozen=True)
class ClusterConfig:
    """Which Ray resources the workers take and which device backend they run."""

    num_workers: int = 2
    """Workers in the group: one per PPU (the world size). Workers beyond the largest
    multiple of TP × PP × CP stay spare, outside the Megatron groups. [≥ 1]"""
    min_workers: Optional[int] = None
    """Elastic: after losing workers, go on with as few as this many (Ray Train
    ScalingConfig(num_workers=(min_workers, num_workers))) at a smaller DP and the same global
    batch, and grow back when capacity returns. None: a fixed group of num_workers. [≥ 1]"""
    elastic_resize_interval_s: float = 60.0
    """Elastic: how often Ray Train checks whether more workers fit (a grow restarts the group
    from the latest checkpoint: keep it near the time between checkpoints). [> 0]"""
    connect_timeout_s: float = 30.0
    """How long the driver tries to reach the cluster in RAY_ADDRESS (its GCS port) before it
    stops with one line naming the address (Ray's own client retries for minutes, printing
    only its retries). [> 0]"""
    group_start_timeout_s: float = 60.0
    """How long Ray Train waits for a worker group's workers to be placed before deciding
    again (elastic: after a node loss it may first try the old size while Ray still counts the
    lost node; shorter shrinks sooner). RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S wins if set. [> 0]"""
    ppu_per_worker: float = 1
    """PPU resource units each worker holds (1 = one device). [> 0]"""
    cpus_per_worker: float = 1
    """Logical CPUs each worker holds, besides its PPU. [≥ 0]"""
    device: Literal["auto", "ppu", "cpu"] = "auto"
    """ppu: torch.cuda + NCCL (PPU or NVIDIA); cpu: gloo on CPU; auto: ppu when CUDA is usable."""
    accelerator: Literal["ppu-810e", "h100", "h200", "a100"] = "ppu-810e"
    """Device model the workers run on (``ray_ppu.devices.specs``): its bf16 peak is the MFU
    denominator and its memory the budget of the memory plan."""
    peak_tflops: Optional[float] = None
    """bf16 peak TFLOP/s of one device, the MFU denominator; None = the accelerator's figure
    (ppu-810e 123, h100 / h200 989, a100 312), or on a CPU device none (MFU n/a). [> 0]"""
    resource_name: str = "PPU"
    """Name of the custom Ray resource that counts devices on a node."""
    simulated_ppus: int = 0
    """Embedded local Ray only: PPU units to advertise (0 = num_workers × ppu_per_worker). [≥ 0]"""
    max_failures: int = -1
    """Worker-group restarts Ray Train attempts after a worker or node failure (or a hang);
    -1 = unlimited, the default: a long run on many nodes loses some, and each restart costs
    seconds. A run whose restarts make no progress stops all the same, with one error naming
    the cause: 3 groups in a row failing before an iteration, or in the same iteration with
    the same cause (``ray_ppu.monitor.restarts.crash_loop``). 0: no restarts. [≥ -1]"""
    hang_timeout_s: Optional[float] = None
    """A group that completes no iteration for this long is failed as hung (the stalled ranks'
    stacks logged, the processes killed; Ray Train restarts it as after a crash:
    ``ray_ppu.recovery.watchdog``). None: max(120 s, 10 × the median step, a validation pass).
    Progress is a completed iteration or, during a save, bytes reaching the checkpoint
    directory: a save that writes nothing this long is a hang too. Before a group's first
    iteration the ranks have 30 min (model build, checkpoint load) unless one stops
    answering. 0: off. [≥ 0]"""
    placement_timeout_s: float = 30.0
    """How long the preflight waits for every PPU node's answer (a node that does not answer in
    time is a problem); a cluster short of PPUs or CPUs fails at once, without waiting. [> 0]"""


@dataclass(frozen=True)
class CheckpointConfig:
    """When checkpoints are written, how many are kept, and where a run starts from."""

    enabled: bool = True
    """Write checkpoints. false: none at all (benchmarks, smoke tests): a failed or stopped
    run then has nothing to resume from."""
    save_interval: Optional[int] = None
    """Iterations between checkpoints (one is always written at the end); None = only at the end. [≥ 1]"""
    keep_last: int = 2
    """Complete checkpoints kept in the run's checkpoint directory; older ones are deleted. [≥ 1]"""
    load: Optional[str] = None
    """Checkpoint directory (or a directory of checkpoints: the latest complete one) to start
    from when the run's own checkpoint directory holds none yet; once the run has saved, its
    restarts resume from its own checkpoints."""
    pretrained: Optional[str] = None
    """Hugging Face model directory (config.json + safetensors, one file or shards with an
    index: Qwen2 / Qwen2.5, Qwen3, LLaMA-3.x) whose weights a fresh run starts from, at any TP / PP /
    virtual PP: each rank reads only the slices it holds. Without a model section the
    architecture is config.json's; with one, it must match (an error names each differing
    field). Iteration, optimizer and data start fresh; once the run has saved, restarts resume
    from its own checkpoints. Exclusive with ``load`` (``entrypoints/convert_checkpoint.py``
    turns it into a torch_dist checkpoint for ``load``)."""
    pretrained_vision: Optional[str] = None
    """A vision-language run starting from separate parts (LLaVA / Bunny stage 1): a SigLIP or
    CLIP checkpoint directory whose vision tower the run starts from, while
    ``checkpoint.pretrained`` is the language model's directory; the projector starts fresh.
    Unset with a LLaVA directory in ``checkpoint.pretrained``: every part is read from it."""
    finetune: bool = False
    """Load only the weights from ``load``: fresh optimizer and schedule, iteration 0, data from
    the start (Megatron's --finetune)."""
    async_save: bool = False
    """Write checkpoints in the background (Megatron-Core's async strategy): training waits
    only while the state is staged in host memory; a checkpoint counts (meta file, Ray Train
    report) once every rank's writer has finished, which is checked after each iteration."""
    stop_timeout_s: float = 300.0
    """On SIGTERM (``ray job stop``): the workers finish their iteration, save and stop; after
    this many seconds (or a second signal) they are aborted instead. ``ray job stop`` itself
    kills the driver RAY_JOB_STOP_WAIT_TIME_S (default 3) after its SIGTERM: raise it on the
    cluster to cover a save. [≥ 0]"""
    memory_interval: Optional[int] = None
    """Iterations between in-memory snapshots of the full training state (Ray only): each
    rank's shard goes to a keeper process on its node and a replica to one on the next node,
    and a restarted group of the same layout restores from the newest complete one instead of
    from disk. None = every iteration, or as often as keeps a snapshot within 2 % of the step
    (measured on the first one; the log says what it chose); 0 = off. [≥ 0]"""
    save_on_preemption: bool = True
    """When Ray reports that a node of the run is being drained (spot reclaim, maintenance),
    save a checkpoint at the end of the current iteration and keep training (Ray Train then
    restarts from it when the node goes). Checked as often as Ray Train's drain watcher looks
    (RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S, default 5 s); not in groups with spare workers."""


@dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs; ``ray_ppu.config.load`` builds and validates it."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    data: DataConfig = field(default_factory=DataConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def index_cache_dir(self) -> str:
        """Where the data indices are cached: ``data.index_cache_dir``, else
        ``<output.dir>/index_cache``."""
        return self.data.index_cache_dir or str(Path(self.output.dir) / "index_cache")
