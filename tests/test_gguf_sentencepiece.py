"""GGUF "llama" (SentencePiece BPE, byte fallback) tokenizers against transformers' own GGUF loading of the same
file: ids, special tokens, flags, streaming detokenisation, and a chat served through the file's template."""
from __future__ import annotations

import random
from pathlib import Path

import gguf
import pytest
import torch

from engine.model.errors import ModelLoadError
from engine.model.gguf_file import GGUFFile
from engine.model.gguf_loader import read_gguf
from engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.test_gguf_loader import write_gguf
from tests.tiny_sentencepiece import (BOS, CHAT_TOKENS, CONTROL, EOS, LLAMA2_TEMPLATE, NORMAL, PAD, UNK, UNKNOWN,
                                      USER_TOKENS, SentencePieceVocab, add_sentencepiece_tokenizer,
                                      tiny_sentencepiece_model, tiny_sentencepiece_vocab)

pytest.importorskip("sentencepiece")
transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!", "hello world", "The quick brown fox jumps over the lazy dog.",
    "Café naïve résumé über señor smörgåsbord", "combining e\u0301 a\u0308 o\u0302\u0323", "Ωμέγα Жук ẞ ǅ ﬁ K",
    "日本語のテキスト、中文文本、한국어 텍스트.", "未见过的汉字：龘靐齉", "emoji 😀🎉🚀 👍🏽 ❤️ family 👨‍👩‍👧 🦀",
    "def main():\n    print('hello')\n    return 0\n", "for i in range(10):\n\ttotal += i ** 2  # sum\n",
    "x = {'a': [1, 2, 3]}; y = x['a'][-1]", "digits 12345 and 3.14159, 2024-01-01, 1,000,000", "007 42 9",
    " leading space", "  two leading spaces", "    four", "trailing  ", "a  b   c    d", "tabs\tand\t\ttabs",
    "new\nlines\n\n\nand\r\nwindows", "\n", " ", "   ", "\t", "", "...!!!???", "a" * 40,
    "<s>bos in text</s>", "<unk> and <pad>", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    " <|im_start|> spaced <|im_end|> ", "<think>reasoning</think>answer", "<|im_start|><|im_end|><s></s>",
    "[INST] hi [/INST]", "<|im_start", "<<SYS>>\nBe brief.\n<</SYS>>",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀, what is 2+2?"},
            {"role": "assistant", "content": "4, of course."}, {"role": "user", "content": "日本語 please"}]


def write_spm_gguf(path: Path, **flags) -> Path:
    write_gguf(path, tokenizer=lambda writer: add_sentencepiece_tokenizer(writer, **flags))
    return path


def reference_tokenizer(path: Path):
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_spm_gguf(tmp_path_factory.mktemp("spm") / "tiny-spm.gguf")


@pytest.fixture(scope="module")
def ours(spm_file: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(spm_file))


@pytest.fixture(scope="module")
def reference(spm_file: Path):
    return reference_tokenizer(spm_file)


def assert_same_ids(ours: Tokenizer, reference, texts: list[str] = TEXTS) -> None:
    for text in texts:
        for special in (True, False):
            ids = reference.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip) == reference.decode(ids, skip_special_tokens=skip), (text, skip)


# --- ids against transformers -------------------------------------------------------------------------------


def test_vocabulary_has_byte_tokens_and_scores() -> None:
    vocab = tiny_sentencepiece_vocab()
    assert vocab.tokens[8:10] == ["<0x00>", "<0x01>"] and "▁the" in vocab.tokens and "▁▁" in vocab.tokens
    assert len(set(vocab.scores)) > len(vocab.tokens) // 3


def test_ids_and_decode_match_transformers(ours: Tokenizer, reference) -> None:
    assert_same_ids(ours, reference)


def test_merges_ranked_by_score_match_transformers(ours: Tokenizer, reference) -> None:
    import json

    assert json.loads(ours.backend.to_str())["model"]["merges"] == json.loads(
        reference.backend_tokenizer.to_str())["model"]["merges"]


def test_random_text_matches_transformers(ours: Tokenizer, reference) -> None:
    """Random strings over the corpus' characters, specials, whitespace and characters the vocabulary lacks."""
    rng = random.Random(3)
    alphabet = list("abcdefghij thequickTHE012345679.,:;'\"()[]{}#=+-*/\\_") + list("  \t\n") * 3 + list(
        "éüñçÅ日本語中文한국😀🎉👍🏽龘Ж") + ["<s>", "</s>", "<|im_start|>", "<think>", "▁", "<0x41>"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(300)]
    assert_same_ids(ours, reference, texts)


@pytest.mark.parametrize("flags", [{"add_bos": False}, {"add_bos": None}, {"add_eos": True},
                                   {"add_bos": False, "add_eos": True}])
def test_add_bos_and_add_eos_flags_match_transformers(tmp_path: Path, flags: dict) -> None:
    path = write_spm_gguf(tmp_path / "m.gguf", **flags)
    ours, reference = Tokenizer.from_gguf(GGUFFile(path)), reference_tokenizer(path)
    assert_same_ids(ours, reference, TEXTS[:8] + ["", "<s>x"])
    ids = ours.encode("hello")
    assert (ids[0] == BOS) == (flags.get("add_bos", True) is not False)  # absent: BOS, as llama.cpp does
    assert (ids[-1] == EOS) == bool(flags.get("add_eos"))


def test_tie_broken_merges_match_transformers(tmp_path: Path) -> None:
    """A hand-made vocabulary where many merges score the same, so that only the tie-break orders them."""
    pieces = ["a", "b", "c", "ab", "bc", "abc", "▁", "▁a", "▁ab", "ca", "cab", "bca", "▁▁", "▁▁a", "aa", "aaa"]
    scores = [0.0] * 3 + [-1.0] * 3 + [0.0, -1.0, -1.0, -1.0, -2.0, -2.0, -1.0, -2.0, -1.0, -1.0]
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = SentencePieceVocab(specials + [f"<0x{b:02X}>" for b in range(256)] + pieces,
                               [0.0] * (len(specials) + 256) + scores,
                               [UNKNOWN, CONTROL, CONTROL, CONTROL] + [6] * 256 + [NORMAL] * len(pieces))
    path = tmp_path / "ties.gguf"
    write_gguf(path, tokenizer=lambda writer: add_sentencepiece_tokenizer(writer, vocab=vocab, chat_template=None))
    texts = ["abc", "abcabc", "cabca bcab", "aaaa aaa aa", "  abc", "bcabcab ab ca", "ab c  a", "xyz abc"]
    assert_same_ids(Tokenizer.from_gguf(GGUFFile(path)), reference_tokenizer(path), texts)


def write_gemma_gguf(path: Path, arch: str) -> Path:
    vocab = tiny_sentencepiece_vocab(gemma=True)
    write_gguf(path, arch=arch, tokenizer=lambda writer: add_sentencepiece_tokenizer(writer, vocab=vocab,
                                                                                     add_space_prefix=False))
    return path


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_vocabulary_matches_transformers_and_sentencepiece(tmp_path: Path, arch: str) -> None:
    """Gemma's files: whitespace tokens spelled with spaces, scores out of merge order, no space prefix."""
    path = write_gemma_gguf(tmp_path / f"{arch}.gguf", arch)
    ours = Tokenizer.from_gguf(GGUFFile(path))
    assert_same_ids(ours, reference_tokenizer(path))
    assert ours.vocab_size == len(tiny_sentencepiece_vocab(gemma=True).tokens)
    assert ours.bos_token_id == 2 and ours.eos_token_ids == (1,)
    assert [ours.id_to_token(i) for i in ours.encode("  two  spaces", False)][:3] == ["▁▁", "two", "▁▁"]
    processor = tiny_sentencepiece_model(gemma=True)
    for text in TEXTS:
        if "<" not in text:
            assert ours.encode(text, add_special_tokens=False) == processor.encode(text), text


def test_gemma_1_vocabulary_is_read_like_gemma_2(tmp_path: Path) -> None:
    """transformers reads no Gemma 1 GGUF; its vocabulary follows the same conventions as Gemma 2's."""
    first, second = (Tokenizer.from_gguf(GGUFFile(write_gemma_gguf(tmp_path / f"{a}.gguf", a)))
                     for a in ("gemma", "gemma2"))
    for text in TEXTS:
        assert first.encode(text) == second.encode(text), text


# --- special tokens, byte fallback, flags -------------------------------------------------------------------


def test_named_control_and_user_defined_tokens(ours: Tokenizer) -> None:
    vocab = tiny_sentencepiece_vocab()
    assert ours.bos_token_id == BOS and ours.eos_token_ids == (EOS,) and ours.vocab_size == len(vocab.tokens)
    chat = [vocab.tokens.index(t) for t in CHAT_TOKENS]
    user = [vocab.tokens.index(t) for t in USER_TOKENS]
    assert ours.all_special_ids == sorted({UNK, BOS, EOS, PAD, *chat})
    ids = ours.encode("<|im_start|>user<|im_end|><think>x</think>", add_special_tokens=False)
    assert ids[0] == chat[0] and chat[1] in ids and user[0] in ids and ids[-1] == user[1]
    assert ours.decode(ids) == "user<think>x</think>"  # user-defined tokens stay in the text, control ones go
    assert ours.encode("<s></s><unk><pad>", add_special_tokens=False) == [BOS, EOS, UNK, PAD]


def test_characters_outside_the_vocabulary_fall_back_to_bytes(ours: Tokenizer) -> None:
    text = "龘🦀"  # neither is in the tiny vocabulary
    pieces = [ours.id_to_token(i) for i in ours.encode(text, add_special_tokens=False)]
    assert pieces == ["▁", "<0xE9>", "<0xBE>", "<0x98>", "<0xF0>", "<0x9F>", "<0xA6>", "<0x80>"]
    assert ours.decode(ours.encode(text)) == text


def test_round_trip(ours: Tokenizer) -> None:
    for text in TEXTS:
        if "<" not in text and not text.startswith(" "):  # specials decode away; a leading space is the prefix's
            assert ours.decode(ours.encode(text)) == text, text


def test_no_space_prefix_when_the_file_says_so(tmp_path: Path) -> None:
    """llama.cpp honours add_space_prefix=false (transformers' GGUF conversion ignores it): no "▁" is prepended
    and decode strips no leading space."""
    ours = Tokenizer.from_gguf(GGUFFile(write_spm_gguf(tmp_path / "m.gguf", add_space_prefix=False)))
    with_prefix = Tokenizer.from_gguf(GGUFFile(write_spm_gguf(tmp_path / "p.gguf", add_space_prefix=True)))
    assert ours.id_to_token(ours.encode("the", add_special_tokens=False)[0]) != "▁the"
    assert with_prefix.id_to_token(with_prefix.encode("the", add_special_tokens=False)[0]) == "▁the"
    for text in ("the", " the end", "  x", "日本", "a\n b"):
        assert ours.decode(ours.encode(text)) == text
        if not text.startswith(" "):  # a text that starts with a space gets no prefix anyway
            assert ours.encode(" " + text, False) == with_prefix.encode(text, False)


def test_unsupported_or_incomplete_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    vocab = tiny_sentencepiece_vocab()
    unscored = SentencePieceVocab(vocab.tokens, vocab.scores[:10], vocab.types)
    path = tmp_path / "unscored.gguf"
    write_gguf(path, tokenizer=lambda writer: add_sentencepiece_tokenizer(writer, vocab=unscored))
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.scores"):
        read_gguf(path)
    write_gguf(tmp_path / "t5.gguf", tokenizer_model="t5")
    with pytest.raises(ModelLoadError, match="'t5' is not supported; expected 'gpt2' .*'llama'"):
        read_gguf(tmp_path / "t5.gguf")


# --- chat template -------------------------------------------------------------------------------------------


def chat_ids(reference, messages: list[dict]) -> list[int]:
    out = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out if isinstance(out, list) else out["input_ids"])


def test_chat_template_from_metadata_matches_transformers(ours: Tokenizer, reference) -> None:
    assert ours.chat_template == LLAMA2_TEMPLATE
    for messages in (MESSAGES, MESSAGES[1:2], MESSAGES[:2]):
        text = ours.apply_chat_template(messages)
        assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.encode(text, add_special_tokens=False) == chat_ids(reference, messages)
    assert ours.apply_chat_template(MESSAGES[:3]) == (
        "<<SYS>>\nBe brief.\n<</SYS>>\n\n<s>[INST] Hi 😀, what is 2+2? [/INST] 4, of course. </s>")


# --- streaming detokenisation -------------------------------------------------------------------------------


def stream(tokenizer: Tokenizer, ids: list[int], prompt_ids: list[int] | None = None,
           skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    return [detok.push(i) for i in ids] + [detok.flush()]


def expected_text(tokenizer: Tokenizer, ids: list[int], prompt_ids: list[int] | None, skip: bool) -> str:
    """What the stream must add up to: the text the ids add after the prompt's last few (whose leading space, if
    any, is the prefix's and is stripped), not the text of the ids on their own."""
    context = list(prompt_ids or ())[-IncrementalDetokenizer.PROMPT_CONTEXT:]
    return tokenizer.decode(context + ids, skip)[len(tokenizer.decode(context, skip)):]


def byte_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return [tokenizer.backend.token_to_id(f"<0x{b:02X}>") for b in text.encode("utf-8")]


def test_a_stream_of_byte_tokens_emits_each_character_once_it_is_complete(ours: Tokenizer) -> None:
    text = "你好😀é🦀"
    ids = byte_ids(ours, text)
    for prompt in (None, ours.encode("Prompt: 日本")):
        deltas = stream(ours, ids, prompt)
        assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
        ends = [len(text[:k].encode()) for k in range(1, len(text) + 1)]  # the byte count when each char completes
        assert [i + 1 for i, d in enumerate(deltas) if d] == ends and all(len(d) == 1 for d in deltas if d)


def test_byte_tokens_between_words_stream_like_decode(ours: Tokenizer) -> None:
    word = ours.encode(" the", add_special_tokens=False)
    ids = word + byte_ids(ours, "😀") + word + byte_ids(ours, "龘") + byte_ids(ours, "é") + word
    for prompt in (None, ours.encode("Hi")):
        for skip in (True, False):
            deltas = stream(ours, ids, prompt, skip)
            assert "".join(deltas) == expected_text(ours, ids, prompt, skip)
            assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_deltas_add_up_to_decode(ours: Tokenizer, text: str) -> None:
    ids = ours.encode(text)
    for prompt in (None, ours.encode("Prompt: 😀")):
        for skip in (True, False):
            deltas = stream(ours, ids, prompt, skip)
            assert "".join(deltas) == expected_text(ours, ids, prompt, skip)
            assert not any("\ufffd" in d for d in deltas)  # the text is valid: no replacement character ever shows


def test_decode_matches_sentencepiece_and_transformers(ours: Tokenizer, reference) -> None:
    """Random ids, byte tokens half the time: ours decodes as SentencePiece does, one U+FFFD per byte that is not
    part of a valid character, and as transformers does wherever the bytes are valid UTF-8 (transformers turns a
    whole run of byte tokens into U+FFFDs when any of it is invalid)."""
    processor = tiny_sentencepiece_model()
    space = ours.backend.token_to_id("<0x20>")  # SentencePiece keeps a leading space byte that both others strip
    rng = random.Random(5)
    invalid = 0
    for _ in range(2000):
        ids = [rng.randrange(8, 264) if rng.random() < 0.5 else rng.randrange(6, ours.vocab_size)
               for _ in range(rng.randint(1, 20))]
        text, reference_text = ours.decode(ids), reference.decode(ids, skip_special_tokens=True)
        assert text == processor.decode(ids) or ids[0] == space, ids
        assert text == reference_text or "\ufffd" in reference_text, ids
        invalid += "\ufffd" in reference_text
    assert invalid > 100


def test_hf_folder_with_a_sentencepiece_decoder_decodes_the_same(tmp_path: Path, ours: Tokenizer, reference) -> None:
    """A Llama-style tokenizer.json (the same decoder chain) gets the same decoding of invalid byte runs."""
    import json

    ours.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    folder = Tokenizer.from_hf_folder(tmp_path)
    ids = ours.encode("a日本") + byte_ids(ours, "龘") + byte_ids(ours, "é")[:1] + ours.encode(" end", False)
    assert folder.decode(ids) == ours.decode(ids) == "a日本龘\ufffd end"
    assert reference.decode(ids, skip_special_tokens=True) == "a日本\ufffd\ufffd\ufffd\ufffd end"  # the whole run


def test_random_id_streams_add_up_to_decode(ours: Tokenizer) -> None:
    """Arbitrary ids, byte tokens half the time (invalid sequences included): the deltas add up to decode, and a
    replacement character is only ever emitted where decode of the whole stream has one too."""
    rng = random.Random(11)
    vocab = ours.vocab_size
    for _ in range(200):
        ids = [rng.randrange(8, 264) if rng.random() < 0.5 else rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        prompt = ours.encode("Prompt:") if rng.random() < 0.5 else None
        deltas = stream(ours, ids, prompt)
        whole = expected_text(ours, ids, prompt, True)
        assert "".join(deltas) == whole
        assert whole.count("\ufffd") == sum(d.count("\ufffd") for d in deltas)


# --- the loader and a chat through the engine ---------------------------------------------------------------


def test_loader_reads_the_sentencepiece_file(spm_file: Path) -> None:
    model = read_gguf(spm_file)
    assert model.config.vocab_size == len(tiny_sentencepiece_vocab().tokens)
    assert model.config.bos_token_id == BOS and model.config.eos_token_ids == (EOS,)
    assert model.tokenizer.encode("hello world") == Tokenizer.from_gguf(gguf.GGUFReader(spm_file)).encode("hello world")


def transformers_greedy(path: Path, prompt_ids: list[int], steps: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              torch_dtype=torch.float32)
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


@pytest.mark.engine
def test_chat_through_the_files_template_matches_transformers(spm_file: Path, ours: Tokenizer, reference) -> None:
    from engine import LLM, SamplingParams

    llm = LLM(str(spm_file), dtype="float32", num_kv_blocks=64, block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = llm.chat(MESSAGES[:2], params)[0]
    prompt_ids = chat_ids(reference, MESSAGES[:2])
    assert out.prompt_token_ids == prompt_ids and BOS in prompt_ids
    generated = list(out.outputs[0].token_ids)
    assert generated == transformers_greedy(spm_file, prompt_ids, 12)
    text, reference_text = out.outputs[0].text, reference.decode(generated, skip_special_tokens=True)
    print(f"reply: {text!r}")
    assert text == ours.decode(generated) and (text == reference_text or "\ufffd" in reference_text)


@pytest.mark.engine
async def test_async_chat_streams_the_same_text(spm_file: Path) -> None:
    from engine import LLM, AsyncLLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    blocking = LLM(str(spm_file), dtype="float32", num_kv_blocks=64, block_size=8).chat(MESSAGES, params)[0]
    llm = AsyncLLM(str(spm_file), dtype="float32", num_kv_blocks=64, block_size=8)
    try:
        deltas = [out.outputs[0].delta_text async for out in llm.chat(MESSAGES, params)]
    finally:
        llm.shutdown()
    assert "".join(deltas) == blocking.outputs[0].text
