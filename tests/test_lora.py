"""LoRA against Hugging Face PEFT: transformers' Qwen2 and Qwen3-MoE models with PEFT adapters
(A and B random and non-zero, built offline) are the reference.

One torchrun launch of two CPU ranks (this file's ``__main__``) builds ray_ppu's model at every
layout (TP 1, TP 2 with and without sequence parallelism, PP 2, PP 2 with virtual stages; the
MoE model at EP 2, and at TP 2 whose experts are split by ETP 2), reads the base from the
Hugging Face directory and the adapters from the PEFT directory, and writes the prompt's logits
and, after one backward pass through Megatron's schedule and DDP, every adapter's whole
gradient. The tests hold the logits to PEFT's, the gradients at TP 1 to PEFT's, and every
layout's gradients to TP 1's: the sharded adapters and their communication are unsharded LoRA.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_hf import _transformer_engine_device
from conftest import launch_torchrun

TOKENS = [5, 17, 300, 999, 42, 7, 8, 9, 123, 456, 2, 0, 77]  # 12 inputs: SP splits them
RANK, ALPHA = 4, 8.0
# (model, adapter, TP, PP, layers per virtual stage, EP, ETP, SP, gradients[, recompute,
# precision])
RUNS = [
    ("qwen", "shared", 1, 1, None, 1, None, False, True),
    ("qwen", "shared", 2, 1, None, 1, None, False, True),
    ("qwen", "shared", 2, 1, None, 1, None, True, True),
    ("qwen", "shared", 2, 1, None, 1, None, True, True, "full"),  # full recompute: hooks rerun
    ("qwen", "shared", 1, 2, None, 1, None, False, True),
    ("qwen", "shared", 1, 2, 1, 1, None, False, True),
    ("qwen", "stacked", 1, 1, None, 1, None, False, False),
    ("qwen", "stacked", 2, 1, None, 1, None, True, False),
    ("qwen3", "qwen3_all", 2, 1, None, 1, None, True, False),  # q / k norms, head_dim 32
    # the base from a ray_ppu checkpoint (converted at TP 2): checkpoint.load as a LoRA base
    ("qwen_mcore", "shared", 1, 1, None, 1, None, False, False),
    ("qwen", "shared", 2, 1, None, 1, None, True, False, "none", "bf16"),  # adapters in bf16
    ("moe", "experts", 1, 1, None, 1, None, False, True),
    ("moe", "experts", 1, 1, None, 2, 1, False, True),
    ("moe", "experts", 2, 1, None, 1, None, True, True),
]


TRAIN = (2, True)  # the frozen-base training check: TP 2 with SP, on both ranks


def run_name(run) -> str:
    model, adapter, tp, pp, vs, ep, etp, sp, _, *options = run
    return (f"{model}_{adapter}_tp{tp}_pp{pp}_vs{vs}_ep{ep}_etp{etp}_sp{int(sp)}"
            + "".join(f"_{o}" for o in options))


# ---------------------------------------------------------------------------------------------
# The lora section and the plan (no model)
# ---------------------------------------------------------------------------------------------

SFT_7B = str(Path(__file__).resolve().parents[1] / "entrypoints/configs/qwen2.5-7b-sft.yaml")
BASE = ["data.data_path=[a]", "checkpoint.load=/base"]


def _plan(*overrides, config=SFT_7B):
    from ray_ppu.config.loader import load
    from ray_ppu.plan import build_plan
    from ray_ppu.plan.memory import memory_plan

    cfg = load(config, [*BASE, *overrides] if config == SFT_7B
               else [*BASE, "training.train_iters=10", "training.eval_iters=0", *overrides])
    plan = build_plan(cfg)
    return cfg, plan, memory_plan(cfg, plan)


def test_lora_is_off_by_default_and_changes_nothing():
    from ray_ppu.config.lora import LoraConfig

    cfg, plan, memory = _plan()
    assert cfg.lora == LoraConfig() and not cfg.lora.enabled
    assert plan.num_trainable_parameters == plan.num_parameters == 7_615_616_512
    assert memory.frozen_parameters == 0 and memory.gradients_gib == pytest.approx(
        plan.num_parameters * 4 / 2**30)


def test_qwen25_7b_rank16_trains_half_a_percent_with_no_base_gradients_or_adam():
    """Qwen2.5-7B (h 3584, 28 heads, 4 KV groups of 128, f 18944, 28 layers), rank 16 on the
    four linears: a layer's adapters are 16·(3584 + 4608) (qkv, A shared by q/k/v) +
    16·(3584 + 3584) (proj) + 16·(3584 + 37888) (fc1, A shared by gate/up) + 16·(18944 +
    3584) (fc2) = 1,269,760; at TP 2 a device holds the column adapters' A whole and half of
    B, the row adapters' half of A and B whole: 749,568."""
    cfg, plan, memory = _plan("lora.enabled=true")
    assert plan.num_trainable_parameters == 28 * 1_269_760 == 35_553_280
    assert plan.num_trainable_parameters / plan.num_parameters < 0.005
    assert memory.trainable_parameters == 35_553_280
    assert memory.frozen_parameters == plan.num_parameters - 35_553_280
    full = _plan()[2]
    assert memory.parameters_gib == full.parameters_gib  # the base is there all the same
    assert memory.gradients_gib == pytest.approx(35_553_280 * 4 / 2**30)
    assert memory.optimizer_gib == pytest.approx(35_553_280 / 16 * 12 / 2**30)  # 16 DP shards
    assert (memory.gradients_gib + memory.optimizer_gib
            < 0.01 * (full.gradients_gib + full.optimizer_gib))
    _, tp2, _ = _plan("lora.enabled=true", "parallel.tensor_model_parallel_size=2")
    assert tp2.num_trainable_parameters_per_device == 28 * 749_568


def test_lora_flops_count_what_a_frozen_base_computes():
    """The tiny preset (h 64, 4 heads of 16, 2 groups: q 64, k 32; f 176; 2 layers; V 151936
    a multiple of 128 already), rank 8 on all four linears, batch 8 × 128: per token a frozen
    GEMM of n weights costs 4n (forward, input gradient), the first layer's QKV 2n (nothing
    below it trains), each adapter 2r(in+out)·2 + 2r·out + 2r·in; attention 2q(1+2)·s² per
    layer as Megatron-LM's; the frozen output layer 4hV."""
    cfg, plan, _ = _plan("lora.enabled=true", "lora.rank=8", config=None)
    h, q, k, f, V, r, L = 64, 64, 32, 176, 151936, 8, 2
    qkv, proj, fc1, fc2 = h * (q + 2 * k), q * h, h * 2 * f, f * h

    def adapter(n_in, n_out, grad_in=True):
        return 4 * r * (n_in + n_out) + 2 * r * n_out + 2 * r * n_in * grad_in

    first = (2 * qkv + adapter(h, q + 2 * k, False) + 4 * proj + adapter(q, h)
             + 4 * fc1 + adapter(h, 2 * f) + 4 * fc2 + adapter(f, h))
    other = (4 * qkv + adapter(h, q + 2 * k) + 4 * proj + adapter(q, h)
             + 4 * fc1 + adapter(h, 2 * f) + 4 * fc2 + adapter(f, h))
    per_token = first + (L - 1) * other + 4 * h * V
    tokens, s = 8 * 128, 128
    assert plan.flops_per_iteration == tokens * per_token + 8 * s * s * L * 6 * q
    assert plan.attention_flops_coefficient == L * 6 * q
    full = _plan(config=None)[1]
    assert plan.flops_per_iteration < full.flops_per_iteration


def test_lora_plan_problems_are_named_together():
    from ray_ppu.config.loader import load
    from ray_ppu.errors import ConfigError
    from ray_ppu.plan import build_plan

    def problems(*overrides, preset="tiny"):
        cfg = load(None, [f"model.preset={preset}", "lora.enabled=true", *overrides])
        with pytest.raises(ConfigError) as err:
            build_plan(cfg)
        return str(err.value)

    text = problems("lora.target_modules=[linear_qkvv, experts.linear_fc1]")
    for line in ["lora.target_modules: unknown module 'linear_qkvv' (did you mean 'linear_qkv'?)",
                 "lora.target_modules 'experts.linear_fc1': the model has no experts"]:
        assert line in text, (line, text)
    text = problems("lora.rank_pattern={linear_prj: 4, linear_qkv: 0}",
                    "lora.alpha_pattern={linear_fc2: -1}", "lora.dropout=1.0",
                    "lora.trainable=[embeding, router, output_layer]")
    for line in ["lora.rank_pattern names 'linear_prj', which is not a target (did you mean "
                 "'linear_proj'?)",
                 "lora.rank_pattern.linear_qkv=0: must be ≥ 1",
                 "lora.alpha_pattern.linear_fc2=-1: must be > 0",
                 "lora.dropout=1: must be at least 0 and below 1",
                 "lora.trainable: unknown part 'embeding' (did you mean 'embedding'?)",
                 "lora.trainable 'router': the model has no experts to route to",
                 "lora.trainable 'output_layer': this model's output layer is its input "
                 "embedding (tied)",
                 "lora.enabled needs a base model to adapt: checkpoint.pretrained"]:
        assert line in text, (line, text)
    moe = problems("lora.target_modules=[linear_fc1]", "parallel.tensor_model_parallel_size=2",
                   "parallel.sequence_parallel=true", "parallel.expert_model_parallel_size=1",
                   "parallel.expert_tensor_parallel_size=1", "cluster.num_workers=4",
                   preset="tiny-moe")
    assert "lora.target_modules 'linear_fc1': a MoE model has no dense MLP (each expert's " \
           "is experts.linear_fc1)" in moe
    assert "at ETP" not in moe  # ETP 1 is fine
    etp = problems("parallel.tensor_model_parallel_size=4", "parallel.sequence_parallel=true",
                   "parallel.expert_tensor_parallel_size=2", "cluster.num_workers=4",
                   "model.num_query_groups=4", preset="tiny-moe")
    assert ("LoRA on experts.linear_fc1, experts.linear_fc2 at ETP 2: adapters on experts "
            "need ETP 1 or ETP = TP (4)") in etp


def test_lora_targets_in_the_names_users_write():
    """all-linear (PEFT, ms-swift) and Hugging Face projection names are the Megatron-Core
    linears that hold them (q / k / v: the fused linear_qkv; a MoE model's MLP names: each
    expert's), rank_pattern keys too; the launch summary lists the mapping."""
    from ray_ppu.config.loader import load
    from ray_ppu.plan import build_plan
    from ray_ppu.plan.summary import _lora

    def planned(*overrides, preset="tiny"):
        cfg = load(None, [f"model.preset={preset}", "lora.enabled=true", "training.train_iters=1",
                          "data.data_path=[/x]", "checkpoint.load=/x", *overrides])
        return cfg, build_plan(cfg)

    default = planned()[1].num_trainable_parameters
    for names in ("all-linear", "all", "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                                       "down_proj",
                  "linear_qkv, o_proj, gate_up_proj, linear_fc2"):
        cfg, plan = planned(f"lora.target_modules=[{names}]")
        assert cfg.lora.targets(False) == ("linear_qkv", "linear_proj", "linear_fc1",
                                           "linear_fc2"), names
        assert plan.num_trainable_parameters == default, names
    cfg, plan = planned("lora.target_modules=[q_proj, v_proj, down_proj]",
                        "lora.rank_pattern={v_proj: 8}")
    assert cfg.lora.targets(False) == ("linear_qkv", "linear_fc2")
    assert cfg.lora.rank_of("linear_qkv") == 8 and cfg.lora.rank_of("linear_fc2") == 16
    assert "linear_qkv r8 (from q_proj, v_proj), linear_fc2 r16 (from down_proj)" in \
        _lora(cfg, plan)[0]
    cfg, _ = planned("lora.target_modules=[q_proj, gate_proj, down_proj]",
                     "parallel.expert_model_parallel_size=1", preset="tiny-moe")
    assert cfg.lora.targets(True) == ("linear_qkv", "experts.linear_fc1", "experts.linear_fc2")


def test_the_summary_shows_what_trains_and_the_frozen_bytes():
    from ray_ppu.plan.summary import summary_lines

    cfg, plan, memory = _plan("lora.enabled=true", "lora.rank_pattern={linear_qkv: 32}")
    lines = "\n".join(summary_lines(cfg, plan, memory))
    assert ("trainable: 39.2 M of 7.62 B parameters (0.52%), 39.2 M on the most loaded device: "
            "LoRA linear_qkv r32, linear_proj r16, linear_fc1 r16, linear_fc2 r16; the base is "
            "frozen") in lines
    assert "parameters 14.2 (frozen 14.1, trainable 0.07) + gradients 0.1" in lines


def test_an_adapter_decides_the_section_and_clashes_are_named(peft_dirs):
    from ray_ppu.config.loader import load
    from ray_ppu.errors import ConfigError

    cfg = load(None, [f"checkpoint.pretrained={peft_dirs['qwen']}",
                      f"lora.adapter={peft_dirs['stacked']}"])
    lora = cfg.lora
    assert lora.enabled and set(lora.targets(False)) == {"linear_qkv", "linear_proj",
                                                          "linear_fc1", "linear_fc2"}
    # q rank 2 + v rank 6 stacked; gate / up have their own A's: 4 + 4
    assert lora.rank_pattern == {"linear_qkv": 8, "linear_proj": 4, "linear_fc1": 8,
                                 "linear_fc2": 4}
    assert lora.scale_of("linear_qkv") == ALPHA / 2  # the first module's (q's) alpha / r
    with pytest.raises(ConfigError, match=r"lora.rank and lora.adapter=.* both set"):
        load(None, [f"checkpoint.pretrained={peft_dirs['qwen']}",
                    f"lora.adapter={peft_dirs['stacked']}", "lora.rank=8"])
    with pytest.raises(ConfigError, match="no adapter_config.json"):
        load(None, [f"checkpoint.pretrained={peft_dirs['qwen']}",
                    f"lora.adapter={peft_dirs['qwen']}"])
    with pytest.raises(ConfigError, match=r"lora.rank_pattern=.*expected a mapping"):
        load(None, ["lora.rank_pattern=8"])


def _peft_model(kind: str, base, adapter: str):
    """PEFT LoRA on ``base`` with random A and B. ``shared``: q / k / v share one A, gate / up
    another (as ray_ppu exports them); ``stacked``: q rank 2 and v rank 6 (k left alone), o and
    the MLP rank 4, alpha 6 on v (other scales); ``experts`` (Qwen3-MoE): attention and both
    expert parameters."""
    from peft import LoraConfig, get_peft_model

    if kind == "qwen3":
        config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear")
    elif adapter == "stacked":
        config = LoraConfig(r=RANK, lora_alpha=ALPHA, rank_pattern={"q_proj": 2, "v_proj": 6},
                            alpha_pattern={"v_proj": 6.0},
                            target_modules=["q_proj", "v_proj", "o_proj", "gate_proj",
                                            "up_proj", "down_proj"])
    elif kind == "moe":
        config = LoraConfig(r=RANK, lora_alpha=ALPHA,
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                            target_parameters=["mlp.experts.gate_up_proj",
                                               "mlp.experts.down_proj"])
    else:
        config = LoraConfig(r=RANK, lora_alpha=ALPHA,
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                            "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(base, config)
    torch.manual_seed(1)
    shared: dict = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" not in name:
                continue
            param.normal_(0.0, 0.2)
            group = ("attn" if "_proj" in name and "self_attn" in name and "o_proj" not in name
                     else "gate_up" if ("gate_proj" in name or "up_proj" in name) else None)
            if adapter == "shared" and "lora_A" in name and group:
                layer = name.split("layers.")[1].split(".")[0]
                param.copy_(shared.setdefault((layer, group), param.detach().clone()))
    return model


def _hf_loss(model) -> torch.Tensor:
    logits = model(torch.tensor([TOKENS[:-1]])).logits[0]
    return torch.nn.functional.cross_entropy(logits, torch.tensor(TOKENS[1:]))


@pytest.fixture(scope="module")
def peft_dirs(tmp_path_factory):
    """Base models and PEFT adapters on disk, with PEFT's logits and gradients."""
    from test_hf import _hf_model

    root = tmp_path_factory.mktemp("lora")
    out = {}
    for kind, adapters in (("qwen", ("shared", "stacked")), ("moe", ("experts",)),
                           ("qwen3", ("qwen3_all",))):
        base_dir = root / kind
        hf_kind = {"qwen": "qwen_gqa", "moe": "qwen3_moe", "qwen3": "qwen3"}[kind]
        extra = {"router_aux_loss_coef": 0.0} if kind == "moe" else {}
        _hf_model(hf_kind, **extra).save_pretrained(base_dir)
        out[kind] = base_dir
        for adapter in adapters:
            model = _peft_model(kind, _hf_model(hf_kind, **extra), adapter)
            path = root / f"adapter_{adapter}"
            model.save_pretrained(path)
            model.zero_grad()
            loss = _hf_loss(model)
            loss.backward()
            with torch.no_grad():
                logits = model(torch.tensor([TOKENS[:-1]])).logits[0]
            torch.save({"logits": logits, "loss": loss.detach(),
                        "grads": {n: p.grad.clone() for n, p in model.named_parameters()
                                  if p.grad is not None}}, path / "reference.pt")
            out[adapter] = path
    return out


@pytest.fixture(scope="module")
def launched(peft_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_layouts")
    jobs = {"out": str(out), "dirs": {k: str(v) for k, v in peft_dirs.items()}, "runs": RUNS,
            "train": TRAIN}
    return launch_torchrun(__file__, jobs, out, timeout=900)


@pytest.mark.parametrize("run", RUNS, ids=run_name)
def test_logits_equal_peft_at_every_layout(run, launched, peft_dirs):
    ours = torch.load(launched / f"{run_name(run)}.pt")
    reference = torch.load(peft_dirs[run[1]] / "reference.pt")
    bf16 = run[10:] == ("bf16",)  # bf16 weights and activations against PEFT's fp32
    tolerance = 0.1 if bf16 else 1e-5
    torch.testing.assert_close(ours["logits"], reference["logits"], rtol=0, atol=tolerance)
    assert ours["loss"] == pytest.approx(float(reference["loss"]), abs=tolerance / 10)


def test_gradients_at_tp1_equal_peft(launched, peft_dirs):
    """The fused adapters' gradients are PEFT's: the A that q / k / v (gate / up) share gets
    the sum of their A gradients, and B's rows are theirs, in Megatron's row order."""
    from ray_ppu.hf import config as hf_config
    from ray_ppu.hf.peft import HF_MODULES, target_of_key
    from ray_ppu.hf.weights import to_hf

    ours = torch.load(launched / f"{run_name(RUNS[0])}.pt")["grads"]
    theirs = torch.load(peft_dirs["shared"] / "reference.pt")["grads"]
    model = hf_config.model_from_hf(hf_config.read(peft_dirs["qwen"]))

    def peft(module: str, piece: str) -> torch.Tensor:
        return theirs[f"base_model.model.{module}.lora_{piece}.default.weight"]

    checked = 0
    for key, grad in ours.items():
        target, piece = target_of_key(key)
        weight_key, modules = HF_MODULES[target]
        for layer in range(model.num_layers):
            if piece == "a":
                total = sum(peft(f"model.layers.{layer}.{m}", "A") for m in modules)
                torch.testing.assert_close(grad[layer], total, rtol=0, atol=1e-6)
            else:
                for name, rows in to_hf(model, model.vocab_size, weight_key, layer, grad[layer]):
                    torch.testing.assert_close(rows, peft(name.removesuffix(".weight"), "B"),
                                               rtol=0, atol=1e-6)
            checked += 1
    assert checked == 4 * 8  # 4 layers × (A, B) of 4 targets


@pytest.mark.parametrize("run", [r for r in RUNS if r[8] and r[2:8] != (1, 1, None, 1, None,
                                                                         False)], ids=run_name)
def test_gradients_at_every_layout_equal_tp1(run, launched):
    """Every adapter's whole gradient (its shards put together) at TP 2 ± SP, PP 2, virtual
    PP, EP 2, ETP 2 equals TP 1's: the sharded adapters back-propagate as unsharded LoRA."""
    tp1 = next(r for r in RUNS if r[:2] == run[:2] and r[2:8] == (1, 1, None, 1, None, False))
    ours = torch.load(launched / f"{run_name(run)}.pt")["grads"]
    reference = torch.load(launched / f"{run_name(tp1)}.pt")["grads"]
    assert sorted(ours) == sorted(reference) and ours
    for key in reference:
        torch.testing.assert_close(ours[key], reference[key], rtol=0, atol=2e-6, msg=key)


def test_a_frozen_base_costs_no_gradients_or_optimizer_state_and_never_changes(launched):
    """Three real optimizer steps (TP 2, SP, DDP, distributed optimizer): no frozen weight
    changed by a single bit, every adapter did; Adam's state and DDP's gradient buffers hold
    exactly the adapters' elements (none for the base, 97 % of the parameters here), which is
    the plan's count of what trains on a device."""
    ranks = json.loads((launched / "frozen.json").read_text())
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["frozen_changed"] == [] and rank["frozen"] > 10 * rank["trainable"]
        assert rank["adapters_changed"] == 32  # 4 layers × 4 targets × (A, B), each rank
        assert rank["adam_elements"] == rank["trainable"] // rank["dp"]
        assert rank["frozen_with_main_grad"] == 0
        # DDP aligns each parameter in its buffer: at most 64 elements of padding each
        assert rank["trainable"] <= rank["grad_buffer_elements"] <= rank["trainable"] + 64 * 32
        assert rank["trainable"] == rank["plan_trainable_per_device"]


def test_entry_points_name_a_bad_adapter_or_merge_in_one_line(peft_dirs, tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints"))
    import convert_checkpoint
    import generate

    assert convert_checkpoint.main(["mcore-to-hf", "--checkpoint", str(peft_dirs["qwen"]),
                                    "--out", str(tmp_path / "x"), "--merge"]) == 2
    assert generate.main(["--checkpoint", str(peft_dirs["qwen"]), "--lora",
                          str(peft_dirs["qwen"]), "--token-ids", "1,2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --merge: {peft_dirs['qwen']} is no LoRA run's checkpoint (nothing "
                   f"to merge; drop --merge)",
                   f"error: --lora {peft_dirs['qwen']}: no adapter_config.json (a PEFT adapter "
                   f"directory holds it and adapter_model.safetensors)"], err


@pytest.mark.gpu
@pytest.mark.skipif(not _transformer_engine_device(),
                    reason="needs a CUDA/PPU device with Transformer Engine")
@pytest.mark.parametrize("adapter", ["shared", "stacked", "experts"])
def test_lora_on_transformer_engine_layers_equals_peft(peft_dirs, tmp_path, adapter):
    """On a device the layers are Transformer Engine's: q/k/v and fc1 are fused layer-norm
    linears (the adapter normalises their input itself) and a MoE layer's adapted experts are
    TE's sequential experts; generate.py --lora gives PEFT's fp32 logits."""
    from conftest import REPO

    dump = tmp_path / "logits.json"
    base = peft_dirs["moe" if adapter == "experts" else "qwen"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "entrypoints" / "generate.py"), "--checkpoint", str(base),
         "--lora", str(peft_dirs[adapter]), "--token-ids", ",".join(map(str, TOKENS[:-1])),
         "--max-new-tokens", "1", "--device", "ppu", "--precision", "fp32",
         "--dump-logits", str(dump)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = torch.load(peft_dirs[adapter] / "reference.pt")["logits"]
    ours = torch.tensor(json.loads(dump.read_text())["logits"])
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-3)  # TE kernels, TF32 off


# ---------------------------------------------------------------------------------------------
# The torchrun side: python -m torch.distributed.run --nproc-per-node 2 tests/test_lora.py JOBS
# ---------------------------------------------------------------------------------------------

def _gather_adapter_grads(chunks: list) -> dict:
    """Every adapter's whole gradient on rank 0: each rank's shards (the sharded state dict
    built over the gradients, so each piece knows its region), put together."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from ray_ppu.config.lora import is_adapter_key
    from ray_ppu.util.wrappers import unwrap

    pieces = []
    for chunk in chunks:
        module = unwrap(chunk)
        params = [p for n, p in module.named_parameters() if is_adapter_key(n)]
        saved = [p.data for p in params]
        for p in params:
            p.data = p.main_grad.to(p.dtype)
        state = module.sharded_state_dict()
        apply_factories(state)
        for sh in nested_values(state):
            if isinstance(sh, ShardedTensor) and is_adapter_key(sh.key):
                pieces.append((sh.key, sh.global_shape, sh.global_offset, sh.data.clone()))
        for p, data in zip(params, saved):
            p.data = data
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, pieces)
    full: dict = {}
    for key, shape, offset, data in (p for rank in everything for p in rank):
        tensor = full.setdefault(key, torch.zeros(shape))
        region = tensor
        for dim, (start, size) in enumerate(zip(offset, (1,) * (len(shape) - data.dim())
                                                + tuple(data.shape))):
            region = region.narrow(dim, start, size)
        region.copy_(data.reshape(region.shape))
    return full


def _loss_and_grads(chunks: list) -> float:
    """One backward pass of the prompt's mean next-token loss through Megatron's schedule
    (finalize_model_grads: DP, SP and embedding reductions)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_attr_wrapped_model

    from ray_ppu.train.schedule import mean_loss, per_chunk, sum_reports

    ids = torch.tensor([TOKENS[:-1]])
    labels = torch.tensor([TOKENS[1:]])
    positions = torch.arange(ids.shape[1])[None]

    def step(_data, model):
        output = model(ids, positions, None, labels=labels)

        def loss_func(losses):
            total = losses.float().sum()
            stats = torch.stack([total.detach(), torch.tensor(float(losses.numel()))])
            return total / losses.numel(), {"lm loss": stats}

        return output, loss_func

    config = get_attr_wrapped_model(chunks[0], "config")
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = per_chunk(chunks, "no_sync")
    for chunk in chunks:
        chunk.zero_grad_buffer()
    interleaved = len(chunks) > 1
    reports = get_forward_backward_func()(
        forward_step_func=step, data_iterator=[None] * len(chunks) if interleaved else None,
        model=chunks if interleaved else chunks[0], num_microbatches=2 if interleaved else 1,
        seq_length=ids.shape[1], micro_batch_size=1, forward_only=False)
    return mean_loss(sum_reports(reports, None), torch.device("cpu"))


def _train_frozen(jobs: dict, out: Path) -> None:
    """Three optimizer steps of the real train_step (TP 2 with SP, DDP, the distributed
    optimizer) on the Qwen2 base with the PEFT adapter: every rank reports its frozen
    weights before and after, its adapters' change, the elements its Adam state and its
    DDP gradient buffers hold, and the plan's trainable parameters per device."""
    import torch.distributed as dist

    from ray_ppu import devices
    from ray_ppu.config.lora import LoraConfig
    from ray_ppu.hf.peft import load_into, lora_section, read_adapter
    from ray_ppu.hf.weights import load_pretrained
    from ray_ppu.model import parallel
    from ray_ppu.model.gpt import build_model
    from ray_ppu.model.optim import build_optimizer
    from ray_ppu.offline import inference
    from ray_ppu.plan import build_plan
    from ray_ppu.train.loop import TrainState, _Window, wire_gradient_sync, train_step
    from ray_ppu.train.schedule import make_schedule
    from ray_ppu.util.wrappers import unwrap

    tp, sp = jobs["train"]
    source = inference.open_source(jobs["dirs"]["qwen"])
    adapter = read_adapter(jobs["dirs"]["shared"])
    lora = LoraConfig(**lora_section(adapter, source.model))
    cfg, _ = inference.inference_config(source.model, dist.get_world_size(), tp, device="cpu",
                                        lora=lora, sequence_parallel=sp)
    dp = dist.get_world_size() // tp
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(
        cfg.training, seq_length=len(TOKENS) - 1, global_batch_size=2 * dp, train_iters=3,
        lr=1e-2, use_distributed_optimizer=True, lr_warmup_iters=0),
        checkpoint=dataclasses.replace(cfg.checkpoint, pretrained=str(source.path)))
    plan = build_plan(cfg)
    batch = {"tokens": [TOKENS[:-1]], "labels": [TOKENS[1:]], "loss_mask": [[1.0] * 12],
             "position_ids": [list(range(12))]}
    with devices.bound("cpu", 0):
        parallel.initialize(plan, cfg.training.seed)
        try:
            model, _ = build_model(cfg, plan, "cpu", initialize=False)
            optimizer, scheduler = build_optimizer(cfg, plan, model)
            load_pretrained(model, str(source.path), cfg.model, plan.padded_vocab_size)
            load_into(model, adapter, cfg.model, cfg.lora)
            optimizer.reload_model_params()
            named = dict(unwrap(model[0]).named_parameters())
            before = {n: p.detach().clone() for n, p in named.items()}
            state = TrainState(plan, model, optimizer, scheduler, torch.device("cpu"))
            wire_gradient_sync(model, optimizer)
            schedule = make_schedule(plan, model, torch.device("cpu"))
            window = _Window(start=0.0)
            for _ in range(3):
                train_step(state, schedule, iter([batch] * 8), window)
            adam = sum(v.numel() for opt in optimizer.chained_optimizers
                       for st in opt.optimizer.state.values() for k, v in st.items()
                       if k == "exp_avg")
            buffers = sum(b.numel_unpadded for chunk in model for b in chunk.buffers)
            report = {
                "frozen_changed": [n for n, p in named.items() if not p.requires_grad
                                   and not torch.equal(p, before[n])],
                "frozen": sum(p.numel() for p in named.values() if not p.requires_grad),
                "adapters_changed": sum(not torch.equal(p, before[n])
                                        for n, p in named.items() if p.requires_grad),
                "trainable": sum(p.numel() for p in named.values() if p.requires_grad),
                "adam_elements": adam, "grad_buffer_elements": buffers,
                "frozen_with_main_grad": sum(hasattr(p, "main_grad") for p in named.values()
                                             if not p.requires_grad),
                "plan_trainable_per_device": plan.num_trainable_parameters_per_device,
                "dp": plan.data_parallel_size, "loss_sum": window.loss_sum.tolist()
                if window.loss_sum is not None else None,
            }
        finally:
            parallel.destroy()
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        (out / "frozen.json").write_text(json.dumps(reports))


def _run_layouts(jobs: dict) -> None:
    import logging

    import torch.distributed as dist

    from ray_ppu import devices
    from ray_ppu.config.lora import LoraConfig
    from ray_ppu.hf.peft import lora_section, read_adapter
    from ray_ppu.model import parallel
    from ray_ppu.model.gpt import build_model
    from ray_ppu.offline import inference

    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    out, dirs = Path(jobs["out"]), dict(jobs["dirs"])
    with parallel.process_group("cpu"):
        from ray_ppu.offline.hf_to_mcore import to_mcore

        dirs["qwen_mcore"] = to_mcore(dirs["qwen"], out / "mcore_qwen", tp=2)["checkpoint"]
        for run in jobs["runs"]:
            kind, adapter_name, tp, pp, vs, ep, etp, sp, grads, *options = run
            recompute, precision = (tuple(options) + ("none", "fp32")[len(options):])[:2]
            source = inference.open_source(dirs[kind])
            adapter = read_adapter(dirs[adapter_name])
            lora = LoraConfig(**lora_section(adapter, source.model))
            cfg, plan = inference.inference_config(source.model, dist.get_world_size(), tp, pp,
                                                   vs, device="cpu", ep=ep, etp=etp, lora=lora,
                                                   sequence_parallel=sp, precision=precision)
            cfg = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory,
                                                                      recompute=recompute))
            with devices.bound("cpu", 0):
                parallel.initialize(plan, cfg.training.seed)
                try:
                    chunks, _ = build_model(cfg, plan, "cpu", initialize=False)
                    inference.load_weights(chunks, source, cfg, plan, adapter)
                    for chunk in chunks:
                        chunk.eval()
                    logits = inference.prompt_logits(chunks, TOKENS[:-1],
                                                     source.model.vocab_size, torch.device("cpu"))
                    result = {"logits": logits}
                    if grads:
                        for chunk in chunks:  # recompute acts in training mode only
                            chunk.train()
                        result["loss"] = _loss_and_grads(chunks)
                        result["grads"] = _gather_adapter_grads(chunks)
                    else:
                        result["loss"] = float(torch.nn.functional.cross_entropy(
                            logits, torch.tensor(TOKENS[1:])))
                finally:
                    parallel.destroy()
            if dist.get_rank() == 0:
                torch.save(result, out / f"{run_name(run)}.pt")
        _train_frozen(jobs, out)


if __name__ == "__main__":  # dist_checkpointing starts spawn-context helpers: guard needed
    _run_layouts(json.loads(Path(sys.argv[1]).read_text()))


def test_the_summary_names_the_exports_a_lora_run_allows(qwen2_tokenizer_dir):
    """--dry-run says what a LoRA run's checkpoints export to: a PEFT adapter (a trained
    projector or merger as modules_to_save) unless a part outside those trains in full; a
    Qwen2.5-VL LoRA run freezes its merger unless told otherwise."""
    from ray_ppu.config.loader import load
    from ray_ppu.plan import build_plan
    from ray_ppu.plan.summary import _lora

    def exports(*overrides):
        cfg = load(None, ["lora.enabled=true", "checkpoint.load=/x", "training.train_iters=1",
                          "training.eval_iters=0", "data.data_path=[/x]", *overrides])
        return _lora(cfg, build_plan(cfg))[1]

    vl = ["data.dataset=sft", f"data.tokenizer={qwen2_tokenizer_dir}"]
    assert exports() == "exports: a PEFT adapter, or the merged model (--merge)"
    assert exports("lora.trainable=[norms]") == (
        "exports: the merged model (--merge) only: norms trains in full, which a PEFT adapter "
        "does not carry")
    # Qwen2.5-VL with LoRA: the adapters alone train unless vision.freeze is set (the seed's
    # recipe, PEFT's habit); the merger trained is exported as modules_to_save
    assert load(None, ["model.preset=tiny-qwen-vl", "lora.enabled=true"]).vision.freeze == [
        "vision", "projector"]
    assert load(None, ["model.preset=tiny-qwen-vl"]).vision.freeze == ["vision"]
    assert exports("model.preset=tiny-qwen-vl", *vl) == \
        "exports: a PEFT adapter, or the merged model (--merge)"
    assert exports("model.preset=tiny-qwen-vl", "vision.freeze=[vision]", *vl) == (
        "exports: a PEFT adapter (the merger as modules_to_save), or the merged model (--merge)")
    assert exports("model.preset=tiny-vl", "vision.freeze=[vision, projector]", *vl) == \
        "exports: a PEFT adapter, or the merged model (--merge)"
    assert exports("model.preset=tiny-vl", "vision.freeze=[]", *vl).startswith(
        "exports: the merged model (--merge) only: the vision tower trains in full")

