"""SFT through the model: packed rows give the same per-sample losses as padded ones (the mask
and position ids really isolate samples). A packed SFT run under Ray Train (TP 2, SP, killed
and restored from memory and from disk) is tests/test_lora_training.py's, with LoRA: one
launch for both."""

import json
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ray_ppu import devices
from ray_ppu.model import parallel
from ray_ppu.config.loader import load
from ray_ppu.plan import build_plan

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_records(n: int, seed: int = 0) -> list[dict]:
    """Alpaca records a tiny model can learn in a few steps, of varied lengths, Chinese too."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice(list(OPS))
        question = f"What is {a} {op} {b}?" if i % 2 else f"计算 {a} {op} {b} 等于多少？"
        records.append({"instruction": question, "input": " ".join(["please"] * rng.randint(0, 6)),
                        "output": f"{a} {op} {b} = {OPS[op](a, b)}"})
    return records


def write_sft_files(root: Path) -> Path:
    """The SFT records: 400 arithmetic questions to train on, 64 to validate, in ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for name, n, seed in (("train.jsonl", 400, 0), ("valid.jsonl", 64, 1)):
        with open(root / name, "w", encoding="utf-8") as f:
            for record in arithmetic_records(n, seed):
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return root


@pytest.fixture(scope="module")
def sft_files(tmp_path_factory):
    return write_sft_files(tmp_path_factory.mktemp("sft"))


def sft_overrides(files, tokenizer_dir, out, *extra):
    return [
        "data.dataset=sft", f"data.data_path=[{files / 'train.jsonl'}]",
        f"data.valid_data_path=[{files / 'valid.jsonl'}]", f"data.tokenizer={tokenizer_dir}",
        f"output.dir={out}", "output.tensorboard=false", "cluster.device=cpu",
        "training.precision=fp32", "training.seq_length=128", "training.micro_batch_size=2",
        "training.global_batch_size=4", "training.train_iters=12", "training.lr=1e-2",
        "training.min_lr=1e-3", "training.lr_warmup_iters=2", "training.eval_interval=6",
        "training.eval_iters=1", "model.make_vocab_size_divisible_by=64", *extra,
    ]


def _packed_and_padded_losses(backend, sft_files, tokenizer_dir, out, preset="tiny",
                              attention="auto"):
    """One real Megatron GPTModel (world of 1): the summed token losses of 24 samples packed
    several per row, padded one per row, and packed but unmasked, microbatches of 2 rows."""
    from ray_ppu.data.sft import sft_rows
    from ray_ppu.model.gpt import build_model, packed_format
    from ray_ppu.train.batch import forward_step

    records = arithmetic_records(24, seed=3)
    cfg = load(None, sft_overrides(sft_files, tokenizer_dir, out, "data.packing=true",
                                   "cluster.num_workers=1", "training.eval_iters=0",
                                   f"cluster.device={backend}", f"model.preset={preset}",
                                   f"training.attention_backend={attention}"))
    plan = build_plan(cfg)
    packed, packed_summary = sft_rows(records, tokenizer_dir, 128, packing=True)
    padded, _ = sft_rows(records, tokenizer_dir, 128, max_padding_length=128)
    assert len(packed["tokens"]) < len(padded["tokens"]) == 24  # several samples per row
    assert packed_summary["packing_efficiency"] > 0.5

    dist.init_process_group(devices.dist_backend(backend), store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        with devices.bound(backend, 0):
            parallel.initialize(plan, cfg.training.seed)
            try:
                model, _ = build_model(cfg, plan, backend)
                model[0].eval()
                how = packed_format(cfg, plan, backend)

                def summed_loss(rows, packed_rows):
                    total = 0.0
                    with torch.no_grad():
                        for i in range(0, len(rows["tokens"]), 2):  # micro batch 2
                            rows_i = {k: v[i:i + 2] for k, v in rows.items()}
                            output, loss = forward_step(iter([rows_i]), model[0],
                                                        devices.torch_device(backend),
                                                        packed=how if packed_rows else None)
                            total += loss(output)[0].item()
                    return total

                losses = (summed_loss(packed, True), summed_loss(padded, False),
                          summed_loss({k: v for k, v in packed.items() if k != "cu_seqlens"},
                                      False))
            finally:
                parallel.destroy()
    finally:
        dist.destroy_process_group()
    return how, losses


# tiny-moe too: its routers send each token to experts by that token alone (no capacity
# limit drops any), so only attention could mix samples
# (tiny-moe with the local mask: test_kernels holds its packed losses to the THD path's)
@pytest.mark.parametrize("preset, attention, how", [
    ("tiny", "local", "mask"), ("tiny", "sdpa", "thd"), ("tiny-moe", "sdpa", "thd")])
def test_packed_rows_give_the_padded_losses(sft_files, qwen2_tokenizer_dir, tmp_path, preset,
                                            attention, how):
    """CPU: Megatron-Core's local attention with the block-diagonal mask, and torch's SDPA
    once per sample of the flattened THD microbatch (no mask), each isolate the samples of a
    packed row; without the boundaries the samples see each other."""
    used, (as_packed, as_padded, unmasked) = _packed_and_padded_losses(
        "cpu", sft_files, qwen2_tokenizer_dir, tmp_path, preset, attention)
    assert used == how
    assert as_packed == pytest.approx(as_padded, rel=1e-5)
    # A freshly initialised model attends almost uniformly, so leaking across samples moves
    # the loss only a little, but far beyond the packed-vs-padded float noise.
    assert abs(unmasked - as_padded) > 10 * abs(as_packed - as_padded) + 1e-3


def _transformer_engine_device() -> bool:
    from ray_ppu.model.gpt import transformer_engine_available

    return torch.cuda.is_available() and transformer_engine_available("ppu")


@pytest.mark.gpu
@pytest.mark.skipif(not _transformer_engine_device(),
                    reason="needs a CUDA/PPU device with Transformer Engine")
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_thd_packed_rows_give_the_padded_losses_with_transformer_engine(
        sft_files, qwen2_tokenizer_dir, tmp_path, preset):
    """PPU/GPU, Transformer Engine spec: the same through THD PackedSeqParams (two rows per
    microbatch flattened into one sequence of 256 tokens); tiny-moe's experts in TE's
    grouped GEMM."""
    how, (as_packed, as_padded, unmasked) = _packed_and_padded_losses(
        "ppu", sft_files, qwen2_tokenizer_dir, tmp_path, preset)
    assert how == "thd"
    assert as_packed == pytest.approx(as_padded, rel=1e-4)
    assert abs(unmasked - as_padded) > 10 * abs(as_packed - as_padded) + 1e-3


def test_thd_boundaries_are_the_block_mask_of_the_flattened_rows():
    """The THD parameters of a microbatch of 2 packed rows (flattened to 1 × 16 tokens) give
    exactly the block-diagonal causal mask each row has on its own, and nothing across rows."""
    from ray_ppu.train.batch import packed_attention_mask, thd_packed_seq_params

    s = 8
    # row 0: samples of 3 and 4 tokens + a 1-token padding tail; row 1: one 8-token sample
    cu = torch.tensor([[0, 3, 7, 8, 8], [0, 8, 8, 8, 8]])
    params = thd_packed_seq_params(cu, s)
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 3, 7, 8, 16] == params.cu_seqlens_kv.tolist()
    assert params.cu_seqlens_q.dtype == torch.int32
    assert params.max_seqlen_q == params.max_seqlen_kv == 8
    flat = packed_attention_mask(params.cu_seqlens_q[None].long(), 2 * s)[0, 0]
    rows = packed_attention_mask(cu, s)[:, 0]
    expected = torch.ones(2 * s, 2 * s, dtype=torch.bool)
    expected[:s, :s], expected[s:, s:] = rows[0], rows[1]
    assert torch.equal(flat, expected)
