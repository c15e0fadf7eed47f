"""Hugging Face tokenizers and idxmap preprocessing with Ray Data.

The HF tokenizer exported from the dashscope ranks must give tiktoken's ids exactly; the Ray
Data pipeline must write, for every input format, what Megatron's IndexedDataset reads back as
the tokenizer's ids + EOD per document, in input order, byte-identical to ``write_idxmap``.
"""

import gzip
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from conftest import REPO
from ray_ppu.data.preprocess import (
    PreprocessError,
    _tokenized_dataset,
    preprocess_with_ray,
    write_idxmap,
)
from ray_ppu.data.readers import resolve_inputs
from ray_ppu.data.tokenizer import QWEN2_EOD, export_qwen2_tokenizer, load_tokenizer, qwen2
from ray_ppu.tools.demo import build_demo_corpus, build_stdlib_corpus, stdlib_sources

# Non-ASCII the standard library lacks: CJK, emoji (ZWJ sequences, skin tones, flags, keycaps),
# other scripts, and the whitespace / contraction corners where two regex engines could differ.
MULTILINGUAL = [
    "今天天气很好，我们去公园散步吧。机器学习模型需要大量的训练数据。",
    "大语言模型（LLM）的预训练：数据清洗、分词、打包成固定长度的序列。",
    "混合文本 mixed text 中英文 English 123 数字４５６ 和标点！？；：",
    "表情符号 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇨🇳🇺🇸 1️⃣ ❤️ 🤖🚀",
    "日本語のテキスト、カタカナとひらがな。한국어 텍스트입니다. Русский текст, ελληνικά.",
    "العربية ١٢٣ עברית हिन्दी ไทย 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ﬁ ligature e\u0301 combining",
    "I'LL BE THERE, we'Re DONE, it's 'quoted' and don't\t\ttabs\u00a0nbsp\u3000ideographic space",
    "lines\r\nwith CRLF\rCR\x0bVT\x0cFF\u2028LS\u2029PS\u0085NEL   trailing   ",
    "    leading spaces\n\n\n   \n\tmixed blank lines\n",
    "<|endoftext|> and <|im_start|>user<|im_end|> written in the text are text, not specials",
]


@pytest.fixture(scope="module")
def hf(qwen2_tokenizer_dir):
    return load_tokenizer(qwen2_tokenizer_dir)


def test_exported_tokenizer_gives_tiktokens_ids(hf):
    files = list(stdlib_sources(250_000))
    lines = [line for text in files for line in text.splitlines(keepends=True)]
    assert len(lines) > 3000
    texts = lines + files[:30] + MULTILINGUAL + ["\n".join(MULTILINGUAL)]
    ours, reference = hf.encode_batch(texts), qwen2().encode_batch(texts)
    mismatched = [t for t, a, b in zip(texts, ours, reference) if a != b]
    assert not mismatched, mismatched[:3]
    for text in texts:
        assert hf.decode(hf.encode(text)) == text
    # Special tokens spelled out in a document stay text for both backends: no fake EOD.
    assert QWEN2_EOD not in hf.encode(MULTILINGUAL[-1])
    assert hf.eod == QWEN2_EOD and hf.vocab_size == 151_657  # 151643 BPE + 3 ChatML + 11 markup
    assert hf.decode([151_644, 151_645, QWEN2_EOD]) == "<|im_start|><|im_end|><|endoftext|>"


def test_tokenizers_pickle_small_and_work_after(hf):
    for tok in (hf, qwen2()):
        data = pickle.dumps(tok)
        assert len(data) < 1000, (tok.name, len(data))  # a recipe, not the 151k-token vocabulary
        copy = pickle.loads(data)
        assert (copy.eod, copy.vocab_size) == (tok.eod, tok.vocab_size)
        assert copy.encode(MULTILINGUAL[3]) == tok.encode(MULTILINGUAL[3])


def test_export_is_complete_and_idempotent(qwen2_tokenizer_dir):
    tokenizer_json = json.loads((qwen2_tokenizer_dir / "tokenizer.json").read_text())
    merges = tokenizer_json["model"]["merges"]
    assert len(merges) == 151_643 - 256  # every multi-byte token has its merge
    assert (qwen2_tokenizer_dir / "merges.txt").read_text().count("\n") == len(merges) + 1  # + the header
    assert len(json.loads((qwen2_tokenizer_dir / "vocab.json").read_text())) == 151_643
    config = json.loads((qwen2_tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["eos_token"] == config["pad_token"] == "<|endoftext|>"

    stamp = (qwen2_tokenizer_dir / "tokenizer.json").stat().st_mtime_ns
    started = time.perf_counter()
    assert export_qwen2_tokenizer(qwen2_tokenizer_dir) == qwen2_tokenizer_dir
    assert time.perf_counter() - started < 0.5
    assert (qwen2_tokenizer_dir / "tokenizer.json").stat().st_mtime_ns == stamp

    jinja2 = pytest.importorskip("jinja2")
    template = jinja2.Environment().from_string(config["chat_template"])
    chat = [{"role": "user", "content": "你好"}, {"role": "assistant", "content": "Hi!"}]
    assert template.render(messages=chat, add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>\n")
    own_system = [{"role": "system", "content": "Be brief."}, chat[0]]
    assert template.render(messages=own_system, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n")


def test_load_tokenizer_eod_and_errors(qwen2_tokenizer_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "absent"))):
        load_tokenizer(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "empty")) + r".*tokenizer\.json"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "broken" / "tokenizer.json"))):
        load_tokenizer(tmp_path / "broken")

    # EOD follows tokenizer_config.json's eos_token (Qwen2.5-Instruct: <|im_end|>), in either
    # of the forms HF writes; without one it is <|endoftext|>.
    instruct = tmp_path / "instruct"
    instruct.mkdir()
    shutil.copy(qwen2_tokenizer_dir / "tokenizer.json", instruct)
    assert load_tokenizer(instruct).eod == QWEN2_EOD
    for eos in ("<|im_end|>", {"content": "<|im_end|>", "special": True}):
        (instruct / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
        assert load_tokenizer(instruct).eod == 151_645
    (instruct / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    with pytest.raises(ValueError, match=re.escape("'<|eot_id|>' is not in")):
        load_tokenizer(instruct)


def _docs(n: int) -> list[str]:
    """n real documents: standard-library source excerpts, some with CJK and emoji mixed in."""
    files = [t for t in stdlib_sources(1_000_000) if t.strip()]
    return [files[i][:1500] + (MULTILINGUAL[i % len(MULTILINGUAL)] if i % 2 else "") for i in range(n)]


def _write_jsonl(path, records, opener=open):
    with opener(path, "wt", encoding="utf-8") as out:
        for r in records:
            out.write(r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) + "\n")


def _assert_idxmap_holds(prefix, texts, tok) -> int:
    """Megatron reads back each text's ids + EOD, one document each, in order; returns the token count."""
    ds = IndexedDataset(str(prefix))
    assert ds.index.dtype == np.int32  # Megatron's optimal dtype for a 151k vocabulary
    assert len(ds) == len(texts)
    assert ds.document_indices.tolist() == list(range(len(texts) + 1))  # one sequence per document
    expected = tok.encode_batch(texts)
    for i, ids in enumerate(expected):
        assert ds[i].tolist() == ids + [tok.eod], f"document {i}"
    return sum(len(ids) + 1 for ids in expected)


def test_ray_preprocessing_reads_every_format_in_order(ray_cluster, hf, tmp_path):
    d = _docs(13)
    # A long first document: its shard finishes last, so only preserve_order keeps it first.
    d[0] = "\n".join(stdlib_sources(400_000))
    raw = tmp_path / "raw"
    raw.mkdir()
    _write_jsonl(raw / "part-000.jsonl", [
        {"text": d[0], "id": 0}, {"text": ""}, {"id": 3}, {"text": d[1]}, "\n",
        {"text": 42}, {"text": d[2]}, {"text": "   \n"}, {"text": d[3]}, {"text": d[4]}])
    _write_jsonl(raw / "part-001.jsonl.gz", [{"text": t} for t in d[5:8]], opener=gzip.open)
    _write_jsonl(raw / "_SUCCESS", [{"text": "bookkeeping, not data"}])
    _write_jsonl(raw / ".part-002.jsonl", [{"text": "a hidden (half-written) file, not data"}])
    (tmp_path / "b.json").write_text(json.dumps(
        [{"text": d[8]}, {"text": None}, {"text": d[9]}, {"text": ["not", "a", "string"]}, {"text": d[10]}]))
    (tmp_path / "parquet").mkdir()
    pq.write_table(pa.table({"text": [d[11], None, "", d[12]], "n": [1, 2, 3, 4]}),
                   tmp_path / "parquet" / "c.parquet")

    inputs = [str(raw), str(tmp_path / "b.json"), str(tmp_path / "parquet" / "*.parquet")]
    assert [os.path.basename(f) for f in resolve_inputs(inputs)] == [
        "part-000.jsonl", "part-001.jsonl.gz", "b.json", "c.parquet"]
    stats = preprocess_with_ray(inputs, tmp_path / "out" / "corpus", hf, workers=2)

    assert stats.tokens == _assert_idxmap_holds(tmp_path / "out" / "corpus", d, hf)
    assert stats.skipped == {"empty": 3, "missing": 3, "not_string": 2}
    assert (stats.files, stats.documents) == (4, 13)
    # The same bytes as the single-process writer (which the test corpora and the demo use).
    write_idxmap(d, hf, tmp_path / "ref" / "corpus")
    for suffix in (".bin", ".idx"):
        assert (tmp_path / "out" / f"corpus{suffix}").read_bytes() == \
               (tmp_path / "ref" / f"corpus{suffix}").read_bytes(), suffix
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["corpus.bin", "corpus.idx"]


def test_read_is_fused_into_the_tokenizer_actors(ray_cluster, hf, tmp_path, capsys):
    """With one actor per CPU, an unfused read would wait forever for a CPU: the plan must fuse."""
    for n in (1, 3):
        files = []
        for i in range(n):
            files.append(str(tmp_path / f"{n}-{i}.jsonl"))
            _write_jsonl(files[-1], [{"text": "x"}])
        _tokenized_dataset(files, "text", hf, workers=n).explain()
        physical = capsys.readouterr().out.split("Physical Plan (Optimized)")[1]
        assert "ActorPoolMapOperator[Read_TextRecords->MapBatches(_TokenizeBatch)]" in physical, physical


def test_strict_mode_and_corrupt_files_fail_naming_the_file(ray_cluster, hf, tmp_path):
    shard = tmp_path / "shard.jsonl"
    _write_jsonl(shard, [{"content": "fine"}, {"content": {"nested": 1}}])
    prefix = tmp_path / "out" / "corpus"
    with pytest.raises(PreprocessError, match=re.escape(f"{shard}: line 2: field 'content' is not a string")):
        preprocess_with_ray([shard], prefix, hf, json_key="content", strict=True, workers=1)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())  # nothing half-written

    # a wrong --json-key skips every record: an error, not a 0-byte corpus and exit 0
    with pytest.raises(PreprocessError, match=re.escape(
            f"no usable document in the input (missing: 2); first: {shard}: line 1: has no "
            f"'text' field; is --json-key 'text' the field that holds the text?")):
        preprocess_with_ray([shard], prefix, hf, workers=1)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())

    corrupt = tmp_path / "corrupt.jsonl"
    _write_jsonl(corrupt, [{"text": "fine"}, "{truncated\n"])
    with pytest.raises(PreprocessError, match="^" + re.escape(f"{corrupt}: line 2: invalid JSON")):
        preprocess_with_ray([corrupt], prefix, hf, workers=1)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())

    for bad in ([tmp_path / "absent.jsonl"], [str(tmp_path / "*.parquet")], [tmp_path / "hf.txt"]):
        (tmp_path / "hf.txt").write_text("not a data file")
        with pytest.raises(PreprocessError, match=re.escape(str(bad[0]))):
            resolve_inputs(bad)


def test_demo_corpus_equals_the_stdlib_corpus(ray_cluster, qwen2_tokenizer_dir, tmp_path):
    shutil.copytree(qwen2_tokenizer_dir, tmp_path / "demo" / "tokenizer")  # spares the export (tested above)
    prefix = build_demo_corpus(tmp_path / "demo", max_bytes=300_000, workers=2)
    assert prefix == str(tmp_path / "demo" / "stdlib_text_document")
    assert len(list((tmp_path / "demo" / "raw").glob("*.jsonl"))) == 4
    build_stdlib_corpus(tmp_path / "ref" / "stdlib", qwen2(), max_bytes=300_000)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / "demo" / f"stdlib_text_document{suffix}").read_bytes() == \
               (tmp_path / "ref" / f"stdlib{suffix}").read_bytes(), suffix
    stamp = os.stat(prefix + ".bin").st_mtime_ns
    assert build_demo_corpus(tmp_path / "demo", max_bytes=300_000) == prefix
    assert os.stat(prefix + ".bin").st_mtime_ns == stamp  # built once


def test_entrypoint(hf, qwen2_tokenizer_dir, tmp_path):
    d = _docs(6)
    _write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in d[:3]] + [{"other": 1}])
    _write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in d[3:]])
    script = str(REPO / "entrypoints" / "preprocess_data.py")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray of its own
    base = [sys.executable, script, "--output-prefix", str(tmp_path / "out" / "corpus")]
    runs = {
        "ok": base + ["--input", str(tmp_path / "*.jsonl"), "--tokenizer", str(qwen2_tokenizer_dir)],
        "no_input": base + ["--input", str(tmp_path / "missing" / "x.jsonl"), "--tokenizer", str(qwen2_tokenizer_dir)],
        "no_tokenizer": base + ["--input", str(tmp_path / "a.jsonl"), "--tokenizer", str(tmp_path)],
    }
    # The three start together: most of their time is importing torch, Megatron and Ray.
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for name, cmd in runs.items()}
    out = {name: (p.communicate(timeout=180), p.returncode) for name, p in procs.items()}

    (stdout, stderr), rc = out["ok"]
    assert rc == 0, stderr[-3000:]
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["documents"] == 6 and summary["skipped"]["missing"] == 1, summary
    assert summary["tokens"] > 0 and summary["tokens_per_s"] > 0 and summary["seconds"] > 0
    assert "Started a local Ray instance" in stderr  # what the failures below must not show
    _assert_idxmap_holds(tmp_path / "out" / "corpus", d, hf)

    for name, path in (("no_input", tmp_path / "missing" / "x.jsonl"), ("no_tokenizer", tmp_path)):
        (stdout, stderr), rc = out[name]
        assert rc == 2, (name, stderr[-2000:])
        assert stderr.splitlines()[-1].startswith("error: ") and str(path) in stderr.splitlines()[-1], \
            (name, stderr[-2000:])
        assert "Started a local Ray instance" not in stderr, name  # rejected before Ray starts
