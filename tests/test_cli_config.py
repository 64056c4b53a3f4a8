"""`serve --config FILE.yaml` (flags from a file, command-line flags winning), `serve MODEL`, and the shell
completion scripts of `cli.py completion bash|zsh`, driven through real shells."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cli
from commands.completion import commands
from engine.flags import ConfigFileError, config_file_argv
from tests.server_utils import TINY_ENGINE_FLAGS, start_server

REPO = Path(__file__).resolve().parent.parent


def _serve_args(tmp_path: Path, text: str, *argv: str):
    (tmp_path / "serve.yaml").write_text(text)
    return cli.parse_args(cli.build_parser(), ["serve", "--config", str(tmp_path / "serve.yaml"), *argv])


def _refused(tmp_path: Path, text: str, capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        _serve_args(tmp_path, text, *argv)
    assert exited.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


# ---------------------------------------------------------------- the config file


@pytest.mark.unit
def test_file_keys_set_flags_with_dashes_or_underscores(tmp_path):
    args = _serve_args(tmp_path, "model: /models/m.gguf\nmax_num_seqs: 7\nkv-cache-memory: 2GiB\n"
                                 "enable_prefix_caching: false\ndevices: [cuda:0, cuda:1]\nport: 8123\n"
                                 "stream-interval: auto\nlong_prompt_threshold: 300\n")
    assert (args.model, args.max_num_seqs, args.kv_cache_memory) == ("/models/m.gguf", 7, 2 << 30)
    assert args.enable_prefix_caching is False and args.devices == ("cuda:0", "cuda:1")
    assert (args.port, args.stream_interval, args.long_prompt_threshold) == (8123, "auto", 300)


@pytest.mark.unit
def test_command_line_flags_win_over_the_file(tmp_path):
    args = _serve_args(tmp_path, "max_num_seqs: 7\nport: 8123\nenable-chunked-prefill: false\nmodel: /from/file\n",
                       "--port", "9000", "--enable-chunked-prefill", "/from/command/line")
    assert (args.max_num_seqs, args.port, args.enable_chunked_prefill) == (7, 9000, True)
    assert args.model == "/from/command/line"
    assert _serve_args(tmp_path, "model: /from/file\n", "--model", "/flag").model == "/flag"


@pytest.mark.unit
def test_file_and_flags_build_the_same_settings(tmp_path):
    from commands.args import engine_options
    from server.args import actor_options, server_settings

    from_file = _serve_args(tmp_path, "max-num-seqs: 5\nhost: 0.0.0.0\ndecode_actors: 2\napi_key: null\n")
    from_flags = cli.parse_args(cli.build_parser(), ["serve", "--max-num-seqs", "5", "--host", "0.0.0.0",
                                                     "--decode-actors", "2"])
    for build in (engine_options, actor_options, server_settings):
        assert build(from_file) == build(from_flags)


@pytest.mark.unit
@pytest.mark.parametrize("text, words", [
    ("max_num_seq: 3\n", "has the unknown key 'max_num_seq'; the closest flag is --max-num-seqs"),
    ("prot: 80\n", "has the unknown key 'prot'; the closest flag is --port"),
    ("config: other.yaml\n", "unknown key 'config'"),
    ("no-enable-prefix-caching: true\n", "unknown key 'no-enable-prefix-caching'; the closest flag is "
                                          "--enable-prefix-caching"),
    ("- port\n", "holds a list; expected a mapping of flag names to values"),
    ("port: [1\n", "is not valid YAML"),
    ("enable_prefix_caching: 1\n", "sets enable-prefix-caching to 1; expected true or false"),
])
def test_file_mistakes_are_named(tmp_path, capsys, text, words):
    assert words in _refused(tmp_path, text, capsys)


@pytest.mark.unit
@pytest.mark.parametrize("key, value, flag_value", [
    ("port", "abc", "abc"), ("dtype", "float8", "float8"), ("kv-cache-memory", "lots", "lots"),
    ("max_num_seqs", "2.5", "2.5"),
])
def test_a_bad_file_value_gets_the_flag_s_own_error(tmp_path, capsys, key, value, flag_value):
    from_file = _refused(tmp_path, f"{key}: {value}\n", capsys)
    with pytest.raises(SystemExit):
        cli.parse_args(cli.build_parser(), ["serve", f"--{key.replace('_', '-')}", flag_value])
    from_flag = capsys.readouterr().err.splitlines()[-1]
    assert from_file == from_flag.replace("error: ", f"error: in the config file {tmp_path / 'serve.yaml'}: ")


@pytest.mark.unit
def test_a_missing_or_empty_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(cli.build_parser(), ["serve", "--config", str(tmp_path / "absent.yaml")])
    assert "cannot read the config file" in capsys.readouterr().err
    assert _serve_args(tmp_path, "# nothing set\n").port == 8000


@pytest.mark.unit
def test_config_file_argv_words_keep_values_that_start_with_a_dash(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--switch", action=argparse.BooleanOptionalAction)
    (tmp_path / "f.yaml").write_text("top_k: -1\nswitch: false\n")
    words = config_file_argv(parser, str(tmp_path / "f.yaml"))
    assert words == ["--top-k=-1", "--no-switch"]
    assert parser.parse_args(words).top_k == -1
    (tmp_path / "f.yaml").write_text("top_k: {a: 1}\n")
    with pytest.raises(ConfigFileError, match="to a mapping"):
        config_file_argv(parser, str(tmp_path / "f.yaml"))


@pytest.mark.unit
def test_two_different_models_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(cli.build_parser(), ["serve", "/a", "--model", "/b"])
    assert "the model is given twice, as '/a' and as --model '/b'" in capsys.readouterr().err
    assert cli.parse_args(cli.build_parser(), ["serve", "/a", "--model", "/a"]).model == "/a"
    assert cli.parse_args(cli.build_parser(), ["serve"]).model is None


def test_serve_runs_from_a_config_file_and_a_positional_model(tmp_path, tiny_model_dir):
    (tmp_path / "serve.yaml").write_text("in_process: true\nserved-model-name: from-the-file\nmax_model_len: 64\n"
                                         "dtype: float32\nthreads: 1\nnum_kv_blocks: 256\nblock-size: 8\n")
    server = start_server(tmp_path / "serve.log", "--config", str(tmp_path / "serve.yaml"), str(tiny_model_dir),
                          "--max-model-len", "96")
    try:
        (model,) = server.get("/v1/models").json()["data"]
        assert (model["id"], model["max_model_len"]) == ("from-the-file", 96)
        reply = server.post("/v1/completions", {"model": "from-the-file", "prompt": "hi", "max_tokens": 3})
        assert reply.status == 200 and reply.json()["usage"]["completion_tokens"] == 3
    finally:
        assert server.stop() == 0


# ---------------------------------------------------------------- shell completion


def _script(shell: str) -> str:
    done = subprocess.run([sys.executable, "cli.py", "completion", shell], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("completion") / "cli.bash"
    path.write_text(_script("bash"))
    return path


def _bash_complete(script: Path, line: str, cwd: Path = REPO, before: str = "") -> list[str]:
    """COMPREPLY for the command line `line` (its last word is the one completed), from the sourced script."""
    code = (f"{before}\nsource {script}\nCOMP_WORDS=({line}); [[ '{line}' == *' ' ]] && COMP_WORDS+=('')\n"
            "COMP_CWORD=$((${#COMP_WORDS[@]} - 1))\n"
            "spec=$(complete -p \"${COMP_WORDS[0]##*/}\"); fn=${spec#*-F }; fn=${fn%% *}\n"
            "\"$fn\" \"${COMP_WORDS[0]}\" \"${COMP_WORDS[COMP_CWORD]}\" \"${COMP_WORDS[COMP_CWORD-1]}\"\n"
            "printf '%s\\n' \"${COMPREPLY[@]}\"\n")
    done = subprocess.run(["bash", "--norc", "--noprofile", "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return [w for w in done.stdout.splitlines() if w]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("line, expected", [
    ("python cli.py ", ["generate", "chat", "serve", "worker", "completion", "-h", "--help", "--version"]),
    ("python cli.py se", ["serve"]),
    ("python3 cli.py serve --max-num-s", ["--max-num-seqs"]),
    ("cli.py serve --no-enable-p", ["--no-enable-prefix-caching"]),
    ("python cli.py serve --dtype ", ["auto", "bfloat16", "float16", "float32"]),
    ("python cli.py generate --speculative ", ["off", "ngram", "draft"]),
    ("python cli.py worker --role ", ["decode", "prefill"]),
    ("python cli.py completion ", ["bash", "zsh"]),
    ("python cli.py serve --port ", []),
    ("python cli.py chat --sys", ["--system"]),
])
def test_bash_completes_commands_flags_and_choices(bash_script, line, expected):
    assert _bash_complete(bash_script, line) == expected


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completes_file_names_for_path_flags_and_the_model(bash_script, tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"")
    (tmp_path / "serve.yaml").write_text("")
    assert _bash_complete(bash_script, "python cli.py serve --model mo", cwd=tmp_path) == ["model.gguf"]
    assert _bash_complete(bash_script, "python cli.py serve --config se", cwd=tmp_path) == ["serve.yaml"]
    assert _bash_complete(bash_script, "python cli.py serve mo", cwd=tmp_path) == ["model.gguf"]
    assert _bash_complete(bash_script, "python cli.py generate --draft-model mo", cwd=tmp_path) == ["model.gguf"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_leaves_other_python_command_lines_to_their_completion(bash_script):
    before = "_earlier() { COMPREPLY=(from-the-earlier-completion); }; complete -F _earlier python"
    assert _bash_complete(bash_script, "python other.py --x", before=before) == ["from-the-earlier-completion"]
    assert _bash_complete(bash_script, "python cli.py se", before=before) == ["serve"]


@pytest.mark.unit
def test_every_flag_of_every_command_is_in_the_bash_script():
    from commands.completion import completion_script

    parser = cli.build_parser()
    text = completion_script(parser, "bash")
    for name in ("generate", "chat", "serve", "worker", "completion"):
        case = text.split(f"        {name})\n", 1)[1]
        listed = case.split("\n", 1)[0].strip().removeprefix('flags="').removesuffix('"').split()
        expected = [flag for action in cli._subparser(parser, name)._actions for flag in action.option_strings]
        assert listed == expected and "--help" in listed, name


ZSH_STUBS = """
_arguments() { print -r -- "ARGUMENTS ${words[1]} $CURRENT"; print -rl -- "$@"; }
_describe() { local name=$4; print -r -- "DESCRIBE"; print -rl -- ${(P)name}; }
compadd() { print -r -- "COMPADD $*"; }
_python() { print -r -- "PYTHON"; }
"""


def _zsh_complete(script: Path, *words: str) -> list[str]:
    quoted = " ".join("'" + w + "'" for w in words)
    code = f"{ZSH_STUBS}\nsource {script}\nwords=({quoted}); CURRENT={len(words)}\n_phase_serve_cli\n"
    done = subprocess.run(["zsh", "-f", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.skipif(shutil.which("zsh") is None, reason="needs zsh")
def test_zsh_script_dispatches_to_each_command_s_arguments(tmp_path):
    script = tmp_path / "cli.zsh"
    script.write_text(_script("zsh"))
    assert subprocess.run(["zsh", "-n", str(script)], capture_output=True, timeout=60).returncode == 0
    first = _zsh_complete(script, "python", "cli.py", "")
    assert first[0] == "DESCRIBE" and "serve:OpenAI-compatible HTTP server" in first
    assert "COMPADD -- -h --help --version" in first
    serve = _zsh_complete(script, "python", "cli.py", "serve", "--po")
    assert serve[0] == "ARGUMENTS serve 2"  # the words shifted so that _arguments sees `serve --po`
    assert "--port[port to listen on (0\\: any free port; the start-up line says which)]:port: " in serve
    assert "--dtype[weights and KV dtype\\: bfloat16 on CPU, fp16/bf16 on GPU]:dtype:(auto bfloat16 float16 " \
           "float32)" in serve
    assert {"(--enable-prefix-caching --no-enable-prefix-caching)--enable-prefix-caching[reuse KV blocks of "
            "identical prompt prefixes]", "1:model:_files"} <= set(serve)
    assert "--model[Hugging Face folder or .gguf file (or a hub id already in the local Hugging Face cache)]" \
           ":path:_files" in serve
    assert _zsh_complete(script, "python", "other.py", "") == ["PYTHON"]
    assert _zsh_complete(script, "cli.py", "completion", "")[-1] == "1:shell:(bash zsh)"
