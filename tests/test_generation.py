"""generate.py's choices without a model: the prompt as the chat template renders it (or raw),
sampling (greedy, temperature, top-k, top-p, seeded), prompts from a JSONL file, and the
errors a user meets before any process group. Continuations against transformers:
tests/test_vl_training.py, test_vl_run.py, test_hf.py, test_qwen_vl_export.py."""

from __future__ import annotations

import json

import pytest
import torch

from ray_ppu.errors import ConfigError
from ray_ppu.offline import generation
from ray_ppu.offline.generation import Prompt, Sampling


def test_a_prompt_is_the_user_turn_of_the_chat_template_unless_raw(tiny_llava_dir):
    from ray_ppu.data.tokenizer import load_tokenizer
    from transformers import AutoTokenizer

    chat = generation.setup(str(tiny_llava_dir), device="cpu")
    raw = generation.setup(str(tiny_llava_dir), raw=True, device="cpu")
    assert chat.chat and not raw.chat
    theirs = AutoTokenizer.from_pretrained(tiny_llava_dir).apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True,
        tokenize=True)
    theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
    encoded = chat.encode(Prompt("Name a colour."))
    assert encoded.ids == list(theirs)
    assert 151_645 in encoded.stops  # <|im_end|> ends the answer
    assert raw.encode(Prompt("Name a colour.")).ids == \
        load_tokenizer(tiny_llava_dir).encode("Name a colour.")
    assert raw.encode(Prompt(token_ids=[1, 2, 3])).ids == [1, 2, 3]


def test_sampling_is_greedy_at_zero_seeded_and_filtered():
    torch.manual_seed(0)
    logits = torch.randn(1000)
    top = torch.topk(logits, 3).indices.tolist()
    assert Sampling().pick(logits, torch.Generator()) == top[0]
    assert Sampling(temperature=5.0, top_k=1).pick(logits, torch.Generator()) == top[0]
    assert Sampling(temperature=5.0, top_p=1e-6).pick(logits, torch.Generator()) == top[0]

    def draws(sampling, n=300):
        generator = torch.Generator().manual_seed(sampling.seed)
        return [sampling.pick(logits, generator) for _ in range(n)]

    assert set(draws(Sampling(temperature=100.0, top_k=3))) == set(top)
    assert draws(Sampling(temperature=1.0, seed=7)) == draws(Sampling(temperature=1.0, seed=7))
    assert draws(Sampling(temperature=1.0, seed=7)) != draws(Sampling(temperature=1.0, seed=8))
    # top_p keeps the fewest likeliest tokens that reach the mass: here exactly the top two
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    generator = torch.Generator().manual_seed(0)
    picked = {Sampling(temperature=1.0, top_p=0.7).pick(probs, generator) for _ in range(200)}
    assert picked == {0, 1}
    assert Sampling(max_new_tokens=-1, temperature=-1, top_k=-2, top_p=0).problems() == [
        "--max-new-tokens -1: expected ≥ 0", "--temperature -1: expected ≥ 0 (0: greedy)",
        "--top-k -2: expected ≥ 0 (0: no limit)", "--top-p 0: expected 0 < top_p ≤ 1"]


def test_prompts_from_jsonl_name_every_bad_line(tmp_path):
    good = tmp_path / "prompts.jsonl"
    good.write_text(json.dumps({"prompt": "Hi", "images": ["a.png"]}) + "\n\n"
                    + json.dumps({"token_ids": [1, 2]}) + "\n")
    assert generation.read_prompts(str(good)) == [
        Prompt("Hi", None, (str(tmp_path / "a.png"),)), Prompt(None, [1, 2], ())]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\nnot json\n{"prompt": "a", "token_ids": [1]}\n')
    with pytest.raises(ConfigError) as err:
        generation.read_prompts(str(bad))
    message = str(err.value)
    assert all(f"bad.jsonl: line {n}:" in message for n in (2, 3, 4)) and "bad.jsonl: line 1:" not in message


def test_what_is_wrong_is_named_before_any_model(tiny_llava_dir, tmp_path):
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "entrypoints"))
    import generate

    setup = generation.setup(str(tiny_llava_dir), device="cpu")
    with pytest.raises(ConfigError, match="is no LoRA checkpoint"):
        generation.setup(str(tiny_llava_dir), base=str(tmp_path), device="cpu")
    with pytest.raises(ConfigError, match="no tokenizer.json there"):
        generation.setup(str(tiny_llava_dir), tokenizer=str(tmp_path), device="cpu")
    from PIL import Image

    Image.new("RGB", (40, 30), (200, 10, 10)).save(tmp_path / "x.png")
    with pytest.raises(ConfigError, match="2 <image> tag"):
        setup.encode(Prompt("<image><image> two tags", images=(str(tmp_path / "x.png"),)))
    with pytest.raises(ConfigError, match="below vocab_size"):
        setup.encode(Prompt(token_ids=[10**7]))
    with pytest.raises(ConfigError, match="--top-p 2.0"):
        generate.prepare(generate.parse_args(["--checkpoint", str(tiny_llava_dir), "--prompt",
                                              "Hi", "--top-p", "2"]))
    assert setup.decode([872, 10**6]) == setup.tokenizer.decode([872])  # padding rows: nothing
