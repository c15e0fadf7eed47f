"""Qwen3-MoE before any worker starts: expert parallelism's rules, counts and settings.

Pure arithmetic on the config (no torch, no Ray): every new validation error by its words,
FLOPs against Megatron-LM's MoE formula, parameters per device with experts split by EP × ETP,
elastic sizes that keep whole expert groups, and the TransformerConfig keywords a worker builds.
"""

import pytest

from ray_ppu.config.loader import ConfigError, load
from ray_ppu.plan import active_workers, build_plan, plan_for_world

BASE = ["data.data_path=[corpus]", "training.train_iters=10", "model.preset=tiny-moe"]


def plan_of(*overrides):
    return build_plan(load(None, [*BASE, *overrides]))


def problems_of(*overrides) -> str:
    with pytest.raises(ConfigError) as err:
        plan_of(*overrides)
    return str(err.value)


def test_expert_layout_is_planned():
    plan = plan_of("cluster.num_workers=4", "parallel.tensor_model_parallel_size=2",
                   "parallel.sequence_parallel=true", "parallel.expert_model_parallel_size=2",
                   "parallel.expert_tensor_parallel_size=1")
    assert (plan.data_parallel_size, plan.expert_model_parallel_size,
            plan.expert_tensor_parallel_size, plan.expert_data_parallel_size) == (2, 2, 1, 2)
    # ETP unset is TP, as in Megatron-Core
    plan = plan_of("cluster.num_workers=4", "parallel.tensor_model_parallel_size=2",
                   "parallel.sequence_parallel=true")
    assert (plan.expert_tensor_parallel_size, plan.expert_data_parallel_size) == (2, 2)


@pytest.mark.parametrize("extra,message", [
    (["parallel.expert_model_parallel_size=3", "cluster.num_workers=3"],
     "model.num_moe_experts 4 is not divisible by EP 3 (each EP rank holds whole experts)"),
    (["parallel.expert_model_parallel_size=4", "cluster.num_workers=2"],
     "the 2 ranks of a pipeline stage (world size 2 / PP 1) are not divisible by EP 4 × ETP 1 = 4"),
    (["parallel.expert_model_parallel_size=2", "parallel.expert_tensor_parallel_size=2",
      "cluster.num_workers=4", "parallel.pipeline_model_parallel_size=2"],
     "the 2 ranks of a pipeline stage (world size 4 / PP 2) are not divisible by EP 2 × ETP 2 = 4"),
    (["model.moe_router_topk=5"], "model.moe_router_topk 5 must be between 1 and num_moe_experts 4"),
    (["model.moe_router_topk=1"], "model.moe_router_topk 1 needs model.moe_norm_topk_prob=false"),
    (["model.moe_ffn_hidden_size=63", "parallel.tensor_model_parallel_size=2",
      "parallel.sequence_parallel=true"], "model.moe_ffn_hidden_size 63 is not divisible by ETP 2"),
    (["parallel.tensor_model_parallel_size=2"],
     "a MoE model at TP 2 needs parallel.sequence_parallel=true"),
    (["model.moe_aux_loss_coeff=-0.1"], "model.moe_aux_loss_coeff=-0.1: must be ≥ 0"),
    (["model.num_moe_experts=0"], "model.num_moe_experts=0: must be ≥ 1"),
    (["model.num_moe_experts=null", "parallel.expert_model_parallel_size=2"],
     "parallel.expert_model_parallel_size=2 needs a MoE model (model.num_moe_experts)"),
])
def test_moe_layout_problems_are_named(extra, message):
    assert message in problems_of(*extra)


def test_every_moe_problem_is_reported_together():
    msg = problems_of("parallel.expert_model_parallel_size=3", "cluster.num_workers=3",
                      "model.moe_router_topk=5", "parallel.tensor_model_parallel_size=3")
    for part in ("not divisible by EP 3", "moe_router_topk 5", "needs parallel.sequence_parallel",
                 "num_attention_heads 4 is not divisible by TP 3"):
        assert part in msg, part


def test_elastic_sizes_keep_whole_expert_groups():
    # 6 workers, EP 4: DP 6 and DP 5 do not hold whole EP groups of 4, DP 4 does
    assert active_workers(6, 1, 1, 1, 12, 1, experts_per_stage=4) == 4
    assert active_workers(6, 1, 1, 1, 12, 1) == 6  # dense: every worker
    cfg = load(None, [*BASE, "cluster.num_workers=8", "cluster.min_workers=4",
                      "parallel.expert_model_parallel_size=4", "training.global_batch_size=8"])
    small = plan_for_world(cfg, 7)
    assert (small.world_size, small.spare_workers, small.expert_data_parallel_size) == (4, 3, 1)
    with pytest.raises(ConfigError, match="stages of whole EP 4 × ETP 1 groups"):
        plan_for_world(cfg, 3)
    assert "with stages of whole EP 4 × ETP 1 groups" in problems_of(
        "cluster.num_workers=8", "cluster.min_workers=3", "parallel.expert_model_parallel_size=4",
        "training.global_batch_size=8")


def _megatron_lm_moe_flops(B, s, L, h, heads, groups, kv, topk, moe_ffn, vocab):
    """Megatron-LM's num_floating_point_operations for an all-MoE GQA model with SwiGLU, in its
    own terms: 3 (fwd, wgrad, dgrad) × 2 (multiply-add) × B·s × (attention + top-k experts'
    MLP + logits); no router, no shared experts."""
    q, k = kv * heads, kv * groups
    attention = h * (q + 2 * k) + q * s / 2 * 2 + q * h
    mlp = h * moe_ffn * topk * 3
    return 3 * 2 * B * s * (L * (attention + mlp) + h * vocab)


@pytest.mark.parametrize("preset", ["qwen3-30B-A3B", "qwen3-235B-A22B", "tiny-moe"])
def test_moe_flops_are_megatron_lms_plus_the_router(preset):
    cfg = load(None, [*BASE, f"model.preset={preset}", "training.global_batch_size=64",
                      "training.seq_length=4096"])
    plan = build_plan(cfg)
    m = cfg.model
    megatron = _megatron_lm_moe_flops(64, 4096, m.num_layers, m.hidden_size,
                                      m.num_attention_heads, m.num_query_groups,
                                      m.effective_kv_channels, m.moe_router_topk,
                                      m.moe_ffn_hidden_size, plan.padded_vocab_size)
    router = 6 * 64 * 4096 * m.num_layers * m.hidden_size * m.num_moe_experts
    assert plan.flops_per_iteration == pytest.approx(megatron + router, rel=1e-12)
    if preset != "tiny-moe":  # the router is a sliver of a real model's count
        assert router / plan.flops_per_iteration < 0.005


def test_experts_are_split_by_ep_and_etp_on_each_device():
    m = load(None, BASE).model
    h, f, e = m.hidden_size, m.moe_ffn_hidden_size, m.num_moe_experts
    q, k = 16 * m.num_attention_heads, 16 * m.num_query_groups  # head width 64 / 4 heads
    attention = h * (q + 2 * k) + q * h
    replicated = 2 * h + 2 * 16 + e * h  # two norms, q / k norms, the router
    experts = e * 3 * h * f
    for workers, tp, ep, etp in ((2, 1, 2, 1), (2, 2, 1, 2), (4, 2, 2, 1), (4, 2, 2, 2)):
        plan = plan_of(f"cluster.num_workers={workers}", f"parallel.tensor_model_parallel_size={tp}",
                       f"parallel.sequence_parallel={'true' if tp > 1 else 'false'}",
                       f"parallel.expert_model_parallel_size={ep}",
                       f"parallel.expert_tensor_parallel_size={etp}")
        layer = attention // tp + experts // (ep * etp) + replicated
        embedding = plan.padded_vocab_size * h // tp
        assert plan.num_parameters_per_device == 2 * layer + embedding + h, (tp, ep, etp)
    total = plan.num_parameters
    assert plan.num_active_parameters == total - 2 * (e - m.moe_router_topk) * 3 * h * f


def test_transformer_config_routes_like_qwen3_moe():
    from ray_ppu.model.megatron_settings import describe

    cfg = load(None, [*BASE, "cluster.num_workers=2", "parallel.expert_model_parallel_size=2"])
    local = describe(cfg, build_plan(cfg), te=False)
    settings = local["TransformerConfig"]
    assert local["layer_spec"] == "local"
    assert (settings["num_moe_experts"], settings["moe_router_topk"],
            settings["moe_ffn_hidden_size"]) == (4, 2, 64)
    # softmax over all experts, top-k renormalised = Megatron's softmax over the top-k logits
    assert settings["moe_router_score_function"] == "softmax"
    assert settings["moe_router_pre_softmax"] is False and settings["moe_router_dtype"] == "fp32"
    assert (settings["moe_router_load_balancing_type"], settings["moe_aux_loss_coeff"]) == (
        "aux_loss", 0.001)
    assert settings["moe_token_dispatcher_type"] == "alltoall"
    assert (settings["expert_model_parallel_size"], settings["expert_tensor_parallel_size"]) == (2, 1)
    assert settings["moe_grouped_gemm"] is False  # local spec: SequentialMLP
    te = describe(cfg, build_plan(cfg), te=True)["TransformerConfig"]
    assert te["moe_grouped_gemm"] is True
    no_norm = load(None, [*BASE, "model.moe_norm_topk_prob=false", "model.moe_aux_loss_coeff=0"])
    settings = describe(no_norm, build_plan(no_norm), te=False)["TransformerConfig"]
    assert settings["moe_router_pre_softmax"] is True
    assert settings["moe_router_load_balancing_type"] == "none"
    dense = load(None, [*BASE, "model.preset=tiny"])
    assert "num_moe_experts" not in describe(dense, build_plan(dense), te=False)["TransformerConfig"]


def test_memory_plan_splits_experts_by_ep_and_their_optimizer_by_expert_dp():
    from ray_ppu.plan.memory import GIB, memory_plan
    from ray_ppu.plan.arithmetic import expert_parameters_per_device

    plans = {}
    for ep in (1, 8):
        cfg = load(None, ["data.data_path=[corpus]", "training.train_iters=10",
                          "model.preset=qwen3-30B-A3B", "cluster.num_workers=16",
                          f"parallel.expert_model_parallel_size={ep}",
                          "training.global_batch_size=256", "training.seq_length=4096"])
        plan = build_plan(cfg)
        plans[ep] = (plan, memory_plan(cfg, plan))
        experts = expert_parameters_per_device(cfg, 1, ep, 1)
        # 48 layers × 128 experts × 3 × 2048 × 768 expert weights, split by EP
        assert experts == 48 * 128 * 3 * 2048 * 768 // ep
        params, mp = plan.num_parameters_per_device, plans[ep][1]
        assert mp.parameters_gib * GIB == pytest.approx(params * 2)  # bf16 weights
        assert mp.gradients_gib * GIB == pytest.approx(params * 4)  # fp32 grad buffers
        # Adam + fp32 main weights (12 bytes): the rest over DP 16, the experts over expert-DP
        expected = ((params - experts) / 16 + experts / plan.expert_data_parallel_size) * 12
        assert mp.optimizer_gib * GIB == pytest.approx(expected)
    (one, one_mp), (eight, eight_mp) = plans[1], plans[8]
    assert (one.expert_data_parallel_size, eight.expert_data_parallel_size) == (16, 2)
    assert not one_mp.fits and eight_mp.fits  # 30B on every device does not fit 96 GB
    # the routed tokens' activations do not depend on how the experts are laid out
    assert one_mp.activations_gib == pytest.approx(eight_mp.activations_gib)
