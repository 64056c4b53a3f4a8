"""A small byte-level BPE tokenizer with a ChatML template, trained in milliseconds for tiny test models."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Reasoning models' templates. Qwen3's: the model opens its think block, and enable_thinking=false writes an
# empty one into the prompt. DeepSeek-R1's: the generation prompt opens the block.
QWEN3_TEMPLATE = CHATML_TEMPLATE.replace(
    "{{ '<|im_start|>assistant\n' }}",
    "{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}")
R1_TEMPLATE = CHATML_TEMPLATE.replace("{{ '<|im_start|>assistant\n' }}", "{{ '<|im_start|>assistant\n<think>\n' }}")
THINK_TOKENS = ("<think>", "</think>")
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


def write_tiny_tokenizer(folder: Path, vocab_size: int = 512, template: str = CHATML_TEMPLATE,
                         added_tokens: tuple[str, ...] = ()) -> None:
    """Writes tokenizer.json and tokenizer_config.json (ChatML unless `template` says otherwise, eos
    `<|im_end|>`) into `folder`. `added_tokens`: plain (not special) tokens at the end of the vocabulary, as
    Qwen3 adds `<think>` and `</think>`."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _train(vocab_size - len(added_tokens))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "bos_token": None,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
              "chat_template": template, "model_max_length": 512}
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
