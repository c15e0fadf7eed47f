"""Config loading and the validation that happens before any worker starts."""

import json
import subprocess
import sys

import pytest

from ray_ppu.config.loader import ConfigError, load
from ray_ppu.plan import ParallelDims, build_plan, flops_per_iteration

from conftest import REPO

BASE = ["data.data_path=[corpus]", "training.train_iters=10"]

# The reference script's 7B pretraining settings on one 16-PPU node.
REFERENCE_7B = [
    "model.preset=7B", "cluster.num_workers=16", "parallel.tensor_model_parallel_size=1",
    "parallel.pipeline_model_parallel_size=1", "training.micro_batch_size=1",
    "training.global_batch_size=256", "training.seq_length=4096", "training.train_tokens=1e10",
    "training.lr_warmup_tokens=1e6", "data.data_path=[corpus]",
]


def plan_of(*overrides):
    return build_plan(load(None, list(overrides)))


def problems_of(*overrides) -> str:
    with pytest.raises(ConfigError) as err:
        plan_of(*overrides)
    return str(err.value)


def test_reference_7b_plan():
    plan = plan_of(*REFERENCE_7B)
    assert plan.data_parallel_size == 16
    assert plan.num_microbatches == 16  # 256 = 16 DP × 1 mbs × 16 microbatches
    assert plan.train_iters == 9536  # 1e10 // 256 // 4096
    assert plan.lr_warmup_iters == 0  # 1e6 // 256 // 4096
    assert plan.lr_decay_iters == 9536


def test_shipped_sft_config_follows_the_reference_sft_schedule():
    cfg = load(REPO / "entrypoints" / "configs" / "qwen2.5-7b-sft.yaml")
    plan = build_plan(cfg)
    assert cfg.data.dataset == "sft" and plan.seq_length == 4096  # PAD_LEN
    assert (plan.train_iters, plan.lr_warmup_iters, plan.lr_decay_iters) == (2000, 50, 1950)
    assert plan.num_microbatches == 16 and not plan.packed_sequences


@pytest.mark.parametrize("extra,message", [
    (["data.max_padding_length=8192"], "max_padding_length 8192 must be between 1 and seq_length 4096"),
    (["data.tokenizer=null"], "data.dataset=sft needs data.tokenizer"),
    (["data.valid_data_path=[]"], "SFT has no split"),
    (["data.packing=true"], "with data.packing rows are seq_length long"),
    (["training.train_tokens=1e9"], "SFT is scheduled in iterations"),
])
def test_sft_settings_are_checked(extra, message):
    with pytest.raises(ConfigError, match=message):
        build_plan(load(REPO / "entrypoints" / "configs" / "qwen2.5-7b-sft.yaml", extra))


def test_packed_rows_at_pp4_are_read_by_every_stage():
    """Packed rows' sample boundaries are every chunk's business (its attention keeps the
    samples apart), so with PP 4 the middle stages' first TP ranks read the data too."""
    cfg = load(REPO / "entrypoints" / "configs" / "qwen2.5-7b-sft.yaml",
               ["data.packing=true", "data.max_padding_length=null",
                "parallel.pipeline_model_parallel_size=4", "cluster.num_workers=64"])
    plan = build_plan(cfg)
    assert plan.packed_sequences and plan.every_chunk_reads
    readers = {rank for rank, _ in plan.dims.data_ranks()}
    stages = {plan.dims.coordinates(rank)["pp"] for rank in readers}
    assert stages == {0, 1, 2, 3}
    assert all(plan.dims.coordinates(rank)["tp"] == 0 for rank in readers)


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: 3B\n  num_layers: 4\ntraining:\n  train_tokens: 2e9\n"
                    "  lr: 1e-4\ndata:\n  data_path: corpus\n")
    cfg = load(path, ["parallel.tensor_model_parallel_size=2", "training.lr=3e-4"])
    assert cfg.model.preset == "3B" and cfg.model.num_layers == 4 and cfg.model.hidden_size == 2048
    assert cfg.training.train_tokens == 2_000_000_000 and isinstance(cfg.training.train_tokens, int)
    assert cfg.training.lr == 3e-4
    assert cfg.data.data_path == ["corpus"]
    assert cfg.parallel.tensor_model_parallel_size == 2


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown key 'parallel.tensor_parallel_size'.*tensor_model_parallel_size"):
        load(None, ["parallel.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"unknown section 'trainig'.*training"):
        load(None, ["trainig.lr=1"])
    with pytest.raises(ConfigError, match=r"unknown model.preset 'qwen3-9B'.*qwen3-8B"):
        load(None, ["model.preset=qwen3-9B"])


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigError, match=r"training.micro_batch_size='two': expected int"):
        load(None, ["training.micro_batch_size=two"])
    with pytest.raises(ConfigError, match=r"training.precision='fp64'.*'bf16'"):
        load(None, ["training.precision=fp64"])


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml does not exist"):
        load(tmp_path / "nope.yaml")


def test_world_not_divisible_by_model_parallel():
    msg = problems_of(*BASE, "cluster.num_workers=6", "parallel.tensor_model_parallel_size=2",
                      "parallel.pipeline_model_parallel_size=2")
    assert "world size 6 is not divisible by TP 2 × PP 2 × CP 1 = 4" in msg


def test_elastic_groups_train_on_the_largest_usable_part_and_keep_the_batch():
    from ray_ppu.plan import active_workers, plan_for_world

    # largest multiple of TP×PP×CP whose DP divides global batch / micro batch
    assert active_workers(16, 2, 2, 1, 256, 1) == 16
    assert active_workers(15, 2, 2, 1, 96, 1) == 12    # DP 3, 3 spare
    assert active_workers(15, 2, 2, 1, 256, 1) == 8    # DP 3 does not divide 256: DP 2
    assert active_workers(7, 1, 1, 1, 8, 1) == 4       # DP 7, 6, 5 do not divide 8
    assert active_workers(3, 2, 2, 1, 8, 1) == 0       # not one TP2×PP2 replica
    assert active_workers(6, 2, 1, 1, 12, 2) == 6      # DP 3 × mbs 2 × 2 microbatches
    cfg = load(None, [*BASE, "cluster.num_workers=16", "cluster.min_workers=4",
                      "parallel.tensor_model_parallel_size=2", "training.global_batch_size=64"])
    full, small = build_plan(cfg), plan_for_world(cfg, 11)
    assert (full.world_size, full.data_parallel_size, full.num_microbatches) == (16, 8, 8)
    assert (small.world_size, small.spare_workers, small.data_parallel_size,
            small.num_microbatches, small.global_batch_size) == (8, 3, 4, 16, 64)
    assert small.train_iters == full.train_iters and small.lr_decay_iters == full.lr_decay_iters
    with pytest.raises(ConfigError, match="1 workers hold no model replica of TP × PP × CP = 2"):
        plan_for_world(cfg, 1)


def test_min_workers_must_hold_a_replica():
    assert "cluster.min_workers 1 cannot hold one model replica: TP 2 × PP 1 × CP 1 = 2" in problems_of(
        *BASE, "cluster.num_workers=4", "cluster.min_workers=1", "parallel.tensor_model_parallel_size=2")
    assert "cluster.min_workers 5 must be at most num_workers 4" in problems_of(
        *BASE, "cluster.num_workers=4", "cluster.min_workers=5")


def test_heads_and_groups_not_divisible_by_tp():
    msg = problems_of(*BASE, "model.preset=7B", "cluster.num_workers=8",
                      "parallel.tensor_model_parallel_size=8", "training.global_batch_size=8")
    assert "num_attention_heads 28 is not divisible by TP 8" in msg
    assert "num_query_groups 4 is not divisible by TP 8" in msg


def test_layers_not_divisible_by_pp_or_virtual_stages():
    assert "num_layers 28 is not divisible by PP 3" in problems_of(
        *BASE, "model.preset=7B", "cluster.num_workers=3", "parallel.pipeline_model_parallel_size=3",
        "training.global_batch_size=3")
    assert "num_layers 28 is not divisible by PP 2 × num_layers_per_virtual_pipeline_stage 3 = 6" in problems_of(
        *BASE, "model.preset=7B", "cluster.num_workers=2", "parallel.pipeline_model_parallel_size=2",
        "parallel.num_layers_per_virtual_pipeline_stage=3")
    plan = plan_of(*BASE, "model.preset=7B", "cluster.num_workers=2",
                   "parallel.pipeline_model_parallel_size=2",
                   "parallel.num_layers_per_virtual_pipeline_stage=7")
    assert plan.virtual_pipeline_model_parallel_size == 2  # 28 layers / 2 stages / 7 per chunk


def test_global_batch_not_divisible():
    msg = problems_of(*BASE, "cluster.num_workers=4", "training.micro_batch_size=2",
                      "training.global_batch_size=12")
    assert "global_batch_size 12 is not divisible by micro_batch_size 2 × DP 4 = 8" in msg


def test_seq_length_beyond_max_positions():
    msg = problems_of(*BASE, "model.preset=0.5B", "training.seq_length=65536")
    assert "seq_length 65536 exceeds max_position_embeddings 32768" in msg


def test_schedule_megatron_would_assert_on_is_a_problem():
    """Megatron's scheduler asserts warmup < decay and min_lr <= lr inside every worker: the
    plan names both first (train_iters 5 with the demo's 5 warmup iterations did reach it)."""
    msg = problems_of(*BASE, "training.train_iters=5", "training.lr_warmup_iters=5")
    assert ("lr_warmup_iters 5 must be below the 5 iterations of decay (the training length)"
            in msg)
    msg = problems_of(*BASE, "training.lr=1e-4", "training.min_lr=1e-3")
    assert "min_lr 0.001 is above lr 0.0001" in msg
    plan_of(*BASE, "training.train_iters=6", "training.lr_warmup_iters=5")  # 5 < 6: fine


def test_restarts_default_to_unlimited_and_a_bad_bound_is_a_problem():
    assert load(None, []).cluster.max_failures == -1
    msg = problems_of(*BASE, "cluster.max_failures=-2", "cluster.hang_timeout_s=-1")
    assert "cluster.max_failures=-2: must be ≥ -1" in msg
    assert "cluster.hang_timeout_s=-1: must be ≥ 0" in msg
    assert plan_of(*BASE, "cluster.max_failures=0") is not None  # 0: no restarts


def test_all_problems_reported_together():
    msg = problems_of(*BASE, "cluster.num_workers=3", "parallel.tensor_model_parallel_size=2",
                      "training.seq_length=100000")
    assert "world size 3" in msg and "seq_length 100000" in msg


def test_sequence_parallel_without_tp_is_an_error():
    # the migration from the reference script drops SP at TP 1 (and says so); a config asking
    # for it explicitly is told why it cannot have it
    assert "sequence_parallel needs TP > 1" in problems_of(*BASE, "parallel.sequence_parallel=true")
    assert plan_of(*BASE, "parallel.sequence_parallel=true", "cluster.num_workers=2",
                   "parallel.tensor_model_parallel_size=2").sequence_parallel is True


def test_training_length_required():
    assert "set training.train_tokens" in problems_of("data.data_path=[corpus]")


def test_parallel_dims_rank_order_matches_megatron_default():
    dims = ParallelDims(world_size=16, tp=2, pp=2, cp=2)  # DP = 2
    # tp fastest, then cp, then dp, then pp (Megatron order "tp-cp-ep-dp-pp")
    assert dims.coordinates(0) == {"tp": 0, "cp": 0, "dp": 0, "pp": 0}
    assert dims.coordinates(1) == {"tp": 1, "cp": 0, "dp": 0, "pp": 0}
    assert dims.coordinates(2) == {"tp": 0, "cp": 1, "dp": 0, "pp": 0}
    assert dims.coordinates(4) == {"tp": 0, "cp": 0, "dp": 1, "pp": 0}
    assert dims.coordinates(8) == {"tp": 0, "cp": 0, "dp": 0, "pp": 1}
    readers = list(dims.data_ranks())
    # TP rank 0 of the first and last stage, for each (cp, dp): 2 stages × 2 cp × 2 dp
    assert len(readers) == 8 and all(dims.coordinates(r)["tp"] == 0 for r, _ in readers)


def _megatron_lm_flops(B, s, L, h, heads, groups, ffn, vocab, kv_channels=None):
    """Megatron-LM training.py num_floating_point_operations, dense, GQA, SwiGLU, written out
    in that function's own terms (expansion factor, attention and MLP terms); kv_channels is
    Megatron-LM's --kv-channels (default hidden / heads)."""
    kv_channels = kv_channels or h // heads
    query_projection_size = kv_channels * heads
    query_projection_to_hidden_size_ratio = query_projection_size / h
    gated_linear_multiplier = 3 / 2
    expansion_factor = 3 * 2 * 2
    return (
        expansion_factor * B * s * L * h * h
        * (
            (1 + (groups / heads) + (s / h / 2)) * query_projection_to_hidden_size_ratio
            + (ffn / h) * gated_linear_multiplier
        )
        + expansion_factor * B * s * h * vocab / 2  # logits: 6·B·s·h·V
    )


# qwen3-0.6B and qwen3-32B: head_dim 128 is not hidden / heads, Megatron-LM's --kv-channels 128
@pytest.mark.parametrize("preset,layout", [("7B", (1, 1)), ("72B", (8, 4)), ("tiny", (2, 1)),
                                           ("qwen3-0.6B", (1, 1)), ("qwen3-32B", (8, 2))])
def test_flops_per_iteration_equal_megatron_lm(preset, layout):
    tp, pp = layout
    cfg = load(None, [*BASE, f"model.preset={preset}", f"cluster.num_workers={tp * pp}",
                      f"parallel.tensor_model_parallel_size={tp}",
                      f"parallel.pipeline_model_parallel_size={pp}",
                      "training.global_batch_size=256", "training.seq_length=4096"])
    plan = build_plan(cfg)
    m = cfg.model
    expected = _megatron_lm_flops(256, 4096, m.num_layers, m.hidden_size, m.num_attention_heads,
                                  m.num_query_groups, m.ffn_hidden_size, plan.padded_vocab_size,
                                  kv_channels=m.kv_channels)
    assert flops_per_iteration(cfg, plan.padded_vocab_size) == pytest.approx(expected, rel=1e-12)
    assert plan.flops_per_iteration == pytest.approx(expected, rel=1e-12)


def test_explicit_kv_channels_sets_the_head_width_apart_from_the_hidden_size():
    tiny = ["model.hidden_size=90", "model.num_attention_heads=4", "model.num_query_groups=2"]
    assert "hidden_size 90 is not divisible by num_attention_heads 4" in problems_of(*BASE, *tiny)
    plan = plan_of(*BASE, *tiny, "model.kv_channels=32")
    assert plan.kv_channels == 32
    # q [128, 90], k and v [64, 90] each, QKV bias (the default), o_proj [90, 128], SwiGLU
    # (3 × 90 × 176), two norms of 90; 2 layers, the tied embedding and the final norm
    layer = 90 * (128 + 2 * 64) + (128 + 2 * 64) + 128 * 90 + 3 * 90 * 176 + 2 * 90
    assert plan.num_parameters == 2 * layer + plan.padded_vocab_size * 90 + 90
    qk_norms = plan_of(*BASE, *tiny, "model.kv_channels=32", "model.qk_layernorm=true")
    assert qk_norms.num_parameters == plan.num_parameters + 2 * 2 * 32  # q / k norm per layer


@pytest.mark.parametrize("kv_channels", [0, 31, -2])
def test_kv_channels_must_be_positive_and_even(kv_channels):
    msg = problems_of(*BASE, f"model.kv_channels={kv_channels}")
    assert (f"model.kv_channels={kv_channels}: must be ≥ 2" in msg if kv_channels < 2 else
            f"kv_channels {kv_channels} must be an even number (RoPE rotates each head's "
            f"channels in pairs)" in msg)


def test_qwen3_transformer_config_has_its_head_width_and_qk_norms():
    """What --dry-run prints and the workers build TransformerConfig from: kv_channels always
    given (Megatron-Core would derive 1024 / 16 = 64 for Qwen3-0.6B), qk_layernorm for Qwen3
    only; the parameter count holds the q / k norms, replicated on each TP rank."""
    from ray_ppu.model.megatron_settings import describe

    cfg = load(None, [*BASE, "model.preset=qwen3-0.6B", "cluster.num_workers=2",
                      "parallel.tensor_model_parallel_size=2", "training.global_batch_size=2"])
    plan = build_plan(cfg)
    settings = describe(cfg, plan, te=False)["TransformerConfig"]
    assert (settings["kv_channels"], settings["qk_layernorm"], settings["add_qkv_bias"]) == \
        (128, True, False)
    qwen2 = load(None, [*BASE, "model.preset=0.5B"])
    settings = describe(qwen2, build_plan(qwen2), te=False)["TransformerConfig"]
    assert (settings["kv_channels"], settings["qk_layernorm"]) == (64, False)
    # 28 layers: q [2048, 1024], k, v [1024, 1024], o_proj [1024, 2048], SwiGLU 3 × 1024 × 3072
    # split over TP; norms 2 × 1024 + q / k norms 2 × 128 on both ranks; the embedding (padded
    # to 152064 rows at TP 2) split, the final norm whole
    split = 1024 * (2048 + 2 * 1024) + 2048 * 1024 + 3 * 1024 * 3072
    assert plan.padded_vocab_size == 152_064
    per_device = 28 * (split // 2 + 2 * 1024 + 2 * 128) + 152_064 * 1024 // 2 + 1024
    assert plan.num_parameters_per_device == per_device


def _cli(*args):
    return subprocess.run([sys.executable, str(REPO / "entrypoints" / "pretrain.py"), *args],
                          capture_output=True, text=True, timeout=120)


def test_dry_run_prints_plan_with_megatron_names():
    # --plan-only: the demo's settings on a corpus that is not there (its files are checked
    # otherwise: tests/test_newcomer.py)
    proc = _cli("--dry-run", "--plan-only", *REFERENCE_7B)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    plan, model = out["plan"], out["config"]["model"]
    assert (plan["data_parallel_size"], plan["num_microbatches"]) == (16, 16)
    assert (plan["train_iters"], plan["lr_warmup_iters"]) == (9536, 0)
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "num_query_groups", "vocab_size"):
        assert key in model
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                "sequence_parallel", "micro_batch_size", "global_batch_size", "seq_length",
                "lr_decay_iters", "kv_channels", "flops_per_iteration", "num_parameters_per_device"):
        assert key in plan
    assert plan["kv_channels"] == 128


def test_cli_rejects_bad_config_before_starting_anything():
    proc = _cli("--dry-run", *BASE, "cluster.num_workers=3", "parallel.tensor_model_parallel_size=2")
    assert proc.returncode == 2
    assert "world size 3 is not divisible by TP 2 × PP 1 × CP 1 = 2" in proc.stderr


def test_help_config_lists_every_field_with_type_default_and_docstring():
    """``pretrain.py --help-config`` is made from the schema: every field of every section, its
    type, its default and its docstring (none may lack one)."""
    import dataclasses

    from ray_ppu.config import schema
    from ray_ppu.config.reference import field_docs

    script = REPO / "entrypoints" / "pretrain.py"
    shown = subprocess.run([sys.executable, str(script), "--help-config"], check=True,
                           capture_output=True, text=True).stdout
    docs = {d.key: d for d in field_docs()}
    for part in dataclasses.fields(schema.RunConfig):
        for f in dataclasses.fields(part.default_factory().__class__):
            doc = docs[f"{part.name}.{f.name}"]
            assert doc.doc, f"{doc.key} has no docstring in ray_ppu/config/schema.py"
            assert f"{doc.key}: {f.type} = " in shown
            assert doc.doc.splitlines()[0] in shown
    assert "training.micro_batch_size: int = 1\n    Samples per forward/backward pass" in shown
    one = subprocess.run([sys.executable, str(script), "--help-config", "cluster"], check=True,
                         capture_output=True, text=True).stdout
    assert "cluster.num_workers" in one and "training." not in one
    bad = subprocess.run([sys.executable, str(script), "--help-config", "trainig"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "no such section (sections: model, parallel" in bad.stderr


@pytest.mark.parametrize("style, warmup, decay", [
    ("cosine", 5, None), ("cosine", 0, 30), ("linear", 3, 20), ("constant", 4, None)])
def test_the_summarys_learning_rates_are_megatrons_scheduler(style, warmup, decay):
    """The learning rate the summary states for an iteration is the one Megatron-Core's
    OptimizerParamScheduler (as ray_ppu.model.optim builds it) sets for it, at every
    iteration, the decay's end and the min_lr tail included."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from ray_ppu.plan.derived import lr_at

    extra = [f"training.lr_decay_style={style}", f"training.lr_warmup_iters={warmup}",
             *([f"training.lr_decay_iters={decay}"] if decay else [])]
    cfg = load(None, ["data.data_path=[corpus]", "training.train_iters=40", "training.lr=3e-3",
                      "training.min_lr=1e-4", *extra])
    plan = build_plan(cfg)
    gbs = plan.global_batch_size
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    t = cfg.training
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else t.lr, max_lr=t.lr, min_lr=t.min_lr,
        lr_warmup_steps=warmup * gbs, lr_decay_steps=plan.lr_decay_iters * gbs,
        lr_decay_style=style, start_wd=0.0, end_wd=0.0, wd_incr_steps=40 * gbs,
        wd_incr_style="constant")
    for iteration in range(1, 41):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(cfg, plan, iteration),
                                                                abs=1e-12), iteration
        scheduler.step(increment=gbs)


def test_a_decay_that_ends_early_at_min_lr_0_is_named():
    """lr_decay_iters is where the decay ends (Megatron's meaning): iterations after it train
    at min_lr, and at min_lr 0 the plan says which ones train at lr 0."""
    from ray_ppu.plan.derived import lr_at, schedule_notes

    base = ["data.data_path=[corpus]", "training.train_iters=35", "training.lr_warmup_iters=1",
            "training.min_lr=0"]
    early = load(None, [*base, "training.lr_decay_iters=34"])
    plan = build_plan(early)
    assert lr_at(early, plan, 35) == 0.0 < lr_at(early, plan, 34)
    assert schedule_notes(early, plan) == [
        "iterations 35..35 train at lr 0: the decay reaches min_lr 0 at iteration 34 "
        "(training.lr_decay_iters) and training goes on to 35"]
    full = load(None, base)  # pretraining: the decay ends with the training
    assert schedule_notes(full, build_plan(full)) == []
    assert lr_at(full, build_plan(full), 35) > 0


def test_the_shipped_qwen_vl_lora_config_never_trains_at_lr_0():
    from ray_ppu.plan.derived import lr_at, schedule_notes

    cfg = load(REPO / "entrypoints" / "configs" / "qwen2.5-vl-7b-lora.yaml",
               ["checkpoint.pretrained=null", "checkpoint.load=base", "data.tokenizer=tok"])
    plan = build_plan(cfg)
    assert cfg.training.min_lr == 0 and schedule_notes(cfg, plan) == []
    assert all(lr_at(cfg, plan, i) > 0 for i in range(2, plan.train_iters + 1))
