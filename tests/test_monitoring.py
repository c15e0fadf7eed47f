"""Monitoring: per-iteration throughput, TFLOP/s and MFU as Megatron counts them, the rows in
Ray's metrics pipeline (scraped from the node's Prometheus endpoint during a real run),
TensorBoard, the Grafana dashboard, and the progress line."""

import json
import math
import re

import pytest
import torch
import torch.distributed as dist

from ray_ppu.config.loader import load
from ray_ppu.devices.specs import SPECS, peak_tflops, run_peak_tflops
from ray_ppu.monitor.metrics_log import MetricsWriter, progress_line
from ray_ppu.plan import build_plan
from ray_ppu.monitor.ray_gauges import GAUGES

from conftest import REPO

PPU_PEAK = 123.0  # the vendor's bf16 figure the reference's MFU table divides by


def test_peak_table_and_override():
    assert peak_tflops("ppu-810e") == PPU_PEAK
    assert (peak_tflops("h100"), peak_tflops("h200"), peak_tflops("a100")) == (989.0, 989.0, 312.0)
    assert peak_tflops("ppu-810e", 100.0) == 100.0  # cluster.peak_tflops
    assert set(SPECS) == {"ppu-810e", "h100", "h200", "a100"}


def test_training_rows_carry_throughput_flops_and_mfu(uninterrupted):
    plan = build_plan(uninterrupted["cfg"])
    rows = [r for r in uninterrupted["rows"] if "lm_loss" in r]
    for r in rows:
        step = r["step_time_s"]
        tokens = plan.global_batch_size * plan.seq_length
        assert r["tokens_per_s"] == pytest.approx(tokens / step)
        assert r["tokens_per_s_per_device"] == pytest.approx(tokens / step / plan.world_size)
        assert r["tflops_per_device"] == pytest.approx(plan.flops_per_iteration / step / plan.world_size / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / PPU_PEAK)
        assert r["restarts"] == 0 and r["data_wait_s"] >= 0 and r["eta_s"] >= 0
    final = uninterrupted["final"]  # the job's result carries the last row's figures
    assert final["mfu"] == pytest.approx(rows[-1]["mfu"]) and final["lm_loss"] == rows[-1]["lm_loss"]


def _samples(lines: list[str]) -> dict[tuple[str, str], float]:
    """{(metric, rank): value} from Prometheus text lines."""
    out = {}
    for line in lines:
        name, labels, value = re.match(r"(\w+)\{(.*)\} (\S+)$", line).groups()
        rank = re.search(r'rank="(\d+)"', labels).group(1)
        out[(name, rank)] = float(value)
    return out


def test_run_metrics_reach_the_nodes_metrics_endpoint(uninterrupted):
    """Scraped from the node's metrics endpoint (what Prometheus and the dashboard's Metrics
    view read) while the run trained: every rank's gauges, tagged with the run's name."""
    samples = _samples(uninterrupted["ray_metrics"])
    assert samples, "no ray_ppu_* metric of the run on the node's metrics endpoint"
    for rank in ("0", "1"):
        for key in ("lm_loss", "tflops_per_device", "mfu", "step_time_s", "iteration"):
            assert ("ray_" + GAUGES[key][0], rank) in samples, (key, rank)
    # the values are the run's own: an exported loss is a logged loss, at a logged iteration
    train = {r["iteration"]: r for r in uninterrupted["rows"] if "lm_loss" in r}
    iteration = samples[("ray_ppu_iteration", "0")]
    assert iteration in train
    assert samples[("ray_ppu_lm_loss", "0")] == pytest.approx(train[iteration]["lm_loss"], rel=1e-6)


def test_grafana_dashboard_charts_every_exported_metric():
    dash = json.loads((REPO / "cluster" / "grafana" / "ray_ppu.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    charted = {name for e in exprs for name in re.findall(r"ray_ppu_\w+", e)}
    assert charted == {"ray_" + name for name, _ in GAUGES.values()}
    assert all('run=~"$run"' in e for e in exprs)  # the run picker applies to every panel
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "run"}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_grafana_dashboard_is_the_generators_output():
    """The committed board is what ray_ppu/monitor/grafana.py builds from GAUGES; after changing a
    gauge or a panel: python -m ray_ppu.monitor.grafana > cluster/grafana/ray_ppu.json"""
    from ray_ppu.monitor.grafana import dashboard_json

    committed = (REPO / "cluster" / "grafana" / "ray_ppu.json").read_text()
    assert committed == dashboard_json(), \
        "stale board: python -m ray_ppu.monitor.grafana > cluster/grafana/ray_ppu.json"


def test_tensorboard_gets_the_same_scalars_validation_included(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path, tensorboard=True)
    for i in (1, 2):
        writer.write({"iteration": i, "train_iters": 2, "lm_loss": 5.0 - i, "lr": 1e-4,
                      "grad_norm": 1.0, "tokens_per_s": 1000.0, "step_time_s": 0.5, "eta_s": 0.5,
                      "tflops_per_device": 50.0, "mfu": 50 / 123})
    writer.write({"iteration": 2, "valid_lm_loss": 3.5, "valid_ppl": math.exp(3.5),
                  "valid_samples": 8})
    writer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/lm_loss", "train/mfu", "train/tflops_per_device", "valid/lm_loss",
            "valid/ppl"} <= tags
    assert [e.value for e in events.Scalars("train/lm_loss")] == [4.0, 3.0]
    assert events.Scalars("valid/lm_loss")[0].step == 2


def test_mfu_is_na_where_the_device_peak_is_unknown():
    from ray_ppu.config.schema import ClusterConfig

    cpu = ClusterConfig(device="cpu")
    assert run_peak_tflops(cpu, "cpu") is None  # a PPU's peak would make a CPU read 0.0 %
    assert run_peak_tflops(ClusterConfig(device="cpu", peak_tflops=2.0), "cpu") == 2.0
    assert run_peak_tflops(ClusterConfig(), "ppu") == PPU_PEAK  # device auto, got a PPU
    row = {"iteration": 1, "train_iters": 2, "lm_loss": 2.5, "lr": 3e-4, "grad_norm": 1.0,
           "tokens_per_s": 10.0, "step_time_s": 0.25, "tflops_per_device": 0.01, "mfu": None,
           "eta_s": 1.0}
    assert "| MFU n/a |" in progress_line(row)


def test_progress_line_shows_iteration_loss_lr_throughput_flops_mfu_eta():
    line = progress_line({"iteration": 7, "train_iters": 100, "lm_loss": 2.5, "lr": 3e-4,
                          "grad_norm": 1.25, "tokens_per_s": 123456.0, "step_time_s": 0.25,
                          "tflops_per_device": 61.5, "mfu": 0.5, "eta_s": 3725.0})
    for part in ("iter      7/100", "loss 2.5000", "lr 3.000e-04", "123,456 tok/s",
                 "61.5 TFLOP/s/device", "MFU 50.0%", "ETA 1:02:05"):
        assert part in line, (part, line)


def test_packed_rows_count_the_real_sample_lengths():
    """Attention FLOPs of packed rows: Σ length² of the samples, not seq_length² per row; a
    vision-language model's ViT FLOPs: the images the rows held, not one per sample."""
    from ray_ppu.train.loop import _flops_per_iteration, _Window, _window_counts
    from ray_ppu.train.batch import TimedIterator

    cfg = load(None, ["data.dataset=sft", "data.data_path=[x]", "data.tokenizer=x",
                      "data.packing=true", "training.eval_iters=0", "training.train_iters=2",
                      "cluster.num_workers=1", "training.global_batch_size=2",
                      "training.micro_batch_size=1", "training.seq_length=16",
                      "model.preset=tiny-vl"])
    plan = build_plan(cfg)
    rows = [{"cu_seqlens": [[0, 4, 16, 16]], "num_images": [2]},  # one iteration: 3 images
            {"cu_seqlens": [[0, 8, 12, 16]], "num_images": [1]}]
    timed = TimedIterator(iter(rows))
    list(timed)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        counts = _window_counts(plan, timed, _Window(start=0.0, iterations=1), torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    flops = _flops_per_iteration(plan, *counts)
    squares = 4 ** 2 + 12 ** 2 + 8 ** 2 + 4 ** 2 + 4 ** 2
    dense = plan.flops_per_iteration - plan.attention_flops_coefficient * 2 * 16 ** 2
    assert counts == (squares, 3)
    assert plan.flops_per_image > 0  # the plan counted 2 images: one per sample
    assert flops == pytest.approx(dense + plan.attention_flops_coefficient * squares
                                  + plan.flops_per_image)
    m = cfg.model
    assert plan.attention_flops_coefficient == 6 * m.num_layers * m.effective_kv_channels * m.num_attention_heads


def test_sample_log_counts_the_group_that_trained_an_iteration_last(tmp_path):
    """An elastic group of DP 2 logs part of iteration 5 and is lost; the DP 1 group that
    replaces it trains iteration 5 again: only the DP 1 group's ids count (the DP-rank-1 line
    of the lost group has no successor and is stale). A restart at the same size replaces
    every line."""
    from ray_ppu.monitor.metrics_log import SampleLog, read_sample_log

    lost = [SampleLog(tmp_path, rank, dp_rank=rank, dp_size=2) for rank in (0, 1)]
    lost[0].write(4, [12, 14])
    lost[1].write(4, [13, 15])
    lost[1].write(5, [17, 19])  # rank 0 never got to log iteration 5
    for log in lost:
        log.close()
    after = SampleLog(tmp_path, 0, dp_rank=0, dp_size=1)
    after.write(5, [16, 17, 18, 19])
    after.write(6, [20, 21, 22, 23])
    after.close()
    again = SampleLog(tmp_path, 0, dp_rank=0, dp_size=1)  # a restart at the same size
    again.write(6, [20, 21, 22, 23])
    again.close()
    assert read_sample_log(tmp_path) == {4: [12, 13, 14, 15], 5: [16, 17, 18, 19],
                                         6: [20, 21, 22, 23]}
