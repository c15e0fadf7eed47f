"""The data entry points a user checks a run with: inspect_data.py, and pretrain.py's corpus
checks (a bad corpus fails before Ray or any worker starts, naming the file)."""

import json
import shutil
import subprocess
import sys
import time

import numpy as np
import yaml

from ray_ppu.data import idxmap

from conftest import REPO


def write_config(tmp_path, corpus, **data):
    cfg = {
        "training": {"micro_batch_size": 2, "global_batch_size": 8, "seq_length": 32,
                     "train_iters": 4, "eval_iters": 0},
        "data": {"data_path": [corpus], "index_cache_dir": str(tmp_path / "cache"), **data},
        "output": {"dir": str(tmp_path / "out")},
        "cluster": {"num_workers": 2, "device": "cpu"},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(script, *args, timeout=120):
    return subprocess.run([sys.executable, str(REPO / "entrypoints" / script), *args],
                          capture_output=True, text=True, timeout=timeout)


def test_inspect_data_prints_what_a_dp_rank_trains_on(corpus, qwen2_tokenizer_dir, tmp_path):
    config = write_config(tmp_path, corpus)
    proc = run("inspect_data.py", "--config", str(config), "--dp-size", "2", "--dp-rank", "1",
               "--num-samples", "6", "--tokenizer", str(qwen2_tokenizer_dir))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    # Megatron-LM's sampler: steps of mbs 2 × DP 2 = 4 ids, rank 1 keeps the second pair;
    # 4 samples per rank per iteration (2 microbatches), so samples 5-6 are iteration 1's.
    assert [r["sample_id"] for r in rows] == [2, 3, 6, 7, 10, 11]
    assert [(r["iteration"], r["microbatch"]) for r in rows] == [(0, 0), (0, 0), (0, 1), (0, 1),
                                                                 (1, 0), (1, 0)]
    spec = idxmap.SampleSpec(prefixes=(corpus,), weights=None, split="99,1,0", seq_length=32,
                             seed=1234, train_samples=32, index_cache_dir=str(tmp_path / "cache"),
                             eod_token_id=151643, vocab_size=151936)
    ds = idxmap.dataset(spec)
    from ray_ppu.data.tokenizer import qwen2

    for r in rows:
        assert r["tokens"] == ds[r["sample_id"]]["tokens"].tolist()
        assert r["text"] == qwen2().decode(r["tokens"])  # the corpus's own tokenizer agrees


def test_inspect_data_rejects_a_rank_outside_dp(corpus, tmp_path):
    proc = run("inspect_data.py", "--config", str(write_config(tmp_path, corpus)),
               "--dp-size", "2", "--dp-rank", "2")
    assert proc.returncode == 2 and "--dp-rank 2 of --dp-size 2" in proc.stderr


def test_pretrain_rejects_a_truncated_corpus_before_starting_ray(corpus, tmp_path):
    broken = tmp_path / "broken"
    shutil.copy(corpus + ".idx", str(broken) + ".idx")
    data = open(corpus + ".bin", "rb").read()
    (tmp_path / "broken.bin").write_bytes(data[: len(data) // 2])
    start = time.monotonic()
    proc = run("pretrain.py", "--config", str(write_config(tmp_path, str(broken))))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{broken}.bin" in proc.stderr and str(len(data) // 2) in proc.stderr
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout
    assert time.monotonic() - start < 60


def test_pretrain_rejects_token_ids_beyond_the_vocabulary(corpus, tmp_path):
    proc = run("pretrain.py", "--config", str(write_config(tmp_path, corpus)),
               "model.vocab_size=1000")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{corpus}.bin" in proc.stderr and "1000" in proc.stderr
    ids = np.fromfile(corpus + ".bin", dtype=np.int32)
    assert str(int(ids[ids >= 1000][0])) in proc.stderr  # the first offending id is named
