"""Agent CLIs (docs/agent-clis.md): limits and login failures read from what the CLIs print, the
readers of their output formats against the fake CLIs of tests/fakes, and what a limit, a
login failure, a question or a changed profile does to runs, profiles and schedules."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import conftest
import pytest
import trio
from conftest import T0, YEARLY, call, make_deps, only, until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import outpost

FAKES = Path(__file__).parent / "fakes"
CHICAGO = ZoneInfo("America/Chicago")


###############################################################################
# Limits (docs/agent-clis.md): every form of the table, with the reset it means
###############################################################################

#: 2026-11-30 08:00 UTC is 02:00 in Chicago (CST, UTC-6), 08:00 in Lisbon (WET).
#: An epoch a CLI names (2026-12-01 09:00 UTC).
EPOCH = 1796115600
LIMIT_FORMS = [
    (f"Claude AI usage limit reached|{EPOCH}", datetime.fromtimestamp(EPOCH, UTC)),
    ("5-hour limit reached ∙ resets 4pm (America/Chicago)", datetime(2026, 11, 30, 22, 0, tzinfo=UTC)),
    ("You've hit your limit · resets 1pm (Europe/Lisbon)", datetime(2026, 11, 30, 13, 0, tzinfo=UTC)),
    ("Limit reached · resets 12:50am (America/Los_Angeles)", datetime(2026, 11, 30, 8, 50, tzinfo=UTC)),
    ("Your limit will reset at 3pm (America/Bogota)", datetime(2026, 11, 30, 20, 0, tzinfo=UTC)),
    ("Rate limit exceeded, resets at 4:00 AM UTC", datetime(2026, 12, 1, 4, 0, tzinfo=UTC)),
    ("Rate limit reached. Please try again in 14.036s.", T0 + timedelta(seconds=14.036)),
    ("429 Too Many Requests: try again in 20ms", T0 + timedelta(milliseconds=20)),
    ("rate limit: try again in 1m30s", T0 + timedelta(seconds=90)),
    ("Usage limit reached. Try again in 3 days 6 hours 57 minutes.", T0 + timedelta(days=3, hours=6, minutes=57)),
    ("HTTP 429 Too Many Requests\nRetry-After: 120", T0 + timedelta(seconds=120)),
    # a wall time without a zone is in the profile's timezone (here Chicago)
    ("You’ve hit your usage limit. Upgrade to Pro or try again at 3:28 PM.",
     datetime(2026, 11, 30, 21, 28, tzinfo=UTC)),
    ("You've hit your usage limit. Try again at Jul 5th, 2027 8:19 PM.", datetime(2027, 7, 6, 1, 19, tzinfo=UTC)),
    ("Your quota will reset after 1h49m8s", T0 + timedelta(hours=1, minutes=49, seconds=8)),
    (f'{{"error": "rate_limit", "reset_time": {EPOCH}}}', datetime.fromtimestamp(EPOCH, UTC)),
    ('{"type": "usage_limit", "resets_in_seconds": 900}', T0 + timedelta(seconds=900)),
]


@pytest.mark.parametrize(("text", "reset"), LIMIT_FORMS, ids=[t[:40] for t, _ in LIMIT_FORMS])
def test_every_limit_form_gives_its_reset(text, reset):
    limit = outpost.find_limit(text, T0, CHICAGO)
    assert limit is not None, text
    assert limit.resets_at == reset
    # the profile is held until the reset plus 30 s
    assert outpost.limit_wait(limit, 0, T0, 0.0) == reset + timedelta(seconds=30)


@pytest.mark.parametrize(("text", "reset"), [
    ("RATE LIMIT EXCEEDED, RESETS AT 4:00 AM UTC", datetime(2026, 12, 1, 4, 0, tzinfo=UTC)),   # capitals
    ("Rate limit: Resets at 11:30 PM PST", datetime(2026, 12, 1, 7, 30, tzinfo=UTC)),   # PST is UTC-8, not UTC
    ("usage limit · Resets 9AM (Asia/Tokyo)", datetime(2026, 12, 1, 0, 0, tzinfo=UTC)),
    ("Rate limit exceeded, resets at 7:55 AM UTC", T0),   # 5 minutes ago: now, not tomorrow
    ("Rate limit exceeded, resets at 7:30 AM UTC", datetime(2026, 12, 1, 7, 30, tzinfo=UTC)),   # 30 min ago: tomorrow
    ("rate limit: try again in 20 MS", T0 + timedelta(milliseconds=20)),   # ms is milliseconds, never minutes
    ("quota exceeded; retry in 2 minutes and 5 seconds", T0 + timedelta(seconds=125)),
    ("You've hit your session limit · resets 3:50pm (Asia/Tokyo)", datetime(2026, 12, 1, 6, 50, tzinfo=UTC)),
    # Claude Code 2.1 names the date of a reset more than a day away (its limit messages, issue 25)
    ("You've hit your weekly Opus limit · resets Dec 3, 9am", datetime(2026, 12, 3, 15, 0, tzinfo=UTC)),
    ("You've hit your weekly limit · resets Dec 4, 12pm (Europe/Paris)", datetime(2026, 12, 4, 11, 0, tzinfo=UTC)),
    ("You've hit your weekly limit · resets Jan 3, 2027, 10pm (Europe/Paris)",
     datetime(2027, 1, 3, 21, 0, tzinfo=UTC)),
    ("Weekly limit reached ∙ resets Nov 13 at 9am", datetime(2027, 11, 13, 15, 0, tzinfo=UTC)),   # passed: next year
    ("You've hit your weekly limit · resets Nov 30, 1:50am (America/Chicago)", T0),   # 10 minutes ago: now
    ("You're out of usage credits · resets 3pm (Europe/Lisbon)", datetime(2026, 11, 30, 15, 0, tzinfo=UTC)),
    # Gemini CLI's quota dialog: a wall time at a fixed offset
    ("Usage limit reached for gemini-2.5-pro. Access resets at 10:57 PM GMT-3.", datetime(2026, 12, 1, 1, 57,
                                                                                           tzinfo=UTC)),
    ("Usage limit reached for gemini-2.5-pro. Access resets at 5:30 PM GMT+5:30.", datetime(2026, 11, 30, 12, 0,
                                                                                            tzinfo=UTC)),
])
def test_limit_resets_read_as_a_human_would(text, reset):
    limit = outpost.find_limit(text, T0, CHICAGO)
    assert limit is not None and limit.resets_at == reset


@pytest.mark.parametrize(("text", "kind"), [
    ("Claude AI usage limit reached|1796115600", "usage_limit"), ("You've hit your limit", "usage_limit"),
    ("Quota exceeded for quota metric", "usage_limit"), ("RESOURCE_EXHAUSTED", "usage_limit"),
    ("You have exhausted your capacity on this model", "usage_limit"), ("rate_limit_error", "rate_limit"),
    ("HTTP 429", "rate_limit"), ("Too Many Requests", "rate_limit"),
    ("You've reached your Opus limit", "usage_limit"), ("You're out of usage credits", "usage_limit"),
    ("You've hit your org's monthly spend limit · ask your admin to raise it at claude.ai/settings/usage",
     "usage_limit"),
    # aider's litellm error for a rate limit, with a wait: a rate limit, never a usage limit
    ("litellm.RateLimitError: RateLimitError: OpenAIException - Rate limit reached for gpt-4o in organization org-x on "
     "tokens per min (TPM): Limit 30000, Used 29000, Requested 1300. Please try again in 4.2s.", "rate_limit"),
    # a provider that is overloaded: wait like a rate limit with no reset
    ("API Error: 529 Overloaded. This is a server-side issue, usually temporary", "rate_limit"),
    ("[API Error: The model is overloaded. Please try again later.]", "rate_limit"),
])
def test_limit_words_and_their_kind(text, kind):
    assert outpost.find_limit(text, T0, CHICAGO).kind == kind


@pytest.mark.parametrize(("text", "by"), [
    ("You've hit your org's monthly spend limit · ask your admin to raise it at claude.ai/settings/usage", "admin"),
    ("You've hit your monthly spend limit · raise it at claude.ai/settings/usage", "billing"),
    ("Credit balance is too low", "billing"),
    ("Quota exceeded. Check your plan and billing details.", "billing"),
    ("litellm.RateLimitError: RateLimitError: OpenAIException - You exceeded your current quota, please check your "
     "plan and billing details.", "billing"),
])
def test_a_spend_or_credit_limit_with_no_reset_waits_for_someone_to_raise_it(text, by):
    limit = outpost.find_limit(text, T0, CHICAGO)
    assert (limit.kind, limit.resets_at) == ("usage_limit", None)
    assert limit.raised_by and by in limit.raised_by


@pytest.mark.parametrize("text", ["You're out of usage credits · resets 3pm (Europe/Lisbon)",
                                  "Rate limit reached. Please try again in 14.036s.", "429 Too Many Requests"])
def test_a_limit_that_resets_or_passes_by_itself_needs_nobody(text):
    assert outpost.find_limit(text, T0, CHICAGO).raised_by is None


@pytest.mark.parametrize("text", ["connection reset by peer", "tests failed: 4290 assertions",
                                  "the result limits are fine", "Try again at 3pm",
                                  "at RetryableQuotaError (file:///gemini-cli/bundle/chunk.js:307344:16)",
                                  "error: call of overloaded 'max(int, long)' is ambiguous"])
def test_text_without_a_limit_word_is_no_limit(text):
    assert outpost.find_limit(text, T0, CHICAGO) is None


@pytest.mark.parametrize(("text", "reset"), [
    ("Your limit resets at 2026-12-01T21:39:39Z", datetime(2026, 12, 1, 21, 39, 39, tzinfo=UTC)),
    ("usage limit reached; try again at 2026-12-01T15:39:39-06:00", datetime(2026, 12, 1, 21, 39, 39, tzinfo=UTC)),
    ("Rate limit: resets at 2026-12-01 15:39", datetime(2026, 12, 1, 21, 39, tzinfo=UTC)),   # no offset: Chicago
    ("usage limit reached: resets at 2026-11-29T09:00:00Z", T0),   # already past: now, then the ladder
])
def test_a_dated_iso_reset_is_read(text, reset):
    assert outpost.find_limit(text, T0, CHICAGO).resets_at == reset


def test_an_epoch_already_past_means_now():
    assert outpost.find_limit("Claude AI usage limit reached|1767000000", T0, CHICAGO).resets_at == T0


def test_a_limit_that_names_no_reset_climbs_the_ladder():
    limit = outpost.find_limit("429 Too Many Requests", T0, CHICAGO)
    assert limit.resets_at is None
    for streak, minutes in enumerate((2, 10, 30, 120, 120)):
        assert outpost.limit_wait(limit, streak, T0, 0.0) == T0 + timedelta(minutes=minutes)
        assert outpost.limit_wait(limit, streak, T0, 1.0) == T0 + timedelta(minutes=minutes * 1.25)
        assert outpost.limit_wait(limit, streak, T0, -1.0) == T0 + timedelta(minutes=minutes * 0.75)


@pytest.mark.parametrize(("text", "auth"), [
    ("Not logged in · Please run /login", True), ("Invalid API key · Fix external API key", True),
    ('{"type":"error","error":{"type":"authentication_error","message":"invalid x-api-key"}}', True),
    ("authentication_failed", True), ("Please set an Auth method in your settings.json", True),
    ("unexpected status 401 Unauthorized: Missing bearer or basic authentication in header", True),
    ("OPENAI_API_KEY is not set", True), ("Missing OPENAI_API_KEY", True),
    # expired or revoked logins, as the real CLIs word them (issue 25)
    ("Failed to authenticate. API Error: 401 OAuth token has expired. Please obtain a new token or refresh your "
     "existing token.", True),
    ("Failed to authenticate. API Error: 403 Your account does not have access to Claude. Please login again or "
     "contact your administrator.", True),
    ("Your access token could not be refreshed because your refresh token was already used. Please log out and "
     "sign in again.", True),
    ("Your access token could not be refreshed because you have since logged out or signed in to another account. "
     "Please sign in again.", True),
    ('[API Error: {"error":{"code":400,"message":"API key not valid. Please pass a valid API key.","status":'
     '"INVALID_ARGUMENT","details":[{"reason":"API_KEY_INVALID"}]}}]', True),
    ("unexpected status 403 Forbidden: Country, region, or territory not supported, url: http://x/v1/responses",
     True),
    ("exit code 1", False), ("failed at line 401 of main.c", False), ("uses OPENAI_API_KEY from env", False),
    ("bash: ./deploy.sh: Permission denied", False), ("the 403 page of the site renders", False),
])
def test_login_failures_are_told_from_other_failures(text, auth):
    assert outpost.is_auth_failure(text) is auth


###############################################################################
# Readers (docs/agent-clis.md): each preset against its fake CLI
###############################################################################

def fake_env(home: Path, log: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of a run of a fake CLI: the fakes first on PATH, their own HOME."""
    env = {"PATH": f"{FAKES}{os.pathsep}{os.environ['PATH']}", "HOME": str(home), "LANG": "C.UTF-8", **extra}
    if log is not None:
        env["FAKE_CLI_LOG"] = str(log)
    return env


def preset_profile(preset: str, **fields) -> outpost.AgentProfile:
    return outpost.agent_profile(Path("outpost.toml"), preset, {"preset": preset, **fields})


def run_fake(tmp_path: Path, preset: str, prompt: str, *, session: str | None = None, model: str = "test-model",
             max_cost_usd: float | None = None, cwd: Path | None = None, now: datetime = T0) -> outpost.Outcome:
    """One run of a preset's command line against its fake CLI, read as the run supervisor reads it."""
    profile = preset_profile(preset)
    cwd = cwd or tmp_path / "work"
    cwd.mkdir(exist_ok=True)
    prompt_file = tmp_path / "prompt.md"
    prompt_file.write_text(prompt)
    argv = outpost.profile_argv(profile, model=model, run_id="out_1", session_id=session,
                                prompt_file=str(prompt_file), max_cost_usd=max_cost_usd)
    env = fake_env(tmp_path / "home", tmp_path) | dict(profile.env)
    done = subprocess.run(argv, input=prompt, capture_output=True, text=True, cwd=cwd, env=env, timeout=60)
    reading = profile.kind.read(done.stdout.splitlines())
    return outpost.run_outcome(reading, done.returncode, done.stderr, now=now, tz=CHICAGO)


def calls(tmp_path: Path, cli: str) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / f"{cli}.jsonl").read_text().splitlines()]


#: preset -> (cost, input, output, cache read tokens) of the fake's successful run
SUCCESS_FIGURES = {"claude-code": (0.0123, 1200, 345, 5000), "codex": (None, 2400, 512, 1000),
                   "gemini": (None, 2500, 500, 0), "aider": (0.01, 2300, 512, None)}
#: preset -> the fake CLI's name
CLI = {"claude-code": "claude", "codex": "codex", "gemini": "gemini", "aider": "aider"}
#: presets whose CLI keeps sessions (aider has none)
SESSIONS = ["claude-code", "codex", "gemini"]


@pytest.mark.parametrize("preset", sorted(SUCCESS_FIGURES))
def test_a_successful_run_reports_session_model_cost_and_tokens(tmp_path, preset):
    outcome = run_fake(tmp_path, preset, "fake:success\nfake-write: notes.txt hello", model="gpt-x")
    assert (outcome.status, outcome.error, outcome.failure_kind) == (outpost.RunStatus.SUCCEEDED, None, None)
    report = outcome.report()
    assert report["format"] == preset
    assert (report["session_id"] is not None) is (preset in SESSIONS)
    cost, tokens_in, tokens_out, cached = SUCCESS_FIGURES[preset]
    assert (report["cost_usd"], report["input_tokens"], report["output_tokens"], report["cache_read_tokens"]) == (
        cost, tokens_in, tokens_out, cached)
    assert report["final_message"].startswith("Done.") and "wrote notes.txt" in report["final_message"]
    assert (tmp_path / "work" / "notes.txt").read_text() == "hello\n"
    (call,) = calls(tmp_path, CLI[preset])
    if preset != "aider":   # aider reads the prompt from its --message-file
        assert call["stdin"].startswith("fake:success")   # the prompt came on stdin, never in argv
    assert not any("fake:success" in arg for arg in call["argv"])
    assert "gpt-x" in call["argv"]


@pytest.mark.parametrize("preset", SESSIONS)
def test_a_brief_that_starts_like_an_option_reaches_the_cli_intact_on_stdin(tmp_path, preset):
    brief = "- fix the flaky test\n--help is not an option here\nfake:success"
    assert run_fake(tmp_path, preset, brief).status == outpost.RunStatus.SUCCEEDED
    (call,) = calls(tmp_path, CLI[preset])
    assert call["stdin"] == brief
    assert "--help" not in call["argv"] and "- fix the flaky test" not in call["argv"]


@pytest.mark.parametrize("preset", sorted(CLI))
def test_a_failure_the_cli_reports_is_a_failure_with_its_text(tmp_path, preset):
    outcome = run_fake(tmp_path, preset, "fake:fail-result")
    assert (outcome.status, outcome.failure_kind) == (outpost.RunStatus.FAILED, "agent")
    assert outcome.error and len(outcome.error) > 10


def test_claude_failure_in_result_with_exit_0_is_a_failure_with_its_text(tmp_path):
    outcome = run_fake(tmp_path, "claude-code", "fake:fail-result")
    assert (outcome.status, outcome.failure_kind) == (outpost.RunStatus.FAILED, "agent")
    assert "API Error" in outcome.error


def test_claude_max_turns_is_no_success(tmp_path):
    outcome = run_fake(tmp_path, "claude-code", "fake:max-turns")
    assert (outcome.status, outcome.failure_kind) == (outpost.RunStatus.FAILED, "agent")
    assert "max_turns" in outcome.error or "max turns" in outcome.error.lower()


def test_claude_json_array_under_verbose_is_read(tmp_path):
    """``--output-format json --verbose`` prints one JSON array of every message."""
    profile = outpost.agent_profile(Path("outpost.toml"), "c", {
        "preset": "claude-code", "command": ["claude", "-p", "--output-format", "json", "--verbose"]})
    done = subprocess.run(outpost.profile_argv(profile, model=None, run_id="r", session_id=None, prompt_file=None,
                                               max_cost_usd=None),
                          input="fake:success", capture_output=True, text=True, cwd=tmp_path,
                          env=fake_env(tmp_path / "home"), timeout=60)
    assert done.stdout.lstrip().startswith("[")
    outcome = outpost.run_outcome(outpost.read_claude(done.stdout.splitlines()), done.returncode, done.stderr, now=T0)
    assert outcome.status == outpost.RunStatus.SUCCEEDED
    assert outcome.report()["session_id"] and outcome.report()["cost_usd"] == 0.0123


def test_claude_permission_denials_on_a_success_ask_a_human(tmp_path):
    outcome = run_fake(tmp_path, "claude-code", "fake:permission-denials")
    assert outcome.status == outpost.RunStatus.NEEDS_YOU
    assert "Bash" in outcome.question and "Write" in outcome.question
    assert {d["tool_name"] for d in outcome.report()["permission_denials"]} >= {"Bash", "Write"}


def test_claude_rate_limit_event_gives_the_exact_reset(tmp_path):
    reset = T0 + timedelta(hours=3)
    outcome = run_fake(tmp_path, "claude-code", f"fake:rate-limit-event\nfake-text: {int(reset.timestamp())}")
    assert (outcome.status, outcome.failure_kind) == (outpost.RunStatus.FAILED, "limit")
    assert outcome.limit.resets_at == reset


@pytest.mark.parametrize("preset", sorted(CLI))
@pytest.mark.parametrize(("text", "reset"), LIMIT_FORMS[:7], ids=[t[:30] for t, _ in LIMIT_FORMS[:7]])
def test_a_limit_the_cli_reports_is_a_limit_with_its_reset(tmp_path, preset, text, reset):
    outcome = run_fake(tmp_path, preset, f"fake:limit\nfake-text: {text.splitlines()[0]}")
    assert (outcome.status, outcome.failure_kind) == (outpost.RunStatus.FAILED, "limit")
    assert outcome.limit.resets_at == reset
    assert outcome.report()["limit"]["resets_at"] == outpost.rfc3339(reset)


@pytest.mark.parametrize("preset", sorted(CLI))
def test_a_cli_without_a_login_is_an_auth_failure(tmp_path, preset):
    outcome = run_fake(tmp_path, preset, "fake:auth")
    assert (outcome.status, outcome.failure_kind) == (outpost.RunStatus.FAILED, "auth")


@pytest.mark.parametrize("preset", SESSIONS)
def test_a_stream_that_ends_without_a_terminal_event_is_no_result(tmp_path, preset):
    outcome = run_fake(tmp_path, preset, "fake:no-terminal")
    assert (outcome.status, outcome.failure_kind) == (outpost.RunStatus.FAILED, "no_result")


def test_codex_session_is_the_first_events_thread_id_and_error_text_is_kept(tmp_path):
    outcome = run_fake(tmp_path, "codex", "fake:error-event")
    assert outcome.status == outpost.RunStatus.FAILED and outcome.error
    first = json.loads((tmp_path / "codex.jsonl").read_text().splitlines()[0])
    assert first["argv"][:2] == ["exec", "--json"]
    assert outcome.report()["session_id"]


@pytest.mark.parametrize("preset", SESSIONS)
def test_resume_passes_the_session_and_an_unknown_session_is_told(tmp_path, preset):
    first = run_fake(tmp_path, preset, "fake:success")
    session = first.report()["session_id"]
    again = run_fake(tmp_path, preset, "go on", session=session)
    assert again.status == outpost.RunStatus.SUCCEEDED and again.report()["session_id"] == session
    assert session in calls(tmp_path, CLI[preset])[-1]["argv"]
    gone = run_fake(tmp_path, preset, "go on", session="0b4c1a55-6c9e-4d5b-9f0e-123456789abc")
    assert gone.status == outpost.RunStatus.FAILED and outpost.is_unknown_session(gone.error)


def test_claude_max_cost_is_passed_to_the_cli(tmp_path):
    run_fake(tmp_path, "claude-code", "fake:success", max_cost_usd=0.5)
    argv = calls(tmp_path, "claude")[0]["argv"]
    assert argv[argv.index("--max-budget-usd") + 1] == "0.5"


###############################################################################
# What the real CLIs printed (tests/fakes/recorded: tests/fakes/record.py ran each
# one as its preset runs it, against the model-API stub of tests/modelstub.py)
###############################################################################

RECORDED = FAKES / "recorded"
#: recording -> (status, failure_kind, limit kind, reset: "event" (its rate_limit_event's resetsAt),
#: seconds from now, or None). The recordings are what to read right, issue 25's cases among them.
RECORDED_OUTCOMES = {
    "claude-success": ("succeeded", None, None, None),
    "claude-tool": ("needs_you", None, None, None),   # Bash denied under acceptEdits
    "claude-401": ("failed", "auth", None, None),
    "claude-403": ("failed", "auth", None, None),     # "Failed to authenticate. API Error: 403 ..."
    "claude-429": ("failed", "limit", "rate_limit", None),
    "claude-529": ("failed", "limit", "rate_limit", None),   # overloaded: waited out, not the agent's failure
    "claude-credits": ("failed", "limit", "usage_limit", None),   # "Credit balance is too low", billing_error
    "claude-token-limit": ("failed", "agent", None, None),
    "claude-unknown-session": ("failed", "agent", None, None),
    "claude-oauth-401": ("failed", "auth", None, None),   # "Failed to authenticate. API Error: 401 OAuth token has ..."
    "claude-oauth-429": ("failed", "limit", "usage_limit", "event"),
    "claude-oauth-429-weekly": ("failed", "limit", "usage_limit", "event"),   # "resets Dec 4, 6:45pm (UTC)"
    "claude-oauth-credits": ("failed", "limit", "usage_limit", "event"),   # "You're out of usage credits · resets ..."
    "claude-oauth-spend": ("failed", "limit", "usage_limit", None),   # "org's monthly spend limit · ask your admin"
    "codex-success": ("succeeded", None, None, None),
    "codex-401": ("failed", "auth", None, None),
    "codex-403": ("failed", "auth", None, None),
    "codex-429": ("failed", "limit", "rate_limit", None),
    "codex-529": ("failed", "limit", "rate_limit", None),
    "codex-credits": ("failed", "limit", "usage_limit", None),   # "Quota exceeded. Check your plan and billing"
    "codex-unknown-session": ("failed", "agent", None, None),
    "gemini-success-auto": ("succeeded", None, None, None),
    "gemini-tool": ("succeeded", None, None, None),   # headless Gemini has no shell tool to deny
    "gemini-401": ("failed", "auth", None, None),
    "gemini-bad-key": ("failed", "auth", None, None),   # API_KEY_INVALID, exit 144
    "gemini-403": ("failed", "auth", None, None),
    "gemini-429": ("failed", "limit", "usage_limit", 3600),   # "Suggested retry after 3600s."
    "gemini-529": ("failed", "limit", "rate_limit", None),
    "gemini-credits": ("failed", "limit", "usage_limit", None),   # "You have exhausted your daily quota"
    "gemini-unknown-session": ("failed", "agent", None, None),
    "aider-success": ("succeeded", None, None, None),
    "aider-401": ("failed", "auth", None, None),
    "aider-403": ("failed", "agent", None, None),   # litellm says APIError, with no status: nothing says login
    "aider-429": ("failed", "limit", "rate_limit", 1),   # RateLimitError ... "try again in 1.0s"
    "aider-529": ("failed", "limit", "rate_limit", None),
    "aider-credits": ("failed", "limit", "usage_limit", None),   # insufficient_quota
    "aider-token-limit": ("failed", "agent", None, None),   # "has hit a token limit!", exit 0
    # Issue 34: provider outages (5xx with and without Retry-After, a cut stream) are waited out as
    # limits, never the agent's failure; a CLI ended by a signal before its result is no_result.
    "claude-500": ("failed", "limit", "rate_limit", None),   # api_error_status 500 "server-side issue"
    "claude-500-retry-after": ("failed", "limit", "rate_limit", None),
    "claude-502": ("failed", "limit", "rate_limit", None),
    "claude-502-retry-after": ("failed", "limit", "rate_limit", None),
    "claude-503": ("failed", "limit", "rate_limit", None),
    "claude-503-retry-after": ("failed", "limit", "rate_limit", None),
    "claude-cut": ("failed", "limit", "rate_limit", None),   # "Connection to the API was lost (ECONNRESET)"
    "claude-hang": ("failed", "no_result", None, None),   # init, then SIGTERM: exit 143, no result event
    "codex-500": ("failed", "limit", "rate_limit", None),   # "We're currently experiencing high demand"
    "codex-500-retry-after": ("failed", "no_result", None, None),   # it honours Retry-After silently: killed
    "codex-502": ("failed", "limit", "rate_limit", None),   # "unexpected status 502 Bad Gateway"
    "codex-502-retry-after": ("failed", "no_result", None, None),
    "codex-503": ("failed", "limit", "rate_limit", None),
    "codex-503-retry-after": ("failed", "no_result", None, None),
    "codex-cut": ("failed", "limit", "rate_limit", None),   # "stream disconnected before completion"
    "codex-hang": ("failed", "no_result", None, None),   # killed by SIGTERM after turn.started
    "codex-capacity": ("failed", "limit", "rate_limit", None),   # "Selected model is at capacity"
    "codex-capacity-503": ("failed", "limit", "rate_limit", None),
    "codex-usage-limit": ("failed", "limit", "usage_limit", 13380),   # "try again at 5:43 AM" (Chicago)
    "codex-usage-limit-weekly": ("failed", "limit", "usage_limit", 445560),   # "at Dec 5th, 2026 5:46 AM"
    "gemini-500": ("failed", "limit", "rate_limit", None),   # [API Error: {... "status": "INTERNAL"}]
    "gemini-500-retry-after": ("failed", "limit", "rate_limit", None),
    "gemini-502": ("failed", "limit", "rate_limit", None),
    "gemini-502-retry-after": ("failed", "limit", "rate_limit", None),
    "gemini-503": ("failed", "limit", "rate_limit", None),   # RetryableQuotaError: "currently unavailable"
    "gemini-503-retry-after": ("failed", "limit", "rate_limit", None),
    "gemini-cut": ("failed", "limit", "rate_limit", None),   # "Model stream ended without a finish reason."
    "gemini-hang": ("failed", "no_result", None, None),   # init and the prompt, then SIGTERM: exit 0
    "aider-500": ("failed", "limit", "rate_limit", None),   # litellm.InternalServerError, exit 0
    "aider-500-retry-after": ("failed", "limit", "rate_limit", None),
    "aider-502": ("failed", "limit", "rate_limit", None),   # litellm.BadGatewayError
    "aider-502-retry-after": ("failed", "limit", "rate_limit", None),
    "aider-503": ("failed", "limit", "rate_limit", None),   # litellm.ServiceUnavailableError
    "aider-503-retry-after": ("failed", "limit", "rate_limit", None),
    "aider-cut": ("failed", "limit", "rate_limit", None),   # InternalServerError "Connection error."
    "aider-hang": ("failed", "no_result", None, None),   # its header, then SIGTERM
    "aider-success-unpriced": ("succeeded", None, None, None),   # "Tokens: 1.2k sent, 345 received." no cost
}
#: Recordings of a spend or credit limit that no wait lifts: the profile waits for a human.
RAISED_BY_A_HUMAN = {"claude-credits", "claude-oauth-spend", "codex-credits", "aider-credits"}
PRESET_OF = {"claude": "claude-code", "codex": "codex", "gemini": "gemini", "aider": "aider"}


def recording(name: str) -> dict:
    return json.loads((RECORDED / f"{name}.json").read_text())


def test_every_recording_has_its_expected_reading():
    assert sorted(p.stem for p in RECORDED.glob("*.json")) == sorted(RECORDED_OUTCOMES)


@pytest.mark.parametrize("name", sorted(RECORDED_OUTCOMES))
def test_what_the_real_cli_printed_is_read_as_it_meant(tmp_path, name):
    cli, _, scenario = name.partition("-")
    outcome = run_fake(tmp_path, PRESET_OF[cli], f"fake:recorded-{scenario}")
    status, kind, limit_kind, reset = RECORDED_OUTCOMES[name]
    assert (str(outcome.status), outcome.failure_kind) == (status, kind), outcome.error
    assert (outcome.limit.kind if outcome.limit else None) == limit_kind
    if reset == "event":
        events = [json.loads(line) for line in recording(name)["stdout"].splitlines() if "rate_limit_event" in line]
        reset = datetime.fromtimestamp(events[-1]["rate_limit_info"]["resetsAt"], UTC)
    elif reset is not None:
        reset = T0 + timedelta(seconds=reset)
    assert (outcome.limit.resets_at if outcome.limit else None) == reset
    assert bool(outcome.limit and outcome.limit.raised_by) is (name in RAISED_BY_A_HUMAN)
    if scenario == "unknown-session":
        assert outpost.is_unknown_session(outcome.error)
    if status == "succeeded":
        assert outcome.report()["final_message"] == "Done: the stub model answered."


def test_claude_reads_its_api_error_status_before_any_text(tmp_path):
    """The 403's text says "Failed to authenticate"; its structured fields say so first."""
    lines = recording("claude-403")["stdout"].splitlines()
    reading = outpost.read_claude([line.replace("Failed to authenticate. ", "") for line in lines])
    assert reading.failure_hint == "auth"
    outcome = outpost.run_outcome(reading, 1, "", now=T0)
    assert outcome.failure_kind == "auth"


def test_a_spend_limit_ignores_the_reset_of_the_window_it_came_with(tmp_path):
    outcome = run_fake(tmp_path, "claude-code", "fake:recorded-oauth-spend")
    assert outcome.limit.resets_at is None and "admin" in outcome.limit.raised_by
    assert "spend limit" in outcome.limit.message


def test_gemini_reports_the_model_that_answered_not_auto(tmp_path):
    outcome = run_fake(tmp_path, "gemini", "fake:recorded-success-auto")
    init = json.loads(recording("gemini-success-auto")["stdout"].splitlines()[0])
    assert init["model"] == "auto"
    assert outcome.report()["model"] == "gemini-3.8-flash"   # the stats' main model, not the router's


def test_gemini_json_format_names_the_model_of_the_main_role():
    """``--output-format json`` (Gemini CLI 0.61): no init; stats.models has each model's roles."""
    tokens = {"input": 10, "prompt": 10, "candidates": 1, "total": 11, "cached": 0, "thoughts": 0, "tool": 0}
    out = {"session_id": "5cc98af5-ba82-47ed-905b-0bb475146d25", "response": "hi", "stats": {"models": {
        "gemini-2.5-flash-lite": {"api": {"totalRequests": 1}, "tokens": {**tokens, "total": 300},
                                  "roles": {"utility_router": {"totalRequests": 1, "tokens": tokens}}},
        "gemini-2.5-pro": {"api": {"totalRequests": 1}, "tokens": tokens,
                           "roles": {"main": {"totalRequests": 1, "tokens": tokens}}}}}}
    reading = outpost.read_gemini(json.dumps(out, indent=2).splitlines())
    assert (reading.verdict, reading.model, reading.final_message) == ("succeeded", "gemini-2.5-pro", "hi")


def test_claude_reports_cost_tokens_session_and_version_of_a_real_run(tmp_path):
    report = run_fake(tmp_path, "claude-code", "fake:recorded-success").report()
    assert (report["input_tokens"], report["output_tokens"], report["cache_read_tokens"]) == (1200, 345, 5000)
    assert report["cost_usd"] > 0 and report["session_id"] and report["agent_version"] == "2.1.197"


def test_aider_reports_its_model_version_and_cost(tmp_path):
    report = run_fake(tmp_path, "aider", "fake:recorded-success").report()
    assert (report["model"], report["agent_version"], report["cost_usd"]) == ("openai/gpt-4o", "0.86.2", 0.0065)
    assert (report["input_tokens"], report["output_tokens"]) == (1200, 345)


def test_aider_at_its_token_limit_fails_though_it_exits_0(tmp_path):
    outcome = run_fake(tmp_path, "aider", "fake:recorded-token-limit")
    assert recording("aider-token-limit")["exit_code"] == 0
    assert outcome.failure_kind == "agent" and "has hit a token limit" in outcome.error


###############################################################################
# What a limit, a login failure and a session do (docs/agent-clis.md, 8.5): the real actors
###############################################################################

@pytest.fixture
def fakes_on_path(tmp_path, monkeypatch) -> Path:
    """The fake CLIs first on the daemon's PATH, a HOME of their own (their sessions), and the
    log of their calls: what a profile's runs inherit through pass_env."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("PATH", f"{FAKES}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("FAKE_CLI_LOG", str(tmp_path))
    return tmp_path


def fake_deps(tmp_path: Path, store: outpost.Store, *profiles: outpost.AgentProfile) -> outpost.Deps:
    pass_env = ("PATH", "HOME", "FAKE_CLI_LOG")
    agents = (outpost.demo_profile(), *(dataclasses.replace(p, pass_env=pass_env) for p in profiles))
    return make_deps(tmp_path, store=store, clock=outpost.TrioClock(T0), token="t", inline_db=True, agents=agents)


def claude(**fields) -> outpost.AgentProfile:
    return preset_profile("claude-code", **fields) if not fields else dataclasses.replace(
        preset_profile("claude-code"), **fields)


def dispatch_run(deps: outpost.Deps, repo: Path, agent: str, brief: str) -> str:
    payload = outpost.normalize_dispatch({"brief": brief, "repository": str(repo), "agent": agent},
                                         deps.clock.now(), agents=deps.profiles)
    return call(deps.store, deps.store.schedules.create_dispatch, payload, deps.clock.now())["run_id"]


def schedule_of(deps: outpost.Deps, repo: Path, agent: str, brief: str) -> dict:
    definition = outpost.normalize_definition(conftest.definition(repo, agent=agent, brief=brief, timing=YEARLY),
                                              deps.clock.now(), agents=deps.profiles)
    return call(deps.store, deps.store.schedules.create_schedule, definition, deps.clock.now(),
                deps.profile_digests[agent])


def run(deps: outpost.Deps, run_id: str) -> dict:
    return call(deps.store, deps.store.runs.get_run, run_id)


def fired_schedule(deps: outpost.Deps, repo: Path, brief: str) -> tuple[dict, str]:
    """A claude schedule with ``brief``, fired by hand: the schedule and its run's id."""
    sched = schedule_of(deps, repo, "claude", brief)
    return sched, call(deps.store, deps.store.schedules.fire_manual, sched["id"], 1, deps.clock.now(),
                       deps.profile_digests)["run_id"]


async def ended_as(deps: outpost.Deps, run_id: str, status: str) -> dict:
    return await until(lambda: (r := run(deps, run_id))["status"] == status and r)


async def actors(deps: outpost.Deps, nursery) -> None:
    nursery.start_soon(outpost.claim_actor, deps)
    nursery.start_soon(outpost.notification_actor, deps)


async def test_a_shutdown_while_a_worktree_is_being_made_settles_the_run_interrupted(fakes_on_path, store, git_repo,
                                                                                      monkeypatch):
    """No agent ran yet, so nothing is to be saved: the half-made worktree goes and the run is
    `interrupted` (its Office wakeup is taken up again at the restart), never failed with
    "changes could not be saved" and a worktree kept for a human."""
    deps = fake_deps(fakes_on_path, store, claude(name="claude"))
    making = trio.Event()

    async def slow_worktree(deps: outpost.Deps, plan: outpost.RunPlan, workspace: Path) -> str:
        (workspace / ".git").mkdir(parents=True)   # as far as a clone gets before the shutdown
        making.set()
        await trio.sleep_forever()

    monkeypatch.setattr(outpost, "prepare_worktree", slow_worktree)
    run_id = dispatch_run(deps, git_repo, "claude", "fake:success")
    with trio.fail_after(60):   # real time: the shielded settlement does real I/O (a mock clock would jump past it)
        async with trio.open_nursery() as nursery:
            await actors(deps, nursery)
            deps.claim_wake.poke()
            await making.wait()
            nursery.cancel_scope.cancel()   # the daemon stops
    ended = run(deps, run_id)
    assert (ended["status"], ended["error"]) == ("failed", "interrupted"), ended["error"]
    assert not deps.worktree(run_id).exists()
    assert not call(store, store.list_attention, True)


async def test_a_shutdown_before_the_agent_starts_never_removes_a_worktree_kept_from_before(fakes_on_path, store,
                                                                                            git_repo, monkeypatch):
    """A worktree an earlier run of the session left, kept with its changes for a human, is not
    this run's to remove: a shutdown while the run prepares it leaves it as it was."""
    deps = fake_deps(fakes_on_path, store, claude(name="claude"))
    preparing = trio.Event()

    async def slow_worktree(deps: outpost.Deps, plan: outpost.RunPlan, workspace: Path) -> str:
        preparing.set()
        await trio.sleep_forever()

    monkeypatch.setattr(outpost, "prepare_worktree", slow_worktree)
    run_id = dispatch_run(deps, git_repo, "claude", "fake:success")
    kept = deps.worktree(run_id)
    kept.mkdir(parents=True)
    (kept / "unsaved.txt").write_text("a human's to look at\n")
    with trio.fail_after(60):   # real time, as above
        async with trio.open_nursery() as nursery:
            await actors(deps, nursery)
            deps.claim_wake.poke()
            await preparing.wait()
            nursery.cancel_scope.cancel()
    assert (kept / "unsaved.txt").read_text() == "a human's to look at\n"


async def test_a_limit_holds_that_profiles_runs_while_others_pass_and_the_streak_stands(
        autojump_clock, fakes_on_path, store, git_repo):
    deps = fake_deps(fakes_on_path, store, claude(name="claude"))
    sched, fired = fired_schedule(deps, git_repo, "fake:limit\nfake-text: Rate limit reached. Try again in 1h.")
    with trio.fail_after(6 * 3600):   # MockClock time
        async with trio.open_nursery() as nursery:
            await actors(deps, nursery)
            limited = await ended_as(deps, fired, "failed")
            waiting = dispatch_run(deps, git_repo, "claude", "fake:success")
            passing = dispatch_run(deps, git_repo, "demo", "@print passed")
            deps.claim_wake.poke()
            await until(lambda: run(deps, passing)["status"] == "succeeded")
            await trio.sleep(30 * 60)   # half the limit: the claude run still waits
            assert run(deps, waiting)["status"] == "queued"
            agents = {a["name"]: a for a in call(store, store.runs.profile_states, ["claude", "demo"],
                                                 deps.clock.now())}
            assert agents["claude"]["queued"] == 1 and agents["claude"]["limited_until"]
            # after the reset (+30 s); polled each mock second, not 20 times one
            await until(lambda: run(deps, waiting)["status"] == "succeeded", poll_s=1)
            nursery.cancel_scope.cancel()
    assert (limited["failure_kind"], limited["agent_report"]["limit"]["kind"]) == ("limit", "rate_limit")
    reset = outpost.parse_instant(limited["agent_report"]["limit"]["resets_at"])
    assert outpost.parse_instant(run(deps, waiting)["started_at"]) >= reset + timedelta(seconds=30)
    assert call(store, store.schedules.get_schedule, sched["id"])["failure_streak"] == 0
    kinds = [a["kind"] for a in call(store, store.list_attention, False)]
    assert kinds.count("agent_limited") == 1 and "failed" not in kinds


async def test_a_second_limit_in_the_same_window_raises_no_second_item(autojump_clock, fakes_on_path, store,
                                                                         git_repo):
    deps = fake_deps(fakes_on_path, store, claude(name="claude", max_running=2))
    first = dispatch_run(deps, git_repo, "claude", "fake:limit\nfake-text: usage limit reached, try again in 2h")
    second = dispatch_run(deps, git_repo, "claude", "fake:limit\nfake-text: usage limit reached, try again in 2h")
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            await actors(deps, nursery)
            await until(lambda: run(deps, first)["status"] == run(deps, second)["status"] == "failed")
            nursery.cancel_scope.cancel()
    assert [a["kind"] for a in call(store, store.list_attention, False)].count("agent_limited") == 1


async def test_a_login_failure_pauses_the_profile_until_resumed(autojump_clock, fakes_on_path, store, git_repo):
    deps = fake_deps(fakes_on_path, store, claude(name="claude"))
    sched, fired = fired_schedule(deps, git_repo, "fake:auth")
    with trio.fail_after(6 * 3600):   # MockClock time
        async with trio.open_nursery() as nursery:
            await actors(deps, nursery)
            failed = await ended_as(deps, fired, "failed")
            waiting = dispatch_run(deps, git_repo, "claude", "fake:success")
            deps.claim_wake.poke()
            await trio.sleep(3600)
            assert run(deps, waiting)["status"] == "queued", "a paused profile starts nothing"
            state = only(call(store, store.runs.profile_states, ["claude"], deps.clock.now()))
            assert state["paused_reason"] and "Not logged in" in state["paused_reason"]
            call(store, store.runs.resume_profile, "claude", deps.clock.now())
            deps.claim_wake.poke()
            await until(lambda: run(deps, waiting)["status"] == "succeeded")
            nursery.cancel_scope.cancel()
    assert failed["failure_kind"] == "auth"
    items = [a for a in call(store, store.list_attention, False) if a["kind"] == "agent_auth"]
    assert len(items) == 1 and "claude" in items[0]["title"]
    assert "/login" in items[0]["detail"] and "resume" in items[0]["detail"]
    assert call(store, store.schedules.get_schedule, sched["id"])["failure_streak"] == 0


async def test_a_spend_limit_pauses_the_profile_until_someone_raises_it(autojump_clock, fakes_on_path, store,
                                                                        git_repo):
    """docs/agent-clis.md: a spend limit with no reset pauses the profile like a login failure, with one
    item saying who can raise it; the CLI's reset of another window does not lift it."""
    deps = fake_deps(fakes_on_path, store, claude(name="claude"))
    sched, fired = fired_schedule(deps, git_repo, "fake:recorded-oauth-spend")
    with trio.fail_after(6 * 3600):   # MockClock time
        async with trio.open_nursery() as nursery:
            await actors(deps, nursery)
            limited = await ended_as(deps, fired, "failed")
            waiting = dispatch_run(deps, git_repo, "claude", "fake:success")
            deps.claim_wake.poke()
            await trio.sleep(5 * 3600)   # past the 5-hour window the CLI's event named
            assert run(deps, waiting)["status"] == "queued", "a paused profile starts nothing"
            state = only(call(store, store.runs.profile_states, ["claude"], deps.clock.now()))
            assert state["paused_reason"] and "spend limit" in state["paused_reason"]
            call(store, store.runs.resume_profile, "claude", deps.clock.now())
            deps.claim_wake.poke()
            await until(lambda: run(deps, waiting)["status"] == "succeeded")
            nursery.cancel_scope.cancel()
    assert (limited["failure_kind"], limited["agent_report"]["limit"]["resets_at"]) == ("limit", None)
    (item,) = [a for a in call(store, store.list_attention, False) if a["kind"] == "agent_limited"]
    assert "spend limit" in item["title"] and "admin" in item["detail"] and "resume" in item["detail"]
    assert call(store, store.schedules.get_schedule, sched["id"])["failure_streak"] == 0


async def test_an_expired_login_refused_with_403_pauses_the_profile(autojump_clock, fakes_on_path, store, git_repo):
    deps = fake_deps(fakes_on_path, store, claude(name="claude"))
    run_id = dispatch_run(deps, git_repo, "claude", "fake:recorded-403")
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            await actors(deps, nursery)
            failed = await ended_as(deps, run_id, "failed")
            nursery.cancel_scope.cancel()
    assert failed["failure_kind"] == "auth"
    assert only(call(store, store.runs.profile_states, ["claude"], deps.clock.now()))["paused_reason"]


async def test_the_log_of_a_3_mib_run_ends_with_the_agents_last_line(autojump_clock, fakes_on_path, store, git_repo):
    deps = fake_deps(fakes_on_path, store, claude(name="claude"))
    run_id = dispatch_run(deps, git_repo, "claude", "fake:big-output")
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            await actors(deps, nursery)
            done = await until(lambda: (r := run(deps, run_id))["status"] in ("succeeded", "failed") and r)
            nursery.cancel_scope.cancel()
    assert done["status"] == "succeeded", done["error"]
    assert done["agent_report"]["final_message"] == "the end of a big run"
    text = deps.log_path(run_id).read_text()
    assert len(text.encode()) <= outpost.MAX_LOG_BYTES + 100 and "bytes cut ..." in text
    last = json.loads(text.rstrip("\n").splitlines()[-1])
    assert (last["type"], last["result"]) == ("result", "the end of a big run")


async def office_session(deps: outpost.Deps, repo: Path, description: str) -> tuple[str, str, list[dict]]:
    """An Office worker on the claude profile, assigned one task: (agent id, task id, its wakeups)."""
    conftest.set_settings(deps.store, repository=str(repo))
    worker = conftest.new_agent(deps.store, "Worker", deps.clock.now(), profiles=("demo", "claude"),
                                executor="claude", cooldown_sec=0)
    tid = conftest.new_task(deps.store, "Write the notes", deps.clock.now(), description=description,
                            assignee_agent_id=worker)
    return worker, tid, conftest.wakeups(deps.store, worker)


async def first_then_a_comment(deps: outpost.Deps, worker: str, tid: str, first: dict) -> dict:
    """Runs the first wakeup of an office_session to its end, then a comment on the task ("go on")
    to its own: the comment's wakeup."""
    store = deps.store
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            await actors(deps, nursery)
            await until(lambda: conftest.wakeup(store, first["id"])["status"] == "finished")
            call(store, store.office.add_comment, tid, "fake:success please go on", deps.clock.now())
            deps.claim_wake.poke()
            comment = only(conftest.wakeups(store, worker, source="comment"))
            await until(lambda: conftest.wakeup(store, comment["id"])["status"] == "finished")
            nursery.cancel_scope.cancel()
    return comment


async def test_office_task_sessions_share_one_worktree_and_branch_and_resume(autojump_clock, fakes_on_path, store,
                                                                             git_repo):
    """docs/agent-clis.md: the runs of one (agent, task) share one worktree path and branch, each
    continuing from the branch's head, so the resumed CLI finds its session (by directory)
    and its earlier edits."""
    deps = fake_deps(fakes_on_path, store, claude(name="claude"))
    worker, tid, (first,) = await office_session(deps, git_repo, "fake:success\nfake-write: notes.txt first draft")
    comment = await first_then_a_comment(deps, worker, tid, first)
    run1 = conftest.office_run(store, conftest.wakeup(store, first["id"])["run_id"])
    run2 = conftest.office_run(store, conftest.wakeup(store, comment["id"])["run_id"])
    assert run1["status"] == run2["status"] == "succeeded"
    branch = f"outpost/office/{tid}/worker"
    assert run1["result_branch"] == run2["result_branch"] == branch
    first_call, second_call = calls(fakes_on_path, "claude")
    assert first_call["cwd"] == second_call["cwd"] == str(deps.worktree(run1["id"], branch))
    session = run1["agent_report"]["session_id"]
    assert second_call["argv"][second_call["argv"].index("--resume") + 1] == session
    assert run2["agent_report"]["session_id"] == session and run2["resumed"] is True
    assert "notes.txt" in run2["agent_report"]["final_message"].partition("saw ")[2]   # it saw its earlier edit
    assert conftest.git(git_repo, "show", f"{branch}:notes.txt") == "first draft"
    # the second run started from the branch's head (the first run's saved edit), and added nothing
    assert run2["resolved_commit"] == conftest.git(git_repo, "rev-parse", branch) != run1["resolved_commit"]
    assert run2["changes"]["commits"] == 0
    assert not deps.worktree(run1["id"], branch).exists(), "removed between runs; the branch stays"


async def test_an_office_wakeup_whose_profile_hit_a_spend_limit_waits_for_the_resume(autojump_clock, fakes_on_path,
                                                                                     store, git_repo):
    deps = fake_deps(fakes_on_path, store, claude(name="claude"))
    worker, tid, (first,) = await office_session(deps, git_repo, "fake:recorded-oauth-spend")
    with trio.fail_after(2 * 3600):   # MockClock time
        async with trio.open_nursery() as nursery:
            await actors(deps, nursery)
            first_run = await until(lambda: conftest.wakeup(store, first["id"])["run_id"])
            spent = await until(lambda: (r := run(deps, first_run))["status"] == "failed" and r)
            await trio.sleep(3600)
            nursery.cancel_scope.cancel()
    assert spent["failure_kind"] == "limit"
    waiting = conftest.wakeup(store, first["id"])   # claimed again: its new run waits for the resume
    assert waiting["retry_count"] == 0 and waiting["run_id"] != spent["id"]
    assert run(deps, waiting["run_id"])["status"] == "queued"
    events = call(store, store.events_after, 0, 1000)["events"]
    assert any("spend limit" in e["data"].get("reason", "") for e in events if e["type"] == "wakeup.waiting")


async def test_a_dead_session_falls_back_to_one_fresh_run_without_a_retry(autojump_clock, fakes_on_path, store,
                                                                         git_repo):
    deps = fake_deps(fakes_on_path, store, claude(name="claude"))
    worker, tid, (first,) = await office_session(deps, git_repo, "fake:success")
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            await actors(deps, nursery)
            await until(lambda: conftest.wakeup(store, first["id"])["status"] == "finished")
            for path in sorted((fakes_on_path / "home" / ".claude" / "fake-sessions").rglob("*"), reverse=True):
                path.unlink() if path.is_file() else path.rmdir()   # the CLI forgot every session
            call(store, store.office.add_comment, tid, "fake:success again", deps.clock.now())
            deps.claim_wake.poke()
            comment = only(conftest.wakeups(store, worker, source="comment"))
            await until(lambda: conftest.wakeup(store, comment["id"])["status"] == "finished")
            nursery.cancel_scope.cancel()
    done = conftest.wakeup(store, comment["id"])
    assert done["retry_count"] == 0
    fresh = conftest.office_run(store, done["run_id"])
    assert fresh["status"] == "succeeded" and fresh["resumed"] is False
    argvs = [c["argv"] for c in calls(fakes_on_path, "claude")]
    assert len(argvs) == 3 and "--resume" in argvs[1] and "--resume" not in argvs[2]
    assert any(a["code"] == "session_dropped" for a in conftest.activity(store, "session_dropped"))


###############################################################################
# Needs-you and replies (docs/agent-clis.md), end to end on the real server
###############################################################################

ASKER = """import json, os, sys, urllib.request
sys.stdin.read()
request = urllib.request.Request(os.environ["OUTPOST_API_URL"] + "/api/agent/needs-you", method="POST",
    data=json.dumps({"question": "Which database may I migrate?"}).encode(),
    headers={"Authorization": "Bearer " + os.environ["OUTPOST_RUN_TOKEN"], "Content-Type": "application/json"})
urllib.request.urlopen(request, timeout=30).read()
print("asked")
"""


def fake_server(server_factory, tmp_path: Path, toml: str):
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "outpost.toml").write_text(toml)
    home = tmp_path / "home"
    log = home / ".claude" / "fake-cli-log"   # writable from inside the sandbox (a CLI state folder)
    log.mkdir(parents=True, exist_ok=True)
    return server_factory(data_dir=data, env={"PATH": f"{FAKES}{os.pathsep}{os.environ['PATH']}",
                                              "HOME": str(home), "FAKE_CLI_LOG": str(log)})


def settled_run(client, run_id: str) -> dict:
    return conftest.wait_for(lambda: (r := client.get(f"/v1/outpost/runs/{run_id}").json())["status"]
                             in conftest.SETTLED and r, timeout_s=60)


def post(client, path: str, body: dict):
    import uuid
    return client.post(path, json=body, headers={"Idempotency-Key": uuid.uuid4().hex})


def test_a_needs_you_run_is_adopted_and_answered_by_a_continuation_on_its_branch(server_factory, tmp_path):
    repo = conftest.make_repo(tmp_path / "repo")
    server = fake_server(server_factory, tmp_path, f"""
[agents.claude]
preset = "claude-code"
pass_env = ["PATH", "HOME", "FAKE_CLI_LOG"]

[agents.asker]
command = [{json.dumps(os.sys.executable)}, "-c", {json.dumps(ASKER)}]
""")
    with server.client() as client:
        # Claude's permission denials on a successful result: the run needs a human.
        run_id = post(client, "/v1/outpost/dispatches", {"brief": "fake:permission-denials", "repository": str(repo),
                                                         "agent": "claude"}).json()["run_id"]
        asked = settled_run(client, run_id)
        assert asked["status"] == "needs_you" and "Bash" in asked["question"]
        refused = post(client, f"/v1/outpost/runs/{run_id}/reply", {"message": "go on"})
        assert refused.status_code == 409 and "adopt" in refused.json()["detail"]
        assert post(client, f"/v1/outpost/runs/{run_id}/adopt", {"workspace": "team"}).status_code == 200
        reply = post(client, f"/v1/outpost/runs/{run_id}/reply", {"message": "fake:success Bash is fine, go on"})
        assert reply.status_code == 202
        answer = settled_run(client, reply.json()["run_id"])
        assert answer["status"] == "succeeded", answer["error"]
        assert (answer["status"], answer["trigger"], answer["continues"]) == ("succeeded", "reply", run_id)
        assert answer["result_branch"] == asked["result_branch"]
        assert answer["agent_report"]["session_id"] == asked["agent_report"]["session_id"]
        assert client.get(f"/v1/outpost/runs/{run_id}").json()["answered_by"] == answer["id"]
        again = post(client, f"/v1/outpost/runs/{run_id}/reply", {"message": "twice?"})
        assert again.status_code == 409
        # A script that asks through the run-scoped API.
        script_run = post(client, "/v1/outpost/dispatches", {"brief": "work", "repository": str(repo),
                                                             "agent": "asker"}).json()["run_id"]
        asked = settled_run(client, script_run)
        assert (asked["status"], asked["question"]) == ("needs_you", "Which database may I migrate?")
        assert post(client, f"/v1/outpost/runs/{script_run}/adopt", {"workspace": "team"}).status_code == 200
        reply = post(client, f"/v1/outpost/runs/{script_run}/reply", {"message": "the staging one"})
        continued = settled_run(client, reply.json()["run_id"])
        assert (continued["trigger"], continued["result_branch"]) == ("reply", asked["result_branch"])
    resumed = calls(tmp_path / "home" / ".claude" / "fake-cli-log", "claude")[-1]
    assert resumed["argv"][resumed["argv"].index("--resume") + 1] == answer["agent_report"]["session_id"]
    assert resumed["stdin"].startswith("fake:success Bash is fine")


###############################################################################
# The profile in a schedule's authority (docs/agent-clis.md), and outpost doctor
###############################################################################

def test_a_changed_profile_holds_the_schedules_fires_until_it_is_confirmed_again(store, git_repo):
    before = preset_profile("claude-code")
    after = dataclasses.replace(before, command=(*before.command, "--max-turns", "50"))
    digests = {"claude-code": outpost.profile_digest(before)}
    definition = outpost.normalize_definition(conftest.definition(
        git_repo, agent="claude-code", timing={"kind": "interval", "seconds": 3600, "timezone": "UTC"}),
        T0, agents=digests)
    sched = call(store, store.schedules.create_schedule, definition, T0, digests["claude-code"])
    assert sched["authority"]["profile_digest"] == digests["claude-code"]
    changed = {"claude-code": outpost.profile_digest(after)}
    assert changed != digests
    for hour in (1, 2):   # two fires held, one item
        assert call(store, store.schedules.claim_due, T0 + timedelta(hours=hour), digests=changed) == []
    ledger = call(store, store.schedules.occurrences, sched["id"], 10)
    assert [o["outcome"] for o in ledger] == ["held_reconfirm", "held_reconfirm"]
    items = [a for a in call(store, store.list_attention, True) if a["kind"] == "reconfirm"]
    assert len(items) == 1 and items[0]["schedule_id"] == sched["id"]
    with pytest.raises(outpost.Conflict):
        call(store, store.schedules.fire_manual, sched["id"], 1, T0 + timedelta(hours=2), changed)
    # Confirming the same definition again, under the profile as it is now, releases it.
    call(store, store.schedules.update_schedule, sched["id"], 1, definition, T0 + timedelta(hours=2),
         changed["claude-code"])
    assert len(call(store, store.schedules.claim_due, T0 + timedelta(hours=3), digests=changed)) == 1
    # An unchanged profile never holds anything.
    assert outpost.profile_digest(preset_profile("claude-code")) == digests["claude-code"]


def test_the_reconfirm_item_closes_once_the_schedule_is_confirmed_again(store, git_repo):
    """Issue 24.6e: the ``reconfirm`` attention item stayed open after the schedule had been
    reviewed and confirmed again; confirming it closes the item."""
    before = preset_profile("claude-code")
    after = dataclasses.replace(before, command=(*before.command, "--max-turns", "50"))
    definition = outpost.normalize_definition(conftest.definition(
        git_repo, agent="claude-code", timing={"kind": "interval", "seconds": 3600, "timezone": "UTC"}),
        T0, agents=["claude-code"])
    sched = call(store, store.schedules.create_schedule, definition, T0, outpost.profile_digest(before))
    changed = {"claude-code": outpost.profile_digest(after)}
    assert call(store, store.schedules.claim_due, T0 + timedelta(hours=1), digests=changed) == []
    (item,) = [a for a in call(store, store.list_attention, True) if a["kind"] == "reconfirm"]
    call(store, store.schedules.update_schedule, sched["id"], 1, definition, T0 + timedelta(hours=1, minutes=5),
         changed["claude-code"])
    assert [a for a in call(store, store.list_attention, True) if a["kind"] == "reconfirm"] == []
    closed = call(store, store.ack_attention, item["id"], T0 + timedelta(hours=2))
    assert closed["acknowledged_at"] == outpost.rfc3339(T0 + timedelta(hours=1, minutes=5))


def doctor(tmp_path: Path, toml: str, **env: str) -> subprocess.CompletedProcess:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    (data / "outpost.toml").write_text(toml)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    return subprocess.run([os.sys.executable, str(conftest.OUTPOST_PY), "doctor", "--data-dir", str(data)],
                          capture_output=True, text=True, timeout=60,
                          env=fake_env(home) | env)


def test_doctor_prints_one_clear_line_per_profile(tmp_path):
    done = doctor(tmp_path, """
[agents.claude]
preset = "claude-code"
pass_env = ["PATH", "HOME", "ANTHROPIC_API_KEY"]

[agents.codex]
preset = "codex"

[agents.missing]
command = ["no-such-agent-cli", "--go"]
""", ANTHROPIC_API_KEY="sk-test")
    lines = dict(line.split(": ", 1) for line in done.stdout.strip().splitlines())
    assert sorted(lines) == ["claude", "codex", "demo", "missing"]
    assert lines["claude"].startswith("ok, 2.1.197 (Claude Code)") and "ANTHROPIC_API_KEY" in lines["claude"]
    assert "codex-cli 0.171.0" in lines["codex"] and "no login found" in lines["codex"] and "codex login" in lines[
        "codex"]
    assert "'no-such-agent-cli' not found" in lines["missing"]
    assert lines["demo"].startswith("ok")
    assert done.returncode == 1 and done.stderr == ""


def test_doctor_exits_0_when_every_profile_is_usable(tmp_path):
    (tmp_path / "home" / ".codex").mkdir(parents=True)
    (tmp_path / "home" / ".codex" / "auth.json").write_text("{}")
    done = doctor(tmp_path, '[agents.codex]\npreset = "codex"\n')
    assert done.returncode == 0, done.stdout
    assert "codex: ok, codex-cli 0.171.0" in done.stdout and ".codex/auth.json" in done.stdout


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


#: preset -> (what the user set up, in HOME or the environment; what doctor names as the login)
LOGINS = {
    "claude apiKeyHelper": ("claude-code", {".claude/settings.json": '{"apiKeyHelper": "~/bin/print-key"}'}, {},
                            "apiKeyHelper"),
    "claude Bedrock in settings": ("claude-code", {".claude/settings.json": json.dumps(
        {"env": {"CLAUDE_CODE_USE_BEDROCK": "1", "AWS_REGION": "us-east-1"}})}, {}, "CLAUDE_CODE_USE_BEDROCK"),
    "claude Bedrock": ("claude-code", {}, {"CLAUDE_CODE_USE_BEDROCK": "1", "AWS_PROFILE": "dev"},
                       "CLAUDE_CODE_USE_BEDROCK"),
    "claude Vertex": ("claude-code", {}, {"CLAUDE_CODE_USE_VERTEX": "1", "ANTHROPIC_VERTEX_PROJECT_ID": "p"},
                      "CLAUDE_CODE_USE_VERTEX"),
    "claude auth token": ("claude-code", {}, {"ANTHROPIC_AUTH_TOKEN": "t"}, "ANTHROPIC_AUTH_TOKEN"),
    "claude login": ("claude-code", {".claude/.credentials.json": "{}"}, {}, ".claude/.credentials.json"),
    "codex auth.json": ("codex", {".codex/auth.json": '{"OPENAI_API_KEY": "sk-x"}'}, {}, "auth.json"),
    "codex CODEX_HOME": ("codex", {"codex-home/auth.json": '{"tokens": {}}'}, {"CODEX_HOME": "{home}/codex-home"},
                         "auth.json"),
    "codex own provider": ("codex", {".codex/config.toml": 'model_provider = "azure"\n[model_providers.azure]\n'
                                     'name = "Azure"\nenv_key = "AZURE_OPENAI_API_KEY"\n'},
                           {"AZURE_OPENAI_API_KEY": "k"}, "azure"),
    "gemini Vertex": ("gemini", {}, {"GOOGLE_GENAI_USE_VERTEXAI": "true", "GOOGLE_CLOUD_PROJECT": "p"},
                      "GOOGLE_GENAI_USE_VERTEXAI"),
    "gemini service account": ("gemini", {"sa.json": "{}"}, {"GOOGLE_APPLICATION_CREDENTIALS": "{home}/sa.json"},
                               "GOOGLE_APPLICATION_CREDENTIALS"),
    "gemini gcloud ADC": ("gemini", {".config/gcloud/application_default_credentials.json": "{}"}, {},
                          "application_default_credentials.json"),
    "gemini key in .env": ("gemini", {".gemini/.env": "GEMINI_API_KEY=abc\n"}, {}, ".gemini/.env"),
    "gemini Google login": ("gemini", {".gemini/oauth_creds.json": "{}"}, {}, "oauth_creds.json"),
}


@pytest.mark.parametrize("setup", sorted(LOGINS))
def test_doctor_recognises_the_logins_a_user_may_have(tmp_path, setup):
    preset, files, env, named = LOGINS[setup]
    home = tmp_path / "home"
    for path, text in files.items():
        write(home / path, text)
    env = {k: v.replace("{home}", str(home)) for k, v in env.items()}
    pass_env = json.dumps(["PATH", "HOME", *env])
    done = doctor(tmp_path, f'[agents.a]\npreset = "{preset}"\npass_env = {pass_env}\n', **env)
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("a: "))
    assert line.startswith("a: ok,") and named in line, line
    assert done.returncode == 0


def test_doctor_says_no_login_when_there_is_none(tmp_path):
    write(tmp_path / "home" / ".claude" / "settings.json", '{"env": {"DISABLE_TELEMETRY": "1"}}')
    done = doctor(tmp_path, '[agents.a]\npreset = "claude-code"\n\n[agents.g]\npreset = "gemini"\n')
    lines = dict(line.split(": ", 1) for line in done.stdout.strip().splitlines())
    assert "no login found" in lines["a"] and "no login found" in lines["g"]
    assert done.returncode == 1


###############################################################################
# Budgets in dollars (the Office spec's budget pre-check, with recorded cost)
###############################################################################

def office_with_budget(store, repo, *, action: str = "pause", **agent_budget) -> tuple[str, str]:
    conftest.set_settings(store, repository=str(repo), budget_action=action)
    lead = conftest.new_agent(store, "Lead", T0, role="coordinator")
    worker = conftest.new_agent(store, "Worker", T0, cooldown_sec=0, **agent_budget)
    return lead, worker


def costly_task(store, worker: str, minute: int, cost: float) -> str:
    """Assign a task, dispatch its wakeup and settle its run as having cost ``cost`` dollars."""
    now = T0 + timedelta(minutes=minute)
    conftest.new_task(store, f"task {minute}", now, assignee_agent_id=worker)
    runs = [r for r in call(store, store.pipeline.dispatch_wakeups, now, {"demo": outpost.demo_profile()})[0]
            if conftest.office_run(store, r)["agent_id"] == worker]
    for run_id in runs:
        conftest.start(store, run_id, now)
        reading = outpost.Reading("claude-code", verdict="succeeded", cost_usd=cost)
        call(store, store.runs.settle_run, run_id, outpost.Outcome(outpost.RunStatus.SUCCEEDED, None, reading=reading),
             now + timedelta(seconds=30))
    return runs[0] if runs else ""


def test_a_dollar_budget_alerts_at_80_percent_once_then_pauses_the_agent(store, git_repo):
    lead, worker = office_with_budget(store, git_repo, budget_usd_per_day=1.0)
    assert costly_task(store, worker, 1, 0.5)
    assert conftest.wakeups(store, lead, source="budget_alert") == []
    assert costly_task(store, worker, 2, 0.35)   # 85 %: the coordinator hears of it
    alert = only(conftest.wakeups(store, lead, source="budget_alert"))
    assert alert["payload"] == {"agent_instance_id": worker, "budget_pct": 85}
    assert costly_task(store, worker, 3, 0.2)    # 0.85 < 1: still allowed; 1.05 after it
    assert len(conftest.wakeups(store, lead, source="budget_alert")) == 1, "once per window"
    assert costly_task(store, worker, 4, 0.1) == ""   # the pre-check reads the cost already spent
    blocked = only(conftest.wakeups(store, worker, status="skipped"))
    assert "$1.00 per day is used up ($1.05 spent)" in blocked["note"]
    assert call(store, store.office.get_agent, worker)["status"] == "paused"
    assert [a["kind"] for a in call(store, store.list_attention, True)] == ["budget_blocked"]


def test_a_budget_whose_action_is_skip_skips_the_wakeup_and_logs_it(store, git_repo):
    _, worker = office_with_budget(store, git_repo, action="skip", budget_usd_per_month=2.0)
    assert costly_task(store, worker, 1, 2.5)
    assert costly_task(store, worker, 2, 0.1) == ""
    skipped = only(conftest.wakeups(store, worker, status="skipped"))
    assert "$2.00 per month is used up" in skipped["note"]
    assert call(store, store.office.get_agent, worker)["status"] != "paused"
    assert only(conftest.activity(store, "wakeup_budget_skipped"))["wakeup_id"] == skipped["id"]
    assert call(store, store.list_attention, True) == []


def test_a_project_budget_counts_only_its_tasks(store, git_repo):
    _, worker = office_with_budget(store, git_repo)
    project = call(store, store.office.create_project, None, "Site", None, None, T0,
                   outpost.budget_fields({"budget_usd_per_day": 1.0}, 1000))
    now = T0 + timedelta(minutes=1)
    conftest.new_task(store, "in the project", now, assignee_agent_id=worker, project_id=project["id"])
    (run_id,) = call(store, store.pipeline.dispatch_wakeups, now, {"demo": outpost.demo_profile()})[0]
    conftest.start(store, run_id, now)
    call(store, store.runs.settle_run, run_id, outpost.Outcome(outpost.RunStatus.SUCCEEDED, None,
                                                               reading=outpost.Reading(
        "claude-code", verdict="succeeded", cost_usd=1.5)), now)
    assert costly_task(store, worker, 5, 0.1), "a task outside the project is not held by its budget"
    later = T0 + timedelta(minutes=9)
    conftest.new_task(store, "more in the project", later, assignee_agent_id=worker, project_id=project["id"])
    assert call(store, store.pipeline.dispatch_wakeups, later, {"demo": outpost.demo_profile()})[0] == []
    assert "project budget of $1.00 per day" in only(conftest.wakeups(store, worker, status="skipped"))["note"]


@pytest.mark.parametrize(("field", "value"), [("budget_usd_per_day", 0), ("budget_usd_per_month", "5"),
                                              ("budget_usd_per_day", True)])
def test_a_bad_dollar_budget_is_refused_naming_its_field(field, value):
    with pytest.raises(outpost.ValidationFailed) as err:
        outpost.normalize_agent({"name": "a", field: value}, profiles=["demo"])
    assert err.value.errors[0]["field"] == field


def test_a_run_over_its_max_cost_is_marked_over_budget(store, git_repo):
    payload = outpost.normalize_dispatch({"brief": "x", "repository": str(git_repo), "agent": "demo",
                                          "limits": {"max_cost_usd": 0.01}}, T0, agents=["demo"])
    run_id = call(store, store.schedules.create_dispatch, payload, T0)["run_id"]
    conftest.start(store, run_id, T0)
    call(store, store.runs.settle_run, run_id, outpost.Outcome(outpost.RunStatus.SUCCEEDED, None,
                                                               reading=outpost.Reading(
        "claude-code", verdict="succeeded", cost_usd=0.0123)), T0)
    view = call(store, store.runs.get_run, run_id)
    assert (view["max_cost_usd"], view["cost_usd"], view["over_budget"]) == (0.01, 0.0123, True)


###############################################################################
# What an agent prints is untrusted (docs/security.md): no line of it takes a run or the daemon down
###############################################################################


def test_400_mb_without_a_newline_is_read_in_linear_time_and_kept_to_a_bound():
    lines, chunk = outpost.OutputLines(), b"x" * 65536
    started = time.monotonic()
    for _ in range(400 * 1024 * 1024 // len(chunk)):
        lines.feed(chunk)
        assert time.monotonic() - started < 5, "the event loop would stall: each chunk copies the line so far"
    lines.feed(b'\n{"status": "succeeded"}\n')
    first, last = lines.lines()
    assert len(first.encode()) == outpost.OUTPUT_LINE_BYTES
    assert last == '{"status": "succeeded"}'


def test_what_is_kept_of_stdout_stays_bounded_however_many_long_lines_a_run_prints():
    """Found by attack: the first 200 lines were kept whole, each up to 4 MiB: 800 MiB of one run."""
    lines, long_line = outpost.OutputLines(), b"y" * (outpost.OUTPUT_LINE_BYTES - 1) + b"\n"
    lines.feed(b'{"type": "system", "subtype": "init", "session_id": "s-1"}\n')
    for _ in range(30):
        lines.feed(long_line)
    lines.feed(b'{"status": "succeeded"}\n')
    kept = lines.lines()
    assert sum(len(line) for line in kept) <= outpost.OUTPUT_HEAD_BYTES + outpost.OUTPUT_TAIL_BYTES
    assert (kept[0], kept[-1]) == ('{"type": "system", "subtype": "init", "session_id": "s-1"}',
                                   '{"status": "succeeded"}')   # the session first, the result last


#: What an agent's CLI really prints, at its largest: a long session's events in one JSON array
#: (Claude's ``--output-format json --verbose``), mostly text between the brackets.
LONG_SESSION = json.dumps([{"type": "assistant", "message": {"id": f"msg_{i}", "content": [
    {"type": "tool_use", "id": f"toolu_{i}", "name": "Bash", "input": {"command": f"ls -la src/{i}"}}]}}
    for i in range(20_000)] + [{"type": "result", "subtype": "success", "is_error": False, "result": "Done."}])


def test_json_that_is_mostly_brackets_is_read_as_text_and_real_events_as_json():
    """4 MiB of "[]," is 1.4 million Python lists (about 100 MB of the daemon's memory): not parsed."""
    brackets = '{"a": [' + "[]," * 1_400_000 + "[]]}"
    assert outpost.agent_json(brackets) is None
    assert outpost.agent_json('{"a": [' + "[]," * 1000 + "[]]}") == {"a": [[]] * 1001}   # a few are JSON
    assert outpost.agent_json(LONG_SESSION)[-1]["result"] == "Done."
    outcome = read_as_the_executor_does("claude-code", LONG_SESSION.splitlines())
    assert outcome.status == outpost.RunStatus.SUCCEEDED


def test_an_agent_that_prints_long_lines_of_brackets_leaves_the_daemon_s_memory_bounded(server_factory, git_repo,
                                                                                        tmp_path):
    """Found by attack: 30 lines of 4 MiB of JSON brackets took a daemon to 3.2 GB and held its
    event loop for 38 s; its watchdog would have killed it and every other run with it."""
    script = ("import sys\nline = b'{\"a\":[' + b'[],' * ((4 << 20) // 3 - 10) + b'[]]}\\n'\n"
              "for _ in range(30):\n    sys.stdout.buffer.write(line)\n"
              "print('{\"type\": \"result\", \"subtype\": \"success\", \"is_error\": false, \"result\": \"Done.\"}')\n")
    data = tmp_path / "data"
    data.mkdir()
    (data / "outpost.toml").write_text(f'[agents.brackets]\ncommand = ["python3", "-c", {json.dumps(script)}]\n'
                                       'preset = "claude-code"\n')
    server = server_factory(data_dir=data)
    with server.client() as client:
        before = peak_memory_kib(server.proc.pid)
        run_id = client.post("/v1/outpost/dispatches", headers={"Idempotency-Key": "brackets"}, json={
            "brief": "go", "repository": str(git_repo), "agent": "brackets"}).json()["run_id"]
        run = conftest.wait_for(lambda: (r := client.get(f"/v1/outpost/runs/{run_id}").json())["finished_at"] and r,
                                timeout_s=120)
        assert run["status"] == "succeeded", (run["error"], run.get("agent_report"))
        assert client.get("/healthz").status_code == 200
        grew_mib = (peak_memory_kib(server.proc.pid) - before) / 1024
    assert grew_mib < 200, f"the daemon's peak memory grew {grew_mib:.0f} MiB for one run's output"


def peak_memory_kib(pid: int) -> int:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(status["VmHWM"].split()[0])


def read_as_the_executor_does(preset: str, lines: list[str], exit_code: int = 0) -> outpost.Outcome:
    reading = outpost.PRESETS[preset].read(lines)
    return outpost.run_outcome(reading, exit_code, "", now=T0, tz=CHICAGO)


UUID = "ea2574c0-46e8-4c1d-adb8-23ae63f3de4e"


@pytest.mark.parametrize(("preset", "session"), [
    ("claude-code", "--dangerously-skip-permissions"), ("claude-code", "-r"), ("claude-code", f"{UUID} --x"),
    ("codex", "--dangerously-bypass-approvals-and-sandbox"), ("codex", "not-a-thread"),
    ("gemini", "--yolo"), ("gemini", UUID + "\n"),
    ("generic", "--help"), ("generic", "-"), ("generic", "a session; rm -rf ~"),
])
def test_a_session_id_not_of_the_clis_shape_is_never_resumed(preset, session):
    kind = {"claude-code": "system", "codex": "thread.started", "gemini": "init", "generic": None}[preset]
    field = "thread_id" if preset == "codex" else "session_id"
    first = {"type": kind, "subtype": "init", field: session} if kind else {"status": "succeeded", field: session}
    outcome = read_as_the_executor_does(preset, [json.dumps(first)])
    report = outcome.report()
    assert report["session_id"] is None
    assert "starts fresh" in report["session_refused"]
    # one stored before Outpost checked: the next run starts fresh all the same
    profile = preset_profile(preset, **({"command": ["my-agent"], "resume": ["my-agent", "--resume", "{session_id}"]}
                                        if preset == "generic" else {}))
    argv = outpost.profile_argv(profile, model=None, run_id="out_1", session_id=session, prompt_file=None,
                                max_cost_usd=None)
    assert session not in argv and argv == outpost.profile_argv(profile, model=None, run_id="out_1", session_id=None,
                                                                prompt_file=None, max_cost_usd=None)


@pytest.mark.parametrize(("preset", "session"), [
    ("claude-code", UUID), ("codex", "01a23257-d9e9-72f3-9736-8dc10144da9f"), ("generic", "demo-0123456789abcdef")])
def test_a_session_id_of_the_clis_shape_is_kept(preset, session):
    kind = {"claude-code": "system", "codex": "thread.started", "generic": None}[preset]
    field = "thread_id" if preset == "codex" else "session_id"
    first = {"type": kind, "subtype": "init", field: session} if kind else {"status": "succeeded", field: session}
    report = read_as_the_executor_does(preset, [json.dumps(first)]).report()
    assert (report["session_id"], report["session_refused"]) == (session, None)


async def test_a_session_id_shaped_like_an_option_never_reaches_the_resume(autojump_clock, fakes_on_path, store,
                                                                          git_repo):
    result = {"type": "result", "subtype": "success", "is_error": False, "result": "Done.",
              "session_id": "--dangerously-skip-permissions"}
    deps = fake_deps(fakes_on_path, store, claude(name="claude"))
    worker, tid, (first,) = await office_session(deps, git_repo, f"fake:lines\nfake-line: {json.dumps(result)}")
    comment = await first_then_a_comment(deps, worker, tid, first)
    second = conftest.office_run(store, conftest.wakeup(store, comment["id"])["run_id"])
    assert second["status"] == "succeeded" and second["resumed"] is False
    argvs = [c["argv"] for c in calls(fakes_on_path, "claude")]
    assert len(argvs) == 2 and not any("--resume" in a or "--dangerously-skip-permissions" in a for a in argvs)
    refused = conftest.activity(store, "session_refused")   # the brief prints it again in the second run
    assert refused and all("'--dangerously-skip-permissions'" in a["data"]["reason"] for a in refused)


#: A line nested past Python's recursion limit, a number past a float, a reset past any calendar.
DEEP = '{"a":' * 100_000 + "1" + "}" * 100_000
HUGE = "1" + "0" * 400
#: Lines no reader can hold, each with the line it would be with sane figures in it.
HOSTILE_LINES = {
    "nested too deep": (DEEP, '{"a": 1}'),
    "an array nested too deep": ("[" * 100_000 + "]" * 100_000, "[]"),
    "a cost past a float": tuple(
        '{"type": "result", "subtype": "success", "is_error": false, "result": "Done.", '
        f'"total_cost_usd": {n}, "cost_usd": {n}, "num_turns": {n}}}' for n in (HUGE, "1")),
    "a reset past any calendar": tuple(
        '{"type": "rate_limit_event", "rate_limit_info": {"status": "rejected", '
        f'"resetsAt": {n}, "rateLimitType": "five_hour"}}}}' for n in ("1e20", "1796115600")),
    "NaN and Infinity": ('{"type": "turn.completed", "usage": {"input_tokens": NaN, "output_tokens": Infinity}, '
                         '"stats": {"input_tokens": -Infinity}}',
                         '{"type": "turn.completed", "usage": {}, "stats": {}}'),
    "no object": ("[1, 2, 3]", "[1, 2, 3]"),
}


def success_lines(preset: str) -> list[str]:
    """What the CLI printed in a successful run: its recording (the demo agent's line for generic)."""
    if preset == "generic":
        return ['{"status": "succeeded", "summary": "done", "session_id": "demo-0123456789abcdef"}']
    name = {"claude-code": "claude-success", "codex": "codex-success", "gemini": "gemini-success-auto",
            "aider": "aider-success"}[preset]
    return recording(name)["stdout"].splitlines()


def strict_json(outcome: outpost.Outcome) -> str:
    """The report and result as the store keeps them and the API serves them: JSON a browser reads."""
    return json.dumps([outcome.report(), outcome.reading.result], allow_nan=False)


@pytest.mark.parametrize("hostile", sorted(HOSTILE_LINES))
@pytest.mark.parametrize("preset", sorted(outpost.PRESETS))
def test_a_line_no_reader_can_hold_leaves_the_run_as_the_rest_of_its_output_says(preset, hostile):
    line, sane = HOSTILE_LINES[hostile]
    expected = read_as_the_executor_does(preset, [*success_lines(preset), sane])
    outcome = read_as_the_executor_does(preset, [*success_lines(preset), line])
    assert (outcome.status, outcome.error) == (expected.status, expected.error)
    strict_json(outcome)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "-1", "-0.5", "1e300", "1e400", HUGE])
def test_a_cost_that_is_no_amount_of_money_is_not_kept(value):
    claude = read_as_the_executor_does("claude-code", [
        f'{{"type": "result", "subtype": "success", "is_error": false, "result": "Done.", "total_cost_usd": {value}}}'])
    generic = read_as_the_executor_does("generic", [f'{{"status": "succeeded", "cost_usd": {value}}}'])
    for outcome in (claude, generic):
        assert outcome.status == outpost.RunStatus.SUCCEEDED
        assert outcome.report()["cost_usd"] is None
        strict_json(outcome)


@pytest.mark.parametrize("value", ["NaN", "-5", "1.5", "1e400", HUGE, "true"])
def test_a_token_count_that_is_no_count_is_not_kept(value):
    usage = f'{{"input_tokens": {value}, "output_tokens": {value}, "cache_read_input_tokens": {value}}}'
    outcomes = [
        read_as_the_executor_does("claude-code", [f'{{"type": "result", "subtype": "success", "is_error": false, '
                                                  f'"num_turns": {value}, "usage": {usage}}}']),
        read_as_the_executor_does("codex", [f'{{"type": "turn.completed", "usage": {usage}}}']),
        read_as_the_executor_does("gemini", [f'{{"type": "result", "status": "success", "stats": {usage}}}'])]
    for outcome in outcomes:
        report = outcome.report()
        assert (report["input_tokens"], report["output_tokens"], report["cache_read_tokens"]) == (None, None, None)
        assert report["turns"] in (None, 1)   # codex counts its turn.completed events itself
        strict_json(outcome)


def test_a_reset_past_any_calendar_is_a_limit_with_no_reset():
    outcome = read_as_the_executor_does("claude-code", [
        HOSTILE_LINES["a reset past any calendar"][0],
        '{"type": "result", "subtype": "success", "is_error": true, "result": "Claude AI usage limit reached"}'], 1)
    assert (outcome.status, outcome.failure_kind, outcome.limit.resets_at) == (outpost.RunStatus.FAILED, "limit", None)


@pytest.mark.parametrize("text", [
    f"usage limit reached, resets_in_seconds: {HUGE}",
    "rate limit reached, try again in 99999999999999 days",
    "usage limit reached; try again at 9999-12-31T23:59:59-05:00",
    "You've hit your weekly limit · resets Dec 31, 9999, 11pm (America/Chicago)",
])
def test_a_limit_text_naming_a_reset_past_any_calendar_names_none(text):
    limit = outpost.find_limit(text, T0, CHICAGO)
    assert limit is not None and limit.resets_at is None
    assert outpost.limit_wait(limit, 0, T0, 0.0) > T0


@pytest.mark.parametrize("preset", ["claude-code", "gemini", "generic"])
def test_a_lone_surrogate_in_an_error_is_kept_as_text_the_store_can_write(preset):
    line = {"claude-code": '{"type": "result", "subtype": "success", "is_error": true, "result": "\\ud800 broke"}',
            "gemini": '{"type": "result", "status": "error", "error": {"message": "\\ud800 broke"}}',
            "generic": '{"status": "failed", "error": "\\ud800 broke"}'}[preset]
    outcome = read_as_the_executor_does(preset, [line])
    assert outcome.status == outpost.RunStatus.FAILED and "broke" in outcome.error
    outcome.error.encode()   # what SQLite and PostgreSQL are given is UTF-8
    json.dumps(outcome.reading.result, ensure_ascii=False).encode()


ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)
#: Field names and values the readers look at, so a random event reaches their branches.
FIELDS = st.sampled_from(["type", "subtype", "session_id", "thread_id", "total_cost_usd", "cost_usd", "usage",
                          "input_tokens", "num_turns", "stats", "models", "roles", "tokens", "rate_limit_info",
                          "resetsAt", "status", "message", "content", "error", "errors", "item", "text", "result",
                          "is_error", "api_error_status", "mcp_servers", "permission_denials", "delta", "response"])
KINDS = st.sampled_from(["system", "init", "assistant", "user", "result", "rate_limit_event", "thread.started",
                         "item.completed", "turn.completed", "turn.failed", "error", "message", "agent_message"])
NUMBERS = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e400", HUGE, "-" + HUGE, "1e300", "-1"])
EVENT = st.recursive(
    st.one_of(ANY_JSON, KINDS),
    lambda inner: st.dictionaries(FIELDS | st.text(max_size=4), inner, max_size=6) | st.lists(inner, max_size=3),
    max_leaves=30)


def hostile_line(draw) -> str:
    line = json.dumps(draw(EVENT))   # NaN and Infinity come out as Python writes them
    if draw(st.booleans()):   # a number no float holds, where a number was
        line = re.sub(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?", draw(NUMBERS), line, count=1)
    return draw(st.sampled_from([line, line.replace('"', '"\\ud800', 1), DEEP, "[" * 5000, line[:-1],
                                 f'{{"type": "result", "result": "{"x" * 10_000}"}}', "Tokens: 1.2.3 sent",
                                 f"Tokens: {HUGE} sent, 1 received. Cost: ${HUGE} message, $1 session."]))


@st.composite
def hostile_output(draw) -> list[str]:
    return [hostile_line(draw) for _ in range(draw(st.integers(1, 6)))]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=hostile_output(), preset=st.sampled_from(sorted(outpost.PRESETS)))
def test_no_output_makes_a_reader_raise_and_every_number_kept_is_finite(lines, preset):
    outcome = read_as_the_executor_does(preset, lines, exit_code=0)
    report = outcome.report()
    strict_json(outcome)
    json.dumps(report, ensure_ascii=False).encode()
    for field in ("cost_usd", "turns", "input_tokens", "output_tokens", "cache_read_tokens"):
        assert report[field] is None or 0 <= report[field] < math.inf
    assert outcome.limit is None or outcome.limit.resets_at is None or outcome.limit.resets_at.year <= outpost.MAX_YEAR


async def test_an_agent_that_prints_hostile_lines_fails_with_its_reason_and_the_daemon_serves_on(
        autojump_clock, fakes_on_path, store, git_repo):
    result = {"type": "result", "subtype": "success", "is_error": True, "result": "the tests failed",
              "session_id": "--dangerously-skip-permissions"}
    deep = '{"a":' * 3000 + "1" + "}" * 3000   # past the recursion limit, within a brief's length
    printed = [deep, HOSTILE_LINES["a reset past any calendar"][0],
               json.dumps(result)[:-1] + f', "total_cost_usd": {HUGE}, "num_turns": NaN, "usage": '
                                         '{"input_tokens": Infinity, "output_tokens": -1}}']
    deps = fake_deps(fakes_on_path, store, claude(name="claude"))
    hostile = dispatch_run(deps, git_repo, "claude", "fake:lines\n" + "".join(f"fake-line: {p}\n" for p in printed))
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            await actors(deps, nursery)
            settled = await until(lambda: (r := run(deps, hostile))["status"] not in ("queued", "running") and r)
            after = dispatch_run(deps, git_repo, "claude", "fake:success")
            deps.claim_wake.poke()
            await ended_as(deps, after, "succeeded")
            nursery.cancel_scope.cancel()
    assert (settled["status"], settled["failure_kind"], settled["error"]) == ("failed", "agent", "the tests failed")
    assert settled["cost_usd"] is None and settled["agent_report"]["session_id"] is None
    json.dumps([run(deps, hostile), call(store, store.runs.list_runs, None, None, 50, None),
                call(store, store.runs.profile_states, ["claude"], deps.clock.now())], allow_nan=False)
