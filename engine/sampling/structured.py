"""Structured outputs: grammar constraints on what a sequence may generate, enforced with xgrammar.

A `Guide` is the constraint as the user wrote it (a JSON schema, any JSON object, a regex, a list of choices, an
EBNF grammar or a structural tag): plain strings, so it travels in SamplingParams, over msgpack and into cache
keys. A `GrammarCompiler` turns a Guide into xgrammar's compiled grammar for one tokenizer, once per Guide (a
bounded LRU cache, thread-safe: the engine's callers compile on a worker thread before a request reaches the
step thread, engine.core.constraints, so the step thread normally only finds cache hits); every JSON part is
compiled with its numbers and whitespace bounded (json_grammar), so that a JSON constraint closes.
`GuideStates` holds one matcher per sequence and fills the bitmask rows of a sampling batch; it follows each
sequence's output tokens, so preemption, recompute, n > 1 and a first token sampled by another actor need no
extra bookkeeping.

xgrammar was chosen over llguidance and outlines-core by the per-token mask cost measured with
`python -m bench.grammar_mask` (docs/performance.md).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.sampling.json_grammar import JSON_OBJECT, bounded_structural_tag, json_schema_ebnf

if TYPE_CHECKING:
    from engine.model.tokenizer import Tokenizer

GUIDE_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
CACHE_SIZE = 256  # compiled grammars kept per tokenizer


class GuideError(ValueError):
    """A constraint the grammar engine cannot compile; the message names the problem."""


@dataclass(frozen=True)
class Guide:
    """One constraint. `kind` is one of GUIDE_KINDS; `source` is the schema as JSON text (json), the regex
    (regex), the EBNF grammar (grammar), "" (json_object: any JSON object), xgrammar's structural tag as JSON
    text (structural_tag: literal text around JSON-schema parts, such as a tool call); `choices` for kind
    choice."""

    kind: str
    source: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in GUIDE_KINDS:
            raise GuideError(f"unknown constraint kind {self.kind!r}; expected one of {', '.join(GUIDE_KINDS)}")
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind == "choice" and (not self.choices or not all(isinstance(c, str) for c in self.choices)):
            raise GuideError("a choice constraint needs a non-empty list of strings")

    @classmethod
    def json_schema(cls, schema: Any) -> Guide:
        """From a schema given as a dict or as JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GuideError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GuideError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json", json.dumps(schema, separators=(",", ":")))

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "source": self.source, "choices": list(self.choices)}

    @classmethod
    def from_wire(cls, d: dict[str, Any] | None) -> Guide | None:
        return None if d is None else cls(d["kind"], d.get("source", ""), tuple(d.get("choices", ())))


def _ebnf_string(text: str) -> str:
    """`text` as a double-quoted EBNF literal."""
    return json.dumps(text, ensure_ascii=False)


def token_bytes(tokenizer: Tokenizer) -> tuple[list[bytes], list[int]]:
    """(the bytes each token id stands for, the special token ids): byte-level BPE spellings are mapped back
    through GPT-2's table, SentencePiece spellings through their space mark and <0xXX> byte tokens. Special
    tokens get b"" (xgrammar never lets a grammar emit them, apart from the stop tokens)."""
    from engine.model.tokenizer import SPM_SPACE, _byte_to_unicode  # noqa: PLC0415 - only when compiling

    backend = tokenizer.backend
    vocab = backend.get_vocab(with_added_tokens=True)
    size = max(max(vocab.values()) + 1, tokenizer.vocab_size)
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    spelled: list[str | None] = [None] * size
    for text, i in vocab.items():
        spelled[i] = text
    byte_fallback = "<0x0A>" in vocab
    from_char = {c: b for b, c in _byte_to_unicode().items()}
    out: list[bytes] = []
    for i, text in enumerate(spelled):
        if text is None or i in special:
            out.append(b"")
        elif byte_fallback:
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                out.append(bytes([int(text[3:5], 16)]))
            else:
                out.append(text.replace(SPM_SPACE, " ").encode())
        elif all(c in from_char for c in text):
            out.append(bytes(from_char[c] for c in text))
        else:  # an added token spelled as plain text
            out.append(text.encode())
    return out, sorted(special)


class GrammarCompiler:
    """Compiles Guides for one tokenizer and vocabulary width (the model's logits may be wider than the
    tokenizer). Thread-safe; the compiled grammars are cached, most recently used kept."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 cache_size: int = CACHE_SIZE) -> None:
        import xgrammar as xgr  # noqa: PLC0415 - only engines that serve constraints load it

        self._xgr = xgr
        encoded, _ = token_bytes(tokenizer)
        self._encoded = encoded[:vocab_size] + [b""] * max(0, vocab_size - len(encoded))
        self._stop_token_ids = list(stop_token_ids)
        self.vocab_size = vocab_size
        self._compiler = self._xgr_compiler(self._encoded)
        self._json_compiler: Any = None  # built on the first JSON constraint
        self._cache: OrderedDict[Guide, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses, for tests and stats

    def _xgr_compiler(self, encoded: list[bytes]) -> Any:
        xgr = self._xgr
        info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                 stop_token_ids=self._stop_token_ids)
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def _for_json(self) -> Any:
        """The compiler for JSON constraints: its vocabulary leaves out tokens with control characters other
        than newline and carriage return. JSON allows none inside strings and only those two and tab between
        tokens, but xgrammar's string rule excludes only the quote, backslash, newline and carriage return."""
        with self._lock:
            if self._json_compiler is None:
                self._json_compiler = self._xgr_compiler(
                    [b"" if any(c < 0x20 and c not in (0x0A, 0x0D) for c in t) else t for t in self._encoded])
            return self._json_compiler

    def compile(self, guide: Guide) -> Any:
        """The compiled grammar of `guide`; GuideError names what is wrong with it."""
        with self._lock:
            hit = self._cache.get(guide)
            if hit is not None:
                self._cache.move_to_end(guide)
                return hit
        compiled = self._compile(guide)  # outside the lock: other schemas' hits need not wait
        with self._lock:
            self.num_compiled += 1
            self._cache[guide] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def cached(self, guide: Guide) -> bool:
        with self._lock:
            return guide in self._cache

    def _compile(self, guide: Guide) -> Any:
        try:
            c = self._for_json() if guide.kind in ("json", "json_object", "structural_tag") else self._compiler
            if guide.kind in ("json", "json_object"):  # numbers and whitespace bounded (json_grammar)
                return c.compile_grammar(json_schema_ebnf(guide.source if guide.kind == "json" else JSON_OBJECT))
            if guide.kind == "regex":
                return c.compile_regex(guide.source)
            if guide.kind == "structural_tag":
                return c.compile_structural_tag(bounded_structural_tag(guide.source))
            if guide.kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(_ebnf_string(x) for x in guide.choices))
            return c.compile_grammar(guide.source)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses with the parser's message
            raise GuideError(f"cannot compile the {guide.kind} constraint: {_first_line(e)}") from None

    def matcher(self, guide: Guide) -> Any:
        return self._xgr.GrammarMatcher(self.compile(guide))


def _first_line(e: Exception) -> str:
    """The parser's message without xgrammar's time stamp and C++ source location."""
    text = str(e).strip() or type(e).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[0])[:300]


class _State:
    __slots__ = ("matcher", "num_tokens", "dead")

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.num_tokens = 0  # output tokens accepted so far
        self.dead = False  # a token outside the grammar was forced in (cannot happen through the mask)


class GuideStates:
    """One matcher per constrained sequence (keyed by seq_id), kept in step with its output tokens."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._states: dict[int, _State] = {}
        self.words = (compiler.vocab_size + 31) // 32

    def drop(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)

    def sync(self, seq_id: int, guide: Guide, output: Sequence[int]) -> _State:
        """The matcher of `seq_id` after exactly `output` (its output tokens so far)."""
        state = self._states.get(seq_id)
        if state is None or state.num_tokens > len(output):
            state = self._states[seq_id] = _State(self.compiler.matcher(guide))
        for token in output[state.num_tokens:]:
            if not state.dead and not state.matcher.is_terminated() and not state.matcher.accept_token(token):
                state.dead = True
            state.num_tokens += 1
        return state

    def _fill(self, state: _State, out: torch.Tensor, row: int) -> None:
        if state.dead or state.matcher.is_terminated():
            out[row].fill_(-1)  # nothing left to enforce: every token allowed
        else:
            state.matcher.fill_next_token_bitmask(out, row)

    def bitmask(self, items: Sequence[tuple[int, Guide, Sequence[int]]]) -> torch.Tensor:
        """int32 [len(items), words]: the allowed tokens of each (seq_id, guide, output tokens), bit t % 32
        of word t // 32."""
        out = torch.full((len(items), self.words), -1, dtype=torch.int32)
        for row, (seq_id, guide, output) in enumerate(items):
            self._fill(self.sync(seq_id, guide, output), out, row)
        return out

    def draft_bitmask(self, seq_id: int, guide: Guide, output: Sequence[int], drafts: Sequence[int]) -> torch.Tensor:
        """int32 [len(drafts) + 1, words]: row j allows what may follow `output` and the first j drafts. Past a
        draft the grammar rejects, rows allow everything: the rejected draft's row already gives it
        probability 0, so verification never reaches them. The matcher is rolled back afterwards."""
        state = self.sync(seq_id, guide, output)
        out = torch.full((len(drafts) + 1, self.words), -1, dtype=torch.int32)
        accepted = 0
        for j in range(len(drafts) + 1):
            self._fill(state, out, j)
            if j == len(drafts) or state.dead or state.matcher.is_terminated() \
                    or not state.matcher.accept_token(drafts[j]):
                break
            accepted += 1
        if accepted:
            state.matcher.rollback(accepted)
        return out


def mask_logits(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of logits [B, V] with the tokens that bitmask [G, W] forbids in `rows` [G] at -inf, by xgrammar's
    own kernel (16 of 32 rows of 49152 tokens, one thread: 1.8 ms against 4.4 ms unpacking the bits in torch)."""
    import xgrammar as xgr  # noqa: PLC0415 - loaded already: a bitmask comes from it

    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32, device=logits.device)
    full[rows] = bitmask.to(logits.device)
    out = logits.clone()
    xgr.apply_token_bitmask_inplace(out, full, indices=rows.tolist(), vocab_size=logits.shape[-1])
    return out


def source_compiler(source: Any) -> GrammarCompiler:
    """compiler_for a ModelSource, with the stop ids the engine's scheduler uses."""
    tokenizer, config = source.tokenizer, source.config
    return compiler_for(tokenizer, config.vocab_size, tokenizer.eos_token_ids or config.eos_token_ids)


_COMPILERS: dict[tuple[int, int, tuple[int, ...]], tuple[Any, GrammarCompiler]] = {}
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> GrammarCompiler:
    """The process's one GrammarCompiler (and so one cache) for a tokenizer, vocabulary width and stop ids:
    the thread that compiles a request's constraint and the engine step that applies it share grammars."""
    key = (id(tokenizer), vocab_size, tuple(stop_token_ids))
    with _COMPILERS_LOCK:
        entry = _COMPILERS.get(key)
        if entry is None:  # the tokenizer is kept with its compiler, so its id cannot be reused meanwhile
            entry = _COMPILERS[key] = (tokenizer, GrammarCompiler(tokenizer, vocab_size, stop_token_ids))
        return entry[1]
