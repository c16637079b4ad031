"""Shell commands as a reader takes them from a markdown page, and a program run under a
terminal: what tests/e2e/test_getting_started_run.py follows docs/getting-started.md with."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Block:
    step: str  # the `## N. ...` heading it is under
    lang: str
    text: str


@dataclass
class Command:
    step: str
    line: str  # continuation lines joined, the comment taken off
    comment: str


def page_blocks(text: str) -> list[Block]:
    blocks: list[Block] = []
    step = ""
    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith("## "):
            step = line[3:].strip()
            continue
        fence = re.match(r"\s*```(\w*)\s*$", line)
        if not fence:
            continue
        indent = len(line) - len(line.lstrip())
        body = []
        for inner in lines:
            if inner.strip() == "```":
                break
            body.append(inner[indent:])
        blocks.append(Block(step, fence.group(1), "\n".join(body)))
    return blocks


def split_comment(line: str) -> tuple[str, str]:
    """`cmd  # comment` -> (cmd, comment); a `#` inside quotes or `$(...)` is part of the command."""
    quote = ""
    depth = 0
    # A placeholder's apostrophe (`<a watcher's address>`) opens no quote.
    masked = re.sub(r"<[^<>]+>", lambda m: "x" * len(m.group(0)), line)
    for i, ch in enumerate(masked):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "#" and depth == 0 and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i + 1 :].strip()
    return line.rstrip(), ""


def shell_commands(block: Block) -> list[Command]:
    commands = []
    pending = ""
    for raw in block.text.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line, comment = split_comment(pending + raw)
        pending = ""
        if line:
            commands.append(Command(block.step, line, comment))
    return commands


def run_in_terminal(
    argv: list[str], answer: str, *, cwd: Path, env: Mapping[str, str], timeout: float = 120.0
) -> tuple[int, str]:
    """`argv` with a terminal, as a reader runs it, answering its question with `answer`."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower, cwd=cwd, env=dict(env))
    os.close(follower)
    output = b""
    answered = False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the program ended and closed its terminal
                break
            if not chunk:
                break
            output += chunk
            if not answered and b"?" in output.split(b"\n")[-1]:
                os.write(leader, answer.encode() + b"\n")
                answered = True
        elif proc.poll() is not None:
            break
    os.close(leader)
    return proc.wait(timeout=30), output.decode(errors="replace").replace("\r\n", "\n")
