"""The README's code blocks, run as written: the shell and `openai` blocks against a real server on the default
model (its address put where the README says 127.0.0.1:8000), the embedded ones in a fresh interpreter."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.server_utils import REPO, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
README_ADDRESS = "127.0.0.1:8000"


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", (REPO / "README.md").read_text(), re.MULTILINE | re.DOTALL)


def test_the_readme_has_the_blocks_these_tests_run():
    assert len(blocks("bash")) == 1 and len(blocks("python")) == 3
    assert all(README_ADDRESS in block for block in blocks("bash") + blocks("python")[:1])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = start_server(tmp_path_factory.mktemp("readme") / "server.log", "--in-process", timeout=300)
    yield proc
    assert proc.stop() == 0, proc.log()


def run(command: list[str], block: str, address: str = README_ADDRESS) -> str:
    done = subprocess.run([*command, block.replace(README_ADDRESS, address)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_curl_block_gets_a_chat_completion(server):
    reply = json.loads(run(["bash", "-c"], blocks("bash")[0], server.url.removeprefix("http://")))
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"]


def test_the_openai_block_prints_the_city_from_schema_valid_json(server):
    assert run([sys.executable, "-c"], blocks("python")[0], server.url.removeprefix("http://")).strip() == "Paris"


def test_the_embedded_block_answers_the_question():
    assert "Paris" in run([sys.executable, "-c"], blocks("python")[1])


def test_the_streaming_block_prints_a_continuation():
    out = run([sys.executable, "-c"], blocks("python")[2])
    assert out.endswith("\n") and len(out.split()) >= 5  # 32 tokens of text, then the closing newline
