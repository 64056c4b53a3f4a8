"""Tokenizers (Hugging Face folders and GGUF files), chat templates and streaming detokenisation."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from engine.model.errors import ModelLoadError

if TYPE_CHECKING:
    import gguf

    from engine.model.gguf_file import GGUFFile

CONTROL_TOKEN = 3  # llama.cpp token types
USER_DEFINED_TOKEN = 4

# Split patterns for `tokenizer.ggml.pre` values whose text splitting differs from GPT-2's own regex.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2_PRE = ("gpt2", "default", "gpt-2")
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact")
LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3")
QWEN2_PRE = ("qwen2", "deepseek-r1-qwen")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what serving needs around it: special ids and the chat template."""

    def __init__(self, backend: Backend, *, bos_token_id: int | None, eos_token_ids: Sequence[int],
                 chat_template: str | None) -> None:
        self._backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self._chat_template = chat_template
        self._compiled_template = _compile_template(chat_template) if chat_template else None

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise ModelLoadError(f"{folder} has no tokenizer.json; expected a Hugging Face tokenizer folder")
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        bos_id = _token_id(backend, config.get("bos_token"))
        eos_id = _token_id(backend, config.get("eos_token"))
        if config.get("add_bos_token") and bos_id is not None and not _adds_bos(backend, bos_id):
            backend.post_processor = _special_tokens_processor(backend, bos_id, None)
        return cls(backend, bos_token_id=bos_id, eos_token_ids=() if eos_id is None else (eos_id,),
                   chat_template=_hf_chat_template(folder, config))

    @classmethod
    def from_gguf(cls, source: GGUFFile | gguf.GGUFReader) -> Tokenizer:
        """Builds the tokenizer a GGUF file's metadata describes (byte-level BPE vocabularies only).

        `source` is an `engine.model.gguf_file.GGUFFile` or, much slower to open, a `gguf.GGUFReader`.
        """
        meta = _gguf_tokenizer_metadata(source)
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported; expected 'gpt2' (byte-level BPE)")
        backend = _byte_level_backend(meta)
        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        add_bos = bos_id if meta.get("tokenizer.ggml.add_bos_token", False) else None
        add_eos = meta.get("tokenizer.ggml.eos_token_id") if meta.get("tokenizer.ggml.add_eos_token") else None
        backend.post_processor = _special_tokens_processor(backend, add_bos, add_eos)
        eos = [meta[key] for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if key in meta]
        return cls(backend, bos_token_id=bos_id, eos_token_ids=eos, chat_template=meta.get("tokenizer.chat_template"))

    @property
    def backend(self) -> Backend:
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(i for i, token in self._backend.get_added_tokens_decoder().items() if token.special)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Renders `messages` as Hugging Face's `apply_chat_template(..., tokenize=False)` does."""
        if self._compiled_template is None:
            raise ValueError("this model has no chat template; send a plain completion prompt instead")
        variables = {**self._template_tokens(), **kwargs}  # callers may override bos_token and friends
        return self._compiled_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              **variables)

    def _template_tokens(self) -> dict[str, str]:
        eos = self._eos_token_ids[0] if self._eos_token_ids else None
        named = {"bos_token": self._bos_token_id, "eos_token": eos}
        return {name: self.id_to_token(i) for name, i in named.items() if i is not None}


class IncrementalDetokenizer:
    """Turns one sequence's generated ids into text deltas, never splitting a UTF-8 character.

    Each step decodes a short window, the last emitted ids (context, which some decoders need to place a
    leading space) plus the pending ones, and emits the text past the context unless it ends mid-character.
    """

    PROMPT_CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids or ())[-self.PROMPT_CONTEXT:]
        self._emitted = len(self._ids)  # ids[:emitted] is context whose text is already out

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Emits whatever is held back (an incomplete character at the very end decodes as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        context = self._decode(self._ids[:self._emitted])
        text = self._decode(self._ids)
        if len(text) <= len(context) or (text.endswith("\ufffd") and not final):
            return ""
        del self._ids[:self._emitted]  # the ids emitted now become the next step's context
        self._emitted = len(self._ids)
        return text[len(context):]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _token_id(backend: Backend, token: Any) -> int | None:
    text = _token_text(token)
    return None if text is None else backend.token_to_id(text)


def _adds_bos(backend: Backend, bos_id: int) -> bool:
    return backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The template from chat_template.jinja, chat_template.json or tokenizer_config.json, in that order."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        template = {entry["name"]: entry["template"] for entry in template}.get("default")
    return template


def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _raise_template_error(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters, which chat templates must not do.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _gguf_tokenizer_metadata(source: GGUFFile | gguf.GGUFReader) -> dict[str, Any]:
    metadata = getattr(source, "metadata", None)  # a GGUFFile's is already plain Python values
    if metadata is None:
        metadata = {name: field.contents() for name, field in source.fields.items()}
    return {name: value for name, value in metadata.items() if name.startswith("tokenizer.")}


def _byte_level_backend(meta: dict[str, Any]) -> Backend:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token if set(token) <= alphabet else _byte_level_spelling(token): i for i, token in enumerate(tokens)}
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    _add_gguf_special_tokens(backend, tokens, meta.get("tokenizer.ggml.token_type", []), alphabet)
    return backend


def _byte_level_spelling(token: str) -> str:
    """A token stored as raw text (some converters do this for a few) spelled in GPT-2's byte alphabet."""
    mapping = _byte_to_unicode()
    return "".join(mapping[byte] for byte in token.encode("utf-8"))


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte to printable-character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """Mirrors llama.cpp's splitting for `tokenizer.ggml.pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in GPT2_PRE:
        return byte_level
    if pre in DIGIT_SPLIT_PRE:  # llama.cpp isolates every \p{N} before GPT-2's regex, as HF's Digits does
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = LLAMA3_SPLIT if pre in LLAMA3_PRE else QWEN2_SPLIT if pre in QWEN2_PRE else None
    if split is None:
        raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} is not supported; expected one of "
                             f"{', '.join(GPT2_PRE + DIGIT_SPLIT_PRE + LLAMA3_PRE + QWEN2_PRE)}")
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _add_gguf_special_tokens(backend: Backend, tokens: list[str], token_types: list[int], alphabet: set[str]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens (matched whole).

    As in transformers, one spelled outside the byte alphabet is left out: adding it would grow the vocabulary.
    """
    spelled = [(t, kind) for t, kind in zip(tokens, token_types) if set(t) <= alphabet]
    control = [t for t, kind in spelled if kind == CONTROL_TOKEN]
    user = [t for t, kind in spelled if kind == USER_DEFINED_TOKEN]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _special_tokens_processor(backend: Backend, bos_id: int | None, eos_id: int | None) -> processors.PostProcessor:
    names = {i: backend.id_to_token(i) for i in (bos_id, eos_id) if i is not None}
    bos = [names[bos_id]] if bos_id is not None else []
    eos = [names[eos_id]] if eos_id is not None else []
    return processors.TemplateProcessing(single=[*bos, "$A", *eos], pair=[*bos, "$A", *eos, *bos, "$B:1", *eos],
                                         special_tokens=[(token, i) for i, token in names.items()])
