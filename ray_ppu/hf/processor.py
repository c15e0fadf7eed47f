"""What transformers' ``AutoProcessor`` needs of an exported vision-language directory besides
the tokenizer and the image processor: ``processor_config.json`` (LLaVA: the image token, the
patch size and feature strategy it expands each image by) and a chat template that takes
images (``chat_template.json``, the processor's own file).

The template is the run's own chat template behind a preamble that turns a message's content
list (``[{"type": "image"}, {"type": "text", "text": …}]``, what processors are given) into
the text ray_ppu trains and generates with: each image as its tag (LLaVA: the image token and
a newline, as an ``<image>`` line of a training record; Qwen2.5-VL: vision start, one image
pad, vision end), then the text. String contents pass through, so any model's template (the
published ones or the ChatML ray_ppu writes) keeps its own format; the processor then expands
each image token to the image's token count, as ``generate.py`` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ray_ppu.config.vision import VisionConfig

PROCESSOR_CONFIG = "processor_config.json"
CHAT_TEMPLATE_JSON = "chat_template.json"  # a processor's template (transformers reads it)

_PREAMBLE = (
    "{%- set ray_ppu = namespace(turns=[]) -%}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set ray_ppu.turns = ray_ppu.turns + [message] -%}"
    "{%- else -%}"
    "{%- set text = namespace(value='') -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{%- set text.value = text.value + IMAGE -%}"
    "{%- elif part['type'] == 'text' -%}{%- set text.value = text.value + part['text'] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- set ray_ppu.turns = ray_ppu.turns + [{'role': message['role'], "
    "'content': text.value}] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- set messages = ray_ppu.turns -%}"
)


def token_text(tokenizer_dir: Path, token_id: int) -> Optional[str]:
    """The text of an added token of ``tokenizer.json`` (None: not an added token)."""
    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        return None
    added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens", [])
    return next((t["content"] for t in added if t.get("id") == token_id), None)


def chat_template(tokenizer_dir: Path) -> Optional[str]:
    """The tokenizer's own chat template, as SFT reads it (the data side's reader)."""
    from ray_ppu.data.sft.chat_encoder import chat_template_of

    return chat_template_of(Path(tokenizer_dir))


def processor_files(vision: VisionConfig, tokenizer_dir: Path) -> dict[str, str]:
    """{file name: text} of ``processor_config.json`` and ``chat_template.json`` for an export
    whose tokenizer (and its template) is in ``tokenizer_dir``; empty where the tokenizer has
    no template or does not name the image token (transformers could not prompt it anyway)."""
    template = chat_template(tokenizer_dir)
    image = token_text(tokenizer_dir, vision.image_token_id)
    if template is None or image is None:
        return {}
    if vision.native:  # Qwen2.5-VL: <|vision_start|><|image_pad|><|vision_end|>
        start = token_text(tokenizer_dir, vision.vision_start_token_id)
        end = token_text(tokenizer_dir, vision.vision_start_token_id + 1)
        if start is None or end is None:
            return {}
        tag, config = start + image + end, {"processor_class": "Qwen2_5_VLProcessor"}
    else:
        tag = image + "\n"
        config = {"processor_class": "LlavaProcessor", "image_token": image,
                  "patch_size": vision.patch_size,
                  "vision_feature_select_strategy": vision.feature_select,
                  "num_additional_image_tokens": 1 if vision.class_token else 0}
    composed = "{%- set IMAGE = " + json.dumps(tag) + " -%}" + _PREAMBLE + template
    return {PROCESSOR_CONFIG: json.dumps(config, indent=2) + "\n",
            CHAT_TEMPLATE_JSON: json.dumps({"chat_template": composed}, indent=2) + "\n"}
