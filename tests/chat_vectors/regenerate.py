"""Regenerates ``vectors.json``: the token ids vLLM's ``/tokenize`` gives for `models.CASES`.

Run with the Python of a vLLM install (CPU build 0.32.0 here; no engine is started: the tokenize
endpoint's own code, ``OnlineRenderer.preprocess_chat`` / ``preprocess_completion``, runs in-process on
each model directory, with a two-layer Llama ``config.json`` beside its tokenizer files):

    VLLM_PY=/path/to/vllm-venv/bin/python
    $VLLM_PY tests/chat_vectors/regenerate.py            # vectors.json from the checked-in tokenizer
    $VLLM_PY tests/chat_vectors/regenerate.py --retrain  # base_tokenizer.json trained anew first
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import CASES, HERE, MODELS, SPECIAL_TOKENS, VECTORS, assemble

_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1024,
    "max_position_embeddings": 4096, "torch_dtype": "float32", "rms_norm_eps": 1e-5,
}  # fmt: skip


def train() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = "the a dragon story weather city time tool call answer hello there how are you today tell me about"
    corpus = [" ".join(words.split()[i:] + words.split()[:i]) + ' Zürich 12:00 {"temp": 21}' for i in range(19)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus * 20, trainer)
    tokenizer.save(str(HERE / "base_tokenizer.json"))


async def vectors() -> dict[str, Any]:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest, TokenizeCompletionRequest
    from vllm.renderers.online_renderer import OnlineRenderer
    from vllm.renderers.registry import renderer_from_config

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        renderers = {}
        for model in MODELS:
            directory = assemble(model, Path(tmp) / model)
            (directory / "config.json").write_text(json.dumps(_LLAMA))
            model_config = ModelConfig(model=str(directory), tokenizer=str(directory), max_model_len=4096)
            config = VllmConfig(model_config=model_config)
            renderers[model] = OnlineRenderer(
                model_config, renderer_from_config(config), request_logger=None, chat_template=None,
                chat_template_content_format="auto",
            )  # fmt: skip
        for case, body in CASES.items():
            online = renderers[body["model"]]
            try:
                if "prompt" in body:
                    text = TokenizeCompletionRequest(**body)
                    inputs = await online.preprocess_completion(text, text.prompt, None, skip_mm_cache=True)
                else:
                    chat = TokenizeChatRequest(**body)
                    tools = None if chat.tools is None else [tool.model_dump() for tool in chat.tools]
                    _, inputs = await online.preprocess_chat(
                        chat, chat.messages, default_template=None, default_template_content_format="auto",
                        default_template_kwargs=None, tool_dicts=tools, skip_mm_cache=True,
                    )  # fmt: skip
            except Exception as exc:  # the template refused: the engine answers 400
                out[case] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            out[case] = {"tokens": [token for item in inputs for token in item["prompt_token_ids"]]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--retrain", action="store_true", help="train base_tokenizer.json anew first")
    args = parser.parse_args()
    if args.retrain or not (HERE / "base_tokenizer.json").exists():
        train()
    result = asyncio.run(vectors())
    VECTORS.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"{len(result)} cases written to {VECTORS}")


if __name__ == "__main__":
    main()
