"""Tokenizer: round trips, parity with transformers, chat templates and streaming detokenisation."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import jinja2
import pytest

from engine.model.gguf_loader import default_model_path
from engine.model.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.tiny_tokenizer import write_tiny_tokenizer

UNICODE_TEXTS = [
    "Hello, world!",
    "Café naïve résumé über señor",
    "日本語のテキストと中文文本, 한국어",
    "emoji 😀🎉🚀 👍🏽 ❤️ family 👨‍👩‍👧",
    "combining e\u0301 a\u0308 o\u0302\u0323",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "digits 12345 and 3.14159, 2024-01-01",
    "<|im_start|>user\nhi<|im_end|>\n",
]
# A run of whitespace before a number: the one place transformers' GGUF converter and llama.cpp disagree.
WHITESPACE_BEFORE_DIGITS = ["a  123", "\n\n1. first\n2. second", "x\t\t42", "  7", "١٢٣ ⅷ ²"]
PARITY_TEXTS = UNICODE_TEXTS + [
    "code:\n    def f(x):\n        return x**2\n", "it's we're I'll don't", "URL https://example.com/a?b=1&c=2",
    "$100.00", "<|endoftext|>", "<repo_name>x<file_sep>", "   ", "", "...!!!???", "CamelCaseWords and snake_case",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_folder: Path) -> Tokenizer:
    return Tokenizer.from_hf_folder(tiny_folder)


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(default_model_path()))


@pytest.fixture(scope="module")
def smol_transformers():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


# --- the tiny tokenizer -------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [300, 512])
def test_tiny_tokenizer_fits_the_requested_vocab(tmp_path: Path, vocab_size: int) -> None:
    write_tiny_tokenizer(tmp_path, vocab_size=vocab_size)
    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    assert tokenizer.vocab_size <= vocab_size
    assert max(tokenizer.encode(" ".join(UNICODE_TEXTS))) < vocab_size


def test_tiny_tokenizer_is_deterministic(tmp_path: Path, tiny_folder: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (tiny_folder / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_tiny_round_trip(tiny: Tokenizer, text: str) -> None:
    assert tiny.decode(tiny.encode(text), skip_special_tokens=False) == text


def test_tiny_special_tokens(tiny: Tokenizer) -> None:
    ids = tiny.encode("<|im_start|>user<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and tiny.decode(ids) == "user"
    assert tiny.eos_token_ids == (2,) and tiny.bos_token_id is None and tiny.all_special_ids == [0, 1, 2]


def test_tiny_matches_transformers(tiny: Tokenizer, tiny_folder: Path) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(tiny_folder)
    for text in PARITY_TEXTS:
        assert tiny.encode(text) == reference.encode(text), text
    for messages in (MESSAGES, MESSAGES[1:2]):
        assert tiny.apply_chat_template(messages) == reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)


def test_add_bos_token_from_tokenizer_config(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"bos_token": "<|endoftext|>",
                                                                          "add_bos_token": True}))
    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    assert tokenizer.encode("hi")[0] == 0 and tokenizer.encode("hi", add_special_tokens=False)[0] != 0
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]).startswith("<|im_start|>")


def test_chat_template_jinja_file_wins(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}")
    assert Tokenizer.from_hf_folder(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "x<|im_end|>"


def test_chat_template_features(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
                "{{ m | tojson }}\n{% endfor %}")
    (tmp_path / "chat_template.jinja").write_text(template)
    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "é<b>"}])
    assert rendered == '{"role": "user", "content": "é<b>"}\n'  # no ASCII or HTML escaping
    with pytest.raises(jinja2.TemplateError, match="no tools"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


def test_missing_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_hf_folder(tmp_path).apply_chat_template(MESSAGES)


# --- the default model's GGUF tokenizer ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("text", UNICODE_TEXTS + WHITESPACE_BEFORE_DIGITS)
def test_smol_round_trip(smol: Tokenizer, text: str) -> None:
    assert smol.decode(smol.encode(text), skip_special_tokens=False) == text


@pytest.mark.slow
def test_smol_ids_match_transformers(smol: Tokenizer, smol_transformers) -> None:
    for text in PARITY_TEXTS:
        ids = smol_transformers.encode(text)
        assert smol.encode(text) == ids, text
        assert smol.decode(ids) == smol_transformers.decode(ids, skip_special_tokens=True)
        assert smol.decode(ids, False) == smol_transformers.decode(ids, skip_special_tokens=False)


def llama_cpp_smollm_ids(text: str, reference) -> list[int]:
    """llama.cpp's `smollm` splitting (every \\p{N} alone, then GPT-2's regex) on transformers' BPE model."""
    regex = pytest.importorskip("regex")
    gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    spell = reference.backend_tokenizer.pre_tokenizer.pre_tokenize_str  # plain ByteLevel: bytes -> alphabet
    ids = []
    for chunk in regex.split(r"(\p{N})", text):
        for piece in regex.findall(gpt2, chunk):
            ids += [t.id for t in reference.backend_tokenizer.model.tokenize("".join(s for s, _ in spell(piece)))]
    return ids


@pytest.mark.slow
def test_smol_splits_numbers_like_llama_cpp(smol: Tokenizer, smol_transformers) -> None:
    """The file says pre='smollm': llama.cpp (and SmolLM2's own tokenizer.json) isolate digits before the
    byte-level regex, which transformers' GGUF converter does not, so whitespace before digits differs."""
    for text in PARITY_TEXTS[:-3] + WHITESPACE_BEFORE_DIGITS:  # no special tokens in these
        if "<" not in text:
            assert smol.encode(text) == llama_cpp_smollm_ids(text, smol_transformers), text
    assert [smol.id_to_token(i) for i in smol.encode("a  123")] == ["a", "ĠĠ", "1", "2", "3"]


@pytest.mark.slow
def test_smol_special_tokens_and_no_bos(smol: Tokenizer) -> None:
    assert smol.vocab_size == 49152 and smol.eos_token_ids == (2,) and smol.bos_token_id == 1
    assert smol.encode("Hello")[0] != smol.bos_token_id
    assert smol.encode("<|im_start|>assistant<|im_end|>") == [1, 520, 9531, 2]
    assert set(smol.all_special_ids) == set(range(17))


@pytest.mark.slow
def test_smol_chat_template_matches_transformers(smol: Tokenizer, smol_transformers) -> None:
    for messages in (MESSAGES, MESSAGES[1:], MESSAGES[1:2]):
        for add_generation_prompt in (True, False):
            assert smol.apply_chat_template(messages, add_generation_prompt) == smol_transformers.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt)


# --- incremental detokenisation -----------------------------------------------------------------------------


class SpyTokenizer(Tokenizer):
    """Records the longest id window the detokeniser asked to decode."""

    def __init__(self, inner: Tokenizer) -> None:
        self.__dict__.update(inner.__dict__)
        self.longest = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return super().decode(ids, skip_special_tokens)


def stream(tokenizer: Tokenizer, ids: list[int], prompt_ids: list[int] | None = None,
           skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
    return [detok.push(i) for i in ids] + [detok.flush()]


def check_stream(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    for skip in (True, False):
        deltas = stream(tokenizer, ids, skip_special_tokens=skip)
        full = tokenizer.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == full
        assert "".join(stream(tokenizer, ids, tokenizer.encode("Prompt: 😀"), skip)) == full
        assert "\ufffd" in full or not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", UNICODE_TEXTS + ["🎉" * 5, "end with emoji 🚀"])
def test_tiny_detokenizer_deltas_concatenate_to_decode(tiny: Tokenizer, text: str) -> None:
    check_stream(tiny, text)


@pytest.mark.slow
@pytest.mark.parametrize("text", UNICODE_TEXTS + WHITESPACE_BEFORE_DIGITS)
def test_smol_detokenizer_deltas_concatenate_to_decode(smol: Tokenizer, text: str) -> None:
    check_stream(smol, text)


def test_detokenizer_holds_back_split_characters(tiny: Tokenizer) -> None:
    ids = tiny.encode("🚀")
    assert len(ids) > 1  # the tiny vocabulary has no token for it: it arrives as byte tokens
    deltas = stream(tiny, ids)
    assert deltas[:len(ids) - 1] == [""] * (len(ids) - 1) and deltas[len(ids) - 1] == "🚀"


def test_detokenizer_flush_emits_an_incomplete_tail(tiny: Tokenizer) -> None:
    partial = tiny.encode("🚀")[:1]
    assert stream(tiny, partial) == ["", tiny.decode(partial)] and tiny.decode(partial).endswith("\ufffd")


def test_detokenizer_decodes_a_bounded_window(tiny: Tokenizer) -> None:
    spy = SpyTokenizer(tiny)
    ids = tiny.encode(" ".join(UNICODE_TEXTS) * 20)
    assert "".join(stream(spy, ids)) == tiny.decode(ids)
    assert spy.longest <= 16 < len(ids) // 10  # bounded by the longest character, not the sequence
