"""Channels (shared/API.md 14, docs/office.md "Channels"): Slack and Telegram messages into an
Office task, the agent's comments back out. Real-shaped, signed events and updates are sent to
a real server; local stubs of Slack's Web API and Telegram's Bot API (tests/channelstub.py)
receive the replies."""
from __future__ import annotations

import json
import math
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
import trio
from channelstub import ChannelStub
from conftest import T0, call, wait_for

import outpost

SECRET = "slack-signing-secret"
TG_SECRET = "tg_secret-token"
#: Slack's own worked example (https://docs.slack.dev/authentication/verifying-requests-from-slack).
DOC_BODY = (b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&"
            b"channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&"
            b"response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRs"
            b"kXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c")


# --- pure: signatures and messages ----------------------------------------------------------------------

def test_the_slack_signature_matches_slacks_worked_example():
    assert outpost.slack_signature("8f742231b10e8888abcd99yyyzzz85a5", "1531420618", DOC_BODY) == (
        "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503")


def slack_headers(body: bytes, at: float, secret: str = SECRET) -> dict[str, str]:
    stamp = str(int(at))
    return {"x-slack-request-timestamp": stamp, "x-slack-signature": outpost.slack_signature(secret, stamp, body)}


@pytest.mark.parametrize(("change", "reason"), [
    ({"x-slack-signature": "v0=" + "0" * 64}, "bad signature"),
    ({"x-slack-request-timestamp": str(int(T0.timestamp()) - 301)}, "stale timestamp"),
    ({"x-slack-request-timestamp": str(int(T0.timestamp()) + 301)}, "stale timestamp"),
    ({"x-slack-request-timestamp": "²"}, "missing X-Slack-Request-Timestamp"),
    ({"x-slack-request-timestamp": ""}, "missing X-Slack-Request-Timestamp"),
])
def test_a_forged_or_stale_slack_request_is_refused(change, reason):
    body = b'{"type": "event_callback"}'
    headers = slack_headers(body, T0.timestamp()) | change
    assert outpost.slack_refusal(SECRET, headers, body, T0).startswith(reason)
    assert outpost.slack_refusal(SECRET, slack_headers(body, T0.timestamp() - 299), body, T0) is None
    assert outpost.slack_refusal("another secret", slack_headers(body, T0.timestamp()), body, T0) == "bad signature"


def slack_event(text: str, *, event_id: str = "Ev01", channel: str = "C111", **event) -> dict:
    return {"type": "event_callback", "team_id": "T1", "api_app_id": "A1", "event_id": event_id,
            "event_time": int(T0.timestamp()),
            "event": {"type": "message", "channel": channel, "user": "U123", "text": text, "ts": "1.0",
                      "channel_type": "channel", **event}}


@pytest.mark.parametrize("envelope", [
    slack_event("hi", bot_id="B1"), slack_event("hi", subtype="message_changed"),
    slack_event("hi", subtype="bot_message"), slack_event("hi", channel="C999"), slack_event("  "),
    {"type": "event_callback", "event": {"type": "app_mention", "channel": "C111", "user": "U1", "text": "x"}},
])
def test_what_is_no_persons_message_in_the_channel_is_ignored(envelope):
    assert outpost.slack_message(envelope, "C111") is None


def test_a_persons_slack_message_and_telegram_message_are_read():
    assert outpost.slack_message(slack_event("@Release cut 1.4"), "C111") == outpost.ChannelMessage(
        "Ev01", "U123", "@Release cut 1.4")
    update = {"update_id": 10, "message": {"message_id": 1, "date": 0, "chat": {"id": -100, "type": "group"},
                                           "from": {"id": 5, "is_bot": False, "first_name": "Ada",
                                                    "username": "ada_l"}, "text": "hello"}}
    assert outpost.telegram_message(update, "-100") == outpost.ChannelMessage("10", "ada_l", "hello")
    assert outpost.telegram_message(update, "-101") is None
    assert outpost.telegram_message({**update, "message": {**update["message"], "from": {"is_bot": True}}},
                                    "-100") is None
    assert outpost.telegram_message({"update_id": 11, "edited_message": update["message"]}, "-100") is None


def test_text_that_cannot_be_stored_or_a_chat_that_is_no_object_is_no_500():
    assert outpost.slack_message(slack_event("hi \ud800 there"), "C111").text == "hi \ufffd there"
    update = {"update_id": 1, "message": {"chat": "x", "from": {"first_name": "A"}, "text": "hi"}}
    assert outpost.telegram_message(update, "x") is None
    named = {"update_id": 2, "message": {"chat": {"id": 7}, "from": {"first_name": "\udc00"}, "text": "\ud800"}}
    assert outpost.telegram_message(named, "7") == outpost.ChannelMessage("2", "\ufffd", "\ufffd")


def entry_for(stub: ChannelStub, kind: str = "slack", token: str | None = None) -> outpost.ChannelEntry:
    return outpost.ChannelEntry("ops", kind, "C111" if kind == "slack" else "-100", "tsk_1", None,
                                token or (stub.slack_token if kind == "slack" else stub.telegram_token),
                                signing_secret=SECRET, secret_token=TG_SECRET)


def stub_config(tmp_path: Path, stub: ChannelStub, **more) -> outpost.Config:
    return outpost.Config(data_dir=tmp_path, slack_api_url=f"{stub.url}/slack",
                          telegram_api_url=f"{stub.url}/telegram", **more)


def test_a_reply_to_slack_is_escaped_so_an_agent_cannot_ping_the_channel(tmp_path, stub):
    assert outpost.send_channel_message(stub_config(tmp_path, stub), entry_for(stub), "<!channel> & <@U9>") is None
    assert stub.posted("/slack/chat.postMessage") == [{"channel": "C111", "text": "&lt;!channel&gt; &amp; &lt;@U9&gt;"}]


def test_an_error_of_a_send_never_shows_the_bot_token(tmp_path, stub):
    config = outpost.Config(data_dir=tmp_path, telegram_api_url=f"{stub.url}/tele gram")   # an invalid URL
    error = outpost.send_channel_message(config, entry_for(stub, "telegram", "123:very-secret"), "hi")
    assert error and "123:very-secret" not in error and "<bot token>" in error


def test_a_hostile_users_info_answer_falls_back_to_the_user_id(tmp_path, stub):
    stub.users["U9"] = {"id": "U9", "profile": "not an object"}
    assert outpost.slack_user_name(stub_config(tmp_path, stub), entry_for(stub), "U9") == "U9"
    assert outpost.slack_user_name(stub_config(tmp_path, stub), entry_for(stub), "U123") == "ada"


def test_two_channels_feeding_one_task_stop_serve(store):
    agent = store.transaction(store.office.create_agent, None, outpost.normalize_agent(
        {"name": "Release", "executor": "demo"}, profiles=["demo"]), T0)[0]
    task = store.transaction(store.office.create_task, None, outpost.normalize_task(
        {"title": "t", "assignee_agent_id": agent["id"]}, profiles=["demo"]), T0)[0]
    entries = tuple(outpost.ChannelEntry(name, "slack", f"C{i}", task["id"], None, "xoxb", signing_secret="s")
                    for i, name in enumerate(("ops", "alerts")))
    with pytest.raises(outpost.ConfigError, match="alerts and ops feed the same task"):
        store.transaction(store.channels.sync, entries, T0)


# --- configuration ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("toml", "says"), [
    ('[[channels]]\nname = "ops"\nkind = "slack"\nchannel = "C1"\ntask = "create"\nagent = "A"\n'
     'bot_token = "x"\n', "channels[0].signing_secret is missing"),
    ('[[channels]]\nname = "ops"\nkind = "irc"\n', "channels[0].kind"),
    ('[[channels]]\nname = "ops"\nkind = "slack"\nchannel = "C1"\ntask = "create"\nsigning_secret = "s"\n'
     'bot_token = "x"\n', "channels[0].agent is missing"),
    ('[[channels]]\nname = "ops"\nkind = "telegram"\nchannel = 5\ntask = "t"\nbot_token = "x"\n'
     'secret_token = "has:colon"\n', "secret_token must be 1-256"),
    ('[[channels]]\nname = "ops"\nkind = "telegram"\nchannel = 5\ntask = "t"\nbot_token = "123:AB CD"\n'
     'secret_token = "s"\n', "bot_token must be one word of visible ASCII"),
    ('[[channels]]\nname = "ops"\nkind = "telegram"\nchannel = 5\ntask = "t"\nbot_token = "env:NO_SUCH_VAR_X"\n'
     'secret_token = "s"\n', "names $NO_SUCH_VAR_X, which is not set (or empty)"),
    ('[[channels]]\nname = "ops"\nkind = "slack"\nchanel = "C1"\n', "channels[0].chanel is not a setting"),
    ('[settings]\nslack_api_url = "ftp://x"\n', "settings.slack_api_url must be an http(s) URL"),
])
def test_a_channel_config_error_names_its_key(tmp_path, toml, says):
    (tmp_path / "outpost.toml").write_text(toml)
    with pytest.raises(outpost.ConfigError, match=None) as err:
        outpost.load_config(tmp_path)
    assert says in str(err.value)


def test_a_channel_secret_may_come_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("OPS_BOT_TOKEN", "123:from-env")
    (tmp_path / "outpost.toml").write_text('[[channels]]\nname = "ops"\nkind = "telegram"\nchannel = -100\n'
                                           'task = "tsk_1"\nbot_token = "env:OPS_BOT_TOKEN"\nsecret_token = "s_1"\n')
    (entry,) = outpost.load_config(tmp_path).channels
    assert (entry.bot_token, entry.channel, entry.key) == ("123:from-env", "-100", "channel:ops")


# --- end to end: a real server, the stubs ------------------------------------------------------------------

@pytest.fixture
def stub():
    s = ChannelStub().start()
    yield s
    s.stop()


def channels_toml(stub: ChannelStub) -> str:
    return (f'[settings]\nslack_api_url = "{stub.url}/slack"\ntelegram_api_url = "{stub.url}/telegram"\n'
            f'[[channels]]\nname = "ops"\nkind = "slack"\nchannel = "C111"\ntask = "create"\nagent = "Release"\n'
            f'signing_secret = "{SECRET}"\nbot_token = "{stub.slack_token}"\n'
            f'[[channels]]\nname = "phone"\nkind = "telegram"\nchannel = -100\ntask = "create"\nagent = "Release"\n'
            f'bot_token = "{stub.telegram_token}"\nsecret_token = "{TG_SECRET}"\n')


@pytest.fixture
def office_with_channels(server_factory, tmp_path, git_repo, stub):
    """A daemon whose Office has the agent "Release" (demo executor) and a repository, restarted
    with two channels that create their tasks."""
    data = tmp_path / "data"
    first = server_factory(data_dir=data)
    with first.client() as client:
        assert client.patch("/api/office/settings", json={"repository": str(git_repo)}).status_code == 200
        assert client.post("/api/office/agents", json={"name": "Release", "executor": "demo",
                                                       "cooldown_sec": 0}).status_code == 201
    assert first.stop() == 0
    (data / "outpost.toml").write_text(channels_toml(stub))
    return server_factory(data_dir=data)


def post_slack(client: httpx.Client, envelope: dict, *, at: float | None = None, secret: str = SECRET,
               name: str = "ops", headers: dict | None = None) -> httpx.Response:
    body = json.dumps(envelope).encode()
    sent = {"Content-Type": "application/json", **slack_headers(body, time.time() if at is None else at, secret),
            **(headers or {})}
    return client.post(f"/api/channels/slack/{name}", content=body, headers=sent)


def channel(client: httpx.Client, name: str) -> dict:
    (found,) = [c for c in client.get("/api/office/channels").json()["channels"] if c["name"] == name]
    return found


def test_a_slack_message_becomes_a_comment_that_wakes_the_agent_whose_reply_is_posted_back(office_with_channels,
                                                                                         stub):
    """The journey: Slack event -> comment (by its sender's display name) -> wakeup -> run -> the
    agent's comment -> chat.postMessage at the stub."""
    server = office_with_channels
    with server.client() as client:
        ops = channel(client, "ops")
        task = client.get(f"/api/office/tasks/{ops['task_id']}").json()
        assert task["title"] == "ops (Slack)" and task["state"] == "IN_PROGRESS"
        assert post_slack(client, {"type": "url_verification", "challenge": "c-123", "token": "t"}).json() == {
            "challenge": "c-123"}
        reply = post_slack(client, slack_event("Please cut 1.4 tonight\n@comment Cutting 1.4 now."))
        assert reply.status_code == 200 and reply.json()["status"] == "comment"
        comment = client.get(f"/api/office/tasks/{ops['task_id']}").json()["comments"][-1]
        assert (comment["author"], comment["author_agent_id"]) == ("ada", None)
        assert "Please cut 1.4 tonight" in comment["body"]
        woke = wait_for(lambda: [w for w in client.get("/api/office/wakeups?source=comment").json()["wakeups"]
                                 if w["payload"].get("comment_id") == comment["id"]])
        assert woke[0]["status"] in ("queued", "claimed", "finished")
        posted = wait_for(lambda: stub.posted("/slack/chat.postMessage"), timeout_s=60)
        assert posted == [{"channel": "C111", "text": "Cutting 1.4 now."}]
        assert [r["authorization"] for r in stub.requests if r["path"].endswith("chat.postMessage")] == [
            f"Bearer {stub.slack_token}"]
        # Slack's retry of the same event (its X-Slack-Retry-Num) adds nothing.
        again = post_slack(client, slack_event("Please cut 1.4 tonight\n@comment Cutting 1.4 now."),
                           headers={"X-Slack-Retry-Num": "1", "X-Slack-Retry-Reason": "http_timeout"})
        assert again.json() == {"status": "duplicate"}
        assert len(client.get(f"/api/office/tasks/{ops['task_id']}").json()["comments"]) == 2   # +the agent's
        state = wait_for(lambda: (c := channel(client, "ops"))["last_out_at"] and c)
        assert state["last_in_at"] and state["last_error"] is None
    assert server.stop() == 0
    logs = server.logs()
    assert "channel ops message" in logs and "sent" in logs


def test_forged_stale_and_unsigned_slack_requests_are_refused_and_recorded(office_with_channels):
    server = office_with_channels
    with server.client() as client:
        forged = post_slack(client, slack_event("rm -rf"), secret="not the secret")
        stale = post_slack(client, slack_event("old", event_id="Ev02"), at=time.time() - 301)
        unsigned = client.post("/api/channels/slack/ops", content=b"{}", headers={"Content-Type": "application/json"})
        assert [r.status_code for r in (forged, stale, unsigned)] == [401, 401, 401]
        assert client.post("/api/channels/slack/nope", content=b"{}").status_code == 404
        refused = channel(client, "ops")["refused"]
        assert [r["reason"] for r in refused][::-1] == ["bad signature", refused[1]["reason"],
                                                          "missing X-Slack-Request-Timestamp"]
        assert refused[1]["reason"].startswith("stale timestamp") and refused[0]["size"] == 2
        ops = channel(client, "ops")
        assert client.get(f"/api/office/tasks/{ops['task_id']}").json()["comments"] == []


def test_a_telegram_update_becomes_a_comment_and_a_wrong_secret_is_refused(office_with_channels, stub):
    server = office_with_channels
    update = {"update_id": 500, "message": {"message_id": 9, "date": int(time.time()),
                                            "chat": {"id": -100, "type": "group"},
                                            "from": {"id": 5, "is_bot": False, "first_name": "Ada"},
                                            "text": "status?\n@comment All green."}}
    with server.client() as client:
        wrong = client.post("/api/channels/telegram/phone", json=update,
                            headers={"X-Telegram-Bot-Api-Secret-Token": "guess"})
        assert wrong.status_code == 401
        ok = client.post("/api/channels/telegram/phone", json=update,
                         headers={"X-Telegram-Bot-Api-Secret-Token": TG_SECRET})
        assert ok.json()["status"] == "comment"
        dup = client.post("/api/channels/telegram/phone", json=update,
                          headers={"X-Telegram-Bot-Api-Secret-Token": TG_SECRET})
        assert dup.json() == {"status": "duplicate"}
        phone = channel(client, "phone")
        comment = client.get(f"/api/office/tasks/{phone['task_id']}").json()["comments"][0]
        assert comment["author"] == "Ada"
        sent = wait_for(lambda: stub.posted(f"/telegram/bot{stub.telegram_token}/sendMessage"), timeout_s=60)
        assert sent == [{"chat_id": "-100", "text": "All green."}]
        assert [r["reason"] for r in channel(client, "phone")["refused"]] == [
            "missing or wrong X-Telegram-Bot-Api-Secret-Token"]


async def test_a_reply_while_slack_is_down_is_delivered_once_late(tmp_path, autojump_clock, stub):
    """The outbox's rows are the truth: a reply that met a 503 is sent at its retry (60 s), once."""
    autojump_clock.autojump_threshold = math.inf   # time moves only when the test says
    (data := tmp_path / "cfg").mkdir()
    (data / "outpost.toml").write_text(channels_toml(stub))
    config = outpost.load_config(data)
    store, watcher = outpost.Store(tmp_path / "outpost.sqlite3"), outpost.Store(tmp_path / "outpost.sqlite3")
    call(store, store.office.create_agent, None, outpost.normalize_agent({"name": "Release", "executor": "demo"},
                                                                          profiles=["demo"]), T0)
    store.notify.configure(config.notify, config.channels)
    call(store, store.channels.sync, config.channels, T0)
    call(watcher, watcher.channels.sync, config.channels, T0)   # the same task: made once
    task_id = channel_of(store, "ops")["task_id"]
    agent_id = call(store, store.office.get_task, task_id)["assignee_agent_id"]
    call(store, store.office.add_comment, task_id, "Cut 1.4: done.", T0, agent_id)
    call(store, store.office.add_comment, task_id, "a person's comment is not posted back", T0)
    stub.down = True
    deps = outpost.Deps(config=config, store=store, clock=outpost.TrioClock(T0), token="t", inline_db=True,
                        api_url="http://127.0.0.1:8321")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outpost.outbox_actor, deps)
        failed = await trio.to_thread.run_sync(lambda: wait_for(lambda: channel_of(watcher, "ops")["last_error"]))
        assert "503" in failed and stub.posted("/slack/chat.postMessage") == [{"channel": "C111",
                                                                                 "text": "Cut 1.4: done."}]
        stub.down = False
        autojump_clock.jump(60)
        await trio.to_thread.run_sync(lambda: wait_for(lambda: channel_of(watcher, "ops")["last_out_at"]))
        for _ in range(3):   # hours pass: nothing is sent again
            autojump_clock.jump(3600)
            await trio.sleep(0)
        nursery.cancel_scope.cancel()
    answered = [r["status"] for r in stub.requests if r["path"].endswith("chat.postMessage")]
    assert answered == [503, 200]
    assert channel_of(store, "ops")["last_error"] is None
    store.close()
    watcher.close()


def channel_of(store: outpost.Store, name: str) -> dict:
    (found,) = [c for c in call(store, store.channels.states) if c["name"] == name]
    return found


def test_a_channel_naming_a_missing_agent_stops_serve_with_one_line(tmp_path, stub):
    data = tmp_path / "data"
    data.mkdir()
    (data / "outpost.toml").write_text(channels_toml(stub))
    import subprocess
    import sys
    done = subprocess.run([sys.executable, str(Path(outpost.__file__)), "serve", "--data-dir", str(data),
                           "--port", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "outpost: channels: ops.agent 'Release' is no agent of the default workspace"]
    assert datetime.now(UTC) > T0


def test_a_slow_users_info_does_not_hold_the_event_the_sender_is_its_id(office_with_channels, stub):
    stub.users_delay_s = 4   # past the 1.5 s Outpost waits for a name (Slack waits 3 s for the answer)
    with office_with_channels.client() as client:
        reply = post_slack(client, slack_event("slow name", event_id="EvSlow"))
        assert reply.json()["status"] == "comment"
        ops = channel(client, "ops")
        comment = client.get(f"/api/office/tasks/{ops['task_id']}").json()["comments"][-1]
        assert comment["author"] == "U123"
        again = post_slack(client, slack_event("slow name", event_id="EvSlow"))
        assert again.json() == {"status": "duplicate"}   # before any lookup



def test_a_channels_agent_is_checked_at_every_start_and_its_task_is_made_once(store):
    store.transaction(store.office.create_agent, None, outpost.normalize_agent(
        {"name": "Release", "executor": "demo"}, profiles=["demo"]), T0)
    entry = outpost.ChannelEntry("ops", "slack", "C1", "create", "Release", "xoxb", signing_secret="s")
    store.transaction(store.channels.sync, (entry,), T0)
    store.transaction(store.channels.sync, (entry,), T0)
    tasks = store.transaction(store.office.list_tasks, None, None)[0]
    assert [t["title"] for t in tasks] == ["ops (Slack)"]
    typo = outpost.ChannelEntry("ops", "slack", "C1", "create", "Relase", "xoxb", signing_secret="s")
    with pytest.raises(outpost.ConfigError, match="ops.agent 'Relase' is no agent"):
        store.transaction(store.channels.sync, (typo,), T0)


def test_a_channel_message_is_a_comment_whose_mentions_wake_the_named_agents(store):
    def agent(name: str) -> str:
        return store.transaction(store.office.create_agent, None, outpost.normalize_agent(
            {"name": name, "executor": "demo"}, profiles=["demo"]), T0)[0]["id"]
    release, bob = agent("Release"), agent("Bob")
    entry = outpost.ChannelEntry("ops", "slack", "C1", "create", "Release", "xoxb", signing_secret="s")
    store.transaction(store.channels.sync, (entry,), T0)
    taken = store.transaction(store.channels.receive, "ops", outpost.ChannelMessage(
        "Ev1", "ada", "@Bob please look, @Ghost too"), T0)[0]
    comment = store.transaction(store.office.get_task, taken["task_id"])[0]["comments"][-1]
    assert (comment["author"], comment["mentions"]) == ("ada", [{"name": "Bob", "agent_id": bob},
                                                                {"name": "Ghost", "agent_id": None}])
    woken = store.transaction(store.office.list_wakeups, None, None, None, None, 100)[0]
    assert {(w["agent_id"], w["source"], w["reason"]) for w in woken if w["payload"].get("comment_id")} == {
        (release, "comment", "comment"), (bob, "user", "mentioned")}
    assert store.transaction(store.channels.receive, "ops", outpost.ChannelMessage("Ev1", "ada", "again"),
                             T0)[0] == {"status": "duplicate"}
