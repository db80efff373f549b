"""What the fake agent CLIs of this folder share (tests put the folder first on PATH).

Each fake (``claude``, ``codex``, ``gemini``, ``aider``) replays the output shapes its real
CLI prints, recorded from the CLI's documentation and source (see the comment at the top of
each fake). The prompt chooses the shape with one word ``fake:<scenario>``; lines of the
prompt add detail:

    fake-text: TEXT       the message of a ``limit`` scenario (a form of docs/agent-clis.md)
    fake-write: PATH TEXT write TEXT to PATH in the working directory (an agent's edit)
    fake-sleep: SECONDS   wait before finishing
    fake-exit: N          the exit status of a ``plain`` scenario

``fake:recorded-<name>`` replays what the real CLI printed, as tests/fakes/record.py recorded it
against tests/modelstub.py (``recorded/<cli>-<name>.json``: stdout, stderr and exit status; each
file names the CLI's version): ``fake:recorded-403`` to the fake ``claude`` prints
``recorded/claude-403.json``, ``fake:recorded-oauth-spend`` prints ``recorded/claude-oauth-spend.json``.

Every call is recorded (argv, stdin, cwd, the OUTPOST_* environment) as one JSON line in
``$FAKE_CLI_LOG/<name>.jsonl`` when that variable names a directory. Sessions are kept like
Claude Code keeps them, per working directory, in the CLI's own state folder
(``$HOME/.<name>/fake-sessions/``, where the real CLI keeps its own): a resume from another
directory does not find the session.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import NoReturn

BIG_OUTPUT_BYTES = 3 * 1024 * 1024
#: What the real CLIs printed (tests/fakes/record.py).
RECORDED = Path(__file__).resolve().parent / "recorded"


class Call:
    """One invocation of a fake: its argv, the prompt it was given, what it should do."""

    def __init__(self, name: str, prompt: str | None = None):
        self.name = name
        self.argv = sys.argv[1:]
        self.stdin = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read()
        self.prompt = self.stdin if prompt is None else prompt
        self.cwd = os.getcwd()
        match = re.search(r"\bfake:([a-z0-9-]+)", self.prompt)
        self.scenario = match[1] if match else "success"
        self.text = self.line("fake-text") or ""
        self.record()
        if self.scenario.startswith("recorded-"):
            replay(name, self.scenario.removeprefix("recorded-"))

    def line(self, key: str) -> str | None:
        match = re.search(rf"^{re.escape(key)}:[ \t]*(.*)$", self.prompt, re.MULTILINE)
        return match[1].strip() if match else None

    def option(self, *names: str) -> str | None:
        """The value of the first of ``names`` given (``--x v`` or ``--x=v``)."""
        for i, arg in enumerate(self.argv):
            for name in names:
                if arg == name and i + 1 < len(self.argv):
                    return self.argv[i + 1]
                if arg.startswith(name + "="):
                    return arg[len(name) + 1:]
        return None

    def has(self, flag: str) -> bool:
        return flag in self.argv

    def record(self) -> None:
        folder = os.environ.get("FAKE_CLI_LOG")
        if not folder:
            return
        env = {k: v for k, v in os.environ.items() if k.startswith("OUTPOST_")}
        with open(Path(folder) / f"{self.name}.jsonl", "a") as f:
            f.write(json.dumps({"argv": self.argv, "stdin": self.stdin, "cwd": self.cwd, "env": env}) + "\n")

    def act(self) -> list[str]:
        """Do what the prompt asks of the working tree; what was done, in words."""
        done = []
        for path, text in re.findall(r"^fake-write:[ \t]*(\S+)[ \t]*(.*)$", self.prompt, re.MULTILINE):
            target = Path(self.cwd) / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text + "\n")
            done.append(f"wrote {path}")
        seen = sorted(p.name for p in Path(self.cwd).iterdir() if p.name != ".git")
        done.append("saw " + ",".join(seen))
        if (seconds := self.line("fake-sleep")) is not None:
            time.sleep(float(seconds))
        return done

    # --- sessions, per working directory (as Claude Code looks them up) ---

    def _sessions(self) -> Path:
        home = Path(os.environ.get("HOME", "/tmp"))
        return home / f".{self.name}" / "fake-sessions" / hashlib.sha256(self.cwd.encode()).hexdigest()[:16]

    def new_session(self) -> str:
        session_id = str(uuid.uuid4())
        self._sessions().mkdir(parents=True, exist_ok=True)
        (self._sessions() / session_id).write_text(self.prompt)
        return session_id

    def knows(self, session_id: str) -> bool:
        return bool(session_id) and (self._sessions() / session_id).exists()


def replay(name: str, recording: str) -> NoReturn:
    """Print what the real CLI printed in ``recorded/<name>-<recording>.json`` and exit with its status."""
    data = json.loads((RECORDED / f"{name}-{recording}.json").read_text())
    sys.stdout.write(data["stdout"])
    sys.stdout.flush()
    sys.stderr.write(data["stderr"])
    sys.stderr.flush()
    if data["exit_code"] < 0:   # it died of that signal (subprocess's negative code): so does the replay
        signal.signal(-data["exit_code"], signal.SIG_DFL)
        os.kill(os.getpid(), -data["exit_code"])
    sys.exit(data["exit_code"])


def emit(obj: dict | list) -> None:
    print(json.dumps(obj), flush=True)


def big_output(line_of) -> None:
    """About 3 MiB of output, ``line_of(i)`` giving each line (an event or text)."""
    written, i = 0, 0
    while written < BIG_OUTPUT_BYTES:
        text = line_of(i)
        print(text, flush=False)
        written += len(text) + 1
        i += 1
    sys.stdout.flush()
