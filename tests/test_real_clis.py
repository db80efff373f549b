"""The presets against the real agent CLIs (docs/agent-clis.md), installed from npm into a cache outside
the checkout (reused when present) and run with no login and no network: what they print then
is the ground truth for the version, the session id, the auth failure and Codex's wait for a
network. Skips only where npm itself is missing."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import T0

import outpost

#: npm package of each preset's CLI, and its binary.
PACKAGES = {"claude-code": ("@anthropic-ai/claude-code", "claude"), "codex": ("@openai/codex", "codex"),
            "gemini": ("@google/gemini-cli", "gemini")}
CACHE = Path(os.environ.get("OUTPOST_AGENT_CLIS", Path.home() / ".cache" / "outpost" / "agent-clis"))


@pytest.fixture(scope="module")
def clis() -> Path:
    """The cache's bin folder, after installing what is missing (about 760 MB the first time)."""
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: the real CLIs cannot be installed here")
    bin_dir = CACHE / "node_modules" / ".bin"
    if not all((bin_dir / binary).exists() for _, binary in PACKAGES.values()):
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(CACHE),
                        *(package for package, _ in PACKAGES.values())], check=True, capture_output=True, timeout=900)
    return bin_dir


def installed_version(package: str) -> str:
    return json.loads((CACHE / "node_modules" / package / "package.json").read_text())["version"]


def run_real(clis: Path, tmp_path: Path, preset: str, prompt: str, timeout_s: float) -> outpost.Outcome:
    """One run of the preset's command line against the real CLI, with a fresh HOME, no keys."""
    profile = outpost.agent_profile(Path("outpost.toml"), preset, {"preset": preset})
    work = tmp_path / "work"   # a git repository, as a run's worktree is
    if not work.exists():
        subprocess.run(["git", "init", "-q", str(work)], check=True)
    argv = outpost.profile_argv(profile, model=None, run_id="out_1", session_id=None, prompt_file=None,
                                max_cost_usd=None)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {"PATH": f"{clis}{os.pathsep}{os.environ['PATH']}", "HOME": str(home), "LANG": "C.UTF-8",
           **dict(profile.env)}
    proc = subprocess.Popen(argv, cwd=work, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(prompt, timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        timed_out = True
    reading = profile.kind.read(out.splitlines())
    return outpost.run_outcome(reading, proc.returncode, err, timed_out=timed_out, now=T0)


@pytest.mark.parametrize("preset", sorted(PACKAGES))
def test_the_version_command_names_the_installed_version(clis, preset):
    package, binary = PACKAGES[preset]
    version = outpost.cli_version([str(clis / binary), *outpost.PRESETS[preset].version[1:]],
                                  {"PATH": os.environ["PATH"], "HOME": "/nonexistent"})
    assert version is not None and installed_version(package) in version


def test_claude_without_a_login_reports_auth_with_its_session(clis, tmp_path):
    outcome = run_real(clis, tmp_path, "claude-code", "say hi", 120)
    assert (outcome.status, outcome.failure_kind) == (outpost.RunStatus.FAILED, "auth"), outcome.error
    report = outcome.report()
    assert report["session_id"] and report["agent_version"] == installed_version("@anthropic-ai/claude-code")


def test_gemini_without_a_login_reports_auth(clis, tmp_path):
    outcome = run_real(clis, tmp_path, "gemini", "say hi", 120)
    assert (outcome.status, outcome.failure_kind) == (outpost.RunStatus.FAILED, "auth"), outcome.error
    assert "Auth method" in outcome.error


def test_codex_waiting_for_a_network_ends_as_a_timeout_with_its_thread_id(clis, tmp_path):
    outcome = run_real(clis, tmp_path, "codex", "say hi", 8)
    assert (outcome.status, outcome.failure_kind) == (outpost.RunStatus.FAILED, "timeout"), outcome.error
    assert outcome.report()["session_id"]
