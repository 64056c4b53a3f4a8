"""Source hygiene: the kernel sources stay mostly code, and no source file narrates its own history.

Comment share (test_kernel_comment_share): in each kernel directory (engine/kernels/, and engine/backends/ where
it exists, each searched recursively and taken as a whole), comment lines are at most 20% of all lines of its
*.py, *.cpp and *.h files. A comment line holds nothing but comment: in C++ a line that starts with // or lies
in a /* */ block; in Python a line that starts with #, or any line of a module, class or function docstring.
A line of code with a trailing comment counts as code; blank lines count as lines.

Measurement logs (test_kernel_comments_carry_no_figures): no comment in those directories quotes a timing,
bandwidth, FLOP rate or speed-up; such figures belong in docs/performance.md under the bench that reproduces
them. The one exception is the line that says why a hand kernel is kept: a comment of at most
MAX_WHY_KEPT_LINES lines that names its `python -m bench.` command may quote the gain it measured.

History (test_no_history_narration): no comment or docstring of a source file (*.py, *.cpp, *.h anywhere in the
repository except hidden directories such as .venv, docs/ and build outputs) matches HISTORY_PATTERNS: numbered
work sessions or rounds of work, earlier hosts, "was N ms" and before -> after timings.

Only the standard library is imported: this reads files, it runs nothing.
"""
from __future__ import annotations

import ast
import bisect
import io
import os
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
KERNEL_DIRS = ("engine/kernels", "engine/backends")
SOURCE_SUFFIXES = (".py", ".cpp", ".h")
SKIPPED_DIRS = frozenset({"docs", "build", "dist", "__pycache__", "node_modules"})
MAX_COMMENT_SHARE = 0.20
MAX_WHY_KEPT_LINES = 3

_UNIT = r"(?:ms|s|us|µs|ns|tok/s|tokens/s|GB/s|MB/s|GFLOPS|TFLOPS)"
HISTORY_PATTERNS = tuple(re.compile(p, re.IGNORECASE) for p in (
    r"\bsessions? \d+",
    r"\b(?:round|session|pass) \d+ of (?:work|the work|this)\b",
    r"\b(?:earlier|previous|past|later) (?:sessions|rounds of work)\b",
    r"\bthe (?:intel|amd|amx|zen ?\d*|epyc|sapphire rapids) (?:host|vm|machine|box|one)\b",
    r"\bthe (?:other|previous|old|new|first|second) (?:host|vm|machine|box)\b",
    r"\bthis \d+-core (?:host|vm|machine)\b",
    r"\b(?:was|were) \d[\d.]* ?" + _UNIT + r"(?![\w/])",
    r"\b\d[\d.]* ?" + _UNIT + r"? ?-> ?\d[\d.]* ?" + _UNIT + r"(?![\w/])",
    r"\bwhat \w+ used to\b",
    r"\bbefore this (?:change|commit|session|round)\b",
))
# A Python comment (group 1), or a string literal, so that a # inside a string is not taken for a comment: the
# comments tokenize finds (test_comments_are_the_tokenizers), in a tenth of its time.
PY_COMMENT_OR_STRING = re.compile(r'''(#[^\n]*)|"""(?:\\.|[^\\])*?"""|\'\'\'(?:\\.|[^\\])*?\'\'\''''
                                  r'''|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*\'''', re.DOTALL)
FIGURE_PATTERNS = tuple(re.compile(p, re.IGNORECASE) for p in (
    r"\b\d[\d.]* ?(?:ms|us|µs|GB/s|MB/s|GFLOPS|TFLOPS|tok/s|tokens/s)(?![\w/])",
    r"\b\d+\.\d+x\b",
))


@dataclass(frozen=True)
class Comment:
    """One run of consecutive comment lines, markers stripped and joined by spaces; `starts` holds, for each
    line of the run, (offset of its text in `text`, its 1-based line number)."""
    path: Path
    starts: tuple[tuple[int, int], ...]
    text: str

    def line_at(self, offset: int) -> int:
        return max(line for start, line in self.starts if start <= offset)


def _statements(tree: ast.AST):
    """Every statement of the tree (and the module, handlers and match cases that hold statements), without the
    expressions inside them: the only places a docstring's owner can stand."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            stack.extend(getattr(node, field, ()))


def _docstring_nodes(tree: ast.AST) -> list[ast.Constant]:
    owners = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = []
    for node in _statements(tree):
        if isinstance(node, owners) and node.body and isinstance(node.body[0], ast.Expr):
            value = node.body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.append(value)
    return found


def python_comment_lines(text: str) -> dict[int, str]:
    """1-based line -> its comment text, for # comments (whole-line or trailing) and docstring lines."""
    lines = text.splitlines()
    line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
    out: dict[int, str] = {}
    for match in PY_COMMENT_OR_STRING.finditer(text):
        if match.group(1) is not None:
            out[bisect.bisect_right(line_starts, match.start())] = match.group(1).lstrip("#").strip()
    for node in _docstring_nodes(ast.parse(text)):
        for number in range(node.lineno, node.end_lineno + 1):
            out[number] = lines[number - 1].strip().strip('"').strip("'").strip()
    return out


def python_whole_comment_lines(text: str) -> set[int]:
    """Lines that hold only comment: # lines and docstring lines (the comment-share rule)."""
    lines = text.splitlines()
    hashed = {n for n in range(1, len(lines) + 1) if lines[n - 1].lstrip().startswith("#")}
    return hashed | {n for node in _docstring_nodes(ast.parse(text))
                     for n in range(node.lineno, node.end_lineno + 1)}


def cpp_comment_lines(text: str) -> tuple[dict[int, str], set[int]]:
    """(1-based line -> its comment text, for // and /* */ comments; the lines that hold only comment)."""
    texts: dict[int, str] = {}
    whole: set[int] = set()
    in_block = False
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if in_block:
            whole.add(number)
            texts[number] = stripped.split("*/")[0].lstrip("*").strip()
            in_block = "*/" not in stripped
        elif stripped.startswith("/*"):
            whole.add(number)
            texts[number] = stripped[2:].split("*/")[0].strip()
            in_block = "*/" not in stripped[2:]
        elif "//" in line:
            code, _, comment = line.partition("//")
            if not code.strip():
                whole.add(number)
            texts[number] = comment.lstrip("/").strip()
    return texts, whole


def comment_lines(path: Path) -> dict[int, str]:
    text = path.read_text(encoding="utf-8")
    return python_comment_lines(text) if path.suffix == ".py" else cpp_comment_lines(text)[0]


def whole_comment_count(path: Path) -> tuple[int, int]:
    """(lines that hold only comment, all lines) of one source file."""
    text = path.read_text(encoding="utf-8")
    whole = python_whole_comment_lines(text) if path.suffix == ".py" else cpp_comment_lines(text)[1]
    return len(whole), len(text.splitlines())


def comment_runs(path: Path) -> list[Comment]:
    """Consecutive comment lines joined, so that a phrase broken over two lines is still one phrase."""
    runs: list[Comment] = []
    previous = -1
    for number, text in sorted(comment_lines(path).items()):
        if runs and number == previous + 1:
            last = runs[-1]
            runs[-1] = Comment(path, last.starts + ((len(last.text) + 1, number),), f"{last.text} {text}")
        else:
            runs.append(Comment(path, ((0, number),), text))
        previous = number
    return runs


def _skipped(directory: str) -> bool:
    return directory.startswith(".") or directory in SKIPPED_DIRS or directory.endswith(".egg-info")


def source_files(top: Path) -> list[Path]:
    """*.py, *.cpp and *.h under `top`, pruning hidden directories (.git, .venv), docs/ and build outputs."""
    found = []
    for directory, subdirs, names in os.walk(top):
        subdirs[:] = sorted(d for d in subdirs if not _skipped(d))
        found += [Path(directory) / n for n in sorted(names) if n.endswith(SOURCE_SUFFIXES)]
    return found


def kernel_dirs() -> list[Path]:
    return [ROOT / d for d in KERNEL_DIRS if (ROOT / d).is_dir()]


def matches(runs: list[Comment], patterns: tuple[re.Pattern, ...]) -> list[str]:
    hits = []
    for run in runs:
        for pattern in patterns:
            for match in pattern.finditer(run.text):
                hits.append(f"{run.path.relative_to(ROOT)}:{run.line_at(match.start())}: {match.group(0)!r} in "
                            f"{run.text[max(0, match.start() - 60):match.end() + 60]!r}")
    return hits


def test_kernel_sources_are_found():
    files = [f for d in kernel_dirs() for f in source_files(d)]
    cpp = [f for f in files if f.suffix in (".cpp", ".h")]
    assert len(cpp) >= 3, f"expected the C++ kernel sources under {KERNEL_DIRS}, found {cpp}"
    assert sum(whole_comment_count(f)[1] for f in cpp) >= 1000


def comment_share_failure(top: Path) -> str | None:
    """None when `top`'s sources keep within MAX_COMMENT_SHARE, else the totals and a per-file breakdown."""
    counts = {f.relative_to(ROOT): whole_comment_count(f) for f in source_files(top)}
    comments, lines = sum(c for c, _ in counts.values()), sum(n for _, n in counts.values())
    if comments <= MAX_COMMENT_SHARE * lines:
        return None
    worst_first = sorted(counts.items(), key=lambda kv: -kv[1][0] / max(kv[1][1], 1))
    per_file = "\n".join(f"  {path}: {c} of {n} lines ({c / max(n, 1):.0%})" for path, (c, n) in worst_first)
    return (f"{top.relative_to(ROOT)}: {comments} comment lines of {lines} ({comments / lines:.1%}), over "
            f"{MAX_COMMENT_SHARE:.0%}; per file:\n{per_file}")


def test_kernel_comment_share():
    dirs = kernel_dirs()
    assert dirs, f"none of {KERNEL_DIRS} exists"
    failures = [f for f in map(comment_share_failure, dirs) if f]
    assert not failures, "\n".join(failures)


def why_kept(run: Comment) -> bool:
    """A short comment that names the bench behind its figures: the one line beside a kept hand kernel."""
    return len(run.starts) <= MAX_WHY_KEPT_LINES and "python -m bench." in run.text


def test_kernel_comments_carry_no_figures():
    runs = [r for d in kernel_dirs() for f in source_files(d) for r in comment_runs(f)]
    assert runs, "no comments found under the kernel directories"
    hits = matches([r for r in runs if not why_kept(r)], FIGURE_PATTERNS)
    assert not hits, ("measured figures in kernel comments (move them to docs/performance.md, under the bench "
                      "that reproduces them):\n" + "\n".join(hits))


def test_no_history_narration():
    files = source_files(ROOT)
    assert len(files) > 100 and ROOT / "engine/kernels/kv_quant.py" in files, "the source walk found too little"
    hits = matches([r for f in files for r in comment_runs(f)], HISTORY_PATTERNS)
    assert not hits, "comments that narrate history (what changed belongs in commit bodies, figures in " \
                     "docs/performance.md):\n" + "\n".join(hits)


@pytest.mark.parametrize("text", [
    "measured in session 12 on two cores", "on the Intel host it ran slower", "the AMX host",
    "the step was 12.5 ms", "encode 125 -> 45 ms", "what prefill used to run", "round 3 of work",
    "this 2-core VM often lags", "on the Zen 5 one",
])
def test_history_patterns_catch(text):
    assert any(p.search(text) for p in HISTORY_PATTERNS)


@pytest.mark.parametrize("text", [
    "medians of 4 rounds", "a decode actor on another host", "576 -> 3072 columns", "the session's sequences",
    "it was preempted", "rounded to bf16",
])
def test_history_patterns_spare(text):
    assert not any(p.search(text) for p in HISTORY_PATTERNS)


def test_figure_patterns():
    assert all(any(p.search(t) for p in FIGURE_PATTERNS) for t in ("20.6 vs 24.8 ms", "12 GB/s", "1.19x faster"))
    assert not any(p.search(t) for p in FIGURE_PATTERNS for t in ("16x16 tiles", "1 KiB of loads", "2 threads"))


def test_only_a_short_comment_naming_its_bench_may_quote_a_gain():
    run = lambda lines, text: Comment(Path("k.py"), tuple((0, n) for n in range(1, lines + 1)), text)  # noqa: E731
    assert why_kept(run(2, "kept: 1.47x the Python loop at batch 8 (python -m bench.cpu_kernels)"))
    assert not why_kept(run(2, "kept: 1.47x the Python loop at batch 8"))
    assert not why_kept(run(MAX_WHY_KEPT_LINES + 1, "a table of timings ... python -m bench.cpu_kernels"))


def test_comment_counting():
    cpp = "int a;  // trailing\n// whole\n/* one\n   two */\nint b;\n"
    texts, whole = cpp_comment_lines(cpp)
    assert whole == {2, 3, 4} and texts[1] == "trailing"
    py = '"""Doc\nmore."""\nx = 1  # trailing\n# whole\n\ndef f():\n    """One."""\n    return 1\n'
    assert python_whole_comment_lines(py) == {1, 2, 4, 7}
    assert python_comment_lines(py)[3] == "trailing"


def tokenizer_comments(source: str) -> dict[int, str]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0]: t.string.lstrip("#").strip() for t in tokens if t.type == tokenize.COMMENT}


@pytest.mark.parametrize("source", [
    'x = "# no"  # one\n',
    "s = '''\n# no\n'''  # two\n",
    'r = r"\\d\\"#"  # three\n',
    "t = f\"{a!r}\" 'it\\'s # no'  # four\n",
    'y = """a "quoted" # no\n"""\n# five\n',
    "z = '\\\\'  # six\n",
])
def test_comments_are_the_tokenizers(source):
    """The scanner against tokenize, on what could fool it: a # inside strings of each quoting, escapes."""
    expected = tokenizer_comments(source)
    assert expected and python_comment_lines(source) == expected
