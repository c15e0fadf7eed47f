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

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ray_ppu.util.net import free_port

TOKENS = [5, 17, 300, 999, 42, 7, 8, 9, 123, 456, 2, 0, 77]  # 12 inputs: SP splits them
RANK, ALPHA = 4, 8.0
# (model, adapter, TP, PP, layers per virtual stage, EP, ETP, SP, gradients)
RUNS = [
    ("qwen", "shared", 1, 1, None, 1, None, False, True),
    ("qwen", "shared", 2, 1, None, 1, None, False, True),
    ("qwen", "shared", 2, 1, None, 1, None, True, True),
    ("qwen", "shared", 1, 2, None, 1, None, False, True),
    ("qwen", "shared", 1, 2, 1, 1, None, False, True),
    ("qwen", "stacked", 1, 1, None, 1, None, False, False),
    ("qwen", "stacked", 2, 1, None, 1, None, True, False),
    ("moe", "experts", 1, 1, None, 1, None, False, True),
    ("moe", "experts", 1, 1, None, 2, 1, False, True),
    ("moe", "experts", 2, 1, None, 1, None, True, True),
]


def run_name(run) -> str:
    model, adapter, tp, pp, vs, ep, etp, sp, _ = run
    return f"{model}_{adapter}_tp{tp}_pp{pp}_vs{vs}_ep{ep}_etp{etp}_sp{int(sp)}"


def _peft_model(kind: str, base, adapter: str):
    """PEFT LoRA on ``base`` with random A and B. ``shared``: q / k / v share one A, gate / up
    another (as ray_ppu exports them); ``stacked``: q rank 2 and v rank 6 (k left alone), o and
    the MLP rank 4, alpha 6 on v (other scales); ``experts`` (Qwen3-MoE): attention and both
    expert parameters."""
    from peft import LoraConfig, get_peft_model

    if adapter == "stacked":
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
    for kind, adapters in (("qwen", ("shared", "stacked")), ("moe", ("experts",))):
        base_dir = root / kind
        hf_kind = "qwen_gqa" if kind == "qwen" else "qwen3_moe"
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
    jobs = {"out": str(out), "dirs": {k: str(v) for k, v in peft_dirs.items()}, "runs": RUNS}
    (out / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port("127.0.0.1")), __file__, str(out / "jobs.json")],
        capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.parametrize("run", RUNS, ids=run_name)
def test_logits_equal_peft_at_every_layout(run, launched, peft_dirs):
    ours = torch.load(launched / f"{run_name(run)}.pt")
    reference = torch.load(peft_dirs[run[1]] / "reference.pt")
    torch.testing.assert_close(ours["logits"], reference["logits"], rtol=0, atol=1e-5)
    assert ours["loss"] == pytest.approx(float(reference["loss"]), abs=1e-5)


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


@pytest.mark.parametrize("run", [r for r in RUNS if r[-1] and r[2:8] != (1, 1, None, 1, None,
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
    out, dirs = Path(jobs["out"]), jobs["dirs"]
    with parallel.process_group("cpu"):
        for run in jobs["runs"]:
            kind, adapter_name, tp, pp, vs, ep, etp, sp, grads = run
            source = inference.open_source(dirs[kind])
            adapter = read_adapter(dirs[adapter_name])
            lora = LoraConfig(**lora_section(adapter, source.model))
            cfg, plan = inference.inference_config(source.model, dist.get_world_size(), tp, pp,
                                                   vs, device="cpu", ep=ep, etp=etp, lora=lora,
                                                   sequence_parallel=sp)
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
                        result["loss"] = _loss_and_grads(chunks)
                        result["grads"] = _gather_adapter_grads(chunks)
                    else:
                        result["loss"] = float(torch.nn.functional.cross_entropy(
                            logits, torch.tensor(TOKENS[1:])))
                finally:
                    parallel.destroy()
            if dist.get_rank() == 0:
                torch.save(result, out / f"{run_name(run)}.pt")


if __name__ == "__main__":  # dist_checkpointing starts spawn-context helpers: guard needed
    _run_layouts(json.loads(Path(sys.argv[1]).read_text()))
