"""`cli.py chat`: what each typed line does (ChatSession), and the real command driven through its stdin."""
from __future__ import annotations

import subprocess
import sys

import pytest

from client.chat_session import Action, ChatSession
from tests.server_utils import REPO


@pytest.mark.unit
def test_a_user_line_joins_the_history_after_the_system_message():
    session = ChatSession("be brief")
    assert session.handle("  hello  ").action is Action.REPLY
    session.replied("hi!")
    assert session.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                                {"role": "assistant", "content": "hi!"}]


@pytest.mark.unit
def test_empty_lines_never_reach_the_model():
    session = ChatSession()
    assert [session.handle(line).action for line in ("", "   ", "\t")] == [Action.SKIP] * 3
    assert session.messages == []


@pytest.mark.unit
def test_reset_keeps_the_system_message_and_system_replaces_it():
    session = ChatSession("one")
    session.handle("hello")
    session.replied("hi")
    assert session.handle("/reset").action is Action.SAY
    assert session.messages == [{"role": "system", "content": "one"}]
    session.handle("/system two words")
    assert session.messages == [{"role": "system", "content": "two words"}]
    session.handle("/system")
    assert session.messages == [] and session.system is None


@pytest.mark.unit
@pytest.mark.parametrize("line", ["/exit", "/quit", "  /exit  "])
def test_exit_commands_end_the_chat(line):
    assert ChatSession().handle(line).action is Action.EXIT


@pytest.mark.unit
def test_an_unknown_command_is_explained_not_sent():
    session = ChatSession()
    step = session.handle("/frobnicate now")
    assert step.action is Action.SAY and "/frobnicate" in step.text and "/exit" in step.text
    assert session.messages == []


@pytest.mark.process
def test_the_chat_command_greets_skips_blank_lines_and_leaves_on_exit(tiny_model_dir):
    script = "hello there\n\n/system answer in one word\nand now?\n/reset\n/exit\nnever read\n"
    done = subprocess.run([sys.executable, "cli.py", "chat", "--model", str(tiny_model_dir), "--dtype", "float32",
                           "--max-tokens", "4", "--temperature", "0", "--system", "be brief"],
                          cwd=REPO, input=script, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "/exit" in done.stderr and "/system TEXT" in done.stderr  # the banner says how to leave
    assert "(system message set; conversation cleared)" in done.stderr
    assert "(conversation cleared)" in done.stderr
    replies = [part for part in done.stdout.split("> ") if part.strip()]
    assert len(replies) == 2  # two user lines were sent; the blank one and the commands were not
