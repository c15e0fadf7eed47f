"""Know the data before the cluster does: ``--dry-run`` and the launch read a sample of every
SFT / VL file through the pipeline's own steps, before any Ray starts, and name every bad
record (file, line, reason); the launch lists them all in ``<dir>/bad_records/<split>.jsonl``.

The corpora hold every kind of bad record a real corpus holds: a missing, a truncated, a
zero-byte and a non-image image file, ``<image>`` tags and images that do not match (both
ways, and a tag in an answer), malformed JSON, missing keys, GBK bytes, and records with
images given to a text model. No Ray here: the point is that none is needed.
"""

from __future__ import annotations

import gzip
import json

import pytest

from conftest import REPO
from ray_ppu.config.loader import load
from ray_ppu.errors import ConfigError
from ray_ppu.launch import local_checks
from ray_ppu.launch.output import absolute_paths
from ray_ppu.plan import build_plan

DEMO_VL = REPO / "entrypoints" / "configs" / "demo-vl.yaml"


def _ask(image, question="<image>\nWhat colour is it?", answer="Red."):
    record = {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}
    return {"image": image, **record} if image is not None else record


@pytest.fixture(scope="module")
def vl_corpus(tmp_path_factory):
    """A VL JSONL whose bad records sit at known lines (1-based), good ones around them."""
    from PIL import Image

    root = tmp_path_factory.mktemp("vl")
    images = root / "images"
    images.mkdir()
    Image.new("RGB", (40, 30), (200, 20, 20)).save(images / "red.png")
    data = (images / "red.png").read_bytes()
    (images / "truncated.png").write_bytes(data[: len(data) // 2])
    (images / "empty.png").write_bytes(b"")
    (images / "text.jpg").write_text("not an image")
    lines = [json.dumps(_ask("red.png")).encode()] * 40
    bad = {
        3: ("missing_image", json.dumps(_ask("nowhere.png")).encode()),
        5: ("unreadable_image", json.dumps(_ask("truncated.png")).encode()),
        7: ("unreadable_image", json.dumps(_ask("empty.png")).encode()),
        9: ("unreadable_image", json.dumps(_ask("text.jpg")).encode()),
        11: ("image_tag_mismatch", json.dumps(_ask("red.png", "<image> <image> which?")).encode()),
        13: ("image_tag_mismatch", json.dumps(_ask("red.png", "What colour?")).encode()),
        15: ("image_tag_mismatch", json.dumps(_ask("red.png", "<image>", "<image> red")).encode()),
        17: ("malformed_json", b'{"image": "red.png", "conversations": ['),
        19: ("missing_fields", json.dumps({"image": "red.png", "conversations": [
            {"from": "human", "value": "<image>"}, {"from": "gpt"}]}).encode()),
        21: ("invalid_utf8", json.dumps(_ask("red.png"), ensure_ascii=False).replace(
            "Red.", "红色").encode("gbk")),
    }
    for line, (_, text) in bad.items():
        lines[line - 1] = text
    (root / "train.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return {"root": root, "images": images, "bad": bad}


def _vl_config(corpus, tokenizer_dir, out, *extra):
    return absolute_paths(load(DEMO_VL, [
        f"data.data_path=[{corpus['root'] / 'train.jsonl'}]", "data.valid_data_path=[]",
        "training.eval_iters=0", "training.train_iters=20", f"data.image_root={corpus['images']}",
        f"data.tokenizer={tokenizer_dir}", f"output.dir={out}", *extra]))


def test_the_dry_run_sample_names_every_bad_vl_record_with_its_line_and_reason(
        vl_corpus, qwen2_tokenizer_dir, tmp_path):
    cfg = _vl_config(vl_corpus, qwen2_tokenizer_dir, tmp_path / "out")
    checked = local_checks.check(cfg, build_plan(cfg))
    bad = vl_corpus["bad"]
    sample = [line for line in checked.lines if line.startswith("SFT train sample:")]
    assert sample and "40 records of 1 file(s)" in sample[0], checked.lines
    assert f"{40 - len(bad)} usable, {len(bad)} dropped" in sample[0], sample
    listed = "\n".join(checked.warnings)
    train = vl_corpus["root"] / "train.jsonl"
    for line, (reason, _) in bad.items():  # every bad record named, under its reason
        assert f"{train}: line {line}:" in listed, (line, listed)
        warning = next(w for w in checked.warnings if f"{train}: line {line}:" in w)
        assert f": {reason} × " in warning, (line, reason, warning)
    assert "unreadable_image × 3" in listed and "image_tag_mismatch × 3" in listed
    assert not (tmp_path / "out").exists(), "a check writes nothing"

    # fail mode: the first bad record in file order (line 3), not the first a stage found
    cfg = _vl_config(vl_corpus, qwen2_tokenizer_dir, tmp_path / "out", "data.on_bad_record=fail")
    with pytest.raises(ConfigError) as info:
        local_checks.check(cfg, build_plan(cfg))
    assert str(info.value).startswith(f"data.on_bad_record=fail: {train}: line 3: "), info.value
    assert "nowhere.png" in str(info.value)

    # a drop share over the bound: refused, the reasons listed with their first records
    cfg = _vl_config(vl_corpus, qwen2_tokenizer_dir, tmp_path / "out", "data.max_dropped_share=0.1")
    with pytest.raises(ConfigError) as info:
        local_checks.check(cfg, build_plan(cfg))
    message = str(info.value)
    assert message.startswith(f"SFT train sample: {len(bad)} of 40 records dropped (25 %, over "
                              f"data.max_dropped_share=0.1):"), message
    assert f"missing_image × 1: {train}: line 3:" in message


def test_a_wrong_image_root_and_vl_records_on_a_text_model_are_refused_before_ray(
        vl_corpus, qwen2_tokenizer_dir, tmp_path):
    """The two mistakes that used to pass the dry run and fail the launch after Ray Data ran:
    every record dropped is over the default bound."""
    train = vl_corpus["root"] / "train.jsonl"
    cfg = _vl_config(vl_corpus, qwen2_tokenizer_dir, tmp_path / "out",
                     f"data.image_root={tmp_path}")
    with pytest.raises(ConfigError) as info:
        local_checks.check(cfg, build_plan(cfg))
    assert "over data.max_dropped_share=0.5" in str(info.value)
    assert f"missing_image × 34: {train}: line 1: " in str(info.value), info.value

    cfg = _vl_config(vl_corpus, qwen2_tokenizer_dir, tmp_path / "out", "model.preset=tiny")
    with pytest.raises(ConfigError) as info:
        local_checks.check(cfg, build_plan(cfg))
    assert (f"bad_field_type × 37: {train}: line 1: 1 image(s), and the model has no vision "
            f"part (vision.encoder)") in str(info.value), info.value


def _alpaca(i):
    return json.dumps({"instruction": f"Count to {i % 9}.", "output": "1 2 3"})


def test_the_sample_reads_the_head_and_a_spread_with_the_files_own_line_numbers(
        qwen2_tokenizer_dir, tmp_path):
    """JSON Lines: the first n records, then n lines found by byte offset over the rest, each
    named by its real line number (blank lines counted); Parquet: by row; a compressed file:
    its head only, said in the report."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ray_ppu.data.sft import sample_check
    from ray_ppu.data.sft.rows import SFTOptions
    from ray_ppu.data.sft.windows import as_encoder

    # 20 good records, then bad ones holding their own line number, a blank line among them
    # (counted, not a record)
    lines = [_alpaca(n) if n <= 20 else "" if n == 501 else f'{{"bad": {n}'
             for n in range(1, 2002)]
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    encoder, options = as_encoder(str(qwen2_tokenizer_dir)), SFTOptions(64)
    report = sample_check.sample_split("train", [str(jsonl)], encoder, options, 20)
    assert report.stats["records_read"] == 40 and report.stats["samples_used"] == 20
    named = [message for _, message in report.stats["bad"]]
    assert len(named) == 20 and len(set(named)) == 20
    numbers = [int(m.split(": line ")[1].split(":")[0]) for m in named]
    assert numbers == sorted(numbers) and numbers[0] < 100 and numbers[-1] > 1900, numbers
    for number in numbers:  # the line named is the line that holds that bad record
        assert lines[number - 1] == f'{{"bad": {number}', (number, lines[number - 1])

    rows = [{"instruction": f"Q{i}", "output": "A" if i < 300 else ""} for i in range(1000)]
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=128)
    report = sample_check.sample_split("train", [str(parquet)], encoder, options, 10)
    empty = [m for reason, m in report.stats["bad"] if reason == "empty_response"]
    assert report.stats["records_read"] == 20 and len(empty) >= 6
    assert all(int(m.split(": row ")[1].split(":")[0]) >= 300 for m in empty)

    packed = tmp_path / "c.jsonl.gz"
    with gzip.open(packed, "wt") as f:
        f.write("\n".join(_alpaca(i) for i in range(100)) + "\n")
    report = sample_check.sample_split("train", [str(packed)], encoder, options, 10)
    assert report.stats["records_read"] == 10 and report.head_only == [str(packed)]
    assert "(1 compressed: first records only)" in report.line()


def test_fail_mode_names_the_first_bad_record_in_file_order(qwen2_tokenizer_dir, tmp_path):
    """A record only the image check can refuse (line 4) before a malformed line (18): the
    pipeline's error names line 4 (the reading stage used to raise at line 18 first)."""
    from ray_ppu.data.sft import sft_rows_from_files
    from ray_ppu.errors import PreprocessError

    lines = [_alpaca(i) for i in range(30)]
    lines[3] = json.dumps({"instruction": "Which?", "output": "That.", "image": "a.png"})
    lines[17] = '{"instruction": "oops",'
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PreprocessError) as info:
        sft_rows_from_files([path], qwen2_tokenizer_dir, 64, on_error="fail")
    assert str(info.value).startswith(f"{path}: line 4: 1 image(s), and the model has no vision")
    _, stats = sft_rows_from_files([path], qwen2_tokenizer_dir, 64)
    assert [m.split(": ")[1] for _, m in stats["bad"]] == ["line 4", "line 18"]


def test_inspect_data_shows_vl_rows_as_the_model_sees_them(vl_corpus, qwen2_tokenizer_dir,
                                                           tmp_path):
    """inspect_data.py on a packed VL config: the corpus's figures, each row's samples with
    the template rendered, trained text marked (exactly the loss mask's positions), each
    image's span with its size and positions, and the same as a page holding the images."""
    import subprocess
    import sys

    import numpy as np

    from ray_ppu.data.sft.view import inspect

    overrides = [f"data.data_path=[{vl_corpus['root'] / 'train.jsonl'}]",
                 "data.valid_data_path=[]", "training.eval_iters=0", "training.train_iters=20",
                 f"data.image_root={vl_corpus['images']}", f"data.tokenizer={qwen2_tokenizer_dir}",
                 f"output.dir={tmp_path / 'out'}", "data.packing=true", "training.seq_length=128"]
    page = tmp_path / "rows.html"
    proc = subprocess.run([sys.executable, str(REPO / "entrypoints" / "inspect_data.py"),
                           "--config", str(DEMO_VL), "--num-samples", "3", "--html", str(page),
                           *overrides], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "  records: 40\n  used: 30\n" in out, out[:800]
    assert '"unreadable_image": 3' in out and '"image_tag_mismatch": 3' in out
    assert "  images_per_sample: 1.0\n  image_tokens_per_sample: 16.0" in out
    assert "── row 0 (sample 0, iteration 0, microbatch 0 of DP rank 0): 128 positions, 2 samples packed" in out
    assert "── sample 1 of 2 (" in out and "<|im_start|>user\n⟨image 1: 40×30 px, 16 tokens⟩\nWhat colour is it?<|im_end|>" in out
    assert "<|im_start|>assistant\n⟦Red.<|im_end|>⟧" in out and "⟨pad × " in out
    html = page.read_text()
    assert html.count("<img ") == out.count("⟨image ") == 6
    assert html.count("<span class='trained'>Red.&lt;|im_end|&gt;</span>") == 6

    # the marks are the loss mask's: every trained position, and only those
    cfg = _vl_config(vl_corpus, qwen2_tokenizer_dir, tmp_path / "out", "data.packing=true",
                     "training.seq_length=128")
    found, source, views = inspect(cfg, build_plan(cfg), "train", np.arange(15), 0)
    assert source == "every record, read here" and found["rows"] == 15
    from ray_ppu.data.sft import sft_rows_from_files
    from ray_ppu.data import sft_store

    spec = sft_store.spec_for(cfg, build_plan(cfg))
    rows, _ = sft_rows_from_files([vl_corpus["root"] / "train.jsonl"], qwen2_tokenizer_dir, 128,
                                  packing=True, vision=spec.vision)
    for view, _ in views:
        assert view.trained == int(rows["loss_mask"][view.row].sum())
        assert sum(view.lengths) + view.pad == 128


def test_many_files_share_the_sample_budget(qwen2_tokenizer_dir, tmp_path):
    """Over 16 files, the budget of 16 files is shared out: every file is still read (head and
    rest), and the total stays that of 16 files."""
    from ray_ppu.data.sft import sample_check
    from ray_ppu.data.sft.rows import SFTOptions
    from ray_ppu.data.sft.windows import as_encoder

    files = []
    for k in range(40):
        path = tmp_path / f"part-{k:03d}.jsonl"
        lines = ['{"first": '] + [_alpaca(i) for i in range(29)]  # each file's line 1 is bad
        path.write_text("\n".join(lines) + "\n")
        files.append(str(path))
    report = sample_check.sample_split("train", files, as_encoder(str(qwen2_tokenizer_dir)),
                                       SFTOptions(64), 20)
    assert report.stats["records_read"] == 40 * 2 * (16 * 20 // 40)  # 8 + 8 of each file
    assert report.files == 40
    assert [message for _, message in report.stats["bad"]] == [
        f"{path}: line 1: invalid JSON: Expecting value: line 1 column 11 (char 10)" for path in files]


def test_a_file_that_cannot_be_read_is_named_before_ray(qwen2_tokenizer_dir, tmp_path):
    """A corrupt Parquet shard among good files: the checks' one problem names it (it was a
    pyarrow traceback)."""
    good = tmp_path / "a.jsonl"
    good.write_text(_alpaca(1) + "\n")
    (tmp_path / "b.parquet").write_bytes(b"not parquet at all")
    cfg = absolute_paths(load(None, [
        "data.dataset=sft", f"data.data_path=[{tmp_path}]", f"data.tokenizer={qwen2_tokenizer_dir}",
        "training.eval_iters=0", "training.train_iters=4", "training.lr_warmup_iters=1",
        f"output.dir={tmp_path / 'out'}", "cluster.device=cpu"]))
    with pytest.raises(ConfigError) as info:
        local_checks.check(cfg, build_plan(cfg))
    assert str(info.value).startswith(f"data.data_path: {tmp_path / 'b.parquet'}: cannot read "
                                      f"it: "), info.value
