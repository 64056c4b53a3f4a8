"""`serve --config FILE.yaml` (flags from a file, command-line flags winning) and `serve MODEL`."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cli
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
    from engine.args import engine_options
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
