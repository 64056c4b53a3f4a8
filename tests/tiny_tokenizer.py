"""A small byte-level BPE tokenizer with a ChatML template, trained in milliseconds for tiny test models."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Once upon a time there was a little model that learned to count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10.",
    "def main():\n    print('hello')\n    return 0\n",
    "Café, naïve, résumé, über, señor, smörgåsbord.",
    "日本語のテキスト、中文文本、한국어 텍스트.",
    "Emoji: 😀 🎉 🚀 👍🏽 ❤️",
    "The user asked a question and the assistant gave an answer.",
    "Numbers like 3.14159 and 2024-01-01 appear in text.",
]


def write_tiny_tokenizer(folder: Path, vocab_size: int = 512) -> None:
    """Writes tokenizer.json and tokenizer_config.json (ChatML, eos `<|im_end|>`) into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _train(vocab_size)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "bos_token": None,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
              "chat_template": CHATML_TEMPLATE, "model_max_length": 512}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def _train(vocab_size: int) -> Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be at least {len(alphabet) + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet,
                                  min_frequency=1, show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tokenizer
