"""Local stubs of Slack's Web API and Telegram's Bot API (docs/office.md "Channels"): the methods
Outpost calls, answered as the services document them, every request recorded.

Slack (https://docs.slack.dev/reference/methods/chat.postMessage, .../users.info): ``POST
/chat.postMessage`` with ``Authorization: Bearer <bot token>`` and a JSON body answers
``{"ok": true, "channel", "ts"}``, ``{"ok": false, "error": "invalid_auth"}`` for another token;
``GET /users.info?user=U...`` answers the user's profile. Telegram
(https://core.telegram.org/bots/api#sendmessage): ``POST /bot<token>/sendMessage`` answers
``{"ok": true, "result": {...}}``, or 401 ``{"ok": false, "error_code": 401, "description":
"Unauthorized"}``. ``down = True`` makes both answer 503 (a provider outage) until set back.
"""
from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.parse


class ChannelStub:
    def __init__(self, slack_token: str = "xoxb-stub", telegram_token: str = "123:stub") -> None:
        self.slack_token, self.telegram_token = slack_token, telegram_token
        self.users = {"U123": {"id": "U123", "real_name": "Ada Lovelace", "profile": {"display_name": "ada"}}}
        self.requests: list[dict] = []
        self.down = False
        self.users_delay_s = 0.0   # users.info answers this late
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def answer(self, status: int, body: dict) -> None:
                stub.requests[-1]["status"] = status
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def record(self, body: dict | None) -> urllib.parse.SplitResult:
                url = urllib.parse.urlsplit(self.path)
                stub.requests.append({"method": self.command, "path": url.path, "query": url.query,
                                      "authorization": self.headers.get("Authorization"), "body": body})
                return url

            def do_GET(self) -> None:
                url = self.record(None)
                if stub.down:
                    return self.answer(503, {"ok": False, "error": "service_unavailable"})
                if url.path == "/slack/users.info":
                    time.sleep(stub.users_delay_s)
                    if self.headers.get("Authorization") != f"Bearer {stub.slack_token}":
                        return self.answer(200, {"ok": False, "error": "invalid_auth"})
                    user = stub.users.get(urllib.parse.parse_qs(url.query).get("user", [""])[0])
                    return self.answer(200, {"ok": True, "user": user} if user else {"ok": False,
                                                                                     "error": "user_not_found"})
                self.answer(404, {"ok": False, "error": "unknown_method"})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                url = self.record(body)
                if stub.down:
                    return self.answer(503, {"ok": False, "error": "service_unavailable"})
                if url.path == "/slack/chat.postMessage":
                    if self.headers.get("Authorization") != f"Bearer {stub.slack_token}":
                        return self.answer(200, {"ok": False, "error": "invalid_auth"})
                    return self.answer(200, {"ok": True, "channel": body.get("channel"), "ts": "1700000000.000100"})
                if url.path == f"/telegram/bot{stub.telegram_token}/sendMessage":
                    return self.answer(200, {"ok": True, "result": {"message_id": 7, "chat": {"id": body["chat_id"]},
                                                                    "text": body.get("text")}})
                if url.path.startswith("/telegram/bot"):
                    return self.answer(401, {"ok": False, "error_code": 401, "description": "Unauthorized"})
                self.answer(404, {"ok": False, "error": "unknown_method"})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> ChannelStub:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def posted(self, path_end: str) -> list[dict]:
        return [r["body"] for r in self.requests if r["method"] == "POST" and r["path"].endswith(path_end)]
