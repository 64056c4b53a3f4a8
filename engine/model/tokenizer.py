"""Tokenizers (Hugging Face folders and GGUF files), chat templates and streaming detokenisation."""
from __future__ import annotations

import json
import string
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

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
SPM_SPACE = "\u2581"  # SentencePiece's spelling of a space inside its tokens
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")  # whose "llama" vocabularies follow Gemma's conventions
GEMMA_SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")  # special in transformers whatever the ids
GGUF_TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE with byte fallback"}
# The ids GGUF names, with the tokenizer attribute and chat-template variable each becomes.
GGUF_NAMED_TOKENS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                     "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}

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
                 chat_template: str | None, named_tokens: dict[str, str] | None = None) -> None:
        self._backend = backend
        self._named_tokens = dict(named_tokens or {})  # chat-template variables: unk_token, ...
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self._chat_template = chat_template
        self._compiled_template = _compile_template(chat_template) if chat_template else None
        self._byte_fallback = ByteFallbackDecoder.of(backend)

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
        """Builds the tokenizer a GGUF file's metadata describes: byte-level BPE ("gpt2") or SentencePiece
        BPE ("llama"), the way transformers' `AutoTokenizer.from_pretrained(..., gguf_file=...)` builds it, but
        with the tokenizers library alone: transformers is only a test dependency, and its import and GGUF
        conversion cost several times this at start-up.

        `source` is an `engine.model.gguf_file.GGUFFile` or, much slower to open, a `gguf.GGUFReader`.
        The file's `general.architecture` picks Gemma's variant of a SentencePiece vocabulary.
        """
        meta = _gguf_tokenizer_metadata(source)
        architecture = meta.get("general.architecture")
        kind = meta.get("tokenizer.ggml.model")
        if kind not in GGUF_TOKENIZER_MODELS:
            expected = ", ".join(f"{name!r} ({what})" for name, what in GGUF_TOKENIZER_MODELS.items())
            raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported; expected {expected}")
        tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
        if not tokens:
            raise ModelLoadError("GGUF metadata has no tokenizer.ggml.tokens; expected the model's vocabulary")
        backend = _byte_level_backend(meta) if kind == "gpt2" else _sentencepiece_backend(meta, architecture)
        named = {name: _gguf_token(tokens, meta.get(key)) for name, key in GGUF_NAMED_TOKENS.items()}
        gemma_named = GEMMA_SPECIAL_TOKENS if kind == "llama" and architecture in GEMMA_ARCHITECTURES else ()
        _add_named_special_tokens(backend, [*named.values(), *gemma_named])
        bos_id = meta.get("tokenizer.ggml.bos_token_id")
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise (older files).
        add_bos = bos_id if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") else None
        add_eos = meta.get("tokenizer.ggml.eos_token_id") if meta.get("tokenizer.ggml.add_eos_token") else None
        backend.post_processor = _special_tokens_processor(backend, add_bos, add_eos)
        eos = [meta[key] for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if key in meta]
        return cls(backend, bos_token_id=bos_id, eos_token_ids=eos, chat_template=meta.get("tokenizer.chat_template"),
                   named_tokens={name: t for name, t in named.items() if t is not None})

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
        text = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._byte_fallback is not None and "\ufffd" in text:  # perhaps a run of byte tokens that is not UTF-8
            return self._byte_fallback.decode(ids, skip_special_tokens)
        return text

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
        """bos_token, eos_token and (where the model names them) unk_token and pad_token, as HF passes them."""
        eos = self._eos_token_ids[0] if self._eos_token_ids else None
        named = {"bos_token": self._bos_token_id, "eos_token": eos}
        return {**self._named_tokens,
                **{name: self.id_to_token(i) for name, i in named.items() if i is not None}}


class ByteFallbackDecoder:
    """Decodes ids of a SentencePiece-style vocabulary ("▁" for a space, `<0xNN>` byte tokens) as SentencePiece
    does: each byte of a run of byte tokens that is not valid UTF-8 becomes U+FFFD, and the valid characters
    around it stay.

    tokenizers' ByteFallback instead turns the whole run into U+FFFDs, so one stray byte would garble the
    characters decoded before it: text already streamed would change afterwards. On valid UTF-8 the two agree.
    Used only for the decoder chain that SentencePiece conversions build (Replace, ByteFallback, Fuse, and an
    optional Strip of the prefix space); any other chain is left to the backend.
    """

    STEPS = [{"type": "Replace", "pattern": {"String": SPM_SPACE}, "content": " "}, {"type": "ByteFallback"},
             {"type": "Fuse"}]
    STRIP_PREFIX = {"type": "Strip", "content": " ", "start": 1, "stop": 0}

    def __init__(self, backend: Backend, strip_prefix: bool) -> None:
        self._backend = backend
        self._strip_prefix = strip_prefix
        vocab = backend.get_vocab(with_added_tokens=False)
        self._bytes = {i: int(token[3:5], 16) for token, i in vocab.items() if _is_byte_token(token)}
        self._special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def of(cls, backend: Backend) -> ByteFallbackDecoder | None:
        decoder = backend.decoder
        steps = json.loads(decoder.__getstate__()).get("decoders") if decoder is not None else None
        if steps in (cls.STEPS, cls.STEPS + [cls.STRIP_PREFIX]):
            return cls(backend, strip_prefix=len(steps) > len(cls.STEPS))
        return None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        raw = bytearray()
        for i in ids:
            token = None if skip_special_tokens and i in self._special else self._backend.id_to_token(i)
            if token is not None:
                byte = self._bytes.get(i)
                raw += token.replace(SPM_SPACE, " ").encode("utf-8") if byte is None else bytes((byte,))
        text = raw.decode("utf-8", errors="surrogateescape").translate(_ESCAPED_BYTES)
        return text[1:] if self._strip_prefix and text.startswith(" ") else text


_ESCAPED_BYTES = {0xDC80 + b: "\ufffd" for b in range(128)}  # surrogateescape's stand-ins for invalid bytes


def _is_byte_token(token: str) -> bool:
    return len(token) == 6 and token.startswith("<0x") and token.endswith(">") and all(
        c in string.hexdigits for c in token[3:5])


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
    return {name: value for name, value in metadata.items()
            if name.startswith("tokenizer.") or name == "general.architecture"}


def _add_named_special_tokens(backend: Backend, named: Iterable[str | None]) -> None:
    """As transformers does, a named token (BOS, EOS, ...) not already added becomes a special token: matched whole
    in the text and skipped in decode. One the vocabulary spells otherwise (a byte-level respelling) is left out,
    since adding it would grow the vocabulary past the model's."""
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    vocab = backend.get_vocab(with_added_tokens=False)
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(named)
                                if t is not None and t not in added and t in vocab])


def _gguf_token(tokens: list[str], token_id: int | None) -> str | None:
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


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


def _sentencepiece_backend(meta: dict[str, Any], architecture: str | None) -> Backend:
    """SentencePiece BPE as llama.cpp's "llama" vocabulary holds it: "▁" for a space, `<0xNN>` byte tokens for
    any character the vocabulary lacks, and merges ranked by the score of the token they make.

    It has the same parts as transformers' GGUF conversion (byte-fallback BPE, a Metaspace prefix on the first
    piece of text only, and control and user-defined tokens added whole), so that the ids match it. Gemma's
    files differ in three ways, handled as transformers handles them: a token of whitespace with a space in it
    is stored with real spaces (respelled "▁" here), merges follow the vocabulary's order (its scores do
    not), and no space prefix is added.
    """
    stored: list[str] = meta["tokenizer.ggml.tokens"]
    gemma = architecture in GEMMA_ARCHITECTURES
    tokens = [SPM_SPACE * len(t) if " " in t and not t.strip() else t for t in stored] if gemma else stored
    vocab = {token: i for i, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]
    elif gemma:
        merges = _merges_from_scores(tokens, [-float(i) for i in range(len(tokens))])
    elif len(meta.get("tokenizer.ggml.scores") or ()) == len(tokens):
        merges = _merges_from_scores(tokens, meta["tokenizer.ggml.scores"])
    else:
        raise ModelLoadError("GGUF 'llama' tokenizer has neither tokenizer.ggml.merges nor one score per token; "
                             "expected tokenizer.ggml.scores to rank its merges")
    unk = "<unk>" if gemma and "<unk>" in vocab else None  # only reached for a byte no <0xNN> token spells
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, unk_token=unk))
    # transformers ignores add_space_prefix, prefixing every vocabulary but Gemma's; llama.cpp honours it, and
    # so do we: a model trained without the prefix would otherwise see a "▁" before every prompt.
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True)) and not gemma
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPM_SPACE, split=False,
                                                     prepend_scheme="first" if prefix else "never")
    steps = [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + [decoders.Strip(content=" ", left=1)] if prefix else steps)
    types = meta.get("tokenizer.ggml.token_type", [])
    # By the file's spelling, as transformers does: a Gemma whitespace token respelled above is not added whole.
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, kind in zip(stored, types) if kind == CONTROL_TOKEN and t in vocab])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(stored, types) if kind == USER_DEFINED_TOKEN and t in vocab])
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges recovered from a SentencePiece vocabulary: every split of a token into two tokens.

    SentencePiece merges the adjacent pair whose joined token scores highest, so merges rank by that score. Ties
    go to the longer left part, then the longer right part, then the token's place in the vocabulary, then the
    left part's id. That is the order transformers' conversion gives, so that the ids match it wherever scores
    are equal.
    """
    ids = {token: i for i, token in enumerate(tokens)}
    ranked: list[tuple[float, int, int, int, str, str]] = []  # sort keys, then the merge; plain tuple sorts
    for token, score in dict(zip(tokens, scores)).items():
        splits = sorted((ids[left], ids[right], left, right) for k in range(1, len(token))
                        if (left := token[:k]) in ids and (right := token[k:]) in ids)
        ranked.extend((-score, -len(left), -len(right), len(ranked) + n, left, right)  # len(ranked) + n: vocab order
                      for n, (_, _, left, right) in enumerate(splits))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


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
