"""User errors end as one ``error: <message>`` line and exit status 2, never as a traceback.

Two paths that used to print pages of traceback: a malformed JSON line in SFT data with
``data.on_bad_record: fail`` (raised inside a Ray Data actor, it reached the driver as a
``RayTaskError`` whose text is the whole remote traceback), and an impossible TP / PP layout
given to ``generate.py`` or ``convert_checkpoint.py hf-to-mcore`` under torchrun (every rank
raised it after joining the process group; now every rank finds it before importing
Megatron-Core). Real Ray, real torchrun, a real tiny checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from ray_ppu.util.net import free_port
from ray_ppu.errors import ConfigError

GOOD = [{"instruction": f"Count to {i}.", "output": " ".join(str(n) for n in range(1, i + 2))}
        for i in range(7)]


def test_malformed_sft_line_with_on_bad_record_fail_is_one_line(ray_cluster, qwen2_tokenizer_dir,
                                                                 tmp_path):
    """The launcher's own preparation call: a ConfigError naming file and line, nothing else,
    and no half-written split left in the cache."""
    from ray_ppu.data import sft_store
    from ray_ppu.launch.launcher import _as_config_error

    shard = tmp_path / "train.jsonl"
    lines = [json.dumps(r) for r in GOOD] + ['{"instruction": "oops",'] + [json.dumps(GOOD[0])]
    shard.write_text("\n".join(lines) + "\n")
    cache = tmp_path / "cache"
    spec = sft_store.SFTSpec(train_paths=(str(shard),), valid_paths=(),
                             tokenizer_dir=str(qwen2_tokenizer_dir), seq_length=64,
                             max_padding_length=64, packing=False, on_error="fail",
                             cache_dir=str(cache), train_samples=4)
    with pytest.raises(ConfigError) as info:
        _as_config_error(sft_store.prepare, spec)
    message = str(info.value)
    assert message.startswith(f"{shard}: line 8: invalid JSON"), message[:2000]
    assert "\n" not in message and "Traceback" not in message and "ray::" not in message, \
        message[:2000]
    assert not (list(cache.iterdir()) if cache.exists() else []), "temporary split left behind"


# --- torchrun: an impossible layout --------------------------------------------------------------


@pytest.fixture(scope="module")
def one_kv_head_model(tmp_path_factory):
    """A tiny Qwen2 with 4 attention heads and one KV head (num_query_groups 1), saved offline."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=176,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                         tie_word_embeddings=True, max_position_embeddings=512)
    path = tmp_path_factory.mktemp("hf") / "qwen_one_kv_head"
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def _torchrun(script: str, *args: str) -> subprocess.Popen:
    """Started, not waited for: the two entry points' runs overlap (suite time)."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port("127.0.0.1")), str(REPO / "entrypoints" / script), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})


def _finished(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = proc.communicate(timeout=180)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _assert_one_error_line(proc: subprocess.CompletedProcess, problem: str) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output[-3000:]
    # the message (the plan lists its problems under its first line) follows that one line
    assert problem in proc.stderr.split(errors[0], 1)[1] or problem in errors[0], output[-3000:]
    # No traceback from a rank: the only one is torchrun's own (it raises ChildFailedError to
    # report failed children), whose report gives each rank's exit status.
    assert output.count("Traceback (most recent call last)") == output.count(
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"), output[-3000:]
    assert not re.search(r'File "[^"]*(entrypoints|ray_ppu)/', output), output[-3000:]
    assert "ConfigError" not in output, output[-3000:]
    # LOCAL_RANK 0 printed and failed first; the other rank exited 2 when torchrun stopped it
    # (or -15: stopped before it got as far as the check)
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", output, re.S)
    assert root and root.groups() == ("0", "2"), output[-3000:]
    assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", output)) <= {"2", "-15"}, output[-3000:]


def test_generate_convert_and_train_under_torchrun_with_impossible_layouts_are_one_error_line(
        one_kv_head_model, tmp_path):
    out = tmp_path / "mcore"
    generate = _torchrun("generate.py", "--checkpoint", str(one_kv_head_model),
                         "--token-ids", "5,17,300", "--max-new-tokens", "1", "--tp", "2")
    convert = _torchrun("convert_checkpoint.py", "hf-to-mcore", "--hf", str(one_kv_head_model),
                        "--out", str(out), "--tp", "2")
    # the torchrun training path: a plan for another world than torchrun started
    train = _torchrun("torchrun_pretrain.py", "cluster.device=cpu", "cluster.num_workers=4",
                      f"data.data_path=[{tmp_path / 'corpus'}]", "training.train_iters=1",
                      f"output.dir={tmp_path / 'run'}")
    _assert_one_error_line(_finished(generate), "num_query_groups 1 is not divisible by TP 2")
    _assert_one_error_line(_finished(convert), "num_query_groups 1 is not divisible by TP 2")
    _assert_one_error_line(_finished(train), "torchrun started 2 processes, the plan is for 4 "
                                             "(cluster.num_workers=4)")
    assert not out.exists()


_CHECK_BEFORE_MEGATRON = """
import json, sys
hf, out = sys.argv[1:]
sys.path.insert(0, {entrypoints!r})
import convert_checkpoint, generate
codes = [generate.main(["--checkpoint", hf, "--token-ids", "5,17,300", "--tp", "2"]),
         convert_checkpoint.main(["hf-to-mcore", "--hf", hf, "--out", out, "--tp", "2"])]
print(json.dumps({{"codes": codes,
                  "megatron": sorted(m for m in sys.modules if m.split(".")[0] == "megatron")}}))
"""


def test_impossible_tp_is_found_before_megatron_core_is_imported(one_kv_head_model, tmp_path):
    """Both entry points check the layout before importing Megatron-Core (8 s a process here),
    so a user's impossible --tp is an error in about a second: one process that runs both with
    torchrun's WORLD_SIZE and then lists the megatron modules it holds."""
    out = tmp_path / "mcore"
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK_BEFORE_MEGATRON.format(entrypoints=str(REPO / "entrypoints")),
         str(one_kv_head_model), str(out)],
        capture_output=True, text=True, timeout=180,
        env={**os.environ, "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"codes": [2, 2], "megatron": []}, \
        proc.stdout[-3000:]
    assert proc.stderr.count("num_query_groups 1 is not divisible by TP 2") == 2, \
        proc.stderr[-3000:]
    assert not out.exists()
