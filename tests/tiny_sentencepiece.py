"""A small SentencePiece BPE vocabulary with byte fallback, trained in milliseconds, as a GGUF "llama" tokenizer.

The vocabulary is trained by the `sentencepiece` package with Llama's settings (byte fallback, digits split,
whitespace kept as it is, a dummy space prefix) and written the way llama.cpp's converter writes one: pieces,
scores and token types, the special ids and the add_bos/add_eos flags.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from functools import lru_cache

import gguf

from tests.tiny_tokenizer import CORPUS

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's token types
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]  # marked control, as a converter marks special added tokens
USER_TOKENS = ["<think>", "</think>"]  # marked user-defined: matched whole, but not special
UNK, BOS, EOS, PAD = 0, 1, 2, 3
# Llama 2's chat format: BOS before each user turn, EOS after each assistant turn.
LLAMA2_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
SPM_CORPUS = CORPUS + [
    "    indented code\n\tand a tab, then  two spaces and   three",
    "for i in range(10):\n        total += i * 2  # comment\n",
    "The year 1999 and the numbers 12 345 6789.",
    "A longer English sentence helps the merges: the model answers the question the user asked.",
]


GEMMA_IDS = {"padding": 0, "eos": 1, "bos": 2, "unknown": 3}  # Gemma's layout of its named tokens
GEMMA_CONTROL = ["<mask>", "<start_of_turn>", "<end_of_turn>"]


@dataclass(frozen=True)
class SentencePieceVocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    ids: tuple[tuple[str, int], ...] = (("bos", BOS), ("eos", EOS), ("unknown", UNK), ("padding", PAD))


@lru_cache(maxsize=None)
def tiny_sentencepiece_model(vocab_size: int = 512, gemma: bool = False):
    """The trained `sentencepiece.SentencePieceProcessor` (deterministic: one thread, a fixed corpus).

    `gemma`: Gemma's layout instead of Llama's (pad, eos, bos, unk first, no dummy space prefix).
    """
    import sentencepiece

    ids = {f"{name[:3] if name != 'padding' else 'pad'}_id": i for name, i in GEMMA_IDS.items()} if gemma else dict(
        unk_id=UNK, bos_id=BOS, eos_id=EOS, pad_id=PAD)
    names = dict(pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>") if gemma else {}
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_CORPUS * 8), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", character_coverage=0.99, hard_vocab_limit=False, num_threads=1,
        user_defined_symbols=(GEMMA_CONTROL if gemma else CHAT_TOKENS) + USER_TOKENS, add_dummy_prefix=not gemma,
        minloglevel=2, **ids, **names)
    return sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())


@lru_cache(maxsize=None)
def tiny_sentencepiece_vocab(vocab_size: int = 512, gemma: bool = False) -> SentencePieceVocab:
    """The trained model's pieces, scores and llama.cpp token types.

    `gemma`: also as Gemma's files hold them: a whitespace token spelled with real spaces, and scores that do
    not follow the merge order (reversed here), so that only the vocabulary's order can rank the merges.
    """
    processor = tiny_sentencepiece_model(vocab_size, gemma)
    control = GEMMA_CONTROL if gemma else CHAT_TOKENS
    tokens, scores, types = [], [], []
    for i in range(processor.get_piece_size()):
        piece = processor.id_to_piece(i)
        tokens.append(piece.replace("▁", " ") if gemma and not piece.strip("▁") else piece)
        scores.append(processor.get_score(i))
        types.append(UNKNOWN if processor.is_unknown(i) else CONTROL if processor.is_control(i) or piece in control
                     else USER_DEFINED if piece in USER_TOKENS else UNUSED if processor.is_unused(i)
                     else BYTE if processor.is_byte(i) else NORMAL)
    if gemma:
        return SentencePieceVocab(tokens, scores[::-1], types, tuple(GEMMA_IDS.items()))
    return SentencePieceVocab(tokens, scores, types)


def add_sentencepiece_tokenizer(writer: gguf.GGUFWriter, vocab: SentencePieceVocab | None = None,
                                add_bos: bool | None = True, add_eos: bool | None = False,
                                add_space_prefix: bool | None = None, chat_template: str | None = LLAMA2_TEMPLATE,
                                ) -> int:
    """Writes a "llama" tokenizer's metadata; a flag left None is left out of the file. Returns the vocab size."""
    vocab = vocab or tiny_sentencepiece_vocab()
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array("tokenizer.ggml.tokens", vocab.tokens)
    writer.add_array("tokenizer.ggml.scores", vocab.scores)
    writer.add_array("tokenizer.ggml.token_type", vocab.types)
    for key, token_id in vocab.ids:
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", token_id)
    for key, flag in {"add_bos_token": add_bos, "add_eos_token": add_eos, "add_space_prefix": add_space_prefix}.items():
        if flag is not None:
            writer.add_bool(f"tokenizer.ggml.{key}", flag)
    if chat_template is not None:
        writer.add_string("tokenizer.chat_template", chat_template)
    return len(vocab.tokens)
