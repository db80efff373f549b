"""Outpost's own tools for agents (docs/agent-clis.md): ``outpost mcp`` driven by the MCP SDK's own
client against a real ``outpost serve``. A person's agent with a proposer key looks and proposes,
never decides; inside a run the tools follow the run token (an Office run's task tools, else only
ask_human), and a hostile agent's attempts to reach more are refused. The real CLIs' wiring is
tested end to end in tests/clis/test_mcp_clis.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import conftest
import httpx
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

import outpost

AGENT = Path(__file__).parent / "fakes" / "mcp_agent.py"
DEFINITION = {"name": "nightly", "brief": "Update the lockfile.", "agent": "demo",
              "timing": {"kind": "cron", "expression": "0 9 * * 1-5", "timezone": "Europe/Berlin"}}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTPOST_")}
    return env | extra


def post(client: httpx.Client, path: str, body: dict, **headers: str) -> httpx.Response:
    return client.post(path, json=body, headers={"Idempotency-Key": uuid.uuid4().hex, **headers})


def make_key(server: conftest.Server, name: str = "my-agent") -> str:
    """As a user does: ``outpost keys create --proposer``; the key is alone on the last line."""
    done = subprocess.run([sys.executable, str(conftest.OUTPOST_PY), "--data-dir", str(server.data_dir), "keys",
                           "create", "--proposer", "--name", name, "--url", server.url],
                          capture_output=True, text=True, env=clean_env(), timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


class Mcp:
    """One ``outpost mcp`` process and the SDK's client session to it."""

    def __init__(self, session: ClientSession):
        self.session = session

    async def tools(self) -> list[str]:
        return sorted(t.name for t in (await self.session.list_tools()).tools)

    async def call(self, name: str, **arguments) -> tuple[bool, str]:
        answer = await self.session.call_tool(name, arguments)
        return answer.is_error, "".join(getattr(c, "text", "") for c in answer.content)

    async def ok(self, name: str, **arguments) -> dict:
        error, text = await self.call(name, **arguments)
        assert not error, text
        return json.loads(text)


def mcp_for(env: dict[str, str]):
    """An async context: a session with ``outpost mcp`` started with ``env``."""
    import contextlib

    @contextlib.asynccontextmanager
    async def session():
        params = StdioServerParameters(command=sys.executable, args=[str(conftest.OUTPOST_PY), "mcp"], env=env)
        async with stdio_client(params) as (read, write), ClientSession(read, write) as s:
            await s.initialize()
            yield Mcp(s)
    return session()


@pytest.fixture
def served(server_factory, tmp_path):
    repo = conftest.make_repo(tmp_path / "repo")
    server = server_factory()
    return server, repo


def test_outpost_mcp_without_a_key_refuses_to_start_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(conftest.OUTPOST_PY), "--data-dir", str(tmp_path), "mcp"],
                          capture_output=True, text=True, env=clean_env(), timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == outpost.EXIT_NO_TOKEN
    assert done.stderr.count("\n") == 1 and "outpost keys create --proposer" in done.stderr


def test_a_revoked_or_forged_key_stops_outpost_mcp_and_every_request(served):
    server, _ = served
    key = make_key(server)
    client = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert client.get("/v1/outpost/schedules").status_code == 200
    assert server.client().delete("/v1/outpost/keys/my-agent").status_code == 204
    assert client.get("/v1/outpost/schedules").status_code == 401, "revoking is immediate"
    started = [subprocess.Popen([sys.executable, str(conftest.OUTPOST_PY), "mcp", "--url", server.url],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                                env=clean_env(OUTPOST_KEY=bad)) for bad in (key, "opk_" + "A" * 43, server.token)]
    (revoked, forged, token) = [(p.wait(60), p.stderr.read()) for p in started]   # at once: each imports the SDK
    for status, stderr in (revoked, forged):
        assert status == outpost.EXIT_REFUSED and "unknown or revoked" in stderr and stderr.count("\n") == 1
    assert token[0] == outpost.EXIT_NO_TOKEN and "no proposer key" in token[1], "never the API token"


async def test_a_persons_agent_proposes_and_only_a_human_confirms(served):
    server, repo = served
    key = make_key(server)
    human = server.client()
    async with mcp_for(clean_env(OUTPOST_KEY=key, OUTPOST_API_URL=server.url)) as mcp:
        assert await mcp.tools() == sorted(outpost.PROPOSER_TOOLS)
        preview = await mcp.ok("preview", definition={**DEFINITION, "repository": str(repo)})
        assert len(preview["next_fires"]) == 5 and preview["summary"]
        assert preview["next_fires_local"][0].endswith(("CET (+01:00)", "CEST (+02:00)")), "in its zone, offset"
        proposal = await mcp.ok("propose_schedule", definition={**DEFINITION, "repository": str(repo)})
        assert (proposal["state"], proposal["kind"]) == ("pending", "create")
        assert proposal["next_fires"] == preview["next_fires_local"], "what the human reviews, in its zone"
        stored = human.get(f"/v1/outpost/proposals/{proposal['id']}").json()
        assert stored["proposed_by"] == "my-agent" and stored["review"]["next_fires"] == preview["next_fires"]
        assert human.get("/v1/outpost/schedules").json()["schedules"] == [], "a proposal creates nothing"
        items = [a for a in human.get("/v1/outpost/attention").json()["attention"] if a["kind"] == "proposal"]
        assert len(items) == 1 and items[0]["link"] == f"/proposals/{proposal['id']}"
        as_key = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        refused = post(as_key, f"/v1/outpost/proposals/{proposal['id']}/confirm", {})
        assert (refused.status_code, refused.json()["code"]) == (403, "forbidden")
        assert "proposer key may not" in refused.json()["detail"]
        confirmed = post(human, f"/v1/outpost/proposals/{proposal['id']}/confirm", {})
        assert confirmed.status_code == 200, confirmed.text
        schedule_id = confirmed.json()["schedule_id"]
        assert human.get(f"/v1/outpost/schedules/{schedule_id}").json()["name"] == "nightly"
        assert (await mcp.ok("get_proposal", proposal_id=proposal["id"]))["state"] == "confirmed"
        assert not [a for a in human.get("/v1/outpost/attention").json()["attention"] if a["kind"] == "proposal"]
        # a change: the diff against the revision it was made from; a human declines it with a note
        change = await mcp.ok("propose_change", schedule_id="nightly",
                              changes={"timing": {**DEFINITION["timing"], "expression": "30 7 * * *"}})
        assert change["diff"] == [{"field": "timing.expression", "before": "0 9 * * 1-5",
                                             "after": "30 7 * * *"}]
        post(human, f"/v1/outpost/proposals/{change['id']}/decline", {"note": "keep weekdays"}).raise_for_status()
        declined = await mcp.ok("get_proposal", proposal_id=change["id"])
        assert (declined["state"], declined["note"]) == ("declined", "keep weekdays")
        assert human.get(f"/v1/outpost/schedules/{schedule_id}").json()["timing"]["expression"] == "0 9 * * 1-5"
        # a proposal made from a revision that moved is stale at its confirm: 412, never applied
        pause = await mcp.ok("propose_control", schedule_id=schedule_id, action="pause")
        etag = human.get(f"/v1/outpost/schedules/{schedule_id}").headers["ETag"]
        post(human, f"/v1/outpost/schedules/{schedule_id}/control", {"action": "pause"},
             **{"If-Match": etag}).raise_for_status()
        post(human, f"/v1/outpost/schedules/{schedule_id}/control", {"action": "enable"},
             **{"If-Match": str(int(etag.strip('"')) + 1)}).raise_for_status()
        late = post(human, f"/v1/outpost/proposals/{pause['id']}/confirm", {})
        assert (late.status_code, late.json()["code"]) == (412, "revision_mismatch")
        assert (await mcp.ok("get_proposal", proposal_id=pause["id"]))["state"] == "stale"
        assert human.get(f"/v1/outpost/schedules/{schedule_id}").json()["enabled"] is True
        # an error reads as the API's words, never a traceback
        error, text = await mcp.call("propose_schedule", definition={"name": "x"})
        assert error and "422" in text and "brief" in text and "Traceback" not in text
        inspected = await mcp.ok("inspect_schedule", schedule_id="nightly")
        assert inspected["verdict"].startswith("Healthy") and len(inspected["checks"]) == 6


async def test_a_proposer_key_dispatches_as_itself_and_replies_only_to_runs_it_adopted(served, tmp_path):
    server, repo = served
    key = make_key(server, "helper")
    human = server.client()
    async with mcp_for(clean_env(OUTPOST_KEY=key, OUTPOST_API_URL=server.url)) as mcp:
        run_id = (await mcp.ok("dispatch", brief="@needs-you Which file?", repository=str(repo)))["run_id"]
        run = conftest.wait_for(lambda: (r := human.get(f"/v1/outpost/runs/{run_id}").json())["status"]
                                in conftest.SETTLED and r, timeout_s=60)
        assert (run["status"], run["requested_by"]) == ("needs_you", "helper")
        other = (await mcp.ok("dispatch", brief="@needs-you Which one?", repository=str(repo)))["run_id"]
        conftest.wait_for(lambda: human.get(f"/v1/outpost/runs/{other}").json()["status"] == "needs_you", 60)
        post(human, f"/v1/outpost/runs/{other}/adopt", {"workspace": "team"}).raise_for_status()
        error, text = await mcp.call("reply", run_id=other, message="README")
        assert error and "403" in text, "a run another workspace adopted is not the key's to answer"
        assert (await mcp.ok("adopt_run", run_id=run_id))["owner"] == "helper"
        reply = await mcp.ok("reply", run_id=run_id, message="README")
        answered = conftest.wait_for(lambda: (r := human.get(f"/v1/outpost/runs/{reply['run_id']}").json())[
            "status"] in conftest.SETTLED and r, timeout_s=60)
        assert answered["continues"] == run_id


def test_a_key_is_kept_where_no_run_reads_it_and_a_readable_key_file_is_refused(served):
    server, _ = served
    key = make_key(server, "laptop")
    saved = server.data_dir / "keys" / "laptop"
    assert saved.read_text().strip() == key and saved.stat().st_mode & 0o777 == 0o600
    assert (server.data_dir / "keys").stat().st_mode & 0o777 == 0o700
    taken = post(server.client(), "/v1/outpost/keys", {"name": "dashboard", "role": "proposer"})
    assert (taken.status_code, taken.json()["errors"][0]["field"]) == (422, "name"), "a human's name is no key's"
    saved.chmod(0o644)
    done = subprocess.run([sys.executable, str(conftest.OUTPOST_PY), "mcp", "--url", server.url, "--key-file",
                           str(saved)], capture_output=True, text=True, env=clean_env(), timeout=60,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == outpost.EXIT_NO_TOKEN and f"chmod 600 {saved}" in done.stderr
    revoked = subprocess.run([sys.executable, str(conftest.OUTPOST_PY), "--data-dir", str(server.data_dir), "keys",
                              "revoke", "laptop", "--url", server.url], capture_output=True, text=True,
                             env=clean_env(), timeout=60)
    assert revoked.returncode == 0 and not saved.exists()


def test_a_keys_idempotency_keys_are_its_own(served):
    server, repo = served
    key = make_key(server)
    as_key = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    shared = {"Idempotency-Key": "the-same-key"}
    first = as_key.post("/v1/outpost/schedules/compose", json={**DEFINITION, "repository": str(repo)},
                        headers=shared)
    assert first.status_code == 200
    proposal = as_key.post("/v1/outpost/proposals", json={"kind": "create", "definition": {
        **DEFINITION, "repository": str(repo)}}, headers=shared)
    assert proposal.status_code == 201
    human = server.client().post("/v1/outpost/dispatches", json={"brief": "hi", "repository": str(repo)},
                                 headers=shared)
    assert human.status_code == 202 and "Idempotent-Replayed" not in human.headers, "a key claims no human's key"


def route_path(rule: str) -> str:
    return rule.replace("<", "").replace(">", "")


def test_a_proposer_key_may_read_everything_and_write_only_what_it_may(served):
    """Every route of the API tables, with a proposer key: reads answer (never 401/403), the
    proposer's writes pass auth, every other write is 403 ``forbidden`` naming the route."""
    server, _ = served
    key = make_key(server)
    as_key = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    allowed = set()
    for table in (outpost.api, outpost.office_api, outpost.hooks, outpost.agent_api, outpost.pages):
        for route in table.routes:
            if route.rule.startswith("/v1/outpost/events/stream"):
                continue
            answer = as_key.request(route.method, route_path(route.rule), json={},
                                    headers={"Idempotency-Key": uuid.uuid4().hex, "If-Match": '"1"'})
            if route.auth is outpost.Auth.TOKEN and (route.method == "GET" or route.proposer):
                assert answer.status_code not in (401, 403), (route.method, route.rule, answer.text)
                allowed.add((route.method, route.rule))
            elif route.auth in (outpost.Auth.TOKEN, outpost.Auth.SESSION):
                assert answer.status_code == 403, (route.method, route.rule, answer.status_code)
                assert answer.json()["code"] == "forbidden" and route.rule in answer.json()["detail"]
            elif route.auth in (outpost.Auth.RUN, outpost.Auth.ANY_RUN, outpost.Auth.METRICS):
                assert answer.status_code == 401, (route.method, route.rule)
    writes = {(m, r) for m, r in allowed if m != "GET"}
    assert writes == {("POST", "/v1/outpost/schedules/compose"), ("POST", "/v1/outpost/proposals"),
                      ("POST", "/v1/outpost/dispatches"), ("POST", "/v1/outpost/runs/<run_id>/adopt"),
                      ("POST", "/v1/outpost/runs/<run_id>/reply")}


def agent_profile(data_dir: Path) -> None:
    """The ``tooluser`` profile: tests/fakes/mcp_agent.py, an agent that uses ``outpost mcp``."""
    data_dir.mkdir(exist_ok=True)
    command = json.dumps([sys.executable, str(AGENT), str(conftest.OUTPOST_PY)])
    (data_dir / "outpost.toml").write_text(f'[agents.tooluser]\ncommand = {command}\ntimeout_seconds = 120\n'
                                           'pass_env = ["PATH", "HOME", "LANG"]\n')


def agent_output(server: conftest.Server, run_id: str) -> dict:
    log = server.client().get(f"/v1/outpost/runs/{run_id}/log").text
    lines = [line for line in log.splitlines() if line.startswith('{"tools"')]
    assert lines, log[-3000:]
    return json.loads(lines[-1])


def test_an_office_run_acts_through_its_tools_and_reaches_nothing_else(server_factory, tmp_path):
    repo = conftest.make_repo(tmp_path / "repo")
    agent_profile(tmp_path / "data")
    server = server_factory()
    human = server.client()
    human.patch("/api/office/settings", json={"repository": str(repo)},
                headers={"Idempotency-Key": uuid.uuid4().hex}).raise_for_status()
    lead = post(human, "/api/office/agents", {"name": "Lead", "executor": "tooluser", "cooldown_sec": 0}).json()
    worker = post(human, "/api/office/agents", {"name": "Worker", "executor": "demo", "role": "worker",
                                                "cooldown_sec": 0}).json()
    first = post(human, "/api/office/tasks", {"title": "Schema first", "assignee_agent_id": worker["id"]}).json()
    calls = "\n".join([
        'mcp-call: create_task {"title": "Migrate", "assignee": "worker", "parent_id": "$TASK", '
        f'"blocked_by": ["{first["id"]}"]}}',
        'mcp-call: comment {"body": "Split into two steps."}',
        'mcp-call: request_approval {"note": "Ready to ship?", "reviewers": ["Worker"]}',
        'mcp-call: move_task {"state": "IN_REVIEW"}',
        'mcp-call: get_task {}',
        'mcp-call: propose_schedule {"definition": {}}',
        'mcp-call: comment {"body": "x", "task_id": "tsk_01AAAAAAAAAAAAAAAAAAAAAAAA"}',
        'mcp-call: wake {"agent": "Nobody", "reason": "hi"}',
        'mcp-call: wake {"agent": "worker", "reason": "look at the plan"}',
        'http-call: POST /api/agent/tasks {"title": "mine", "executor": "tooluser"}',
        'http-call: POST /api/agent/tasks {"title": "started", "state": "IN_PROGRESS"}',
        'http-call: GET /v1/outpost/schedules {}',
        'http-call: POST /v1/outpost/proposals {"kind": "create", "definition": {}}'])
    task = post(human, "/api/office/tasks", {"title": "Ship 1.4", "description": calls,
                                             "assignee_agent_id": lead["id"]}).json()
    runs = conftest.wait_for(lambda: [r for r in human.get(f"/api/office/agents/{lead['id']}/runs").json()["runs"]
                                      if r["status"] in conftest.SETTLED], timeout_s=90)
    assert runs[0]["status"] == "succeeded", runs[0]["error"]
    out = agent_output(server, runs[0]["id"])
    assert out["tools"] == sorted(outpost.OFFICE_RUN_TOOLS)
    made, commented, approval, moved, got, propose, foreign, nobody, woke = out["calls"]
    assert out["http"] == [422, 422, 401, 401], "no executor or state of its choosing; no user route"
    assert not woke["error"], woke["text"]
    assert not any(c["error"] for c in (made, commented, approval, moved, got)), out["calls"]
    sub = json.loads(made["text"])
    assert (sub["parent_id"], sub["blocked_by"], sub["assignee_agent_id"]) == (task["id"], [first["id"]],
                                                                               worker["id"])
    seen = human.get(f"/api/office/tasks/{task['id']}").json()
    assert [c["body"] for c in seen["comments"]] == ["Split into two steps."]
    assert seen["state"] == "IN_REVIEW" and seen["reviewers"] == [worker["id"]]
    assert [a["note"] for a in seen["approvals"]] == ["Ready to ship?"]
    assert json.loads(got["text"])["subtasks"][0]["id"] == sub["id"]
    assert propose["error"] and "propose_schedule" in propose["text"], "no user tool in a run"
    assert foreign["error"] and "404" in foreign["text"]
    assert nobody["error"] and "Lead" in nobody["text"] and "Worker" in nobody["text"]
    wakes = human.get(f"/api/office/wakeups?agent_id={worker['id']}").json()["wakeups"]
    assert any(w["source"] == "user" and w["payload"].get("user_id") == f"agent:{lead['id']}" for w in wakes)
    assert any(w["reason"] and w["source"] == "task_assigned" or w["payload"].get("task_id") == task["id"]
               for w in wakes), "the reviewer is woken by the move to In Review"
    blocked = [w for w in wakes if w["payload"].get("task_id") == sub["id"]]
    assert all(w["status"] != "claimed" for w in blocked), "the blocked subtask waits for its blocker"


def test_a_dispatch_run_gets_only_ask_human_and_its_question_reaches_a_human(server_factory, tmp_path):
    repo = conftest.make_repo(tmp_path / "repo")
    agent_profile(tmp_path / "data")
    server = server_factory()
    human = server.client()
    brief = "\n".join(["Look around.", 'mcp-call: comment {"body": "x"}',
                       'mcp-call: ask_human {"question": "Which branch should I use?"}'])
    run_id = post(human, "/v1/outpost/dispatches", {"brief": brief, "repository": str(repo),
                                                    "agent": "tooluser"}).json()["run_id"]
    run = conftest.wait_for(lambda: (r := human.get(f"/v1/outpost/runs/{run_id}").json())["status"]
                            in conftest.SETTLED and r, timeout_s=90)
    out = agent_output(server, run_id)
    assert out["tools"] == ["ask_human"]
    assert out["calls"][0]["error"], "an Office tool is not offered to a dispatch run"
    assert (run["status"], run["question"]) == ("needs_you", "Which branch should I use?")


def test_each_cli_is_wired_to_outposts_server_and_nothing_else(tmp_path):
    server = outpost.ToolServer("/usr/bin/python3", ("-I", "/opt/outpost.py", "mcp"), "http://127.0.0.1:1",
                                tmp_path, others=(("evil", "command"), ("outpost", ""), ("docs", "")),
                                system_settings=tmp_path / "gemini-system-settings.json")
    claude = outpost.claude_tools(["claude", "-p", "--resume", "abc"], server)
    assert claude.argv == ["claude", "-p", "--resume", "abc", "--mcp-config", str(tmp_path / "mcp.json"),
                           "--strict-mcp-config", "--allowedTools", "mcp__outpost", "--setting-sources", "user"]
    entry = json.loads(claude.files["mcp.json"])["mcpServers"]["outpost"]
    assert entry["args"] == ["-I", "/opt/outpost.py", "mcp"] and entry["alwaysLoad"] is True
    assert "env" not in entry, "the token is inherited from the run's env, never written down"
    assert claude.env == {"MCP_CONNECT_TIMEOUT_MS": "30000"}
    codex = outpost.codex_tools(["codex", "exec", "--json", "resume", "abc", "-"], server)
    assert codex.argv[:2] == ["codex", "exec"] and codex.argv[-4:] == ["--json", "resume", "abc", "-"]
    flags = codex.argv[3:-4:2]
    assert all(flag == "-c" for flag in codex.argv[2:-4:2])
    import tomllib
    merged = tomllib.loads("\n".join(f.replace("=", " = ", 1) for f in flags if not f.startswith("shell_")))
    outpost_entry = merged["mcp_servers"]["outpost"]
    assert (outpost_entry["default_tools_approval_mode"], outpost_entry["required"]) == ("approve", True)
    assert outpost_entry["env"] == {"OUTPOST_API_URL": "http://127.0.0.1:1"}, "the URL by value: no layer redirects it"
    assert outpost_entry["env_vars"] == ["OUTPOST_RUN_TOKEN"], "the token by name: never on a command line"
    assert {k: v.get("enabled") for k, v in merged["mcp_servers"].items()} == {
        "outpost": True, "evil": False, "docs": False}, "every other server a config names is off"
    assert merged["mcp_servers"]["evil"]["command"] == "false", "a project's entry stands alone (an untrusted one)"
    assert "command" not in merged["mcp_servers"]["docs"], "the user's own is read: it keeps its transport"
    assert 'shell_environment_policy.exclude=["OUTPOST_*"]' in flags
    gemini = outpost.gemini_tools(["gemini"], server)
    assert gemini.argv == ["gemini", "--allowed-mcp-server-names", "outpost", "--policy",
                           str(tmp_path / "gemini-policies"), "--admin-policy", str(tmp_path / "gemini-policies")]
    assert gemini.env == {"GEMINI_CLI_SYSTEM_SETTINGS_PATH": str(tmp_path / "gemini-system-settings.json")}
    settings = gemini.system_settings
    assert settings["mcpServers"]["outpost"]["trust"] is True and settings["mcp"]["allowed"] == ["outpost"]
    assert settings["tools"]["allowed"] == [] and settings["hooksConfig"] == {"enabled": False}
    assert settings["mcpServers"]["outpost"]["env"]["OUTPOST_RUN_TOKEN"] == "$OUTPOST_RUN_TOKEN"
    assert all(outpost.PRESETS[p].tools is not None for p in ("claude-code", "codex", "gemini"))
    assert outpost.PRESETS["aider"].tools is None and outpost.PRESETS["generic"].tools is None


def test_codex_runs_disable_every_server_the_configs_name(tmp_path, monkeypatch):
    workspace = tmp_path / "worktree"
    (workspace / "sub" / ".codex").mkdir(parents=True)
    (workspace / ".codex").mkdir()
    (workspace / ".codex" / "config.toml").write_text('[mcp_servers.evil]\ncommand = "sh"\n')
    (workspace / "sub" / ".codex" / "config.toml").write_text('[mcp_servers.other]\nurl = "http://x"\n')
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text('[mcp_servers.docs]\ncommand = "docs"\n')
    monkeypatch.setenv("CODEX_HOME", str(home))
    server = outpost.tool_server("http://127.0.0.1:1", tmp_path / "private", workspace / "sub", workspace)
    assert set(server.others) == {("evil", "command"), ("other", "url"), ("docs", "")}
    (home / "config.toml").write_text('[mcp_servers.docs\n')
    server = outpost.tool_server("http://127.0.0.1:1", tmp_path / "private", workspace / "sub", workspace)
    assert set(server.others) == {("evil", "command"), ("other", "url")}, "one that does not parse is Codex's to refuse"


def test_a_repositorys_codex_config_that_is_a_fifo_a_link_or_huge_is_not_read(tmp_path):
    """The daemon reads the worktree's .codex/config.toml (to disable the servers it names): a FIFO
    there must not block it, a link must not make it read elsewhere, a huge file is left unread."""
    secret = tmp_path / "secret.toml"
    secret.write_text('[mcp_servers.leak]\ncommand = "x"\n')
    fifo, link, huge = tmp_path / "fifo.toml", tmp_path / "link.toml", tmp_path / "huge.toml"
    os.mkfifo(fifo)
    link.symlink_to(secret)
    huge.write_text('[mcp_servers.big]\ncommand = "x"\n' + "#" * outpost.CONFIG_READ_BYTES)
    assert [outpost.config_servers(p) for p in (fifo, link, huge, tmp_path / "missing")] == [{}, {}, {}, {}]
    assert outpost.config_servers(secret) == {"leak": {"command": "x"}}


def test_a_non_root_daemon_runs_gemini_only_with_the_settings_an_admin_installed(tmp_path):
    server = outpost.outpost_tool_server("http://127.0.0.1:1", tmp_path)
    wanted = outpost.gemini_settings(server)
    mine = tmp_path / "gemini-settings.json"
    mine.write_text(json.dumps(wanted))
    if os.geteuid() == 0:
        os.chown(mine, 12345, 12345)
    with pytest.raises(outpost.LaunchError, match="root owns.*outpost gemini-settings"):
        outpost.check_installed_settings(mine, wanted)
    done = subprocess.run([sys.executable, str(conftest.OUTPOST_PY), "gemini-settings"], capture_output=True,
                          text=True, env=clean_env(), timeout=60)
    printed = json.loads(done.stdout)
    assert printed["mcpServers"]["outpost"]["args"] == ["-I", str(conftest.OUTPOST_PY), "mcp"]


def test_a_claude_run_whose_outpost_tools_did_not_start_fails_saying_so():
    init = json.dumps({"type": "system", "subtype": "init", "session_id": "s1", "model": "m",
                       "mcp_servers": [{"name": "outpost", "status": "failed"}]})
    result = json.dumps({"type": "result", "subtype": "success", "is_error": False, "result": "done"})
    reading = outpost.PRESETS["claude-code"].read([init, result])
    outcome = outpost.run_outcome(reading, 0, "", now=conftest.T0)
    assert (outcome.status, outcome.failure_kind) == ("failed", "launch")
    assert "Outpost's tools did not start" in outcome.error
    connected = json.dumps({"type": "system", "subtype": "init", "mcp_servers": [{"name": "outpost",
                                                                                   "status": "connected"}]})
    assert outpost.run_outcome(outpost.PRESETS["claude-code"].read([connected, result]), 0, "",
                               now=conftest.T0).status == "succeeded"


def test_the_office_prompt_names_the_tools_only_for_a_cli_that_has_them():
    args = {"agent": {"name": "Lead", "role": "coordinator"}, "wakeups": [], "task": None, "comments": [],
            "blockers": [], "summary": "", "resume": False}
    with_tools = outpost.assemble_prompt(**args, tools=True)
    assert outpost.ACTING_WITH_TOOLS in with_tools and "create_task" in with_tools and "curl" not in with_tools
    plain = outpost.assemble_prompt(**args)
    assert "$OUTPOST_RUN_TOKEN" in plain and outpost.ACTING_WITH_TOOLS not in plain


def test_a_proposal_nobody_decided_within_a_week_is_stale_and_cannot_be_confirmed(store, tmp_path):
    repo = conftest.make_repo(tmp_path / "repo")
    definition = conftest.normalized(repo, name="weekly")
    review = {**outpost.composed(definition, conftest.T0, definition["timing"]), "name": "weekly"}
    made = conftest.call(store, store.access.create_proposal, "create", None, {"definition": definition}, None,
                         review, "laptop", conftest.T0)
    week = conftest.T0 + timedelta(seconds=outpost.PROPOSAL_TTL_S)
    assert conftest.call(store, store.access.get_proposal, made["id"], week - timedelta(seconds=1))[
        "state"] == "pending"
    assert conftest.call(store, store.access.get_proposal, made["id"], week)["state"] == "stale"
    assert [p["id"] for p in conftest.call(store, store.access.list_proposals, "stale", week)] == [made["id"]]
    with pytest.raises(outpost.Conflict, match="stale"):
        conftest.call(store, store.access.decide_proposal, made["id"], "confirmed", None, week)


def test_a_persons_key_never_reaches_a_run_whatever_its_profile_passes():
    """A profile that passes OUTPOST_KEY on (a user's mistake) hands no run a person's key."""
    profile = outpost.AgentProfile(name="p", command=("true",), pass_env=("PATH", "OUTPOST_KEY"))
    env = outpost.agent_env(profile, {"PATH": "/bin", "OUTPOST_KEY": "opk_secret"}, "out_1")
    assert "OUTPOST_KEY" not in env and env["PATH"] == "/bin"
