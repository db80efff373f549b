#!/usr/bin/env python3
"""Record what the real agent CLIs print, run as Outpost's presets run them, against the model-API
stub of tests/modelstub.py: one JSON file per (CLI, scenario) in tests/fakes/recorded/, which the
fakes replay with ``fake:recorded-<scenario>`` (fakecli.replay) and tests/test_agents.py reads.

    python tests/fakes/record.py [claude|claude-oauth|codex|gemini|aider ...]
    python tests/fakes/record.py codex:500,hang gemini:503   # only these scenarios of a CLI

The CLIs come from $OUTPOST_AGENT_CLIS (npm, default ~/.cache/outpost/agent-clis) and
$OUTPOST_AIDER_VENV (PyPI, default ~/.cache/outpost/aider-venv), as .ci/run installs them. Each
run gets a fresh HOME under /var/tmp/outpost-record and the login a user would have: an API key
(``claude-oauth``: a subscription's OAuth token, CLAUDE_CODE_OAUTH_TOKEN), the CLI's base-URL
setting pointed at the stub, and its retries cut short (CLAUDE_CODE_MAX_RETRIES=0, Gemini's
general.maxAttempts 1) so that a failure is printed within seconds. aider cannot be told to retry
less: its 429/503 scenarios take about 80 s each, so the runs of one CLI go in parallel.

A run that has not ended by its deadline (``hang``: KILL_AFTER_S after its first line of output;
any other: DEADLINE_S) gets
SIGTERM to its process group, as Outpost's timeout does, and SIGKILL 10 s later; the recording says so in ``killed``
(signal, after how many seconds, whether SIGKILL was needed) and its exit_code is what
``subprocess`` reported (a negative number: the signal that ended it).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]
import modelstub  # noqa: E402

import outpost  # noqa: E402

RECORDED = HERE / "recorded"
CLIS = Path(os.environ.get("OUTPOST_AGENT_CLIS", Path.home() / ".cache" / "outpost" / "agent-clis"))
AIDER = Path(os.environ.get("OUTPOST_AIDER_VENV", Path.home() / ".cache" / "outpost" / "aider-venv"))
ROOT = Path("/var/tmp/outpost-record")
#: A session id no CLI knows.
UNKNOWN_SESSION = "0b4c1a55-6c9e-4d5b-9f0e-123456789abc"
#: The provider outages of tests/modelstub.py: 500, 502, 503, each also with a retry-after.
OUTAGES = modelstub.OUTAGES
#: A stream cut mid-reply; a provider that never answers.
BROKEN = ("cut", "hang")
#: cli -> (preset, model, scenarios)
PLAN = {
    "claude": ("claude-code", None, ("success", "tool", "401", "403", "429", "529", "credits", "token-limit",
                                     "unknown-session", *OUTAGES, *BROKEN)),
    "claude-oauth": ("claude-code", None, ("401", "429", "429-weekly", "credits", "spend")),
    "codex": ("codex", None, ("success", "401", "403", "429", "529", "credits", "unknown-session", *OUTAGES,
                              *BROKEN, "capacity", "capacity-503", "usage-limit",
                              "usage-limit-weekly")),
    "gemini": ("gemini", "gemini-2.5-pro", ("success-auto", "tool", "401", "bad-key", "403", "429", "529", "credits",
                                            "unknown-session", *OUTAGES, *BROKEN)),
    "aider": ("aider", "openai/gpt-4o", ("success", "401", "403", "429", "529", "credits", "token-limit", *OUTAGES,
                                         *BROKEN, "success-unpriced")),
}
#: (cli, scenario) -> the model it runs with instead of PLAN's: one litellm knows no price for.
MODEL_OF = {("aider", "success-unpriced"): "openai/stub-unpriced-model"}
#: The scenario the stub plays for a recorded one of another name.
STUB_SCENARIO = {"success-auto": "success", "unknown-session": "success", "success-unpriced": "success"}
#: A ``hang`` run is ended this many seconds after its first line of output (SIGTERM, as Outpost's
#: timeout ends a run), or FIRST_LINE_S after its start if it prints none.
KILL_AFTER_S = 25
FIRST_LINE_S = 120
#: Any other run is ended after this long (a CLI that retries a 5xx for minutes).
DEADLINE_S = 280
#: Each CLI's stderr is kept whole up to this size, else its head and tail.
STDERR_KEPT = 8192


def cli_env(cli: str, home: Path, url: str) -> dict[str, str]:
    """The environment of one recorded run: PATH with the CLIs, a fresh HOME, the login, the stub."""
    home.mkdir(parents=True, exist_ok=True)
    env = {"PATH": f"{CLIS / 'node_modules' / '.bin'}:{AIDER / 'bin'}:/usr/local/bin:/usr/bin:/bin",
           "HOME": str(home), "LANG": "C.UTF-8", "TZ": "UTC"}
    if cli.startswith("claude"):
        login = ({"CLAUDE_CODE_OAUTH_TOKEN": "sk-ant-oat01-stub"} if cli == "claude-oauth"
                 else {"ANTHROPIC_API_KEY": "sk-ant-api03-stub"})
        env |= {"ANTHROPIC_BASE_URL": url, "CLAUDE_CODE_MAX_RETRIES": "0", **login}
    elif cli == "codex":
        (home / ".codex").mkdir(exist_ok=True)
        (home / ".codex" / "config.toml").write_text(f'openai_base_url = "{url}/v1"\n')
        env["CODEX_API_KEY"] = "sk-stub"
    elif cli == "gemini":
        (home / ".gemini").mkdir(exist_ok=True)
        (home / ".gemini" / "settings.json").write_text(json.dumps(
            {"security": {"auth": {"selectedType": "gemini-api-key"}}, "general": {"maxAttempts": 1}}))
        env |= {"GOOGLE_GEMINI_BASE_URL": url, "GEMINI_API_KEY": "stub-key"}
    elif cli == "aider":
        env |= {"OPENAI_API_BASE": f"{url}/v1", "OPENAI_API_KEY": "sk-stub"}
    return env


def cli_version(cli: str) -> str:
    preset = PLAN[cli][0]
    binary = "aider" if cli == "aider" else outpost.PRESETS[preset].version[0]
    env = {"PATH": f"{CLIS / 'node_modules' / '.bin'}:{AIDER / 'bin'}:/usr/bin:/bin", "HOME": "/nonexistent"}
    return outpost.cli_version([binary, *outpost.PRESETS[preset].version[1:]], env) or "?"


def record(cli: str, scenario: str, url: str, version: str) -> Path:
    preset, model, _ = PLAN[cli]
    model = MODEL_OF.get((cli, scenario), model)
    root = ROOT / f"{cli}-{scenario}"
    shutil.rmtree(root, ignore_errors=True)
    work = root / "work"
    work.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    profile = outpost.agent_profile(Path("outpost.toml"), cli, {"preset": preset})
    stub_scenario = STUB_SCENARIO.get(scenario, scenario)
    prompt = f"stub:{stub_scenario} Say hi."
    (root / "prompt.md").write_text(prompt)
    argv = outpost.profile_argv(profile, model=None if scenario == "success-auto" else model, run_id="out_rec",
                                session_id=UNKNOWN_SESSION if scenario == "unknown-session" else None,
                                prompt_file=str(root / "prompt.md"), max_cost_usd=None)
    env = cli_env(cli, root / "home", url) | dict(profile.env)
    started = time.monotonic()
    returncode, stdout, stderr, killed = run_bounded(argv, work, env, prompt, hang=scenario == "hang")
    if len(stderr) > STDERR_KEPT:
        stderr = stderr[:2048] + "\n[... cut when recorded ...]\n" + stderr[-(STDERR_KEPT - 2048):]
    path = RECORDED / f"{cli}-{scenario}.json"
    path.write_text(json.dumps({
        "recorded_from": f"{version}, run as Outpost's {preset} preset runs it against tests/modelstub.py "
                         f"(scenario {stub_scenario}) by tests/fakes/record.py",
        "recorded_at": time.strftime("%Y-%m-%d"), "cli": cli, "scenario": scenario,
        "argv": [Path(argv[0]).name, *argv[1:]], "seconds": round(time.monotonic() - started, 1),
        "exit_code": returncode, **({"killed": killed} if killed else {}),
        "stdout": stdout, "stderr": stderr}, indent=1, ensure_ascii=False) + "\n")
    return path


def run_bounded(argv: list[str], cwd: Path, env: dict[str, str], prompt: str,
                hang: bool) -> tuple[int, str, str, dict | None]:
    """Run one CLI, in its own process group, to its end, or to its deadline: then SIGTERM to the
    group, and SIGKILL to what is left of it 10 s later (``sigkill_needed``: the leader lived on).
    A ``hang`` run's deadline is KILL_AFTER_S after its first line of output (Claude's and Gemini's
    init event, Codex's thread.started), or FIRST_LINE_S after its start if it prints none."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)   # its own group, as in Outpost
    out: list[str] = []
    err: list[str] = []
    first_line: list[float] = []

    def read_out() -> None:
        for line in proc.stdout:
            if not first_line:
                first_line.append(time.monotonic())
            out.append(line)

    readers = [threading.Thread(target=read_out, daemon=True),
               threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)]
    for reader in readers:
        reader.start()
    started = time.monotonic()
    try:
        proc.stdin.write(prompt)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    killed = None
    while proc.poll() is None:
        if hang:
            deadline = first_line[0] + KILL_AFTER_S if first_line else started + FIRST_LINE_S
        else:
            deadline = started + DEADLINE_S
        if time.monotonic() >= deadline:
            os.killpg(proc.pid, signal.SIGTERM)   # the group: Gemini CLI runs itself again as a child
            killed = {"signal": "SIGTERM", "after_s": round(time.monotonic() - started, 1),
                      "after_first_output_line_s": round(time.monotonic() - first_line[0], 1) if first_line else None,
                      "sigkill_needed": False}
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                killed["sigkill_needed"] = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)   # what is left of the group
            proc.wait()
            break
        time.sleep(0.2)
    for reader in readers:
        reader.join(timeout=10)
    return proc.returncode, "".join(out), "".join(err), killed


def main() -> None:
    chosen = [arg.partition(":")[0] for arg in sys.argv[1:]] or list(PLAN)
    only = {arg.partition(":")[0]: arg.partition(":")[2].split(",") for arg in sys.argv[1:] if ":" in arg}
    RECORDED.mkdir(exist_ok=True)
    stub = modelstub.ModelStub().start()
    try:
        for cli in chosen:
            stub.retry_after_s = 3600 if cli == "gemini" else 1   # Gemini fails at once past 300 s; Codex retries
            version = cli_version(cli)
            with concurrent.futures.ThreadPoolExecutor(max_workers=8 if cli == "aider" else 6) as pool:
                scenarios = only.get(cli) or PLAN[cli][2]
                for path in pool.map(lambda s, c=cli, v=version: record(c, s, stub.url, v), scenarios):
                    print(path.relative_to(HERE), flush=True)
    finally:
        stub.stop()


if __name__ == "__main__":
    main()
