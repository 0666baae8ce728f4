"""Model directories with chat templates, and the requests whose token ids vLLM gave for them.

`assemble` writes a model's tokenizer files (``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``, ``special_tokens_map.json``) from what is checked in here: one byte-level
BPE (``base_tokenizer.json``, trained by ``regenerate.py``) given each model's post-processor, and the
templates of this directory, in each of the places Hugging Face reads a template from. ``CASES`` are
the requests; ``vectors.json`` holds vLLM 0.32's answers to them (``regenerate.py``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, processors

HERE = Path(__file__).resolve().parent
VECTORS = HERE / "vectors.json"
SPECIAL_TOKENS = [
    "<unk>", "<s>", "</s>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|im_start|>", "<|im_end|>", "[INST]", "[/INST]",
]  # fmt: skip


def _template(name: str) -> str:
    return (HERE / f"{name}.jinja").read_text(encoding="utf-8")


_PLAIN_TOKEN = {"lstrip": False, "normalized": False, "rstrip": False, "special": True}

# name -> the token its post-processor puts in front of a text (None: none), and its files
MODELS: dict[str, dict[str, Any]] = {
    # Llama-3-like: BOS from the post-processor for text, from the template for chat; tools in the system turn.
    "llama3-like": {
        "prefix": "<|begin_of_text|>",
        "config": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": "llama3_like"},
    },
    # ChatML-like with tools, no BOS anywhere; template in tokenizer_config.json.
    "chatml-tools": {
        "prefix": None,
        "config": {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "chat_template": "chatml_tools"},
    },
    # [INST]-style without a generation-prompt branch, raising on bad turns; template in chat_template.jinja,
    # special tokens written as added-token objects.
    "inst-no-generation-prompt": {
        "prefix": "<s>",
        "config": {
            "bos_token": {"__type": "AddedToken", "content": "<s>", **_PLAIN_TOKEN},
            "eos_token": {"__type": "AddedToken", "content": "</s>", **_PLAIN_TOKEN},
            "unk_token": "<unk>",
        },
        "jinja_file": "inst_no_generation_prompt",
    },
    # Named templates (default, tool_use picked when a request has tools); eos in special_tokens_map.json.
    "named-templates": {
        "prefix": None,
        "config": {"chat_template": [["default", "named_default"], ["tool_use", "named_tool_use"]]},
        "special_tokens_map": {"eos_token": "<|im_end|>"},
    },
}


def assemble(model: str, directory: Path) -> Path:
    """Writes ``model``'s tokenizer files into ``directory``, which it returns."""
    spec = MODELS[model]
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(HERE / "base_tokenizer.json"))
    prefix = spec["prefix"]
    if prefix is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{prefix} $A", pair=f"{prefix} $A $B", special_tokens=[(prefix, tokenizer.token_to_id(prefix))]
        )
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, **spec["config"]}
    template = config.get("chat_template")
    if isinstance(template, str):
        config["chat_template"] = _template(template)
    elif isinstance(template, list):
        config["chat_template"] = [{"name": name, "template": _template(file)} for name, file in template]
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    if "jinja_file" in spec:
        shutil.copy(HERE / f"{spec['jinja_file']}.jinja", directory / "chat_template.jinja")
    if "special_tokens_map" in spec:
        (directory / "special_tokens_map.json").write_text(json.dumps(spec["special_tokens_map"]), encoding="utf-8")
    return directory


_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
_TIME = {"type": "function", "function": {"name": "get_time", "strict": True}}
_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}
_BAD_CALL = {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}
_TOOL_TURNS = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather in Zürich and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [_CALL, _BAD_CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]
_PLAIN = [
    {"role": "system", "content": "Be brief.  "},
    {"role": "user", "content": "Hello there, how are you doing today? 日本語も"},
    {"role": "assistant", "content": "Fine, thanks."},
    {"role": "user", "content": "Tell me a story about a dragon."},
]
_DATE = {"date_string": "03 Dec 2026"}

# id -> the model and the /tokenize body (chat: messages; text: prompt)
CASES: dict[str, dict[str, Any]] = {
    "llama3-plain": {"model": "llama3-like", "messages": _PLAIN, "chat_template_kwargs": _DATE},
    "llama3-tools": {"model": "llama3-like", "messages": _TOOL_TURNS, "tools": [_WEATHER, _TIME],
                     "chat_template_kwargs": _DATE},
    "llama3-no-generation-prompt": {"model": "llama3-like", "messages": _PLAIN[:3], "add_generation_prompt": False,
                                    "chat_template_kwargs": _DATE},
    "llama3-special-tokens-added": {"model": "llama3-like", "messages": _PLAIN[1:2], "add_special_tokens": True,
                                    "chat_template_kwargs": _DATE},
    "llama3-text": {"model": "llama3-like", "prompt": "Once upon a time, in a land far away"},
    "llama3-text-no-special-tokens": {"model": "llama3-like", "prompt": "Once upon", "add_special_tokens": False},
    "chatml-plain": {"model": "chatml-tools", "messages": _PLAIN},
    "chatml-tools": {"model": "chatml-tools", "messages": _TOOL_TURNS, "tools": [_WEATHER, _TIME]},
    "chatml-tools-no-system": {"model": "chatml-tools", "messages": _TOOL_TURNS[1:], "tools": [_WEATHER]},
    "chatml-billing-header": {"model": "chatml-tools", "messages": [
        {"role": "system", "content": "x-anthropic-billing-header: cch=7f3a; v=1\nYou are terse."}, _PLAIN[1]]},
    "chatml-named-user": {"model": "chatml-tools", "messages": [{"role": "user", "name": "ann", "content": "hi"}]},
    "chatml-text": {"model": "chatml-tools", "prompt": "<|im_start|>user\nraw text with specials<|im_end|>"},
    "inst-plain": {"model": "inst-no-generation-prompt", "messages": _PLAIN},
    "inst-no-system": {"model": "inst-no-generation-prompt", "messages": _PLAIN[1:], "add_generation_prompt": False},
    "inst-text": {"model": "inst-no-generation-prompt", "prompt": "Plain text, with a BOS in front."},
    "inst-refused": {"model": "inst-no-generation-prompt", "messages": [_PLAIN[1], _PLAIN[1]]},
    "named-default": {"model": "named-templates",
                      "messages": [{"role": "user", "name": "bob", "content": "hi"}, *_PLAIN[2:]]},
    "named-tool-use": {"model": "named-templates", "messages": _TOOL_TURNS, "tools": [_WEATHER, _TIME]},
}  # fmt: skip
