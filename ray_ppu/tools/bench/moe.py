"""``benchmark.py moe``: a MoE model trained at EP 1 and at EP > 1, side by side, with the time its
token dispatcher takes.

CPU (``main``): the ``tiny-moe`` preset (Qwen3-MoE shrunk: 4 experts, top-2) on 2 gloo ranks,
fp32, at EP 1 (DP 2: every rank holds all 4 experts) and at EP 2 (DP 2, 2 experts per rank:
tokens cross ranks by all-to-all). ``device`` (called by ``benchmark.py device``): a bigger
MoE (hidden 1024, 8 experts, top-2, bf16, Transformer Engine's grouped GEMM where it is
installed) on every visible GPU / PPU at EP 1 and EP = the devices (the largest divisor of the
experts), with MFU.

Both runs train in one torchrun launch of :mod:`ray_ppu.tools.bench.moe_rank`, whose
:class:`~ray_ppu.tools.bench.dispatch_clock.DispatcherClock` times the dispatchers' permutation,
all-to-all and unpermutation, forward and backward. Per run: the median step time and tokens/s
over the iterations after :data:`WARMUP_ITERS`, the dispatcher's seconds per step (the mean
over ranks, median over iterations) and its share of the step; then EP>1 / EP 1 ratios, and
the two runs' losses compared (the same weights and data: they should agree to float
rounding; a check that is printed, never an abort). ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Optional

from ray_ppu.tools.bench.common import (add_corpus_argument, default_corpus, launch_ranks,
                                        write_json)

HELP = "MoE at EP 1 vs EP 2: step time, tokens/s, token-dispatcher time and share, losses"
WARMUP_ITERS = 2  # the first iterations build caches (and on a GPU, kernels): not timed
LOSS_TOLERANCE = 1e-5  # relative; EP only regroups the experts' fp32 sums (seen: ~1e-7)

CPU_BASE = ["cluster.device=cpu", "cluster.num_workers=2", "training.precision=fp32",
            "model.preset=tiny-moe", "model.make_vocab_size_divisible_by=64",
            "training.global_batch_size=8", "training.micro_batch_size=2",
            "training.seq_length=64", "training.lr=2e-2", "training.min_lr=3e-4"]
# the device model: 8 layers of hidden 1024, 8 experts of 2048, top-2: 0.58 B weights (0.16 B
# of them the 151936-word embedding), 0.28 B active per token; seq 2048 as the option matrix's
DEVICE_EXPERTS = 8
DEVICE_MODEL = ["model.preset=tiny-moe", "model.num_layers=8", "model.hidden_size=1024",
                "model.ffn_hidden_size=2048", "model.num_attention_heads=16",
                "model.num_query_groups=4", f"model.num_moe_experts={DEVICE_EXPERTS}",
                "model.moe_router_topk=2",
                "model.moe_ffn_hidden_size=2048", "training.precision=bf16",
                "training.micro_batch_size=2", "training.seq_length=2048", "training.lr=1e-4",
                "training.min_lr=1e-5"]
COMMON = ["training.lr_warmup_iters=1", "training.eval_iters=0", "data.split=100,0,0",
          "output.tensorboard=false", "checkpoint.enabled=false"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iters", type=int, default=10,
                        help=f"timed iterations per run (after {WARMUP_ITERS} warm-up ones)")
    parser.add_argument("--json", default=None, help="write the figures here")
    add_corpus_argument(parser)
    parser.add_argument("--timeout", type=float, default=600, help="seconds for both runs")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value",
                        help="applied to both runs (default: tiny-moe, seq 64, global batch 8)")


def main(args) -> dict:
    base = [*CPU_BASE, *COMMON, *args.overrides]
    runs = {"ep1": [], "ep2": ["parallel.expert_model_parallel_size=2"]}
    _check(runs, base, args.iters)  # before a corpus is built or a rank started
    with tempfile.TemporaryDirectory(prefix="ray_ppu_moe_") as tmp:
        corpus = _corpus(args.corpus, Path(tmp))
        result = _launch(runs, base, corpus, args.iters, Path(tmp), 2, args.timeout)
    figures = summarize(result, args.iters)
    figures["setting"] = _setting("tiny-moe", "CPU", result, args.iters)
    print_figures(figures)
    if args.json:
        write_json(args.json, figures)
    return figures


def device(corpus: str, iters: int, out: Path, timeout: float) -> dict:
    """The device part: EP 1 and EP = the devices on every visible GPU / PPU, with MFU."""
    import torch

    from ray_ppu.devices.specs import SPECS, accelerator_of

    require_cuda("benchmark.py device's MoE part")
    nproc = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    accelerator = accelerator_of(name)
    # EP holds whole experts and divides the ranks (DP is a multiple of it)
    ep = max(d for d in range(1, nproc + 1) if DEVICE_EXPERTS % d == 0 and nproc % d == 0)
    runs = {"ep1": []}
    if ep > 1:
        runs[f"ep{ep}"] = [f"parallel.expert_model_parallel_size={ep}"]
    base = [*DEVICE_MODEL, *COMMON, "cluster.device=ppu", f"cluster.num_workers={nproc}",
            f"cluster.accelerator={accelerator}", f"training.global_batch_size={8 * nproc}"]
    _check(runs, base, iters)
    result = _launch(runs, base, corpus, iters, out, nproc, timeout)
    figures = summarize(result, iters, SPECS[accelerator].bf16_tflops)
    experts = ("Transformer Engine's grouped GEMM" if next(iter(result.values()))["transformer_engine"]
               else "local experts, no Transformer Engine")
    figures["setting"] = _setting(f"MoE of hidden 1024, 8 layers, 8 experts of 2048, top-2, bf16, "
                                  f"{experts}", f"{nproc} × {name}", result, iters)
    print_figures(figures)
    if ep == 1:
        print("EP > 1: not run (one device: expert parallelism needs two or more)")
    return figures


def require_cuda(command: str) -> None:
    """Stop, saying so, where torch sees no CUDA(-compatible) device (before any corpus or run)."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"{command} needs a CUDA(-compatible) device; this machine has none "
                         f"(the CPU measurements: benchmark.py options, benchmark.py moe)")


def _check(runs: dict, base: list[str], iters: int) -> None:
    """``--iters`` and every run's config (a plan of its own: a bad override stops here, naming
    the run). The corpus is checked next: a plan does not read it, so a placeholder stands in."""
    from ray_ppu.config.loader import load
    from ray_ppu.errors import ConfigError
    from ray_ppu.plan import build_plan

    if iters < 1:
        raise SystemExit(f"--iters {iters}: at least 1 timed iteration is needed")
    for name, extra in runs.items():
        try:
            build_plan(load(None, [*base, "data.data_path=[corpus]",
                                   f"training.train_iters={WARMUP_ITERS + iters}", *extra]))
        except ConfigError as err:
            raise SystemExit(f"moe run {name}: {err}") from None


def _corpus(corpus: Optional[str], tmp: Path) -> str:
    """``--corpus`` (its .bin and .idx must be there), else a small stdlib one built in ``tmp``."""
    if corpus is None:
        return default_corpus(tmp)
    for suffix in (".bin", ".idx"):
        if not Path(corpus + suffix).is_file():
            raise SystemExit(f"--corpus {corpus}: {corpus}{suffix} is not a file "
                             f"(an idxmap prefix names PREFIX.bin and PREFIX.idx)")
    return corpus


def _launch(runs: dict, base: list[str], corpus: str, iters: int, out: Path, nproc: int,
            timeout: float) -> dict:
    """The runs (checked by :func:`_check`) trained by ``nproc`` ranks of :mod:`moe_rank` in one
    launch, under ``out``; its ``--result``."""
    common = [*base, f"data.data_path=[{corpus}]", f"training.train_iters={WARMUP_ITERS + iters}",
              f"data.index_cache_dir={out / 'index_cache'}"]
    runs = {name: [*extra, f"output.dir={out / name}"] for name, extra in runs.items()}
    out.mkdir(parents=True, exist_ok=True)
    spec, result = out / "runs.json", out / "figures.json"
    result.unlink(missing_ok=True)  # an earlier launch's figures are not this one's
    spec.write_text(json.dumps(runs))
    launch_ranks("ray_ppu.tools.bench.moe_rank",
                 ["--runs", str(spec), "--result", str(result), *common], nproc, timeout,
                 "moe benchmark")
    return json.loads(result.read_text())


def summarize(result: dict, iters: int, peak_tflops: Optional[float] = None) -> dict:
    """Per run its figures; the ratios of the last run (the largest EP) to the first (EP 1);
    whether their losses agree. ``peak_tflops``: the device's bf16 peak, for MFU (None: CPU)."""
    runs = {name: _run_figures(r, peak_tflops) for name, r in result.items()}
    figures = {"runs": runs, "iters": iters, "warmup_iters": WARMUP_ITERS}
    if len(runs) > 1:
        (first, one), (last, other) = list(runs.items())[0], list(runs.items())[-1]
        figures["ratios"] = {"of": f"{last}/{first}", **{
            key: other[key] / one[key] for key in ("step_time_s", "tokens_per_s", "dispatcher_s")
            if one[key]}}
        pairs = list(zip(one["losses"], other["losses"]))
        figures["losses_max_rel_diff"] = max(abs(a - b) / abs(a) for a, b in pairs)
        figures["losses_agree"] = (len(one["losses"]) == len(other["losses"])
                                   and figures["losses_max_rel_diff"] <= LOSS_TOLERANCE)
    return figures


def _run_figures(r: dict, peak_tflops: Optional[float]) -> dict:
    """One run's medians over its timed iterations (the rows after the warm-up)."""
    timed = r["rows"][WARMUP_ITERS:]
    step = statistics.median(row["step_time_s"] for row in timed)
    ranks = r["dispatcher_s"]  # per rank: forward and backward seconds per iteration

    def per_step(*parts: str, of: Optional[list] = None) -> float:
        """Mean over the ranks (``of``: these), median over the timed iterations."""
        of = of or ranks
        totals = [sum(rank[p][i] for rank in of for p in parts) / len(of)
                  for i in range(WARMUP_ITERS, len(of[0]["forward"]))]
        return statistics.median(totals)

    dispatcher = per_step("forward", "backward")
    figures = {"expert_model_parallel_size": r["expert_model_parallel_size"],
               "data_parallel_size": r["data_parallel_size"], "world_size": r["world_size"],
               "step_time_s": step, "tokens_per_s": r["tokens_per_iteration"] / step,
               "dispatcher_s": dispatcher, "dispatcher_forward_s": per_step("forward"),
               "dispatcher_backward_s": per_step("backward"), "dispatcher_share": dispatcher / step,
               # an all-to-all waits for the slowest rank: a spread here is skew, not transfer
               "dispatcher_s_per_rank": [per_step("forward", "backward", of=[rank])
                                         for rank in ranks],
               "moe_layers": r["layers"], "losses": [row["lm_loss"] for row in r["rows"]]}
    if peak_tflops:  # Megatron-LM's FLOPs per iteration over the step, per device, of the peak
        figures["mfu"] = r["flops_per_iteration"] / step / r["world_size"] / (peak_tflops * 1e12)
    return figures


def _setting(model: str, where: str, result: dict, iters: int) -> str:
    ranks = next(iter(result.values()))["world_size"]
    return (f"{model}: {ranks} ranks on {where}; {iters} timed iterations per run after "
            f"{WARMUP_ITERS} warm-up")


def print_figures(f: dict) -> None:
    runs = f["runs"]
    names = list(runs)
    head = [f"EP {r['expert_model_parallel_size']} (DP {r['data_parallel_size']})"
            for r in runs.values()]
    ratio = f.get("ratios", {})
    print(f"\n{f['setting']}")
    print(f"{'':30s}" + "".join(f"{h:>16s}" for h in head)
          + (f"{ratio['of'].upper():>12s}" if ratio else ""))
    rows = [("median step time", "step_time_s", lambda v: f"{v * 1000:.1f} ms"),
            ("tokens/s", "tokens_per_s", lambda v: f"{v:,.0f}"),
            ("token dispatcher per step", "dispatcher_s", lambda v: f"{v * 1000:.2f} ms"),
            ("  forward", "dispatcher_forward_s", lambda v: f"{v * 1000:.2f} ms"),
            ("  backward", "dispatcher_backward_s", lambda v: f"{v * 1000:.2f} ms"),
            ("  share of the step", "dispatcher_share", lambda v: f"{v:.1%}")]
    if "mfu" in runs[names[0]]:
        rows.append(("MFU", "mfu", lambda v: f"{v:.1%}"))
    for label, key, show in rows:
        line = f"{label:30s}" + "".join(f"{show(runs[n][key]):>16s}" for n in names)
        if key in ratio:
            line += f"{ratio[key]:>12.3f}"
        print(line)
    if "losses_agree" in f:
        verdict = "yes" if f["losses_agree"] else "NO"
        print(f"losses agree (check, max relative difference ≤ {LOSS_TOLERANCE:g}): {verdict}, "
              f"max |{names[-1]} - {names[0]}| / {names[0]} = {f['losses_max_rel_diff']:.1e} "
              f"over {len(runs[names[0]]['losses'])} iterations")
