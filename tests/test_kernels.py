"""The torch kernels a run uses without Transformer Engine (``ray_ppu.plan.kernels``) against
Megatron-Core's reference ones, in fp32:

* core attention: torch SDPA (``attention_backend=sdpa``) vs Megatron-Core's local
  ``DotProductAttention``; packed rows through the sample boundaries (THD) vs the s × s mask;
* the loss: the chunked vocabulary-parallel cross entropy vs the output layer's logits and
  ``vocab_parallel_cross_entropy``, with a padded vocabulary;
* MoE experts: one ``torch._grouped_mm`` per linear vs SequentialMLP's loop.

In-process tests check each function on its own (chunk sizes, boundaries, a frozen weight);
one torchrun launch of two CPU ranks (this file's ``__main__``) builds the tiny model with both
kernel sets at TP 2, TP 2 with SP, PP 2 and EP 2 and compares losses and every parameter's
gradient (the same layout on both sides: each rank's shards compare directly). GPU tests (marked)
compare the device kernels (varlen flash attention, bf16 grouped GEMM) with the CPU ones.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import launch_torchrun

# the reference kernels, and the torch ones (a run's default wherever TE is not used)
REFERENCE = ["training.attention_backend=local", "training.cross_entropy=megatron",
             "training.moe_grouped_gemm=false"]
TORCH = ["training.attention_backend=sdpa", "training.cross_entropy=chunked",
         "training.cross_entropy_chunk_tokens=5", "training.moe_grouped_gemm=true"]
# name → (overrides, world ranks): the layouts each kernel set is built at
LAYOUTS = {
    "tp2": ["parallel.tensor_model_parallel_size=2"],
    "tp2_sp": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],
    "ep2_moe": ["model.preset=tiny-moe", "parallel.expert_model_parallel_size=2",
                "parallel.expert_tensor_parallel_size=1"],
}
SEQ = 32
# two packed rows: samples of 5, 19 and 8 tokens; of 32
CU_SEQLENS = [[0, 5, 24, 32], [0, 32, 32, 32]]


# ----------------------------------------------------------------------- in-process checks

def _qkv(t: int, heads: int = 4, groups: int = 2, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads, d, generator=g, requires_grad=True)
    k = torch.randn(t, groups, d, generator=g, requires_grad=True)
    v = torch.randn(t, groups, d, generator=g, requires_grad=True)
    return q, k, v


def _reference_attention(q, k, v, causal: bool) -> torch.Tensor:
    """Textbook attention of one sample [t, heads, d] (K/V repeated per head, fp64 softmax)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / q.shape[-1] ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), -torch.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("causal", [True, False])
def test_packed_attention_is_attention_within_each_sample(causal):
    from ray_ppu.model.attention import packed_attention

    q, k, v = _qkv(32)
    cu = torch.tensor([0, 5, 24, 32])
    out = packed_attention(q, k, v, cu, 19, causal)
    pieces = [_reference_attention(q[a:b], k[a:b], v[a:b], causal)
              for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    assert torch.allclose(out, torch.cat(pieces), atol=1e-5)
    # one sequence instead of three: the samples see each other, and the result moves
    whole = packed_attention(q, k, v, torch.tensor([0, 32]), 32, causal)
    assert (whole[5:] - out[5:]).abs().max() > 1e-2
    # gradients through the per-sample kernel equal the reference's
    out.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.cat(pieces).square().sum().backward()
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        assert torch.allclose(got, want, atol=1e-4)


def test_boundaries_that_do_not_cover_the_rows_are_refused():
    from ray_ppu.model.attention import packed_attention

    q, k, v = _qkv(32)
    with pytest.raises(ValueError, match="cover 30 tokens, the microbatch has 32"):
        packed_attention(q, k, v, torch.tensor([0, 10, 30]), 20, True)


def _padded_vocab_loss(hidden, weight, labels, vocab):
    """Megatron's semantics on one rank: logits over the padded vocabulary, padding at -inf."""
    logits = (hidden @ weight.t()).float()
    logits[:, vocab:] = -torch.inf
    return F.cross_entropy(logits, labels, reduction="none")


@pytest.mark.parametrize("chunk", [1, 7, 64, 0])
def test_chunked_cross_entropy_equals_the_whole_logits_loss(chunk):
    """Every chunk size (0: by the byte budget, one chunk here) gives the same per-token loss
    and gradients as the logits of all tokens at once; padding rows never count."""
    from ray_ppu.model.output_loss import ChunkedCrossEntropy, _Shard, chunk_tokens

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 16, generator=g, requires_grad=True)
    weight = torch.randn(24, 16, generator=g, requires_grad=True)  # V' 24, V 21
    labels = torch.randint(0, 21, (40,), generator=g)
    upstream = torch.rand(40, generator=g)  # a loss mask's weights
    losses = ChunkedCrossEntropy.apply(hidden, weight, labels, _Shard(0, 24, 21, None),
                                       chunk_tokens(24, chunk))
    (losses * upstream).sum().backward()
    got = losses.detach(), hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    want = _padded_vocab_loss(hidden, weight, labels, 21)
    (want * upstream).sum().backward()
    assert torch.allclose(got[0], want.detach(), atol=1e-5)
    assert torch.allclose(got[1], hidden.grad, atol=1e-5)
    assert torch.allclose(got[2], weight.grad, atol=1e-5)
    assert weight.grad[21:].abs().max() == 0  # padding rows learn nothing


def test_a_frozen_output_weight_gets_no_gradient():
    from ray_ppu.model.output_loss import ChunkedCrossEntropy, _Shard

    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(10, 8)  # frozen (LoRA's base)
    ChunkedCrossEntropy.apply(hidden, weight, torch.arange(6), _Shard(0, 10, 10, None),
                              4).sum().backward()
    assert hidden.grad is not None and weight.grad is None


def test_grouped_experts_equal_the_loop_of_experts():
    """torch._grouped_mm over the experts' stacked weights, forward and backward (an expert
    with no tokens included), equals one GEMM per expert."""
    from ray_ppu.model.moe_layers import _GroupedLinear

    g = torch.Generator().manual_seed(2)
    x = torch.randn(30, 8, generator=g, requires_grad=True)
    weights = [torch.randn(12, 8, generator=g, requires_grad=True) for _ in range(4)]
    counts = [7, 0, 15, 8]
    out = _GroupedLinear.apply(x, torch.tensor(counts).cumsum(0).int(), *weights)
    upstream = torch.randn(30, 12, generator=g)
    (out * upstream).sum().backward()
    got = [out.detach(), x.grad.clone()] + [w.grad.clone() for w in weights]
    x.grad = None
    for w in weights:
        w.grad = None
    want = torch.cat([part @ w.t() for part, w in zip(x.split(counts), weights)])
    (want * upstream).sum().backward()
    for a, b in zip(got, [want.detach(), x.grad] + [w.grad for w in weights]):
        assert torch.allclose(a, b, atol=1e-5)
    assert got[3].abs().max() == 0  # expert 1 saw no token


def test_the_plan_names_the_kernels_and_the_memory_they_keep():
    """The summary names the kernels; on a device the plan counts TE's, and says what a worker
    without TE runs; the chunked loss plans no microbatch-wide logits."""
    from ray_ppu.config.loader import load
    from ray_ppu.plan import build_plan
    from ray_ppu.plan.kernels import choose
    from ray_ppu.plan.memory import memory_plan
    from ray_ppu.plan.summary import summary_lines

    base = ["data.data_path=[corpus]", "training.train_iters=4", "model.preset=0.5B",
            "training.seq_length=4096", "cluster.num_workers=1", "training.global_batch_size=1"]
    cpu = load(None, [*base, "cluster.device=cpu"])
    line = next(l for l in summary_lines(cpu, build_plan(cpu), memory_plan(cpu, build_plan(cpu)))
                if l.startswith("kernels:"))
    assert "attention sdpa" in line and "loss: chunked" in line
    device = load(None, [*base, "cluster.device=ppu"])
    plan = build_plan(device)
    line = next(l for l in summary_lines(device, plan, memory_plan(device, plan))
                if l.startswith("kernels:"))
    assert "attention te" in line and "does not import: attention sdpa" in line
    megatron = load(None, [*base, "cluster.device=ppu", "training.cross_entropy=megatron"])
    logits = 4096 * build_plan(megatron).padded_vocab_size * 4  # fp32, TP 1
    chunked = memory_plan(device, plan, choose(device, False)).activations_per_microbatch_gib
    full = memory_plan(megatron, build_plan(megatron),
                       choose(megatron, False)).activations_per_microbatch_gib
    assert (full - chunked) * 2 ** 30 == pytest.approx(logits, rel=0.05)


# --------------------------------------------------------------- two ranks, both kernel sets

@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels")
    return launch_torchrun(__file__, {"out": str(out)}, out, timeout=900)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rows", ["unpacked", "packed"])
def test_torch_kernels_equal_megatrons_at_every_layout(launched, layout, rows):
    """Losses and every parameter's gradient (each rank's shards) of the torch kernels equal
    the reference kernels' in fp32; packed rows: THD boundaries against the s × s mask."""
    results = torch.load(launched / f"{layout}_{rows}.pt")
    for rank in results:
        ref, ours = rank["reference"], rank["torch"]
        if ref["loss"] is not None:  # the last pipeline stage holds the losses
            assert torch.allclose(ours["loss"], ref["loss"], rtol=1e-5, atol=1e-6)
        assert ref["grads"].keys() == ours["grads"].keys()
        for name, grad in ref["grads"].items():
            scale = grad.abs().max().clamp(min=1e-8)
            assert (ours["grads"][name] - grad).abs().max() / scale < 1e-4, name
    assert any(rank["reference"]["loss"] is not None for rank in results)


def test_each_layout_ran_the_kernels_it_names(launched):
    """The torch side really ran the torch kernels (not the reference ones twice)."""
    used = json.loads((launched / "kernels.json").read_text())
    for layout, kinds in used.items():
        assert kinds["reference"]["attention"] == "DotProductAttention", layout
        assert kinds["torch"]["attention"] == "TorchAttention", layout
        assert kinds["torch"]["output"] in ("ChunkedOutputLayer", None), layout
        if layout == "ep2_moe":
            assert kinds["torch"]["experts"] == "GroupedLayoutFreeMLP"
            assert kinds["reference"]["experts"] == "LayoutFreeSequentialMLP"


def test_middle_pipeline_chunks_keep_packed_samples_apart(launched):
    """PP 2 with 2 virtual stages: chunks that are neither the first nor the last read the
    sample boundaries too; a packed row's per-token losses are its samples' padded alone."""
    last = next(r for r in torch.load(launched / "pp2_vp2_packing.pt") if r["packed"] is not None)
    lengths = last["lengths"]
    packed = last["packed"][:2 * SEQ]  # the first microbatch (the second is the same)
    padded = last["padded"].reshape(-1, SEQ)  # one row per sample
    ours = torch.cat([padded[i, :n] for i, n in enumerate(lengths)])
    assert torch.allclose(packed, ours, rtol=1e-5, atol=1e-6)


def test_grouped_experts_train_like_the_loop_at_expert_dp_2(launched):
    """Three optimizer steps with the distributed optimizer and overlapped parameter gathers:
    the grouped GEMM's experts see every rank's update (their linears' gather hooks run)."""
    ranks = torch.load(launched / "expert_dp_training.pt")
    for rank in ranks:
        for ours, theirs in zip(rank["grouped"]["losses"], rank["loop"]["losses"]):
            assert ours == pytest.approx(theirs, rel=1e-5)  # [loss sum, tokens]
    for name, weight in ranks[0]["grouped"]["experts"].items():
        assert torch.equal(weight, ranks[1]["grouped"]["experts"][name]), name


# --------------------------------------------------------------------------- the device

def _cuda() -> bool:
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA/PPU device")
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_flash_attention_equals_per_sample_attention_on_the_device(causal):
    from ray_ppu.model.attention import _per_sample_attention, packed_attention, packed_kernel

    q, k, v = (t.detach().cuda().bfloat16().requires_grad_() for t in _qkv(2048, 16, 2, 128))
    assert packed_kernel(q) == "varlen"
    cu = torch.tensor([0, 100, 1100, 1101, 2048], device="cuda")
    out = packed_attention(q, k, v, cu, 1000, causal)
    ref = _per_sample_attention(q.float(), k.float(), v.float(), cu, causal, 128 ** -0.5, 0.0)
    assert (out.float() - ref).norm() / ref.norm() < 2e-2
    out.float().square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA/PPU device")
def test_grouped_gemm_in_bf16_equals_the_loop_on_the_device():
    from ray_ppu.model.moe_layers import _GroupedLinear, grouped_gemm_usable

    if not grouped_gemm_usable(torch.device("cuda"), torch.bfloat16):
        pytest.skip("torch._grouped_mm needs bf16 on compute capability ≥ 9.0")
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weights = [torch.randn(1536, 2048, device="cuda", dtype=torch.bfloat16) / 45
               for _ in range(8)]
    for w in weights:
        w.requires_grad_()
    counts = [700, 0, 1000, 13, 900, 483, 1000, 0]
    out = _GroupedLinear.apply(x, torch.tensor(counts, device="cuda").cumsum(0).int(), *weights)
    want = torch.cat([p.float() @ w.float().t() for p, w in zip(x.split(counts), weights)])
    assert (out.float() - want).norm() / want.norm() < 1e-2
    out.float().sum().backward()
    wgrad = x[:700].float().sum(0)  # d(sum)/dW_0 = 1ᵀ·x_0 per output row
    assert (weights[0].grad[0].float() - wgrad).norm() / wgrad.norm() < 1e-2
    assert weights[1].grad.abs().max() == 0


# ------------------------------------------------ the torchrun side: python -m torch.distributed.run

def _microbatch(packed: bool, vocab: int):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (2, SEQ), generator=g)
    labels = torch.randint(0, vocab, (2, SEQ), generator=g)
    batch = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(2, SEQ),
             "position_ids": torch.arange(SEQ).expand(2, -1).contiguous()}
    if packed:
        batch["cu_seqlens"] = torch.tensor([row + [SEQ] * (4 - len(row)) for row in CU_SEQLENS])
    return batch


def _padded(packed: dict) -> list[dict]:
    """The packed microbatch's samples one per row (padded to SEQ, loss on the sample's own
    tokens), two rows a microbatch: the per-token losses packing must reproduce."""
    rows = []
    for r, bounds in enumerate(CU_SEQLENS):
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                row = {k: torch.zeros(SEQ, dtype=packed[k].dtype) for k in ("tokens", "labels")}
                row["tokens"][:b - a] = packed["tokens"][r, a:b]
                row["labels"][:b - a] = packed["labels"][r, a:b]
                mask = torch.zeros(SEQ)
                mask[:b - a] = 1.0
                rows.append({**row, "loss_mask": mask, "position_ids": torch.arange(SEQ),
                             "length": b - a})
    return [{k: torch.stack([row[k] for row in rows[i:i + 2]]) if k != "length"
             else [row[k] for row in rows[i:i + 2]] for k in rows[0]}
            for i in range(0, len(rows), 2)]


def _step(cfg, plan, chunks, batch, packed: str | None):
    """One forward and backward through Megatron's schedule over ``batch`` (a microbatch, or
    a list of the plan's microbatches); this rank's per-token losses (None off the last
    stage) and every parameter's gradient (its local shard)."""
    from functools import partial

    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_attr_wrapped_model

    from ray_ppu.train.batch import forward_step
    from ray_ppu.train.schedule import make_schedule, per_chunk

    config = get_attr_wrapped_model(chunks[0], "config")
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = per_chunk(chunks, "no_sync")
    losses = []
    schedule = make_schedule(plan, chunks, torch.device("cpu"), packed=packed)
    ours = schedule.args[1]  # the schedule's own forward_step partial (device, packing, …)

    def step(batches, model):
        output, loss_func = forward_step(batches, model, **ours.keywords)

        def keep(*args):
            out = loss_func(*args)
            losses.append(args[-1].detach().clone())
            return out
        return output, keep

    for chunk in chunks:
        chunk.zero_grad_buffer()
    schedule = partial(schedule.func, schedule.args[0], step, *schedule.args[2:])
    schedule(iter(batch if isinstance(batch, list) else [batch]), forward_only=False)
    grads = {f"{i}.{name}": p.main_grad.clone() for i, chunk in enumerate(chunks)
             for name, p in chunk.named_parameters() if p.requires_grad}
    return (torch.cat([l.reshape(-1) for l in losses]) if losses else None), grads


def _kinds(chunks) -> dict:
    """The classes of the core attention, output layer and experts of the built chunks."""
    found = {"attention": None, "output": None, "experts": None}
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if name.endswith("core_attention"):
                found["attention"] = type(module).__name__
            elif name.endswith("output_layer"):
                found["output"] = type(module).__name__
            elif name.endswith("mlp.experts"):
                found["experts"] = type(module).__name__
    return found


def _run(jobs: dict) -> None:
    import logging

    import torch.distributed as dist

    from ray_ppu import devices
    from ray_ppu.config.loader import load
    from ray_ppu.model import parallel
    from ray_ppu.model.gpt import build_model, packed_format
    from ray_ppu.plan import build_plan

    logging.getLogger("megatron.core").setLevel(logging.WARNING)
    out = Path(jobs["out"])
    base = ["cluster.device=cpu", "cluster.num_workers=2", "training.train_iters=1",
            "training.precision=fp32", f"training.seq_length={SEQ}", "training.micro_batch_size=2",
            "model.preset=tiny", "model.num_layers=2",
            # 1000 tokens padded to 1024 (a multiple of 128 × TP): padding rows on TP rank 1
            "model.vocab_size=1000", "model.make_vocab_size_divisible_by=128",
            "parallel.overlap_grad_reduce=false", "parallel.overlap_param_gather=false",
            # packed SFT rows (the model is the same; only how its batches keep samples apart)
            "data.dataset=sft", "data.packing=true", "data.data_path=[records]",
            "data.tokenizer=tok", "training.eval_iters=0"]
    used: dict = {}
    with parallel.process_group("cpu"):
        for layout, overrides in LAYOUTS.items():
            result: dict = {"unpacked": {}, "packed": {}}
            for side, kernels in (("reference", REFERENCE), ("torch", TORCH)):
                cfg = load(None, [*base, *overrides, *kernels])
                dp = build_plan(cfg).data_parallel_size
                cfg = dataclasses.replace(cfg, training=dataclasses.replace(
                    cfg.training, global_batch_size=2 * dp))
                plan = build_plan(cfg)
                with devices.bound("cpu", 0):
                    parallel.initialize(plan, cfg.training.seed)
                    try:  # one build, both kinds of rows
                        chunks, _ = build_model(cfg, plan, "cpu")
                        used.setdefault(layout, {})[side] = _kinds(chunks)
                        for rows, packed in (("unpacked", None),
                                             ("packed", packed_format(cfg, plan, "cpu"))):
                            loss, grads = _step(cfg, plan, chunks,
                                                _microbatch(rows == "packed", 1000), packed)
                            result[rows][side] = {"loss": loss, "grads": grads}
                    finally:
                        parallel.destroy()
            for rows, sides in result.items():
                everything = [None] * dist.get_world_size()
                dist.all_gather_object(everything, sides)
                if dist.get_rank() == 0:
                    torch.save(everything, out / f"{layout}_{rows}.pt")
        if dist.get_rank() == 0:
            (out / "kernels.json").write_text(json.dumps(used))
        _interleaved_packing(base, out)
        _expert_data_parallel_training(base, out)


def _interleaved_packing(base: list, out: Path) -> None:
    """PP 2 × 2 virtual stages (the middle chunks read the boundaries too): the packed
    microbatch's per-token losses and those of its samples padded one per row."""
    import torch.distributed as dist

    from ray_ppu import devices
    from ray_ppu.config.loader import load
    from ray_ppu.model import parallel
    from ray_ppu.model.gpt import build_model, packed_format
    from ray_ppu.plan import build_plan

    cfg = load(None, [*base, "parallel.pipeline_model_parallel_size=2", "model.num_layers=4",
                      "parallel.num_layers_per_virtual_pipeline_stage=1", *TORCH,
                      "training.global_batch_size=4"])  # 2 microbatches (interleaving's least)
    plan = build_plan(cfg)
    packed = _microbatch(True, 1000)
    padded = _padded(packed)
    result = {}
    with devices.bound("cpu", 0):
        parallel.initialize(plan, cfg.training.seed)
        try:
            chunks, _ = build_model(cfg, plan, "cpu")
            result["packed"] = _step(cfg, plan, chunks, [packed, packed],
                                     packed_format(cfg, plan, "cpu"))[0]
            inputs = [{k: v for k, v in mb.items() if k != "length"} for mb in padded]
            result["padded"] = _step(cfg, plan, chunks, inputs, None)[0]
        finally:
            parallel.destroy()
    result["lengths"] = [n for mb in padded for n in mb["length"]]
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, result)
    if dist.get_rank() == 0:
        torch.save(everything, out / "pp2_vp2_packing.pt")


def _expert_data_parallel_training(base: list, out: Path) -> None:
    """tiny-moe at DP 2 (each expert on both ranks, its optimizer state split between them;
    parameters all-gathered bucket by bucket in the next forward, overlap_param_gather, small
    buckets): three optimizer steps with the grouped experts and with the loop of experts give
    the same losses, and every rank holds the same expert weights after them."""
    import dataclasses

    import torch.distributed as dist

    from ray_ppu import devices
    from ray_ppu.config.loader import load
    from ray_ppu.model import parallel
    from ray_ppu.model.gpt import build_model
    from ray_ppu.model.optim import build_optimizer
    from ray_ppu.plan import build_plan
    from ray_ppu.train.loop import TrainState, _Window, train_step, wire_gradient_sync
    from ray_ppu.train.schedule import make_schedule
    from ray_ppu.util.wrappers import unwrap

    result = {}
    for side, experts in (("grouped", "true"), ("loop", "false")):
        overrides = [o for o in base if not o.startswith("parallel.overlap")]
        cfg = load(None, [*overrides, "model.preset=tiny-moe", "training.lr=1e-2",
                          f"training.moe_grouped_gemm={experts}", "training.global_batch_size=4",
                          "training.use_distributed_optimizer=true", "training.lr_warmup_iters=0",
                          "parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true",
                          # buckets of ~1 layer: each module's gather waits in its own pre-hook
                          "parallel.ddp_bucket_size=20000"])
        cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, train_iters=3))
        plan = build_plan(cfg)
        batch = {k: v for k, v in _microbatch(False, 1000).items()}
        with devices.bound("cpu", 0):
            parallel.initialize(plan, cfg.training.seed)
            try:
                model, _ = build_model(cfg, plan, "cpu")
                optimizer, scheduler = build_optimizer(cfg, plan, model)
                state = TrainState(plan, model, optimizer, scheduler, torch.device("cpu"))
                wire_gradient_sync(model, optimizer)
                schedule = make_schedule(plan, model, torch.device("cpu"))
                losses = []
                for _ in range(3):
                    window = _Window(start=0.0)
                    train_step(state, schedule, iter([batch] * plan.num_microbatches), window)
                    losses.append(window.loss_sum.tolist())
                for chunk in model:  # the gathers of the last step's updates
                    chunk.start_param_sync(force_sync=True)
                experts_now = {n: p.detach().clone() for n, p in
                               unwrap(model[0]).named_parameters() if ".experts." in n}
            finally:
                parallel.destroy()
        result[side] = {"losses": losses, "experts": experts_now}
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, result)
    if dist.get_rank() == 0:
        torch.save(everything, out / "expert_dp_training.pt")


if __name__ == "__main__":
    _run(json.loads(Path(sys.argv[1]).read_text()))


def test_the_device_check_is_prepared():
    """``benchmark.py device --part mfu``: every case's plan builds, at the most layers (up
    to its cap) whose memory plan stays within 80 % of an H200; the 7B slice is deep enough to
    measure (≥ 8 of its layers at seq 4096)."""
    from ray_ppu.tools.bench import mfu

    for name, (_, _, cap, _) in mfu.CASES.items():
        layers = mfu.layers_that_fit(name, "h200")
        memory = mfu.planned_memory(name, "h200", layers)
        assert memory.total_gib <= mfu.FILL * memory.device_memory_gib, name
        if layers < cap:
            deeper = mfu.planned_memory(name, "h200", layers + 1)
            assert deeper.total_gib > mfu.FILL * deeper.device_memory_gib, name
    assert mfu.layers_that_fit("dense", "h200") >= 8
