"""An agent for the tests of Outpost's own tools (tests/test_mcp.py): run as a generic profile's
command, it does what any agent could do inside its run: starts ``outpost mcp`` with its run's
environment (OUTPOST_RUN_TOKEN, OUTPOST_API_URL), lists the tools it is offered and makes the calls
its prompt names, one ``mcp-call: <tool> <json arguments>`` line each (``$TASK`` in them is the
run's own task id), and the raw requests a hostile agent would send with its run token, one
``http-call: <METHOD> <path> <json body>`` line each. It prints one JSON line: the tool names,
each call's error flag and text, and each request's status."""
from __future__ import annotations

import json
import os
import re
import sys
import urllib.error
import urllib.request

import anyio
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client


async def main(outpost_py: str) -> None:
    prompt = sys.stdin.read()
    calls = [(m[1], json.loads(m[2].replace("$TASK", os.environ.get("OUTPOST_TASK_ID", ""))))
             for m in re.finditer(r"^mcp-call: (\w+) (\{.*\})$", prompt, re.MULTILINE)]
    server = StdioServerParameters(command=sys.executable, args=[outpost_py, "mcp"], env=dict(os.environ))
    async with stdio_client(server) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        tools = sorted(t.name for t in (await session.list_tools()).tools)
        results = []
        for name, arguments in calls:
            answer = await session.call_tool(name, arguments)
            results.append({"tool": name, "error": answer.is_error,
                            "text": "".join(getattr(c, "text", "") for c in answer.content)})
    print(json.dumps({"tools": tools, "calls": results, "http": [http(m[1], m[2], m[3]) for m in re.finditer(
        r"^http-call: (\w+) (\S+) (\{.*\})$", prompt, re.MULTILINE)]}), flush=True)


def http(method: str, path: str, body: str) -> int:
    request = urllib.request.Request(os.environ["OUTPOST_API_URL"] + path, data=body.encode(), method=method,
                                     headers={"Authorization": "Bearer " + os.environ["OUTPOST_RUN_TOKEN"],
                                              "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
