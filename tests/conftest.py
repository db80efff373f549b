"""Shared fixtures: a temp git repository, a temp store, definitions, and the real server."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import outpost  # noqa: E402

OUTPOST_PY = Path(outpost.__file__).resolve()
#: A fixed wall-clock origin for tests that drive time with MockClock.
T0 = datetime(2026, 11, 30, 8, 0, tzinfo=UTC)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def make_repo(path: Path, symlinks: dict[str, Path] | None = None) -> Path:
    """A real git repository at ``path``: one commit on ``main`` with ``README``, ``sub/keep``
    and the given symlinks (name -> target)."""
    path.mkdir(parents=True)
    git(path, "init", "-q", "-b", "main")
    (path / "README").write_text("hello\n")
    (path / "sub").mkdir()
    (path / "sub" / "keep").write_text("x\n")
    for name, target in (symlinks or {}).items():
        os.symlink(target, path / name)
    git(path, "add", "-A")
    git(path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "init")
    return path


@pytest.fixture
def git_repo(tmp_path: Path) -> Path:
    return make_repo(tmp_path / "repo")


@dataclasses.dataclass
class Reply:
    """An HTTP answer reduced to what assertions look at (in-process or real server)."""
    status: int
    text: str
    mimetype: str
    headers: Any

    @property
    def body(self) -> Any:
        if self.mimetype in ("application/json", "application/problem+json"):
            return json.loads(self.text)
        return self.text


def definition(repo: Path | str, **overrides) -> dict:
    """A raw schedule definition on ``repo`` (demo agent, every 5 minutes, UTC)."""
    raw = {"name": "nightly", "brief": "@print hello", "repository": str(repo), "agent": "demo",
           "timing": {"kind": "cron", "expression": "*/5 * * * *", "timezone": "UTC"}}
    raw.update(overrides)
    return raw


@pytest.fixture
def store(tmp_path: Path):
    s = outpost.Store(tmp_path / "outpost.sqlite3")
    yield s
    s.close()


def normalized(repo: Path | str, now: datetime = T0, **overrides) -> dict:
    return outpost.normalize_definition(definition(repo, **overrides), now, agents=["demo"])


@pytest.fixture
async def mock_deps(tmp_path: Path, store, autojump_clock):
    """Deps for actor tests: MockClock time from T0, store calls inline (no worker thread).

    The test itself must also request ``autojump_clock``: pytest-trio installs the
    MockClock only for a clock fixture the test function names directly."""
    config = outpost.Config(data_dir=tmp_path, agents=(outpost.demo_profile(),))
    return outpost.Deps(config=config, store=store, clock=outpost.TrioClock(T0), token="t", inline_db=True)


class Server:
    """A real ``outpost serve`` process on 127.0.0.1 with its own data dir."""

    def __init__(self, data_dir: Path, extra_args: tuple[str, ...] = (), env: dict | None = None):
        self.data_dir = data_dir
        self.extra_args = extra_args
        self.env = {k: v for k, v in os.environ.items() if k != "OUTPOST_API_TOKEN"} | (env or {})
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.token = ""
        self.signin_link = ""

    def start(self, timeout_s: float = 20) -> Server:
        self.log_path = self.data_dir.parent / f"serve-{time.time_ns()}.log"
        self.log_file = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(OUTPOST_PY), "serve", "--data-dir", str(self.data_dir), "--port", "0",
             *self.extra_args], stdout=subprocess.PIPE, stderr=self.log_file, text=True, env=self.env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"outpost serve exited: {self.log_path.read_text()}")
            m = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
            if m:
                self.url = f"http://127.0.0.1:{m[1]}"
                self.signin_link = self.proc.stdout.readline().split()[-1]   # printed right after
                break
        self.token = self.env.get("OUTPOST_API_TOKEN") or (self.data_dir / "api-token").read_text().strip()
        return self

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=30)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self.log_file.close()

    def logs(self) -> str:
        return self.log_path.read_text()


@pytest.fixture
def server_factory(tmp_path: Path):
    servers: list[Server] = []

    def make(*extra_args: str, data_dir: Path | None = None, env: dict | None = None) -> Server:
        server = Server(data_dir or tmp_path / "data", extra_args, env)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        if server.proc and server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def wait_for(predicate, timeout_s: float = 20, interval_s: float = 0.05):
    """Poll a real server until ``predicate()`` is truthy (end-to-end tests only)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s")


__all__ = ["T0", "Reply", "definition", "make_repo", "normalized", "git", "wait_for", "trio"]


def call(store: outpost.Store, fn, *args, **kwargs):
    """One store function in its own transaction (test set-up and assertions); its result."""
    return store.transaction(fn, *args, **kwargs)[0]


def instant(text: str | None) -> datetime | None:
    """An RFC 3339 instant of a view, as an aware datetime (None stays None)."""
    return outpost.parse_instant(text) if text else None
