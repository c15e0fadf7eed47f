"""LoRA under Ray Train, end to end: packed SFT on a Hugging Face Qwen2 base, starting from a
PEFT adapter (q rank 2 and v rank 6, k left alone: stacked into one linear_qkv adapter).

One real run, ``tp2`` (also the suite's packed SFT run under Ray Train): TP 2 with sequence
parallelism, snapshots every 2 iterations, a
checkpoint at 4, interrupted twice: a worker SIGKILLed after iteration 5 (the group restores
the snapshot of 4 from memory and trains 5 again), then, once the restarted group has logged
iteration 6, every snapshot keeper and a worker (the next group reads the checkpoint at 4 from
disk and trains 5 and 6 again). Every iteration trained again must give the loss it gave the
first time, on the same samples: resume and restore are exact. (That TP 2 with SP computes what
TP 1 does is tests/test_lora.py's: every adapter's gradient at every layout.)

Then the checkpoint goes out as a PEFT adapter and as a merged model, and each loads in
peft / transformers with the logits ray_ppu's own generation gives from the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from test_sft_training import write_sft_files
from ray_ppu.config.loader import load

ITERS = 8
PROMPT = [9707, 11, 1879, 0, 3555, 374, 220, 16, 488, 220, 17]


def _base_and_adapter(root: Path, tokenizer_dir) -> tuple[Path, Path]:
    """A 2-layer Qwen2 with the real vocabulary (its tokenizer beside it), and a PEFT adapter
    on it with non-zero B (the run starts away from the base)."""
    from peft import LoraConfig, get_peft_model
    from test_hf import _hf_model

    base = root / "Qwen2-tiny"
    _hf_model("qwen_gqa", vocab_size=151_936, num_hidden_layers=2,
              max_position_embeddings=32768).save_pretrained(base)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(tokenizer_dir) / name, base / name)
    model = get_peft_model(_hf_model("qwen_gqa", vocab_size=151_936, num_hidden_layers=2,
                                     max_position_embeddings=32768),
                           LoraConfig(r=4, lora_alpha=8, rank_pattern={"q_proj": 2, "v_proj": 6},
                                      target_modules=["q_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"]))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02)
    model.save_pretrained(root / "adapter")
    return base, root / "adapter"


def _config(sft_files, base, adapter, out, *extra):
    from test_sft_training import sft_overrides

    from ray_ppu.launch.output import absolute_paths

    return absolute_paths(load(None, [
        *sft_overrides(sft_files, base, out, "data.packing=true", "cluster.num_workers=2",
                       f"training.train_iters={ITERS}", "checkpoint.save_interval=4",
                       "output.sample_log=true", "training.lr=5e-2", "training.eval_interval=4"),
        f"checkpoint.pretrained={base}", f"lora.adapter={adapter}", *extra]))


def _run(cfg, action=None):
    from test_checkpoint import _launch, launch_while

    from ray_ppu.launch.output import prepare_output
    from ray_ppu.plan import build_plan

    plan = build_plan(cfg)
    prepare_output(cfg, plan)
    final = (launch_while(cfg, plan, action) if action else _launch(cfg, plan))[0]
    rows = [json.loads(line) for line in open(Path(cfg.output.dir) / "metrics.jsonl")]
    return {"cfg": cfg, "plan": plan, "final": final, "rows": rows}


def _interrupt_twice(out: Path, killed: list):
    """Kill a worker of the run in ``out`` after iteration 5; once the restarted group has
    logged 6, the run's keepers and a worker."""
    from test_checkpoint import _kill_keepers, _kill_one_worker, _logged, _rows_after_restart

    metrics = out / "metrics.jsonl"

    def action(stop: threading.Event) -> None:
        while not stop.is_set() and not _logged(metrics, 5):
            time.sleep(0.01)
        if stop.is_set() or not _kill_one_worker(out, killed):
            return
        while not stop.is_set():
            if any(r["iteration"] >= 6 for r in _rows_after_restart(metrics, 1)):
                _kill_keepers(out)
                _kill_one_worker(out, killed)
                return
            time.sleep(0.01)

    return action


def run_lora(root: Path, qwen2_tokenizer_dir) -> dict:
    """The module's run, ``tp2`` (the module docstring), from files it makes under ``root``:
    the SFT records, the base and its adapter. Prelaunched (tests/prelaunch.py)."""
    files = write_sft_files(root / "sft")
    base, adapter = _base_and_adapter(root, qwen2_tokenizer_dir)
    out = root / "lora_tp2"
    out.mkdir()
    cfg = _config(files, base, adapter, out, "parallel.tensor_model_parallel_size=2",
                  "parallel.sequence_parallel=true", "checkpoint.memory_interval=2",
                  "cluster.max_failures=2")
    killed: list = []
    result = _run(cfg, _interrupt_twice(out, killed))
    assert len(killed) == 2, killed
    return {"tp2": result, "base": base, "adapter": adapter}


@pytest.fixture(scope="module")
def lora_run(prelaunched):
    return prelaunched.result("lora_run")


@pytest.fixture(scope="module")
def tp2(lora_run):
    return lora_run["tp2"]


@pytest.fixture(scope="module")
def base_and_adapter(lora_run):
    return lora_run["base"], lora_run["adapter"]


def _first_and_again(rows: list) -> tuple[dict, dict]:
    """{iteration: loss} as first logged, and as logged again after a restart."""
    first, again = {}, {}
    for r in rows:
        if "lm_loss" in r:
            (again if r["iteration"] in first else first)[r["iteration"]] = r["lm_loss"]
    return first, again


@pytest.mark.slow
def test_lora_resumes_exactly_from_memory_and_from_disk(tp2):
    from ray_ppu.monitor.metrics_log import read_sample_log

    rows = tp2["rows"]
    restarts = [(r["iteration"], r["resumed_from"]) for r in rows if r.get("event") == "restart"]
    assert [it for it, _ in restarts] == [4, 4], restarts
    assert restarts[0][1].startswith("memory:") and restarts[1][1] == "iter_0000004"
    first, again = _first_and_again(rows)
    assert sorted(first) == list(range(1, ITERS + 1)) and {5, 6} <= set(again), again
    for iteration, loss in again.items():
        assert loss == pytest.approx(first[iteration], abs=1e-6), iteration
    # the restarted groups read exactly the samples of the first (the log keeps the last)
    assert read_sample_log(tp2["cfg"].output.dir) == {i: list(range((i - 1) * 4, i * 4))
                                                       for i in range(1, ITERS + 1)}
    assert first[ITERS] < first[1] - 0.2  # and it learned (small adapters on a random base)


@pytest.mark.slow
def test_packed_sft_under_ray_learns_and_accounts_for_every_record(tp2):
    """The packed SFT path under Ray Train (the readers, the SFT rows, the schedule): the
    decay is train − warmup (SFT), training and validation losses fall, and every record read
    was used (none dropped: the end-of-run account)."""
    plan, rows, final = tp2["plan"], tp2["rows"], tp2["final"]
    assert plan.packed_sequences and plan.lr_decay_iters == ITERS - 2  # warmup 2
    valid = {r["iteration"]: r["valid_lm_loss"] for r in rows if "valid_lm_loss" in r}
    assert sorted(valid) == [4, 8] and valid[8] < valid[4], valid
    assert (final["iteration"], final["restarts"]) == (ITERS, 2)
    data = final["data"]["train"]
    assert data["records_read"] == 400 and data["samples_used"] + data["dropped_total"] == 400


@pytest.mark.slow
def test_lora_checkpoints_hold_the_adapters_and_name_their_base(tp2, base_and_adapter):
    from ray_ppu import checkpoint
    from ray_ppu.offline.mcore_to_hf import _reader, stored_tensors

    base, _ = base_and_adapter
    path, meta = checkpoint.latest(checkpoint.save_root(tp2["cfg"]))
    assert meta.iteration == ITERS and meta.lora["rank_pattern"]["linear_qkv"] == 8  # 2 + 6
    assert meta.base["path"] == str(base) and meta.base["kind"] == "hf"
    model_keys = {k for k in stored_tensors(_reader(path)) if k.startswith("decoder")}
    assert model_keys and all("_lora." in k for k in model_keys), model_keys
    plan = tp2["plan"]
    assert plan.num_trainable_parameters < 0.02 * plan.num_parameters


@pytest.mark.slow
def test_resuming_on_another_base_is_refused(tp2, tmp_path):
    from test_hf import _hf_model

    from ray_ppu.errors import UserError
    from ray_ppu.launch.local_checks import starting_point

    other = tmp_path / "other-base"
    torch.manual_seed(7)
    _hf_model("qwen_gqa", vocab_size=151_936, num_hidden_layers=2,
              max_position_embeddings=32768).save_pretrained(other)
    cfg = tp2["cfg"]
    moved = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint,
                                                                    pretrained=str(other)))
    with pytest.raises(UserError) as err:
        starting_point(moved, tp2["plan"])
    text = str(err.value)
    assert str(other) in text and cfg.checkpoint.pretrained in text and "fingerprint" in text


def _generate_logits(tmp_path: Path, *args) -> torch.Tensor:
    dump = tmp_path / "logits.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "entrypoints" / "generate.py"), *args, "--token-ids",
         ",".join(map(str, PROMPT)), "--max-new-tokens", "1", "--dump-logits", str(dump)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.tensor(json.loads(dump.read_text())["logits"])


@pytest.mark.slow
def test_peft_and_merged_exports_load_with_the_checkpoints_logits(tp2, base_and_adapter,
                                                                    tmp_path):
    """generate.py on the LoRA checkpoint itself is the reference; the PEFT export loaded by
    peft onto the base and the merged export loaded by transformers give its logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ray_ppu import checkpoint
    from ray_ppu.offline.lora_export import export_merged, export_peft

    base, _ = base_and_adapter
    path, _ = checkpoint.latest(checkpoint.save_root(tp2["cfg"]))
    ours = _generate_logits(tmp_path, "--checkpoint", str(path))
    summary = export_peft(path, tmp_path / "peft")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj",
                                        "q_proj", "up_proj", "v_proj"]
    # q (2) and v (6) stacked into rank 8, gate / up (4 each, two A's) into 8: r = 8
    assert config["r"] == 8 and config["rank_pattern"] == {"o_proj": 4, "down_proj": 4}
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
                                           tmp_path / "peft").eval()
    with torch.no_grad():
        theirs = peft_model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(theirs, ours, rtol=0, atol=2e-5)
    merged = export_merged(path, tmp_path / "merged")
    assert merged["format"] == "merged" and summary["tensors"] == 2 * 2 * 7
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(torch.tensor([PROMPT])).logits[0], ours, rtol=0,
                                   atol=2e-5)
