"""The real appliance: ``outpost serve`` as a subprocess on 127.0.0.1:0 with its own data
dir, a real git repository, the demo agent, signals, restarts and the CLI."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import OUTPOST_PY, SETTLED, YEARLY, Server, definition, git, wait_for

import outpost

# --- helpers -------------------------------------------------------------------------------------

_keys = iter(range(1, 1_000_000))


def key() -> dict[str, str]:
    return {"Idempotency-Key": f"test-{time.time_ns()}-{next(_keys)}"}


def create_schedule(client: httpx.Client, raw: dict) -> dict:
    """Compose, then confirm (docs/schedules.md)."""
    composed = client.post("/v1/outpost/schedules/compose", json=raw)
    assert composed.status_code == 200, composed.text
    body = composed.json()
    created = client.post("/v1/outpost/schedules", headers=key(),
                          json={"definition": body["definition"], "confirmation": body["confirmation"]})
    assert created.status_code == 201, created.text
    assert created.headers["ETag"] == '"1"'
    return created.json()


def fire(client: httpx.Client, schedule_id: str) -> dict:
    etag = client.get(f"/v1/outpost/schedules/{schedule_id}").headers["ETag"]
    fired = client.post(f"/v1/outpost/schedules/{schedule_id}/control", json={"action": "fire"},
                        headers={**key(), "If-Match": etag})
    assert fired.status_code == 200, fired.text
    assert fired.json()["outcome"] == "admitted"
    return fired.json()


def dispatch(client: httpx.Client, repo: Path, brief: str, idempotency_key: str | None = None) -> httpx.Response:
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else key()
    return client.post("/v1/outpost/dispatches", headers=headers,
                       json={"brief": brief, "repository": str(repo), "agent": "demo"})


def get_run(client: httpx.Client, run_id: str) -> dict:
    response = client.get(f"/v1/outpost/runs/{run_id}")
    assert response.status_code == 200, response.text
    return response.json()


def wait_status(client: httpx.Client, run_id: str, statuses=SETTLED, timeout_s: float = 20) -> dict:
    return wait_for(lambda: (run := get_run(client, run_id))["status"] in statuses and run, timeout_s)


def spawn_record(data_dir: Path, run_id: str) -> tuple[int | None, str | None]:
    """The pid and start time the daemon recorded for a run (read-only, beside the live daemon)."""
    db = sqlite3.connect(f"file:{data_dir / 'outpost.sqlite3'}?mode=ro", uri=True, timeout=5)
    try:
        row = db.execute('SELECT pid, pid_started FROM "Run" WHERE id = ?', (run_id,)).fetchone()
    finally:
        db.close()
    return (row[0], row[1]) if row else (None, None)


def process_running(pid: int, start: str) -> bool:
    """The same process (pid and start time), alive. An orphan that init has not reaped yet is
    a zombie: it has ended."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] != "Z" and fields[19] == start


def group_running(pgid: int) -> bool:
    """Any live (non-zombie) member of the process group."""
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_path.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def runs_of(client: httpx.Client, schedule_id: str | None = None) -> list[dict]:
    params = {"schedule_id": schedule_id} if schedule_id else {}
    return client.get("/v1/outpost/runs", params={**params, "limit": 500}).json()["runs"]


# --- the full flow ------------------------------------------------------------------------------------

def test_full_flow_compose_create_fire_settle(server_factory, git_repo):
    server = server_factory()
    head = git(git_repo, "rev-parse", "HEAD")
    with server.client() as client:
        assert client.get("/healthz").status_code == 200
        schedule = create_schedule(client, definition(
            git_repo, name="Full Flow", brief="@print hello-from-demo\n@commit notes.txt hi", timing=YEARLY))
        assert schedule["revision"] == 1 and schedule["enabled"]
        fired = fire(client, schedule["id"])
        run = wait_status(client, fired["run_id"])
        assert run["status"] == "succeeded", run
        assert run["trigger"] == "manual" and run["schedule_id"] == schedule["id"]
        assert run["occurrence_id"] == fired["occurrence_id"]
        assert run["resolved_commit"] == head
        assert run["result_branch"] == f"outpost/full-flow/{run['id']}"
        assert run["changes"] == {"commits": 1}
        assert run["exit_code"] == 0
        assert git(git_repo, "show", f"{run['result_branch']}:notes.txt") == "hi"
        assert git(git_repo, "log", "-1", "--format=%s", run["result_branch"]) == "demo: write notes.txt"
        assert not (server.data_dir / "worktrees" / run["id"]).exists()

        log = client.get(f"/v1/outpost/runs/{run['id']}/log")
        assert log.status_code == 200 and log.headers["content-type"].startswith("text/plain")
        assert "hello-from-demo" in log.text

        items = client.get("/v1/outpost/attention").json()["attention"]
        assert [(a["kind"], a["run_id"]) for a in items] == [("changes_returned", run["id"])]

        events = client.get("/v1/outpost/events", params={"after": 0, "limit": 1000}).json()["events"]
        cursors = [e["cursor"] for e in events]
        assert cursors == sorted(cursors) and len(set(cursors)) == len(cursors)
        mine = [e["type"] for e in events if e["data"].get("run_id") == run["id"] and e["type"].startswith("run.")]
        assert mine == ["run.queued", "run.started", "run.settled"]
        types = [e["type"] for e in events]
        assert types.index("schedule.created") < types.index("occurrence.claimed") < types.index("run.settled")
        assert types.index("run.settled") < types.index("attention.raised")

        ids, names = [], []
        with client.stream("GET", "/v1/outpost/events/stream?after=0", timeout=10) as stream:
            assert stream.headers["content-type"].startswith("text/event-stream")
            for line in stream.iter_lines():
                if line.startswith("id:"):
                    ids.append(int(line[3:].strip()))
                elif line.startswith("event:"):
                    names.append(line[6:].strip())
                    if len(names) >= len(events):
                        break
        assert ids == cursors
        assert names == types


# --- shutdown and crashes ---------------------------------------------------------------------------

def test_sigterm_while_a_run_sleeps_shuts_down_cleanly(server_factory, git_repo):
    server = server_factory("--max-running", "1")
    with server.client() as client:
        schedule = create_schedule(client, definition(git_repo, brief="@sleep 60", timing=YEARLY))
        run_id = fire(client, schedule["id"])["run_id"]
        wait_status(client, run_id, ("running",))
        pid, start = wait_for(lambda: (rec := spawn_record(server.data_dir, run_id))[0] and rec)
        assert process_running(pid, start)
        started_at = get_run(client, run_id)["started_at"]
        queued = dispatch(client, git_repo, "@print queued-at-shutdown").json()["run_id"]
    began = time.monotonic()
    assert server.stop(signal.SIGTERM, timeout_s=15) == 0
    assert time.monotonic() - began < 10
    assert "Traceback" not in server.logs()
    assert not process_running(pid, start)
    assert not group_running(pid)

    again = server_factory(data_dir=server.data_dir)
    with again.client() as client:
        run = get_run(client, run_id)
        assert (run["status"], run["error"], run["failure_kind"]) == ("failed", "interrupted", "interrupted")
        # The operator stopped it: no failure item (and so no notification), no failure streak.
        items = client.get("/v1/outpost/attention?state=all").json()["attention"]
        assert [i for i in items if i["run_id"] == run_id] == []
        assert client.get(f"/v1/outpost/schedules/{schedule['id']}").json()["failure_streak"] == 0
        # The run that was queued at shutdown starts now; the interrupted one does not.
        assert wait_status(client, queued)["status"] == "succeeded"
        run = get_run(client, run_id)
        assert run["started_at"] == started_at
        assert [r["id"] for r in runs_of(client, schedule["id"])] == [run_id]
    assert again.stop() == 0


def test_sigterm_kills_an_agent_that_ignores_sigterm_after_the_grace(server_factory, git_repo, tmp_path):
    """SIGTERM, then SIGKILL after GRACE_S; an open event stream does not hold the shutdown up."""
    data = tmp_path / "stubborn-data"
    data.mkdir()
    (data / "outpost.toml").write_text('[agents.stubborn]\ncommand = ["sh", "-c", "trap \'\' TERM; sleep 60"]\n')
    server = server_factory(data_dir=data)
    streamed: list[str] = []

    def listen() -> None:
        with contextlib.suppress(httpx.HTTPError), server.client() as sse, \
                sse.stream("GET", "/v1/outpost/events/stream?after=0", timeout=30) as stream:
            streamed.extend(stream.iter_lines())

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    with server.client() as client:
        response = client.post("/v1/outpost/dispatches", headers=key(),
                               json={"brief": "ignored", "repository": str(git_repo), "agent": "stubborn"})
        assert response.status_code == 202, response.text
        run_id = response.json()["run_id"]
        wait_status(client, run_id, ("running",))
        pid, start = wait_for(lambda: (rec := spawn_record(data, run_id))[0] and rec)
        time.sleep(0.3)   # the shell has set its trap
    began = time.monotonic()
    assert server.stop(signal.SIGTERM, timeout_s=20) == 0
    took = time.monotonic() - began
    assert outpost.GRACE_S - 1 < took < outpost.GRACE_S + 7, f"SIGKILL after the grace, took {took:.1f} s"
    assert "Traceback" not in server.logs()
    assert not group_running(pid)
    listener.join(5)
    assert not listener.is_alive()
    assert any(line.startswith("id:") for line in streamed)

    again = server_factory(data_dir=data)
    with again.client() as client:
        run = get_run(client, run_id)
        assert (run["status"], run["error"]) == ("failed", "interrupted")


def test_kill_9_while_running_recovers_at_the_next_start(server_factory, git_repo):
    server = server_factory("--max-running", "1")
    with server.client() as client:
        schedule = create_schedule(client, definition(git_repo, brief="@edit wip.txt x\n@sleep 60", timing=YEARLY))
        long_run = fire(client, schedule["id"])["run_id"]
        wait_status(client, long_run, ("running",))
        pid, start = wait_for(lambda: (rec := spawn_record(server.data_dir, long_run))[0] and rec)
        queued = dispatch(client, git_repo, "@print after-restart")
        assert queued.status_code == 202, queued.text
        queued_id = queued.json()["run_id"]
        time.sleep(0.3)
        assert get_run(client, queued_id)["status"] == "queued"
        started_at = get_run(client, long_run)["started_at"]
    server.stop(signal.SIGKILL)
    assert process_running(pid, start), "the agent outlives a kill -9 of its daemon"

    again = server_factory("--max-running", "1", data_dir=server.data_dir)
    with again.client() as client:
        run = get_run(client, long_run)
        assert (run["status"], run["error"]) == ("failed", "interrupted")
        assert run["started_at"] == started_at
        assert not process_running(pid, start), "the orphaned agent was ended"
        assert not group_running(pid)
        owner = outpost.cgroup_owner(server.data_dir)   # and the cgroups it was held in are gone
        assert not [d for p in outpost.find_cgroups(owner).parents for d in os.listdir(p)
                    if d.startswith(f"outpost-{owner}-{server.proc.pid}-")]
        # Its uncommitted edit is kept on the result branch.
        assert git(git_repo, "show", f"{run['result_branch']}:wip.txt") == "x"

        after = wait_status(client, queued_id)
        assert after["status"] == "succeeded", after
        assert "after-restart" in client.get(f"/v1/outpost/runs/{queued_id}/log").text

        assert [r["id"] for r in runs_of(client, schedule["id"])] == [long_run]
        occurrences = client.get(f"/v1/outpost/schedules/{schedule['id']}/occurrences").json()["occurrences"]
        assert [(o["outcome"], o["run_id"]) for o in occurrences] == [("admitted", long_run)]
        assert get_run(client, long_run)["started_at"] == started_at
    assert "Traceback" not in again.logs()


EMBEDDED_AGENT = ("G='git -c user.name=agent -c user.email=agent@example.invalid'; "
                  "mkdir inner && cd inner && git init -q && echo one > notes && git add notes && "
                  "$G commit -qm inner && echo two >> notes")


def test_a_worktree_whose_embedded_repository_holds_changes_is_kept_and_a_clean_one_goes(
        server_factory, git_repo, tmp_path):
    """The save commits what git can (the embedded repository as a gitlink), not the embedded
    repository's own uncommitted edit: the worktree is asked again after a save and kept. A run
    that changed nothing has its worktree removed."""
    data = tmp_path / "embedded-data"
    data.mkdir()
    (data / "outpost.toml").write_text(f'[agents.embedder]\ncommand = ["sh", "-c", {json.dumps(EMBEDDED_AGENT)}]\n'
                                       '[agents.idle]\ncommand = ["true"]\n')
    server = server_factory(data_dir=data)
    with server.client() as client:
        ids = {}
        for agent in ("embedder", "idle"):
            response = client.post("/v1/outpost/dispatches", headers=key(),
                                   json={"brief": "b", "repository": str(git_repo), "agent": agent})
            assert response.status_code == 202, response.text
            ids[agent] = response.json()["run_id"]
        runs = {agent: wait_status(client, run_id) for agent, run_id in ids.items()}
    assert runs["idle"]["status"] == "succeeded" and not (data / "worktrees" / ids["idle"]).exists()
    kept = data / "worktrees" / ids["embedder"] / "inner" / "notes"
    assert kept.read_text() == "one\ntwo\n"   # its uncommitted edit is where the agent left it
    assert git(git_repo, "ls-tree", runs["embedder"]["result_branch"], "inner").split()[1] == "commit"


def test_idempotency_key_survives_a_restart(server_factory, git_repo):
    server = server_factory()
    with server.client() as client:
        first = dispatch(client, git_repo, "@print once", idempotency_key="dispatch-once")
        assert first.status_code == 202, first.text
        assert "Idempotent-Replayed" not in first.headers
        wait_status(client, first.json()["run_id"])
    assert server.stop() == 0

    again = server_factory(data_dir=server.data_dir)
    with again.client() as client:
        replay = dispatch(client, git_repo, "@print once", idempotency_key="dispatch-once")
        assert replay.status_code == 202
        assert replay.headers.get("Idempotent-Replayed") == "true"
        assert replay.json() == first.json()
        assert [r["id"] for r in runs_of(client)] == [first.json()["run_id"]]
        reused = dispatch(client, git_repo, "@print something else", idempotency_key="dispatch-once")
        assert reused.status_code == 422 and reused.json()["code"] == "idempotency_key_reused"


# --- names the CLI prints ------------------------------------------------------------------------------

#: Control characters a terminal would act on: ESC (a colour, a cursor move), NUL, newlines, DEL,
#: C1 (CSI, NEL) and the Unicode line separator.
CONTROL_NAMES = ["\x1b[31mred\x1b[0m", "a\x00b", "two\nlines", "cr\rover", "del\x7f", "csi\x9b2J", "nel\x85",
                 "line\u2028separator"]


def test_names_with_control_characters_are_422_naming_the_name(server_factory, git_repo):
    """A schedule, an Office agent or a workspace named with control characters is refused:
    the CLI prints these names raw into a terminal."""
    server = server_factory()
    with server.client() as client:
        assert client.post("/v1/outpost/schedules/compose",
                           json=definition(git_repo, name="Nächtlich ✓ 夜 report")).status_code == 200
        for name in CONTROL_NAMES:
            replies = {
                "compose": client.post("/v1/outpost/schedules/compose", json=definition(git_repo, name=name)),
                "create": client.post("/v1/outpost/schedules", headers=key(), json={
                    "definition": definition(git_repo, name=name), "confirmation": "x"}),
                "agent": client.post("/api/office/agents", json={"name": name, "executor": "demo"}),
                "workspace": client.post("/api/office/workspaces", json={"name": name}),
            }
            for what, reply in replies.items():
                assert reply.status_code == 422, (what, repr(name), reply.status_code, reply.text[:200])
                assert [e["field"] for e in reply.json()["errors"]] == ["name"], (what, repr(name), reply.text)
        assert client.get("/v1/outpost/schedules").json()["schedules"] == []
        assert client.get("/api/office/agents").json()["agents"] == []
        assert len(client.get("/api/office/workspaces").json()["workspaces"]) == 1   # the default one


# --- dashboard sign-in -----------------------------------------------------------------------------------

#: ``next`` values a browser would follow to another origin: ``/\\`` reads as ``//``, and tabs and
#: line breaks are dropped from a URL before it is parsed.
OFF_ORIGIN_NEXT = ["/\\evil.example", "/\\/evil.example", "//evil.example", "/\t/evil.example", "/\n/evil.example",
                   "/\r\n/evil.example", "https://evil.example/", "evil.example", "\\\\evil.example", ""]


def test_sign_in_goes_only_to_a_path_of_this_origin(server_factory):
    """``/signin?next=...``: the page carries ``next`` to the form; signing in follows it only
    when it is a path here, else it lands on ``/``."""
    server = server_factory()
    with httpx.Client(base_url=server.url, timeout=30, follow_redirects=False) as browser:
        form_page = browser.get("/signin", params={"next": "/\\evil.example"})
        assert form_page.status_code == 200
        for target, expected in [("/runs?status=failed", "/runs?status=failed"), ("/office/board", "/office/board"),
                                 *((bad, "/") for bad in OFF_ORIGIN_NEXT)]:
            reply = browser.post("/signin", data={"token": server.token, "next": target})
            assert reply.status_code in (302, 303), (repr(target), reply.status_code, reply.text[:200])
            assert reply.headers["Location"] == expected, (repr(target), reply.headers["Location"])
            assert outpost.SESSION_COOKIE in reply.cookies


# --- keep-alive connections ----------------------------------------------------------------------------

def test_a_refusal_before_the_body_is_read_leaves_the_keep_alive_connection_usable(server_factory):
    """A POST with a large body refused before Outpost reads it (401, 403, 404, 428): the next
    request on the same HTTP/1.1 connection is answered at once, not after the read timeout."""
    import http.client

    server = server_factory()
    port = int(server.url.rsplit(":", 1)[1])
    body = json.dumps({"brief": "x" * (512 * 1024)}).encode()   # under the 1 MiB limit
    token = {"Authorization": f"Bearer {server.token}"}
    refusals = [
        ("/v1/outpost/dispatches", {"Authorization": "Bearer wrong"}, 401),
        ("/v1/outpost/dispatches", {**token, "Host": "evil.example"}, 403),
        ("/v1/outpost/no-such-endpoint", token, 404),
        ("/v1/outpost/dispatches", token, 428),   # no Idempotency-Key
    ]
    for path, headers, status in refusals:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            connection.request("POST", path, body=body, headers={"Content-Type": "application/json", **headers})
            refused = connection.getresponse()
            refused.read()
            assert refused.status == status, (path, refused.status)
            connection.request("GET", "/healthz")
            after = connection.getresponse()
            after.read()
            assert after.status == 200, (status, after.status)
        except TimeoutError:
            pytest.fail(f"after a {status} the next request on the same connection got no answer")
        finally:
            connection.close()


# --- the CLI against the real daemon -------------------------------------------------------------------

def cli(data_dir: Path, *args: str, port: int | None = None, stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OUTPOST_API_TOKEN", "OUTPOST_PORT")}
    if port is not None:
        env["OUTPOST_PORT"] = str(port)
    return subprocess.run([sys.executable, str(OUTPOST_PY), "--data-dir", str(data_dir), *args],
                          capture_output=True, text=True, env=env, stdin=stdin, timeout=60)


def port_of(server: Server) -> int:
    return int(server.url.rsplit(":", 1)[1])


TOML_DEFINITION = """\
name = "cli-toml"
brief = "@print from-the-cli"
repository = "{repo}"
agent = "demo"

[timing]
kind = "cron"
expression = "0 0 1 1 *"
timezone = "Europe/Berlin"
"""


def test_cli_against_the_real_daemon(server_factory, git_repo, tmp_path):
    server = server_factory()
    data, port = server.data_dir, port_of(server)
    toml_file = tmp_path / "nightly.toml"
    toml_file.write_text(TOML_DEFINITION.format(repo=git_repo))
    json_file = tmp_path / "weekly.json"
    json_file.write_text(json.dumps(definition(git_repo, name="cli-json", timing=YEARLY)))

    created = cli(data, "schedules", "create", str(toml_file), "--yes", port=port)
    assert created.returncode == 0, created.stderr
    assert "Runs agent 'demo'" in created.stdout and "Created sch_" in created.stdout
    created = cli(data, "schedules", "create", str(json_file), "--yes", "--json", port=port)
    assert created.returncode == 0, created.stderr
    as_json = json.loads(created.stdout[created.stdout.index("\n{") + 1:])
    assert as_json["name"] == "cli-json" and as_json["revision"] == 1

    listed = cli(data, "schedules", "list", port=port)
    assert listed.returncode == 0 and "cli-toml" in listed.stdout and "cli-json" in listed.stdout
    assert "NAME" in listed.stdout.splitlines()[0]
    listed = cli(data, "schedules", "list", "--json", port=port)
    assert sorted(s["name"] for s in json.loads(listed.stdout)) == ["cli-json", "cli-toml"]

    shown = cli(data, "schedules", "show", "cli-toml", port=port)
    assert shown.returncode == 0 and "Slot ledger" in shown.stdout and "Europe/Berlin" in shown.stdout

    fired = cli(data, "schedules", "fire", "cli-toml", port=port)
    assert fired.returncode == 0, fired.stderr
    assert fired.stdout.startswith("admitted: run out_")
    run_id = fired.stdout.split()[2]
    with server.client() as client:
        assert wait_status(client, run_id)["status"] == "succeeded"

    paused = cli(data, "schedules", "pause", "cli-toml", port=port)
    assert paused.returncode == 0 and "is now paused" in paused.stdout, paused.stderr
    resumed = cli(data, "schedules", "resume", "cli-toml", "--json", port=port)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["enabled"] is True

    runs = cli(data, "runs", "list", port=port)
    assert runs.returncode == 0 and run_id in runs.stdout and "succeeded" in runs.stdout
    assert [r["id"] for r in json.loads(cli(data, "runs", "list", "--json", port=port).stdout)["runs"]] == [run_id]
    by_name = cli(data, "runs", "list", "--schedule", "cli-toml", port=port)   # a name, as everywhere else
    assert by_name.returncode == 0 and run_id in by_name.stdout, by_name.stderr
    unfired = cli(data, "runs", "list", "--schedule", "cli-json", port=port)
    assert unfired.returncode == 0 and unfired.stdout.strip() == "No runs match.", unfired.stdout
    shown_run = cli(data, "runs", "show", run_id, port=port)
    assert shown_run.returncode == 0 and "succeeded" in shown_run.stdout
    assert json.loads(cli(data, "runs", "show", run_id, "--json", port=port).stdout)["status"] == "succeeded"
    run_log = cli(data, "runs", "log", run_id, port=port)
    assert run_log.returncode == 0 and "from-the-cli" in run_log.stdout

    # Declined: stdin is not a terminal and there is no --yes; nothing is created.
    other = tmp_path / "other.json"
    other.write_text(json.dumps(definition(git_repo, name="never-confirmed", timing=YEARLY)))
    declined = cli(data, "schedules", "create", str(other), port=port)
    assert declined.returncode == 5
    assert "--yes" in declined.stderr and "Traceback" not in declined.stderr
    with server.client() as client:
        names = [s["name"] for s in client.get("/v1/outpost/schedules").json()["schedules"]]
    assert "never-confirmed" not in names

    token = cli(data, "token")
    assert token.returncode == 0 and token.stdout.strip() == server.token

    # No daemon listens there.
    unreachable = cli(data, "schedules", "list", port=free_port())
    assert unreachable.returncode == 3
    assert "cannot reach" in unreachable.stderr and "Traceback" not in unreachable.stderr

    # No token: a fresh data dir.
    fresh = tmp_path / "fresh"
    no_token = cli(fresh, "schedules", "list", port=port)
    assert no_token.returncode == 4
    assert "token" in no_token.stderr and "Traceback" not in no_token.stderr
    assert cli(fresh, "token").returncode == 4

    assert server.stop() == 0
    inspected = cli(data, "inspect", "cli-toml")
    assert inspected.returncode == 0, inspected.stderr
    starts = [inspected.stdout.find(f"\n{n}. ") for n in range(1, 7)]
    assert all(s >= 0 for s in starts) and starts == sorted(starts), inspected.stdout
    assert run_id in inspected.stdout
    as_json = json.loads(cli(data, "inspect", "cli-toml", "--json").stdout)
    assert [c["check"] for c in as_json["checks"]] == [1, 2, 3, 4, 5, 6]


def test_the_cli_finds_serve_on_any_port_through_its_recorded_address(server_factory, git_repo, tmp_path):
    """Issue 28: `schedules create` no longer fails on 8321 while serve runs on another port."""
    server = server_factory()   # --port 0: a port of the kernel's choosing
    recorded = server.data_dir / "serve.json"
    assert json.loads(recorded.read_text())["url"] == server.url
    assert recorded.stat().st_mode & 0o777 == 0o600
    definition_file = tmp_path / "nightly.toml"
    definition_file.write_text(TOML_DEFINITION.format(repo=git_repo))
    created = cli(server.data_dir, "schedules", "create", str(definition_file), "--yes")   # no --url, no $OUTPOST_PORT
    assert created.returncode == 0, created.stderr
    with server.client() as client:
        assert [s["name"] for s in client.get("/v1/outpost/schedules").json()["schedules"]] == ["cli-toml"]
    elsewhere = cli(server.data_dir, "schedules", "list", port=free_port())   # $OUTPOST_PORT still wins
    assert elsewhere.returncode == 3
    assert server.stop() == 0
    assert not recorded.exists(), "a stopped serve's address is forgotten"


def test_a_recorded_address_of_a_dead_serve_is_not_used(tmp_path, monkeypatch):
    monkeypatch.delenv("OUTPOST_PORT", raising=False)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / "serve.json").write_text(json.dumps({"url": "http://127.0.0.1:1234", "pid": int(dead.stdout)}))
    assert outpost.daemon_url(tmp_path, None) == f"http://127.0.0.1:{outpost.DEFAULT_PORT}"
    (tmp_path / "serve.json").write_text(json.dumps({"url": "http://0.0.0.0:1234", "pid": os.getpid()}))
    assert outpost.daemon_url(tmp_path, None) == "http://127.0.0.1:1234", "a wildcard bind is asked on loopback"
    assert outpost.daemon_url(tmp_path, "http://example.invalid:1") == "http://example.invalid:1"


@pytest.mark.parametrize("args", [("schedules", "list"), ("runs", "list")])
def test_cli_without_a_daemon_exits_3(tmp_path, args):
    data = tmp_path / "data"
    data.mkdir()
    (data / "api-token").write_text("some-token\n")
    done = cli(data, *args, port=free_port())
    assert done.returncode == 3
    assert "is `outpost serve` running?" in done.stderr


# --- the demo agent (README.md), as the CLI runs it ---------------------------------------------------

def demo_agent(prompt: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(OUTPOST_PY), "demo-agent"], input=prompt, cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def test_the_demo_agent_prints_its_closing_status_last_even_after_a_result(tmp_path):
    """Defect 14: after ``@result`` the demo agent never printed its closing status."""
    done = demo_agent('@result {"answer": 42}\n@print after', tmp_path)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stderr
    assert lines[:2] == ['{"answer": 42}', "after"]
    closing = json.loads(lines[-1])
    assert closing["status"] == "succeeded" and closing["session_id"].startswith("demo-")


def test_the_demo_agent_refuses_invalid_json_after_result_in_one_line(tmp_path):
    done = demo_agent("@result {not json", tmp_path)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().count("\n") == 0 and "@result" in done.stderr and "JSON" in done.stderr


# --- configuration at start (docs/agent-clis.md) --------------------------------------------------------------

@pytest.mark.parametrize(("toml", "key"), [
    ('[agents.claude]\ncommand = ["claude"]\ntimeout_seconds = "3600"\n', "agents.claude.timeout_seconds"),
    ('[agents.claude]\ncommand = ["claude"]\npass_env = "PATH"\n', "agents.claude.pass_env"),
    ('[agents.claude]\ncommand = []\n', "agents.claude.command"),
    ('[agents.claude]\ncomand = ["claude"]\n', "agents.claude.comand"),
    ('[agents.claude]\ntimeout_seconds = 60\n', "agents.claude.command"),
    ('[agents.claude]\ncommand = ["claude"]\nenv = {KEY = 1}\n', "agents.claude.env"),
    ('[settings]\nmax_running = 0\n', "settings.max_running"),
    ('[settings]\nallowed_hosts = "box.local"\n', "settings.allowed_hosts"),
    ('[setting]\nmax_running = 2\n', "[setting]"),
    ('[settings\n', "not valid TOML"),
    ('[settings]\nisolate_agents = "sometimes"\n', "settings.isolate_agents"),
])
def test_a_bad_outpost_toml_stops_serve_at_start_with_one_line_naming_the_key(tmp_path, toml, key):
    """Defect 8: a typo took the daemon down at the first run (a crash loop under systemd), or
    was silently misread (``pass_env = "PATH"`` became P, A, T, H)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "outpost.toml").write_text(toml)
    done = subprocess.run([sys.executable, str(OUTPOST_PY), "serve", "--data-dir", str(data), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert str(data / "outpost.toml") in line and key in line, line


@pytest.mark.parametrize(("args", "env", "words"), [
    (("--database", "mysql://db/outpost"), {}, "must be a postgresql:// URL"),
    (("--database", "postgresql://outpost:in-the-url@127.0.0.1:1/outpost"), {}, "Connection refused"),
    (("--database", "postgresql://outpost@127.0.0.1:1/outpost"), {"OUTPOST_DATABASE_PASSWORD": "in-the-env"},
     "Connection refused"),
    ((), {"OUTPOST_DATABASE_URL": "postgresql://outpost@127.0.0.1:1/"}, "names no database"),
])
def test_a_database_that_cannot_be_used_stops_serve_without_printing_its_password(tmp_path, args, env, words):
    done = subprocess.run([sys.executable, str(OUTPOST_PY), "serve", "--data-dir", str(tmp_path / "data"),
                           "--port", "0", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr
    assert "in-the-url" not in done.stderr + done.stdout and "in-the-env" not in done.stderr + done.stdout


def test_serve_with_a_relative_data_dir_from_another_directory(tmp_path):
    """Defect 9: ``--data-dir ./data`` died with Pony's "unable to open database file" (Pony reads
    a relative SQLite path against its caller's module, not the working directory)."""
    proc = subprocess.Popen([sys.executable, str(OUTPOST_PY), "serve", "--data-dir", "./data", "--port", "0"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "Outpost is listening" in line, proc.stderr.read() if proc.poll() is not None else line
        url = line.split()[-1].rstrip("/")
        token = (tmp_path / "data" / "api-token").read_text().strip()
        reply = httpx.get(f"{url}/v1/outpost/schedules", headers={"Authorization": f"Bearer {token}"})
        assert reply.status_code == 200 and (tmp_path / "data" / "outpost.sqlite3").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_process_alive_here_tells_a_live_process_an_ended_one_and_one_elsewhere():
    """Who holds a fleet node's name: a process of this machine is known alive or ended (killed
    and not yet reaped counts as ended); one of another machine is not known here."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    mine = outpost.this_process().split()
    process = " ".join([*mine[:4], str(child.pid), "start", outpost.process_start_time(child.pid)])
    assert outpost.process_alive_here(process) is True
    child.kill()
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)   # a zombie now, not reaped
    assert outpost.process_alive_here(process) is False
    child.wait()
    assert outpost.process_alive_here(process) is False
    assert outpost.process_alive_here(process.replace(mine[0], "another-host", 1)) is None
    assert outpost.process_alive_here(outpost.this_process()) is True


# --- faults of the machine, not of the agent (docs/security.md: the daemon keeps serving) -------------------

@pytest.mark.parametrize("folder", ["runs", "private", "worktrees"])
def test_a_run_whose_files_cannot_be_made_fails_with_the_reason_and_the_daemon_serves_on(
        server_factory, git_repo, folder):
    """A folder of the data dir that is not a folder (or cannot be written): that run fails naming
    it, the daemon serves on (no crash, so no crash loop under systemd at the next start), and
    runs work again once the folder is back."""
    server = server_factory()
    broken = server.data_dir / folder
    with server.client() as client:
        wait_status(client, dispatch(client, git_repo, "@print first").json()["run_id"])
        subprocess.run(["rm", "-rf", str(broken)], check=True)
        broken.write_text("not a folder\n")
        run = wait_status(client, dispatch(client, git_repo, "@print second").json()["run_id"])
        assert run["status"] == "failed" and str(broken) in run["error"], run["error"]
        assert client.get("/healthz").status_code == 200
    server.stop()
    again = server_factory(data_dir=server.data_dir)   # a restart with the folder still broken
    with again.client() as client:
        run = wait_status(client, dispatch(client, git_repo, "@print third").json()["run_id"])
        assert run["status"] == "failed" and str(broken) in run["error"], run["error"]
        broken.unlink()
        run = wait_status(client, dispatch(client, git_repo, "@print fourth").json()["run_id"])
        assert run["status"] == "succeeded", run["error"]
        assert "fourth" in client.get(f"/v1/outpost/runs/{run['id']}/log").text
        assert again.proc.poll() is None
    assert "Traceback" not in again.logs() + server.logs()


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap makes a read-only data dir, also for root")
def test_a_read_only_data_dir_stops_serve_with_one_line(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    done = subprocess.run(["bwrap", "--dev-bind", "/", "/", "--ro-bind", str(data), str(data), "--",
                           sys.executable, str(OUTPOST_PY), "serve", "--data-dir", str(data), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert str(data) in line and "Read-only file system" in line, line


def test_a_second_serve_on_the_same_data_dir_exits_2_naming_the_running_one(server_factory, tmp_path):
    """shared/API.md 2: one daemon per data dir. A second serve (the same port or another) exits 2
    with one line naming the running one; the first keeps its serve.json and goes on serving."""
    first = server_factory()
    recorded = json.loads((first.data_dir / "serve.json").read_text())
    for port in ("0", first.url.rsplit(":", 1)[1]):
        second = subprocess.run([sys.executable, str(OUTPOST_PY), "serve", "--data-dir", str(first.data_dir),
                                 "--port", port], capture_output=True, text=True, timeout=60,
                                env={k: v for k, v in os.environ.items() if k != "OUTPOST_API_TOKEN"})
        assert second.returncode == 2, second.stderr
        assert second.stderr.count("\n") == 1 and "Traceback" not in second.stderr
        assert str(recorded["pid"]) in second.stderr and first.url in second.stderr
        assert json.loads((first.data_dir / "serve.json").read_text()) == recorded, "only its writer removes it"
    assert first.client().get("/healthz").status_code == 200


# --- a full disk ---------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path: Path):
    """A data dir on its own 16 MiB tmpfs (root can mount one; elsewhere the test skips)."""
    data = tmp_path / "data"
    data.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(data)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield data
    subprocess.run(["umount", "-l", str(data)], check=False)


def fill(folder: Path) -> Path:
    """A file that takes what space is left on ``folder``'s disk."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 16, 1 << 12, 1):   # down to the last byte
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * size)
    return filler


def test_a_full_disk_is_named_at_healthz_and_dispatch_and_all_recovers_once_space_is_back(small_disk, git_repo):
    """The data dir's disk fills while a run's agent works: the run waits unsettled (never lost),
    /healthz and a dispatch say the disk is full; once space is freed, without a restart, the run
    settles failed with the reason (its work kept in its worktree), /healthz is ok and a new run
    succeeds."""
    data = small_disk
    waiter = ('echo work > work.txt; if grep -q wait; then touch hold; while [ -e hold ]; do sleep 0.05; done; fi; '
              'echo \'{"status": "succeeded"}\'')
    (data / "outpost.toml").write_text(f'[agents.waiter]\ncommand = ["sh", "-c", {json.dumps(waiter)}]\n')
    server = Server(data).start()
    try:
        with server.client() as client:
            def run_waiter(brief: str) -> str:
                return client.post("/v1/outpost/dispatches", headers=key(), json={
                    "brief": brief, "repository": str(git_repo), "agent": "waiter"}).json()["run_id"]

            def settled(run_id: str) -> dict:
                return wait_for(lambda: (r := client.get(f"/v1/outpost/runs/{run_id}").json())["status"] in SETTLED
                                and r)
            run_id = run_waiter("work, then wait")
            hold = data / "worktrees" / run_id / "hold"
            wait_for(hold.exists)
            filler = fill(data)
            hold.unlink()   # the agent ends; what it left cannot be saved, nor its run settled
            refused = client.post("/v1/outpost/dispatches", headers=key(), json={
                "brief": "more", "repository": str(git_repo), "agent": "waiter"})
            assert refused.status_code == 503 and refused.headers["Content-Type"] == "application/problem+json"
            assert refused.json()["code"] == "disk_full" and "is full" in refused.json()["detail"], refused.json()
            health = wait_for(lambda: (h := client.get("/healthz")).status_code == 503 and h.json())
            assert health["status"] == "disk_full" and "is full" in health["reason"], health
            wait_for(lambda: "settle_run: the disk" in server.logs())   # its settlement waits for space
            assert client.get(f"/v1/outpost/runs/{run_id}").json()["status"] == "running"

            filler.unlink()
            run = settled(run_id)
            assert run["status"] == "failed" and run["error"].startswith("the disk is full, so "), run
            assert (data / "worktrees" / run_id / "work.txt").read_text() == "work\n"
            assert wait_for(lambda: client.get("/healthz").json()["ok"])
            after = settled(run_waiter("work"))
            assert (after["status"], after["changes"]["commits"]) == ("succeeded", 1), after
        assert server.proc.poll() is None
    finally:
        server.stop()


# --- what an agent prints, where a person reads it ------------------------------------------------

def test_escape_sequences_an_agent_prints_are_shown_not_obeyed_in_the_daemons_log_and_the_cli(server_factory,
                                                                                              git_repo):
    """An OSC title, a clear screen and a bell in the agent's output and in its error: the serve
    log and ``outpost runs show`` / ``runs log`` print them as ``\\x1b``, never the bytes a terminal
    obeys; plain text, line breaks and UTF-8 stay as they are."""
    data = git_repo.parent / "data"
    data.mkdir()
    noisy = (r'printf "\033]0;pwned\007\033[2Jout \303\251\nline two\n"; '
             r'printf "\033]0;pwned\007\033[2Jerr \303\251\n" >&2; exit 1')
    (data / "outpost.toml").write_text(f'[agents.noisy]\ncommand = ["sh", "-c", {json.dumps(noisy)}]\n')
    server = server_factory(data_dir=data)
    with server.client() as client:
        run_id = client.post("/v1/outpost/dispatches", headers=key(), json={
            "brief": "go", "repository": str(git_repo), "agent": "noisy"}).json()["run_id"]
        run = wait_status(client, run_id)
    assert run["status"] == "failed" and "\x1b]0;pwned\x07" in run["error"]   # the API keeps the agent's words
    port = port_of(server)
    shown = cli(data, "runs", "show", run_id, port=port)
    logged = cli(data, "runs", "log", run_id, port=port)
    server.stop()
    settled_line = next(line for line in server.logs().splitlines() if f"run {run_id} settled" in line)
    for printed in (shown.stdout, logged.stdout, settled_line):
        assert "\x1b" not in printed and "\x07" not in printed, repr(printed)
        assert "\\x1b]0;pwned\\x07\\x1b[2J" in printed, printed
    assert "err é" in shown.stdout and "err é" in settled_line
    assert "\\x1b[2Jout é\nline two\n" in logged.stdout
