"""Supervised fine-tuning samples from raw JSON shards.

What PAI-Megatron-Patch's ``run_mcore_qwen.sh`` (the 25-argument launch script that
``entrypoints/from_pai_script.py`` migrates) does with ``MP_DATASET_TYPE=raw`` and ``SFT=true``:
train on JSON conversations, not on a pre-tokenized idxmap corpus.

Pipeline, one arrow per step::

    files / dirs / globs  ->  records (JSON Lines, JSON array or Parquet; alpaca or chat form)
      -> conversations [{role, content}, ...]      (validated; problems counted by reason)
      -> chat template (Jinja, from tokenizer_config.json) + tokenizer -> ids + assistant mask
      -> samples (tokens = t[:-1], labels = t[1:], loss_mask)     (too long prompt: dropped)
      -> rows: one padded sample per row, or several samples packed per row

Records
    ``{"instruction", "input"?, "output", "system"?}`` (alpaca) becomes system? → user
    (instruction and input joined by a newline, either may be empty) → assistant (output).
    ``{"messages": [{"role", "content"}, ...]}`` (chat) is used as is; roles are system, user,
    assistant, several turns allowed, at least one assistant turn, no empty assistant turn.
    A record with a ``messages`` key is read as chat, else as alpaca.

Problems are never lost silently: each record is either used or dropped for one reason of
:data:`DROP_REASONS`, and the first message of each reason (``file: line N: ...``) is kept in
the summary. ``on_error="fail"`` raises :class:`PreprocessError` on the first record problem
instead; ``prompt_too_long`` is a length policy, not a data error, and never fails. No input
file at all (or only empty files) is always an error naming the paths.

Tokenization (:class:`ChatEncoder`)
    The conversation is rendered with the tokenizer's own chat template (jinja2, the way Hugging
    Face renders it: trim_blocks, lstrip_blocks, ``raise_exception``; no ``transformers``). To
    know which characters came from message contents, the template is first rendered with each
    content replaced by a private-use placeholder; the rendering with the real contents must be
    that string with the placeholders substituted by the contents, as they are or stripped
    (LLaMA-3's templates ``| trim`` them); any other rewrite drops the record as
    ``template_mismatch``.
    Scaffolding (template text) is split at the tokenizer's added tokens, which become their
    ids (``<|im_start|>`` → 151644); contents are always encoded as ordinary text, so a user
    who writes ``<|im_end|>`` gets the characters, never the special id.
    Assistant turns are located by rendering prefixes: turn *k* spans from the end of
    ``render(messages[:k], add_generation_prompt=True)`` to the end of
    ``render(messages[:k+1])``; both must be prefixes of the full rendering. Inside that span
    the loss covers everything up to and including the first added token after the content —
    the end-of-turn token (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for LLaMA-3) — and not the
    scaffolding after it (ChatML's ``\\n``). Tokens after the last assistant token carry no
    loss and are cut off.
    Ordinary text (template text between special tokens, and contents) is tokenized turn by
    turn: cut at every special token and at every assistant turn's start and end. That
    concatenation must equal the tokenization of the whole rendering (cut at special tokens
    only). When it does not (BPE merged across a turn boundary, e.g. an answer starting with a
    newline right after ChatML's ``assistant\\n``) the record is dropped as
    ``template_mismatch`` (fatal with ``on_error="fail"``): the prompt the model would be
    trained on would differ from the one it gets at inference.

Sample layout (Megatron GPT contract, :data:`ray_ppu.data.idxmap.SAMPLE_KEYS`)
    For token ids t[0..n]: ``tokens = t[:-1]``, ``labels = t[1:]``, ``loss_mask[i] = 1`` iff
    ``labels[i]`` is an assistant token. Row length L is ``max_padding_length`` (padding) or
    ``seq_length`` (packing). A sample whose prompt (the tokens before the first assistant
    token) is ≥ L tokens is dropped (``prompt_too_long``); a longer one is cut to L + 1 ids and
    counted as ``truncated`` (loss on the kept part).

Rows (int32 ids and positions, float32 loss mask, as :func:`ray_ppu.data.idxmap.read`)
    * padding: one sample per row, padded to L with the pad id (``pad_token`` of
      tokenizer_config.json, else EOD); labels are the pad id and loss mask 0 there;
      ``position_ids`` 0..L-1.
    * packing: samples, in input order, greedily packed into rows of exactly ``seq_length``
      tokens (a new row starts when the next sample does not fit or the row already has
      ``max_samples_per_row`` samples); the rest of the row is padding. Position ids restart
      at 0 at each sample (and at the padding tail). Extra columns: ``cu_seqlens`` int32
      ``[max_samples_per_row + 2]`` (sequence boundaries, the padding tail being the last
      sequence, so ``cu_seqlens[num_seqs] == seq_length``; entries after ``num_seqs`` repeat the
      last value), ``num_seqs`` int32 and ``max_seqlen`` int32 (the longest sequence of the row).

Packing windows: determinism vs. streaming
    Greedy packing is sequential. Rather than one global packer (a single stage through which
    every sample must pass, with no end-of-stream hook in ``map_batches`` to flush its last
    row), each input file is cut into windows of ``window`` consecutive records (default 1024,
    bad records included) and every window is packed on its own, in order. A window is one
    row of the Ray dataset, so Ray Data can neither split it nor reorder it: rows depend only
    on the files, the tokenizer and the options — not on Ray's block sizes or the number of
    workers — and windows are processed in parallel while the dataset streams. The cost: each
    window ends with its own partly filled row (≈ one row per window of loss against a
    global greedy packing; with 1024 records of ~500 tokens in 4096-token rows, < 1 %), and a
    file with fewer records than ``window`` is a window of its own: shard corpora into files of
    many records. :func:`sft_rows` and :func:`sft_rows_from_files` (in-process) use the same
    windows, so they give the Ray path's rows exactly.

Modules, one step each: :mod:`~ray_ppu.data.sft.records` (records → conversations),
:mod:`~ray_ppu.data.sft.chat_encoder` (chat template + tokenizer), :mod:`~ray_ppu.data.sft.rows`
(samples, padding, packing), :mod:`~ray_ppu.data.sft.files` (files → entries → windows),
:mod:`~ray_ppu.data.sft.windows` (one window → rows and statistics; the in-process pipeline)
and :mod:`~ray_ppu.data.sft.ray_source` (the Ray Data pipeline). This package exports the names
the rest of ray_ppu and the tests use.
"""

import importlib

# Imported on first use (PEP 562): a reader process imports ray_ppu.data.sft.image_samples to
# decode a row's images, and must not pay for Ray Data, pyarrow and pandas (~90 MB of PSS, ~1 s)
# that only the pipeline's driver and tasks need.
_EXPORTS = {"ChatEncoder": "chat_encoder", "sft_dataset": "ray_source",
            "DROP_REASONS": "records", "conversation_from_record": "records",
            "SFTOptions": "rows", "make_sample": "rows",
            "sft_rows": "windows", "sft_rows_from_files": "windows"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
