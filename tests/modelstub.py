"""A stub of the model APIs the agent CLIs call, on 127.0.0.1, for the end-to-end tests of the real
CLIs (docs/agent-clis.md). Each CLI's own base-URL setting points at it; it answers with what the providers
document. The scenario is named in the prompt, ``stub:<scenario>`` (the latest one in a request's
conversation wins, so runs of several scenarios can share one stub), else ``stub.scenario``.

What it speaks, and where the shapes come from (the providers' public API documentation):
- Anthropic Messages, ``POST /v1/messages`` with ``"stream": true``: the server-sent events
  message_start, content_block_start, ping, content_block_delta (text_delta, input_json_delta),
  content_block_stop, message_delta (stop_reason, usage), message_stop.
  https://platform.claude.com/docs/en/build-with-claude/streaming
  Errors: ``{"type": "error", "error": {"type": ..., "message": ...}}`` with 401
  authentication_error, 403 permission_error, 429 rate_limit_error, 529 overloaded_error.
  https://docs.claude.com/en/api/errors
  429 headers: ``retry-after`` (seconds) and ``anthropic-ratelimit-{requests,tokens,input-tokens,
  output-tokens}-{limit,remaining,reset}`` (reset in RFC 3339). https://docs.claude.com/en/api/rate-limits
  The subscription limit headers ``anthropic-ratelimit-unified-*`` (status, reset in epoch seconds,
  representative-claim, overage-status, overage-disabled-reason) are not in the public docs: their
  names and values are the ones Claude Code 2.1.197 reads (its bundled code) and reports as
  ``rate_limit_event.rate_limit_info`` (anthropics/claude-code#38673 shows one captured).
- OpenAI Responses, ``POST /v1/responses`` with ``"stream": true``: response.created,
  response.in_progress, response.output_item.added, response.content_part.added,
  response.output_text.delta, response.output_text.done, response.content_part.done,
  response.output_item.done, response.completed (with ``usage``); a function_call output item for a
  tool call. https://platform.openai.com/docs/api-reference/responses-streaming
  OpenAI Chat Completions (aider, through litellm), ``POST /v1/chat/completions``: one
  ``chat.completion`` object, or ``chat.completion.chunk`` events ending with ``data: [DONE]``.
  https://platform.openai.com/docs/api-reference/chat , .../chat-streaming
  Errors: ``{"error": {"message", "type", "param", "code"}}``: 401 invalid_api_key, 403
  unsupported_country_region_territory, 429 rate_limit_exceeded and insufficient_quota ("You
  exceeded your current quota, please check your plan and billing details"), 503 "The engine is
  currently overloaded". https://platform.openai.com/docs/guides/error-codes
  429 headers: ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` (reset as a duration, "6m0s").
  https://platform.openai.com/docs/guides/rate-limits
  Codex first asks for a WebSocket on ``GET /v1/responses``; the stub refuses the upgrade at once
  (426), and Codex falls back to HTTP server-sent events.
- Gemini, ``POST /v1beta/models/{model}:streamGenerateContent?alt=sse`` (and ``:generateContent``):
  GenerateContentResponse objects (candidates[].content.parts[].text | functionCall, finishReason,
  usageMetadata, modelVersion). https://ai.google.dev/api/generate-content
  Errors: ``{"error": {"code", "message", "status", "details"}}``: 400 INVALID_ARGUMENT with an
  ErrorInfo ``API_KEY_INVALID``, 401 UNAUTHENTICATED, 403 PERMISSION_DENIED, 429 RESOURCE_EXHAUSTED
  (QuotaFailure, RetryInfo ``retryDelay``), 503 UNAVAILABLE "The model is overloaded".
  https://ai.google.dev/gemini-api/docs/troubleshooting , https://ai.google.dev/gemini-api/docs/rate-limits

Scenarios: success, tool (the model asks to run ``git push origin HEAD``, which an unattended
run may not), calls (below), 401, 403, 429, 529 (overloaded), credits (out of credits or quota), bad-key
(Gemini's API_KEY_INVALID), token-limit (the reply is cut at max tokens).

calls: the model runs a script of tool calls written in the user's prompt, one a line,
``stub-call: <tool> <json object of arguments>``. Stateless like the rest: on each request it
counts the tool results the conversation holds (Anthropic ``tool_result`` blocks, Responses
``function_call_output``/``custom_tool_call_output`` items, Gemini ``functionResponse`` parts) and
makes call n of the script, else answers REPLY and then one line per tool result's text (so a test
reads in the final message what the tools answered). The tool is the offered one named ``<tool>``,
or ending with ``__<tool>``, or with ``_<tool>`` (Claude Code offers an MCP server's tools as
``mcp__<server>__<tool>``, Gemini CLI as ``mcp_<server>_<tool>``, Codex as functions ``<tool>`` in a
``{"type": "namespace", "name": "mcp__<server>"}`` tool, called with ``"namespace"``); none, and the
model answers ``no tool <tool> offered``. Codex's code-mode models (``tool_mode`` code_mode_only in
its model catalog, its default model among them) are offered no MCP tool directly, only the
custom tool ``exec`` that runs JavaScript calling ``tools.<name>`` (names in ``ALL_TOOLS``): the
model calls ``exec`` with a script that finds the tool there by the same rule and prints its text
(and the names in ALL_TOOLS: the requests after it list them in ``stub.requests[...]["tools"]``).
``stub.calls`` lists each call the model made and each tool result it was given
(``{"api", "kind": "call" | "result", "tool", "arguments" | "text"}``).
Tool calls: Anthropic ``tool_use`` blocks (input_json_delta), https://platform.claude.com/docs/en/
agents-and-tools/tool-use/implement-tool-use ; Responses ``function_call`` and ``custom_tool_call``
items, https://platform.openai.com/docs/guides/function-calling ; Gemini ``functionCall`` parts,
https://ai.google.dev/gemini-api/docs/function-calling
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: What the model answers in a successful turn.
REPLY = "Done: the stub model answered."
#: Token counts of one successful reply (each CLI adds up its requests its own way).
USAGE = {"input_tokens": 1200, "output_tokens": 345, "cache_read_input_tokens": 5000}
#: The command the model asks to run in the ``tool`` scenario.
DENIED_COMMAND = "git push origin HEAD"
#: How far ahead the stub's limits reset.
RESET_IN_S = 3 * 3600
SCENARIOS = ("success", "tool", "calls", "401", "403", "429", "429-weekly", "529", "credits", "spend", "bad-key",
             "token-limit", "500", "500-retry-after", "502", "502-retry-after", "503", "503-retry-after", "cut",
             "hang", "capacity", "capacity-503", "usage-limit", "usage-limit-weekly")
#: The provider outages (500 api_error / server_error / INTERNAL, 502 a gateway's HTML page, 503), each
#: also with a ``retry-after`` header of RETRY_AFTER_5XX_S seconds.
OUTAGES = ("500", "500-retry-after", "502", "502-retry-after", "503", "503-retry-after")
RETRY_AFTER_5XX_S = 120
#: What a gateway in front of the API (Cloudflare) answers for a 502.
BAD_GATEWAY_HTML = (b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway"
                    b"</h1></center>\r\n<hr><center>cloudflare</center>\r\n</body>\r\n</html>\r\n")
#: How long a ``hang`` request is held at most (the CLI is killed long before).
HANG_S = 900


class ModelStub:
    """The stub server: ``start()``, set ``scenario``, read ``requests``, ``stop()``."""

    def __init__(self) -> None:
        self.scenario = "success"   # for a request that names none
        self.requests: list[dict] = []
        #: The ``calls`` scenario's tool calls and the tool results they got (see the module's doc).
        self.calls: list[dict] = []
        self._results_seen: set[tuple] = set()
        self._lock = threading.Lock()
        #: The wait a rate limit names (OpenAI's "try again in Ns" and retry-after); the CLIs retry
        #: after it before they give up, so the tests keep it short.
        self.retry_after_s = 20.0
        self.reset_at = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=RESET_IN_S)
        #: Set by stop(): a ``hang`` request lets go.
        self.stopped = threading.Event()
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.stub = self
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> ModelStub:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.server.shutdown()
        self.server.server_close()


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A CLI that hangs up early (it retries, or its run ended) is no error of the stub's."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _sse(name: str | None, data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data)
    return ((f"event: {name}\n" if name else "") + f"data: {text}\n\n").encode()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: ThreadingHTTPServer
    scenario = "success"

    def log_message(self, format: str, *args) -> None:   # noqa: A002 - the base class's name
        pass

    @property
    def stub(self) -> ModelStub:
        return self.server.stub

    # --- plumbing ------------------------------------------------------------------------

    def _body(self) -> dict:
        size = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(size) if size else b""
        if self.headers.get("content-encoding") == "zstd":   # Codex compresses its requests
            if shutil.which("zstd") is None:
                return {}
            raw = subprocess.run(["zstd", "-dcq"], input=raw, capture_output=True, check=False).stdout
        markers = re.findall(rb"stub:([a-z0-9-]+)", raw)   # the latest message's marker wins
        self.scenario = markers[-1].decode() if markers else self.stub.scenario
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return {}
        return body if isinstance(body, dict) else {}

    def _send(self, status: int, body: dict | bytes, headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, chunks: list[bytes], headers: dict[str, str] | None = None) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(chunk)
            self.wfile.flush()
        self.close_connection = True

    def _outage(self, api: str) -> bool:
        """Answer the scenario's 5xx (OUTAGES) or hang, if it is one; False otherwise."""
        scenario = self.scenario
        if scenario == "hang":   # the request is read and never answered
            self.stub.stopped.wait(HANG_S)
            self.close_connection = True
            return True
        if scenario not in OUTAGES:
            return False
        status = int(scenario[:3])
        headers = {"retry-after": str(RETRY_AFTER_5XX_S)} if scenario.endswith("-retry-after") else {}
        if status == 502:
            self._send(502, BAD_GATEWAY_HTML, headers, content_type="text/html")
        elif api == "anthropic":
            self._send(status, _anthropic_error("api_error", "Internal server error" if status == 500
                                                else "Service Unavailable"), headers)
        elif api == "gemini":
            self._send(status, _google_error(500, "An internal error has occurred. Please retry or report in "
                                             "https://developers.generativeai.google/guide/troubleshooting",
                                             "INTERNAL") if status == 500 else
                       _google_error(503, "The service is currently unavailable.", "UNAVAILABLE"), headers)
        else:
            self._send(status, _openai_error("The server had an error while processing your request. Sorry about that!"
                                             if status == 500 else "The server is overloaded or not ready yet.",
                                             "server_error", None), headers)
        return True

    def _cut(self, chunks: list[bytes], whole: bytes | None = None) -> None:
        """The ``cut`` scenario: a reply begun (the chunks of a stream, or the head of a ``whole``
        body under its full content-length), then the connection closed without its end."""
        if whole is not None:
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(whole)))
            self.end_headers()
            self.wfile.write(whole[:len(whole) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self._stream(chunks)

    def _record(self, api: str, body: dict) -> None:
        tools = [t["name"] for t in _offered_tools(api, body)]
        for result in _tool_results(api, body) if api == "responses" else []:   # code mode's nested tools
            tools += [n for n in result.get("offered", []) if n not in tools]
        self.stub.requests.append({"api": api, "path": self.path, "scenario": self.scenario,
                                   "model": body.get("model"), "tools": tools, "at": time.time()})

    def _calls_turn(self, api: str, body: dict) -> tuple[dict | None, str]:
        """The ``calls`` scenario's next move: (the call to make, "") or (None, the text to answer)."""
        script, results = _script(api, body), _tool_results(api, body)
        with self.stub._lock:
            for result in results:
                if result["key"] not in self.stub._results_seen:
                    self.stub._results_seen.add(result["key"])
                    self.stub.calls.append({"api": api, "kind": "result", "tool": result["tool"],
                                            "text": result["text"]})
        if results and results[-1].get("missing") and _ends_with_a_result(api, body):   # code mode found none
            return None, f"no tool {results[-1]['missing']} offered"
        if len(results) >= len(script):
            return None, "\n".join([REPLY, *(r["text"] for r in results)])
        tool, arguments = script[len(results)]
        if arguments is None:
            return None, f"stub-call {tool}: the arguments are no JSON object"
        offered = _offered_tools(api, body)
        found = _match(tool, offered)
        if found is None and api == "responses":   # Codex's code mode: the tools are behind `exec`
            found = next((t for t in offered if t["type"] == "custom" and t["call"] == "exec"), None)
            if found is not None:
                found = {**found, "code": _code_mode_call(tool, arguments)}
        if found is None:
            return None, f"no tool {tool} offered"
        call = {"api": api, "kind": "call", "tool": found["name"], "arguments": arguments}
        if "code" in found:
            call |= {"wants": tool, "code": found["code"]}
        with self.stub._lock:
            self.stub.calls.append(call)
        return {**found, "arguments": arguments}, ""

    def do_HEAD(self) -> None:
        self._send(200, b"")

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if self.headers.get("upgrade", "").lower() == "websocket":   # Codex's Responses WebSocket: refused
            self._record("websocket", {})
            self._send(426, {"error": {"message": "this stub speaks HTTP only", "type": "invalid_request_error",
                                       "param": None, "code": None}})
            return
        if path.endswith("/models"):
            self._send(200, {"object": "list", "data": [], "models": []})
            return
        self._send(404, {"error": {"message": "not found", "type": "invalid_request_error", "param": None,
                                   "code": None}})

    def do_POST(self) -> None:
        path = self.path.split("?")[0]
        body = self._body()
        if path.endswith("/v1/messages/count_tokens"):
            self._send(200, {"input_tokens": 10})
        elif path.endswith("/v1/messages"):
            self._record("anthropic", body)
            self.anthropic(body)
        elif path.endswith("/responses"):
            self._record("responses", body)
            self.openai_responses(body)
        elif path.endswith("/chat/completions"):
            self._record("chat", body)
            self.chat(body)
        elif ":streamGenerateContent" in path or ":generateContent" in path:
            self._record("gemini", body)
            self.gemini(body, path.rpartition("/")[2].partition(":")[0], stream=":stream" in path)
        elif ":countTokens" in path:
            self._send(200, {"totalTokens": 10})
        else:
            self._send(404, {"error": {"message": f"no such endpoint {path}", "type": "invalid_request_error",
                                       "param": None, "code": None}})

    # --- Anthropic Messages --------------------------------------------------------------

    def anthropic(self, body: dict) -> None:
        scenario = self.scenario
        if scenario in ("401", "bad-key"):   # an OAuth token's 401: anthropics/claude-code#6459 and others
            return self._send(401, _anthropic_error("authentication_error", "invalid x-api-key" if "x-api-key" in
                                                    self.headers else "OAuth token has expired. Please obtain a "
                                                    "new token or refresh your existing token."))
        if scenario == "403":
            return self._send(403, _anthropic_error(
                "permission_error", "Your API key does not have permission to use the specified resource."))
        if scenario in ("429", "429-weekly", "credits", "spend"):
            return self._anthropic_limit(scenario)
        if scenario == "529":
            return self._send(529, _anthropic_error("overloaded_error", "Overloaded"))
        if self._outage("anthropic"):
            return None
        model = body.get("model") or "claude-stub"
        message_id = "msg_" + uuid.uuid4().hex[:24]
        tool_turn = scenario == "tool" and not _answered_a_tool(body)
        call, text = self._calls_turn("anthropic", body) if scenario == "calls" else (None, REPLY)
        tool_turn = tool_turn or call is not None
        usage = {"input_tokens": USAGE["input_tokens"], "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": USAGE["cache_read_input_tokens"], "output_tokens": 1}
        if scenario == "token-limit":
            stop = "max_tokens"
        else:
            stop = "tool_use" if tool_turn else "end_turn"
        if tool_turn:
            name, arguments = ((call["call"], call["arguments"]) if call else
                               ("Bash", {"command": DENIED_COMMAND, "description": "Push the branch"}))
            block = {"type": "tool_use", "id": "toolu_01" + uuid.uuid4().hex[:22], "name": name, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(arguments)}
        else:
            block, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": text}
        if not body.get("stream"):
            content = ([{**block, "input": json.loads(delta["partial_json"])}] if tool_turn
                       else [{"type": "text", "text": text}])
            whole = {"id": message_id, "type": "message", "role": "assistant", "model": model,
                     "content": content, "stop_reason": stop, "stop_sequence": None,
                     "usage": {**usage, "output_tokens": USAGE["output_tokens"]}}
            if scenario == "cut":
                return self._cut([], json.dumps(whole).encode())
            return self._send(200, whole)
        if scenario == "cut":   # message_start, the block begun, half the text: then the connection closes
            return self._cut([
                _sse("message_start", {"type": "message_start", "message": {
                    "id": message_id, "type": "message", "role": "assistant", "content": [], "model": model,
                    "stop_reason": None, "stop_sequence": None, "usage": usage}}),
                _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                             "content_block": {"type": "text", "text": ""}}),
                _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                             "delta": {"type": "text_delta", "text": REPLY[:len(REPLY) // 2]}})])
        self._stream([
            _sse("message_start", {"type": "message_start", "message": {
                "id": message_id, "type": "message", "role": "assistant", "content": [], "model": model,
                "stop_reason": None, "stop_sequence": None, "usage": usage}}),
            _sse("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}),
            _sse("ping", {"type": "ping"}),
            _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
            _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
            _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                   "usage": {"output_tokens": USAGE["output_tokens"]}}),
            _sse("message_stop", {"type": "message_stop"}),
        ])

    def _anthropic_limit(self, scenario: str) -> None:
        """A limit as the API answers it: to an API key, the documented 429 (or, out of credits, the
        400 of a credit balance too low); to a subscription's OAuth token, the same with the
        ``anthropic-ratelimit-unified-*`` headers Claude Code turns into its limit messages."""
        oauth = "x-api-key" not in self.headers
        weekly = scenario == "429-weekly"
        reset = self.stub.reset_at + (timedelta(days=3) if weekly else timedelta())
        rfc = reset.isoformat().replace("+00:00", "Z")
        documented = {"retry-after": str(int((reset - datetime.now(UTC)).total_seconds())),
                      "anthropic-ratelimit-requests-limit": "50", "anthropic-ratelimit-requests-remaining": "0",
                      "anthropic-ratelimit-requests-reset": rfc,
                      "anthropic-ratelimit-tokens-limit": "40000", "anthropic-ratelimit-tokens-remaining": "0",
                      "anthropic-ratelimit-tokens-reset": rfc}
        claim, reason = {"429": ("five_hour", "org_level_disabled"),
                         "429-weekly": ("seven_day", "org_level_disabled"),
                         "credits": ("overage", "out_of_credits"),
                         "spend": ("overage", "org_spend_cap_reached")}[scenario]
        unified = {"anthropic-ratelimit-unified-status": "rejected",
                   "anthropic-ratelimit-unified-reset": str(int(reset.timestamp())),
                   "anthropic-ratelimit-unified-representative-claim": claim,
                   "anthropic-ratelimit-unified-overage-status": "rejected",
                   "anthropic-ratelimit-unified-overage-disabled-reason": reason}
        if not oauth and scenario in ("credits", "spend"):
            return self._send(400, _anthropic_error(
                "invalid_request_error", "Your credit balance is too low to access the Anthropic API. Please go "
                "to Plans & Billing to upgrade or purchase credits."))
        self._send(429, _anthropic_error("rate_limit_error", "Number of request tokens has exceeded your per-minute "
                                         "rate limit"), documented | (unified if oauth else {}))

    # --- OpenAI Responses ----------------------------------------------------------------

    def _openai_failure(self) -> bool:
        """Answer the scenario's OpenAI error, if it is one; False for a success."""
        scenario = self.scenario
        if scenario in ("401", "bad-key"):
            self._send(401, _openai_error("Incorrect API key provided: sk-stub***. You can find your API key at "
                                          "https://platform.openai.com/account/api-keys.", "invalid_request_error",
                                          "invalid_api_key"))
        elif scenario == "403":
            self._send(403, _openai_error("Country, region, or territory not supported", "request_forbidden",
                                          "unsupported_country_region_territory"))
        elif scenario == "429":
            self._send(429, _openai_error(
                "Rate limit reached for gpt-stub in organization org-stub on requests per min (RPM): Limit 3, "
                f"Used 3, Requested 1. Please try again in {self.stub.retry_after_s}s. Visit https://platform.openai.com/"
                "account/rate-limits to learn more.", "requests", "rate_limit_exceeded"),
                {"retry-after": f"{self.stub.retry_after_s:g}", "x-ratelimit-limit-requests": "3",
                 "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": f"{self.stub.retry_after_s:g}s",
                 "x-ratelimit-limit-tokens": "40000",
                 "x-ratelimit-remaining-tokens": "39000", "x-ratelimit-reset-tokens": "1.5s"})
        elif scenario == "529":
            self._send(503, _openai_error("The engine is currently overloaded, please try again later.",
                                          "server_error", None))
        elif self._outage("openai"):
            pass
        elif scenario == "capacity-503":   # the Responses backend's capacity code in an HTTP 503
            self._send(503, {"error": {"message": "Our servers are currently overloaded. Please try again later.",
                                       "type": "service_unavailable_error", "param": None,
                                       "code": "server_is_overloaded"}})
        elif scenario in ("usage-limit", "usage-limit-weekly"):   # a ChatGPT plan's usage limit (Codex's error.rs)
            reset = self.stub.reset_at + (timedelta(days=3) if scenario == "usage-limit-weekly" else timedelta())
            self._send(429, {"error": {"type": "usage_limit_reached", "message": "The usage limit has been reached",
                                       "plan_type": "pro", "resets_at": int(reset.timestamp()),
                                       "resets_in_seconds": int((reset - datetime.now(UTC)).total_seconds())}},
                       {"x-codex-primary-used-percent": "100", "x-codex-primary-window-minutes": "300",
                        "x-codex-primary-reset-at": str(int(reset.timestamp())),
                        "x-codex-primary-reset-after-seconds": str(int((reset - datetime.now(UTC)).total_seconds())),
                        "x-codex-secondary-used-percent": "40", "x-codex-secondary-window-minutes": "10080"})
        elif scenario == "credits":
            self._send(429, _openai_error(
                "You exceeded your current quota, please check your plan and billing details. For more "
                "information on this error, read the docs: https://platform.openai.com/docs/guides/error-codes/"
                "api-errors.", "insufficient_quota", "insufficient_quota"))
        else:
            return False
        return True

    def openai_responses(self, body: dict) -> None:
        if self._openai_failure():
            return
        model = body.get("model") or "gpt-stub"
        response_id = "resp_" + uuid.uuid4().hex[:24]
        tool = self.scenario == "tool" and not any(
            isinstance(item, dict) and item.get("type") == "function_call_output" for item in body.get("input", []))
        call, text = self._calls_turn("responses", body) if self.scenario == "calls" else (None, REPLY)
        usage = {"input_tokens": USAGE["input_tokens"],
                 "input_tokens_details": {"cached_tokens": USAGE["cache_read_input_tokens"] // 5},
                 "output_tokens": USAGE["output_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": USAGE["input_tokens"] + USAGE["output_tokens"]}
        if call is not None:
            tool = True
            ids = {"id": "fc_" + uuid.uuid4().hex[:24], "status": "completed",
                   "call_id": "call_" + uuid.uuid4().hex[:24]}
            if call["type"] == "custom":   # a freeform tool: its input is text (code mode's is JavaScript)
                item = {"type": "custom_tool_call", **ids, "name": call["call"],
                        "input": call.get("code") or str(call["arguments"].get("input", ""))}
            else:
                item = {"type": "function_call", **ids, "name": call["call"],
                        **({"namespace": call["namespace"]} if call["namespace"] else {}),
                        "arguments": json.dumps(call["arguments"])}
        elif tool:
            names = {t.get("name") for t in body.get("tools", []) if isinstance(t, dict)}
            name = "shell" if "shell" in names else "exec_command" if "exec_command" in names else "shell"
            arguments = ({"command": ["bash", "-lc", DENIED_COMMAND]} if name == "shell"
                         else {"cmd": DENIED_COMMAND})
            item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "status": "completed",
                    "call_id": "call_" + uuid.uuid4().hex[:24], "name": name, "arguments": json.dumps(arguments)}
        else:
            item = {"type": "message", "id": "msg_" + uuid.uuid4().hex[:24], "status": "completed",
                    "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}
        started = {"id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
                   "model": model, "output": [], "usage": None}
        done = {**started, "status": "completed", "output": [item], "usage": usage}
        events: list[tuple[str, dict]] = [("response.created", {"response": started}),
                                          ("response.in_progress", {"response": started}),
                                          ("response.output_item.added", {"output_index": 0, "item": {
                                              **item, "status": "in_progress",
                                              **({} if tool else {"content": []})}})]
        if not tool:
            part = {"type": "output_text", "text": "", "annotations": []}
            events += [("response.content_part.added", {"item_id": item["id"], "output_index": 0,
                                                        "content_index": 0, "part": part}),
                       ("response.output_text.delta", {"item_id": item["id"], "output_index": 0,
                                                       "content_index": 0, "delta": text}),
                       ("response.output_text.done", {"item_id": item["id"], "output_index": 0,
                                                      "content_index": 0, "text": text}),
                       ("response.content_part.done", {"item_id": item["id"], "output_index": 0,
                                                       "content_index": 0, "part": {**part, "text": text}})]
        if self.scenario == "cut":   # the text begun, then the connection closes: no response.completed
            if not body.get("stream"):
                return self._cut([], json.dumps(done).encode())
            events = events[:3] + [events[3], ("response.output_text.delta", {
                "item_id": item["id"], "output_index": 0, "content_index": 0, "delta": text[:len(text) // 2]})]
            return self._cut([_sse(name, {"type": name, "sequence_number": i, **data})
                              for i, (name, data) in enumerate(events)])
        if self.scenario == "capacity":   # the Responses backend's capacity code in a response.failed event
            failed = {**started, "status": "failed", "error": {
                "code": "server_is_overloaded",
                "message": "Our servers are currently overloaded. Please try again later."}}
            events = [("response.created", {"response": started}), ("response.failed", {"response": failed})]
        else:
            events += [("response.output_item.done", {"output_index": 0, "item": item}),
                       ("response.completed", {"response": done})]
        if not body.get("stream"):
            return self._send(200, done)
        self._stream([_sse(name, {"type": name, "sequence_number": i, **data})
                      for i, (name, data) in enumerate(events)])

    # --- OpenAI Chat Completions (aider) ---------------------------------------------------

    def chat(self, body: dict) -> None:
        if self._openai_failure():
            return
        model = body.get("model") or "gpt-stub"
        finish = "length" if self.scenario == "token-limit" else "stop"
        completion_id = "chatcmpl-" + uuid.uuid4().hex[:24]
        usage = {"prompt_tokens": USAGE["input_tokens"], "completion_tokens": USAGE["output_tokens"],
                 "total_tokens": USAGE["input_tokens"] + USAGE["output_tokens"]}
        if not body.get("stream"):
            whole = {"id": completion_id, "object": "chat.completion", "created": int(time.time()),
                     "model": model, "choices": [{"index": 0, "message": {
                         "role": "assistant", "content": REPLY}, "logprobs": None,
                         "finish_reason": finish}], "usage": usage}
            if self.scenario == "cut":
                return self._cut([], json.dumps(whole).encode())
            return self._send(200, whole)
        base = {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}
        if self.scenario == "cut":   # half the text, then the connection closes: no finish_reason, no [DONE]
            return self._cut([_sse(None, {**base, "choices": [{"index": 0, "delta": {
                "role": "assistant", "content": REPLY[:len(REPLY) // 2]}, "finish_reason": None}]})])
        self._stream([
            _sse(None, {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": REPLY},
                                             "finish_reason": None}]}),
            _sse(None, {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}], "usage": usage}),
            _sse(None, "[DONE]")])

    # --- Gemini --------------------------------------------------------------------------

    def gemini(self, body: dict, model: str, *, stream: bool) -> None:
        scenario = self.scenario
        if scenario == "bad-key":
            return self._send(400, _google_error(400, "API key not valid. Please pass a valid API key.",
                                                 "INVALID_ARGUMENT", [{
                                                     "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                                                     "reason": "API_KEY_INVALID", "domain": "googleapis.com",
                                                     "metadata": {"service": "generativelanguage.googleapis.com"}}]))
        if scenario == "401":
            return self._send(401, _google_error(401, "Request had invalid authentication credentials. Expected "
                                                 "OAuth 2 access token, login cookie or other valid authentication "
                                                 "credential.", "UNAUTHENTICATED"))
        if scenario == "403":
            return self._send(403, _google_error(403, "Permission denied: Consumer 'api_key:stub' has been "
                                                 "suspended.", "PERMISSION_DENIED"))
        if scenario in ("429", "credits"):
            daily = scenario == "credits"
            return self._send(429, _google_error(429, "You exceeded your current quota, please check your plan "
                                                 "and billing details. For more information on this error, head "
                                                 "to: https://ai.google.dev/gemini-api/docs/rate-limits.",
                                                 "RESOURCE_EXHAUSTED", [
                {"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [{
                    "quotaMetric": "generativelanguage.googleapis.com/generate_content_free_tier_requests",
                    "quotaId": ("GenerateRequestsPerDayPerProjectPerModel-FreeTier" if daily
                                else "GenerateRequestsPerMinutePerProjectPerModel-FreeTier"),
                    "quotaDimensions": {"location": "global", "model": "gemini-2.5-pro"},
                    "quotaValue": "250" if daily else "5"}]},
                {"@type": "type.googleapis.com/google.rpc.Help", "links": [{
                    "description": "Learn more about Gemini API quotas",
                    "url": "https://ai.google.dev/gemini-api/docs/rate-limits"}]},
                {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": f"{self.stub.retry_after_s:g}s"}]))
        if scenario == "529":
            return self._send(503, _google_error(503, "The model is overloaded. Please try again later.",
                                                 "UNAVAILABLE"))
        if self._outage("gemini"):
            return None
        config = body.get("generationConfig") or {}
        wants_json = (config.get("responseMimeType") == "application/json" or "responseJsonSchema" in config
                      or "responseSchema" in config)
        if wants_json:   # the CLI's own routing and next-speaker checks ask for JSON
            part = {"text": json.dumps({"reasoning": "a simple request", "model_choice": "pro",
                                        "complexity_reasoning": "simple", "complexity_score": 10,
                                        "next_speaker": "user"})}
        elif scenario == "tool" and not _answered_a_gemini_call(body):
            part = {"functionCall": {"name": "run_shell_command", "args": {"command": DENIED_COMMAND}}}
        elif scenario == "calls":
            call, text = self._calls_turn("gemini", body)
            part = ({"functionCall": {"id": "call_" + uuid.uuid4().hex[:16], "name": call["call"],
                                      "args": call["arguments"]}} if call else {"text": text})
        else:
            part = {"text": REPLY}
        tokens_in, tokens_out = (100, 20) if wants_json else (USAGE["input_tokens"], USAGE["output_tokens"])
        answer = {"candidates": [{"content": {"role": "model", "parts": [part]},
                                  "finishReason": "MAX_TOKENS" if scenario == "token-limit" else "STOP",
                                  "index": 0}],
                  "usageMetadata": {"promptTokenCount": tokens_in, "candidatesTokenCount": tokens_out,
                                    "cachedContentTokenCount": 0, "totalTokenCount": tokens_in + tokens_out},
                  "modelVersion": model, "responseId": base64.urlsafe_b64encode(
                      hashlib.sha256(uuid.uuid4().bytes).digest()[:12]).decode()}
        if scenario == "cut" and not wants_json:   # half the text, no finishReason: then the connection closes
            if not stream:
                return self._cut([], json.dumps(answer).encode())
            half = {"text": REPLY[:len(REPLY) // 2]}
            begun = {**answer, "candidates": [{"content": {"role": "model", "parts": [half]}, "index": 0}]}
            begun.pop("usageMetadata")
            return self._cut([_sse(None, begun)])
        if not stream:
            return self._send(200, answer)
        self._stream([_sse(None, answer)])


def _answered_a_tool(body: dict) -> bool:
    messages = body.get("messages") or []
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(c, dict) and c.get("type") == "tool_result" for c in m["content"])
               for m in messages)


def _answered_a_gemini_call(body: dict) -> bool:
    return any(isinstance(c, dict) and any(isinstance(p, dict) and "functionResponse" in p for p in c.get("parts", []))
               for c in body.get("contents") or [])


#: A line of the ``calls`` scenario's script.
_CALL_LINE = re.compile(r"^[ \t]*stub-call:[ \t]*(\S+)[ \t]*(.*?)[ \t]*$", re.MULTILINE)


def _texts(content) -> list[str]:
    """The text in a message's content: a string, or parts with ``text`` (text, input_text, output_text)."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, dict):
        content = [content]
    return [c["text"] for c in content or [] if isinstance(c, dict) and isinstance(c.get("text"), str)
            and c.get("type", "text") in ("text", "input_text", "output_text")]


def _user_texts(api: str, body: dict) -> list[str]:
    """What the user wrote, in the order of the conversation (tool results are no user text)."""
    if api == "gemini":
        return [p["text"] for c in body.get("contents") or [] if isinstance(c, dict) and c.get("role", "user") == "user"
                for p in c.get("parts") or [] if isinstance(p, dict) and isinstance(p.get("text"), str)]
    if api == "responses":
        items = body.get("input")
        if isinstance(items, str):
            return [items]
        return [text for item in items or [] if isinstance(item, dict) and item.get("role") == "user"
                and item.get("type", "message") == "message" for text in _texts(item.get("content"))]
    return [text for m in body.get("messages") or [] if isinstance(m, dict) and m.get("role") == "user"
            for text in _texts(m.get("content"))]


def _script(api: str, body: dict) -> list[tuple[str, dict | None]]:
    """The ``calls`` scenario's script: (tool, its arguments, None if they are no JSON object)."""
    script = []
    for text in _user_texts(api, body):
        for tool, raw in _CALL_LINE.findall(text):
            try:
                arguments = json.loads(raw or "{}")
            except ValueError:
                arguments = None
            script.append((tool, arguments if isinstance(arguments, dict) else None))
    return script


def _offered_tools(api: str, body: dict) -> list[dict]:
    """The tools a request offers: ``name`` (a namespace's tools as ``<namespace>__<tool>``, the names
    Codex gives them), ``call`` and ``namespace`` (what a call names), ``type`` (function, custom, ...)."""
    offered: list[dict] = []

    def add(tools, namespace: str | None = None) -> None:
        for t in tools or []:
            if not isinstance(t, dict):
                continue
            if isinstance(t.get("functionDeclarations"), list):   # Gemini
                for d in t["functionDeclarations"]:
                    if isinstance(d, dict) and d.get("name"):
                        offered.append({"name": d["name"], "call": d["name"], "namespace": None, "type": "function"})
                continue
            if t.get("type") == "namespace" and isinstance(t.get("tools"), list):   # Responses (Codex)
                add(t["tools"], t.get("name"))
                continue
            if isinstance(t.get("function"), dict):   # Chat Completions
                t = {**t["function"], "type": "function"}
            name = t.get("name")
            if not name:   # a built-in: Responses' web_search, Gemini's googleSearch
                name = t.get("type") or next(iter(t), "?")
                offered.append({"name": name, "call": name, "namespace": None, "type": "builtin"})
                continue
            offered.append({"name": f"{namespace}__{name}" if namespace else name, "call": name,
                            "namespace": namespace, "type": t.get("type", "function")})

    add(body.get("tools"))
    if api == "responses" and isinstance(body.get("input"), list):   # Codex's additional_tools input items
        for item in body["input"]:
            if isinstance(item, dict) and item.get("type") == "additional_tools":
                add(item.get("tools"))
    return offered


def _match(tool: str, offered: list[dict]) -> dict | None:
    for fits in (lambda n: n == tool, lambda n: n.endswith(f"__{tool}"), lambda n: n.endswith(f"_{tool}")):
        found = next((t for t in offered if t["type"] != "builtin" and fits(t["name"])), None)
        if found:
            return found
    return None


def _code_mode_call(tool: str, arguments: dict) -> str:
    """The JavaScript for Codex's ``exec`` that calls ``tool``: found in ALL_TOOLS by the rule of _match,
    its text printed as a JSON line the stub reads back (``stub_tool``, ``text``; ``missing`` if none;
    ``tools_offered``, the names in ALL_TOOLS, which the requests that carry it list among their tools).
    An MCP tool answers a CallToolResult (its text parts are the text), a built-in one an object
    (its ``output``, else the whole object)."""
    return (f"const want = {json.dumps(tool)}, args = {json.dumps(arguments)};\n"
            "const names = ALL_TOOLS.map((t) => t.name);\n"
            "const name = names.find((n) => n === want) ?? names.find((n) => n.endsWith(`__${want}`))\n"
            "  ?? names.find((n) => n.endsWith(`_${want}`));\n"
            "if (name === undefined) {\n"
            "  text(JSON.stringify({stub_tool: null, missing: want, tools_offered: names}));\n"
            "} else {\n"
            "  try {\n"
            "    const r = await tools[name](args);\n"
            "    const said = typeof r === \"string\" ? r\n"
            "      : Array.isArray(r?.content)\n"
            "        ? r.content.filter((c) => c.type === \"text\").map((c) => c.text).join(\"\\n\")\n"
            "      : typeof r?.output === \"string\" ? r.output : JSON.stringify(r);\n"
            "    text(JSON.stringify({stub_tool: name, text: said, is_error: !!r?.isError, tools_offered: names}));\n"
            "  } catch (e) {\n"
            "    text(JSON.stringify({stub_tool: name, text: String(e), is_error: true, tools_offered: names}));\n"
            "  }\n"
            "}\n")


def _ends_with_a_result(api: str, body: dict) -> bool:
    """Whether the conversation's latest turn is a tool's result (not a later message: a resumed
    session's new prompt goes on with the script)."""
    if api == "anthropic":
        messages = [m for m in body.get("messages") or [] if isinstance(m, dict) and m.get("role") in ("user",
                                                                                                        "assistant")]
        last = messages[-1].get("content") if messages else None
        return isinstance(last, list) and any(isinstance(c, dict) and c.get("type") == "tool_result" for c in last)
    if api == "responses":
        items = [i for i in body.get("input") if isinstance(i, dict) and (
            i.get("type", "").endswith("_output") or i.get("role") in ("user", "assistant"))] if isinstance(
            body.get("input"), list) else []
        return bool(items) and items[-1].get("type", "").endswith("_output")
    contents = [c for c in body.get("contents") or [] if isinstance(c, dict)]
    return bool(contents) and any(isinstance(p, dict) and "functionResponse" in p
                                  for p in contents[-1].get("parts") or [])


def _tool_results(api: str, body: dict) -> list[dict]:
    """The tool results a conversation holds, in order: ``key`` (to record each once), ``tool``, ``text``
    (and ``missing``: code mode found no such tool)."""
    results: list[dict] = []
    if api == "anthropic":
        names = {}
        for m in body.get("messages") or []:
            if not isinstance(m, dict) or not isinstance(m.get("content"), list):
                continue
            for c in m["content"]:
                if not isinstance(c, dict):
                    continue
                if c.get("type") == "tool_use":
                    names[c.get("id")] = c.get("name")
                elif c.get("type") == "tool_result":
                    results.append({"key": ("anthropic", c.get("tool_use_id")), "tool": names.get(c.get("tool_use_id")),
                                    "text": "\n".join(_texts(c.get("content")))})
    elif api == "responses":
        names = {}
        for item in body.get("input") if isinstance(body.get("input"), list) else []:
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind in ("function_call", "custom_tool_call"):
                ns = item.get("namespace")
                names[item.get("call_id")] = f"{ns}__{item.get('name')}" if ns else item.get("name")
            elif kind in ("function_call_output", "custom_tool_call_output"):
                output = item.get("output")
                texts = _texts(output.get("content") if isinstance(output, dict) else output)
                result = {"key": ("responses", item.get("call_id")), "tool": names.get(item.get("call_id")),
                          "text": "\n".join(texts)}
                for text in texts:   # code mode: the line the stub's script printed
                    try:
                        said = json.loads(text)
                    except ValueError:
                        continue
                    if isinstance(said, dict) and "stub_tool" in said:
                        result |= {"tool": said["stub_tool"] or result["tool"], "text": said.get("text") or "",
                                   **({"missing": said["missing"]} if said.get("missing") else {}),
                                   "offered": [n for n in said.get("tools_offered") or [] if isinstance(n, str)]}
                results.append(result)
    elif api == "gemini":
        for c in body.get("contents") or []:
            for p in (c.get("parts") or []) if isinstance(c, dict) else []:
                if isinstance(p, dict) and isinstance(p.get("functionResponse"), dict):
                    r = p["functionResponse"]
                    response = r.get("response")
                    if isinstance(response, dict) and isinstance(response.get("output"), str):
                        text = response["output"]
                    elif isinstance(response, dict) and isinstance(response.get("error"), str):
                        text = response["error"]
                    elif isinstance(response, dict) and isinstance(response.get("content"), list):
                        text = "\n".join(_texts(response["content"]))
                    else:
                        text = json.dumps(response)
                    results.append({"key": ("gemini", r.get("id") or (r.get("name"), len(results), text)),
                                    "tool": r.get("name"), "text": text})
    return results


def _anthropic_error(kind: str, message: str) -> dict:
    return {"type": "error", "error": {"type": kind, "message": message}}


def _openai_error(message: str, kind: str, code: str | None) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _google_error(code: int, message: str, status: str, details: list | None = None) -> dict:
    return {"error": {"code": code, "message": message, "status": status, **({"details": details} if details else {})}}


if __name__ == "__main__":   # by hand: python tests/modelstub.py [scenario]
    stub = ModelStub().start()
    stub.scenario = sys.argv[1] if len(sys.argv) > 1 else "success"
    print(stub.url, flush=True)
    threading.Event().wait()
