"""The conversation behind `cli.py chat`: what each typed line does to the message history.

Pure logic (no engine, no terminal), so the CLI loop stays a few lines and the commands are testable.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

HELP = "/system TEXT sets the system message and starts over, /reset starts over, /exit (or Ctrl-D) leaves"


class Action(enum.Enum):
    REPLY = "reply"  # send the history to the model and append its reply
    SAY = "say"  # show `Step.text` to the user; nothing goes to the model
    SKIP = "skip"  # an empty line: nothing happens
    EXIT = "exit"


@dataclass(frozen=True)
class Step:
    action: Action
    text: str = ""


@dataclass
class ChatSession:
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def handle(self, line: str) -> Step:
        """What one typed line means; a user message is appended to the history before REPLY."""
        line = line.strip()
        if not line:
            return Step(Action.SKIP)
        if not line.startswith("/"):
            self.messages.append({"role": "user", "content": line})
            return Step(Action.REPLY)
        command, _, rest = line.partition(" ")
        return self._command(command, rest.strip())

    def _command(self, command: str, rest: str) -> Step:
        if command in ("/exit", "/quit"):
            return Step(Action.EXIT)
        if command == "/reset":
            self.reset()
            return Step(Action.SAY, "(conversation cleared)")
        if command == "/system":
            self.system = rest or None
            self.reset()
            return Step(Action.SAY, f"(system message {'set' if rest else 'removed'}; conversation cleared)")
        if command == "/help":
            return Step(Action.SAY, HELP)
        return Step(Action.SAY, f"unknown command {command}; {HELP}")

    def replied(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})
