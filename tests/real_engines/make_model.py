"""Writes a tiny random-weight Llama and its byte-level BPE tokenizer (with a chat template) to a
directory, for real vLLM engines to serve without a model hub. Run with the vLLM venv's python
(transformers, tokenizers and torch come with vLLM): ``python make_model.py OUT_DIR``.

The text is gibberish; what matters is that the engine tokenizes, caches and reports like any other.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

VOCAB = 6000
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def words(seed: int, count: int) -> list[str]:
    """Pronounceable nonsense words (the same generator as the tests' prompts)."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    return ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(count)]


def train_tokenizer() -> Tokenizer:
    """The byte-level BPE (``tokenizers`` alone: the proxy's tests train it too)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [" ".join(words(seed, 200)) for seed in range(300)]
    tokenizer.train_from_iterator(corpus, trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return tokenizer


def make_tokenizer(out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    tokenizer = train_tokenizer()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(add_bos_token=False, chat_template=CHAT_TEMPLATE, model_max_length=4096)
    config_path.write_text(json.dumps(config, indent=1))


def make_model(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out, safe_serialization=True)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out)
    make_model(out)
    print(out)


if __name__ == "__main__":
    main()
