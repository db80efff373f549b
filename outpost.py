"""Outpost: a durable scheduler appliance that wakes coding agents.

Outpost runs as one process on a small always-on machine. It wakes agent CLIs
(Claude Code, Codex, aider, any script) on schedules and one-shot dispatches; each
run gets its own git worktree and result branch, and everything a human should look
at becomes an attention item. The database is the source of truth: a fire that was
committed survives ``kill -9``, and no occurrence is ever admitted twice. SQLite in the
data dir is the embedded default; several processes (nodes) may share one PostgreSQL
database and act as one appliance, the database their only coordinator (a fleet).

Usage::

    outpost serve                      # dashboard + API on http://127.0.0.1:8321
    outpost token                      # the API token
    outpost schedules create nightly.toml
    outpost inspect nightly-deps       # "why didn't it run at 09:00?"
    outpost serve --database postgresql://outpost@db/outpost   # one node of a fleet
    outpost migrate --to postgresql://outpost@db/outpost       # an appliance's history into it

The process (``serve``, in the supervisor section, builds it)::

    main()
     └─ root nursery
         ├─ signal watcher      SIGTERM/SIGINT -> shutdown (a second signal: at once)
         ├─ web                 hypercorn + quart-trio: JSON API, SSE, dashboard (the web sections)
         ├─ cron actor          sleeps until the next due instant, claims occurrences
         ├─ claim actor         FIFO admission (max_running) -> run supervisors
         │   └─ runs nursery    worktree, agent subprocess, timeout, settlement
         ├─ recovery actor      boot reconciliation; periodic hygiene
         ├─ notification actor  settled runs -> failure streak, attention items
         ├─ housekeeping actor  daily: old runs and history, merged result branches, space back
         ├─ node actor          a fleet only: heartbeat, lost nodes' runs settled or requeued
         └─ watchdog actor      systemd WATCHDOG=1 from the loop (under Type=notify)

Shutdown: the web server stops through its trigger, then the actors are cancelled; run
supervisors end their agents' process groups and record them ``interrupted``; the store
closes last. A database locked by another process or a full disk answers 503 at the API
(``unavailable``, ``disk_full``; /healthz says ``disk_full`` too) while the actors wait it out.

Where to look:

- every route: ``print(*route_list(), sep="\\n")``; the tables are ``api``, ``office_api``,
  ``agent_api``, ``hooks`` and ``pages`` (web: requests), each route a module-level handler
  declaring its auth (web: the JSON API, web: the dashboard); ``create_app`` only installs them;
  the API and the dashboard change things through one function per action (web: actions);
- every actor: ``grep -n '^async def .*_actor' outpost.py``; ``serve`` (the supervisor section)
  starts them in order: recovery, web, then notification, outbox, cron, claim (and in a fleet the
  node actor);
- the store: ``Store`` is ``StoreCore`` (the session: transactions, events, attention) with its
  parts, ``grep -n '^class .*Store' outpost.py``: ``store.runs``, ``store.schedules``,
  ``store.nodes``, ``store.access``, ``store.notify``, ``store.wakeups``, ``store.office``,
  ``store.pipeline``, ``store.routines``, ``store.housekeeping``, ``store.channels``; each holds
  the parts below it that it calls (every run is queued by ``store.runs.queue_run``). What
  differs between SQLite and PostgreSQL is ``store.dialect`` (``Dialect``, ``PostgresDialect``);
- an agent CLI: its ``Preset`` in ``PRESETS`` (the Agent CLIs section), and how it is told of
  Outpost's own MCP server (``claude_tools``, ``codex_tools``, ``gemini_tools``);
- the tools agents act with: ``AgentTools`` and ``cli_mcp`` (the CLI section) over the agent API
  (``agent_api``) and, for a person's own agent, proposer keys and proposals (``propose``,
  ``confirm_proposal``; ``check_proposer`` says what a key may do);
- a behaviour of the docs: search for its name (``skip_if_active``, ``task_blockers_resolved``,
  ``retry_stale_assignee``).

Sections of this file, one per concern (``grep -n '^# [0-9]*\\. ' outpost.py``):

    1. imports and constants          13. git and worktrees
    2. errors (one family)            14. running an agent
    3. agent CLIs                     15. wiring (clocks, channels, Deps)
    4. configuration                  16. fleet
    5. schedules and runs, the domain 17. actors
    6. Office, the domain             18. web: requests (routes, auth, errors)
    7. store: database and session    19. web: actions (API and dashboard)
    8. store: runs                    20. web: the JSON API
    9. store: schedules               21. web: the dashboard, create_app
   10. store: nodes, access, notify   22. supervisor
   11. store: the Office queue        23. CLI and main()
   12. store: routines, housekeeping,
       channels, the Store of parts
"""


###############################################################################
# 1. Imports and constants.
###############################################################################

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import difflib
import enum
import errno
import fcntl
import functools
import hashlib
import heapq
import hmac
import http.client
import inspect
import io
import itertools
import json
import logging
import math
import os
import random
import re
import resource
import secrets
import shlex
import shutil
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
import zlib
import zoneinfo
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from datetime import datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import Any, Literal, NoReturn
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import trio
from croniter import croniter
from croniter.croniter import CroniterBadCronError, CroniterBadDateError
from pony import orm
from pony.orm.dbproviders.sqlite import SQLiteDatetimeConverter
from ulid import ULID

__all__ = [
    "Config", "OutpostError", "Clock", "WallClock", "TrioClock", "Store", "Deps",
    "next_fires", "normalize_definition", "confirmation_of", "run_outcome",
    "cron_actor", "claim_actor", "recovery_actor", "notification_actor", "outbox_actor",
    "create_app", "serve", "main",
]

log = logging.getLogger("outpost")
log.addHandler(logging.NullHandler())

UTC = timezone.utc

#: Units of the time constants below.
MINUTE_S, HOUR_S, DAY_S = 60, 3600, 86400
#: Default TCP port of the API and dashboard.
DEFAULT_PORT = 8321
#: Runs holding an admission slot at once, unless outpost.toml or --max-running says otherwise.
DEFAULT_MAX_RUNNING = 2
#: Seconds an agent process group gets between SIGTERM and SIGKILL.
GRACE_S = 5.0
#: Largest request body the API accepts.
MAX_BODY_BYTES = 1024 * 1024
#: Largest run log kept on disk: past it, the first LOG_HEAD_BYTES and the last LOG_TAIL_BYTES.
MAX_LOG_BYTES = 1024 * 1024
LOG_HEAD_BYTES = 256 * 1024
LOG_TAIL_BYTES = MAX_LOG_BYTES - LOG_HEAD_BYTES
#: Most of a run's line times read (runs/<id>.times): a day at a line a second, 28 bytes each.
LINE_TIMES_MAX_BYTES = 28 * 86_400
#: How long an Idempotency-Key is remembered.
IDEMPOTENCY_TTL_S = 24 * HOUR_S
#: An in-flight key older than this belongs to a request that died (its action never committed).
IN_FLIGHT_STALE_S = 60


class IdempotencyState(enum.StrEnum):
    IN_FLIGHT = "in_flight"   # its request is being handled: a repeat is refused
    DONE = "done"             # answered: a repeat gets the same answer


#: A due slot later than this when the cron actor reaches it counts as missed (downtime).
MISFIRE_GRACE_S = 60.0
#: Longest single sleep of the cron actor, so a wall-clock jump (suspend, NTP) is noticed.
CRON_MAX_SLEEP_S = 300.0
#: A fleet (docs/fleet.md): heartbeats every NODE_HEARTBEAT_S on the database's clock; a node silent
#: for NODE_LOST_S (four beats: one beat late under load is no loss) is lost; the claim actor and the
#: event streams of every node look at the shared store every FLEET_POLL_S (the nudges of another
#: node's requests do not reach them), the cron actor every CRON_FLEET_POLL_S (the node that changed
#: a schedule fires it on time itself; the others only take over its fires when it is gone).
NODE_HEARTBEAT_S, NODE_LOST_S, FLEET_POLL_S, CRON_FLEET_POLL_S = 2.0, 8, 1.0, 10.0


class NodeStatus(enum.StrEnum):
    UP = "up"
    LOST = "lost"   # silent for NODE_LOST_S: another node settled its runs


#: How often ``outpost runs log --follow`` asks for what is new.
FOLLOW_POLL_S = 1.0
#: A fleet: how often a running agent's new log lines go into the database for the other nodes.
LOG_SHIP_S = 1.0
#: How long an actor waits before retrying a store that was locked or full.
STORE_RETRY_S = 2.0
#: How long one database statement waits for another process's write lock.
BUSY_TIMEOUT_MS = 5000
#: Store calls one group commit takes at most (a bound on how long its first caller waits).
GROUP_COMMIT_MAX = 128
#: A cron wake-up this close after the instant it slept until is on time: what it read while asleep holds.
CRON_ON_TIME_S = 1.0
#: Longest a shutdown waits for one run's cleanup (save leftovers, settle) after its process ended.
CLEANUP_S = 10.0
#: Outpost's own git in a run's sandbox (saving leftovers, the fetch's far end) ends after this
#: long: an agent can plant what makes git wait forever (an fsmonitor that never answers, a FIFO).
SANDBOXED_GIT_S = 300.0
#: The notification actor looks for settled runs it was not told about this often.
NOTIFY_SWEEP_S = 60.0
#: Due slots of one schedule recorded individually per claim; older missed ones are only counted.
LEDGER_KEEP = 100
#: Missed slots a claim counts one by one; past it the count says "more than" (a year of a
#: per-minute cron must not hold the only writer for an hour).
MISSED_COUNT_CAP = 500
#: Schedules per page of the dashboard's list.
SCHEDULES_PAGE = 100
#: How long a dashboard sign-in lasts.
SESSION_TTL_S = 30 * DAY_S
#: A proposal no human decided within a week is stale (docs/agent-clis.md).
PROPOSAL_TTL_S = 7 * DAY_S
#: How a proposer key begins (``outpost keys create --proposer``), so the API token is never looked up.
PROPOSER_KEY_PREFIX = "opk_"
#: How long the one-time sign-in link that ``outpost serve`` prints stays usable.
SIGNIN_CODE_TTL_S = 15 * 60
#: Consecutive failures that auto-pause a schedule.
AUTO_PAUSE_STREAK = 3
#: Bytes of stderr kept as a failed run's error text.
ERROR_TAIL_BYTES = 2000
#: Output an agent report is read from: the first lines (up to so many bytes) and the last bytes of stdout.
OUTPUT_HEAD_LINES = 200
OUTPUT_HEAD_BYTES = 1024 * 1024
OUTPUT_TAIL_BYTES = 8 * 1024 * 1024
#: Longest stdout line the readers get: a CLI's longest real event (a tool's whole output in one) is
#: far shorter. The rest of a longer line is dropped (so it reads as text): a line that never ends
#: holds neither the memory nor the event loop.
OUTPUT_LINE_BYTES = 4 * 1024 * 1024
#: Interval shorter than this draws a compose warning (a typical agent run takes longer).
SHORT_INTERVAL_S = 300
#: How far ahead compose looks for DST transitions.
DST_HORIZON_DAYS = 366
#: Latest year an instant may name (datetime arithmetic near year 9999 overflows).
MAX_YEAR = 9000
#: Environment variables an agent may inherit when its profile names no pass_env.
DEFAULT_PASS_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ", "SHELL", "TMPDIR")
#: ``[settings] isolate_agents``: bubblewrap around every agent when it works (auto), or required, or off.
ISOLATION_MODES = ("auto", "always", "never")
#: Never handed to an agent, whatever a profile says.
SECRET_ENV = ("OUTPOST_API_TOKEN", "OUTPOST_KEY", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
#: Author of the commit that saves what an agent left uncommitted: its own identity, never signed
#: (a user's commit.gpgsign must not make the save fail); hooks are skipped with --no-verify.
GIT_IDENTITY = ("-c", "user.name=Outpost", "-c", "user.email=outpost@localhost", "-c", "commit.gpgsign=false")
#: Every git command Outpost runs obeys no hook: a user's hooks are for the user's own commits, and
#: one that an agent planted must never run with the daemon's rights (docs/security.md).
GIT_NO_HOOKS = ("-c", "core.hooksPath=/dev/null")
#: What of the service user's HOME an isolated agent may write: its own CLI's state folder (logins,
#: sessions; ``Preset.home_state``); the other CLIs' folders are hidden, so a run of one profile
#: can neither read nor replace another CLI's login. The rest of HOME (~/.gitconfig, shell
#: profiles) stays read-only: Outpost's own git and ssh read it outside the sandbox. Claude Code
#: replaces ~/.claude.json by a rename in HOME itself, so inside it keeps that file in ~/.claude
#: (CLAUDE_CONFIG_DIR), as Codex and Gemini keep theirs in their folders.
AGENT_HOME_STATE = (".claude", ".codex", ".gemini", ".aider")
#: Of those, what stays read-only inside, made empty when missing (None: a folder): what names
#: commands a CLI runs (hooks, MCP servers, notify, plugins, extensions, custom commands) and its
#: standing instructions, each CLI's own docs' list (docs/security.md). An agent must not leave a
#: command or an instruction for the next run, or for the user's own CLI outside.
AGENT_HOME_SETTINGS = {
    ".claude/settings.json": "{}\n", ".claude/CLAUDE.md": "", ".claude/commands": None, ".claude/agents": None,
    ".claude/skills": None, ".claude/plugins": None, ".claude/output-styles": None, ".claude/rules": None,
    ".codex/config.toml": "", ".codex/AGENTS.md": "", ".codex/AGENTS.override.md": "", ".codex/prompts": None,
    ".codex/skills": None, ".codex/agents": None, ".codex/.env": "", ".codex/rules": None, ".codex/policy": None,
    ".gemini/settings.json": "{}\n", ".gemini/GEMINI.md": "", ".gemini/.env": "", ".gemini/commands": None,
    ".gemini/extensions": None, ".gemini/policies": None, ".gemini/skills": None, ".gemini/agents": None,
    ".gemini/trustedFolders.json": "{}\n", ".aider/oauth-keys.env": ""}
#: Credentials in HOME no agent needs, hidden from every sandbox (a folder becomes empty, a file
#: /dev/null, which cannot be opened there): the keys and tokens that reach the user's other
#: machines and accounts. Outpost's own git and ssh use them outside the sandbox; an agent's
#: commit is never signed with them.
HOME_SECRETS = (".ssh", ".gnupg", ".git-credentials", ".config/git/credentials", ".netrc", ".pgpass", ".aws",
                ".azure", ".config/gcloud", ".config/gh", ".docker", ".kube", ".npmrc", ".pypirc", ".claude.json")
#: A sandbox's /tmp and /dev/shm, each, in MiB, unless its profile says (``tmp_mb``): a tmpfs is
#: memory, and an agent that fills it must meet "no space left" long before the machine runs out.
SANDBOX_TMP_MB = 1024
#: A run's processes and threads at once, unless its profile says (``max_processes``): a fork
#: bomb meets it, a parallel build (make -j, a test runner's workers, Node's threads) does not.
RUN_MAX_PROCESSES = 1024
#: A run's memory in MiB, its /tmp's included, unless its profile says (``memory_mb``). Without a
#: cgroup it caps each process's data instead (prlimit), where Node's CLIs need 1024 to start.
RUN_MEMORY_MB = 4096
#: Where the kernel's cgroup hierarchies are mounted: the unified one (v2), or one per controller (v1).
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: This file (the demo agent and Outpost's tools run it), and its folder: the dashboard's
#: templates and static files are beside it.
OUTPOST_PY = Path(__file__).resolve()
INSTALLED = OUTPOST_PY.parent
#: The namespaces of a sandbox's own (with the mount one bubblewrap always makes): its processes,
#: IPC and hostname. The start's probe asks for the same, so a service manager that forbids one
#: (systemd's RestrictNamespaces=) is found then, not at each run.
SANDBOX_NAMESPACES = ("--unshare-pid", "--unshare-ipc", "--unshare-uts")
#: A user namespace of the sandbox's own, in which it can make no other: in a new one an agent
#: would hold every capability there, enough to mount its cgroup hierarchy and lift its own
#: max_processes and memory_mb. Bubblewrap 0.8 or newer; with an older one the start says so.
SANDBOX_NO_USERNS = ("--unshare-user", "--disable-userns")
#: How long bubblewrap may take to name its sandbox's process 1 (it does so at once, as it starts).
SANDBOX_START_S = 30.0
#: Each tmpfs that only hides something (the data dir, /run, another CLI's folder, a secret):
#: room for the mount points shown in it, no more.
HIDING_TMPFS_BYTES = 1 << 20
#: The system's secrets, hidden too: they matter when the daemon runs as root, which owns them.
SYSTEM_SECRETS = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-", "/etc/ssh", "/etc/sudoers",
                  "/etc/sudoers.d", "/root/.ssh")
#: Parts of the fresh /proc that write to the host's kernel (a fresh /proc leaves them writable for
#: uid 0, and core_pattern runs a program as root outside any sandbox): read-only inside.
PROC_HOST_KNOBS = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs")
#: Exit statuses of the CLI (docs/cli.md lists them).
EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_NO_TOKEN, EXIT_DECLINED = 1, 2, 3, 4, 5
#: This Outpost's version (pyproject.toml), as its MCP server names itself.
OUTPOST_VERSION = "0.1.0"
#: Current schema version of the store (section 5).
SCHEMA_VERSION = 18     # 2: sign-in sessions and codes; 3: Run(schedule, id) index; 4: Office; 5: routines;
                        # 6: a routine run found by its wakeup; 7: agent CLIs (reports, limits, replies, budgets);
                        # 8: catch-up plans, re-runs, chart indexes; 9: nodes (a fleet, docs/fleet.md);
                        # 10: PostgreSQL numbers events by a sequence (StoreCore._number_events);
                        #     a node's name is one process's (Node.process)
                        # 11: covering indexes of the tallies GET /metrics reads (run_tally, wakeup_tally)
                        # 12: the notification outbox
                        # 13: a needs_you run's answer (Run.answer); a session's one-time flash
                        # 14: indexes that keep a year of history's reads small (the bench's year row)
                        # 15: proposer keys and proposals (a person's own agent, docs/agent-clis.md);
                        #     who asked for a dispatch (Run.requested_by)
                        # 16: channels (ChannelState, ChannelDelivery, Comment.author)
                        # 17: attention folds (Attention.times, latest_at, run_ids, agent_id); NotifyTarget
                        # 18: a run's timeline (Run.steps)
#: The runs of a needs_you thread a run page shows before (and after) it, at most.
THREAD_MAX = 25
#: The workspace Office resources belong to unless a request names another.
DEFAULT_WORKSPACE = "ws_default"
#: The error of a run whose repository is missing or broken: its wakeup waits, it is no retry.
REPOSITORY_UNAVAILABLE = "repository unavailable"
#: How often a wakeup waiting for its repository looks again; and how long a node of a fleet that
#: could not fetch a URL leaves its runs to the other nodes before it tries again.
REPOSITORY_RECHECK_S = 30
#: The start of the error of a run whose node could not fetch its repository URL (docs/fleet.md).
UNREACHABLE_ERROR = f"{REPOSITORY_UNAVAILABLE}: cannot fetch "
#: Wakeups of one agent, source and scope (WINDOW_ACROSS_TASKS: any task) this close together
#: become one (docs/office.md, "Coalescing, three layers").
COALESCING_WINDOW_S = 5
#: Wakeups the dispatcher takes through the pipeline in one transaction.
DISPATCH_BATCH = 200
#: Share of an agent's run budget at which its coordinators get a budget_alert wakeup.
BUDGET_ALERT_PCT = 80
#: Self-wakes an agent may ask for in 24 h (docs/office.md): one that wakes itself at the end of
#: every run would otherwise run, and spend, for ever; past it the wake is refused (429).
SELF_WAKES_PER_DAY = 48
#: Time limit of an Office run whose agent profile names none.
OFFICE_RUN_TIMEOUT_S = 3600
#: Comments of its task an Office prompt shows (the newest).
PROMPT_COMMENTS = 10
#: How often the recovery actor runs the Office recovery sweep (unstarted assigned tasks).
RECOVERY_SWEEP_S = 300
#: Settlements that may wait for the notification actor before one is dropped (it sweeps the store too).
SETTLED_BUFFER = 1000
#: Longest free text a user or an agent may send (a comment, a wake's context, an approval note).
MAX_TEXT_CHARS = 20000
#: How long ``outpost doctor`` waits for a CLI's ``--version``.
VERSION_TIMEOUT_S = 20
#: Largest diff a run page or a comparison shows.
MAX_DIFF_BYTES = 1024 * 1024
#: Days the charts show.
CHART_DAYS = 30
#: Longest prompt a run is given (a brief is at most 32,768 characters; a reply adds to it).
MAX_PROMPT_CHARS = 65536
#: Every kind of attention item Outpost raises (StoreCore.raise_attention's callers).
ATTENTION_KINDS = ("needs_you", "failed", "changes_returned", "succeeded", "auto_pause", "missed_fire",
                   "catch_up_plan", "reconfirm", "agent_limited", "agent_auth", "approval", "agent_error",
                   "budget_blocked", "proposal")
#: The kinds a ``[[notify]]`` entry sends unless it names its own (docs/operations.md).
#: Channels (docs/office.md, "Channels"): the kinds, the services' API roots (settings slack_api_url and
#: telegram_api_url point them at local stubs in tests), Slack's replay window for a signed
#: request, how long a delivered event id is remembered, and each service's longest message.
CHANNEL_KINDS = ("slack", "telegram")
SLACK_API_URL = "https://slack.com/api"
TELEGRAM_API_URL = "https://api.telegram.org"
SLACK_SIGNATURE_WINDOW_S = 300
#: How long a Slack event waits for its sender's display name (users.info) before it uses the id.
SLACK_NAME_LOOKUP_S = 1.5
CHANNEL_DEDUP_S = DAY_S
CHANNEL_TEXT_MAX = {"slack": 4000, "telegram": 4096}
NOTIFY_DEFAULT_KINDS = ("needs_you", "failed", "auto_pause", "agent_auth", "missed_fire", "budget_blocked")
#: A notification that could not be delivered is tried again after 1 min, doubling up to 1 h,
#: until it is a day old; then it is given up (and recorded).
NOTIFY_RETRY_FIRST_S, NOTIFY_RETRY_MAX_S, NOTIFY_GIVE_UP_S = MINUTE_S, HOUR_S, DAY_S
#: Longest one send may take (real seconds, in its own thread: Apprise is synchronous).
NOTIFY_SEND_TIMEOUT_S = 60
#: A message left "sending" this long was being sent by a process that stopped (or a node that
#: was lost): it is tried again. The one case that may deliver a message twice (a receiver that
#: took it in the instant before the crash).
NOTIFY_SENDING_STALE_S = 5 * MINUTE_S


class NotificationStatus(enum.StrEnum):
    QUEUED = "queued"         # waiting for its next_at: the first try, or the next after a failure
    SENDING = "sending"       # one process is sending it (due again once NOTIFY_SENDING_STALE_S old)
    DELIVERED = "delivered"
    GIVEN_UP = "given_up"     # still undelivered NOTIFY_GIVE_UP_S after it was queued


#: How often the outbox actor looks for work without a nudge (another node's items, a lost nudge).
OUTBOX_SWEEP_S = MINUTE_S
#: A daily digest missed while the daemon was down goes out late up to this long after its time.
DIGEST_LATE_S = 6 * HOUR_S
#: Days settled runs and their history are kept by default (``[settings] keep_days``, docs/operations.md).
DEFAULT_KEEP_DAYS = 90
#: Housekeeping: runs deleted per transaction, and other rows (events, ledger, wakeups) per
#: transaction, so the one writer is held a few milliseconds at a time (well under 100 ms).
HOUSEKEEPING_RUNS = 100
HOUSEKEEPING_ROWS = 500
#: SQLite pages given back per transaction by ``PRAGMA incremental_vacuum`` (4 MiB of 4 KiB pages).
VACUUM_PAGES = 1024
#: A schedule's newest ledger rows (occurrences) that housekeeping keeps, whatever their age.
LEDGER_KEEP = 100
#: The daily pass: how long after a start it first runs, then how often.
HOUSEKEEPING_FIRST_S = 600
HOUSEKEEPING_EVERY_S = 86400
#: An existing SQLite database without incremental auto-vacuum is converted (one VACUUM) at
#: start when it is at most this big; a bigger one is left as it is (docs/operations.md).
VACUUM_AT_START_MAX_BYTES = 64 * 1024 * 1024


###############################################################################
# 2. Errors: one family: a base, one subclass per problem code, and the
#    failures of configuration, schema, launch and the CLI.
###############################################################################

class OutpostError(Exception):
    """A refusal a user can read: becomes application/problem+json at the API."""
    status = 400
    code = "bad_request"
    title = "Bad request"

    def __init__(self, detail: str, *, errors: list[dict[str, str]] | None = None,
                 extra: dict[str, Any] | None = None):
        super().__init__(detail)
        self.detail = detail
        self.errors = errors or []
        self.extra = extra or {}

    def problem(self) -> dict[str, Any]:
        body = {"status": self.status, "code": self.code, "title": self.title, "detail": self.detail}
        if self.errors:
            body["errors"] = self.errors
        return body | self.extra


class Unauthorized(OutpostError):
    status, code, title = 401, "unauthorized", "Missing or wrong API token"


class WebhookRefused(OutpostError):
    status, code, title = 401, "unauthorized", "Webhook delivery refused"


class Forbidden(OutpostError):
    status, code, title = 403, "forbidden", "Not allowed for this caller"


class ForbiddenHost(OutpostError):
    status, code, title = 403, "forbidden_host", "Host not allowed"


class NotFound(OutpostError):
    status, code, title = 404, "not_found", "Not found"


class MethodNotAllowed(OutpostError):
    status, code, title = 405, "method_not_allowed", "Method not allowed"


class Conflict(OutpostError):
    status, code, title = 409, "conflict", "Conflict"


class Archived(OutpostError):
    status, code, title = 409, "archived", "Schedule is archived"


class AutoPaused(OutpostError):
    status, code, title = 409, "auto_paused", "Schedule is auto-paused"


class RevisionMismatch(OutpostError):
    status, code, title = 412, "revision_mismatch", "Revision mismatch"


class PayloadTooLarge(OutpostError):
    status, code, title = 413, "payload_too_large", "Payload too large"


class ValidationFailed(OutpostError):
    status, code, title = 422, "validation_failed", "Validation failed"


class ConfirmationMismatch(OutpostError):
    status, code, title = 422, "confirmation_mismatch", "Confirmation does not match"


class IdempotencyKeyReused(OutpostError):
    status, code, title = 422, "idempotency_key_reused", "Idempotency key reused"


class IdempotencyKeyRequired(OutpostError):
    status, code, title = 428, "idempotency_key_required", "Idempotency-Key header required"


class PreconditionRequired(OutpostError):
    status, code, title = 428, "precondition_required", "If-Match header required"


class SelfWakeLimit(OutpostError):
    status, code, title = 429, "self_wake_limit", "Too many self-wakes"


class StoreUnavailable(OutpostError):
    """The database cannot take a write now (locked by another process, disk full): retry."""
    status, code, title = 503, "unavailable", "Temporarily unavailable"


class DiskFull(StoreUnavailable):
    """The database's disk is full: nothing can be recorded until space is freed there."""
    status, code, title = 503, "disk_full", "Disk full"


class CrossSiteRefused(OutpostError):
    status, code, title = 403, "forbidden", "Request refused"


class InternalError(OutpostError):
    """A bug: the trace is in the daemon's log, never in the answer."""
    status, code, title = 500, "internal_error", "Internal error"


class ConfigError(OutpostError):
    """outpost.toml cannot be used; the message names the file and the key."""
    status, code, title = 500, "config_invalid", "Configuration cannot be used"


class NodeNameTaken(ConfigError):
    """A fleet node's name is held by another running process (docs/fleet.md: names are unique)."""


class SchemaTooNew(OutpostError):
    """The database was written by a newer Outpost; refuse rather than damage it."""
    status, code, title = 500, "schema_too_new", "Database is newer than this Outpost"


class LaunchError(OutpostError):
    """A run could not start (repository, ref, workdir, command): it fails with this text."""
    status, code, title = 422, "launch_failed", "Run could not start"


class RepositoryUnavailable(LaunchError):
    """The run's repository is missing, is no git repository, or lacks the ref: not the agent's failure."""


class RepositoryUnreachable(RepositoryUnavailable):
    """This node cannot fetch the run's repository URL (docs/fleet.md): never counted toward a failure streak."""


class CliError(OutpostError):
    """A CLI failure: its message is printed as is, ``exit_status`` is the process's."""
    code, title = "cli", "Command failed"

    def __init__(self, message: str, exit_status: int):
        super().__init__(message)
        self.exit_status = exit_status


def invalid(field: str, message: str) -> ValidationFailed:
    return ValidationFailed(f"{field}: {message}", errors=[{"field": field, "message": message}])


# --- suggestions: what a refusal offers instead of a near miss ------------------------------------

#: Longer words than this get no suggestion.
SUGGEST_MAX_CHARS = 100


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """``"; did you mean X?"`` for the closest of ``known`` to a mistyped ``word``, else ``""``."""
    if len(word) > SUGGEST_MAX_CHARS:   # no typo of a short name; and difflib's time grows with the length
        return ""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


#: Zone abbreviations people write, and the IANA name that keeps the daylight-saving rules.
#: (Some, like CET and EST, are also legacy IANA names and so are accepted as they are.)
ZONE_NAMES_FOR_ABBREVIATIONS = {
    "PST": "America/Los_Angeles", "PDT": "America/Los_Angeles", "MST": "America/Denver",
    "MDT": "America/Denver", "CST": "America/Chicago", "CDT": "America/Chicago", "EST": "America/New_York",
    "EDT": "America/New_York", "AKST": "America/Anchorage", "HST": "Pacific/Honolulu", "BST": "Europe/London",
    "CET": "Europe/Berlin", "CEST": "Europe/Berlin", "MET": "Europe/Berlin", "EET": "Europe/Helsinki",
    "EEST": "Europe/Helsinki", "WET": "Europe/Lisbon", "IST": "Asia/Kolkata", "JST": "Asia/Tokyo",
    "KST": "Asia/Seoul", "AEST": "Australia/Sydney", "AEDT": "Australia/Sydney", "NZST": "Pacific/Auckland",
    "Z": "UTC", "ZULU": "UTC"}


@functools.cache
def iana_zones() -> tuple[str, ...]:
    """Every zone name this machine's tz database holds, sorted."""
    return tuple(sorted(zoneinfo.available_timezones()))


def zone_suggestions(name: str) -> list[str]:
    """The IANA names closest to a refused zone (``PST``, ``Europe/Berlinn``, ``berlin``): at most three."""
    if len(name) > SUGGEST_MAX_CHARS:
        return []
    if found := ZONE_NAMES_FOR_ABBREVIATIONS.get(name.strip().upper()):
        return [found]
    zones = iana_zones()
    by_lower = {z.lower(): z for z in zones}
    if name.lower() in by_lower:
        return [by_lower[name.lower()]]
    close = [by_lower[z] for z in difflib.get_close_matches(name.lower(), by_lower, n=3, cutoff=0.75)]
    cities = {z.rsplit("/", 1)[-1].lower().replace("_", " "): z for z in zones if "/" in z}
    close += [cities[c] for c in difflib.get_close_matches(name.lower().replace("_", " "), cities, n=2, cutoff=0.8)]
    return list(dict.fromkeys(close))[:3]


def zone_problem(name: str) -> str:
    """Why ``name`` is refused as a zone, with the closest IANA names."""
    close = zone_suggestions(name)
    hint = (f"did you mean {close[0]}?" + (f" (also close: {', '.join(close[1:])})" if close[1:] else "")
            if close else "use a name such as Europe/Berlin or America/New_York")
    return f"{name[:64]!r} is not an IANA timezone name; {hint}"


###############################################################################
# 3. Agent CLIs: each preset's command lines, its reader of the CLI's output, its limit and
#    login rules and its doctor check. Pure, but for the doctor's probes.
###############################################################################

# --- agent CLIs ------------------------------------------------------------------------------
# Everything Outpost knows of each agent CLI (docs/agent-clis.md), in one place: the limits and login
# failures a CLI's words name, the readers of their output (docs/agent-clis.md), the login checks of
# ``outpost doctor``, and one Preset per CLI that holds its command lines, its reader, whether it
# always ends with a terminal event, its login rules and its doctor check. A run's executor and
# ``outpost doctor`` ask a profile's preset (``profile.kind``), never a table keyed by its name.
# Uses only sections 1 and 2, and rfc3339 (moved up with it: a Limit's view needs it).

def rfc3339(dt: datetime | None) -> str | None:
    """An aware instant as RFC 3339 UTC with ``Z`` (milliseconds kept when present)."""
    if dt is None:
        return None
    dt = dt.astimezone(UTC)
    spec = "milliseconds" if dt.microsecond else "seconds"
    return dt.replace(tzinfo=None).isoformat(timespec=spec) + "Z"


# Limits and login failures, in whatever words a CLI prints them (docs/agent-clis.md, "Limits and login failures").

#: Words that mark a limit in an error text or the tail of stderr (case-insensitive, whole words:
#: a stack trace's ``RetryableQuotaError`` is no limit).
USAGE_LIMIT_WORDS = ("usage limit", "usage_limit", "hit your limit", "hit your usage limit", "quota",
                     "exhausted your capacity", "resource_exhausted", "limit will reset", "out of usage credits",
                     "out of credits", "spend limit", "credit balance is too low", "billing_error")
RATE_LIMIT_WORDS = ("rate limit", "rate_limit", "ratelimit", "ratelimiterror", "too many requests")
#: Claude Code 2.1's wordings: "You've hit your session limit", "... your weekly limit", "... Opus limit",
#: "You've reached your Opus limit"; "Your limit resets at 2026-12-01T21:39:39Z".
HIT_A_LIMIT = re.compile(r"\b(?:hit|reached) your [\w' -]{0,30}\blimit\b|\byour [\w' -]{0,30}\blimit resets\b")
#: A provider too busy to answer (Anthropic's 529, a 503 "overloaded"): waited out like a rate limit
#: with no reset, never the agent's own failure. Not a bare "overloaded" (a compiler says that too).
OVERLOADED = re.compile(r"overloaded_error|\b529\b|\b(?:model|engine|server|servers|api|service) (?:is |are )?"
                        r"(?:currently |temporarily )?(?:down or )?overloaded|api error: \d{3} overloaded")
#: A provider that is down or cut the reply off (a 5xx, a dropped stream), in each real CLI's words
#: (tests/fakes/recorded/*-500, -502, -503, -cut, codex-capacity): waited out as an overload.
PROVIDER_DOWN = re.compile(
    r"api error: 50[0-4]\b|connection to the api was lost"                      # Claude Code
    r"|experiencing high demand|stream closed before response\.completed|model is at capacity"   # Codex
    r"|service is currently unavailable|model stream ended without a finish reason")   # Gemini
#: A limit that no wait lifts: a spend cap, credits or a plan's quota used up. When it names no
#: reset, the profile is paused until a human raises it and resumes the profile (docs/agent-clis.md).
SPEND_LIMIT = re.compile(r"spend (?:limit|cap)|credit balance is too low|billing_error|insufficient_quota|"
                         r"check your plan and billing|out of (?:usage )?credits|add funds")
#: Waits of a limit that names no reset, each +-25% (the wakeup retries' ladder, docs/office.md "Retries").
LIMIT_LADDER_S = (120, 600, 1800, 7200)
LIMIT_JITTER = 0.25
#: A profile stays limited this long past the reset its CLI named.
LIMIT_BUFFER_S = 30
#: A wall time named in a limit message that passed less than this ago means "now".
LIMIT_RECENT_S = 15 * 60
#: Zone abbreviations CLIs print, as fixed offsets (hours); any other zone is an IANA name.
ZONE_ABBREVIATIONS = {"UTC": 0, "GMT": 0, "Z": 0, "EST": -5, "EDT": -4, "CST": -6, "CDT": -5, "MST": -7,
                      "MDT": -6, "PST": -8, "PDT": -7, "AKST": -9, "AKDT": -8, "HST": -10, "CET": 1,
                      "CEST": 2, "BST": 1, "WET": 0, "WEST": 1, "EET": 2, "EEST": 3, "IST": 5.5, "JST": 9,
                      "KST": 9, "AEST": 10, "AEDT": 11}
DURATION_UNITS = {"ms": 0.001, "millisecond": 0.001, "milliseconds": 0.001, "s": 1, "sec": 1, "secs": 1,
                  "second": 1, "seconds": 1, "m": MINUTE_S, "min": MINUTE_S, "mins": MINUTE_S,
                  "minute": MINUTE_S, "minutes": MINUTE_S, "h": HOUR_S, "hr": HOUR_S, "hrs": HOUR_S,
                  "hour": HOUR_S, "hours": HOUR_S, "d": DAY_S, "day": DAY_S, "days": DAY_S}
_UNIT = r"(?:milliseconds?|ms|seconds?|secs?|s|minutes?|mins?|m|hours?|hrs?|h|days?|d)(?![a-z])"
_DURATION = rf"(?:\d+(?:\.\d+)?\s*{_UNIT}[\s,]*(?:and\s+)?)+"
_WALL = r"(\d{1,2})(?::(\d{2}))?\s*([ap]\.?m\.?)?"
#: A zone after a wall time: an IANA name, an abbreviation, or a fixed offset (GMT-3, UTC+5:30).
_ZONE = r"((?:GMT|UTC)[+-]\d{1,2}(?::?\d{2})?|[A-Za-z_]+/[A-Za-z_]+(?:/[A-Za-z_]+)?|[A-Z]{1,5})"
_MONTH = r"(jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?"
MONTHS = {m: i for i, m in enumerate(("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct",
                                      "nov", "dec"), 1)}


@dataclasses.dataclass(frozen=True, slots=True)
class Limit:
    """A rate or usage limit an agent CLI hit, and when it said the limit resets (None: it did not).
    ``raised_by`` names who must act on a spend or credit limit that no wait lifts (None: waiting does)."""
    kind: str                      # rate_limit | usage_limit
    resets_at: datetime | None
    message: str
    raised_by: str | None = None

    def view(self) -> dict[str, Any]:
        return {"kind": self.kind, "resets_at": rfc3339(self.resets_at), "message": self.message}


def _duration_s(text: str) -> float:
    return sum(float(n) * DURATION_UNITS[u.lower()]
               for n, u in re.findall(rf"(\d+(?:\.\d+)?)\s*({_UNIT})", text, re.IGNORECASE))


def _zone_of(name: str | None, default: ZoneInfo) -> tzinfo:
    if not name:
        return default
    if m := re.fullmatch(r"(?:GMT|UTC)([+-])(\d{1,2})(?::?(\d{2}))?", name, re.IGNORECASE):
        offset = timedelta(hours=int(m[2]), minutes=int(m[3] or 0))
        return timezone(-offset if m[1] == "-" else offset) if offset < timedelta(hours=15) else default
    if name.upper() in ZONE_ABBREVIATIONS:
        return timezone(timedelta(hours=ZONE_ABBREVIATIONS[name.upper()]))
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        return default


def _hour(hour: str, ampm: str | None) -> int:
    h = int(hour)
    if ampm:
        h = h % 12 + (12 if ampm.lower().startswith("p") else 0)
    return h


def _next_wall(now: datetime, tz: tzinfo, hour: int, minute: int) -> datetime | None:
    """The next instant showing hour:minute in ``tz``; one that passed in the last 15 minutes is now."""
    if hour > 23 or minute > 59:
        return None
    local = now.astimezone(tz)
    wall = local.replace(hour=hour, minute=minute, second=0, microsecond=0)
    if wall <= local - timedelta(seconds=LIMIT_RECENT_S):
        wall = (wall.replace(tzinfo=None) + timedelta(days=1)).replace(tzinfo=tz)
    return max(wall.astimezone(UTC), now)


def _next_date(now: datetime, tz: tzinfo, year: int | None, month: int, day: int, hour: int,
               minute: int) -> datetime | None:
    """That date and wall time in ``tz``; without a year, the next such date (one that passed in the
    last 15 minutes is now)."""
    if hour > 23 or minute > 59:
        return None
    for candidate in ((year,) if year else (now.astimezone(tz).year, now.astimezone(tz).year + 1)):
        try:
            at = datetime(candidate, month, day, hour, minute, tzinfo=tz)
        except ValueError:
            return None
        if year or at > now - timedelta(seconds=LIMIT_RECENT_S):
            return max(at.astimezone(UTC), now)
    return None


def limit_reset(text: str, now: datetime, tz: ZoneInfo) -> datetime | None:
    """When a limit message says the limit resets (docs/agent-clis.md), or None when it names no time.
    A wall time without a zone is in ``tz`` (the profile's timezone). A reset past MAX_YEAR ("try
    again in 10^400 seconds") names none: no calendar holds it, and the text is an agent's to write."""
    try:
        at = _named_reset(text, now, tz)
    except OverflowError:
        return None
    return at if at is None or at.year <= MAX_YEAR else None


def _named_reset(text: str, now: datetime, tz: ZoneInfo) -> datetime | None:
    if m := re.search(r"\|(\d{10})\b|reset_time\W{0,3}(\d{9,11})\b", text, re.IGNORECASE):
        return max(datetime.fromtimestamp(int(m[1] or m[2]), UTC), now)
    if m := re.search(r"resets?_in_seconds\W{0,3}(\d+(?:\.\d+)?)", text, re.IGNORECASE):
        return now + timedelta(seconds=float(m[1]))
    if m := re.search(r"retry-after:\s*(\d{1,9})\b", text, re.IGNORECASE):
        return now + timedelta(seconds=int(m[1]))
    # "Your limit resets at 2026-12-01T21:39:39Z": an ISO instant (without an offset: in ``tz``)
    if m := re.search(r"\b(?:resets?|try again|retry|available)\s+(?:at|after|on)\s+"
                      r"(\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)", text,
                      re.IGNORECASE):
        with contextlib.suppress(ValueError):
            at = datetime.fromisoformat(m[1])
            return max((at if at.tzinfo else at.replace(tzinfo=tz)).astimezone(UTC), now)
    # "resets Dec 4, 12pm (Europe/Paris)", "resets Jan 3, 2027, 10pm (...)", "resets Nov 13 at 9am"
    m = re.search(rf"\bresets?\s+(?:on\s+)?{_MONTH}\s+(\d{{1,2}})(?:st|nd|rd|th)?,?\s+(?:(\d{{4}}),?\s+)?"
                  rf"(?:at\s+)?{_WALL}(?:\s*\(([A-Za-z_]+(?:/[A-Za-z0-9_+-]+)*)\))?", text, re.IGNORECASE)
    if m and (m[6] or m[5]):   # a wall time: "at 3:28 PM" or "9am", never a bare number
        return _next_date(now, _zone_of(m[7], tz), int(m[3]) if m[3] else None, MONTHS[m[1].lower()],
                          int(m[2]), _hour(m[4], m[6]), int(m[5] or 0))
    if m := re.search(rf"\breset(?:s)?\b(?:\s+at)?\s+{_WALL}\s*\(([A-Za-z_]+(?:/[A-Za-z0-9_+-]+)*)\)",
                      text, re.IGNORECASE):
        return _next_wall(now, _zone_of(m[4], tz), _hour(m[1], m[3]), int(m[2] or 0))
    if m := re.search(rf"\bresets?\s+at\s+{_WALL}\s*\b{_ZONE}(?![\w/])", text, re.IGNORECASE):
        return _next_wall(now, _zone_of(m[4], tz), _hour(m[1], m[3]), int(m[2] or 0))
    if m := re.search(rf"\btry again at\s+{_MONTH}\s+(\d{{1,2}})(?:st|nd|rd|th)?,?\s+(\d{{4}}),?\s+"
                      r"(?:at\s+)?" + _WALL, text, re.IGNORECASE):
        return _next_date(now, tz, int(m[3]), MONTHS[m[1].lower()], int(m[2]), _hour(m[4], m[6]), int(m[5] or 0))
    m = re.search(rf"\b(?:try again|reset|resets)\s+at\s+{_WALL}", text, re.IGNORECASE)
    if m and (m[2] or m[3]):   # "at 3:28 PM" or "at 3pm", never a bare number
        return _next_wall(now, tz, _hour(m[1], m[3]), int(m[2] or 0))
    if m := re.search(rf"\b(?:again|retry|retrying|reset|resets|available)\s+(?:in|after)\s+({_DURATION})",
                      text, re.IGNORECASE):
        return now + timedelta(seconds=_duration_s(m[1]))
    return None


def _has_word(lower: str, words: Iterable[str]) -> bool:
    return any(re.search(rf"(?<![a-z]){re.escape(word)}(?![a-z])", lower) for word in words)


def who_raises(text: str) -> str:
    """Who can lift a spend or credit limit, from how the CLI worded it."""
    if re.search(r"\b(?:your|ask|contact) (?:org'?s? )?admin|your org(?:anization)?'?s\b", text, re.IGNORECASE):
        return "an admin of your organization (the account's billing or usage settings)"
    return "whoever manages the account's billing (plan, credits or spend limit)"


def find_limit(text: str, now: datetime, tz: ZoneInfo, *, kind: str | None = None) -> Limit | None:
    """A limit named in ``text`` (an error, the tail of stderr), or None. ``kind`` is what the CLI's
    structured fields said (``limit``, ``rate_limit``, ``usage_limit``, ``billing``, ``overloaded``):
    then it is a limit whatever the words, and the words only tell its kind and reset."""
    lower = text.lower()
    usage = _has_word(lower, USAGE_LIMIT_WORDS) or bool(HIT_A_LIMIT.search(lower))
    overloaded = bool(OVERLOADED.search(lower) or PROVIDER_DOWN.search(lower))
    rate = _has_word(lower, RATE_LIMIT_WORDS) or bool(re.search(r"\b429\b", lower)) or overloaded
    if not usage and not rate and "limit reached" not in lower and kind is None:   # "5-hour limit reached": usage
        return None
    if kind in ("usage_limit", "billing"):
        usage = True
    elif kind in ("rate_limit", "overloaded"):
        usage = False
    else:
        usage = usage or not rate
    words = (*USAGE_LIMIT_WORDS, *RATE_LIMIT_WORDS, "429", "limit", "overloaded")
    line = next((ln.strip() for ln in text.splitlines() if any(w in ln.lower() for w in words)), text.strip())
    resets_at = limit_reset(text, now, tz)
    spend = kind == "billing" or kind in (None, "limit") and SPEND_LIMIT.search(lower)
    raised_by = who_raises(text) if resets_at is None and usage and spend else None
    return Limit("usage_limit" if usage else "rate_limit", resets_at, line[:500], raised_by)


def limit_wait(limit: Limit, streak: int, now: datetime, jitter: float) -> datetime:
    """Until when a limit holds its profile: the named reset plus 30 s; with no reset, the
    ladder 2 min, 10 min, 30 min, 2 h (+-25%) by the profile's limits in a row."""
    if limit.resets_at is not None:
        return limit.resets_at + timedelta(seconds=LIMIT_BUFFER_S)
    step = LIMIT_LADDER_S[min(streak, len(LIMIT_LADDER_S) - 1)]
    return now + timedelta(seconds=step * (1 + LIMIT_JITTER * max(-1.0, min(1.0, jitter))))


#: Texts of an agent CLI that cannot act for want of a login (docs/agent-clis.md): none, a bad key, or an
#: expired or revoked one (Claude Code's "Failed to authenticate. API Error: 401 OAuth token has
#: expired", "Please login again"; Codex's refresh-token texts; Gemini's API_KEY_INVALID); aider's
#: through litellm.
AUTH_MARKERS = ("not logged in", "please run /login", "invalid api key", "authentication_error",
                "authentication_failed", "please set an auth method", "401 unauthorized", "http 401",
                "status 401", "unauthorized: 401", "authenticationerror", "not able to authenticate you",
                "failed to authenticate", "oauth token has expired", "token has been revoked", "please login again",
                "please log in again", "could not be refreshed", "sign in again", "api_key_invalid",
                "api key not valid", "403 forbidden", "status 403", "http 403", "permissiondeniederror",
                "does not have access to claude", '"unauthenticated"', '"permission_denied"')


def is_auth_failure(text: str) -> bool:
    lower = text.lower()
    return (any(marker in lower for marker in AUTH_MARKERS)
            or bool(re.search(r"openai_api_key\W+(?:is\s+)?(?:not set|missing|required)|"
                              r"(?:missing|no|set)\s+(?:the\s+)?openai_api_key", lower)))


# The report of a run (docs/agent-clis.md): each CLI's reader.

#: Longest final message a report keeps.
FINAL_MESSAGE_CHARS = 4096
#: Deepest nesting of JSON read from an agent's output: the CLIs' events nest a handful of levels
#: (a tool's input a few more). What is kept is written out again later (the store, the API), so it
#: must stay far from Python's recursion limit wherever that happens; deeper output reads as text.
AGENT_JSON_DEPTH = 64
#: JSON that is mostly brackets (past AGENT_JSON_CONTAINERS of them, one in AGENT_JSON_SPARSE
#: characters or more) is not parsed: each becomes a Python object of 50-100 bytes, so 4 MiB of
#: "[]," would take 100 MB of the daemon's memory and seconds of its time. A real event is mostly text.
AGENT_JSON_CONTAINERS = 10_000
AGENT_JSON_SPARSE = 8
#: Largest cost one run may report: the costliest real runs cost tens of dollars. A larger figure
#: (or a negative one, NaN, Infinity) is no amount of money, and it would swamp every sum it enters
#: (budgets, the Agent CLIs page, the runs chart): it is not kept.
MAX_RUN_COST_USD = 100_000.0
#: Largest token or turn count one run may report: a trillion tokens would cost millions. A larger
#: figure is no count (and past 2**53 a browser's JSON would not even read it exactly): not kept.
MAX_RUN_COUNT = 10**12


@dataclasses.dataclass(slots=True)
class Reading:
    """What an agent CLI said about its run, read from its whole output by its preset's reader.
    ``verdict`` is what the CLI's own terminal event said (None: it printed none)."""
    format: str
    verdict: str | None = None          # succeeded | failed | needs_you
    error: str | None = None
    question: str | None = None
    session_id: str | None = None
    model: str | None = None
    agent_version: str | None = None
    turns: int | None = None
    cost_usd: float | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_tokens: int | None = None
    final_message: str | None = None
    permission_denials: list[Any] = dataclasses.field(default_factory=list)
    limit_reset: datetime | None = None   # an exact reset an event gave (Claude's rate_limit_event)
    failure_hint: str | None = None       # what the CLI's structured fields say a failure was (LIMIT_HINTS, auth)
    session_refused: str | None = None    # why the session id it reported is not kept (Preset.read)
    result: dict[str, Any] | None = None  # the run's ``result``: the last JSON object printed
    ends_with_result: bool = False        # its CLI always ends with a terminal event (Preset.read): none is no result
    tools_error: str | None = None        # Outpost's own MCP server did not start (Claude's init event says)


REPORT_FIELDS = ("format", "session_id", "model", "agent_version", "turns", "cost_usd", "input_tokens",
                 "output_tokens", "cache_read_tokens", "final_message", "permission_denials", "session_refused")


def _finite(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


#: JSON as an agent's output is read: NaN and Infinity (which are no JSON) and a number past a float
#: (1e400) become null, so what is kept is JSON every reader after reads (the API, a browser).
AGENT_JSON = json.JSONDecoder(parse_float=_finite, parse_constant=lambda _: None)
#: A JSON escape of half a UTF-16 pair with no other half (Node writes one for a string it cut in a
#: pair): as a string no database can write it. Escaped backslashes and whole pairs match first, kept.
LONE_SURROGATE = re.compile(r"(\\\\|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                            r"|\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _nests_within(value: Any, depth: int) -> bool:
    level = [value]
    for _ in range(depth + 1):
        level = [v for c in level if isinstance(c, dict | list) for v in (c.values() if isinstance(c, dict) else c)]
        if not level:
            return True
    return False


def agent_json(text: str, *, prefix: bool = False) -> Any:
    """``text``, printed by an agent, as JSON (``prefix``: more text may follow it), or None when
    it is none Outpost keeps: not JSON, nested past AGENT_JSON_DEPTH or past the recursion limit, an
    int past Python's 4300 digits. Never an exception: what an agent prints is no reason to fail."""
    containers = text.count("[") + text.count("{")
    if containers > AGENT_JSON_CONTAINERS and containers * AGENT_JSON_SPARSE > len(text):
        return None
    if "\\u" in text:
        text = LONE_SURROGATE.sub(lambda m: m[1] or "\\ufffd", text)
    try:
        value, end = AGENT_JSON.raw_decode(text)
    except (ValueError, RecursionError):
        return None
    if not prefix and text[end:].strip():
        return None
    return value if _nests_within(value, AGENT_JSON_DEPTH) else None


def json_lines(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """Every line of the output that is one JSON object."""
    for line in lines:
        line = line.strip()
        if line.startswith("{") and isinstance(value := agent_json(line), dict):
            yield value


def last_json_object(lines: Iterable[str]) -> dict[str, Any] | None:
    last = None
    for last in json_lines(lines):   # noqa: B007 - the last one is wanted
        pass
    return last


def _whole_json(lines: list[str]) -> Any:
    """The output as one JSON document (a pretty-printed object, or an array), else None."""
    text = "\n".join(lines).strip()
    return agent_json(text) if text.startswith(("{", "[")) else None


def _amount(value: Any, most: float) -> float | None:
    """A figure an agent reported, when it is a number from 0 to ``most`` (never NaN); else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= most:
        return float(value)
    return None


def _count(value: Any) -> int | None:
    """A count an agent reported, when it is a whole number from 0 to MAX_RUN_COUNT; else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_RUN_COUNT else None


def _epoch(value: Any) -> datetime | None:
    """Epoch seconds an agent reported as an instant, when they name one before MAX_YEAR; else None."""
    seconds = _amount(value, datetime(MAX_YEAR, 1, 1, tzinfo=UTC).timestamp())
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


def _string(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _final(text: Any) -> str | None:
    return text[-FINAL_MESSAGE_CHARS:] if isinstance(text, str) and text else None


#: What a failed HTTP status of the model API means for the run (a CLI's structured fields).
STATUS_HINTS = {401: "auth", 403: "auth", 402: "billing", 429: "limit", 500: "overloaded", 502: "overloaded",
                503: "overloaded", 504: "overloaded", 529: "overloaded"}
#: Claude Code's ``error`` on the assistant message it makes up when a request fails.
CLAUDE_ERROR_HINTS = {"authentication_failed": "auth", "oauth_org_not_allowed": "auth", "billing_error": "billing",
                      "rate_limit": "limit"}
#: Claude Code's overage reasons (rate_limit_info.overageDisabledReason) of a spend cap: no wait lifts it.
CLAUDE_SPEND_CAPS = ("org_level_disabled_until", "org_spend_cap_reached")
#: Hints that make a failure a limit (find_limit's ``kind``).
LIMIT_HINTS = ("limit", "rate_limit", "usage_limit", "billing", "overloaded")


def read_claude(lines: list[str]) -> Reading:
    """Claude Code, ``--output-format stream-json --verbose`` (or ``json``, and its array form
    under ``--verbose``): ``system``/``init`` names the session, model and version; the
    ``result`` event decides (``is_error`` or a ``subtype`` other than ``success`` fails, the
    text is in ``result``); ``rate_limit_event`` gives an exact reset. What a failure was is read
    from ``api_error_status`` and the assistant message's ``error`` before any text."""
    events = list(json_lines(lines))
    if len(events) <= 1 and isinstance(whole := _whole_json(lines), list | dict):
        events = [e for e in (whole if isinstance(whole, list) else [whole]) if isinstance(e, dict)]
    reading = Reading("claude-code")
    for e in events:
        kind = e.get("type")
        if kind == "system" and e.get("subtype") == "init":
            reading.session_id = _string(e.get("session_id")) or reading.session_id
            reading.model = _string(e.get("model")) or reading.model
            reading.agent_version = _string(e.get("claude_code_version")) or reading.agent_version
            servers = e.get("mcp_servers") if isinstance(e.get("mcp_servers"), list) else []
            down = [s for s in servers if isinstance(s, dict) and s.get("name") == "outpost"
                    and s.get("status") not in ("connected", None)]
            if down:   # the agent could not act on Outpost: never a success (docs/agent-clis.md)
                status = _string(down[0]["status"])
                reading.tools_error = f"Outpost's tools did not start (MCP server outpost: {status})"
        elif kind == "assistant":
            content = (e.get("message") or {}).get("content") if isinstance(e.get("message"), dict) else None
            texts = [c.get("text") for c in content if isinstance(c, dict) and c.get("type") == "text"] if (
                isinstance(content, list)) else []
            if any(isinstance(t, str) and t for t in texts):
                reading.final_message = _final("\n".join(t for t in texts if isinstance(t, str)))
            if isinstance(e.get("error"), str):   # authentication_failed, billing_error, rate_limit, ...
                reading.failure_hint = CLAUDE_ERROR_HINTS.get(e["error"], reading.failure_hint)
        elif kind == "rate_limit_event":
            info = e.get("rate_limit_info") if isinstance(e.get("rate_limit_info"), dict) else {}
            resets = _epoch(info.get("resetsAt"))
            if info.get("status") not in ("allowed", "allowed_warning"):
                if info.get("rateLimitType") == "overage" and info.get("overageDisabledReason") in CLAUDE_SPEND_CAPS:
                    reading.failure_hint, reading.limit_reset = "billing", None   # resetsAt is another window's
                elif resets is not None:
                    reading.limit_reset = resets
        elif kind == "result":
            reading.result = e
            reading.session_id = _string(e.get("session_id")) or reading.session_id
            failing = e.get("is_error") is True or e.get("subtype", "success") != "success"
            reading.verdict = "failed" if failing else "succeeded"
            text = e.get("result") if isinstance(e.get("result"), str) else None
            if failing:
                reading.error = (text or _string(e.get("subtype")) or "the agent reported a failure")
                if isinstance(e.get("errors"), list) and e["errors"]:
                    reading.error += "; " + "; ".join(str(x) for x in e["errors"][:5])
                status = _count(e.get("api_error_status"))
                if reading.failure_hint is None or STATUS_HINTS.get(status) in ("auth", "overloaded"):
                    reading.failure_hint = STATUS_HINTS.get(status, reading.failure_hint)
            reading.final_message = _final(text) or reading.final_message
            reading.cost_usd = _amount(e.get("total_cost_usd"), MAX_RUN_COST_USD)
            reading.turns = _count(e.get("num_turns"))
            usage = e.get("usage") if isinstance(e.get("usage"), dict) else {}
            reading.input_tokens = _count(usage.get("input_tokens"))
            reading.output_tokens = _count(usage.get("output_tokens"))
            reading.cache_read_tokens = _count(usage.get("cache_read_input_tokens"))
            denials = e.get("permission_denials")
            reading.permission_denials = denials if isinstance(denials, list) else []
            if not failing and reading.permission_denials:
                tools = sorted({str(d.get("tool_name")) for d in reading.permission_denials if isinstance(d, dict)})
                reading.verdict = "needs_you"
                reading.question = (f"The agent was denied permission to use {', '.join(tools) or 'a tool'}. "
                                    "Allow it in the profile, or reply with what to do instead.")
    if reading.verdict != "failed":
        reading.failure_hint = None
    return reading


def _codex_hint(message: str) -> str | None:
    """What a Codex error says, from the HTTP status it names ("unexpected status 401 Unauthorized",
    "exceeded retry limit, last status: 429") or its own error kinds (codex-rs protocol/error.rs)."""
    if m := re.search(r"\b(?:unexpected|last) status:? (\d{3})\b", message):
        return STATUS_HINTS.get(int(m[1]))
    if message.startswith("Quota exceeded. Check your plan and billing details"):   # insufficient_quota
        return "billing"
    if "could not be refreshed" in message:   # the refresh token was used, revoked or expired
        return "auth"
    return None


def read_codex(lines: list[str]) -> Reading:
    """Codex, ``exec --json``: ``thread.started.thread_id`` is the session; ``turn.completed``
    ends a turn (its ``usage`` the tokens); ``turn.failed`` (``error.message``) or ``error``
    (``message``) fails, the HTTP status it names telling a login or limit failure; no terminal
    event at all is no result."""
    reading = Reading("codex")
    for e in json_lines(lines):
        kind = e.get("type")
        if kind == "thread.started":
            reading.session_id = _string(e.get("thread_id")) or reading.session_id
        elif kind == "item.completed" and isinstance(e.get("item"), dict):
            item = e["item"]
            if item.get("type") in ("agent_message", "assistant_message"):
                reading.final_message = _final(item.get("text")) or reading.final_message
        elif kind == "turn.completed":   # its usage is the thread's running total: the last one counts
            reading.result, reading.verdict, reading.error, reading.failure_hint = e, "succeeded", None, None
            usage = e.get("usage") if isinstance(e.get("usage"), dict) else {}
            reading.input_tokens = _count(usage.get("input_tokens"))
            reading.output_tokens = _count(usage.get("output_tokens"))
            reading.cache_read_tokens = _count(usage.get("cached_input_tokens"))
            reading.turns = (reading.turns or 0) + 1
        elif kind == "turn.failed":
            error = e.get("error") if isinstance(e.get("error"), dict) else {}
            reading.result, reading.verdict = e, "failed"
            reading.error = _string(error.get("message")) or "the turn failed"
            reading.failure_hint = _codex_hint(reading.error)
        elif kind == "error":   # "Reconnecting... 2/5" is Codex waiting for a network, not an end
            reading.error = _string(e.get("message")) or "error"
            if not reading.error.lower().startswith("reconnecting"):
                reading.result, reading.verdict = e, "failed"
                reading.failure_hint = _codex_hint(reading.error)
    return reading


def _google_hint(message: str) -> str | None:
    """What a Gemini CLI error says: the Google API error it quotes ("[API Error: {...}]": its
    ``code``, ``status`` and ErrorInfo ``reason``), or the CLI's own quota and overload texts."""
    start = message.find("{")
    body = agent_json(message[start:], prefix=True) if start >= 0 else None
    error = body.get("error") if isinstance(body, dict) and isinstance(body.get("error"), dict) else None
    if error is not None:
        details = error.get("details") if isinstance(error.get("details"), list) else []
        reasons = [d.get("reason") for d in details if isinstance(d, dict)]
        if "API_KEY_INVALID" in reasons or error.get("status") in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            return "auth"
        status = _count(error.get("code"))
        return "limit" if error.get("status") == "RESOURCE_EXHAUSTED" else STATUS_HINTS.get(status)
    if "exhausted your daily quota" in message:   # resets by itself (at midnight Pacific): nobody must act
        return "usage_limit"
    if re.search(r"model is overloaded", message, re.IGNORECASE):
        return "overloaded"
    return None


def _gemini_model(stats: dict[str, Any], named: str | None) -> str | None:
    """The model that answered: the one init named, unless that was ``auto`` (the CLI's router
    chose): then the stats' model with the main role, else the one that used the most tokens."""
    models = stats.get("models") if isinstance(stats.get("models"), dict) else {}
    if named and not named.startswith("auto") or not models:
        return named
    answering = [m for m, s in models.items() if isinstance(s, dict) and isinstance(s.get("roles"), dict | list)
                 and "main" in s["roles"]]
    if answering:
        return answering[0]

    def used(item: tuple[str, Any]) -> int:
        figures = item[1] if isinstance(item[1], dict) else {}
        tokens = figures.get("tokens") if isinstance(figures.get("tokens"), dict) else figures
        return _count(tokens.get("total_tokens", tokens.get("total"))) or 0

    return max(models.items(), key=used)[0]


def read_gemini(lines: list[str]) -> Reading:
    """Gemini CLI, ``--output-format stream-json`` (or the ``json`` format's one multi-line
    object): ``init`` names the session and model (``auto``: the stats name the model that
    answered); the ``result`` event's ``status`` decides, its ``error`` quoting the API's error;
    its ``stats`` give the tokens."""
    reading = Reading("gemini")
    events = list(json_lines(lines))
    whole = _whole_json(lines) if not events else None
    if isinstance(whole, dict):   # --output-format json: {"response", "stats", "error"}
        reading.result = whole
        reading.session_id = _string(whole.get("session_id"))
        reading.final_message = _final(whole.get("response"))
        if isinstance(whole.get("stats"), dict):
            reading.model = _gemini_model(whole["stats"], None)
        error = whole.get("error")
        reading.verdict = "failed" if error else "succeeded"
        if error:
            reading.error = _string(error.get("message")) if isinstance(error, dict) else str(error)
            reading.failure_hint = _google_hint(reading.error or "")
        return reading
    for e in events:
        kind = e.get("type")
        if kind == "init":
            reading.session_id = _string(e.get("session_id")) or reading.session_id
            reading.model = _string(e.get("model")) or reading.model
        elif kind == "message" and e.get("role") == "assistant":
            text = e.get("content")
            if isinstance(text, str):
                reading.final_message = _final(((reading.final_message or "") + text) if e.get("delta")
                                               else text)
        elif kind == "error":
            reading.error = _string(e.get("message")) or reading.error
        elif kind == "result":
            reading.result = e
            ok = e.get("status") == "success"
            reading.verdict = "succeeded" if ok else "failed"
            if not ok:
                error = e.get("error")
                reading.error = ((_string(error.get("message")) if isinstance(error, dict) else _string(error))
                                 or reading.error or "the agent reported a failure")
                reading.failure_hint = _google_hint(reading.error)
            stats = e.get("stats") if isinstance(e.get("stats"), dict) else {}
            reading.input_tokens = _count(stats.get("input_tokens"))
            reading.output_tokens = _count(stats.get("output_tokens"))
            reading.cache_read_tokens = _count(stats.get("cached", stats.get("cached_tokens")))
            reading.turns = _count(stats.get("turns"))
            reading.model = _gemini_model(stats, reading.model)
    return reading


#: litellm's exception classes in aider's output, and what they mean for the run.
LITELLM_HINTS = {"AuthenticationError": "auth", "PermissionDeniedError": "auth", "RateLimitError": "limit",
                 "InternalServerError": "overloaded", "BadGatewayError": "overloaded",
                 "ServiceUnavailableError": "overloaded", "APIConnectionError": "overloaded"}


#: A figure in aider's Tokens line: "2,300", "12.3" (a longer one is inf as a float, and not kept).
_FIGURE = r"(\d[\d,]*(?:\.\d+)?)"


def read_aider(lines: list[str]) -> Reading:
    """aider (plain text): it exits 0 even when its model call failed (aider#5552), so a
    ``litellm.*Error`` line with no ``Tokens:`` line after it fails the run (the error's class
    telling a login or limit failure), and so does "Model X has hit a token limit!"; each ``Tokens:
    ... Cost: $X message, $Y session.`` line adds its cost; the reply is the final message; the
    header names the version ("Aider v0.86.2") and the model ("Main model: X with ...")."""
    reading = Reading("aider")
    cost, tokens_at, errors_at = 0.0, None, None
    for i, line in enumerate(lines):
        if m := re.match(r"\s*litellm\.(\w*(?:Error|Exception))\b", line):
            errors_at, reading.failure_hint = i, LITELLM_HINTS.get(m[1])
        elif re.match(r"\s*Model \S+ has hit a token limit!", line):
            errors_at, reading.failure_hint = i, None
        elif m := re.match(r"Aider v(\d[\w.+-]*)\s*$", line):
            reading.agent_version = m[1]
        elif m := re.match(r"(?:Main model|Model): (\S+) with ", line):
            reading.model = m[1]
        if m := re.match(rf"\s*Tokens:\s*{_FIGURE}(k?)\s+sent.*?{_FIGURE}(k?)\s+received\.\s*"
                         rf"(?:Cost:\s*\${_FIGURE}\s+message|$)", line):   # no cost part: litellm knows no price
            sent, received = (_amount(float(n.replace(",", "")) * (1000 if k else 1), MAX_RUN_COUNT) or 0.0
                              for n, k in ((m[1], m[2]), (m[3], m[4])))
            reading.input_tokens = _count((reading.input_tokens or 0) + round(sent))
            reading.output_tokens = _count((reading.output_tokens or 0) + round(received))
            if m[5] is not None:
                cost += _amount(float(m[5].replace(",", "")), MAX_RUN_COST_USD) or 0.0
                reading.cost_usd = _amount(round(cost, 6), MAX_RUN_COST_USD)
            tokens_at = i
    if errors_at is not None and (tokens_at is None or errors_at > tokens_at):
        reading.verdict = "failed"
        # the error and what aider adds to it, not its advice ("... Try again later or check your quotas.")
        kept = [ln.strip() for ln in lines[errors_at:errors_at + 6] if ln.strip()
                and not re.match(r"\s*(?:Retrying in|The API provider|https?://|Token counts below)", ln)]
        reading.error = "\n".join(kept[:4])[-ERROR_TAIL_BYTES:]
    else:
        reading.failure_hint = None
    if tokens_at is not None:   # the reply: the paragraph before the Tokens line, after aider's header
        before = "\n".join(lines[max(0, tokens_at - 200):tokens_at]).strip()
        reading.final_message = _final(before.rsplit("\n\n", 1)[-1])
    elif text := [ln for ln in lines if ln.strip()]:
        reading.final_message = _final("\n".join(text[-20:]))
    return reading


def read_generic(lines: list[str]) -> Reading:
    """Any other command (the demo agent included), docs/agent-clis.md: exit 0 succeeds unless the last
    JSON object line says ``"is_error": true``, ``"status": "failed"`` or ``"type": "turn.failed"
    | "error"``; ``"status": "needs_you"`` (with ``"question"``) asks a human."""
    result = last_json_object(lines)
    reading = Reading("generic", result=result)
    if result is None:
        return reading
    error = result.get("error")
    reading.error = error if isinstance(error, str) else json.dumps(error) if error else None
    if (result.get("is_error") is True or result.get("status") == "failed"
            or result.get("type") in ("turn.failed", "error")):
        reading.verdict = "failed"
        reading.error = reading.error or _string(result.get("message")) or "the agent reported a failure"
    elif result.get("status") == "needs_you":
        reading.verdict, reading.question = "needs_you", _string(result.get("question"))
    else:
        reading.verdict = "succeeded"
    reading.session_id = _string(result.get("session_id"))
    reading.final_message = _final(result.get("summary"))
    reading.cost_usd = _amount(result.get("cost_usd"), MAX_RUN_COST_USD)
    return reading


# What ``outpost doctor`` asks of a CLI: its logins besides a variable or a file, and its version.

def _json_file(path: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        value = json.loads(path.read_text())
        return value if isinstance(value, dict) else {}
    return {}


def _dotenv(path: Path) -> dict[str, str]:
    """The ``KEY=value`` lines of a .env file (the ones Gemini CLI loads)."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        return {m[1]: m[2].strip().strip("'\"") for m in re.finditer(r"^\s*(?:export\s+)?([A-Z][A-Z0-9_]*)\s*=\s*(.*)$",
                                                                     path.read_text(), re.MULTILINE)}
    return {}


def _truthy(value: Any) -> bool:
    return str(value or "").strip().lower() in ("1", "true", "yes", "on")


def claude_logins(env: dict[str, str], home: Path) -> list[str]:
    """Claude Code's logins besides a key variable and ~/.claude/.credentials.json: an
    ``apiKeyHelper`` or a key, Bedrock or Vertex in its settings (user or managed), Bedrock or
    Vertex (CLAUDE_CODE_USE_BEDROCK, CLAUDE_CODE_USE_VERTEX) or ANTHROPIC_AUTH_TOKEN in the env.
    https://docs.claude.com/en/docs/claude-code/settings , .../amazon-bedrock , .../google-vertex-ai"""
    config = Path(env.get("CLAUDE_CONFIG_DIR") or home / ".claude")
    found = [f"{key} ({what})" for key, what in (("CLAUDE_CODE_USE_BEDROCK", "Amazon Bedrock"),
                                                 ("CLAUDE_CODE_USE_VERTEX", "Google Vertex AI"),
                                                 ("CLAUDE_CODE_USE_FOUNDRY", "Microsoft Foundry"))
             if _truthy(env.get(key))]
    found += ["ANTHROPIC_AUTH_TOKEN"] if env.get("ANTHROPIC_AUTH_TOKEN") else []
    for path in (config / "settings.json", Path("/etc/claude-code/managed-settings.json")):
        settings = _json_file(path)
        if isinstance(settings.get("apiKeyHelper"), str) and settings["apiKeyHelper"].strip():
            found.append(f"apiKeyHelper in {path}")
        settings_env = settings.get("env") if isinstance(settings.get("env"), dict) else {}
        found += [f"{key} in {path}" for key in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "CLAUDE_CODE_OAUTH_TOKEN")
                  if settings_env.get(key)]
        found += [f"{key} in {path}" for key in ("CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX",
                                                 "CLAUDE_CODE_USE_FOUNDRY") if _truthy(settings_env.get(key))]
    if env.get("CLAUDE_CONFIG_DIR") and (config / ".credentials.json").exists():
        found.append(f"{config / '.credentials.json'}")
    return found


def codex_logins(env: dict[str, str], home: Path) -> list[str]:
    """Codex's logins besides CODEX_API_KEY and ~/.codex/auth.json: auth.json in $CODEX_HOME, or a
    model provider of its own in config.toml (with its ``env_key`` set, when it names one).
    https://github.com/openai/codex/blob/main/docs/config.md"""
    codex_home = Path(env.get("CODEX_HOME") or home / ".codex")
    found = [str(codex_home / "auth.json")] if env.get("CODEX_HOME") and (codex_home / "auth.json").exists() else []
    with contextlib.suppress(OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        config = tomllib.loads((codex_home / "config.toml").read_text())
        provider = config.get("model_provider")
        if isinstance(provider, str) and provider != "openai":
            spec = (config.get("model_providers") or {}).get(provider)
            key = spec.get("env_key") if isinstance(spec, dict) else None
            if not key or env.get(key):
                found.append(f"model_provider {provider} in {codex_home / 'config.toml'}{f' ({key})' if key else ''}")
    return found


def gemini_logins(env: dict[str, str], home: Path) -> list[str]:
    """Gemini CLI's logins besides GEMINI_API_KEY, Vertex AI's switch and ~/.gemini/oauth_creds.json:
    a key in the .env files it loads (~/.gemini/.env, ~/.env), GOOGLE_API_KEY, a service account
    (GOOGLE_APPLICATION_CREDENTIALS), gcloud's application-default credentials, or a metadata-server
    login chosen in its settings. https://github.com/google-gemini/gemini-cli/blob/main/docs/get-started/authentication.md"""
    found = ["GOOGLE_API_KEY"] if env.get("GOOGLE_API_KEY") else []
    for path in (home / ".gemini" / ".env", home / ".env"):
        found += [f"{key} in {path}" for key in ("GEMINI_API_KEY", "GOOGLE_API_KEY", "GOOGLE_GENAI_USE_VERTEXAI")
                  if _dotenv(path).get(key)]
    if (credentials := env.get("GOOGLE_APPLICATION_CREDENTIALS")) and Path(credentials).expanduser().is_file():
        found.append(f"GOOGLE_APPLICATION_CREDENTIALS ({credentials})")
    adc = Path(env.get("CLOUDSDK_CONFIG") or home / ".config" / "gcloud") / "application_default_credentials.json"
    if adc.is_file():
        found.append(f"gcloud application-default credentials ({adc})")
    settings = _json_file(home / ".gemini" / "settings.json")
    auth = ((settings.get("security") or {}).get("auth") or {}) if isinstance(settings.get("security"), dict) else {}
    selected = (auth.get("selectedType") if isinstance(auth, dict) else None) or settings.get("selectedAuthType")
    if selected in ("cloud-shell", "compute-default-credentials"):
        found.append(f"{selected} in {home / '.gemini' / 'settings.json'}")
    return found


def cli_version(argv: list[str], env: dict[str, str]) -> str | None:
    """The first line a CLI's version command prints, or None when it does not answer."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=VERSION_TIMEOUT_S, env=env,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[0].strip()[:120] if done.returncode == 0 and lines else None


# --- A run's log as a transcript (the run pages) ---------------------------------------------------
# The agent writes its log: every text is clipped here, the entries and the characters are
# capped, and the templates escape it all (Jinja autoescape); nothing is trusted to be a string.

TRANSCRIPT_MESSAGE_CHARS = 4000      # a message or the final result
TRANSCRIPT_TOOL_INPUT_CHARS = 300    # a tool call's input, summarized
TRANSCRIPT_TOOL_RESULT_CHARS = 800   # what a tool answered
TRANSCRIPT_ENTRIES = 500
TRANSCRIPT_CHARS = 250_000           # the transcript stops there; the raw log has the rest
#: The input field that says what a tool call does, by preference (Claude's Bash/Read/Edit/Grep/
#: WebFetch, Gemini's run_shell_command/read_file...): else the input as compact JSON.
TOOL_INPUT_KEYS = ("command", "file_path", "path", "absolute_path", "pattern", "url", "query", "prompt",
                   "description")


def clip(value: Any, limit: int) -> str:
    """Text of at most ``limit`` characters (and a note of what was cut); any value as text."""
    try:
        text = value if isinstance(value, str) else "" if value is None else json.dumps(value, ensure_ascii=False)
    except (ValueError, RecursionError):
        text = "(unreadable)"
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit:,} more characters)"


def tool_input_summary(value: Any) -> str:
    if isinstance(value, dict):
        for key in TOOL_INPUT_KEYS:
            if isinstance(value.get(key), str) and value[key]:
                return clip(value[key], TRANSCRIPT_TOOL_INPUT_CHARS)
    return clip(value, TRANSCRIPT_TOOL_INPUT_CHARS)


def session_words(model: Any, session_id: Any) -> str:
    return f"model {clip(model, 100)}, session {clip(session_id, 100)}"


def _content_text(content: Any) -> str:
    """A tool result's content: a string, or Claude's list of ``{"type": "text", "text"}`` blocks."""
    if isinstance(content, list):
        return "\n".join(c["text"] for c in content if isinstance(c, dict) and isinstance(c.get("text"), str))
    return content if isinstance(content, str) else "" if content is None else json.dumps(content)


def mcp_tool_name(name: Any) -> str:
    """A tool's name as a transcript shows it: an MCP server's tool as ``server.tool`` (Claude Code
    calls it ``mcp__outpost__comment``, Gemini CLI ``mcp_outpost_comment``), others as they are."""
    text = clip(name, 100) if isinstance(name, str) else ""
    if m := re.fullmatch(r"mcp__([\w-]+?)__(\w+)|mcp_(outpost)_(\w+)", text):
        return f"{m[1] or m[3]}.{m[2] or m[4]}"
    return text


def _claude_entries(e: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Claude Code stream-json: ``assistant`` text, thinking and tool_use blocks; ``user``
    tool_result blocks (or the prompt); the ``result`` with its cost."""
    kind = e.get("type")
    message = e.get("message") if isinstance(e.get("message"), dict) else {}
    content = message.get("content")
    if kind == "system" and e.get("subtype") == "init":
        yield {"kind": "session", "text": session_words(e.get("model"), e.get("session_id"))}
    elif kind in ("assistant", "user") and isinstance(content, str):
        yield {"kind": "message", "role": kind, "text": clip(content, TRANSCRIPT_MESSAGE_CHARS)}
    elif kind in ("assistant", "user") and isinstance(content, list):
        for c in content:
            block = c.get("type") if isinstance(c, dict) else None
            if block == "text":
                yield {"kind": "message", "role": kind, "text": clip(c.get("text"), TRANSCRIPT_MESSAGE_CHARS)}
            elif block == "thinking":
                yield {"kind": "thinking", "text": clip(c.get("thinking"), TRANSCRIPT_MESSAGE_CHARS)}
            elif block == "tool_use":
                yield {"kind": "tool", "name": mcp_tool_name(c.get("name")), "text": tool_input_summary(c.get("input"))}
            elif block == "tool_result":
                yield {"kind": "tool_result", "error": c.get("is_error") is True,
                       "text": clip(_content_text(c.get("content")), TRANSCRIPT_TOOL_RESULT_CHARS)}
    elif kind == "result":
        usage = e.get("usage") if isinstance(e.get("usage"), dict) else {}
        yield {"kind": "result", "error": e.get("is_error") is True or e.get("subtype", "success") != "success",
               "text": clip(e.get("result") if isinstance(e.get("result"), str) else e.get("subtype"),
                            TRANSCRIPT_MESSAGE_CHARS),
               "cost_usd": _amount(e.get("total_cost_usd"), MAX_RUN_COST_USD), "turns": _count(e.get("num_turns")),
               "input_tokens": _count(usage.get("input_tokens")), "output_tokens": _count(usage.get("output_tokens"))}


def _codex_entries(e: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Codex exec --json (codex-rs/exec/src/exec_events.rs): completed items (agent_message,
    reasoning, command_execution, file_change, mcp_tool_call, web_search, error), the turn's end."""
    kind = e.get("type")
    item = e.get("item") if isinstance(e.get("item"), dict) else {}
    what = item.get("type")
    if kind == "thread.started":
        yield {"kind": "session", "text": f"thread {clip(e.get('thread_id'), 100)}"}
    elif kind == "item.completed" and what in ("agent_message", "assistant_message"):
        yield {"kind": "message", "role": "assistant", "text": clip(item.get("text"), TRANSCRIPT_MESSAGE_CHARS)}
    elif kind == "item.completed" and what == "reasoning":
        yield {"kind": "thinking", "text": clip(item.get("text"), TRANSCRIPT_MESSAGE_CHARS)}
    elif kind == "item.completed" and what == "command_execution":
        yield {"kind": "tool", "name": "shell", "text": clip(item.get("command"), TRANSCRIPT_TOOL_INPUT_CHARS)}
        code = _count(item.get("exit_code"))
        yield {"kind": "tool_result", "error": code not in (0, None),
               "text": clip(item.get("aggregated_output"), TRANSCRIPT_TOOL_RESULT_CHARS)
               + (f"\n(exit code {code})" if code else "")}
    elif kind == "item.completed" and what == "file_change":
        changes = item.get("changes") if isinstance(item.get("changes"), list) else []
        paths = ", ".join(f"{clip(c.get('kind'), 20)} {clip(c.get('path'), 200)}" for c in changes[:20]
                          if isinstance(c, dict))
        yield {"kind": "tool", "name": "edit", "text": clip(paths, TRANSCRIPT_TOOL_INPUT_CHARS)}
    elif kind == "item.completed" and what == "mcp_tool_call":
        yield {"kind": "tool", "name": f"{clip(item.get('server'), 50)}.{clip(item.get('tool'), 50)}",
               "text": tool_input_summary(item.get("arguments"))}
    elif kind == "item.completed" and what == "web_search":
        yield {"kind": "tool", "name": "web_search", "text": clip(item.get("query"), TRANSCRIPT_TOOL_INPUT_CHARS)}
    elif kind == "item.completed" and what == "error" or kind == "error":
        yield {"kind": "error", "text": clip((item or e).get("message"), TRANSCRIPT_TOOL_RESULT_CHARS)}
    elif kind in ("turn.completed", "turn.failed"):
        usage = e.get("usage") if isinstance(e.get("usage"), dict) else {}
        error = e.get("error") if isinstance(e.get("error"), dict) else {}
        yield {"kind": "result", "error": kind == "turn.failed", "cost_usd": None, "turns": None,
               "text": clip(error.get("message"), TRANSCRIPT_MESSAGE_CHARS) if error else "turn completed",
               "input_tokens": _count(usage.get("input_tokens")), "output_tokens": _count(usage.get("output_tokens"))}


def _gemini_entries(e: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Gemini CLI stream-json: init, messages (an assistant's deltas are joined by the caller),
    tool_use/tool_result, error, result with its stats."""
    kind = e.get("type")
    if kind == "init":
        yield {"kind": "session", "text": session_words(e.get("model"), e.get("session_id"))}
    elif kind == "message" and e.get("role") in ("user", "assistant"):
        yield {"kind": "message", "role": e["role"], "text": clip(e.get("content"), TRANSCRIPT_MESSAGE_CHARS),
               "delta": e.get("delta") is True}
    elif kind == "tool_use":
        yield {"kind": "tool", "name": mcp_tool_name(e.get("tool_name")),
               "text": tool_input_summary(e.get("parameters"))}
    elif kind == "tool_result":
        error = e.get("error") if isinstance(e.get("error"), dict) else {}
        yield {"kind": "tool_result", "error": e.get("status") != "success",
               "text": clip(e.get("output") or error.get("message"), TRANSCRIPT_TOOL_RESULT_CHARS)}
    elif kind == "error":
        yield {"kind": "error", "text": clip(e.get("message"), TRANSCRIPT_TOOL_RESULT_CHARS)}
    elif kind == "result":
        stats = e.get("stats") if isinstance(e.get("stats"), dict) else {}
        error = e.get("error")
        yield {"kind": "result", "error": e.get("status") != "success", "cost_usd": None,
               "turns": _count(stats.get("turns")),
               "text": clip(error.get("message") if isinstance(error, dict) else error or e.get("status"),
                            TRANSCRIPT_MESSAGE_CHARS),
               "input_tokens": _count(stats.get("input_tokens")), "output_tokens": _count(stats.get("output_tokens"))}


def transcript(text: str, fmt: str | None) -> dict[str, Any] | None:
    """A log of a CLI whose preset (named ``fmt``) has a ``transcriber``, as entries (``kind``:
    session, message, thinking, tool, tool_result, error, result, output for a line that is no
    event), or None: another format, or no event in it. ``cut``: entries left out past the caps
    (the raw log has them)."""
    preset = PRESETS.get(fmt or "")
    reader = preset.transcriber if preset else None
    if reader is None:
        return None
    entries: list[dict[str, Any]] = []
    used = cut = events = 0
    for line in text.splitlines():
        stripped = line.strip()
        event = agent_json(stripped) if stripped.startswith("{") else None
        if isinstance(event, dict):
            events += 1
            found = list(reader(event))
        else:
            found = [{"kind": "output", "text": clip(line, TRANSCRIPT_TOOL_RESULT_CHARS)}] if stripped else []
        for entry in found:
            last = entries[-1] if entries else None
            if last and entry["kind"] == "output" == last["kind"] or (entry.get("delta") and last
                                                                      and last.get("delta")):
                joined = clip(last["text"] + ("\n" if entry["kind"] == "output" else "") + entry["text"],
                              TRANSCRIPT_MESSAGE_CHARS)   # output lines, or an assistant's deltas: one entry
                used += len(joined) - len(last["text"])
                last["text"] = joined
            elif len(entries) >= TRANSCRIPT_ENTRIES or used >= TRANSCRIPT_CHARS:
                cut += 1
            else:
                entries.append(entry)
                used += len(entry.get("text") or "")
    return {"entries": entries, "cut": cut} if events else None


# Outpost's own tools in a run (docs/agent-clis.md): how each CLI is told of ``outpost mcp``.

#: The variables of every run that ``outpost mcp`` reads: its token, and where the API is.
RUN_TOKEN_ENV, API_URL_ENV = "OUTPOST_RUN_TOKEN", "OUTPOST_API_URL"

@dataclasses.dataclass(frozen=True, slots=True)
class ToolServer:
    """Outpost's MCP server as one run's CLI starts it: the command line of ``outpost mcp``, the
    API's URL (the run token it reads from the run's env, RUN_TOKEN_ENV, never from a file or a
    command line), and the run's private folder, where the files that wire it are written:
    outside the worktree, read-only to the agent."""
    command: str
    args: tuple[str, ...]
    api_url: str
    folder: Path
    #: MCP servers the CLI's own config files name, each with the transport a disabling entry must
    #: carry to stand on its own ("" where the file is always read; Codex: they are disabled).
    others: tuple[tuple[str, str], ...] = ()
    #: Gemini CLI's system settings file for the run (see gemini_settings).
    system_settings: Path | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ToolWiring:
    """What a run's command line becomes with Outpost's tools: its argv, variables to add, and
    files (name in the run's private folder -> text) to write before it starts."""
    argv: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    #: What must be at ``ToolServer.system_settings`` (Gemini CLI's system settings), or None.
    system_settings: dict[str, Any] | None = None


def claude_tools(argv: list[str], server: ToolServer) -> ToolWiring:
    """Claude Code: only the servers of --mcp-config (a committed .mcp.json adds none), Outpost's
    tools allowed by server name, the project's settings not read (they could allow a tool).
    ``alwaysLoad``: connected before the first turn (print mode otherwise starts while the server
    is still "pending" and offers none of its tools) and never deferred to tool search."""
    config = {"mcpServers": {"outpost": {"type": "stdio", "command": server.command, "args": list(server.args),
                                         "alwaysLoad": True}}}   # it inherits the CLI's env: token, URL
    return ToolWiring([*argv, "--mcp-config", str(server.folder / "mcp.json"), "--strict-mcp-config",
                       "--allowedTools", "mcp__outpost", "--setting-sources", "user"],
                      {"MCP_CONNECT_TIMEOUT_MS": "30000"}, {"mcp.json": json.dumps(config)})


def codex_tools(argv: list[str], server: ToolServer) -> ToolWiring:
    """Codex: Outpost's server by -c overrides (they win over every config file), its tools
    approved, required (the run fails when it cannot start); the token forwarded by name (a
    command line is readable in /proc), the API's URL set by value so no config layer can point
    the token elsewhere; every other server a config names (``server.others``) disabled; the
    agent's shell commands get no OUTPOST_ variable."""
    table = {"command": server.command, "args": list(server.args), "env_vars": [RUN_TOKEN_ENV],
             "default_tools_approval_mode": "approve", "required": True, "startup_timeout_sec": 60,
             "enabled": True, f"env.{API_URL_ENV}": server.api_url}
    flags = [f"mcp_servers.outpost.{k}={json.dumps(v)}" for k, v in table.items()]   # JSON values are TOML here
    for name, transport in (o for o in server.others if o[0] != "outpost"):
        # a project's file is read only when its folder is trusted: its entry must be valid alone
        flags += [f"mcp_servers.{json.dumps(name)}.enabled=false", *{
            "command": [f'mcp_servers.{json.dumps(name)}.command="false"'],
            "url": [f'mcp_servers.{json.dumps(name)}.url="http://127.0.0.1:9/"']}.get(transport, [])]
    flags.append('shell_environment_policy.exclude=["OUTPOST_*"]')
    at = argv.index("exec") + 1 if "exec" in argv else min(1, len(argv))
    return ToolWiring([*argv[:at], *(x for flag in flags for x in ("-c", flag)), *argv[at:]])


def gemini_settings(server: ToolServer) -> dict[str, Any]:
    """Gemini CLI's system settings for a run: Outpost's server trusted (no confirmation), its
    variables expanded by Gemini from the run's env, and what a trusted project's
    .gemini/settings.json could widen set back (system settings win over it; arrays replace)."""
    return {"mcpServers": {"outpost": {"command": server.command, "args": list(server.args), "trust": True,
                                       "timeout": 60_000, "env": {k: f"${k}" for k in (RUN_TOKEN_ENV, API_URL_ENV)}}},
            "mcp": {"allowed": ["outpost"], "excluded": [], "serverCommand": ""},
            "tools": {"allowed": [], "discoveryCommand": "", "callCommand": ""}, "hooksConfig": {"enabled": False}}


def gemini_tools(argv: list[str], server: ToolServer) -> ToolWiring:
    """Gemini CLI: system settings (``gemini_settings``), which it reads only from a file that root
    owns in folders root owns (``server.system_settings``); only Outpost's server may start, and
    the policy paths a project names are replaced by an empty folder of the run's."""
    policies = server.folder / "gemini-policies"
    return ToolWiring([*argv, "--allowed-mcp-server-names", "outpost", "--policy", str(policies), "--admin-policy",
                       str(policies)], {"GEMINI_CLI_SYSTEM_SETTINGS_PATH": str(server.system_settings)},
                      {"gemini-policies/.keep": ""}, gemini_settings(server))


#: The session ids a CLI may report, since each goes on the command line of a resume: Claude Code,
#: Codex (its thread id, a UUIDv7) and Gemini CLI name sessions by UUID (tests/fakes/recorded);
#: another command by a word that cannot be read as an option (no leading "-", no space).
UUID_SESSION = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE | re.ASCII)
WORD_SESSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,199}", re.ASCII)


@dataclasses.dataclass(frozen=True, slots=True)
class Preset:
    """How Outpost drives one agent CLI: its command lines (the prompt always on stdin), the
    reader of its output and whether the CLI always ends with a terminal event (then a run that
    printed none has no result), the flags that carry a model and a cost cap, how to ask its
    version, and what shows it is logged in: a variable set, a file in HOME, or what its own
    ``logins`` check finds. The executor reads a run with ``read``; ``outpost doctor`` checks
    the CLI with ``doctor``. ``name`` is the preset's name in outpost.toml and the report's
    ``format``; the limits and login failures a CLI's structured fields name are its reader's.
    ``session_shape``: what a session id it reports must be to be resumed."""
    name: str
    command: tuple[str, ...]
    resume: tuple[str, ...] = ()
    session_shape: re.Pattern[str] = WORD_SESSION
    reader: Callable[[list[str]], Reading] = read_generic
    ends_with_result: bool = False
    #: Its log's events as transcript entries (the run pages); None: the log reads raw.
    transcriber: Callable[[dict[str, Any]], Iterator[dict[str, Any]]] | None = None
    model_flag: str | None = None
    budget_flag: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    version: tuple[str, ...] = ()
    login_env: tuple[str, ...] = ()
    login_files: tuple[str, ...] = ()
    logins: Callable[[dict[str, str], Path], list[str]] | None = None
    login: str = ""
    #: How its command line gets Outpost's MCP tools (None: the CLI has no such wiring; its
    #: agent is told the HTTP API and the run token).
    tools: Callable[[list[str], ToolServer], ToolWiring] | None = None
    #: Its state folder in HOME (of AGENT_HOME_STATE), the one its sandbox shows (None: none).
    home_state: str | None = None

    def read(self, lines: list[str]) -> Reading:
        """What the CLI said about its run, from the lines it printed. A session id not of its
        shape is not kept: a resume would put it on the command line, where ``--yolo`` is an option."""
        reading = self.reader(lines)
        reading.ends_with_result = self.ends_with_result
        if reading.session_id is not None and not self.resumes(reading.session_id):
            reading.session_refused = (f"the agent reported session {clip(reading.session_id, 100)!r}, which is not "
                                       f"a {self.name} session id: not kept, the next run starts fresh")
            reading.session_id = None
        return reading

    def resumes(self, session_id: str) -> bool:
        """Whether ``session_id`` may go on its resume command line."""
        return bool(self.session_shape.fullmatch(session_id))

    def doctor(self, binary: str, env: dict[str, str]) -> tuple[bool, str]:
        """``outpost doctor``'s check of the CLI at ``binary`` under a run's ``env``: it answers
        its version command, and a login is found. Usable or not, and the line that says so."""
        if not self.version:
            return True, f"ok, {binary} ({self.name}: no version or login check)"
        version = cli_version([binary, *self.version[1:]], env)
        if version is None:
            return False, f"{binary} did not answer `{' '.join(self.version)}`"
        home = Path(env.get("HOME", "~")).expanduser()
        keys = [k for k in self.login_env if env.get(k)]
        files = [f for f in self.login_files if (home / f).exists()]
        others = self.logins(env, home) if self.logins else []
        if not keys and not files and not others:
            wanted = " or ".join([*self.login_env[:2], *(f"~/{f}" for f in self.login_files)])
            return False, f"{version} at {binary}, but no login found ({wanted}): {self.login}"
        return True, f"ok, {version} at {binary}, logged in by {', '.join(keys + files + others)}"


#: The agent CLIs Outpost knows (docs/agent-clis.md), each flag checked against the CLI's own docs:
#: - Claude Code: print mode reads the prompt from stdin; stream-json needs --verbose;
#:   acceptEdits lets an unattended run edit files (other tools are denied and reported).
#:   https://docs.claude.com/en/docs/claude-code/cli-reference, .../headless
#: - Codex 0.171: ``exec`` reads the prompt from stdin with ``-``; --json prints JSONL events;
#:   --sandbox workspace-write replaces --full-auto (refused, exit 2); options go before
#:   ``resume ID`` (after it --sandbox is refused); --skip-git-repo-check; ``exec`` reads
#:   CODEX_API_KEY or ~/.codex/auth.json, not OPENAI_API_KEY.
#:   https://github.com/openai/codex/blob/main/docs/exec.md, codex-rs/exec/src/cli.rs
#: - Gemini CLI 0.61: headless when stdin is not a terminal; stream-json events; a new worktree
#:   is an untrusted folder (exit 55) unless GEMINI_CLI_TRUST_WORKSPACE=true (or --skip-trust);
#:   auto_edit approves edits, a shell command is denied; ``--resume UUID`` in the same directory.
#:   https://github.com/google-gemini/gemini-cli/blob/main/docs/cli/headless.md
#: - aider 0.86: one message from a file, no questions, no commits of its own (Outpost saves the
#:   edits), plain unwrapped output, no self-update, no .gitignore edit, no analytics; it has no
#:   sessions. https://aider.chat/docs/config/options.html
PRESETS: dict[str, Preset] = {preset.name: preset for preset in (
    Preset(
        "claude-code",
        command=("claude", "-p", "--output-format", "stream-json", "--verbose", "--permission-mode", "acceptEdits"),
        resume=("claude", "-p", "--output-format", "stream-json", "--verbose", "--permission-mode", "acceptEdits",
                "--resume", "{session_id}"),
        reader=read_claude, ends_with_result=True, transcriber=_claude_entries, model_flag="--model",
        session_shape=UUID_SESSION,
        budget_flag="--max-budget-usd",
        version=("claude", "--version"),
        login_env=("ANTHROPIC_API_KEY", "CLAUDE_CODE_OAUTH_TOKEN"), login_files=(".claude/.credentials.json",),
        logins=claude_logins, tools=claude_tools, home_state=".claude",
        login="run `claude`, then /login (or `claude setup-token`, or give ANTHROPIC_API_KEY through pass_env)"),
    Preset(
        "codex",
        command=("codex", "exec", "--json", "--sandbox", "workspace-write", "--skip-git-repo-check", "-"),
        resume=("codex", "exec", "--json", "--sandbox", "workspace-write", "--skip-git-repo-check", "resume",
                "{session_id}", "-"),
        reader=read_codex, ends_with_result=True, transcriber=_codex_entries, model_flag="--model",
        session_shape=UUID_SESSION,
        version=("codex", "--version"),
        login_env=("CODEX_API_KEY",), login_files=(".codex/auth.json",), logins=codex_logins, tools=codex_tools,
        home_state=".codex",
        login="run `codex login` (or `printenv OPENAI_API_KEY | codex login --with-api-key`), or give "
              "CODEX_API_KEY through pass_env (codex exec ignores OPENAI_API_KEY)"),
    Preset(
        "gemini",
        command=("gemini", "--output-format", "stream-json", "--approval-mode", "auto_edit"),
        resume=("gemini", "--output-format", "stream-json", "--approval-mode", "auto_edit", "--resume",
                "{session_id}"),
        reader=read_gemini, ends_with_result=True, transcriber=_gemini_entries, model_flag="--model",
        session_shape=UUID_SESSION,
        env=(("GEMINI_CLI_TRUST_WORKSPACE", "true"), ("NO_COLOR", "1")), version=("gemini", "--version"),
        login_env=("GEMINI_API_KEY", "GOOGLE_GENAI_USE_VERTEXAI", "GOOGLE_GENAI_USE_GCA"),
        login_files=(".gemini/oauth_creds.json",), logins=gemini_logins, tools=gemini_tools, home_state=".gemini",
        login="run `gemini` once and choose a login (or give GEMINI_API_KEY through pass_env)"),
    Preset(
        "aider",
        command=("aider", "--message-file", "{prompt_file}", "--yes-always", "--no-auto-commits", "--no-pretty",
                 "--no-stream", "--no-check-update", "--no-gitignore", "--no-analytics", "--no-show-release-notes"),
        reader=read_aider, model_flag="--model", version=("aider", "--version"),
        env=(("COLUMNS", "1000"), ("BROWSER", "true")),
        login_env=("ANTHROPIC_API_KEY", "OPENAI_API_KEY", "GEMINI_API_KEY", "DEEPSEEK_API_KEY", "OPENROUTER_API_KEY"),
        login="give the model provider's API key (ANTHROPIC_API_KEY, OPENAI_API_KEY, ...) through pass_env",
        home_state=".aider"),
    Preset("generic", command=(), reader=read_generic),
)}


###############################################################################
# 4. Configuration: outpost.toml, environment and flags -> one frozen Config.
###############################################################################

# --- profiles, settings and the Config ---------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class ResourceCaps:
    """What one run's processes are held to together: its profile's ``max_processes`` (threads
    count) and ``memory_mb`` (docs/security.md "Resource caps")."""
    processes: int = RUN_MAX_PROCESSES
    memory_mb: int = RUN_MEMORY_MB


@dataclasses.dataclass(frozen=True, slots=True)
class AgentProfile:
    """How to start one kind of agent: a preset's command lines, or the profile's own. Command
    items may hold {model}, {run_id}, {prompt_file} and (resume) {session_id}; the prompt goes on
    stdin. ``timeout_seconds`` caps every run of this agent, whatever a schedule's limit says;
    ``max_running`` caps this profile's runs at once; ``timezone`` reads reset times its CLI
    prints without a zone; ``tmp_mb`` sizes its sandbox's /tmp and /dev/shm; ``max_processes``
    and ``memory_mb`` cap each of its runs (docs/security.md "Resource caps")."""
    name: str
    command: tuple[str, ...]
    timeout_seconds: int | None = None
    env: tuple[tuple[str, str], ...] = ()
    pass_env: tuple[str, ...] = DEFAULT_PASS_ENV
    resume: tuple[str, ...] = ()
    preset: str = "generic"
    model: str | None = None
    max_running: int | None = None
    timezone: str | None = None
    tmp_mb: int = SANDBOX_TMP_MB
    max_processes: int = RUN_MAX_PROCESSES
    memory_mb: int = RUN_MEMORY_MB

    @property
    def caps(self) -> ResourceCaps:
        return ResourceCaps(self.max_processes, self.memory_mb)

    @property
    def kind(self) -> Preset:
        return PRESETS[self.preset]

    @property
    def model_flag(self) -> str | None:
        return self.kind.model_flag

    @property
    def budget_flag(self) -> str | None:
        return self.kind.budget_flag

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone) if self.timezone else host_zone()


def host_zone() -> ZoneInfo:
    """The host's zone (for reset times a CLI prints without one), UTC when it cannot be told."""
    with contextlib.suppress(OSError, ValueError, ZoneInfoNotFoundError):
        name = os.environ.get("TZ") or os.path.realpath("/etc/localtime").partition("zoneinfo/")[2]
        if name:
            return ZoneInfo(name.lstrip(":"))
    return ZoneInfo("UTC")


@dataclasses.dataclass(frozen=True, slots=True)
class NotifyEntry:
    """One ``[[notify]]`` entry (docs/operations.md): where notifications go (an Apprise URL, which holds
    its secrets: shown only as ``label``), which attention kinds, and an optional daily digest; or
    one added from the dashboard (``index`` None, ``id`` its row's)."""
    index: int | None
    url: str
    label: str                              # the URL with its secrets masked (Apprise's privacy form)
    kinds: tuple[str, ...] = NOTIFY_DEFAULT_KINDS
    digest: str | None = None               # "08:00 Europe/Berlin"
    id: str = ""                            # "toml-0" for outpost.toml's first, "ntf_..." for the dashboard's

    @property
    def name(self) -> str:
        """The entry in logs: ``notify[0]`` (outpost.toml) or its id."""
        return f"notify[{self.index}]" if self.index is not None else self.id

    @property
    def key(self) -> str:
        """The entry in the outbox: its URL hashed (the same entry after a restart, never its secrets)."""
        return hashlib.sha256(self.url.encode()).hexdigest()[:24]

    def digest_due(self, now: datetime) -> datetime | None:
        """The latest instant at or before ``now`` its daily digest was due (None: no digest)."""
        if self.digest is None:
            return None
        clock, _, zone_name = self.digest.partition(" ")
        hour, minute = (int(x) for x in clock.split(":"))
        tz = ZoneInfo(zone_name or "UTC")
        local = now.astimezone(tz)
        due = local.replace(hour=hour, minute=minute, second=0, microsecond=0)
        if due > local:
            due = (local - timedelta(days=1)).replace(hour=hour, minute=minute, second=0, microsecond=0)
        # a wall time a DST change skipped or doubled: its first instant, as cron does
        return datetime.fromtimestamp(due.replace(tzinfo=tz).timestamp(), UTC)


@dataclasses.dataclass(frozen=True, slots=True)
class ChannelEntry:
    """One ``[[channels]]`` entry (docs/office.md, "Channels"): a Slack channel or a Telegram chat that
    feeds one Office task. Its secrets are read here (``env:NAME`` from the environment) and
    shown nowhere."""
    name: str
    kind: str                      # slack | telegram
    channel: str                   # Slack channel id; Telegram chat id
    task: str                      # a task id, or "create"
    agent: str | None              # with task "create": the agent the channel task is assigned to
    bot_token: str
    signing_secret: str = ""       # Slack
    secret_token: str = ""         # Telegram

    @property
    def key(self) -> str:
        """Its outbox entry: the agent's replies go out as this entry's rows."""
        return f"channel:{self.name}"

    @property
    def title(self) -> str:
        return f"{self.name} ({'Slack' if self.kind == 'slack' else 'Telegram'})"


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    max_running: int = DEFAULT_MAX_RUNNING
    allowed_hosts: tuple[str, ...] = ()
    agents: tuple[AgentProfile, ...] = ()
    isolate_agents: str = "auto"      # auto | always | never: bubblewrap around every agent
    database: str | None = None       # a postgresql:// URL (a fleet, docs/fleet.md); None: SQLite in data_dir
    node_name: str = ""               # this process in a fleet; "" -> <hostname>:<port>
    fleet_max_running: int | None = None
    metrics_token: str | None = None  # a second token that reads GET /metrics only (docs/operations.md)
    notify: tuple[NotifyEntry, ...] = ()   # [[notify]] entries (docs/operations.md)
    keep_days: int = DEFAULT_KEEP_DAYS   # housekeeping (docs/operations.md): settled runs older than this go
    channels: tuple[ChannelEntry, ...] = ()   # [[channels]] entries (docs/office.md "Channels")
    slack_api_url: str = SLACK_API_URL
    telegram_api_url: str = TELEGRAM_API_URL

    def agent(self, name: str) -> AgentProfile | None:
        return next((a for a in self.agents if a.name == name), None)

    @property
    def db_path(self) -> Path:
        return self.data_dir / "outpost.sqlite3"

    @property
    def node(self) -> str:
        """Unique in a fleet: ``node_name``, or ``<hostname>:<port>`` (the process id for a port
        chosen at start, ``--port 0``)."""
        return self.node_name or f"{socket.gethostname()}:{self.port or f'pid{os.getpid()}'}"


def default_data_dir() -> Path:
    env = os.environ.get("OUTPOST_DATA_DIR")
    return Path(env) if env else Path.home() / ".local/state/outpost"


def demo_profile() -> AgentProfile:
    """The built-in profile: this very file's simulated agent (section 6)."""
    command = (sys.executable, str(OUTPOST_PY), "demo-agent")
    return AgentProfile("demo", command, timeout_seconds=600, resume=(*command, "--resume", "{session_id}"))


def as_written(value: Any) -> str:
    """A value as outpost.toml would say it (``true``, not Python's ``True``), for an error that quotes it."""
    return json.dumps(value, default=str, ensure_ascii=False)


def _whole(lo: int, hi: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        ok = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
        return None if ok else f"must be a whole number from {lo} to {hi}, not {as_written(value)}"
    return check


def _strings(*, empty: bool) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value) and (empty or value)
        return None if ok else f"must be a {'' if empty else 'non-empty '}list of strings, not {as_written(value)}"
    return check


def _string_table(value: Any) -> str | None:
    ok = isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
    return None if ok else f"must be a table of strings (NAME = \"value\"), not {as_written(value)}"


#: Every key ``outpost.toml`` may hold, with its check: a typo or a wrong type stops ``serve``
#: at start with one line naming the key, never a crash at the first run.
def _one_of(*choices: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return None if value in choices else f"must be one of {', '.join(choices)}, not {as_written(value)}"
    return check


def is_postgres_url(database: Path | str) -> bool:
    return str(database).startswith(("postgresql://", "postgres://"))


def _database_url(value: Any) -> str | None:
    if isinstance(value, str) and is_postgres_url(value):
        return None
    return f"must be a postgresql:// URL (SQLite in the data dir is the default), not {as_written(value)}"


def _text_value(value: Any) -> str | None:
    return None if isinstance(value, str) and value.strip() else f"must be a non-empty string, not {as_written(value)}"


def _metrics_token(value: Any) -> str | None:
    """A scraper's secret: long enough not to be guessed, and one word (it goes in a header)."""
    if isinstance(value, str) and len(value) >= 16 and value.isascii() and value.isprintable() and " " not in value:
        return None
    return "must be a string of at least 16 printable ASCII characters without spaces (a secret a scraper sends)"


def _api_url(value: Any) -> str | None:
    ok = isinstance(value, str) and re.fullmatch(r"https?://[^\s/?#]+(?:/[^\s?#]*)?", value) is not None
    return None if ok else f"must be an http(s) URL such as https://slack.com/api, not {as_written(value)}"


SETTINGS_KEYS: dict[str, Callable[[Any], str | None]] = {
    "max_running": _whole(1, 1000), "allowed_hosts": _strings(empty=True),
    "isolate_agents": _one_of(*ISOLATION_MODES), "database": _database_url,
    "node_name": _text_value, "fleet_max_running": _whole(1, 100_000), "metrics_token": _metrics_token,
    "keep_days": _whole(1, 100_000), "slack_api_url": _api_url, "telegram_api_url": _api_url}


def _zone_name(value: Any) -> str | None:
    try:
        ZoneInfo(value)
        return None
    except (ZoneInfoNotFoundError, ValueError, TypeError, OSError):   # OSError: "Europe" is a folder of zones
        return f"must be an IANA timezone name: {zone_problem(value)}" if isinstance(value, str) else (
            f"must be an IANA timezone name such as \"America/Chicago\", not {as_written(value)}")


AGENT_KEYS: dict[str, Callable[[Any], str | None]] = {
    "preset": _one_of(*PRESETS), "command": _strings(empty=False), "resume": _strings(empty=True),
    "timeout_seconds": _whole(1, DAY_S), "env": _string_table, "pass_env": _strings(empty=True),
    "model": _text_value, "max_running": _whole(1, 1000), "timezone": _zone_name, "tmp_mb": _whole(16, 1 << 20),
    "max_processes": _whole(16, 1 << 22), "memory_mb": _whole(64, 1 << 24)}


def agent_profile(path: Path, name: str, spec: dict[str, Any]) -> AgentProfile:
    """One ``[agents.NAME]`` table as a profile: its preset's command lines unless it gives its own."""
    preset = PRESETS[spec.get("preset", "generic")]
    command = tuple(spec.get("command", preset.command))
    if not command:
        raise ConfigError(f"{path}: agents.{name}.command is missing (the command line that starts the agent; "
                          f"or name a preset: {', '.join(p.name for p in PRESETS.values() if p.command)})")
    for key in ("command", "resume"):
        if any("{prompt}" in item for item in spec.get(key, ())):
            raise ConfigError(f"{path}: agents.{name}.{key} holds {{prompt}}: the prompt goes to the agent on stdin "
                              "(a brief starting with '-' must not become an option); remove it, or use "
                              "{prompt_file} for a CLI that reads a file")
    env = dict(preset.env) | spec.get("env", {})
    return AgentProfile(name, command, spec.get("timeout_seconds"), tuple(env.items()),
                        tuple(spec.get("pass_env", DEFAULT_PASS_ENV)),
                        tuple(spec.get("resume", preset.resume if "command" not in spec else ())),
                        spec.get("preset", "generic"), spec.get("model"), spec.get("max_running"),
                        spec.get("timezone"), spec.get("tmp_mb", SANDBOX_TMP_MB),
                        spec.get("max_processes", RUN_MAX_PROCESSES), spec.get("memory_mb", RUN_MEMORY_MB))


def _checked_table(path: Path, where: str, table: Any, keys: dict[str, Callable[[Any], str | None]]) -> dict:
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: {where} must be a table")
    for key, value in table.items():
        if key not in keys:
            raise ConfigError(f"{path}: {where}.{key} is not a setting Outpost knows "
                              f"(known: {', '.join(keys)}){did_you_mean(key, keys)}")
        if (problem := keys[key](value)) is not None:
            raise ConfigError(f"{path}: {where}.{key} {problem}")
    return table


def _notify_kinds(value: Any) -> str | None:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        return f"must be a non-empty list of attention kinds, not {as_written(value)}"
    unknown = [v for v in value if v not in ATTENTION_KINDS]
    return f"names {unknown[0]!r}, not an attention kind (known: {', '.join(ATTENTION_KINDS)})" if unknown else None


def _digest_time(value: Any) -> str | None:
    m = re.fullmatch(r"([01]?\d|2[0-3]):([0-5]\d)(?: (\S+))?", value) if isinstance(value, str) else None
    if m is None:
        return ("must be a time of day with an optional IANA zone, such as \"08:00 Europe/Berlin\", "
                f"not {as_written(value)}")
    return _zone_name(m[3]) if m[3] else None


#: Apprise's plain webhooks (a POST of JSON, a form, XML): their path is shown masked.
PATH_SECRET_SCHEMES = ("json", "jsons", "form", "forms", "xml", "xmls")
NOTIFY_KEYS: dict[str, Callable[[Any], str | None]] = {"url": _text_value, "kinds": _notify_kinds,
                                                       "digest": _digest_time}


def notify_label(url: str) -> str | None:
    """An Apprise URL with its secrets masked, or None when Apprise cannot send to it (an
    unknown scheme, a missing token). Apprise answers from the URL alone, with no network."""
    import apprise  # noqa: PLC0415 - 0.15 s to import: only with [[notify]] entries

    target = apprise.Apprise.instantiate(url, suppress_exceptions=True)
    if not target:
        return None
    label = target.url(privacy=True).partition("?")[0]   # without Apprise's default options
    scheme, _, rest = label.partition("://")
    host, slash, path = rest.partition("/")
    # a webhook's path is often its secret (Slack's /services/T.../B.../XXXX); Apprise masks
    # tokens and passwords, never a plain webhook's path
    return f"{scheme}://{host}/****" if scheme.lower() in PATH_SECRET_SCHEMES and slash and path else label


def _config_tables(path: Path, raw: Any, section: str, keys: dict[str, Callable[[Any], str | None]],
                   names: str) -> Iterator[tuple[int, str, dict]]:
    """Each ``[[section]]`` table with its index and name (``notify[0]``), every key checked."""
    if not isinstance(raw, list) or not all(isinstance(spec, dict) for spec in raw):
        raise ConfigError(f"{path}: {section} must be [[{section}]] tables ({names})")
    for index, spec in enumerate(raw):
        where = f"{section}[{index}]"
        yield index, where, _checked_table(path, where, spec, keys)


def notify_entries(path: Path, raw: Any) -> tuple[NotifyEntry, ...]:
    """The ``[[notify]]`` entries: each checked here, so a typo stops ``serve`` at start with one
    line; a URL is named by its entry and scheme only (it holds tokens and passwords)."""
    entries: list[NotifyEntry] = []
    for index, where, spec in _config_tables(path, raw, "notify", NOTIFY_KEYS, "url, kinds, digest"):
        if "url" not in spec:
            raise ConfigError(f"{path}: {where}.url is missing (an Apprise URL, such as ntfy://ntfy.sh/my-topic)")
        scheme = spec["url"].partition("://")[0] if "://" in spec["url"] else "(none)"
        label = notify_label(spec["url"])
        if label is None:
            raise ConfigError(f"{path}: {where}.url is not a URL Apprise can send to (scheme {scheme!r}; "
                              "see https://github.com/caronc/apprise/wiki for each service's URL)")
        if any(e.url == spec["url"] for e in entries):
            raise ConfigError(f"{path}: {where}.url repeats an earlier entry's (give it more kinds instead)")
        entries.append(NotifyEntry(index, spec["url"], label, tuple(spec.get("kinds", NOTIFY_DEFAULT_KINDS)),
                                   spec.get("digest"), f"toml-{index}"))
    return tuple(entries)


#: The keys of a [[channels]] entry, each checked; ``kind`` decides which secrets it needs.
CHANNEL_KEYS: dict[str, Callable[[Any], str | None]] = {
    "name": lambda v: None if isinstance(v, str) and re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,62}", v) else
    f"must be a short lowercase name (letters, digits, - and _), not {v!r}",
    "kind": _one_of(*CHANNEL_KINDS), "channel": lambda v: None if isinstance(v, str) and v or (
        isinstance(v, int) and not isinstance(v, bool)) else f"must be a channel or chat id, not {v!r}",
    "task": _text_value, "agent": _text_value, "bot_token": _text_value, "signing_secret": _text_value,
    "secret_token": _text_value}
#: What each kind of channel needs, besides name, kind and channel.
CHANNEL_SECRETS = {"slack": ("signing_secret", "bot_token"), "telegram": ("bot_token", "secret_token")}


def _secret(path: Path, where: str, value: str) -> str:
    """A secret as written, or ``env:NAME`` read from the environment (unset: stop ``serve``)."""
    if not value.startswith("env:"):
        return value
    name = value[4:]
    if not os.environ.get(name):
        raise ConfigError(f"{path}: {where} names ${name}, which is not set (or empty)")
    return os.environ[name]


def channel_entries(path: Path, raw: Any) -> tuple[ChannelEntry, ...]:
    """The ``[[channels]]`` entries, each checked here: a typo, an unknown or missing key stops
    ``serve`` with one line naming it."""
    entries: list[ChannelEntry] = []
    for _, where, spec in _config_tables(path, raw, "channels", CHANNEL_KEYS, "name, kind, channel, task, ..."):
        for key in ("name", "kind", "channel", "task"):
            if key not in spec:
                raise ConfigError(f"{path}: {where}.{key} is missing")
        kind = spec["kind"]
        for key in CHANNEL_SECRETS[kind]:
            if key not in spec:
                raise ConfigError(f"{path}: {where}.{key} is missing (a {kind} channel needs "
                                  f"{' and '.join(CHANNEL_SECRETS[kind])})")
        for key in ("signing_secret", "secret_token"):
            if key in spec and key not in CHANNEL_SECRETS[kind]:
                raise ConfigError(f"{path}: {where}.{key} is not a setting of a {kind} channel")
        if spec["task"] == "create" and "agent" not in spec:
            raise ConfigError(f"{path}: {where}.agent is missing (task \"create\" assigns the channel task to it)")
        if any(e.name == spec["name"] for e in entries):
            raise ConfigError(f"{path}: {where}.name {spec['name']!r} repeats an earlier channel's")
        secrets = {key: _secret(path, f"{where}.{key}", spec[key]) for key in CHANNEL_SECRETS[kind]}
        for key, value in secrets.items():   # it goes into a header or a URL: one visible word
            if not re.fullmatch(r"[\x21-\x7e]{1,512}", value):
                raise ConfigError(f"{path}: {where}.{key} must be one word of visible ASCII (a space, a newline "
                                  "or another character in it: check what you pasted)")
        if kind == "telegram" and not re.fullmatch(r"[A-Za-z0-9_-]{1,256}", secrets["secret_token"]):
            raise ConfigError(f"{path}: {where}.secret_token must be 1-256 of A-Z, a-z, 0-9, _ and - "
                              "(what Telegram's setWebhook accepts)")
        entries.append(ChannelEntry(spec["name"], kind, str(spec["channel"]), spec["task"], spec.get("agent"),
                                    **secrets))
    return tuple(entries)


def load_config(data_dir: Path, *, host: str | None = None, port: int | None = None,
                max_running: int | None = None, database: str | None = None) -> Config:
    """Read ``<data dir>/outpost.toml`` (optional), check every key and type, and merge flags
    over it. The data dir becomes absolute here, whatever directory the caller ran in."""
    data_dir = data_dir.expanduser().absolute()
    raw: dict[str, Any] = {}
    path = data_dir / "outpost.toml"
    if path.exists():
        try:
            raw = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    for section in raw:
        if section not in ("settings", "agents", "notify", "channels"):
            raise ConfigError(f"{path}: [{section}] is not a section Outpost knows "
                              "(known: settings, agents, notify, channels)"
                              f"{did_you_mean(section, ('settings', 'agents', 'notify', 'channels'))}")
    settings = _checked_table(path, "settings", raw.get("settings", {}), SETTINGS_KEYS)
    agents = [demo_profile()]
    profiles = raw.get("agents", {})
    if not isinstance(profiles, dict):
        raise ConfigError(f"{path}: agents must be tables ([agents.NAME])")
    for name, spec in profiles.items():
        profile = agent_profile(path, name, _checked_table(path, f"agents.{name}", spec, AGENT_KEYS))
        agents = [a for a in agents if a.name != name] + [profile]
    env_port = os.environ.get("OUTPOST_PORT")
    if port is None and env_port:
        if not env_port.isdigit() or not 0 <= int(env_port) <= 65535:
            raise ConfigError(f"$OUTPOST_PORT must be a port number, not {env_port!r}")
        port = int(env_port)
    limit = max_running if max_running is not None else settings.get("max_running", DEFAULT_MAX_RUNNING)
    if limit < 1:
        raise ConfigError(f"--max-running must be a whole number >= 1, not {limit}")
    database = database or os.environ.get("OUTPOST_DATABASE_URL") or settings.get("database")
    if database and (problem := _database_url(database)):
        raise ConfigError(f"--database {problem}")
    return Config(data_dir=data_dir, host=host or "127.0.0.1", port=port if port is not None else DEFAULT_PORT,
                  max_running=limit, allowed_hosts=tuple(settings.get("allowed_hosts", ())), agents=tuple(agents),
                  isolate_agents=settings.get("isolate_agents", "auto"), database=database or None,
                  node_name=settings.get("node_name", ""), fleet_max_running=settings.get("fleet_max_running"),
                  metrics_token=settings.get("metrics_token"),
                  notify=notify_entries(path, raw.get("notify", [])),
                  channels=channel_entries(path, raw.get("channels", [])),
                  slack_api_url=settings.get("slack_api_url", SLACK_API_URL).rstrip("/"),
                  telegram_api_url=settings.get("telegram_api_url", TELEGRAM_API_URL).rstrip("/"),
                  keep_days=settings.get("keep_days", DEFAULT_KEEP_DAYS))


def api_token(data_dir: Path, *, create: bool) -> str | None:
    """$OUTPOST_API_TOKEN, else ``<data dir>/api-token`` (made 0600 on first start)."""
    if os.environ.get("OUTPOST_API_TOKEN"):
        return os.environ["OUTPOST_API_TOKEN"]
    path = data_dir / "api-token"
    if path.exists():
        return path.read_text().strip()
    if not create:
        return None
    data_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


#: Where a running ``serve`` records the address it bound, for the CLI (``daemon_url``).
SERVE_FILE = "serve.json"


def record_address(data_dir: Path, url: str) -> None:
    """``<data dir>/serve.json`` (0600, replaced whole): the URL this ``serve`` is bound to,
    with its pid, written once bound so that a CLI without --url finds it on any port."""
    path = data_dir / SERVE_FILE
    temp = path.with_name(f".{SERVE_FILE}.{os.getpid()}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "pid": os.getpid()}, f)
    os.replace(temp, path)


def forget_address(data_dir: Path) -> None:
    """At stop: the address goes, unless another ``serve`` of this data dir has recorded its own."""
    with contextlib.suppress(OSError, ValueError):
        path = data_dir / SERVE_FILE
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


def recorded_address(data_dir: Path) -> str | None:
    """The URL a live ``serve`` of this data dir recorded, reachable from this machine (a
    wildcard bind is asked on loopback); None when there is none or its process is gone."""
    try:
        recorded = json.loads((data_dir / SERVE_FILE).read_text())
        url, pid = recorded["url"], recorded["pid"]
        if not isinstance(url, str) or not url.startswith(("http://", "https://")) or not isinstance(pid, int):
            return None
        os.kill(pid, 0)
    except PermissionError:   # alive, as another user
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    parts = urllib.parse.urlsplit(url)
    host = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(parts.netloc.rsplit(":", 1)[0])
    return parts._replace(netloc=f"{host}:{parts.port}").geturl() if host else url


def daemon_url(data_dir: Path, url: str | None) -> str:
    """Where the CLI finds the daemon: --url, else $OUTPOST_PORT on 127.0.0.1, else the
    address the running ``serve`` of this data dir recorded, else http://127.0.0.1:8321."""
    if url:
        if not re.match(r"https?://", url):
            raise CliError(f"--url {url!r} needs its scheme: http://{url}", EXIT_USAGE)
        return url
    if os.environ.get("OUTPOST_PORT"):
        return f"http://127.0.0.1:{os.environ['OUTPOST_PORT']}"
    return recorded_address(data_dir) or f"http://127.0.0.1:{DEFAULT_PORT}"


###############################################################################
# 5. Schedules and runs, the domain: instants, timing and the DST rules, definitions,
#    naming and outcomes. Pure: no I/O, no trio, no clock reads.
###############################################################################

def sql_tuple(values: Iterable[str]) -> str:
    """``('a', 'b')``: the values of a raw SQL ``IN``, written into its text (our own constants, never input)."""
    return "(" + ", ".join(f"'{value}'" for value in values) + ")"


class RunStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    NEEDS_YOU = "needs_you"
    CANCELLED = "cancelled"


#: What made a run: a schedule's timing, a person, a re-run or reply, a dispatch, an Office wakeup.
RUN_TRIGGERS = ("cron", "interval", "once", "manual", "catch_up", "dispatch", "rerun", "reply", "wakeup")

#: A run in one of these states is over.
SETTLED_RUN_STATUSES = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.NEEDS_YOU, RunStatus.CANCELLED)
#: A schedule whose run is in one of these states is "active" for the overlap rules.
ACTIVE_RUN_STATUSES = (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.PAUSED)
#: The same, for raw SQL: ``status IN (...)``.
ACTIVE_RUN_SQL = sql_tuple(ACTIVE_RUN_STATUSES)
#: The error of a run whose daemon stopped or died under it (not the agent's failure).
INTERRUPTED = "interrupted"


class SlotOutcome(enum.StrEnum):
    """What became of one due slot of a schedule: the slot ledger."""
    ADMITTED = "admitted"                 # a run was queued for it
    SKIPPED_OVERLAP = "skipped_overlap"   # skip_if_active and a run was active
    COALESCED = "coalesced"               # coalesce_if_active: merged into the active run
    FOLDED = "folded"                     # missed during downtime, counted into a catch-up
    SKIPPED_MISSED = "skipped_missed"     # missed during downtime under skip_missed
    PAUSED = "paused"                     # the schedule was paused when it came due
    HELD_RECONFIRM = "held_reconfirm"     # its agent profile changed since it was confirmed
    SKIPPED_UNCHANGED = "skipped_unchanged"   # skip_if_unchanged: the commit of its last success
    PENDING_CATCH_UP = "pending_catch_up"     # catch_up ask: missed, waiting for a human's decision


CONCURRENCY_POLICIES = ("skip_if_active", "coalesce_if_active", "always_enqueue")
#: A schedule's states, as the schedules list filters them.
SCHEDULE_STATES = ("enabled", "paused", "auto_paused", "archived")
#: Control actions of a schedule that change its state (``fire`` is the other one).
SCHEDULE_ACTIONS = ("enable", "pause", "resume", "archive", "approve_catch_up", "dismiss_catch_up")
CATCH_UP_POLICIES = ("enqueue_missed_with_cap", "skip_missed", "ask")
NOTIFY_POLICIES = ("attention", "failures_only", "always")
#: Attention kinds a schedule's ``mute`` may stop for it (a question waiting for you is never muted).
MUTABLE_ATTENTION_KINDS = ("changes_returned", "succeeded", "failed", "missed_fire")
#: Kinds that fold: while one is open for a schedule or an Office agent, the next of its kind counts
#: on it instead of making a second item (the README's 5-minute example made 288 a day).
FOLDED_ATTENTION_KINDS = ("changes_returned", "succeeded", "failed", "missed_fire", "agent_error")
#: The runs a folded item lists, newest first.
FOLDED_RUNS_MAX = 100
#: The policies in the compose form's words: its menus, the summary compose answers and every
#: page that shows a definition (review, the schedule, a proposal) say them so.
POLICY_WORDS = {
    "concurrency_policy": {"skip_if_active": "skip the new fire", "coalesce_if_active": "fold it into the active run",
                           "always_enqueue": "queue another run"},
    "catch_up": {"enqueue_missed_with_cap": "catch up (missed fires fold into runs)",
                 "skip_missed": "skip what was missed", "ask": "ask me first"},
    "notify": {"attention": "changes, failures, needs-you", "failures_only": "failures and needs-you only",
               "always": "every run"},
}


class ProposalState(enum.StrEnum):
    """A schedule change a proposer key asked for (docs/agent-clis.md), as a human decided it."""
    PENDING = "pending"
    CONFIRMED = "confirmed"
    DECLINED = "declined"
    STALE = "stale"   # undecided for PROPOSAL_TTL_S, or its schedule moved on before it was confirmed


CRON_ALIASES = {"@hourly": "0 * * * *", "@daily": "0 0 * * *", "@weekly": "0 0 * * 0",
                "@monthly": "0 0 1 * *", "@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *"}
DEFINITION_FIELDS = ("name", "brief", "repository", "workdir", "source_ref", "agent", "timing",
                     "limits", "notify", "concurrency_policy", "catch_up", "skip_if_unchanged", "mute")


# --- instants ----------------------------------------------------------------

def parse_instant(text: str, tz: ZoneInfo | None = None) -> datetime:
    """ISO 8601 -> aware datetime; without an offset it is wall time in ``tz`` (gap rule applied)."""
    dt = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    if dt.tzinfo is not None:
        return dt
    if tz is None:
        raise ValueError("needs an offset")
    instants = wall_instants(dt, tz, follow_real_time=False)
    return instants[0]


def zone(name: Any, field: str = "timing.timezone") -> ZoneInfo:
    if not isinstance(name, str) or not name:
        raise invalid(field, "an IANA timezone name is required, e.g. Europe/Berlin")
    try:
        if len(name) > 64:
            raise ValueError(name)
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):   # OSError: "Europe" is a folder of zones
        raise invalid(field, zone_problem(name)) from None


# --- timing: cron / interval / once, with the DST rules -------------------------

def _gap_end(wall: datetime, tz: ZoneInfo) -> datetime:
    """First instant after the DST gap that swallows ``wall`` (a wall time that does not exist)."""
    lo = int(wall.replace(tzinfo=tz, fold=1).timestamp())   # offset after the gap: earlier instant
    hi = int(wall.replace(tzinfo=tz, fold=0).timestamp())   # offset before the gap: later instant
    after = wall.replace(tzinfo=tz, fold=0).astimezone(UTC).astimezone(tz).utcoffset()
    while lo < hi:
        mid = (lo + hi) // 2
        if datetime.fromtimestamp(mid, tz).utcoffset() == after:
            hi = mid
        else:
            lo = mid + 1
    return datetime.fromtimestamp(lo, tz)


def wall_instants(wall: datetime, tz: ZoneInfo, *, follow_real_time: bool) -> list[datetime]:
    """The instants a naive wall time stands for in ``tz``, by the DST rules of docs/schedules.md.

    A time in a gap fires once at the first instant after the gap; a repeated time fires
    at its first occurrence. Jobs that follow real time (the cron's hour field is ``*``)
    instead skip the gap and fire in both copies of a repeated hour."""
    first = wall.replace(tzinfo=tz, fold=0)
    second = wall.replace(tzinfo=tz, fold=1)
    if first.utcoffset() == second.utcoffset():
        return [first]
    exists = first.astimezone(UTC).astimezone(tz).replace(tzinfo=None) == wall
    if exists:   # repeated: fold=0 is the first copy
        return [first, second] if follow_real_time else [first]
    return [] if follow_real_time else [_gap_end(wall, tz)]


#: The five cron fields: name, lowest and highest value, the names a value may have (lower case).
CRON_FIELDS = (("minute", 0, 59, ()), ("hour", 0, 23, ()), ("day-of-month", 1, 31, ()),
               ("month", 1, 12, ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")),
               ("day-of-week", 0, 6, ("sun", "mon", "tue", "wed", "thu", "fri", "sat")))


def reversed_cron_range(text: str) -> str | None:
    """Why a five-field cron is refused for a range whose start comes after its end (``23-3``,
    ``sat-tue/2``), or None. Vixie cron and cronie refuse them too; croniter would accept them
    and fire at times the range does not mean. The message names the values it reads as."""
    for item_field, (name, lo, hi, names) in zip(text.split(" "), CRON_FIELDS, strict=True):
        for item in item_field.split(","):
            m = re.fullmatch(r"(\w+)-(\w+)(?:/(\d+))?", item)
            if not m:
                continue
            bounds = [lo + names.index(w.lower()) if w.lower() in names else int(w) if w.isdigit() else None
                      for w in m.group(1, 2)]
            start, end = bounds
            if start is None or end is None or not lo <= end < start <= hi + 1:   # in order, or not ours to judge
                continue
            step = int(m[3] or 1)
            if start > hi:   # day-of-week 7 is Sunday, 0
                instead = f"{lo}-{end}" + (f"/{step}" if m[3] else "")
            elif step == 1:
                instead = ",".join(f"{a}-{b}" if a < b else f"{a}" for a, b in ((start, hi), (lo, end)))
            else:   # the values a wrapping range would mean: from start up to the field's end, then on to end
                values, value, wrapped = [], start, False
                while not wrapped or value <= end:
                    values.append(value)
                    value += step
                    if value > hi:
                        if wrapped:
                            break
                        value, wrapped = value - (hi - lo + 1), True
                instead = ",".join(map(str, sorted(values)))
            return (f"the {name} range {item} is reversed ({m[1]} comes after {m[2]}): cron does not wrap "
                    f"around the end of the {name} field; write {instead} instead")
    return None


def cron_value_problems(text: str) -> list[str]:
    """Each value of a five-field cron outside its field's range, named by its field ("minute 61 is
    out of range 0-59"), and each name in a field that takes none: what croniter says only as a
    bare number."""
    problems = []
    for item_field, (name, lo, hi, names) in zip(text.split(" "), CRON_FIELDS, strict=True):
        top = 7 if name == "day-of-week" else hi   # 7 is Sunday too
        for item in item_field.split(","):
            base, _, step = item.partition("/")
            for value in base.split("-") if base != "*" else ():
                if value.isascii() and value.isdigit() and not lo <= int(value) <= top:   # "²" is a digit to isdigit
                    problems.append(f"{name} {value} is out of range {lo}-{hi}")
                elif value.isalpha() and value.lower() not in names:
                    takes = f"takes {names[0]}-{names[-1]} or {lo}-{hi}" if names else f"takes numbers {lo}-{hi}"
                    problems.append(f"{name} {value!r} is not a value of that field (it {takes})")
            if step.isascii() and step.isdigit() and not 1 <= int(step) <= hi - lo + 1:
                problems.append(f"{name} step /{step} is out of range 1-{hi - lo + 1}")
    return problems


def cron_expression(expr: str) -> str:
    """Normalize a five-field cron or an @alias; raise ValidationFailed otherwise."""
    if not isinstance(expr, str) or not expr.strip():
        raise invalid("timing.expression", "a five-field cron expression is required")
    text = " ".join(expr.split())
    if len(text) > 200:
        raise invalid("timing.expression", "is longer than 200 characters")
    names = {"jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
             "sun", "mon", "tue", "wed", "thu", "fri", "sat"}
    if not text.startswith("@") and any(word.lower() not in names for word in re.findall(r"[A-Za-z]+", text)):
        raise invalid("timing.expression", "use numbers, * / , - and month or weekday names only "
                      "(random R, hashed H and L/W/# fields are not supported)")
    if text.startswith("@"):
        if text == "@reboot" or text not in CRON_ALIASES:
            raise invalid("timing.expression", f"{text} is not supported; use five fields or "
                          "@hourly, @daily, @weekly, @monthly, @yearly")
        return text
    if len(text.split(" ")) != 5:
        raise invalid("timing.expression", "must have exactly five fields "
                      "(minute hour day-of-month month day-of-week)")
    if problems := cron_value_problems(text):
        raise invalid("timing.expression", "; ".join(problems))
    if problem := reversed_cron_range(text):
        raise invalid("timing.expression", problem)
    try:
        croniter(text)
    except (CroniterBadCronError, ValueError, KeyError) as exc:
        raise invalid("timing.expression", f"not a valid cron expression: {exc}") from None
    return text


def _cron_fields(expr: str) -> list[str]:
    return CRON_ALIASES.get(expr, expr).split(" ")


def follows_real_time(expr: str) -> bool:
    """Hourly or finer crons (hour field ``*``) follow real time across DST changes."""
    return _cron_fields(expr)[1] == "*"


def _cron_walk(expr: str, tz: ZoneInfo, after: datetime) -> Iterator[datetime]:
    """The fires of a cron strictly after ``after`` (UTC, in order, never two at one instant),
    lazily, in one croniter walk: a caller takes as many as it needs."""
    real_time = follows_real_time(expr)
    # Start a few hours early in wall time: the second copy of a repeated hour maps
    # to instants that a naive walk from wall(after) would place before ``after``.
    start = (after.astimezone(tz) - timedelta(hours=3)).replace(tzinfo=None)
    walk = croniter(CRON_ALIASES.get(expr, expr), start)
    pending: list[datetime] = []   # a heap: instants found, not yet known to be the next
    last = None
    while True:
        try:
            wall = walk.get_next(datetime)
        except CroniterBadDateError:
            break
        for instant in wall_instants(wall, tz, follow_real_time=real_time):
            if instant > after:
                heapq.heappush(pending, instant.astimezone(UTC))
        # No later wall can map to an instant more than 3 h of wall time before itself.
        while pending and wall - timedelta(hours=3) > pending[0].astimezone(tz).replace(tzinfo=None):
            if (fire := heapq.heappop(pending)) != last:
                yield fire
                last = fire
    while pending:
        if (fire := heapq.heappop(pending)) != last:
            yield fire
            last = fire


def _cron_fires(expr: str, tz: ZoneInfo, after: datetime, count: int) -> list[datetime]:
    return list(itertools.islice(_cron_walk(expr, tz, after), count))


def next_fires(timing: dict[str, Any], after: datetime, count: int = 1,
               *, anchor: datetime | None = None) -> list[datetime]:
    """The next ``count`` due instants (UTC) strictly after ``after``.

    ``anchor`` is when an interval schedule was created: it fires at anchor + k*seconds."""
    kind = timing["kind"]
    if kind == "cron":
        return _cron_fires(timing["expression"], ZoneInfo(timing["timezone"]), after, count)
    if kind == "interval":
        step = timing["seconds"]
        base = anchor or after
        k = max(1, math.floor((after - base).total_seconds() / step) + 1)
        fires = [base + timedelta(seconds=step * (k + i)) for i in range(count + 1)]
        return [f.astimezone(UTC) for f in fires if f > after][:count]
    at = parse_instant(timing["at"])
    return [at.astimezone(UTC)] if at > after else []


#: The most fires of one schedule or routine trigger the upcoming list shows: a minutely cron's
#: week (docs/http-api.md); past it the list names the schedule in ``cut``.
UPCOMING_MAX_EACH = 10_080


def fires_until(timing: dict[str, Any], after: datetime, until: datetime, cap: int, *,
                anchor: datetime | None = None) -> list[datetime]:
    """The due instants strictly after ``after`` up to ``until``, at most ``cap``, walked only as
    far as ``until``: a yearly cron costs one step, not ``cap`` years."""
    if timing["kind"] == "cron":
        walk = _cron_walk(timing["expression"], ZoneInfo(timing["timezone"]), after)
        return list(itertools.islice(itertools.takewhile(lambda at: at <= until, walk), cap))
    if timing["kind"] == "interval":
        count = min(cap, int((until - after).total_seconds() // timing["seconds"]) + 1)
        return [at for at in next_fires(timing, after, max(count, 1), anchor=anchor) if at <= until]
    return [at for at in next_fires(timing, after, 1) if at <= until]


def upcoming_fires(timing: dict[str, Any], next_at: datetime | None, now: datetime, until: datetime, *,
                   paused: bool, anchor: datetime | None = None,
                   cap: int = UPCOMING_MAX_EACH) -> list[tuple[datetime, str]]:
    """The due instants of one timing up to ``until``, each ``scheduled``, ``late`` (its stored next
    fire passed more than MISFIRE_GRACE_S ago and nobody claimed it: the cron actor is behind or
    down) or ``paused`` (counted on from now: a paused schedule's slots wait unclaimed)."""
    if paused:
        return [(at, "paused") for at in fires_until(timing, now, until, cap, anchor=anchor)]
    if next_at is None:
        return []   # a once schedule that fired
    fires, grace = [], now - timedelta(seconds=MISFIRE_GRACE_S)
    if next_at < grace:
        fires.append((next_at, "late"))
    after = max(grace, next_at - timedelta(microseconds=1))
    fires += [(at, "scheduled") for at in fires_until(timing, after, until, cap - len(fires), anchor=anchor)]
    return fires


@dataclasses.dataclass(frozen=True, slots=True)
class FireSource:
    """A schedule, or a routine's schedule trigger, as the upcoming list reads it."""
    kind: str                      # schedule | routine
    id: str
    name: str
    timezone: str
    timing: dict[str, Any]
    next_at: datetime | None       # its stored next fire
    paused: bool
    anchor: datetime | None = None


def upcoming_list(sources: Iterable[FireSource], now: datetime, days: int) -> dict[str, Any]:
    """docs/http-api.md: every fire of ``sources`` in the next ``days`` days in time order (ties by
    id), and ``cut``: the ids whose fires stopped at UPCOMING_MAX_EACH. Pure: the web layer runs it
    on a worker thread, away from the store and the event loop."""
    until, fires, cut = now + timedelta(days=days), [], set()
    for src in sources:
        mine = upcoming_fires(src.timing, src.next_at, now, until, paused=src.paused, anchor=src.anchor,
                              cap=UPCOMING_MAX_EACH + 1)   # one more: whether there were more
        if len(mine) > UPCOMING_MAX_EACH:
            cut.add(src.id)
            del mine[UPCOMING_MAX_EACH:]
        fires += [{"at": at, "kind": src.kind, "id": src.id, "name": src.name, "timezone": src.timezone,
                   "state": state} for at, state in mine]
    fires.sort(key=lambda f: (f["at"], f["id"]))
    return {"fires": [{**f, "at": rfc3339(f["at"])} for f in fires], "cut": sorted(cut)}


@dataclasses.dataclass(frozen=True, slots=True)
class DueSlots:
    """The due instants of a schedule in [first due, now]: how many (``counted_all`` false:
    more than ``count``, counting stopped at its cap) and the newest of them, in order."""
    count: int
    recent: list[datetime]
    counted_all: bool = True


def due_slots(timing: dict[str, Any], first_due: datetime, now: datetime,
              *, anchor: datetime | None, keep: int = LEDGER_KEEP) -> DueSlots:
    """The slots due in [first_due, now], bounded whatever the downtime: an interval counts
    by arithmetic; a cron counts up to MISSED_COUNT_CAP slots, then takes its newest ``keep``
    from a window that ends at ``now`` (a year of a per-minute cron costs two short walks)."""
    if first_due > now:
        return DueSlots(0, [])
    if timing["kind"] == "once":
        return DueSlots(1, [first_due])
    if timing["kind"] == "interval":
        step, base = timedelta(seconds=timing["seconds"]), anchor or first_due
        first, last = (first_due - base) // step, (now - base) // step
        return DueSlots(last - first + 1, [(base + k * step).astimezone(UTC)
                                           for k in range(max(first, last - keep + 1), last + 1)])
    expr, tz = timing["expression"], ZoneInfo(timing["timezone"])
    count, recent = 0, collections.deque(maxlen=keep)
    for slot in _cron_walk(expr, tz, first_due - timedelta(microseconds=1)):
        if slot > now:
            return DueSlots(count, list(recent))
        count += 1
        recent.append(slot)
        if count == MISSED_COUNT_CAP:
            break
    else:   # the cron has no later fire at all
        return DueSlots(count, list(recent))
    gap = (recent[-1] - first_due) / (count - 1)
    width = gap * keep * 3 // 2
    while True:   # the newest slots: a window ending at now, wide enough for ``keep`` of them
        begin = max(recent[-1], now - width)
        window = list(itertools.takewhile(lambda t: t <= now, _cron_walk(expr, tz, begin)))
        if len(window) >= keep or begin == recent[-1]:
            break
        width *= 4
    seen = count + len(window)
    return DueSlots(seen, (list(recent) + window)[-keep:], counted_all=begin == recent[-1])


def dst_transitions(tz: ZoneInfo, start: datetime, days: int) -> list[datetime]:
    """Instants in [start, start+days) at which ``tz`` changes its UTC offset."""
    found = []
    t = int(start.timestamp())
    end = t + days * DAY_S
    while t < end:
        nxt = min(t + DAY_S, end)
        if datetime.fromtimestamp(t, tz).utcoffset() != datetime.fromtimestamp(nxt, tz).utcoffset():
            lo, hi = t, nxt
            before = datetime.fromtimestamp(t, tz).utcoffset()
            while lo < hi:
                mid = (lo + hi) // 2
                if datetime.fromtimestamp(mid, tz).utcoffset() == before:
                    lo = mid + 1
                else:
                    hi = mid
            found.append(datetime.fromtimestamp(lo, UTC))
        t = nxt
    return found


def _hhmm(dt: datetime) -> str:
    return dt.strftime("%H:%M")


def dst_warnings(timing: dict[str, Any], now: datetime) -> list[str]:
    """One sentence per DST transition in the next 12 months that moves or drops a fire."""
    tz = ZoneInfo(timing["timezone"])
    name = timing["timezone"]
    warnings = []
    for change in dst_transitions(tz, now, DST_HORIZON_DAYS):
        before = (change - timedelta(seconds=1)).astimezone(tz).replace(tzinfo=None)
        after = change.astimezone(tz).replace(tzinfo=None)
        if timing["kind"] == "once":
            continue
        if timing["kind"] == "interval":
            if timing["seconds"] % HOUR_S == 0 and timing["seconds"] >= DAY_S:
                warnings.append(f"On {after:%Y-%m-%d} {name} changes its clocks; this interval follows "
                                "real time, so its fires move by the change in local time.")
            continue
        expr = timing["expression"]
        real_time = follows_real_time(expr)
        gap = after > before
        # Wall times inside the gap, or inside the repeated hour: lo < wall < hi.
        lo, hi = (before, after) if gap else (after - timedelta(seconds=1), before + timedelta(seconds=1))
        walk = croniter(CRON_ALIASES.get(expr, expr), lo)
        walls = []
        while (wall := walk.get_next(datetime)) < hi:
            walls.append(wall)
        if not walls:
            continue
        when = (f"{walls[0]:%Y-%m-%d %H:%M}" if len(walls) == 1 else
                f"{walls[0]:%Y-%m-%d} {len(walls)} fires from {_hhmm(walls[0])} to {_hhmm(walls[-1])}")
        verb = ("does not exist" if len(walls) == 1 else "do not exist") if gap else (
            "occurs twice" if len(walls) == 1 else "occur twice")
        if gap and real_time:
            outcome = "firing every hour or more often, it follows real time and skips the missing hour"
        elif gap:
            outcome = f"that day it fires once, at {_hhmm(after)}"
        elif real_time:
            outcome = "firing every hour or more often, it follows real time and fires in both copies"
        else:
            outcome = "it fires once, at the first"
        warnings.append(f"{when} {verb} in {name} (clocks change); {outcome}.")
    return warnings


def once_warnings(requested: Any) -> list[str]:
    """A once-fire asked for as wall time (no offset) that a DST change moves: normalization
    keeps only the instant, so the sentence comes from what the user wrote."""
    if not isinstance(requested, dict) or requested.get("kind") != "once":
        return []
    try:
        wall = datetime.fromisoformat(str(requested.get("at", "")).strip())
        tz = ZoneInfo(str(requested.get("timezone")))
    except (ValueError, ZoneInfoNotFoundError):
        return []
    if wall.tzinfo is not None:
        return []
    first, second = wall.replace(tzinfo=tz, fold=0), wall.replace(tzinfo=tz, fold=1)
    if first.utcoffset() == second.utcoffset():
        return []
    if wall_instants(wall, tz, follow_real_time=True):   # it exists: twice
        return [f"{wall:%Y-%m-%d %H:%M} occurs twice in {tz.key} (clocks change); it fires once, at the first."]
    fires = _gap_end(wall, tz)
    return [f"{wall:%Y-%m-%d %H:%M} does not exist in {tz.key} (clocks change); that day it fires once, "
            f"at {_hhmm(fires)}."]


def timing_warnings(timing: dict[str, Any], now: datetime, requested: Any = None) -> list[str]:
    """Sentences a human should read before confirming. ``requested`` is the timing as sent
    (a once-fire's wall time is only there)."""
    warnings = dst_warnings(timing, now) + once_warnings(requested)
    if timing["kind"] == "cron":
        fields = _cron_fields(timing["expression"])
        if fields[2] != "*" and fields[4] != "*":
            warnings.append("Both day-of-month and day-of-week are restricted: cron fires when "
                            "EITHER matches, not only when both do.")
    if timing["kind"] == "interval" and timing["seconds"] < SHORT_INTERVAL_S:
        warnings.append(f"An interval of {timing['seconds']} s is shorter than a typical agent run; "
                        "fires that find the previous run still active follow the concurrency policy.")
    return warnings


# --- definitions: validation, normalization, confirmation ------------------------

class FieldErrors:
    """Validation that goes on past a field's error, so a form shows every error at once:
    each ``with errors.check():`` block records its ValidationFailed; ``raise_any`` raises
    them together (the first one's text first, as a single error reads)."""

    def __init__(self):
        self.errors: list[dict[str, str]] = []

    @contextlib.contextmanager
    def check(self) -> Iterator[None]:
        try:
            yield
        except ValidationFailed as err:
            self.errors.extend(err.errors or [{"field": "definition", "message": err.detail}])

    def raise_any(self) -> None:
        if self.errors:
            raise ValidationFailed("; ".join(f"{e['field']}: {e['message']}" for e in self.errors),
                                   errors=self.errors)


def _text(d: dict, key: str, lo: int, hi: int, default: str | None = None, *, single_line: bool = False) -> str:
    value = d.get(key, default)
    if not isinstance(value, str):
        raise invalid(key, "must be a string")
    if not lo <= len(value) <= hi:
        raise invalid(key, f"must be {lo}-{hi} characters long")
    if single_line and any(is_control(c) for c in value):
        raise invalid(key, "must not contain control characters (escapes, line breaks)")
    return value


def is_control(char: str) -> bool:
    """A character a terminal acts on rather than prints: C0 (ESC, NUL, newlines), DEL, C1
    (CSI, NEL) and the Unicode line and paragraph separators."""
    return ord(char) < 32 or 127 <= ord(char) < 160 or char in "\u2028\u2029"


def _unknown(raw: dict, fields: Iterable[str], what: str, prefix: str = "") -> None:
    """Refuse every field that is not one of ``fields``, each with the known one it is closest to."""
    errors = FieldErrors()
    for name in sorted(set(raw) - set(fields), key=str):
        with errors.check():
            raise invalid(f"{prefix}{name}", f"is not a field of {what}{did_you_mean(str(name), fields)}")
    errors.raise_any()


#: The longest notification URL the dashboard takes (Apprise URLs with a token are ~200).
NOTIFY_URL_MAX = 2000
#: The most items one bulk action (runs cancelled or re-run, attention acknowledged) takes at once.
BULK_MAX = 200


def selected_ids(raw: Any) -> list[str]:
    """A bulk action's ``{"ids": [...]}``: 1-BULK_MAX ids, each once, in the order given."""
    if not isinstance(raw, dict):
        raise invalid("body", "must be a JSON object with ids")
    _unknown(raw, ("ids",), "a bulk action")
    ids = raw.get("ids")
    if not isinstance(ids, list) or not 1 <= len(ids) <= BULK_MAX:
        raise invalid("ids", f"a list of 1-{BULK_MAX} ids is required")
    if not all(isinstance(i, str) and 0 < len(i) <= 100 for i in ids):
        raise invalid("ids", "every id must be a string of 1-100 characters")
    return list(dict.fromkeys(ids))


#: A repository named by URL (docs/fleet.md): https://, ssh://, file:// or scp-like user@host:path.
REPOSITORY_URL = re.compile(r"^(?:(?:https|ssh|file)://\S+|[\w.-]+@[\w.-]+:(?!//)\S+)$")


def is_repository_url(repository: str) -> bool:
    return bool(REPOSITORY_URL.match(repository))


def _repository(d: dict) -> str:
    """An absolute path, normalized, or a git URL; whether it is a git repository is asked of git."""
    repo = _text(d, "repository", 1, 4096, single_line=True)
    if is_repository_url(repo):
        if repo.startswith("https://") and "@" in urllib.parse.urlsplit(repo).netloc or (
                repo.startswith("ssh://") and urllib.parse.urlsplit(repo).password):
            raise invalid("repository", "must not hold a password or token: git reads credentials from the "
                                        "service user's configuration (a credential helper, ~/.ssh), never the URL")
        return repo
    if not os.path.isabs(repo):
        raise invalid("repository", "must be an absolute path or a git URL (https://, ssh://, user@host:path, "
                                    "file://)")
    return os.path.normpath(repo)


def _source_ref(d: dict) -> str:
    """A branch, tag or commit name, never one git could read as an option."""
    ref = _text(d, "source_ref", 1, 255, "HEAD")
    if ref.startswith("-") or any(c.isspace() or ord(c) < 32 for c in ref):
        raise invalid("source_ref", "must be a branch, tag or commit (not starting with '-')")
    return ref


def _check_unicode(value: Any, path: str) -> None:
    """Refuse unpaired surrogates (valid JSON escapes, not text) before anything hashes them."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            raise invalid(path or "body", "contains an unpaired UTF-16 surrogate; send valid Unicode") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, path)
            _check_unicode(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for item in value:
            _check_unicode(item, path)


def _object(raw: dict, key: str) -> dict:
    """An optional object field: absent or null means its defaults; anything else must be an object."""
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(key, "must be an object")
    return value


def _int(value: Any, field: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(field, "must be a whole number")
    if not lo <= value <= hi:
        raise invalid(field, f"must be between {lo} and {hi}")
    return value


def interval_hint(timing: dict[str, Any]) -> str:
    """What an interval written as a duration (``every = "6h"``) should say instead: its seconds."""
    for key in ("every", "interval", "duration", "period"):
        if isinstance(timing.get(key), str) and (seconds := _duration_s(timing[key])) >= 1:
            return f": an interval is given in seconds; use seconds = {int(seconds)} ({timing[key]})"
    return ": an interval is given in seconds (seconds = 3600 is an hour)" if "seconds" not in timing else ""


def normalize_timing(timing: Any, now: datetime, *, check_past: bool) -> dict[str, Any]:
    """One timing, every field's error at once (a wrong timezone and a wrong expression together)."""
    if not isinstance(timing, dict):
        raise invalid("timing", 'must be an object with "kind" cron, interval or once')
    kind = timing.get("kind")
    errors = FieldErrors()
    with errors.check():
        tz = zone(timing.get("timezone"))
    allowed = {"cron": ("kind", "expression", "timezone"), "interval": ("kind", "seconds", "timezone"),
               "once": ("kind", "at", "timezone")}
    if not isinstance(kind, str) or kind not in allowed:
        errors.errors.append({"field": "timing.kind", "message": "must be cron, interval or once"
                              + (did_you_mean(kind, allowed) if isinstance(kind, str) else "")})
        errors.raise_any()
    hint = interval_hint(timing) if kind == "interval" else ""
    with errors.check():
        _unknown(timing, allowed[kind], f"{kind} timing{hint}", "timing.")
    if kind == "cron":
        with errors.check():
            expr = cron_expression(timing.get("expression"))
        errors.raise_any()
        normalized = {"kind": "cron", "expression": expr, "timezone": tz.key}
        if not next_fires(normalized, now, 1):
            raise invalid("timing.expression", "never fires")
        return normalized
    if kind == "interval":
        if "seconds" in timing:
            with errors.check():
                value = timing.get("seconds")
                if isinstance(value, str) and (written := _duration_s(value)) >= 1:   # "6h": say it in seconds
                    raise invalid("timing.seconds", f"must be a whole number of seconds: use {int(written)} ({value})")
                seconds = _int(value, "timing.seconds", 10, 31622400)
        elif not set(timing) - set(allowed[kind]):   # else the unknown field's error says what to write
            errors.errors.append({"field": "timing.seconds", "message": "is required: the interval in seconds "
                                                                        "(3600 is an hour)"})
        errors.raise_any()
        return {"kind": "interval", "seconds": seconds, "timezone": tz.key}
    with errors.check():   # read as UTC while the timezone is refused: its own error is still told
        instant = once_instant(timing.get("at"), tz if not errors.errors else UTC, now, check_past=check_past)
    errors.raise_any()
    return {"kind": "once", "at": instant.astimezone(tz).isoformat(), "timezone": tz.key}


def once_instant(at: Any, tz: ZoneInfo, now: datetime, *, check_past: bool) -> datetime:
    """A once-timing's ``at``: an ISO 8601 instant, or wall time in ``tz``."""
    if not isinstance(at, str):
        raise invalid("timing.at", "an ISO 8601 date and time is required")
    try:
        instant = parse_instant(at, tz)
        if not 1970 <= instant.astimezone(UTC).year <= MAX_YEAR:
            raise OverflowError(at)
    except ValueError:
        raise invalid("timing.at", f"{at[:40]!r} is not an ISO 8601 date and time") from None
    except OverflowError:
        raise invalid("timing.at", f"must be between 1970 and {MAX_YEAR}") from None
    if check_past and instant <= now:
        raise invalid("timing.at", "is in the past")
    return instant


def normalize_definition(raw: Any, now: datetime, *, agents: Iterable[str],
                         check_past: bool = True) -> dict[str, Any]:
    """Validate a schedule definition (docs/schedules.md) and fill its defaults; every field's error
    at once. Pure: the git checks (repository, source_ref) are the store/executor's, see
    ``check_repository``."""
    if not isinstance(raw, dict):
        raise invalid("definition", "must be a JSON object")
    _check_unicode(raw, "")
    d: dict[str, Any] = {}
    errors = FieldErrors()
    with errors.check():
        _unknown(raw, DEFINITION_FIELDS, "a schedule definition")
    with errors.check():
        d["name"] = _text(raw, "name", 1, 100, single_line=True).strip()
        if not d["name"]:
            raise invalid("name", "must not be blank")
    with errors.check():
        d["brief"] = _text(raw, "brief", 1, 32768)
    with errors.check():
        d["repository"] = _repository(raw)
    with errors.check():
        workdir = _text(raw, "workdir", 1, 4096, ".", single_line=True)
        if os.path.isabs(workdir) or ".." in Path(workdir).parts:
            raise invalid("workdir", "must be a relative path without '..'")
        d["workdir"] = os.path.normpath(workdir)
    with errors.check():
        d["source_ref"] = _source_ref(raw)
    with errors.check():
        agent = raw.get("agent", "demo")
        if not isinstance(agent, str) or agent not in set(agents):
            raise invalid("agent", f"no agent profile named {str(agent)[:60]!r}; known: {', '.join(sorted(agents))}")
        d["agent"] = agent
    with errors.check():
        d["timing"] = normalize_timing(raw.get("timing"), now, check_past=check_past)
    with errors.check():
        d["limits"] = normalize_limits(_object(raw, "limits"))
    with errors.check():
        d["notify"] = raw.get("notify", "attention")
        if not isinstance(d["notify"], str) or d["notify"] not in NOTIFY_POLICIES:
            raise invalid("notify", "must be attention, failures_only or always")
    with errors.check():
        d["concurrency_policy"] = raw.get("concurrency_policy", "skip_if_active")
        if not isinstance(d["concurrency_policy"], str) or d["concurrency_policy"] not in CONCURRENCY_POLICIES:
            raise invalid("concurrency_policy", "must be " + ", ".join(CONCURRENCY_POLICIES))
    with errors.check():
        d["catch_up"] = normalize_catch_up(_object(raw, "catch_up") or {"policy": "enqueue_missed_with_cap", "max": 1})
    skip = raw.get("skip_if_unchanged", False)
    with errors.check():
        if not isinstance(skip, bool):
            raise invalid("skip_if_unchanged", "must be true or false")
    mute = raw.get("mute", [])
    with errors.check():
        if not isinstance(mute, list) or not all(isinstance(k, str) and k in MUTABLE_ATTENTION_KINDS for k in mute):
            raise invalid("mute", "must be a list of attention kinds: " + ", ".join(MUTABLE_ATTENTION_KINDS)
                          + " (a question waiting for you is never muted)")
    errors.raise_any()
    if skip:   # only when set: older confirmations stay valid
        d["skip_if_unchanged"] = True
    if mute:
        d["mute"] = sorted(set(mute), key=MUTABLE_ATTENTION_KINDS.index)
    return d


def normalize_limits(limits: dict[str, Any]) -> dict[str, Any]:
    _unknown(limits, ("timeout_seconds", "model", "max_cost_usd"), "limits", "limits.")
    model, errors = limits.get("model"), FieldErrors()
    if model is not None and (not isinstance(model, str) or not 1 <= len(model) <= 200):
        errors.errors.append({"field": "limits.model", "message": "must be a string of 1-200 characters or null"})
    out = {"model": model}
    with errors.check():
        out["timeout_seconds"] = _int(limits.get("timeout_seconds", HOUR_S), "limits.timeout_seconds", 1, DAY_S)
    if (cap := limits.get("max_cost_usd")) is not None:   # only when set: older confirmations stay valid
        if _amount(cap, 10000) is None or cap < 0.01:
            errors.errors.append({"field": "limits.max_cost_usd",
                                  "message": "must be a number of US dollars from 0.01 to 10000, or null"})
        else:
            out["max_cost_usd"] = float(cap)
    errors.raise_any()
    return {"timeout_seconds": out.pop("timeout_seconds"), **out}


def normalize_catch_up(catch_up: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(catch_up.get("policy"), str) or catch_up["policy"] not in CATCH_UP_POLICIES:
        raise invalid("catch_up.policy", "must be enqueue_missed_with_cap, skip_missed or ask")
    if catch_up["policy"] in ("skip_missed", "ask"):
        if set(catch_up) - {"policy"}:
            raise invalid("catch_up.max", f"is not used with {catch_up['policy']}")
        return {"policy": catch_up["policy"]}
    return {"policy": "enqueue_missed_with_cap", "max": _int(catch_up.get("max", 1), "catch_up.max", 1, 25)}


DISPATCH_FIELDS = ("brief", "repository", "workdir", "source_ref", "agent", "limits", "notify")


def normalize_dispatch(raw: dict[str, Any], now: datetime, *, agents: Iterable[str]) -> dict[str, Any]:
    """A one-shot dispatch: the run fields of a schedule definition, by the same rules."""
    _unknown(raw, DISPATCH_FIELDS, "a dispatch")
    as_schedule = {**raw, "name": "dispatch", "timing": {"kind": "interval", "seconds": HOUR_S, "timezone": "UTC"}}
    d = normalize_definition(as_schedule, now, agents=agents)
    return {k: d[k] for k in DISPATCH_FIELDS}


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def confirmation_of(definition: dict[str, Any]) -> str:
    """``sha256:<hex>`` of the canonical JSON (sorted keys, no spaces, UTF-8)."""
    return "sha256:" + hashlib.sha256(canonical_json(definition).encode()).hexdigest()


def check_confirmation(definition: dict[str, Any], given: Any) -> None:
    """The human-confirmed digest must be this definition's (compared as bytes, in constant time)."""
    if not isinstance(given, str) or not hmac.compare_digest(given.encode(), confirmation_of(definition).encode()):
        raise ConfirmationMismatch("the confirmation does not match this definition: compose it, "
                                   "review the summary, then confirm what compose returned",
                                   errors=[{"field": "confirmation", "message": "does not match"}])


WEEKDAYS = ("Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def cron_words(expr: str) -> str | None:
    """Common cron shapes in words ("every 5 minutes", "at 09:00 on Monday-Friday"); None
    for the rest, which are shown as written."""
    fields = expr.split()
    if len(fields) != 5:
        return None
    minute, hour, day, month, weekday = fields
    if (m := re.fullmatch(r"\*/(\d+)", minute)) and hour == day == month == weekday == "*":
        return "every minute" if m[1] == "1" else f"every {int(m[1])} minutes"
    if minute == hour == day == month == weekday == "*":
        return "every minute"
    if not (minute.isdigit() and month == "*"):
        return None
    if hour == "*" and day == weekday == "*":
        return f"every hour at :{int(minute):02d}"
    if not hour.isdigit():
        return None
    at = f"at {int(hour):02d}:{int(minute):02d}"
    if day == "*" and weekday == "*":
        return f"{at} every day"
    if day == "*" and (m := re.fullmatch(r"([0-7])(?:-([0-7]))?", weekday)):
        days = WEEKDAYS[int(m[1])] + (f"-{WEEKDAYS[int(m[2])]}" if m[2] else "")
        return f"{at} on {days}"
    if weekday == "*" and day.isdigit():
        return f"{at} on day {int(day)} of every month"
    return None


def describe_timing(timing: dict[str, Any]) -> str:
    tz = timing["timezone"]
    if timing["kind"] == "cron":
        words = cron_words(timing["expression"])
        expr = timing["expression"]
        return f"{words} (cron '{expr}', {tz})" if words else f"on cron '{expr}' in {tz}"
    if timing["kind"] == "interval":
        s = timing["seconds"]
        for unit, n in (("day", DAY_S), ("hour", HOUR_S), ("minute", MINUTE_S)):
            if s % n == 0:
                count = s // n
                return f"every {count} {unit}{'s' if count != 1 else ''} ({tz})"
        return f"every {s} seconds ({tz})"
    return f"once at {timing['at']} ({tz})"


def schedule_summary(d: dict[str, Any], first_fire: datetime | None) -> str:
    """The one human sentence compose shows before a human confirms."""
    when = describe_timing(d["timing"])
    tz = ZoneInfo(d["timing"]["timezone"])
    first = (f", first at {first_fire.astimezone(tz):%Y-%m-%d %H:%M %Z}" if first_fire else
             ", and never fires again")
    ref = f"{d['source_ref']} of {d['repository']}" + (f" (in {d['workdir']})" if d["workdir"] != "." else "")
    unchanged = ("; skips a fire when the commit has not changed since its last successful run"
                 if d.get("skip_if_unchanged") else "")
    asks = "; asks before catching up missed fires" if d["catch_up"]["policy"] == "ask" else ""
    if d.get("mute"):
        asks += "; muted: " + ", ".join(k.replace("_", " ") for k in d["mute"])
    overlap = POLICY_WORDS["concurrency_policy"][d["concurrency_policy"]]
    return (f"Runs agent '{d['agent']}' {when}{first} on a fresh worktree of {ref}; "
            f"while a run is still active, {overlap}; times out after {d['limits']['timeout_seconds']} s; "
            f"attention: {POLICY_WORDS['notify'][d['notify']]}{unchanged}{asks}.")


def merge_changes(current: dict[str, Any], changes: Any) -> dict[str, Any]:
    """An edit: the current definition with the changed top-level fields replaced."""
    if not isinstance(changes, dict):
        raise invalid("changes", "must be an object of definition fields")
    return {**current, **changes}


def definition_diff(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """What a change does to a definition, field by field (``timing.expression``), for its
    review: each changed field with its value before and after, in the definition's order."""
    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in d.items():
            if isinstance(value, dict):
                out |= flat(value, f"{prefix}{key}.")
            else:
                out[prefix + key] = value
        return out
    old, new = flat(before), flat(after)
    return [{"field": f, "before": old.get(f), "after": new.get(f)}
            for f in dict.fromkeys([*old, *new]) if old.get(f) != new.get(f)]


def plan_words(name: str, zone_name: str, plan: dict[str, Any]) -> tuple[str, str]:
    """A pending catch-up plan's item: its title and detail, the whole plan's count and window in
    the schedule's zone ("more than N" when counting stopped)."""
    count, tz = plan["missed_count"], ZoneInfo(zone_name)
    many = f"{count}" if plan.get("missed_count_exact", True) else f"more than {count:,}"
    window = " to ".join(f"{parse_instant(plan[k]).astimezone(tz):%Y-%m-%d %H:%M %Z}"
                         for k in ("first_missed_at", "last_missed_at"))
    return (f"Schedule '{name}' missed {many} occurrence{'s' if count != 1 else ''}: run a catch-up?",
            f"Missed from {window}. Approve one catch-up run, or dismiss them.")


#: A slot that did not fire, in words ("its last fire ... was skipped: a run was still active").
SKIPPED_WORDS = {
    SlotOutcome.SKIPPED_OVERLAP: "skipped: a run was still active (skip_if_active)",
    SlotOutcome.COALESCED: "merged into the run that was still active (coalesce_if_active)",
    SlotOutcome.FOLDED: "missed while Outpost was down, and counted into a catch-up run",
    SlotOutcome.SKIPPED_MISSED: "missed while Outpost was down, and skipped (skip_missed)",
    SlotOutcome.PAUSED: "not run: the schedule was paused",
    SlotOutcome.HELD_RECONFIRM: "held: its agent profile changed since it was confirmed; review and confirm it again",
    SlotOutcome.SKIPPED_UNCHANGED: "skipped: nothing changed since its last successful run (skip_if_unchanged)",
    SlotOutcome.PENDING_CATCH_UP: "missed while Outpost was down; a catch-up waits for your decision (ask)"}
#: What becomes of a fire due while a run is active, by concurrency policy.
WHILE_ACTIVE_WORDS = {"skip_if_active": "is skipped (skip_if_active)",
                      "coalesce_if_active": "is merged into it (coalesce_if_active)",
                      "always_enqueue": "queues another run (always_enqueue)"}


def inspect_verdict(report: dict[str, Any]) -> str:
    """The answer to "why didn't it run?" in plain words, first, from the six recovery checks
    (docs/http-api.md): what happened last and why, then the next fire; instants in the
    schedule's zone."""
    checks = {c["check"]: c["data"] for c in report["checks"]}
    state, active, runs = checks[1], checks[2], checks[3]["runs"]
    tz = ZoneInfo(state["timing"]["timezone"])

    def at(instant: str) -> str:
        return f"{parse_instant(instant).astimezone(tz):%Y-%m-%d %H:%M %Z}"

    since = f" since {at(state['paused_since'])}" if state.get("paused_since") else ""
    if state["archived"]:
        return "It is archived: it never fires again."
    if state["auto_paused"]:
        return (f"It is auto-paused{since} after {checks[5]['failure_streak']} failures in a row: it fires again "
                "once a human resumes it.")
    if not state["enabled"]:
        return f"It is paused{since}: it does not fire until enabled."
    upcoming = f" Next fire at {at(state['next_fire_at'])}." if state["next_fire_at"] else " It has no next fire."
    if active["active_run_id"]:
        policy = WHILE_ACTIVE_WORDS.get(report.get("concurrency_policy", ""), "follows its concurrency policy")
        return f"It is running now (run {active['active_run_id']}): a fire due meanwhile {policy}.{upcoming}"
    latest = runs[0] if runs else None
    skip = active["recent_skips"][0] if active["recent_skips"] else None
    fired_at = latest["due_at"] if latest else None   # a re-run or a reply has no due instant
    if skip and (latest is None or fired_at and parse_instant(skip["due_at"]) > parse_instant(fired_at)):
        why = SKIPPED_WORDS.get(skip["outcome"], skip["outcome"])
        return f"Its last fire, due at {at(skip['due_at'])}, was {why}.{upcoming}"
    if latest:
        status = latest["status"].replace("_", " ")
        if fired_at is None:   # a re-run or a reply: asked for by a person, due at no instant
            return f"Its latest run (run {latest['run_id']}) was a re-run or a reply, not a fire: {status}.{upcoming}"
        return f"It ran at {at(fired_at)} (run {latest['run_id']}): {status}.{upcoming}"
    if not state["next_fire_at"]:
        return "It has no next fire (a one-time schedule that already fired)."
    return f"Healthy: it has not fired yet.{upcoming}"


# --- naming, prompts, outcomes -------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}_{ULID()}"


def slug(name: str) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return s[:60].strip("-") or "schedule"


def office_branch(task_id: str, agent_name: str) -> str:
    """The one branch of an Office task session (docs/agent-clis.md)."""
    return f"outpost/office/{task_id}/{slug(agent_name)}"


def result_branch(schedule_name: str | None, run_id: str) -> str:
    return f"outpost/{slug(schedule_name) if schedule_name else 'dispatch'}/{run_id}"


#: ``{{name}}`` (or ``{{dotted.path}}`` into a webhook body) in a brief or a routine template.
TEMPLATE_VARIABLE = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_-]+)*)\s*\}\}")


def builtin_variables(at: datetime, tz: ZoneInfo) -> dict[str, str]:
    """``{{date}}`` and ``{{datetime}}``: the fire's instant in the schedule's or workspace's timezone."""
    local = at.astimezone(tz)
    return {"date": local.date().isoformat(), "datetime": local.isoformat(timespec="seconds")}


def render_variables(text: str, values: dict[str, Any]) -> str:
    """``{{name}}`` -> its value (booleans as true/false); unknown names stay as written."""
    def value(m: re.Match) -> str:
        v = values.get(m[1], m[0])
        return json.dumps(v) if isinstance(v, bool) else str(v)
    return TEMPLATE_VARIABLE.sub(value, text)


def render_brief(brief: str, due_at: datetime, tz: ZoneInfo, variables: dict[str, str] | None = None) -> str:
    """Resolve ``{{date}}``, ``{{datetime}}`` and declared variables; unknown names stay as written."""
    return render_variables(brief, builtin_variables(due_at, tz) | (variables or {}))


def catch_up_note(missed_count: int, since: datetime, tz: ZoneInfo, *, counted_all: bool = True) -> str:
    """The catch-up run's note; past the counting cap it says "more than"."""
    many = f"{missed_count}" if counted_all else f"more than {missed_count:,}"
    return (f"\n\n(Outpost: this is a catch-up run; the schedule missed {many} "
            f"occurrence{'s' if missed_count != 1 else ''} since {since.astimezone(tz):%Y-%m-%d %H:%M %Z}.)")


def fill_command(template: Iterable[str], *, model: str | None, run_id: str, session_id: str | None = None,
                 prompt_file: str | None = None) -> list[str]:
    """The argv of an agent. The prompt itself never becomes an argument (it goes on stdin, or
    in ``{prompt_file}``): a brief that starts with ``-`` must not turn into an option. An
    argument that is only a placeholder with nothing to fill is dropped."""
    values = {"model": model or "", "run_id": run_id, "session_id": session_id or "",
              "prompt_file": prompt_file or ""}
    argv = []
    for item in template:
        filled = re.sub(r"\{(model|run_id|session_id|prompt_file)\}", lambda m: values[m[1]], item)
        if filled or not re.fullmatch(r"\{(model|run_id|session_id|prompt_file)\}", item):
            argv.append(filled)
    return argv


def profile_argv(profile: AgentProfile, *, model: str | None, run_id: str, session_id: str | None,
                 prompt_file: str | None, max_cost_usd: float | None) -> list[str]:
    """The command line of one run of ``profile``: its resume form when a session continues,
    plus the model and budget flags of its preset when those are set."""
    if session_id and not profile.kind.resumes(session_id):   # stored before Outpost checked it (Preset.read)
        session_id = None
    argv = fill_command(profile.resume if session_id else profile.command, model=model, run_id=run_id,
                        session_id=session_id, prompt_file=prompt_file)
    if model and profile.model_flag and "{model}" not in " ".join(profile.resume if session_id else profile.command):
        argv += [profile.model_flag, model]
    if max_cost_usd is not None and profile.budget_flag:
        argv += [profile.budget_flag, f"{max_cost_usd:g}"]
    return argv


def profile_digest(profile: AgentProfile) -> str:
    """docs/agent-clis.md: what a schedule's confirmation covers of its profile (the effective command,
    resume, preset, env names, pass_env, timeout cap). A change holds the schedule's fires."""
    facts = {"command": list(profile.command), "resume": list(profile.resume), "preset": profile.preset,
             "env": sorted(k for k, _ in profile.env), "pass_env": sorted(profile.pass_env),
             "timeout_seconds": profile.timeout_seconds}
    return "sha256:" + hashlib.sha256(canonical_json(facts).encode()).hexdigest()


def run_token(key: bytes, run_id: str) -> str:
    """The run-scoped token every run acts with: its run id, signed. Nothing is stored; it is
    honoured only while that run is running (see Store.run_agent_context)."""
    return f"{run_id}.{hmac.new(key, run_id.encode(), hashlib.sha256).hexdigest()}"


def run_of_token(key: bytes, token: str) -> str | None:
    run_id = token.partition(".")[0]
    if not run_id or not hmac.compare_digest(token.encode(), run_token(key, run_id).encode()):
        return None
    return run_id


def agent_env(profile: AgentProfile, parent: dict[str, str], run_id: str) -> dict[str, str]:
    """The profile's env plus its pass_env allowlist, never a secret of the daemon's."""
    env = {k: parent[k] for k in profile.pass_env if k in parent}
    env |= dict(profile.env)
    env["OUTPOST_RUN_ID"] = run_id
    for key in list(env):
        if key in SECRET_ENV or key.startswith("WATCHDOG_"):
            del env[key]
    return env


# --- runs: the plan a run follows, how it ended (docs/agent-clis.md) ---------------------------------------

def run_timeout_s(limit_s: int, profile: AgentProfile | None) -> int:
    """A run's time limit, decided here only: its own limit (a schedule's or a dispatch's
    ``limits.timeout_seconds``, an Office run's), capped by its profile's ``timeout_seconds``,
    which caps every run of that agent whatever a schedule says (docs/agent-clis.md)."""
    cap = profile.timeout_seconds if profile is not None else None
    return min(limit_s, cap) if cap else limit_s


@dataclasses.dataclass(frozen=True, slots=True)
class QueuedRun:
    """What a queued run is made from, whoever queues it: a fire (with its occurrence, due instant
    and missed count), a dispatch, a re-run, a reply, an Office wakeup's claim. ``label`` names its
    result branch when it has no schedule (an Office agent's name); a continuation gives the
    ``result_branch`` it continues (a reply's, an Office task's) with the session it resumes."""
    agent: str
    trigger: str
    prompt: str
    repository: str
    workdir: str
    source_ref: str
    timeout_seconds: int
    notify: str
    model: str | None = None
    max_cost_usd: float | None = None
    schedule_id: str | None = None
    label: str | None = None
    due_at: datetime | None = None
    missed_count: int = 0
    occurrence_id: str | None = None
    resolved_commit: str | None = None
    requested_by: str | None = None
    rerun_of: str | None = None
    result_branch: str | None = None
    continues_branch: bool = False
    continues: str | None = None
    resume_session_id: str | None = None
    owner: str | None = None
    worktree_run: str | None = None


def queued_from(definition: dict[str, Any], trigger: str, prompt: str, **fields: Any) -> QueuedRun:
    """A queued run of a schedule's definition or a dispatch (the same fields: agent, repository,
    workdir, source_ref, limits, notify)."""
    limits = definition["limits"]
    return QueuedRun(agent=definition["agent"], trigger=trigger, prompt=prompt, repository=definition["repository"],
                     workdir=definition["workdir"], source_ref=definition["source_ref"],
                     timeout_seconds=limits["timeout_seconds"], model=limits.get("model"),
                     max_cost_usd=limits.get("max_cost_usd"), notify=definition["notify"], **fields)


@dataclasses.dataclass(frozen=True, slots=True)
class RunPlan:
    """One run as its supervisor carries it from worktree to settlement (and recovery settles
    it): made once, from the run's row (``launch_info``) and its profile, then passed to every
    step. Before it a 24-key dict went from step to step, each reading it by key and deciding
    again what it needed (the profile, the model, the session, the time limit).

    - ``resolved_commit`` is the commit its fire recorded, so the ref is resolved once per fire:
      a skip_if_unchanged fire records the commit the cron actor resolved to decide the skip (in
      the claim's own transaction), any other fire resolves it right after its claim (resolve_new_runs),
      a dispatch when it is checked. The worktree step resolves ``source_ref`` only when nothing
      was recorded: the ref did not resolve then (it fails the run with git's words) or the run
      was admitted before that ended (the first commit recorded wins). A run that continues a
      branch starts from that branch's head instead.
    - ``timeout_seconds`` is the limit it runs under, decided once by run_timeout_s.
    - ``model`` is the run's, else its profile's; ``session_id`` the CLI session it resumes
      (None: a new one; a profile with no resume command always starts anew).
    - Whether it was cancelled is no part of the plan, since only what happens while it runs can
      tell: ``LiveRun.cancel`` makes it so (and ``LiveRun.timed_out`` tells a time limit from a
      cancel), and run_outcome alone turns it into the cancelled outcome. (A cancel recorded for
      a run that ended otherwise is the store's to apply when it settles: settle_run.)"""
    run_id: str
    schedule_id: str | None
    agent: str                         # its profile's name
    profile: AgentProfile | None       # None: not configured here (its launch fails, saying so)
    prompt: str
    repository: str                    # a path, or a URL (git works in its mirror)
    workdir: str
    source_ref: str
    resolved_commit: str | None
    result_branch: str
    timeout_seconds: int
    model: str | None
    max_cost_usd: float | None
    session_id: str | None
    continues_branch: bool             # an Office task session or a reply: its branch goes on
    handover_branch: str | None        # the branch its task was left on by another agent
    worktree_run: str | None           # the run whose worktree it works in (a reply)
    office: bool
    task_id: str | None
    paused: bool                       # paused between its admission and its start
    node: str | None                   # the node and attempt that admitted it (the fence)
    attempt: int
    pid: int | None                    # its agent's process, as recorded (recovery)
    pid_started: str | None

    @classmethod
    def of(cls, row: dict[str, Any], profile: AgentProfile | None) -> RunPlan:
        """The plan of the run whose row ``launch_info`` read; ``profile``: the one it names."""
        return cls(
            run_id=row["id"], schedule_id=row["schedule_id"], agent=row["agent"], profile=profile,
            prompt=row["prompt"], repository=row["repository"], workdir=row["workdir"],
            source_ref=row["source_ref"], resolved_commit=row["resolved_commit"], result_branch=row["result_branch"],
            timeout_seconds=run_timeout_s(row["timeout_seconds"], profile),
            model=row["model"] or (profile.model if profile is not None else None), max_cost_usd=row["max_cost_usd"],
            session_id=row["resume_session"] if profile is not None and profile.resume else None,
            continues_branch=row["continues_branch"], handover_branch=row["handover_branch"],
            worktree_run=row["worktree_run"], office=row["office"], task_id=row["task_id"],
            paused=row["status"] == RunStatus.PAUSED, node=row["node"], attempt=row["attempt"], pid=row["pid"],
            pid_started=row["pid_started"])

    @property
    def fence(self) -> tuple[str | None, int]:
        """(node, attempt): a store call for the run counts only while it is still this admission's."""
        return self.node, self.attempt


#: The failure kinds of a run (docs/agent-clis.md); limit and auth are not the agent's own failure.
FAILURE_KINDS = ("agent", "limit", "auth", "timeout", "interrupted", "launch", "no_result")
#: Failure kinds that do not count toward a schedule's failure streak (docs/schedules.md).
NOT_THE_AGENTS_FAILURE = ("interrupted", "limit", "auth")


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """How a run ended: its status, its error text, and the agent report (docs/agent-clis.md)."""
    status: RunStatus
    error: str | None
    failure_kind: str | None = None
    limit: Limit | None = None
    question: str | None = None
    reading: Reading | None = None

    def report(self) -> dict[str, Any]:
        fields = {f: getattr(self.reading, f) for f in REPORT_FIELDS} if self.reading else {"format": None}
        return {**{f: None for f in REPORT_FIELDS}, **fields, "permission_denials": fields.get(
            "permission_denials") or [], "limit": self.limit.view() if self.limit else None,
            "failure_kind": self.failure_kind}


def failed(error: str, kind: str, reading: Reading | None = None) -> Outcome:
    return Outcome(RunStatus.FAILED, error, kind, reading=reading)


def killed_by(exit_code: int | None) -> str | None:
    """The signal that ended a process: its negative return code, or a shell's and Node's 128 + N
    (Claude Code exits 143 on SIGTERM)."""
    number = -exit_code if exit_code is not None and exit_code < 0 else (
        exit_code - 128 if exit_code in (129, 130, 134, 137, 143) else None)
    with contextlib.suppress(ValueError, TypeError):
        return signal.Signals(number).name
    return None


def run_outcome(reading: Reading, exit_code: int | None, stderr_tail: str, *, timed_out: bool = False,
                cancelled: bool = False, now: datetime, tz: ZoneInfo = UTC) -> Outcome:
    """How a run ended, from what its CLI said and how its process ended. A run cancelled while
    it ran (``LiveRun.cancel``) is cancelled, whatever its process said. Exit 0 with a failing
    terminal event fails (CLIs exit 0 on some failures); a failure whose text (or stderr's tail)
    names a login problem is ``auth``, one that names a limit is ``limit``."""
    if cancelled:
        return Outcome(RunStatus.CANCELLED, "cancelled", reading=reading)
    tail = stderr_tail.strip()[-ERROR_TAIL_BYTES:]
    if timed_out:
        return failed("timeout" + (f": {tail}" if tail else ""), "timeout", reading)
    if reading.tools_error:   # its agent could not act on Outpost: never a success (docs/agent-clis.md)
        return failed(reading.tools_error, "launch", reading)
    if exit_code == 0 and reading.verdict == "needs_you":
        return Outcome(RunStatus.NEEDS_YOU, None, question=reading.question, reading=reading)
    if exit_code == 0 and reading.verdict in ("succeeded", None) and not (
            reading.verdict is None and reading.ends_with_result):
        return Outcome(RunStatus.SUCCEEDED, None, reading=reading)
    if exit_code == 0 and reading.verdict is None:
        error, kind = "the agent ended without a result" + (f": {tail}" if tail else ""), "no_result"
    elif reading.verdict is None and reading.error is None and (signal_name := killed_by(exit_code)):
        # something else ended it (an OOM kill, a kill by hand) before its CLI said how it went
        error, kind = f"the agent was ended by {signal_name} before it gave a result", "no_result"
    else:
        parts = (reading.error, tail) if exit_code == 0 else (tail, reading.error)
        error = "; ".join(dict.fromkeys(t for t in parts if t)) or (
            f"exit code {exit_code}" if exit_code else "the agent reported a failure")
        kind = "agent"
    text = "\n".join(t for t in (reading.error, tail) if t)
    hint = reading.failure_hint
    if hint == "auth" or hint not in LIMIT_HINTS and is_auth_failure(text):
        return failed(error[-ERROR_TAIL_BYTES:], "auth", reading)
    limit = find_limit(text, now, tz, kind=hint if hint in LIMIT_HINTS else None)
    if limit is not None or reading.limit_reset is not None:
        limit = limit or Limit("usage_limit", None, (reading.error or "usage limit")[:500])
        if reading.limit_reset is not None and limit.raised_by is None:
            limit = dataclasses.replace(limit, resets_at=max(reading.limit_reset, now))
        return Outcome(RunStatus.FAILED, error[-ERROR_TAIL_BYTES:], "limit", limit, reading=reading)
    return failed(error[-ERROR_TAIL_BYTES:], kind, reading)


@dataclasses.dataclass(frozen=True, slots=True)
class CapMet:
    """A resource cap a run's processes met (Held.met): which, and the run's failure reason."""
    cap: Literal["memory", "processes"]
    reason: str


def capped(outcome: Outcome, cap_met: CapMet | None) -> Outcome:
    """A run that met a resource cap says so first: the cap, not what it did to the agent (a
    kill, a refused fork), is the reason, followed by the last line the run said. Past its memory
    cap the kernel killed some of its processes (cgroup v1 kills one, not the whole run), so its
    work cannot be whole: it fails. One that met its process cap and succeeded anyway (a refused
    fork it handled) stays a success."""
    if cap_met is None or outcome.status == RunStatus.CANCELLED or (
            outcome.status != RunStatus.FAILED and cap_met.cap != "memory"):
        return outcome
    last = next((line.strip() for line in reversed((outcome.error or "").splitlines()) if line.strip()), "")
    said = f"; its last line: {last[-300:]}" if last and outcome.status == RunStatus.FAILED else ""
    return dataclasses.replace(outcome, status=RunStatus.FAILED, error=cap_met.reason + said, question=None)


def attention_kinds(notify: str, status: RunStatus, commits: int, failure_kind: str | None = None) -> list[str]:
    """Attention items one settled run raises under a notify policy (docs/schedules.md). A limit or a
    login failure raises its profile's own item instead (docs/agent-clis.md); a run interrupted by
    a shutdown, a crash or a lost node raises none: it was not the agent's doing."""
    if status == RunStatus.FAILED:
        # an Office failure is retried, then escalated; a run the daemon's stop ended was no failure
        return [] if notify == "wakeup" or failure_kind in ("limit", "auth", "interrupted") else ["failed"]
    if status == RunStatus.NEEDS_YOU:
        return ["needs_you"]
    if status != RunStatus.SUCCEEDED:
        return []
    if commits and notify in ("attention", "always"):
        return ["changes_returned"]
    return ["succeeded"] if notify == "always" else []


def notify_backoff_s(attempts: int) -> int:
    """Seconds before a failed notification's next attempt: 1 min after the first, doubling to 1 h."""
    return min(NOTIFY_RETRY_FIRST_S * 2 ** max(0, min(attempts - 1, 12)), NOTIFY_RETRY_MAX_S)


def next_failure_streak(streak: int, status: RunStatus, failure_kind: str | None, error: str | None = None) -> int:
    """docs/schedules.md: success resets the streak, the agent's own failure adds one; a run the
    daemon's stop or death interrupted, or one that hit a limit or a login wall, is not the
    agent's failure and counts for nothing; nor is one whose node could not fetch its
    repository URL (docs/fleet.md: ``error`` says so)."""
    if status == RunStatus.SUCCEEDED:
        return 0
    if (status == RunStatus.FAILED and failure_kind not in NOT_THE_AGENTS_FAILURE
            and not (error or "").startswith(UNREACHABLE_ERROR)):
        return streak + 1
    return streak


def request_fingerprint(method: str, path: str, body: bytes) -> str:
    return hashlib.sha256(method.encode() + b"\0" + path.encode() + b"\0" + body).hexdigest()


def valid_idempotency_key(key: str) -> bool:
    """1-255 printable ASCII, without outer spaces (" a" and "a" would be one key)."""
    return 1 <= len(key) <= 255 and key == key.strip() and all(32 <= ord(c) < 127 for c in key)


#: What a terminal obeys rather than shows: C0 controls but tab, newline and the CR of a CRLF;
#: DEL; C1 controls (a lone 0x9b is a CSI to some terminals).
TERMINAL_CONTROLS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]|\r(?!\n)")
#: The same in a one-line field (a log line, a table cell): newlines and CRs too.
ONE_LINE_CONTROLS = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def visible(text: str, *, lines: bool = True) -> str:
    """Text an agent controls, made safe to print to a terminal or a log line: its control
    characters shown as ``\\x1b`` (an OSC title, a clear screen, a bell are seen, not obeyed);
    plain text and UTF-8 as they are. ``lines=False``: newlines too, for a one-line field."""
    def shown(match: re.Match[str]) -> str:
        return "".join(f"\\x{ord(c):02x}" for c in match[0])
    return (TERMINAL_CONTROLS if lines else ONE_LINE_CONTROLS).sub(shown, text)


def parse_count(text: str | None) -> int | None:
    """A non-negative integer of ASCII digits (not '²', not 5,000 digits), else None."""
    return int(text) if text and re.fullmatch(r"[0-9]{1,18}", text) else None


def check_revision(schedule_id: str, current: int, given: int) -> None:
    """docs/http-api.md: a stale If-Match is 412 with the current revision, before anything else is judged."""
    if current != given:
        raise RevisionMismatch(f"schedule {schedule_id} is at revision {current}, not {given}; "
                               "someone else changed it: GET it again", extra={"current_revision": current})


def parse_if_match(value: str | None) -> int:
    if value is None or not value.strip():
        raise PreconditionRequired("send If-Match: \"<revision>\" (GET the schedule for its ETag)")
    tag = re.fullmatch(r'(?:W/)?("?)([^"]*)\1', value.strip())   # "3", W/"3" or 3; never a quote left open
    revision = parse_count(tag[2]) if tag else None
    if revision is None:
        raise PreconditionRequired("If-Match must name one revision, e.g. If-Match: \"3\"")
    return revision


###############################################################################
# 6. Office, the domain: agents, tasks, the wakeup queue's rules, retries, prompts,
#    routines and webhook signatures. Pure.
###############################################################################

# --- Office: agents, tasks and the wakeup queue (docs/office.md) ------------------------

class WakeupSource(enum.StrEnum):
    ROUTINE = "routine"
    COMMENT = "comment"
    AGENT_ERROR = "agent_error"
    SELF = "self"
    USER = "user"
    TASK_ASSIGNED = "task_assigned"
    TASK_BLOCKERS_RESOLVED = "task_blockers_resolved"
    TASK_CHILDREN_COMPLETED = "task_children_completed"
    APPROVAL_RESOLVED = "approval_resolved"
    BUDGET_ALERT = "budget_alert"


class WakeupStatus(enum.StrEnum):
    QUEUED = "queued"          # waiting; with scheduled_retry_at it is a scheduled retry
    CLAIMED = "claimed"        # the dispatcher took it; its run is queued or running
    COALESCED = "coalesced"    # merged into another wakeup's run
    SKIPPED = "skipped"        # checkout lost or budget exhausted: no run, no retry
    FINISHED = "finished"
    FAILED = "failed"          # retries exhausted, escalated
    CANCELLED = "cancelled"    # stale: see CancelReason


#: A wakeup in one of these has not ended (claimed: its run is queued, running or paused); the others have.
OPEN_WAKEUP_STATUSES = (WakeupStatus.QUEUED, WakeupStatus.CLAIMED)
ENDED_WAKEUP_STATUSES = tuple(s for s in WakeupStatus if s not in OPEN_WAKEUP_STATUSES)


class CancelReason(enum.StrEnum):
    TASK_NOT_FOUND = "task_not_found"
    ASSIGNEE_CHANGED = "assignee_changed"
    TASK_TERMINAL = "task_terminal"
    REVIEW_PARTICIPANT_CHANGED = "review_participant_changed"
    RETRY_STALE_ASSIGNEE = "retry_stale_assignee"
    RETRY_TASK_CANCELLED = "retry_task_cancelled"


class TaskState(enum.StrEnum):
    TODO = "TODO"
    IN_PROGRESS = "IN_PROGRESS"
    IN_REVIEW = "IN_REVIEW"
    DONE = "DONE"
    CANCELLED = "CANCELLED"


TERMINAL_TASK_STATES = (TaskState.DONE, TaskState.CANCELLED)
#: The same, for raw SQL: ``state NOT IN (...)``.
TERMINAL_TASK_SQL = sql_tuple(TERMINAL_TASK_STATES)
#: Tasks that give an agent something to do (the idle skip counts these).
ACTIONABLE_TASK_STATES = (TaskState.TODO, TaskState.IN_PROGRESS)
AGENT_ROLES = ("coordinator", "worker", "specialist", "assistant")


class AgentStatus(enum.StrEnum):
    IDLE = "idle"
    WORKING = "working"   # set by Outpost while it has sessions; a person sets the others
    PAUSED = "paused"     # claims nothing (a budget pauses it too): its wakeups wait until it is idle again
    STOPPED = "stopped"   # claims nothing, as paused


class ApprovalStatus(enum.StrEnum):
    """A human's decision on an approval an agent asked for."""
    PENDING = "pending"
    APPROVED = "approved"   # an In Review task moves to Done
    REJECTED = "rejected"   # an In Review task goes back to In Progress


#: Coordinators wake to coordinate, not to work a task, so their idle wakes are never skipped.
SKIP_IDLE_DEFAULTS = {"coordinator": False, "worker": True, "specialist": True, "assistant": True}
#: Workflows of a task: only office (and routine) tasks wake agents; kanban tasks are the user's own.
TASK_WORKFLOWS = ("office", "kanban")
#: Wakeup reason of a reviewer woken by a move to In Review (its staleness follows the reviewers).
REVIEW_REASON = "review_requested"
#: Wakeup reason of an agent a comment mentions (docs/office.md, "Mentions"): it is woken on the task, as a
#: reviewer is, without taking it over (its staleness: only the task ending).
MENTION_REASON = "mentioned"
#: The wakes of an agent that takes part in a task it is not assigned: no checkout, no handover.
PARTICIPANT_REASONS = (REVIEW_REASON, MENTION_REASON)
PARTICIPANT_SQL = sql_tuple(PARTICIPANT_REASONS)   # for raw SQL


def same_part_sql(reason: str | None) -> str:
    """Wakeups merge only with those of the same part on a task: a reviewer's or a mentioned
    agent's (it reads the task, takes no lock) never carries the work of its assignee, which
    waits for the task's lock (and the other way round)."""
    return f"w.reason {'' if reason in PARTICIPANT_REASONS else 'NOT '}IN {PARTICIPANT_SQL}"


#: The agents one comment may wake by mention (a comment that names every agent wakes these
#: first), and the unknown names it lists.
MAX_MENTIONS = 10
#: ``@Name`` (a name without spaces) or ``@"Release Bot"``; never inside a word or an e-mail address.
MENTION = re.compile(r'(?<![\w@.])@(?:"([^"\n]{1,100})"|([\w][\w.-]{0,99}))')
#: Code in a comment, a fenced block or an inline span: its @words are decorators and packages.
CODE_SPANS = re.compile(r"```.*?(?:```|\Z)|`[^`\n]*`", re.DOTALL)
#: The note of a task_assigned wakeup that waits, queued, for its task's open blockers.
HELD_NOTE = "held until its blockers are done"


@dataclasses.dataclass(frozen=True, slots=True)
class RoutinePayload:
    routine_id: str
    variables: dict[str, Any] = dataclasses.field(default_factory=dict)
    missed_ticks: int = 0
    task_id: str | None = None   # a heavy routine's fire waking its open task's agent again


@dataclasses.dataclass(frozen=True, slots=True)
class CommentPayload:
    task_id: str
    comment_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class AgentErrorPayload:
    agent_profile_id: str
    run_id: str
    error: str


@dataclasses.dataclass(frozen=True, slots=True)
class SelfPayload:
    reason: str
    payload: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class UserPayload:
    """A person's wake (user_id: who asked), or a mention in a comment (task_id, comment_id,
    mentioned_by: its author, an agent id or "user")."""
    user_id: str | None = None
    context: str | None = None
    task_id: str | None = None
    comment_id: str | None = None
    mentioned_by: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class TaskAssignedPayload:
    task_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class TaskBlockersResolvedPayload:
    task_id: str
    resolved_blocker_ids: list[str]


@dataclasses.dataclass(frozen=True, slots=True)
class TaskChildrenCompletedPayload:
    task_id: str


@dataclasses.dataclass(frozen=True, slots=True)
class ApprovalResolvedPayload:
    approval_id: str
    status: str
    decision_note: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class BudgetAlertPayload:
    agent_instance_id: str
    budget_pct: int


WAKEUP_PAYLOADS: dict[WakeupSource, type] = {
    WakeupSource.ROUTINE: RoutinePayload, WakeupSource.COMMENT: CommentPayload,
    WakeupSource.AGENT_ERROR: AgentErrorPayload, WakeupSource.SELF: SelfPayload, WakeupSource.USER: UserPayload,
    WakeupSource.TASK_ASSIGNED: TaskAssignedPayload,
    WakeupSource.TASK_BLOCKERS_RESOLVED: TaskBlockersResolvedPayload,
    WakeupSource.TASK_CHILDREN_COMPLETED: TaskChildrenCompletedPayload,
    WakeupSource.APPROVAL_RESOLVED: ApprovalResolvedPayload, WakeupSource.BUDGET_ALERT: BudgetAlertPayload,
}


def wakeup_payload(source: str, raw: Any):
    """The typed payload of one source, checked at the boundary: unknown or missing keys and
    wrong types are a ValueError naming them."""
    cls = WAKEUP_PAYLOADS[WakeupSource(source)]
    if not isinstance(raw, dict):
        raise ValueError(f"{source} payload must be an object")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(raw) - set(fields)
    if unknown:
        raise ValueError(f"{source} payload has unknown keys: {', '.join(sorted(unknown))}")
    hints = {"str": str, "int": int, "dict[str, Any]": dict, "list[str]": list,
             "dict[str, Any] | None": (dict, type(None)), "str | None": (str, type(None))}
    for name, f in fields.items():
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{source} payload needs {name}")
            continue
        value = raw[name]
        if not isinstance(value, hints[f.type]) or isinstance(value, bool) or (
                f.type == "list[str]" and not all(isinstance(item, str) for item in value)):
            raise ValueError(f"{source} payload: {name} has the wrong type")
    return cls(**raw)


def mentioned_names(body: str) -> list[str]:
    """The names a comment mentions outside its code (``@dataclass`` in a snippet is none), in
    order, each once (case aside)."""
    names: dict[str, str] = {}
    for quoted, bare in MENTION.findall(CODE_SPANS.sub(" ", body)):
        name = (quoted or bare.rstrip(".-")).strip()
        if name:
            names.setdefault(name.casefold(), name)
    return list(names.values())


def payload_task_id(payload: dict[str, Any]) -> str | None:
    """The task a wakeup is about (its scope); None for a taskless wakeup."""
    task_id = payload.get("task_id")
    return task_id if isinstance(task_id, str) and task_id else None


def wakeup_idempotency_key(source: str, payload: dict[str, Any], agent_id: str) -> str | None:
    """Source-level dedup keys (docs/office.md "Coalescing, three layers": the first). None:
    every request counts."""
    match source:
        case WakeupSource.COMMENT:
            return f"comment:{payload['comment_id']}"
        case WakeupSource.TASK_ASSIGNED:
            return f"task_assigned:{payload['task_id']}:{agent_id}"
        case WakeupSource.TASK_BLOCKERS_RESOLVED:
            return f"task_blockers_resolved:{payload['task_id']}:{','.join(sorted(payload['resolved_blocker_ids']))}"
        case WakeupSource.APPROVAL_RESOLVED:
            return f"approval_resolved:{payload['approval_id']}"
        case WakeupSource.AGENT_ERROR:
            return f"agent_error:{payload['run_id']}:{agent_id}"
    return None


def routine_waiting_note(fired: int) -> str:
    """What a needs_you item of a heavy routine's task says of the fires it held back."""
    return f"The routine fired {fired} more time{'s' if fired != 1 else ''} while this waits for you."


def routine_idempotency_key(routine_id: str, trigger_id: str, due_at: datetime) -> str:
    return f"routine:{routine_id}:{trigger_id}:{int(due_at.timestamp()) // 60}"


#: Sources whose coalescing window spans the agent's tasks (docs/office.md: the same agent and source
#: within 5 s merge: five subtasks finishing give one task_children_completed). The other
#: task-bound sources hand an agent one task's work, run in that task's session, branch and
#: lock: their window keeps to the task, so no task is left without a run of its own. Their
#: wakeups come in bursts (one cascade of tasks finishing) and are not claimed before their
#: window has passed, so the burst becomes one run.
WINDOW_ACROSS_TASKS = (WakeupSource.TASK_CHILDREN_COMPLETED,)
WINDOW_HELD_SQL = sql_tuple(WINDOW_ACROSS_TASKS)
#: Merged wakeups a context snapshot keeps in full; older ones are only counted.
SNAPSHOT_KEEP = 20


def merge_context(snapshot: dict[str, Any], source: str, reason: str, payload: dict[str, Any],
                  requested_at: datetime) -> dict[str, Any]:
    """Claim-time merge: a coalesced wakeup's payload joins the in-flight one's context."""
    wakeups = [*snapshot.get("wakeups", []),
               {"source": source, "reason": reason, "payload": payload, "requested_at": rfc3339(requested_at)}]
    dropped = snapshot.get("dropped", 0) + max(0, len(wakeups) - SNAPSHOT_KEEP)
    merged = {**snapshot, "wakeups": wakeups[-SNAPSHOT_KEEP:]}
    if dropped:
        merged["dropped"] = dropped
    return merged


def stale_reason(task: dict[str, Any] | None, agent_id: str, reason: str | None) -> CancelReason | None:
    """The staleness check: is the task scope of a wakeup (of this ``reason``) still this agent's
    to act on? A reviewer's holds while it reviews; a mention's while its task is open, whoever
    it is assigned to; any other while the agent is the assignee."""
    if task is None:
        return CancelReason.TASK_NOT_FOUND
    terminal = task["state"] in TERMINAL_TASK_STATES or task["archived_at"] is not None
    if reason == MENTION_REASON:
        return CancelReason.TASK_TERMINAL if terminal else None
    if reason == REVIEW_REASON:
        if terminal:
            return CancelReason.TASK_TERMINAL
        if task["state"] != TaskState.IN_REVIEW or agent_id not in task["reviewers"]:
            return CancelReason.REVIEW_PARTICIPANT_CHANGED
        return None
    if task["assignee_agent_id"] != agent_id:
        return CancelReason.ASSIGNEE_CHANGED
    return CancelReason.TASK_TERMINAL if terminal else None


def retry_stale_reason(task: dict[str, Any] | None, agent_id: str, reason: str | None) -> CancelReason | None:
    """Retry promotion: a scheduled retry is dropped once its task was cancelled or changed hands.
    A review wakeup's agent is a reviewer, never the assignee: it is stale when the agent is no
    longer among the task's reviewers. A mention's retry holds until its task is cancelled."""
    if task is None or task["state"] == TaskState.CANCELLED:
        return CancelReason.RETRY_TASK_CANCELLED
    if reason == MENTION_REASON:
        return None
    if reason == REVIEW_REASON:
        return None if agent_id in task["reviewers"] else CancelReason.REVIEW_PARTICIPANT_CHANGED
    if task["assignee_agent_id"] != agent_id:
        return CancelReason.RETRY_STALE_ASSIGNEE
    return None


def idle_skip_applies(source: str, payload: dict[str, Any], skip_idle_wakeups: bool, actionable: int) -> bool:
    """Only a periodic (lightweight routine) wake is skippable; event wakes always proceed."""
    return (source == WakeupSource.ROUTINE and payload_task_id(payload) is None
            and skip_idle_wakeups and actionable == 0)


def is_office_task(workflow: str, project_id: str | None) -> bool:
    """Office identity: a task on the office workflow or in a project; an ordinary kanban
    task with an assignee wakes nobody."""
    return workflow != "kanban" or bool(project_id)


def resolve_executor(task_override: str | None, agent_preference: str | None, project_executor: str | None,
                     workspace_default: str | None) -> str | None:
    """Executor resolution at launch: task override -> agent -> project -> workspace default."""
    return task_override or agent_preference or project_executor or workspace_default


# --- Office: failures, retries and rate limits ----------------------------------------------

#: Backoff of a failed wakeup's retries (docs/office.md "Retries": 2m, 10m, 30m, 2h), each +-25% jitter.
RETRY_BACKOFF_S = (120, 600, 1800, 7200)
RETRY_JITTER = 0.25
#: Failed attempts retried before a wakeup is escalated to the coordinator.
MAX_RETRY_COUNT = 4
#: What agent CLIs print when asked to resume a session they no longer know (Claude Code:
#: "No conversation found with session ID: ..."; Codex 0.171: "no rollout found for thread id ...";
#: others: "session not found").
UNKNOWN_SESSION_MARKERS = ("no conversation found", "session not found", "no session found", "unknown session",
                           "no rollout found", "invalid session identifier", "no previous sessions found")


def is_unknown_session(error: str) -> bool:
    text = error.lower()
    return any(marker in text for marker in UNKNOWN_SESSION_MARKERS)


@dataclasses.dataclass(frozen=True, slots=True)
class RetryPlan:
    retry_count: int
    retry_at: datetime | None      # None: retries exhausted, escalate
    source: str                    # rate_limit_parsed | backoff | escalated


def plan_retry(retry_count: int, now: datetime, jitter: float, limited_until: datetime | None = None,
               not_before: datetime | None = None) -> RetryPlan:
    """handle_wakeup_failure's decision. ``jitter`` is a random number in [-1, 1]; a run that
    hit a limit with a parsed reset is retried when its profile's limit ends (the
    rate-limit path of docs/office.md "Retries"); any other failure, a limit that named no reset included, falls through
    to the backoff of its retry count, not before ``not_before``. So does a reset that had
    already passed (the profile is then held only LIMIT_BUFFER_S): waiting for it again and
    again would burn the retries in minutes."""
    count = retry_count + 1
    if count > MAX_RETRY_COUNT:
        return RetryPlan(count, None, "escalated")
    if limited_until is not None and limited_until > now + timedelta(seconds=LIMIT_BUFFER_S):
        return RetryPlan(count, limited_until, "rate_limit_parsed")
    delay = RETRY_BACKOFF_S[count - 1] * (1 + RETRY_JITTER * max(-1.0, min(1.0, jitter)))
    return RetryPlan(count, max(now + timedelta(seconds=delay), not_before or now), "backoff")


# --- Office: prompts and the continuation summary --------------------------------------------

#: Characters of the continuation summary placed in a prompt.
SUMMARY_PROMPT_CHARS = 1500
#: Largest continuation summary kept.
SUMMARY_MAX_BYTES = 8 * 1024
#: Decisions the summary remembers, and blockers it lists (lines are capped at 300 chars: < 8 KB).
SUMMARY_DECISIONS = 5
SUMMARY_BLOCKERS = 15
#: The heading of the prompt section that names an agent's Outpost tools.
ACTING_WITH_TOOLS = "## Acting on Outpost (your tools)"
WAKE_WORDS = {
    WakeupSource.ROUTINE: "a routine fired", WakeupSource.COMMENT: "a new comment on your task",
    WakeupSource.AGENT_ERROR: "an agent's work failed", WakeupSource.SELF: "you asked to be woken",
    WakeupSource.USER: "the user woke you", WakeupSource.TASK_ASSIGNED: "a task was assigned to you",
    WakeupSource.TASK_BLOCKERS_RESOLVED: "the blockers of your task are done",
    WakeupSource.TASK_CHILDREN_COMPLETED: "every subtask of your task is finished",
    WakeupSource.APPROVAL_RESOLVED: "an approval you asked for was resolved",
    WakeupSource.BUDGET_ALERT: "an agent is near its budget",
}


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineOutcome:
    """What the dispatch pipeline did with one wakeup: ``claimed`` is false when another
    claimer had it; ``run_id`` is the run it queued (None: the wakeup ended without one)."""
    claimed: bool
    run_id: str | None = None


def wake_line(source: str, reason: str, payload: dict[str, Any]) -> str:
    detail = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in payload.items()
                       if v not in (None, "", {}))
    label = WAKE_WORDS.get(source, source) + (f" ({reason})" if reason and reason != source else "")
    return f"- {source}: {label}" + (f"; {detail}" if detail else "")


def assemble_prompt(*, agent: dict[str, Any], wakeups: list[dict[str, Any]], task: dict[str, Any] | None,
                    comments: list[dict[str, Any]], blockers: list[dict[str, Any]], summary: str,
                    resume: bool, dropped: int = 0, routine: dict[str, Any] | None = None,
                    others: list[dict[str, Any]] | None = None, tools: bool = False) -> str:
    """What the agent reads: why it woke, the task and its new comments, the other tasks its
    merged wake reasons name, the summary slice. A resumed session already holds the
    instructions, so it gets only this delta. ``tools``: its CLI has Outpost's MCP tools (the
    real CLIs: their unattended modes allow no shell call of the API); the demo agent and
    generic profiles are told the HTTP API and the run token."""
    parts = []
    if not resume:
        parts.append(f"You are {agent['name']}, a {agent['role']} agent woken by Outpost Office.")
        if agent.get("instructions"):
            parts.append(agent["instructions"])
    parts.append("## Why you woke" + ("" if not resume else " (since your last run)"))
    parts += [wake_line(w["source"], w["reason"], w["payload"]) for w in wakeups]
    if dropped:
        parts.append(f"- ... and {dropped} earlier wake reasons")
    if routine is not None:
        parts.append(f"## Routine: {routine['name']}"
                     + (f"\n{routine['description']}" if routine["description"] else ""))
    if task is not None:
        parts.append(f"## Task {task['id']}: {task['title']}\nState: {task['state']}")
        if not resume and task["description"]:
            parts.append(task["description"])
        if blockers:
            parts.append("Blocked by: " + ", ".join(f"{b['id']} ({b['state']})" for b in blockers))
    if others:
        parts.append("## Also about\n" + "\n".join(f"- Task {o['id']}: {o['title']} ({o['state']})" for o in others))
    if comments:
        parts.append("## " + ("New comments" if resume else "Comments"))
        parts += [f"{c['author']} at {c['created_at']}:\n{c['body']}" for c in comments]
    if summary:
        parts.append("## Continuation summary\n" + summary[:SUMMARY_PROMPT_CHARS])
    if not resume and tools:
        parts.append(ACTING_WITH_TOOLS + "\nAct on Outpost with your `outpost` tools (MCP server `outpost`): "
                     "get_task and list_tasks to read, comment on a task, move_task, create_task (a subtask: "
                     "parent_id, sequenced by blocked_by), request_approval from a human, wake another agent, "
                     "and ask_human when you cannot go on without a person's decision. Task ids default to "
                     "your task; agents are named by name (wake, assignee, reviewers); @Name in a comment "
                     "wakes that agent.")
    elif not resume:
        parts.append("## Acting on Outpost\nYour run token is in $OUTPOST_RUN_TOKEN and the API in $OUTPOST_API_URL: "
                     "POST /api/agent/comments, /api/agent/tasks/<id>/move, /api/agent/tasks, "
                     "/api/agent/approvals and /api/agent/wake (Authorization: Bearer $OUTPOST_RUN_TOKEN).")
    return "\n\n".join(parts) + "\n"


def result_text(result: dict[str, Any] | None) -> str | None:
    """The summary builder's fallback chain: summary -> result -> message -> error."""
    for key in ("summary", "result", "message", "error"):
        value = (result or {}).get(key)
        if isinstance(value, str) and value.strip():
            return " ".join(value.split())
    return None


def _section(markdown: str, title: str) -> list[str]:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", markdown, re.MULTILINE | re.DOTALL)
    return [line for line in (m[1].strip().splitlines() if m else []) if line.strip()]


def build_summary(previous: str, result: dict[str, Any] | None, stats: dict[str, int],
                  blockers: list[str], now: datetime, more: int = 0) -> str:
    """The continuation summary, composed deterministically from structured inputs (the
    same inputs give the same text): four markdown sections, capped at 8 KB."""
    focus = (f"{stats.get('open_tasks', 0)} open tasks ({stats.get('in_progress', 0)} in progress, "
             f"{stats.get('in_review', 0)} in review); {stats.get('failed_runs', 0)} failed runs and "
             f"{stats.get('escalations', 0)} agent errors in the last 24 h.")
    decisions = [line for line in _section(previous, "Recent decisions") if line.startswith("- ")]
    text = result_text(result)
    if text:
        decisions.append(f"- {now.date().isoformat()}: {text[:300]}")
    decisions = decisions[-SUMMARY_DECISIONS:]
    if stats.get("escalations"):
        next_action = "Look into the agent errors and reassign or retry the failed work."
    elif blockers:
        next_action = "Unblock the blocked tasks above."
    elif stats.get("in_review"):
        next_action = "Follow up on the tasks waiting in review."
    else:
        next_action = "Continue monitoring."
    shown = [f"- {b[:300]}" for b in blockers[:SUMMARY_BLOCKERS]] or ["None."]
    more += max(0, len(blockers) - SUMMARY_BLOCKERS)   # ``more``: open blockers not even passed in
    if more:
        shown.append(f"- ... and {more} more")
    body = ["## Active focus", focus, "", "## Open blockers", *shown,
            "", "## Recent decisions", *(decisions or ["- None yet."]), "", "## Next action", next_action]
    return ("\n".join(body) + "\n").encode()[:SUMMARY_MAX_BYTES].decode(errors="ignore")


# --- Office: checking what the API is given ----------------------------------------------------

#: A budget of a workspace, a project or an agent: runs in 24 h, US dollars in 24 h and in the
#: calendar month (in the workspace's timezone). None: no budget.
BUDGET_FIELDS = ("budget_runs_per_day", "budget_usd_per_day", "budget_usd_per_month")
#: What a wakeup does when a budget is used up (action_on_exceed, docs/office.md "Budgets").
BUDGET_ACTIONS = ("pause", "skip")
AGENT_FIELDS = ("workspace_id", "name", "role", "status", "executor", "instructions", "max_concurrent_sessions",
                "cooldown_sec", "skip_idle_wakeups", *BUDGET_FIELDS)
TASK_FIELDS = ("workspace_id", "title", "description", "state", "assignee_agent_id", "parent_id", "blocked_by",
               "requires_approval", "reviewers", "project_id", "workflow", "executor", "archived")
SETTINGS_FIELDS = ("name", "timezone", "repository", "source_ref", "default_executor",
                   "recovery_lookback_hours", *BUDGET_FIELDS, "budget_action")
#: recovery_lookback_hours is clamped into this range on write (1-720 hours, docs/office.md "The recovery sweep").
LOOKBACK_HOURS = (1, 720)


def budget_fields(raw: dict, runs_max: int) -> dict[str, Any]:
    """The budget fields of an agent, a project or a workspace (each optional)."""
    budget, errors = {}, FieldErrors()
    with errors.check():
        budget["budget_runs_per_day"] = _optional_int(raw, "budget_runs_per_day", 1, runs_max)
    for key in ("budget_usd_per_day", "budget_usd_per_month"):
        value = raw.get(key)
        with errors.check():
            if value is not None and (_amount(value, 1_000_000) is None or value < 0.01):
                raise invalid(key, "must be a number of US dollars from 0.01 to 1,000,000, or null (no budget)")
            budget[key] = None if value is None else float(value)
    errors.raise_any()
    return budget


@dataclasses.dataclass(frozen=True, slots=True)
class Spend:
    """What a scope (workspace, project, agent) used: runs and dollars in 24 h, dollars this month."""
    runs_day: int
    usd_day: float
    usd_month: float


def budget_used_up(scope: str, budget: dict[str, Any], spend: Spend) -> str | None:
    """The sentence saying which budget of ``scope`` is used up, or None (the pre-check)."""
    if budget.get("budget_runs_per_day") and spend.runs_day >= budget["budget_runs_per_day"]:
        return f"{scope} budget of {budget['budget_runs_per_day']} runs per day is used up"
    for key, spent, window in (("budget_usd_per_day", spend.usd_day, "day"),
                               ("budget_usd_per_month", spend.usd_month, "month")):
        if budget.get(key) and spent >= budget[key]:
            return f"{scope} budget of ${budget[key]:,.2f} per {window} is used up (${spent:,.2f} spent)"
    return None


def budget_share(budget: dict[str, Any], spend: Spend) -> tuple[float, str]:
    """The largest share of a budget used, and its window ("day" or "month"): for the 80% alert."""
    shares = [(spend.runs_day / budget["budget_runs_per_day"], "day") if budget.get("budget_runs_per_day") else None,
              (spend.usd_day / budget["budget_usd_per_day"], "day") if budget.get("budget_usd_per_day") else None,
              (spend.usd_month / budget["budget_usd_per_month"], "month") if budget.get("budget_usd_per_month")
              else None]
    return max((s for s in shares if s), default=(0.0, "day"))


def _optional_name(raw: dict, key: str, allowed: Iterable[str], what: str) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    allowed = set(allowed)
    if not isinstance(value, str) or value not in allowed:
        raise invalid(key, f"no {what} named {str(value)[:60]!r}; known: {', '.join(sorted(allowed))}")
    return value


def _ids(raw: dict, key: str, limit: int = 50) -> list[str]:
    value = raw.get(key) or []
    if not isinstance(value, list) or len(value) > limit or not all(isinstance(v, str) and v for v in value):
        raise invalid(key, f"must be a list of at most {limit} ids")
    return list(dict.fromkeys(value))


def _bool(raw: dict, key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise invalid(key, "must be true or false")
    return value


def _optional_int(raw: dict, key: str, lo: int, hi: int) -> int | None:
    return None if raw.get(key) is None else _int(raw[key], key, lo, hi)


def normalize_agent(raw: Any, *, profiles: Iterable[str], current: dict[str, Any] | None = None) -> dict[str, Any]:
    """An agent's fields with their defaults (role defaults for skip_idle_wakeups). With
    ``current`` it is an edit: only the fields given change."""
    if not isinstance(raw, dict):
        raise invalid("body", "must be a JSON object")
    _check_unicode(raw, "")
    errors = FieldErrors()   # every field's error at once
    with errors.check():
        _unknown(raw, AGENT_FIELDS, "an agent")
    if current is not None and "workspace_id" in raw:
        errors.errors.append({"field": "workspace_id", "message": "an agent cannot move to another workspace"})
    merged = {**(current or {}), **raw}
    role_changed = current is not None and raw.get("role", current["role"]) != current["role"]
    if role_changed and "skip_idle_wakeups" not in raw and \
            current["skip_idle_wakeups"] == SKIP_IDLE_DEFAULTS.get(current["role"]):
        merged.pop("skip_idle_wakeups")   # the new role's default, unless the user had chosen otherwise
    a: dict[str, Any] = {}
    with errors.check():
        a["name"] = _text(merged, "name", 1, 100, single_line=True).strip()
        if not a["name"]:
            raise invalid("name", "must not be blank")
    role = merged.get("role", "worker")
    role = "coordinator" if role == "ceo" else role
    if role not in AGENT_ROLES:
        errors.errors.append({"field": "role", "message": "must be " + ", ".join(AGENT_ROLES) + " (or ceo)"})
        role = "worker"   # for the defaults below; the error stands
    a["role"] = role
    with errors.check():
        status = merged.get("status", AgentStatus.IDLE)
        if status not in tuple(AgentStatus) or (status == AgentStatus.WORKING
                                                and raw.get("status") == AgentStatus.WORKING):
            raise invalid("status", "must be idle, paused or stopped (working is set by Outpost)")
        a["status"] = status
    for key, check in (
            ("executor", lambda: _optional_name(merged, "executor", profiles, "agent profile")),
            ("instructions", lambda: _text(merged, "instructions", 0, MAX_TEXT_CHARS, "")
             if merged.get("instructions") else None),
            ("max_concurrent_sessions", lambda: _int(merged.get("max_concurrent_sessions", 1),
                                                     "max_concurrent_sessions", 1, 16)),
            ("cooldown_sec", lambda: _int(merged.get("cooldown_sec", 10), "cooldown_sec", 0, DAY_S)),
            ("skip_idle_wakeups", lambda: _bool(merged, "skip_idle_wakeups", SKIP_IDLE_DEFAULTS[role]))):
        with errors.check():
            a[key] = check()
    with errors.check():
        a |= budget_fields(merged, 100000)
    errors.raise_any()
    return a


def normalize_task(raw: Any, *, profiles: Iterable[str], current: dict[str, Any] | None = None) -> dict[str, Any]:
    """A task's fields with their defaults; with ``current``, an edit (state moves through /move)."""
    if not isinstance(raw, dict):
        raise invalid("body", "must be a JSON object")
    _check_unicode(raw, "")
    errors = FieldErrors()   # every field's error at once
    with errors.check():
        _unknown(raw, TASK_FIELDS, "a task")
    for key in ("workspace_id", "state", "parent_id", "workflow") if current is not None else ():
        if key in raw:
            errors.errors.append({"field": key, "message": "cannot be changed by an edit"
                                  + (" (POST .../move)" if key == "state" else "")})
    merged = {**(current or {}), **raw}
    t: dict[str, Any] = {}
    with errors.check():
        t["title"] = _text(merged, "title", 1, 200, single_line=True).strip()
        if not t["title"]:
            raise invalid("title", "must not be blank")
    with errors.check():
        t["description"] = _text(merged, "description", 0, 100_000, "")
    state = merged.get("state", TaskState.TODO)
    if state not in (TaskState.TODO, TaskState.IN_PROGRESS) and current is None:
        errors.errors.append({"field": "state", "message": "a new task starts in TODO or IN_PROGRESS"})
    t["state"] = state
    for key in ("assignee_agent_id", "parent_id", "project_id"):
        value = merged.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            errors.errors.append({"field": key, "message": "must be an id or null"})
        t[key] = value
    for key, check in (("blocked_by", lambda: _ids(merged, "blocked_by")),
                       ("reviewers", lambda: _ids(merged, "reviewers", 10)),
                       ("requires_approval", lambda: _bool(merged, "requires_approval", False))):
        with errors.check():
            t[key] = check()
    workflow = merged.get("workflow", "office")
    # an edit keeps a routine's task on the routine workflow (only its fire creates one)
    if workflow not in TASK_WORKFLOWS and not (current is not None and workflow == "routine"):
        errors.errors.append({"field": "workflow", "message": "must be office or kanban"})
    t["workflow"] = workflow
    with errors.check():
        t["executor"] = _optional_name(merged, "executor", profiles, "agent profile")
    if "archived" in raw:
        with errors.check():
            t["archived"] = _bool(raw, "archived", False)
    errors.raise_any()
    return t


def normalize_settings(raw: Any, *, profiles: Iterable[str], current: dict[str, Any]) -> dict[str, Any]:
    """Workspace settings; recovery_lookback_hours is clamped to 1-720, not refused."""
    if not isinstance(raw, dict):
        raise invalid("body", "must be a JSON object")
    _check_unicode(raw, "")
    merged = {**current, **raw}
    s: dict[str, Any] = {}
    errors = FieldErrors()   # every field's error at once: the settings form shows them together
    with errors.check():
        _unknown(raw, SETTINGS_FIELDS, "the workspace settings")
    with errors.check():
        s["name"] = _text(merged, "name", 1, 100, single_line=True).strip()
        if not s["name"]:
            raise invalid("name", "must not be blank")
    with errors.check():
        zone(merged.get("timezone", "UTC"), "timezone")
        s["timezone"] = merged.get("timezone", "UTC")
    with errors.check():
        s["repository"] = _repository(merged) if merged.get("repository") is not None else None
    with errors.check():
        s["source_ref"] = _source_ref(merged)
    with errors.check():
        s["default_executor"] = _optional_name(merged, "default_executor", profiles, "agent profile")
    with errors.check():
        hours = merged.get("recovery_lookback_hours", 24)
        if isinstance(hours, bool) or not isinstance(hours, int | float) or (isinstance(hours, float)
                                                                             and not math.isfinite(hours)):
            raise invalid("recovery_lookback_hours", "must be a number of hours")
        s["recovery_lookback_hours"] = int(min(max(hours, LOOKBACK_HOURS[0]), LOOKBACK_HOURS[1]))
    with errors.check():
        s |= budget_fields(merged, 1_000_000)
    with errors.check():
        s["budget_action"] = merged.get("budget_action", "pause")
        if s["budget_action"] not in BUDGET_ACTIONS:
            raise invalid("budget_action", "must be pause (the agent is paused) or skip (the wakeup is skipped)")
    errors.raise_any()
    return s


def summary_scope(payload: dict[str, Any]) -> str:
    """The continuation summary a taskless run reads and updates: one chain per routine."""
    return f"routine:{payload['routine_id']}" if payload.get("routine_id") else "taskless"


# --- Office routines: templates, variables, triggers, webhook signatures ----------------------

class RoutineStatus(enum.StrEnum):
    ACTIVE = "active"
    PAUSED = "paused"
    ARCHIVED = "archived"   # for good: it never fires, nor becomes active again


class RoutineRunStatus(enum.StrEnum):
    """What became of one firing of a routine (a routine run: its history)."""
    RECEIVED = "received"
    TASK_CREATED = "task_created"   # dispatched: its task created (heavy), or its wakeup queued (lightweight)
    SKIPPED = "skipped"             # skip_if_active, or its wakeup came to nothing
    COALESCED = "coalesced"         # coalesce_if_active: merged into the routine's active run
    FAILED = "failed"               # with its error


TRIGGER_KINDS = ("schedule", "webhook", "manual")
SIGNING_MODES = ("none", "bearer", "hmac_sha256", "github")
VARIABLE_TYPES = ("text", "number", "boolean", "select")
BUILTIN_VARIABLES = ("date", "datetime")
#: Other names of routine policies a client may send, stored as Outpost's (docs/office.md "Routines").
ROUTINE_POLICY_ALIASES = {"always_create": "always_enqueue"}
ROUTINE_FIELDS = ("workspace_id", "name", "description", "assignee_agent_id", "status", "concurrency_policy",
                  "catch_up_policy", "catch_up_max", "priority", "task_template", "variables", "triggers")
#: A webhook signature (hmac_sha256) is valid this long around its timestamp (either way: the
#: sender's clock may be ahead), and remembered until its timestamp is that far behind.
WEBHOOK_TOLERANCE_S = 300
#: A GitHub delivery id is remembered this long (its redeliveries are not fired again).
GITHUB_DELIVERY_TTL_S = DAY_S
#: After a secret rotation the old secret is still accepted this long.
SECRET_ROTATION_GRACE_S = DAY_S
#: Refused deliveries kept per webhook trigger, the newest: a flood of unsigned posts stays bounded.
REFUSED_DELIVERIES_KEPT = 200


def template_variables(*texts: str) -> list[str]:
    """The ``{{name}}`` variables a template uses, in order, without the built-ins."""
    names = [m for text in texts for m in TEMPLATE_VARIABLE.findall(text or "")]
    return [n for n in dict.fromkeys(names) if n not in BUILTIN_VARIABLES]


def _variable(raw: Any, i: int) -> dict[str, Any]:
    field = f"variables[{i}]"
    if not isinstance(raw, dict):
        raise invalid(field, "must be an object with name and type")
    _unknown(raw, ("name", "type", "default", "required", "options", "description"), "a variable")
    name = raw.get("name")
    if not isinstance(name, str) or not TEMPLATE_VARIABLE.fullmatch("{{" + name + "}}"):
        raise invalid(f"{field}.name", "must be a name like branch or repository.full_name")
    if name in BUILTIN_VARIABLES:
        raise invalid(f"{field}.name", f"{name} is built in")
    kind = raw.get("type", "text")
    if kind not in VARIABLE_TYPES:
        raise invalid(f"{field}.type", "must be " + ", ".join(VARIABLE_TYPES))
    options = raw.get("options") or []
    if kind == "select" and (not isinstance(options, list) or not options
                             or not all(isinstance(o, str) and o for o in options)):
        raise invalid(f"{field}.options", "a select variable needs a list of options")
    v = {"name": name, "type": kind, "default": None, "required": _bool(raw, "required", False),
         "options": options if kind == "select" else [], "description": _text(raw, "description", 0, 500, "")}
    if raw.get("default") is not None:
        v["default"] = coerce_variable(v, raw["default"], f"{field}.default")
    return v


def coerce_variable(v: dict[str, Any], value: Any, field: str) -> Any:
    """A provided value in its declared type (a webhook sends JSON; a form sends text)."""
    kind = v["type"]
    if kind == "number":
        if isinstance(value, str):
            try:
                value = float(value) if any(c in value for c in ".eE") else int(value)
            except ValueError:
                raise invalid(field, "must be a number") from None
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise invalid(field, "must be a number")
        return value
    if kind == "boolean":
        if isinstance(value, str) and value.lower() in ("true", "false", "on", "off", "1", "0", "yes", "no"):
            return value.lower() in ("true", "on", "1", "yes")
        if not isinstance(value, bool):
            raise invalid(field, "must be true or false")
        return value
    if isinstance(value, dict | list):
        raise invalid(field, "must be text, not an object or a list")
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > 10000:
        raise invalid(field, "must be at most 10000 characters")
    if kind == "select" and text not in v["options"]:
        raise invalid(field, "must be one of " + ", ".join(v["options"]))
    return text


def _task_template(template: Any) -> dict[str, str]:
    """A routine's task template: a title and a description, or {} for a taskless routine."""
    if template in (None, "", {}):
        return {}
    if not isinstance(template, dict):
        raise invalid("task_template", 'must be {"title", "description"}, or empty for a taskless routine')
    _unknown(template, ("title", "description"), "a task template", "task_template.")
    out = {}
    for key in ("title", "description"):
        try:
            if key in template:
                out[key] = _text(template, key, 0, 100_000 if key == "description" else 200, "")
        except ValidationFailed as err:   # named as the API takes it, and as the form shows it
            raise invalid(f"task_template.{key}", err.errors[0]["message"]) from None
    return out


def normalize_routine(raw: Any, *, current: dict[str, Any] | None = None) -> dict[str, Any]:
    """A routine's fields with their defaults. Saving a template that uses a new
    ``{{var}}`` declares it (text, no default, not required). Triggers are checked by
    ``normalize_trigger``; an edit does not take them (they have their own endpoints)."""
    if not isinstance(raw, dict):
        raise invalid("body", "must be a JSON object")
    _check_unicode(raw, "")
    errors = FieldErrors()   # every field's error at once
    with errors.check():
        _unknown(raw, ROUTINE_FIELDS, "a routine")
    for key in ("workspace_id", "triggers") if current is not None else ():
        if key in raw:
            errors.errors.append({"field": key, "message": "cannot be changed by an edit"
                                  + (" (use .../triggers)" if key == "triggers" else "")})
    merged = {**(current or {}), **raw}
    r: dict[str, Any] = {}
    with errors.check():
        r["name"] = _text(merged, "name", 1, 100, single_line=True).strip()
        if not r["name"]:
            raise invalid("name", "must not be blank")
    with errors.check():
        r["description"] = _text(merged, "description", 0, 10000, "")
    assignee = merged.get("assignee_agent_id")
    if not isinstance(assignee, str) or not assignee:
        errors.errors.append({"field": "assignee_agent_id", "message": "a routine wakes one agent: name it"})
    r["assignee_agent_id"] = assignee
    for key, allowed, default in (("status", tuple(RoutineStatus), RoutineStatus.ACTIVE),
                                  ("concurrency_policy", CONCURRENCY_POLICIES, "coalesce_if_active"),
                                  ("catch_up_policy", CATCH_UP_POLICIES, "enqueue_missed_with_cap")):
        value = merged.get(key, default)
        if key == "concurrency_policy" and isinstance(value, str):   # a list or an object is no alias, just wrong
            value = ROUTINE_POLICY_ALIASES.get(value, value)
        if not isinstance(value, str) or value not in allowed:
            errors.errors.append({"field": key, "message": "must be " + ", ".join(allowed)})
        r[key] = value
    if current is not None and current["status"] == RoutineStatus.ARCHIVED and r["status"] != RoutineStatus.ARCHIVED:
        errors.errors.append({"field": "status", "message": "an archived routine stays archived"})
    with errors.check():
        r["catch_up_max"] = _int(merged.get("catch_up_max", 25), "catch_up_max", 1, 1000)
    with errors.check():
        r["priority"] = _int(merged.get("priority", 0), "priority", -1000, 1000)
    with errors.check():
        r["task_template"] = _task_template(merged.get("task_template"))
    declared = merged.get("variables") or []
    if not isinstance(declared, list) or len(declared) > 50:
        errors.errors.append({"field": "variables", "message": "must be a list of at most 50 variables"})
        declared = []
    variables = []
    for i, v in enumerate(declared):
        with errors.check():
            variables.append(_variable(v, i))
    names = [v["name"] for v in variables]
    if len(set(names)) != len(names):
        errors.errors.append({"field": "variables", "message": "declares a name twice"})
    errors.raise_any()
    for name in template_variables(r["description"], r["task_template"].get("title", ""),
                                   r["task_template"].get("description", "")):
        if name not in names:
            variables.append({"name": name, "type": "text", "default": None, "required": False, "options": [],
                              "description": ""})
    r["variables"] = variables
    return r


def normalize_trigger(raw: Any, i: int, now: datetime, default_tz: str) -> dict[str, Any]:
    field = f"triggers[{i}]"
    if not isinstance(raw, dict):
        raise invalid(field, 'must be an object with "kind": schedule, webhook or manual')
    _unknown(raw, ("kind", "cron_expression", "timezone", "signing_mode", "enabled"), "a trigger")
    kind = raw.get("kind")
    if kind not in TRIGGER_KINDS:
        raise invalid(f"{field}.kind", "must be schedule, webhook or manual")
    t: dict[str, Any] = {"kind": kind, "enabled": _bool(raw, "enabled", True)}
    if kind == "schedule":
        try:
            timing = normalize_timing({"kind": "cron", "expression": raw.get("cron_expression"),
                                       "timezone": raw.get("timezone") or default_tz}, now, check_past=False)
        except ValidationFailed as err:   # in the trigger's words: both of its errors, when both are wrong
            name = {"timing.expression": "cron_expression", "timing.timezone": "timezone"}
            errors = FieldErrors()
            errors.errors = [{"field": f"{field}.{name.get(e['field'], 'cron_expression')}", "message": e["message"]}
                             for e in err.errors]
            errors.raise_any()
        t |= {"cron_expression": timing["expression"], "timezone": timing["timezone"]}
    elif kind == "webhook":
        mode = raw.get("signing_mode", "hmac_sha256")
        if mode not in SIGNING_MODES:
            raise invalid(f"{field}.signing_mode", "must be " + ", ".join(SIGNING_MODES))
        t["signing_mode"] = mode
    extra = {"cron_expression", "timezone"} & set(raw) if kind != "schedule" else set()
    extra |= {"signing_mode"} & set(raw) if kind != "webhook" else set()
    if extra:
        raise invalid(f"{field}.{sorted(extra)[0]}", f"is not used by a {kind} trigger")
    return t


def trigger_timing(cron: str, tz: str) -> dict[str, Any]:
    """A schedule trigger's timing in the schedules' own terms: one timing engine for both."""
    return {"kind": "cron", "expression": cron, "timezone": tz}


def lookup_path(values: dict[str, Any], path: str) -> Any:
    """``repository.full_name`` in a webhook body: top-level keys by name, nested by dots."""
    if path in values:
        return values[path]
    value: Any = values
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def resolve_variables(declared: list[dict[str, Any]], provided: dict[str, Any], now: datetime,
                      tz: ZoneInfo) -> dict[str, Any]:
    """Resolution order: built-ins, then declared defaults, then provided values (later wins).
    A required variable with no value refuses the fire."""
    values: dict[str, Any] = builtin_variables(now, tz)
    missing = []
    for v in declared:
        given = lookup_path(provided, v["name"])
        if given is not None:
            values[v["name"]] = coerce_variable(v, given, f"variables.{v['name']}")
        elif v["default"] is not None:
            values[v["name"]] = v["default"]
        elif v["required"]:
            missing.append(v["name"])
    if missing:
        raise ValidationFailed("required variables have no value: " + ", ".join(missing),
                               errors=[{"field": f"variables.{n}", "message": "is required"} for n in missing])
    return values


def dispatch_fingerprint(routine_id: str, title: str, description: str, assignee: str) -> str:
    return hashlib.sha256(canonical_json([routine_id, title, description, assignee]).encode()).hexdigest()


@dataclasses.dataclass(frozen=True, slots=True)
class WebhookCheck:
    ok: bool
    reason: str = ""
    replay_keys: tuple[str, ...] = ()      # remembered after acceptance; a repeat of any is a replay
    redelivery_key: str | None = None      # of them, GitHub's delivery id: its repeat is a redelivery
    replay_ttl_s: int = 0


def bearer(authorization: str | None) -> str:
    """The credential of an ``Authorization: Bearer <credential>`` header; "" for anything else."""
    auth = authorization or ""
    return auth[7:].strip() if auth.lower().startswith("bearer ") else ""


def verify_webhook(mode: str, secrets_: list[str], headers: dict[str, str], body: bytes, now: datetime) -> WebhookCheck:
    """docs/office.md, pure: which deliveries a trigger accepts. ``secrets_`` holds the current
    secret and, during a rotation's grace period, the previous one. Compared in constant time."""
    def any_match(expected: Callable[[str], str], given: str) -> bool:
        return any(hmac.compare_digest(expected(s).encode(), given.encode()) for s in secrets_)

    if mode == "none":
        return WebhookCheck(True)
    if mode == "bearer":
        given = bearer(headers.get("authorization"))
        return WebhookCheck(True) if given and any_match(lambda s: s, given) else WebhookCheck(
            False, "missing or wrong bearer secret")
    if mode == "github":
        given = headers.get("x-hub-signature-256", "")
        if not given.startswith("sha256="):
            return WebhookCheck(False, "missing X-Hub-Signature-256")
        if not any_match(lambda s: "sha256=" + hmac.new(s.encode(), body, hashlib.sha256).hexdigest(), given):
            return WebhookCheck(False, "bad signature")
        # The signature too: the same body under another delivery id, or none, is a replay.
        delivery = headers.get("x-github-delivery", "")[:200]
        redelivery = f"github:{delivery}" if delivery else None
        return WebhookCheck(True, replay_keys=(*([redelivery] if redelivery else []), f"github-sig:{given.lower()}"),
                            redelivery_key=redelivery, replay_ttl_s=GITHUB_DELIVERY_TTL_S)
    header = headers.get("x-outpost-signature", "")
    parts = dict(p.strip().partition("=")[::2] for p in header.split(",") if "=" in p)
    stamp, given = parts.get("t", ""), parts.get("v1", "")
    if not (stamp.isascii() and stamp.isdigit()) or not given:   # "²" is a digit to isdigit, not to int
        return WebhookCheck(False, "missing X-Outpost-Signature (t=<unix seconds>,v1=<hex>)")
    stamped = int(stamp[:12])
    if abs(now.timestamp() - stamped) > WEBHOOK_TOLERANCE_S:
        return WebhookCheck(False, "stale timestamp")
    signed = stamp.encode() + b"." + body
    if not any_match(lambda s: hmac.new(s.encode(), signed, hashlib.sha256).hexdigest(), given):
        return WebhookCheck(False, "bad signature")
    # Remembered past the last instant its stamp is accepted (up to 600 s for a stamp 300 s ahead).
    accepted_until_s = stamped + WEBHOOK_TOLERANCE_S - now.timestamp()
    return WebhookCheck(True, replay_keys=(f"hmac:{given.lower()}",), replay_ttl_s=math.ceil(accepted_until_s) + 1)


def catch_up_plan(policy: str, cap: int, slots: list[datetime], total: int) -> tuple[list[datetime], int]:
    """Which missed ticks a routine fires after downtime, and how many it drops (they are
    summarized into the next prompt): skip_missed fires the current tick only;
    enqueue_missed_with_cap the newest ``cap``."""
    if policy == "skip_missed":
        return slots[-1:], 0
    fired = slots[-cap:]
    return fired, total - len(fired)


@dataclasses.dataclass(frozen=True, slots=True)
class ChannelMessage:
    """One person's message from a channel (docs/office.md, "Channels"), as it becomes a comment: the
    service's id of the delivery (deduplicated), the sender, and the text."""
    delivery_id: str
    sender: str            # Slack: the user id (its display name is looked up); Telegram: the name
    text: str


def plain_text(text: str) -> str:
    """``text`` with any lone surrogate (JSON's ``"\\ud800"``) replaced: it could not be stored."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def slack_signature(secret: str, timestamp: str, body: bytes) -> str:
    """``X-Slack-Signature`` v0: HMAC-SHA256 of ``v0:<timestamp>:<raw body>`` with the signing
    secret (https://docs.slack.dev/authentication/verifying-requests-from-slack)."""
    return "v0=" + hmac.new(secret.encode(), b"v0:" + timestamp.encode() + b":" + body, hashlib.sha256).hexdigest()


def slack_refusal(secret: str, headers: dict[str, str], body: bytes, now: datetime) -> str | None:
    """Why a request is not Slack's (None: it is): no or a stale timestamp (300 s either way:
    a replay), or a signature that does not match, compared in constant time."""
    stamp = headers.get("x-slack-request-timestamp", "")
    if not (stamp.isascii() and stamp.isdigit()) or len(stamp) > 12:
        return "missing X-Slack-Request-Timestamp"
    if abs(now.timestamp() - int(stamp)) > SLACK_SIGNATURE_WINDOW_S:
        return "stale timestamp (a replay, or a clock off by more than 5 minutes)"
    given = headers.get("x-slack-signature", "")
    if not hmac.compare_digest(slack_signature(secret, stamp, body).encode(), given.encode()):
        return "bad signature"
    return None


def slack_message(envelope: dict[str, Any], channel: str) -> ChannelMessage | None:
    """The person's message an ``event_callback`` carries, or None for what is no such message:
    another event type, another channel, a bot's post (its own replies among them: ``bot_id``),
    an edit, a deletion or any other ``subtype``, an empty text."""
    event = envelope.get("event")
    if not isinstance(event, dict) or event.get("type") != "message" or event.get("channel") != channel:
        return None
    if event.get("bot_id") or event.get("subtype") or not isinstance(event.get("user"), str):
        return None
    text, event_id = event.get("text"), envelope.get("event_id")
    if not isinstance(text, str) or not text.strip() or not isinstance(event_id, str) or not event_id:
        return None
    return ChannelMessage(plain_text(event_id[:200]), plain_text(event["user"][:100]), plain_text(text))


def telegram_message(update: dict[str, Any], chat: str) -> ChannelMessage | None:
    """A Telegram webhook update's ``message.text`` from the configured chat, by a person;
    None for anything else (an edit, a channel post, a bot, another chat)."""
    message, update_id = update.get("message"), update.get("update_id")
    if not isinstance(message, dict) or not isinstance(update_id, int) or isinstance(update_id, bool):
        return None
    sender, text = message.get("from") or {}, message.get("text")
    if not isinstance(sender, dict) or sender.get("is_bot") or not isinstance(text, str) or not text.strip():
        return None
    where = message.get("chat")
    if not isinstance(where, dict) or str(where.get("id")) != chat:
        return None
    name = sender.get("username") or sender.get("first_name") or str(sender.get("id", "someone"))
    return ChannelMessage(str(update_id), plain_text(str(name)[:100]), plain_text(text))


###############################################################################
# 7. Store: the database and its session: Pony entities, migrations, views, the dialect
#    (SQLite or PostgreSQL), transactions and the group commit.
###############################################################################

def naive(dt: datetime | None) -> datetime | None:
    """Aware -> naive UTC for storage (Pony's SQLite converter mangles aware datetimes)."""
    return dt.astimezone(UTC).replace(tzinfo=None) if dt is not None else None


def aware(dt: datetime | None) -> datetime | None:
    return dt.replace(tzinfo=UTC) if dt is not None else None


def sql_instant(value: str | datetime) -> datetime:
    """An instant read by raw SQL (text in SQLite) as an aware datetime."""
    return aware(datetime.fromisoformat(value) if isinstance(value, str) else value)


def sql_list(name: str, values: Iterable[str]) -> tuple[str, dict[str, str]]:
    """``(...)`` of an ``IN`` for plain SQL, one parameter per value ($name0, $name1, ...):
    portable, where SQLite's json_each is not. Never call it for no values (``IN ()``)."""
    params = {f"{name}{i}": value for i, value in enumerate(values)}
    return "(" + ", ".join(f"${key}" for key in params) + ")", params


def sql_time(dt: datetime) -> str:
    """An instant as Pony stores it in SQLite, for raw SQL (sqlite3's own adapter drops
    ``.000000`` on whole seconds, and then text comparisons with Pony's rows fail)."""
    return naive(dt).strftime("%Y-%m-%d %H:%M:%S.%f")


#: Before any instant Outpost stores: "since the beginning" in a comparison of plain SQL.
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class StoredInstant(SQLiteDatetimeConverter):
    """Pony reads every datetime column with ``time.strptime`` (about 15 µs each, a tenth of
    the CPU of loading a wakeup); the text it wrote is ISO 8601, which ``fromisoformat`` reads
    in well under a microsecond."""

    def sql2py(self, val):
        try:
            return datetime.fromisoformat(val)
        except (TypeError, ValueError):
            return super().sql2py(val)


def define_entities(db: orm.Database) -> None:
    """The schema. A function of the Database because Pony binds entities once per Database."""
    Optional, Required, PrimaryKey, Set = orm.Optional, orm.Required, orm.PrimaryKey, orm.Set

    class Schedule(db.Entity):
        id = PrimaryKey(str)
        name = Required(str)
        definition = Required(orm.Json)
        revision = Required(int, default=1)
        enabled = Required(bool, default=True)
        archived = Required(bool, default=False)
        auto_paused = Required(bool, default=False)
        failure_streak = Required(int, default=0)
        next_fire_at = Optional(datetime, index=True)
        last_fired_at = Optional(datetime)
        anchored_at = Required(datetime)     # interval schedules fire at anchored_at + k * seconds
        confirmation = Required(str)
        confirmed_at = Required(datetime)
        profile_digest = Optional(str, nullable=True)   # the agent profile confirmed with it (docs/agent-clis.md)
        pending_catch_up = Optional(orm.Json, nullable=True)   # ask: {missed_count(_exact), first/last_missed_at}
        created_at = Required(datetime)
        updated_at = Required(datetime)
        occurrences = Set("Occurrence")
        runs = Set("Run")

    class Occurrence(db.Entity):
        """One due slot of a schedule and what became of it: the slot ledger."""
        id = PrimaryKey(str)
        schedule = Required(Schedule)
        due_at = Required(datetime)
        trigger = Required(str)            # cron | interval | once | manual | catch_up
        outcome = Required(str)            # SlotOutcome
        missed_count = Required(int, default=0)
        run_id = Optional(str, nullable=True)
        created_at = Required(datetime)
        orm.composite_key(schedule, due_at)

    class Run(db.Entity):
        id = PrimaryKey(str)
        schedule = Optional(Schedule)
        occurrence_id = Optional(str, nullable=True)
        agent = Required(str)
        trigger = Required(str)
        due_at = Optional(datetime)
        missed_count = Required(int, default=0)
        status = Required(str, index=True)
        owner = Optional(str, nullable=True)
        prompt = Required(str)
        repository = Required(str)
        workdir = Required(str)
        source_ref = Required(str)
        timeout_seconds = Required(int)
        model = Optional(str, nullable=True)
        notify = Required(str)
        resolved_commit = Optional(str, nullable=True)
        result_branch = Required(str)
        commits = Required(int, default=0)
        exit_code = Optional(int)
        error = Optional(str, nullable=True)
        result = Optional(orm.Json, nullable=True)
        agent_report = Optional(orm.Json, nullable=True)   # docs/agent-clis.md
        failure_kind = Optional(str, nullable=True)
        cost_usd = Optional(float)
        max_cost_usd = Optional(float)
        over_budget = Required(bool, default=False)
        question = Optional(str, nullable=True)            # a needs_you run's question
        continues = Optional(str, nullable=True)           # the needs_you run a reply continues
        rerun_of = Optional(str, nullable=True)            # the run a re-run repeats
        worktree_run = Optional(str, nullable=True)        # a reply works where the run it continues worked
        answered_by = Optional(str, nullable=True)         # the reply run that answered this one
        answer = Optional(str, nullable=True)              # the user's reply to its question, as written
        requested_by = Optional(str, nullable=True)        # the proposer key that dispatched it (its name)
        continues_branch = Required(bool, default=False)   # starts from its result branch's head when it exists
        resume_session_id = Optional(str, nullable=True)   # the agent session this run resumes
        pid = Optional(int)
        pid_started = Optional(str, nullable=True)   # /proc start time: a pid alone may be reused
        resume_requested_at = Optional(datetime)
        cancel_requested = Required(bool, default=False)
        notified = Required(bool, default=False)     # attention + failure streak applied
        node = Optional(str, nullable=True)          # the node that admitted it (docs/fleet.md)
        attempt = Required(int, default=0)           # admissions so far: with node, fences its writes
        queued_at = Required(datetime)
        started_at = Optional(datetime)
        finished_at = Optional(datetime)
        #: The instants of its launch that no other column holds (``run_steps``): worktree_ready
        #: and agent_started (written with its pid), first_output, agent_exited, branch_back (with
        #: its settlement), as RFC 3339 by step name.
        steps = Optional(orm.Json, nullable=True)

    class ProfileState(db.Entity):
        """An agent profile's standing (docs/agent-clis.md): limited until a reset, or paused for a login."""
        name = PrimaryKey(str)
        limited_until = Optional(datetime)
        limit_streak = Required(int, default=0)            # limits in a row that named no reset (the ladder)
        limit_message = Optional(str, nullable=True)
        paused_reason = Optional(str, nullable=True)
        updated_at = Required(datetime)

    class Attention(db.Entity):
        id = PrimaryKey(str)
        kind = Required(str)
        schedule_id = Optional(str, nullable=True)
        run_id = Optional(str, nullable=True)
        title = Required(str)
        detail = Optional(str, nullable=True)
        created_at = Required(datetime)
        acknowledged_at = Optional(datetime, index=True)
        link = Optional(str, nullable=True)   # the dashboard page that settles it (a proposal's review)
        agent_id = Optional(str, nullable=True)            # an Office agent's item (folds like a schedule's)
        times = Required(int, default=1)                   # how often it happened while open (folded)
        latest_at = Optional(datetime)
        run_ids = Optional(orm.Json, nullable=True)        # the runs folded in, newest first

    class NotifyTarget(db.Entity):
        """A notification entry added from the dashboard (docs/operations.md); outpost.toml's
        ``[[notify]]`` entries live in the config and are read-only."""
        id = PrimaryKey(str)
        url = Required(str, unique=True)
        label = Required(str)                              # the URL with its secrets masked: all a page shows
        kinds = Required(orm.Json)
        digest = Optional(str, nullable=True)
        created_at = Required(datetime)
        updated_at = Required(datetime)

    class Event(db.Entity):
        cursor = PrimaryKey(int)
        type = Required(str)
        at = Required(datetime)
        data = Required(orm.Json)

    class EventSequence(db.Entity):
        """One row: the last event cursor, bumped as the last write of a transaction (SQLite;
        PostgreSQL numbers events by its event_cursor sequence)."""
        id = PrimaryKey(int)
        value = Required(int)

    class DashboardSession(db.Entity):
        """A signed-in browser. ``id`` is the SHA-256 of the cookie, so a database leak is no login."""
        id = PrimaryKey(str)
        csrf = Required(str)
        created_at = Required(datetime)
        expires_at = Required(datetime, index=True)
        flash = Optional(orm.Json, nullable=True)   # what the page a form redirected to shows once (a secret)

    class SigninCode(db.Entity):
        """A one-time sign-in link printed by ``outpost serve`` (stored as its SHA-256)."""
        id = PrimaryKey(str)
        expires_at = Required(datetime)
        used_at = Optional(datetime)

    class IdempotencyRecord(db.Entity):
        key = PrimaryKey(str)
        fingerprint = Required(str)
        state = Required(str)              # in_flight | done
        node = Optional(str, nullable=True)   # the node whose request holds it in flight
        status = Optional(int)
        body = Optional(orm.Json, nullable=True)
        created_at = Required(datetime, index=True)

    # --- Office (docs/office.md): workspaces, agents, tasks, the wakeup queue ----------

    class Workspace(db.Entity):
        id = PrimaryKey(str)
        name = Required(str, unique=True)
        timezone = Required(str, default="UTC")
        repository = Optional(str, nullable=True)          # where Office runs get their worktrees
        source_ref = Required(str, default="HEAD")
        default_executor = Optional(str, nullable=True)
        recovery_lookback_hours = Required(int, default=24)
        budget_runs_per_day = Optional(int)
        budget_usd_per_day = Optional(float)
        budget_usd_per_month = Optional(float)
        budget_action = Required(str, default="pause")     # pause | skip (action_on_exceed)
        created_at = Required(datetime)

    class Project(db.Entity):
        id = PrimaryKey(str)
        workspace_id = Required(str, index=True)
        name = Required(str)
        repository = Optional(str, nullable=True)
        executor = Optional(str, nullable=True)
        budget_runs_per_day = Optional(int)
        budget_usd_per_day = Optional(float)
        budget_usd_per_month = Optional(float)
        created_at = Required(datetime)

    class Agent(db.Entity):
        id = PrimaryKey(str)
        workspace_id = Required(str, index=True)
        name = Required(str)
        role = Required(str)
        status = Required(str)                             # idle | working | paused | stopped
        executor = Optional(str, nullable=True)            # agent profile name
        instructions = Optional(str, nullable=True)
        max_concurrent_sessions = Required(int, default=1)
        cooldown_sec = Required(int, default=10)
        skip_idle_wakeups = Required(bool)
        budget_runs_per_day = Optional(int)
        budget_usd_per_day = Optional(float)
        budget_usd_per_month = Optional(float)
        last_wakeup_finished_at = Optional(datetime)
        created_at = Required(datetime)
        updated_at = Required(datetime)

    class Task(db.Entity):
        id = PrimaryKey(str)
        workspace_id = Required(str, index=True)
        project_id = Optional(str, nullable=True)
        workflow = Required(str, default="office")         # office | kanban (see is_office_task)
        title = Required(str)
        description = Optional(str, default="")
        state = Required(str)
        assignee_agent_id = Optional(str, nullable=True)
        parent_id = Optional(str, nullable=True, index=True)
        blocked_by = Optional(orm.Json)
        requires_approval = Required(bool, default=False)
        reviewers = Optional(orm.Json)
        executor = Optional(str, nullable=True)
        checkout_agent_id = Optional(str, nullable=True)   # the atomic checkout lock
        checkout_at = Optional(datetime)
        archived_at = Optional(datetime)
        created_at = Required(datetime)
        updated_at = Required(datetime)

    class Comment(db.Entity):
        id = PrimaryKey(str)
        task_id = Required(str, index=True)
        author_agent_id = Optional(str, nullable=True)     # None: the user
        body = Required(str)
        mentions = Optional(orm.Json, nullable=True)       # [{"name", "agent_id" | None}] (docs/office.md)
        author = Optional(str, nullable=True)              # a person's name on a channel (Slack, Telegram)
        created_at = Required(datetime)

    class Approval(db.Entity):
        id = PrimaryKey(str)
        workspace_id = Required(str, index=True)
        task_id = Required(str)
        requested_by_agent_id = Optional(str, nullable=True)
        note = Optional(str, default="")
        status = Required(str)                             # pending | approved | rejected
        decision_note = Optional(str, default="")
        created_at = Required(datetime)
        resolved_at = Optional(datetime)

    class Wakeup(db.Entity):
        id = PrimaryKey(str)
        workspace_id = Required(str)
        agent_id = Required(str)
        source = Required(str)
        reason = Required(str)
        payload = Required(orm.Json)
        task_id = Optional(str, nullable=True)             # the scope: coalescing never crosses it
        status = Required(str)
        cancel_reason = Optional(str, nullable=True)
        note = Optional(str, nullable=True)                # why a wakeup ended without a run
        coalesced_count = Required(int, default=1)
        coalesced_into = Optional(str, nullable=True)
        idempotency_key = Optional(str, nullable=True)     # UNIQUE (SCHEMA_SQL 4)
        retry_count = Required(int, default=0)
        scheduled_retry_at = Optional(datetime)
        wake_at = Optional(datetime)                       # a self-wake asked for later
        context_snapshot = Required(orm.Json)
        run_id = Optional(str, nullable=True)
        last_error = Optional(str, nullable=True)
        requested_at = Required(datetime)
        claimed_at = Optional(datetime)
        finished_at = Optional(datetime)

    class OfficeRun(db.Entity):
        """The Office facts of a run that a wakeup produced (the run itself is a Run)."""
        run_id = PrimaryKey(str)
        wakeup_id = Required(str)
        agent_id = Required(str)
        workspace_id = Required(str)
        task_id = Optional(str, nullable=True)
        assembled_prompt = Required(str)
        summary_injected = Optional(str, default="")
        context_snapshot = Required(orm.Json)
        session_id = Optional(str, nullable=True)          # the session resumed, else the one it reported
        resumed = Required(bool, default=False)
        queued_at = Required(datetime)

    class AgentSession(db.Entity):
        """The agent CLI session of a (task, agent) pair, resumed by the next task-bound wakeup."""
        agent_id = Required(str)
        task_id = Required(str)
        PrimaryKey(agent_id, task_id)
        session_id = Required(str)
        run_id = Required(str)
        updated_at = Required(datetime)

    class ContinuationSummary(db.Entity):
        agent_id = Required(str)
        scope = Required(str)                              # routine:<id>, or taskless
        PrimaryKey(agent_id, scope)
        content = Optional(str, default="")
        content_tokens = Required(int, default=0)
        updated_at = Required(datetime)
        updated_by_run_id = Optional(str, default="")

    class Activity(db.Entity):
        id = PrimaryKey(int, auto=True)
        workspace_id = Required(str)
        code = Required(str)
        agent_id = Optional(str, nullable=True)
        task_id = Optional(str, nullable=True)
        wakeup_id = Optional(str, nullable=True)
        run_id = Optional(str, nullable=True)
        data = Optional(orm.Json)
        created_at = Required(datetime)

    class Routine(db.Entity):
        """A task template (or taskless wake) with triggers: the Office side of a schedule."""
        id = PrimaryKey(str)
        workspace_id = Required(str, index=True)
        name = Required(str)
        description = Optional(str, default="")
        assignee_agent_id = Required(str)
        status = Required(str)                             # active | paused | archived
        concurrency_policy = Required(str)
        catch_up_policy = Required(str)
        catch_up_max = Required(int, default=25)
        priority = Required(int, default=0)
        task_template = Optional(orm.Json)                 # {} -> lightweight (taskless) routine
        variables = Optional(orm.Json)
        created_at = Required(datetime)
        updated_at = Required(datetime)

    class RoutineTrigger(db.Entity):
        id = PrimaryKey(str)
        routine_id = Required(str, index=True)
        kind = Required(str)                               # schedule | webhook | manual
        cron_expression = Optional(str, nullable=True)
        timezone = Optional(str, nullable=True)
        next_run_at = Optional(datetime, index=True)       # advanced in the claim's transaction
        last_fired_at = Optional(datetime)
        public_id = Optional(str, nullable=True, unique=True)
        signing_mode = Optional(str, nullable=True)
        secret = Optional(str, nullable=True)              # never shown again after creation
        previous_secret = Optional(str, nullable=True)     # still accepted until previous_secret_until
        previous_secret_until = Optional(datetime)
        enabled = Required(bool, default=True)
        created_at = Required(datetime)

    class RoutineRun(db.Entity):
        """One firing of a routine trigger: the routine's history (and, for cron, its ledger:
        UNIQUE (trigger_id, due_at) in SCHEMA_SQL 5 means a tick fires once)."""
        id = PrimaryKey(str)
        routine_id = Required(str, index=True)
        trigger_id = Required(str)
        source = Required(str)                             # cron | webhook | manual
        status = Required(str)                             # received | task_created | skipped | coalesced | failed
        due_at = Optional(datetime)
        missed_ticks = Required(int, default=0)
        trigger_payload = Optional(orm.Json)
        linked_task_id = Optional(str, nullable=True)
        wakeup_id = Optional(str, nullable=True)
        coalesced_into_run_id = Optional(str, nullable=True)
        dispatch_fingerprint = Required(str)
        error = Optional(str, nullable=True)
        started_at = Required(datetime)
        completed_at = Optional(datetime)

    class ChannelState(db.Entity):
        """A ``[[channels]]`` entry as it stands (docs/office.md, "Channels"): the task it feeds, and the
        last message in and out."""
        name = PrimaryKey(str)
        kind = Required(str)
        task_id = Required(str)
        last_in_at = Optional(datetime)
        last_out_at = Optional(datetime)
        last_error = Optional(str, nullable=True)

    class ChannelDelivery(db.Entity):
        """A message a channel delivered (its service's event or update id): UNIQUE (channel,
        delivery_id) in SCHEMA_SQL 16 makes a retry or a replay add nothing."""
        id = PrimaryKey(int, auto=True)
        channel = Required(str)
        delivery_id = Required(str)
        comment_id = Optional(str, nullable=True)
        created_at = Required(datetime, index=True)

    class WebhookRefusal(db.Entity):
        id = PrimaryKey(int, auto=True)
        trigger_id = Required(str, index=True)
        reason = Required(str)
        source_address = Optional(str, nullable=True)
        size = Required(int)
        created_at = Required(datetime)

    class Node(db.Entity):
        """A process serving this database (docs/fleet.md): alive while its heartbeat, written on
        the database's clock, is under NODE_LOST_S old."""
        name = PrimaryKey(str)
        started_at = Required(datetime)
        heartbeat_at = Required(datetime)
        max_running = Required(int)
        status = Required(str)             # up | lost
        orphans = Optional(orm.Json, nullable=True)   # [run id, pid, pid start] settled while it was lost
        process = Optional(str, nullable=True)         # the process holding the name (this_process); NULL: free

    class LogChunk(db.Entity):
        """A fleet (docs/fleet.md): a run's log in the database, so every node serves it. The node
        running it appends what its log file gained (at byte ``at_byte``); at settlement one chunk
        replaces them: the file as it ended, head and tail."""
        run_id = Required(str)
        at_byte = Required(int, size=64)
        data = Required(bytes)
        PrimaryKey(run_id, at_byte)

    class WebhookReplay(db.Entity):
        """Signatures and GitHub delivery ids already accepted: a repeat is refused, by key."""
        key = PrimaryKey(str)
        routine_run_id = Required(str)
        expires_at = Required(datetime, index=True)

    class AccessKey(db.Entity):
        """A key for a person's own agent (``outpost keys create --proposer``): it may look and
        propose, never decide. Only the key's SHA-256 is kept; revoking deletes the row."""
        name = PrimaryKey(str)
        role = Required(str)                     # proposer
        digest = Required(str, unique=True)
        created_at = Required(datetime)

    class Proposal(db.Entity):
        """A schedule change a proposer key asked for, waiting for a human (docs/agent-clis.md):
        a new schedule, a change to one (made from ``base_revision``), or a control action."""
        id = PrimaryKey(str)
        kind = Required(str)                     # create | change | control
        state = Required(str, index=True)        # pending | confirmed | declined | stale
        schedule_id = Optional(str, nullable=True)
        body = Required(orm.Json)                # {"definition"} | {"changes"} | {"action"}
        base_revision = Optional(int)
        review = Required(orm.Json)              # summary, next fires, warnings, diff
        proposed_by = Required(str)
        attention_id = Optional(str, nullable=True)
        note = Optional(str, nullable=True)
        created_at = Required(datetime)
        decided_at = Optional(datetime)

    class Notification(db.Entity):
        """The outbox (docs/operations.md): one message for one ``[[notify]]`` entry, written in the
        transaction that raised its attention item (or queued its digest or test). The rows are
        the truth: a restart resumes them; UNIQUE (entry, item) in SCHEMA_SQL 11 means an item
        reaches an entry once."""
        id = PrimaryKey(int, auto=True)
        entry = Required(str)                  # NotifyEntry.key
        item = Optional(str, nullable=True)    # an attention id, or "digest:<local date>"; NULL: a test
        kind = Required(str)                   # an attention kind, digest or test
        title = Required(str)
        body = Optional(str, nullable=True)
        link = Optional(str, nullable=True)    # a dashboard path (/runs/<id>)
        status = Required(str)                 # queued | sending | delivered | given_up
        attempts = Required(int, default=0)
        next_at = Required(datetime)           # queued: when to try (again)
        sending_at = Optional(datetime)        # the last attempt's start (a stale "sending": NOTIFY_SENDING_STALE_S)
        delivered_at = Optional(datetime)
        last_error = Optional(str, nullable=True)
        created_at = Required(datetime)


#: SQL run once per schema version, after Pony created the tables that are missing
#: (new entities). Constraints Pony cannot declare live here, so every rule is in the database.
SCHEMA_SQL = {
    1: [
        'CREATE UNIQUE INDEX IF NOT EXISTS schedule_live_name ON "Schedule"(name) WHERE NOT archived',
        'CREATE INDEX IF NOT EXISTS run_admission ON "Run"(status, queued_at)',
        'CREATE INDEX IF NOT EXISTS run_schedule ON "Run"(schedule, status)',
        'CREATE INDEX IF NOT EXISTS event_at ON "Event"(at)',
    ],
    3: [   # each schedule's newest run without reading all runs (the schedules page)
        'CREATE INDEX IF NOT EXISTS run_schedule_newest ON "Run"(schedule, id)',
    ],
    4: [   # Office: source-level dedup is a constraint; the claim query and the boards are indexed
        'CREATE UNIQUE INDEX IF NOT EXISTS wakeup_idempotency ON "Wakeup"(idempotency_key) '
        'WHERE idempotency_key IS NOT NULL',
        'CREATE INDEX IF NOT EXISTS wakeup_queue ON "Wakeup"(status, requested_at)',
        'CREATE INDEX IF NOT EXISTS wakeup_retry_due ON "Wakeup"(status, scheduled_retry_at)',
        'CREATE INDEX IF NOT EXISTS wakeup_wake_due ON "Wakeup"(status, wake_at)',
        'CREATE INDEX IF NOT EXISTS wakeup_window ON "Wakeup"(agent_id, task_id, status, requested_at)',
        'CREATE INDEX IF NOT EXISTS task_open ON "Task"(workspace_id, state)',
        'CREATE INDEX IF NOT EXISTS wakeup_agent ON "Wakeup"(agent_id, status, requested_at)',
        'CREATE INDEX IF NOT EXISTS wakeup_scope ON "Wakeup"(task_id, status)',
        'CREATE INDEX IF NOT EXISTS wakeup_coalesced ON "Wakeup"(coalesced_into)',
        'CREATE UNIQUE INDEX IF NOT EXISTS agent_name ON "Agent"(workspace_id, name)',
        'CREATE INDEX IF NOT EXISTS task_assignee ON "Task"(assignee_agent_id, state)',
        'CREATE INDEX IF NOT EXISTS office_run_agent ON "OfficeRun"(agent_id, queued_at)',
        'CREATE INDEX IF NOT EXISTS office_run_workspace ON "OfficeRun"(workspace_id, queued_at)',
        'CREATE INDEX IF NOT EXISTS activity_feed ON "Activity"(workspace_id, code, id)',
    ],
    5: [   # routines: a cron tick of a trigger fires once, by constraint
        'CREATE UNIQUE INDEX IF NOT EXISTS routine_run_tick ON "RoutineRun"(trigger_id, due_at) '
        'WHERE due_at IS NOT NULL',
        'CREATE INDEX IF NOT EXISTS routine_run_history ON "RoutineRun"(routine_id, started_at)',
        'CREATE INDEX IF NOT EXISTS trigger_schedule ON "RoutineTrigger"(kind, next_run_at)',
    ],
    6: [   # a lightweight routine run completes with its wakeup
        'CREATE INDEX IF NOT EXISTS routine_run_wakeup ON "RoutineRun"(wakeup_id) WHERE wakeup_id IS NOT NULL',
    ],
    7: [   # agent CLIs: the agent report, limits and logins, replies, budgets in dollars, profile digests
        'ALTER TABLE "Schedule" ADD COLUMN profile_digest TEXT',
        'ALTER TABLE "Run" ADD COLUMN agent_report JSON',
        'ALTER TABLE "Run" ADD COLUMN failure_kind TEXT',
        'ALTER TABLE "Run" ADD COLUMN cost_usd REAL',
        'ALTER TABLE "Run" ADD COLUMN max_cost_usd REAL',
        'ALTER TABLE "Run" ADD COLUMN over_budget BOOLEAN NOT NULL DEFAULT FALSE',
        'ALTER TABLE "Run" ADD COLUMN question TEXT',
        'ALTER TABLE "Run" ADD COLUMN continues TEXT',
        'ALTER TABLE "Run" ADD COLUMN worktree_run TEXT',
        'ALTER TABLE "Run" ADD COLUMN answered_by TEXT',
        'ALTER TABLE "Run" ADD COLUMN continues_branch BOOLEAN NOT NULL DEFAULT FALSE',
        'ALTER TABLE "Run" ADD COLUMN resume_session_id TEXT',
        'ALTER TABLE "Workspace" ADD COLUMN budget_usd_per_day REAL',
        'ALTER TABLE "Workspace" ADD COLUMN budget_usd_per_month REAL',
        'ALTER TABLE "Workspace" ADD COLUMN budget_action TEXT NOT NULL DEFAULT \'pause\'',
        'ALTER TABLE "Project" ADD COLUMN budget_runs_per_day INTEGER',
        'ALTER TABLE "Project" ADD COLUMN budget_usd_per_day REAL',
        'ALTER TABLE "Project" ADD COLUMN budget_usd_per_month REAL',
        'ALTER TABLE "Agent" ADD COLUMN budget_usd_per_day REAL',
        'ALTER TABLE "Agent" ADD COLUMN budget_usd_per_month REAL',
        'CREATE INDEX IF NOT EXISTS run_profile ON "Run"(agent, status)',
        'CREATE INDEX IF NOT EXISTS run_cost ON "Run"(finished_at) WHERE cost_usd IS NOT NULL',
    ],
    8: [   # beyond the seeds: catch-up plans, re-runs, the charts' day counts
        'ALTER TABLE "Schedule" ADD COLUMN pending_catch_up JSON',
        'ALTER TABLE "Run" ADD COLUMN rerun_of TEXT',
        'CREATE INDEX IF NOT EXISTS run_queued_day ON "Run"(queued_at)',
        'CREATE INDEX IF NOT EXISTS occurrence_recorded ON "Occurrence"(created_at)',
    ],
    9: [   # a fleet: runs belong to the node that admitted them
        'ALTER TABLE "Run" ADD COLUMN node TEXT',
        'ALTER TABLE "Run" ADD COLUMN attempt INTEGER NOT NULL DEFAULT 0',
        'ALTER TABLE "IdempotencyRecord" ADD COLUMN node TEXT',
        'CREATE INDEX IF NOT EXISTS run_node ON "Run"(node, status)',
    ],
    10: [   # a node's name is one process's at a time
        'ALTER TABLE "Node" ADD COLUMN process TEXT',
    ],
    11: [   # GET /metrics: its grouped counts read an index, not every run (11 ms at 100,000 runs, not 110)
        'CREATE INDEX IF NOT EXISTS run_tally ON "Run"(status, agent, "trigger", cost_usd)',
        'CREATE INDEX IF NOT EXISTS wakeup_tally ON "Wakeup"(source, status)',
    ],
    12: [   # the notification outbox: an item once per entry; the actor's due query
        'CREATE UNIQUE INDEX IF NOT EXISTS notification_item ON "Notification"(entry, item) WHERE item IS NOT NULL',
        'CREATE INDEX IF NOT EXISTS notification_due ON "Notification"(status, next_at)',
        'CREATE INDEX IF NOT EXISTS notification_entry ON "Notification"(entry, id)',
    ],
    13: [   # the dashboard: a needs_you run's answer for its thread; a secret shown once after a redirect
        'ALTER TABLE "Run" ADD COLUMN answer TEXT',
        'ALTER TABLE "DashboardSession" ADD COLUMN flash JSON',
    ],
    14: [   # a year of history (tests/bench, the year row): reads that stay small as the tables grow
        'CREATE INDEX IF NOT EXISTS run_unnotified ON "Run"(id) WHERE NOT notified',   # the start's one lookup
        'CREATE INDEX IF NOT EXISTS run_schedule_queued ON "Run"(schedule, queued_at)',   # a schedule's chart
        'CREATE INDEX IF NOT EXISTS run_chart ON "Run"(queued_at, status, cost_usd)',   # the runs chart, index only
        'CREATE INDEX IF NOT EXISTS run_result_branch ON "Run"(result_branch)',   # housekeeping's branch check
        # (substr, not LIKE: SQLite's LIKE may be made case-sensitive, so no partial index takes it)
        'CREATE INDEX IF NOT EXISTS occurrence_skipped ON "Occurrence"(due_at) '
        "WHERE substr(outcome, 1, 7) = 'skipped'",
        'CREATE INDEX IF NOT EXISTS attention_run ON "Attention"(run_id)',
        'CREATE INDEX IF NOT EXISTS attention_schedule ON "Attention"(schedule_id, kind, created_at)',   # inspect
    ],
    15: [   # a person's own agent: who dispatched a run; proposals listed newest first
        'ALTER TABLE "Run" ADD COLUMN requested_by TEXT',
        'ALTER TABLE "Attention" ADD COLUMN link TEXT',
        'ALTER TABLE "Comment" ADD COLUMN mentions JSON',
        'CREATE INDEX IF NOT EXISTS proposal_newest ON "Proposal"(created_at, id)',
    ],
    16: [   # channels: a delivery is taken once; a comment's author on a channel
        'ALTER TABLE "Comment" ADD COLUMN author TEXT',
        'CREATE UNIQUE INDEX IF NOT EXISTS channel_delivery_once ON "ChannelDelivery"(channel, delivery_id)',
    ],
    17: [   # attention folds (an open item counts what happened again); notification entries from the dashboard
        'ALTER TABLE "Attention" ADD COLUMN agent_id TEXT',
        'ALTER TABLE "Attention" ADD COLUMN times INTEGER NOT NULL DEFAULT 1',
        'ALTER TABLE "Attention" ADD COLUMN latest_at TIMESTAMP',
        'ALTER TABLE "Attention" ADD COLUMN run_ids JSON',
    ],
    18: [   # a run's timeline: the instants of its launch (GET /v1/outpost/runs/<id> "steps")
        'ALTER TABLE "Run" ADD COLUMN steps JSON',
    ],
}


# --- views: entities as the API shows them --------------------------------------------

def schedule_view(s, active_run_id: str | None) -> dict[str, Any]:
    """The API's schedule, with the id of its active run (or None)."""
    return {**s.definition, "id": s.id, "revision": s.revision, "enabled": s.enabled,
            "archived": s.archived, "auto_paused": s.auto_paused, "failure_streak": s.failure_streak,
            "next_fire_at": rfc3339(aware(s.next_fire_at)), "last_fired_at": rfc3339(aware(s.last_fired_at)),
            "active_run_id": active_run_id,
            "authority": {"confirmation": s.confirmation, "confirmed_at": rfc3339(aware(s.confirmed_at)),
                          "profile_digest": s.profile_digest},
            "pending_catch_up": {"missed_count_exact": True, **s.pending_catch_up} if s.pending_catch_up else None,
            "created_at": rfc3339(aware(s.created_at)), "updated_at": rfc3339(aware(s.updated_at))}


def run_view(r) -> dict[str, Any]:
    return {"id": r.id, "schedule_id": r.schedule.id if r.schedule else None,
            "occurrence_id": r.occurrence_id, "agent": r.agent, "trigger": r.trigger,
            "due_at": rfc3339(aware(r.due_at)), "missed_count": r.missed_count, "status": r.status,
            "owner": r.owner, "repository": r.repository, "workdir": r.workdir,
            "source_ref": r.source_ref, "resolved_commit": r.resolved_commit,
            "result_branch": r.result_branch, "changes": {"commits": r.commits},
            "exit_code": r.exit_code, "error": r.error, "queued_at": rfc3339(aware(r.queued_at)),
            "started_at": rfc3339(aware(r.started_at)), "finished_at": rfc3339(aware(r.finished_at)),
            "result": r.result, "agent_report": r.agent_report, "failure_kind": r.failure_kind,
            "cost_usd": r.cost_usd, "max_cost_usd": r.max_cost_usd, "over_budget": r.over_budget,
            "model": r.model or (r.agent_report or {}).get("model"), "question": r.question,
            "continues": r.continues, "answered_by": r.answered_by, "answer": r.answer, "rerun_of": r.rerun_of,
            "requested_by": r.requested_by,
            "node": r.node, "steps": run_steps(aware(r.queued_at), r.steps, aware(r.finished_at))}


#: A run's timeline (docs/schedules.md, "The run page"), in the order its steps happen when they all do.
RUN_STEPS = ("queued", "worktree_ready", "agent_started", "first_output", "agent_exited", "branch_back", "settled")


def instant_ms(dt: datetime) -> str:
    """RFC 3339 UTC to the millisecond, always (a timeline's instants line up)."""
    return dt.astimezone(UTC).replace(tzinfo=None).isoformat(timespec="milliseconds") + "Z"


def run_steps(queued_at: datetime, steps: dict[str, str] | None, finished_at: datetime | None) -> list[dict[str, str]]:
    """The steps that happened, in time order (ties in RUN_STEPS order): queued and settled are the
    run's own columns, the rest its ``steps``, recorded by its supervisor."""
    at = {"queued": queued_at, **{k: datetime.fromisoformat(v) for k, v in (steps or {}).items() if k in RUN_STEPS},
          **({"settled": finished_at} if finished_at else {})}
    ordered = sorted(at, key=lambda k: (at[k], RUN_STEPS.index(k)))
    return [{"step": k, "at": instant_ms(at[k])} for k in ordered]


def profile_state_view(name: str, st, *, running: int, queued: int, last_run_at: datetime | None,
                       cost_usd_24h: float, now: datetime) -> dict[str, Any]:
    """The standing of one agent profile (docs/agent-clis.md), without its configuration."""
    limited = st is not None and st.limited_until is not None and aware(st.limited_until) > now
    return {"name": name, "running": running, "queued": queued,
            "limited_until": rfc3339(aware(st.limited_until)) if limited else None,
            "limit_message": st.limit_message if limited else None,
            "paused_reason": st.paused_reason if st is not None else None,
            "last_run_at": rfc3339(last_run_at), "cost_usd_24h": round(cost_usd_24h, 6)}


def occurrence_view(o) -> dict[str, Any]:
    return {"id": o.id, "schedule_id": o.schedule.id, "due_at": rfc3339(aware(o.due_at)),
            "trigger": o.trigger, "outcome": o.outcome, "missed_count": o.missed_count,
            "run_id": o.run_id, "recorded_at": rfc3339(aware(o.created_at))}


def attention_view(a) -> dict[str, Any]:
    run_ids = a.run_ids if a.run_ids is not None else [a.run_id] if a.run_id else []
    return {"id": a.id, "kind": a.kind, "schedule_id": a.schedule_id, "agent_id": a.agent_id, "run_id": a.run_id,
            "title": a.title, "detail": a.detail, "created_at": rfc3339(aware(a.created_at)),
            "acknowledged_at": rfc3339(aware(a.acknowledged_at)), "link": a.link, "count": a.times,
            "latest_at": rfc3339(aware(a.latest_at or a.created_at)), "run_ids": run_ids}


def proposal_view(p, now: datetime) -> dict[str, Any]:
    """A proposal as the API shows it; a pending one older than PROPOSAL_TTL_S reads ``stale``."""
    expired = p.state == ProposalState.PENDING and aware(p.created_at) <= now - timedelta(seconds=PROPOSAL_TTL_S)
    return {"id": p.id, "kind": p.kind, "state": ProposalState.STALE if expired else p.state,
            "schedule_id": p.schedule_id, **p.body, "base_revision": p.base_revision, "review": p.review,
            "proposed_by": p.proposed_by, "created_at": rfc3339(aware(p.created_at)),
            "decided_at": rfc3339(aware(p.decided_at)), "note": p.note}


def agent_view(a) -> dict[str, Any]:
    return {"id": a.id, "workspace_id": a.workspace_id, "name": a.name, "role": a.role, "status": a.status,
            "executor": a.executor, "instructions": a.instructions,
            "max_concurrent_sessions": a.max_concurrent_sessions, "cooldown_sec": a.cooldown_sec,
            "skip_idle_wakeups": a.skip_idle_wakeups, "budget_runs_per_day": a.budget_runs_per_day,
            "budget_usd_per_day": a.budget_usd_per_day, "budget_usd_per_month": a.budget_usd_per_month,
            "last_wakeup_finished_at": rfc3339(aware(a.last_wakeup_finished_at)),
            "created_at": rfc3339(aware(a.created_at)), "updated_at": rfc3339(aware(a.updated_at))}


def task_view(t) -> dict[str, Any]:
    return {"id": t.id, "workspace_id": t.workspace_id, "title": t.title, "description": t.description,
            "state": t.state, "assignee_agent_id": t.assignee_agent_id, "parent_id": t.parent_id,
            "blocked_by": t.blocked_by or [], "requires_approval": t.requires_approval,
            "reviewers": t.reviewers or [], "project_id": t.project_id, "workflow": t.workflow,
            "executor": t.executor, "checkout_agent_id": t.checkout_agent_id,
            "archived_at": rfc3339(aware(t.archived_at)), "created_at": rfc3339(aware(t.created_at)),
            "updated_at": rfc3339(aware(t.updated_at))}


def wakeup_view(w) -> dict[str, Any]:
    return {"id": w.id, "workspace_id": w.workspace_id, "agent_id": w.agent_id, "source": w.source,
            "reason": w.reason, "status": w.status, "cancel_reason": w.cancel_reason, "note": w.note,
            "coalesced_count": w.coalesced_count, "coalesced_into": w.coalesced_into,
            "retry_count": w.retry_count, "scheduled_retry_at": rfc3339(aware(w.scheduled_retry_at)),
            "wake_at": rfc3339(aware(w.wake_at)), "idempotency_key": w.idempotency_key, "payload": w.payload,
            "task_id": w.task_id, "run_id": w.run_id, "last_error": w.last_error,
            "requested_at": rfc3339(aware(w.requested_at)), "claimed_at": rfc3339(aware(w.claimed_at)),
            "finished_at": rfc3339(aware(w.finished_at))}


def comment_view(c) -> dict[str, Any]:
    return {"id": c.id, "task_id": c.task_id, "author_agent_id": c.author_agent_id, "author": c.author,
            "body": c.body, "mentions": c.mentions or [], "created_at": rfc3339(aware(c.created_at))}


def approval_view(a) -> dict[str, Any]:
    return {"id": a.id, "workspace_id": a.workspace_id, "task_id": a.task_id,
            "requested_by_agent_id": a.requested_by_agent_id, "note": a.note, "status": a.status,
            "decision_note": a.decision_note, "created_at": rfc3339(aware(a.created_at)),
            "resolved_at": rfc3339(aware(a.resolved_at))}


def workspace_view(ws) -> dict[str, Any]:
    return {"id": ws.id, "name": ws.name, "timezone": ws.timezone, "repository": ws.repository,
            "source_ref": ws.source_ref, "default_executor": ws.default_executor,
            "recovery_lookback_hours": ws.recovery_lookback_hours,
            "budget_runs_per_day": ws.budget_runs_per_day, "budget_usd_per_day": ws.budget_usd_per_day,
            "budget_usd_per_month": ws.budget_usd_per_month, "budget_action": ws.budget_action}


def activity_view(x) -> dict[str, Any]:
    return {"id": x.id, "workspace_id": x.workspace_id, "code": x.code, "agent_id": x.agent_id,
            "task_id": x.task_id, "wakeup_id": x.wakeup_id, "run_id": x.run_id, "data": x.data or {},
            "created_at": rfc3339(aware(x.created_at))}


def project_view(p) -> dict[str, Any]:
    return {"id": p.id, "workspace_id": p.workspace_id, "name": p.name, "repository": p.repository,
            "executor": p.executor, **{f: getattr(p, f) for f in BUDGET_FIELDS}}


def trigger_view(t) -> dict[str, Any]:
    view = {"id": t.id, "routine_id": t.routine_id, "kind": t.kind, "cron_expression": t.cron_expression,
            "timezone": t.timezone, "next_run_at": rfc3339(aware(t.next_run_at)),
            "last_fired_at": rfc3339(aware(t.last_fired_at)), "public_id": t.public_id,
            "signing_mode": t.signing_mode, "enabled": t.enabled,
            "previous_secret_valid_until": rfc3339(aware(t.previous_secret_until))}
    if t.public_id:
        view["fire_path"] = f"/api/routine-triggers/{t.public_id}/fire"
    return view


def routine_run_view(x) -> dict[str, Any]:
    return {"id": x.id, "routine_id": x.routine_id, "trigger_id": x.trigger_id, "source": x.source,
            "status": x.status, "due_at": rfc3339(aware(x.due_at)), "missed_ticks": x.missed_ticks,
            "trigger_payload": x.trigger_payload or {}, "linked_task_id": x.linked_task_id,
            "wakeup_id": x.wakeup_id, "coalesced_into_run_id": x.coalesced_into_run_id,
            "dispatch_fingerprint": x.dispatch_fingerprint, "error": x.error,
            "started_at": rfc3339(aware(x.started_at)), "completed_at": rfc3339(aware(x.completed_at))}


@dataclasses.dataclass(frozen=True, slots=True)
class Written:
    """One store call's end in a group commit: its result, whether it emitted events, or its error."""
    result: Any
    wrote: bool
    error: Exception | None


class GroupMemberFailed(Exception):
    """A call of a group raised: the group's transaction rolls back; ``index`` names the call."""

    def __init__(self, index: int):
        super().__init__(index)
        self.index = index


def serialization_failure(error: BaseException | None) -> bool:
    """Whether PostgreSQL rolled a transaction back because it could not stand beside a
    concurrent one (SERIALIZABLE's 40001, or a deadlock): running it again is always safe. Pony
    wraps the driver's error, in a failed flush as the context of its own."""
    while error is not None:
        if isinstance(error, orm.CommitException):
            return any(serialization_failure(exc) for _, exc, _ in error.exceptions)
        if getattr(getattr(error, "original_exc", error), "pgcode", None) in ("40001", "40P01"):
            return True
        error = error.__cause__ or error.__context__
    return False


def cannot_write(error: Exception | None) -> bool:
    """Whether a store error is the database's, not a call's: locked by another process past the
    busy timeout, or a full or failing disk (a failed commit comes wrapped), or PostgreSQL's
    serialization failure (a whole group's, run again; one that outlasts PG_ATTEMPTS)."""
    if serialization_failure(error):
        return True
    if not isinstance(error, orm.dbapiprovider.OperationalError | orm.CommitException):
        return False
    text = str(error).lower()   # SQLite's lock and disk; PostgreSQL's lost or refused connection
    return any(word in text for word in ("locked", "busy", "full", "disk", "no space left", "connect", "terminating"))


def disk_full(error: Exception | None) -> bool:
    """Whether an error says the disk is full: SQLite's SQLITE_FULL, ENOSPC (PostgreSQL's, a
    file's), git's words for it; for a store error that ``cannot_write``, not a lock or a lost
    connection."""
    text = str(error).lower()
    return any(words in text for words in ("disk is full", "no space left", "out of diskspace"))


def _run_group(db: orm.Database, calls: list[Callable[[], Any]]) -> list[Any]:
    results = []
    for index, call in enumerate(calls):
        try:
            results.append(call())
            orm.flush()
        except Exception as exc:
            if cannot_write(exc):   # the whole group's: nobody is run again into the same lock
                raise
            raise GroupMemberFailed(index) from exc
        _forget_loaded(db)
    return results


def _forget_loaded(db: orm.Database) -> None:
    """Between the calls of a group: a fresh Pony session cache on the same connection and
    transaction, so no call reads a row as an earlier call's Pony objects last saw it (a
    plain-SQL write does not update them)."""
    old = orm.core.local.db2cache.get(db)
    if old is None:   # the call read and wrote nothing
        return
    old.flush()   # what was written through Pony objects goes to the database, not away with them
    new = orm.core.SessionCache(db)
    new.connection, new.in_transaction, new.immediate = old.connection, old.in_transaction, old.immediate
    new.db_session, new.saved_fk_state = old.db_session, old.saved_fk_state
    old.connection, old.is_alive = None, False
    for obj in old.objects:
        obj._session_cache_ = None
    orm.core.local.db2cache[db] = new


def postgres_connection(bind: dict[str, Any]):
    """A psycopg2 connection of its own (outside Pony's pool), from Pony's bind arguments."""
    import psycopg2  # noqa: PLC0415 - the optional extra, checked by postgres_bind

    params = {k: v for k, v in bind.items() if k != "provider"}
    params["dbname"] = params.pop("database")
    return psycopg2.connect(**params)


def postgres_is_empty(url: str) -> bool:
    """Whether the database of a postgresql:// URL holds no table yet (``outpost migrate``'s target)."""
    connection = postgres_connection(postgres_bind(url))
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = current_schema()")
            return cursor.fetchone()[0] == 0
    finally:
        connection.close()


def postgres_bind(url: str) -> dict[str, Any]:
    """Pony's bind arguments for a postgresql:// URL. The password is the URL's or
    ``$OUTPOST_DATABASE_PASSWORD`` (docs/fleet.md); query parameters (``sslmode=require``) pass
    through to libpq."""
    try:
        import psycopg2  # noqa: F401, PLC0415 - the optional extra
    except ImportError:
        raise ConfigError("a PostgreSQL database needs its driver: pip install 'outpost[postgres]'") from None
    u = urllib.parse.urlsplit(url)
    if not u.path.strip("/"):
        raise ConfigError(f"the database URL {database_label(url)} names no database (postgresql://user@host/NAME)")
    bind = {"provider": "postgres", "host": u.hostname or "localhost", "port": u.port or 5432,
            "database": urllib.parse.unquote(u.path.strip("/")), **dict(urllib.parse.parse_qsl(u.query))}
    if u.username:
        bind["user"] = urllib.parse.unquote(u.username)
    if password := (urllib.parse.unquote(u.password) if u.password else os.environ.get("OUTPOST_DATABASE_PASSWORD")):
        bind["password"] = password
    return bind


def database_label(database: Path | str) -> str:
    """The database as logs and errors show it: a URL without its password."""
    if not is_postgres_url(database):
        return str(database)
    u = urllib.parse.urlsplit(str(database))
    user = f"{u.username}@" if u.username else ""
    return urllib.parse.urlunsplit((u.scheme, f"{user}{u.hostname or ''}{f':{u.port}' if u.port else ''}",
                                    u.path, "", ""))


#: The advisory locks of a PostgreSQL store: one from numbering a transaction's events to its
#: commit (cursors in commit order), and one around a schema migration.
PG_EVENT_LOCK, PG_MIGRATION_LOCK = 8_102_001, 8_102_002
#: A transaction's events go in by multi-row INSERTs of at most this many rows.
EVENT_INSERT_ROWS = 200
#: A PostgreSQL transaction that could not commit as if alone (SERIALIZABLE) runs again, up to
#: this many times in all, after a random pause of up to PG_RETRY_S times its attempt.
PG_ATTEMPTS, PG_RETRY_S = 50, 0.002



@contextlib.contextmanager
def postgres_migration_lock(bind: dict[str, Any]) -> Iterator[None]:
    """A session advisory lock on a connection of its own (Pony's pooled connection forgets
    session locks between db_sessions): nodes starting together migrate one after another."""
    connection = postgres_connection(bind)
    try:
        connection.autocommit = True
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(%s)", (PG_MIGRATION_LOCK,))
        yield
    finally:
        connection.close()   # ends the session, and its lock with it


class Dialect:
    """What differs between the appliance's SQLite and a fleet's PostgreSQL, chosen once at
    start (``dialect_of``): the SQL that differs, and how a node behaves when other nodes may
    share the database (polling for their work, heartbeats, logs kept in the database). The
    store and the actors ask it; nothing else tells the two apart. This one is SQLite's."""
    #: Other nodes may share the database: a node name held by one process, a heartbeat, runs
    #: handed over, pauses and freed slots seen by looking.
    fleet = False
    #: Run logs are copied into the database as they grow (another node's dashboard reads them).
    ships_logs = False
    #: How long the cron actor sleeps with nothing due (a schedule changed here nudges it).
    cron_sleep_s = CRON_MAX_SLEEP_S
    #: How often the claim actor looks for work another node made (None: only when nudged).
    claim_poll_s: float | None = None
    #: How long an event stream waits for a nudge before it reads the log again.
    stream_poll_s = 15.0
    #: The DB-API parameter mark of a raw cursor.
    placeholder = "?"
    #: SQL: the row (a run, an Idempotency-Key) is this process's. The one process of an
    #: appliance owns every row, whatever name its previous start had.
    own_rows = "1 = 1"
    #: SQL appended to the node upsert: when a restart may take over its node's row.
    node_takeover = ""

    @contextlib.contextmanager
    def bound(self, db: orm.Database, database: Path | str) -> Iterator[bool]:
        """Bind ``db``; yields whether the database is new, for as long as migrating takes."""
        @db.on_connect(provider="sqlite")
        def _pragmas(_db, connection):
            cur = connection.cursor()
            if not cur.execute("PRAGMA page_count").fetchone()[0]:   # a new database: space can be given back
                cur.execute("PRAGMA auto_vacuum=INCREMENTAL")        # (setting it later writes: never then)
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")   # a committed fire survives power loss
            cur.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            cur.execute("PRAGMA foreign_keys=ON")
            # SQLite's LOWER folds ASCII only: text search (Dialect.lower) folds as Python does
            connection.create_function("outpost_lower", 1, lambda v: v.lower() if isinstance(v, str) else v,
                                       deterministic=True)

        fresh = not Path(database).exists() if str(database) != ":memory:" else True
        if not fresh:
            incremental_vacuum_on(Path(database))
        db.bind(provider="sqlite", filename=str(database), create_db=True)
        db.provider.converter_classes = [(datetime, StoredInstant), *db.provider.converter_classes]
        yield fresh

    def migrated(self, db: orm.Database, version: int) -> None:
        """After the entities' tables exist: what this dialect adds, for a database at ``version``."""

    def columns(self, db: orm.Database, table: str) -> list[str]:
        return [row[1] for row in db.execute(f'PRAGMA table_info("{table}")').fetchall()]

    def retries(self, error: BaseException) -> bool:
        """Whether a transaction that raised ``error`` runs again (SQLite's writer lock never
        lets one fail for another's sake)."""
        return False

    def take_cursors(self, db: orm.Database, n: int) -> int:
        """The last of ``n`` event cursors taken for this transaction: the one-row EventSequence,
        whose update holds the writer lock to the commit."""
        return db.execute('UPDATE "EventSequence" SET value = value + $n WHERE id = 1 RETURNING value',
                          {"n": n}).fetchall()[0][0]

    def latest_cursor(self, db: orm.Database) -> int:
        return db.EventSequence[1].value

    def db_now(self, seconds: int = 0) -> str:
        """SQL for the database's clock (naive UTC), ``seconds`` from now: the one clock the
        nodes of a fleet share."""
        return f"strftime('%Y-%m-%d %H:%M:%f', 'now', '{seconds} seconds')"

    def age_s(self, column: str) -> str:
        """SQL for the seconds from the instant in ``column`` to now, on the database's clock."""
        return f"((julianday('now') - julianday({column})) * 86400.0)"

    def json_text(self, column: str, *path: str) -> str:
        """SQL for the text at ``path`` in a JSON column."""
        return f"json_extract({column}, '$$.{'.'.join(path)}')"

    def json_elements(self, column: str) -> str:
        """SQL for a JSON array column's elements as rows with a ``value`` column."""
        return f"json_each({column})"

    def lower(self, text: str) -> str:
        """SQL for ``text`` in lower case, every letter (not ASCII only), as Python's str.lower."""
        return f"outpost_lower({text})"

    def unindexed(self, column: str) -> str:
        """SQL for ``column`` that no index of it serves: SQLite's planner then takes the index
        the query means (a primary-key walk, the schedule's probe) instead of one that skips a
        sort by reading a year of rows."""
        return f"+{column}"

    def bucket(self, column: str, hours: bool) -> str:
        """SQL for an instant column's UTC hour (``YYYY-MM-DD HH``) or minute (``... HH:MM``) as
        text: what the charts group by, so a month of runs comes back as a row per hour or minute."""
        return f"substr({column}, 1, {13 if hours else 16})"

    def copied(self, cursor: Any, table: str, key: str | None) -> None:
        """After ``outpost migrate`` copied ``table`` in (``key``: its automatic key column)."""

    def database_bytes(self, db: orm.Database) -> int:
        """How big the database is: its pages (the file, once the WAL is checkpointed)."""
        return db.execute("PRAGMA page_count").fetchone()[0] * db.execute("PRAGMA page_size").fetchone()[0]

    def give_back_space(self, db: orm.Database) -> int:
        """After housekeeping deleted rows: return up to VACUUM_PAGES free pages to the file system
        (``auto_vacuum=INCREMENTAL``); how many free pages are left. The pragma frees one page per
        step (https://sqlite.org/pragma.html#pragma_incremental_vacuum), and Python's sqlite3 steps a
        statement that returns no columns once: so one page per execute (measured), in one transaction."""
        cursor = db.get_connection().cursor()
        left = cursor.execute("PRAGMA freelist_count").fetchone()[0]
        for _ in range(min(left, VACUUM_PAGES)):
            cursor.execute("PRAGMA incremental_vacuum")
        return cursor.execute("PRAGMA freelist_count").fetchone()[0]

    def continue_event_cursor(self, db: orm.Database) -> None:
        """After ``outpost migrate``: events go on from the last cursor copied."""

    def database_file(self, database: Path | str) -> Path | None:
        """The file the database lives in (its size on disk, a backup), if it is one."""
        return None if str(database) == ":memory:" else Path(database)

    #: Why ``outpost backup`` does not copy this database (None: it does, with ``backup``).
    backup_refusal: str | None = None

    def backup(self, database: Path | str, target: Path) -> None:
        """A consistent copy of the live database into the new file ``target``: SQLite's online
        backup API (https://www.sqlite.org/backup.html, ``sqlite3.Connection.backup``), in one step,
        so the copy is one snapshot even while the daemon writes (WAL: it never waits for us)."""
        source = sqlite3.connect(f"file:{urllib.parse.quote(str(database))}?mode=ro", uri=True,
                                 timeout=BUSY_TIMEOUT_MS / 1000)
        try:
            copy = sqlite3.connect(target)
            try:
                source.backup(copy)   # pages=-1: every page in one step, one read snapshot
                copy.execute("PRAGMA journal_mode=DELETE")   # one self-contained file, no -wal beside it
            finally:
                copy.close()
        finally:
            source.close()


class PostgresDialect(Dialect):
    """A fleet's PostgreSQL: SERIALIZABLE transactions run again on a serialization failure,
    events numbered by a sequence under an advisory lock, the database's clock shared by all."""
    fleet = ships_logs = True
    cron_sleep_s = CRON_FLEET_POLL_S
    claim_poll_s = stream_poll_s = FLEET_POLL_S
    placeholder = "%s"
    own_rows = "(node = $me OR node IS NULL)"
    node_takeover = ' WHERE "Node".process IS NULL OR "Node".process = excluded.process'

    @contextlib.contextmanager
    def bound(self, db: orm.Database, database: Path | str) -> Iterator[bool]:
        bind = postgres_bind(str(database))
        db.bind(**bind)
        # Pony lowercases generated table names on PostgreSQL; the plain SQL names "Run".
        db.provider.normalize_name = lambda name: name[:db.provider.max_name_len]
        with postgres_migration_lock(bind):   # two nodes starting together migrate one at a time
            with orm.db_session:
                fresh = not db.select("SELECT COUNT(*) FROM information_schema.tables "
                                      "WHERE table_schema = current_schema()")[0]
            yield fresh

    def migrated(self, db: orm.Database, version: int) -> None:
        if version < 12:   # idempotent: the keys of tables new since ``version`` too (the outbox's, 12)
            self.widen_auto_keys(db)
        if version < 10:
            db.execute("CREATE SEQUENCE IF NOT EXISTS event_cursor AS BIGINT")
            self.continue_event_cursor(db)

    def widen_auto_keys(self, db: orm.Database) -> None:
        """Pony makes an automatic key SERIAL on PostgreSQL (32-bit); ours are 64-bit, as on SQLite."""
        for entity in db.entities.values():
            if entity._pk_attrs_[0].auto:
                table, column = entity._table_, entity._pk_columns_[0]
                db.execute(f'ALTER TABLE "{table}" ALTER COLUMN {column} TYPE BIGINT')
                sequence = db.select(f"SELECT pg_get_serial_sequence('\"{table}\"', '{column}')")[0]
                db.execute(f"ALTER SEQUENCE {sequence} AS BIGINT")

    def columns(self, db: orm.Database, table: str) -> list[str]:
        return db.select("SELECT column_name FROM information_schema.columns WHERE table_schema = "
                         "current_schema() AND table_name = $t", {"t": table})

    def retries(self, error: BaseException) -> bool:
        return serialization_failure(error)

    def take_cursors(self, db: orm.Database, n: int) -> int:
        """The event_cursor sequence, taken under PG_EVENT_LOCK (held to the commit), so a cursor
        is never behind one that commits later and a reader never skips a row."""
        db.execute(f"SELECT pg_advisory_xact_lock({PG_EVENT_LOCK})")
        return db.select("SELECT setval('event_cursor', nextval('event_cursor') + $n)", {"n": n - 1})[0]

    def latest_cursor(self, db: orm.Database) -> int:
        # a number taken by a transaction still open is not an event yet
        return db.select('SELECT COALESCE(MAX(cursor), 0) FROM "Event"')[0]

    def db_now(self, seconds: int = 0) -> str:
        # clock_timestamp: when the statement runs, not when its transaction began (or began its first attempt)
        return f"(clock_timestamp() AT TIME ZONE 'UTC' + INTERVAL '{seconds} seconds')"

    def age_s(self, column: str) -> str:
        return f"EXTRACT(EPOCH FROM (clock_timestamp() AT TIME ZONE 'UTC' - {column}))"

    def json_text(self, column: str, *path: str) -> str:
        return f"{column} #>> '{{{','.join(path)}}}'"

    def json_elements(self, column: str) -> str:
        return f"jsonb_array_elements_text({column})"

    def lower(self, text: str) -> str:
        return f"LOWER({text})"

    def unindexed(self, column: str) -> str:
        return column   # PostgreSQL has no unary + on a timestamp, and its planner needs no hint here

    def bucket(self, column: str, hours: bool) -> str:
        return f"to_char({column}, '{'YYYY-MM-DD HH24' if hours else 'YYYY-MM-DD HH24:MI'}')"

    def copied(self, cursor: Any, table: str, key: str | None) -> None:
        if key is not None:
            cursor.execute(f"SELECT setval(pg_get_serial_sequence('\"{table}\"', '{key}'), "
                           f'COALESCE(MAX({key}), 0) + 1, false) FROM "{table}"')

    def database_bytes(self, db: orm.Database) -> int:
        return db.select("SELECT pg_database_size(current_database())")[0]

    def give_back_space(self, db: orm.Database) -> int:
        """The server's autovacuum makes deleted rows' space reusable: nothing to do here."""
        return 0

    def continue_event_cursor(self, db: orm.Database) -> None:
        """The event_cursor sequence goes on from the last cursor the EventSequence row gave."""
        db.execute("""SELECT setval('event_cursor', value) FROM "EventSequence" WHERE id = 1 AND value > 0""")

    def database_file(self, database: Path | str) -> Path | None:
        return None

    backup_refusal = ("a fleet's database is PostgreSQL's to back up: use pg_dump (pg_dump --format=custom "
                      "--file=outpost.dump DBNAME), and copy each node's outpost.toml and api-token yourself")


def incremental_vacuum_on(path: Path) -> None:
    """An existing SQLite database made before housekeeping gives its space back only once it
    is in ``auto_vacuum=INCREMENTAL`` mode, which takes one VACUUM (a full copy of the file):
    done here, at start, when the file is small enough for that to be quick; a bigger one is
    left as it is, and docs/operations.md says how to convert it while the appliance is stopped."""
    import sqlite3
    try:
        connection = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
    except sqlite3.Error:
        return   # Pony's bind reports it
    try:
        if connection.execute("PRAGMA auto_vacuum").fetchone()[0] != 0:
            return
        if path.stat().st_size > VACUUM_AT_START_MAX_BYTES:
            log.warning("%s is not in incremental auto-vacuum mode: housekeeping frees space inside it but the "
                        "file does not shrink (see docs/operations.md, Housekeeping, to convert it)", path)
            return
        connection.execute("PRAGMA auto_vacuum=INCREMENTAL")
        connection.execute("VACUUM")
        log.info("%s converted to incremental auto-vacuum", path)
    except sqlite3.Error as exc:   # locked by another process, or read-only: tried at the next start
        log.warning("%s: could not switch to incremental auto-vacuum: %s", path, exc)
    finally:
        connection.close()


def dialect_of(database: Path | str) -> Dialect:
    return PostgresDialect() if is_postgres_url(database) else Dialect()


class StoreCore:
    """The session every part of the store writes through: the database (bind, pragmas,
    migrations), one transaction per call with its events numbered last, the event log, and
    attention items. ``Store`` is this core with its parts attached."""

    def __init__(self, database: Path | str, *, data_dir: Path | None = None, node: str | None = None,
                 process: str | None = None):
        """``database``: a SQLite file (the embedded default), ``:memory:``, or a postgresql://
        URL (docs/fleet.md). ``data_dir`` holds the default workspace's embedded repository; it is
        the SQLite file's directory unless given. ``node``: this process's name in a fleet;
        ``process``: who holds that name (``this_process()`` in the daemon)."""
        self.node = node or socket.gethostname()
        self.process = process or f"{socket.gethostname()} pid {os.getpid()}"
        self.db = orm.Database()
        define_entities(self.db)
        self._pending_events: list[tuple[str, dict[str, Any], datetime]] = []
        self._after_commit: list[Callable[[], None]] = []
        #: Called in the transaction that raises an attention item (id, kind, title, detail,
        #: run id, now): what must be written with it (NotifyStore's outbox rows).
        self.attention_hooks: list[Callable[[str, str, str, str | None, str | None, datetime], None]] = []
        self.serialization_retries = 0   # PostgreSQL transactions run again (logged at a stop; the benchmark)
        self.database, self.dialect = database, dialect_of(database)
        if data_dir is None and not self.dialect.fleet and str(database) != ":memory:":
            data_dir = Path(database).absolute().parent
        #: Where the default workspace's runs go while it names no repository (docs/office.md).
        self.embedded_repository = str(data_dir / "workspaces" / DEFAULT_WORKSPACE) if data_dir else None
        with self.dialect.bound(self.db, database) as fresh:
            self._migrate(fresh)

    def _migrate(self, fresh: bool) -> None:
        with orm.db_session:
            self.db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = self.db.select("SELECT version FROM schema_version")
            version = row[0] if row else (0 if fresh else None)
        if version is None:
            raise SchemaTooNew("the database has no schema_version; it was not made by Outpost")
        if version > SCHEMA_VERSION:
            raise SchemaTooNew(f"the database is at schema version {version}, newer than this "
                               f"Outpost ({SCHEMA_VERSION}); upgrade Outpost")
        # New columns of existing tables first (Pony checks every table against its entity);
        # then Pony creates the tables of entities that are new since ``version``; then the
        # indexes and constraints of SCHEMA_SQL.
        pending = [sql for v in range(version + 1, SCHEMA_VERSION + 1) for sql in SCHEMA_SQL.get(v, [])]
        with orm.db_session:
            for sql in pending:
                if self._column_missing(sql):
                    self.db.execute(sql)
        self.db.generate_mapping(create_tables=True)
        with orm.db_session:
            for sql in pending:
                if not sql.startswith("ALTER TABLE"):
                    self.db.execute(sql)
            self.dialect.migrated(self.db, version)
            self.db.execute("DELETE FROM schema_version")
            self.db.execute(f"INSERT INTO schema_version VALUES ({SCHEMA_VERSION})")
            if not self.db.EventSequence.get(id=1):
                self.db.EventSequence(id=1, value=0)
            if not self.db.Workspace.get(id=DEFAULT_WORKSPACE):
                self.db.Workspace(id=DEFAULT_WORKSPACE, name="Default", created_at=naive(datetime.now(UTC)))

    def copy_into(self, target: StoreCore, logs: Path | None = None) -> dict[str, int]:
        """``outpost migrate``: every row of every table into ``target`` (a new store, which holds
        only what its migrations seed), tables in dependency order, committed once at the end;
        its automatic keys continue after the copied ones. Nodes are not copied: they are
        processes, not history. ``logs``: the folder of the runs' log files (an appliance keeps
        them there, a fleet in the database): each becomes one LogChunk, as a settled run's log
        does. Returns the rows copied per table."""
        counts: dict[str, int] = {}
        mark = target.dialect.placeholder
        with orm.db_session(immediate=True):
            connection = target.db.get_connection()
            cursor = connection.cursor()
            for entity in self.db.entities.values():
                if entity is self.db.Node:
                    continue
                table = entity._table_
                source = self.db.execute(f'SELECT * FROM "{table}"')
                columns = [d[0] for d in source.description]
                flags = {a.column for a in entity._attrs_ if a.py_type is bool and a.column}
                cursor.execute(f'DELETE FROM "{table}"')
                insert = f'INSERT INTO "{table}" ({", ".join(columns)}) VALUES ({", ".join([mark] * len(columns))})'
                counts[table] = 0
                while rows := source.fetchmany(1000):   # SQLite's 0/1 flags are PostgreSQL's booleans
                    cursor.executemany(insert, [tuple(bool(v) if c in flags and v is not None else v
                                                      for c, v in zip(columns, row, strict=True)) for row in rows])
                    counts[table] += len(rows)
                target.dialect.copied(cursor, table, entity._pk_columns_[0] if entity._pk_attrs_[0].auto else None)
            if logs is not None:
                insert = f'INSERT INTO "LogChunk" (run_id, at_byte, data) VALUES ({mark}, 0, {mark})'
                for (run_id,) in self.db.execute('SELECT id FROM "Run" ORDER BY id'):
                    if (path := logs / f"{run_id}.log").is_file():   # one file in memory at a time
                        cursor.execute(insert, (run_id, path.read_bytes()))
                        counts["LogChunk"] = counts.get("LogChunk", 0) + 1
            connection.commit()
        with orm.db_session:
            target.dialect.continue_event_cursor(target.db)
        return counts

    def _column_missing(self, sql: str) -> bool:
        """Whether ``sql`` adds a column to a table that exists without it (a new database's
        tables are made whole from their entities)."""
        m = re.match(r'ALTER TABLE "(\w+)" ADD COLUMN (\w+)', sql)
        if not m:
            return False
        columns = self.dialect.columns(self.db, m[1])
        return bool(columns) and m[2] not in columns

    def close(self) -> None:
        self.db.disconnect()

    def transaction(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, bool]:
        """Run ``fn`` in one serializable transaction; events it emitted are numbered last, then
        committed. Returns (result, whether events were written).

        SQLite: BEGIN IMMEDIATE before the first read, so a claim's reads and writes are one step
        that another process (or connection) cannot interleave. PostgreSQL: SERIALIZABLE, so the
        nodes of a fleet work at once yet each transaction commits only as it would have alone,
        one after another; one that could not is rolled back and ``fn`` runs again on what is
        there now. Either way every "exactly once" rule holds as in the one process."""
        attempt = 1
        while True:
            try:
                return self._serializable(fn, *args, **kwargs)
            except Exception as exc:
                if not self.dialect.retries(exc) or attempt == PG_ATTEMPTS:
                    raise
                self.serialization_retries += 1
                time.sleep(random.uniform(0, PG_RETRY_S * attempt))
                attempt += 1

    def _serializable(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, bool]:
        self._pending_events, self._after_commit = [], []
        with orm.db_session(serializable=True):
            result = fn(*args, **kwargs)
            wrote = bool(self._pending_events)
            if wrote:
                self._number_events(self._pending_events)
        self._pending_events, done = [], self._after_commit
        self._after_commit = []
        for callback in done:
            callback()
        return result, wrote

    def after_commit(self, callback: Callable[[], None]) -> None:
        """``callback()`` once the current transaction has committed (never if it rolls back)."""
        self._after_commit.append(callback)

    def _number_events(self, events: list[tuple[str, dict[str, Any], datetime]]) -> None:
        """A transaction's last writes: its events, numbered after every commit before it
        (``Dialect.take_cursors``)."""
        last = self.dialect.take_cursors(self.db, len(events))
        first = last - len(events) + 1
        for at in range(0, len(events), EVENT_INSERT_ROWS):   # plain SQL, a few statements at most
            rows = list(enumerate(events[at:at + EVENT_INSERT_ROWS], first + at))
            params = {}
            for i, (cursor, (type_, data, when)) in enumerate(rows):
                params.update({f"c{i}": cursor, f"t{i}": type_, f"a{i}": sql_time(when),
                               f"d{i}": json.dumps(data, ensure_ascii=False)})
            values = ", ".join(f"($c{i}, $t{i}, $a{i}, $d{i})" for i in range(len(rows)))
            self.db.execute(f'INSERT INTO "Event" (cursor, type, at, data) VALUES {values}', params)

    def transactions(self, calls: list[Callable[[], Any]]) -> list[Written]:
        """Group commit: several store calls in one transaction, one commit (one fsync) for all.
        Each call is flushed before the next, so a constraint it breaks is its own error. A
        call that raises never takes the others' writes with it: the whole transaction rolls
        back (Pony's cache does not roll back with a SAVEPOINT, docs/development.md) and runs again as the
        calls before it together, the failed one alone (its own error), the rest together."""
        if len(calls) == 1:
            return [self._alone(calls[0])]
        try:
            results, wrote = self.transaction(_run_group, self.db, calls)
        except GroupMemberFailed as failed:
            head, rest = calls[:failed.index], calls[failed.index + 1:]
            return [*(self.transactions(head) if head else []), self._alone(calls[failed.index]),
                    *(self.transactions(rest) if rest else [])]
        except Exception as exc:   # the commit itself failed: nothing was written for anyone
            return [Written(None, False, exc)] * len(calls)
        return [Written(result, wrote, None) for result in results]

    def _alone(self, call: Callable[[], Any]) -> Written:
        try:
            result, wrote = self.transaction(call)
        except Exception as exc:
            return Written(None, False, exc)
        return Written(result, wrote, None)

    def returning(self, sql: str, params: dict[str, Any] | None = None) -> list[Any]:
        """Run a write with RETURNING; the first column of each row that came back."""
        return [row[0] for row in self.db.execute(sql, params or {}).fetchall()]

    def emit(self, type_: str, data: dict[str, Any], at: datetime) -> None:
        self._pending_events.append((type_, data, at))

    def flush(self) -> None:
        orm.flush()

    def raise_attention(self, kind: str, title: str, detail: str | None, now: datetime, *,
                        schedule_id: str | None, run_id: str | None, link: str | None = None,
                        agent_id: str | None = None) -> str:
        """A new item, or, for a kind that folds, the open one of its schedule (or Office agent)
        counting it: newest title, detail and run first; no second notification. PostgreSQL's
        SERIALIZABLE makes two nodes folding at once run one of them again."""
        if kind in FOLDED_ATTENTION_KINDS and (schedule_id or agent_id):
            scope = {"schedule_id": schedule_id} if schedule_id else {"agent_id": agent_id}
            same = self.db.Attention.select(kind=kind, acknowledged_at=None, **scope)
            if (item := same.order_by(self.db.Attention.created_at).first()) is not None:
                earlier = item.run_ids if item.run_ids is not None else [item.run_id] if item.run_id else []
                item.run_ids = ([run_id] if run_id else []) + earlier[:FOLDED_RUNS_MAX - 1]
                item.times, item.latest_at = item.times + 1, naive(now)
                item.title, item.detail, item.run_id = title, detail, run_id or item.run_id
                self.emit("attention.folded", {"attention_id": item.id, "kind": kind, "count": item.times,
                                               "run_id": run_id}, now)
                return item.id
        aid = new_id("att")
        self.db.Attention(id=aid, kind=kind, schedule_id=schedule_id, run_id=run_id, title=title,
                          detail=detail, created_at=naive(now), link=link, agent_id=agent_id)
        self.emit("attention.raised", {"attention_id": aid, "kind": kind, "schedule_id": schedule_id,
                                       "run_id": run_id, "title": title}, now)
        for hook in self.attention_hooks:
            hook(aid, kind, title, detail, run_id, now)
        return aid

    def _activity(self, code: str, workspace_id: str, now: datetime, *, agent_id: str | None = None,
                  task_id: str | None = None, wakeup_id: str | None = None, run_id: str | None = None,
                  **data: Any) -> None:
        self.db.Activity(workspace_id=workspace_id, code=code, agent_id=agent_id, task_id=task_id,
                         wakeup_id=wakeup_id, run_id=run_id, data=data, created_at=naive(now))
        self.emit("office.activity", {"code": code, "agent_id": agent_id, "task_id": task_id}, now)

    def events_after(self, cursor: int, limit: int) -> dict[str, Any]:
        rows = self.db.Event.select(lambda e: e.cursor > cursor).order_by(lambda e: e.cursor)[:limit]
        events = [{"cursor": e.cursor, "type": e.type, "at": rfc3339(aware(e.at)), "data": e.data} for e in rows]
        return {"events": events, "next_cursor": events[-1]["cursor"] if events else cursor}

    def latest_cursor(self) -> int:
        return self.dialect.latest_cursor(self.db)

    def list_attention(self, open_only: bool) -> list[dict[str, Any]]:
        query = self.db.Attention.select()
        if open_only:
            query = query.filter(lambda a: a.acknowledged_at is None)
        return [attention_view(a) for a in query.order_by(lambda a: (orm.desc(a.created_at), orm.desc(a.id)))]

    def ack_attention(self, attention_id: str, now: datetime) -> dict[str, Any]:
        a = self.db.Attention.get(id=attention_id)
        if a is None:
            raise NotFound(f"no attention item {attention_id}")
        if a.acknowledged_at is None:
            a.acknowledged_at = naive(now)
            self.emit("attention.acknowledged", {"attention_id": a.id}, now)
        return attention_view(a)

    def open_attention_count(self) -> int:
        return orm.count(a for a in self.db.Attention if a.acknowledged_at is None)

    def open_attention_by_kind(self) -> dict[str, int]:
        """Open attention items per kind (GET /metrics): one pass over the unacknowledged index."""
        return dict(self.db.select('SELECT kind, COUNT(*) FROM "Attention" WHERE acknowledged_at IS NULL '
                                   "GROUP BY kind"))

    def ack_attention_items(self, attention_ids: list[str] | None, now: datetime) -> dict[str, Any]:
        """Acknowledge a selection (every open item when ``attention_ids`` is None): the items now
        acknowledged, and the ids that name no item."""
        if attention_ids is None:
            items = list(self.db.Attention.select(lambda a: a.acknowledged_at is None))
        else:
            items = list(self.db.Attention.select(lambda a: a.id in attention_ids))
        for a in items:
            if a.acknowledged_at is None:
                a.acknowledged_at = naive(now)
                self.emit("attention.acknowledged", {"attention_id": a.id}, now)
        found = {a.id for a in items}
        return {"acknowledged": [attention_view(a) for a in sorted(items, key=lambda a: a.id)],
                "unknown": [i for i in attention_ids or [] if i not in found]}


class StorePart:
    """A room of the store: it reads and writes through the core's session (``self.db``,
    ``self.core``) and holds, by name, the parts below it that it calls."""

    def __init__(self, core: StoreCore):
        self.core, self.db, self.dialect = core, core.db, core.dialect


class PendingCall:
    """A store call waiting for the writer thread."""
    __slots__ = ("call", "taken", "written", "done")

    def __init__(self, call: Callable[[], Any]):
        self.call, self.taken, self.written, self.done = call, False, None, trio.Event()


class GroupCommit:
    """The one writer: store calls run on a worker thread one transaction at a time, and the
    calls that arrive while a transaction is in flight run together in the next one, so one
    fsync answers them all (docs/development.md). Nobody is answered before the commit that holds their
    call. The first waiter whose call nobody has taken leads the next group; the others wait
    for the lock and find theirs done. ``sizes`` counts groups by size."""

    def __init__(self, store: Store, observe: Callable[[float], None] = lambda seconds: None) -> None:
        self.store = store
        self.observe = observe   # each transaction's duration (outpost_store_transaction_seconds)
        self.queue: list[PendingCall] = []
        self.lock = trio.Lock()
        self.sizes: collections.Counter[int] = collections.Counter()

    async def run(self, call: Callable[[], Any]) -> Written:
        pending = PendingCall(call)
        self.queue.append(pending)
        try:
            async with self.lock:
                if not pending.taken:
                    await self._lead()
        except trio.Cancelled:
            if not pending.taken:   # withdrawn before it ran: nothing was written
                self.queue.remove(pending)
                raise
            with trio.CancelScope(shield=True):   # running in another's group: it commits; wait for it
                await pending.done.wait()
        return pending.written

    def summary(self) -> str:
        calls, groups = sum(size * n for size, n in self.sizes.items()), sum(self.sizes.values())
        return (f"{calls} store calls in {groups} transactions ({calls / groups:.1f} per transaction, "
                f"largest group {max(self.sizes)})" if groups else "no store calls")

    async def _lead(self) -> None:
        group, self.queue = self.queue[:GROUP_COMMIT_MAX], self.queue[GROUP_COMMIT_MAX:]
        for pending in group:
            pending.taken = True
        try:   # shielded: a group once taken is always run and answered, whoever leads it is cancelled
            with trio.CancelScope(shield=True):
                began = time.perf_counter()
                written = await trio.to_thread.run_sync(self.store.transactions, [p.call for p in group])
                self.observe(time.perf_counter() - began)
        except Exception as exc:   # the writer thread itself failed (never a call's own error)
            written = [Written(None, False, exc)] * len(group)
        self.sizes[len(group)] += 1
        for pending, outcome in zip(group, written, strict=True):
            pending.written = outcome
            pending.done.set()


###############################################################################
# 8. Store: runs and admission (every run queued, FIFO admission, settlement, control).
###############################################################################

@dataclasses.dataclass(frozen=True, slots=True)
class SettledRun:
    """A run as its settlement left it: what the profile hold and the Office pipeline read."""
    id: str
    schedule_id: str | None
    agent: str
    trigger: str
    status: RunStatus
    error: str | None
    result: Any
    agent_report: dict[str, Any]
    failure_kind: str | None
    cost_usd: float | None
    limit_named_reset: bool = False   # a limit that said when it resets


class RunStore(StorePart):
    """Runs and admission: every run queued (``queue_run``: fires, dispatches, re-runs, replies,
    Office wakeups), FIFO admission into max_running slots by conditional UPDATE, launch and
    settlement, run control, and the attention a settled run raises.
    Settlement calls each of ``settled_hooks`` in its transaction: the Office pipeline registers
    the settlement of a run's wakeup there."""

    def __init__(self, core: StoreCore):
        super().__init__(core)
        self.settled_hooks: list[Callable[[SettledRun, RunStatus, datetime], None]] = []

    def queue_run(self, run: QueuedRun, now: datetime) -> str:
        """A queued run, as one plain INSERT (every run is made here); its id."""
        rid = new_id("out")
        columns = {"id": rid, "schedule": run.schedule_id, "occurrence_id": run.occurrence_id, "agent": run.agent,
                   "trigger": run.trigger, "due_at": sql_time(run.due_at) if run.due_at else None,
                   "missed_count": run.missed_count, "status": str(RunStatus.QUEUED), "prompt": run.prompt,
                   "repository": run.repository, "workdir": run.workdir, "source_ref": run.source_ref,
                   "resolved_commit": run.resolved_commit, "timeout_seconds": run.timeout_seconds,
                   "model": run.model, "max_cost_usd": run.max_cost_usd, "notify": run.notify,
                   "result_branch": run.result_branch or result_branch(run.label, rid), "commits": 0,
                   "over_budget": False, "continues_branch": run.continues_branch, "cancel_requested": False,
                   "notified": False, "attempt": 0, "queued_at": sql_time(now), "requested_by": run.requested_by,
                   "rerun_of": run.rerun_of, "continues": run.continues, "resume_session_id": run.resume_session_id,
                   "owner": run.owner, "worktree_run": run.worktree_run}
        self.db.execute(f'INSERT INTO "Run" ({", ".join(columns)}) VALUES ({", ".join("$" + c for c in columns)})',
                        columns)
        self.core.emit("run.queued", {"run_id": rid, "schedule_id": run.schedule_id, "trigger": run.trigger}, now)
        return rid

    def _follow_up(self, r, trigger: str, prompt: str, source_ref: str, **fields: Any) -> QueuedRun:
        """A new run of what run ``r`` ran (a re-run, a reply): its agent, repository and limits."""
        return QueuedRun(agent=r.agent, trigger=trigger, prompt=prompt, repository=r.repository, workdir=r.workdir,
                         source_ref=source_ref, timeout_seconds=r.timeout_seconds, model=r.model,
                         max_cost_usd=r.max_cost_usd, notify=r.notify,
                         schedule_id=r.schedule.id if r.schedule else None,
                         label=r.schedule.name if r.schedule else None, **fields)

    def unresolved_runs(self, run_ids: list[str]) -> list[tuple[str, str, str]]:
        """New runs whose commit is not recorded yet (one that continues a branch takes the
        branch's head when it starts)."""
        return [(r.id, r.repository, r.source_ref) for r in self.db.Run.select(
            lambda r: r.id in run_ids and r.resolved_commit is None and not r.continues_branch)]

    def set_resolved_commit(self, run_id: str, commit: str) -> str:
        """Record the exact commit once; a second resolver gets the first one back."""
        self.db.execute('UPDATE "Run" SET resolved_commit = $c WHERE id = $rid AND resolved_commit IS NULL',
                        {"c": commit, "rid": run_id})
        return self.db.select('SELECT resolved_commit FROM "Run" WHERE id = $rid', {"rid": run_id})[0]

    def admit_ready(self, max_running: int, now: datetime, limit: int | None = None,
                    caps: dict[str, int] | None = None, fleet_max: int | None = None,
                    unreachable: Iterable[str] = ()) -> list[tuple[str, bool]]:
        """FIFO admission: (run id, is a resume) for every run that may start now, as many as
        there are free slots (at most ``limit``), in one transaction.

        Paused runs whose resume was asked come first (they started earlier); then queued
        runs in the order they were queued, passing over those of a profile that is limited,
        paused for a login, or at its own ``max_running`` (``caps``): its runs wait, the others
        go by (no head-of-line blocking). The conditional UPDATEs let one claimer win; their
        ``status || ''`` keeps SQLite on the primary key for the few ids chosen (with a plain
        ``status`` it walks every queued run: 31 ms at 100,000 queued instead of 1 ms). Plain,
        portable SQL: it runs unchanged on PostgreSQL.

        In a fleet (docs/fleet.md) ``max_running`` is this node's slots and ``fleet_max`` all nodes'; an
        admitted run is this node's (``node``, ``attempt`` + 1), and only its node resumes a pause;
        runs of a repository path this node cannot reach (``unreachable``) wait for another node."""
        mine, everyone = self.db.select(
            f"SELECT COALESCE(SUM(CASE WHEN {self.dialect.own_rows} THEN 1 ELSE 0 END), 0), COUNT(*) "
            f"FROM \"Run\" WHERE status = '{RunStatus.RUNNING}'", {"me": self.core.node})[0]
        free = min(max_running - mine, limit if limit is not None else max_running,
                   fleet_max - everyone if fleet_max is not None else max_running)
        if free <= 0:
            return []
        resumed = self.core.returning(
            f'UPDATE "Run" SET status = \'{RunStatus.RUNNING}\', resume_requested_at = NULL WHERE id IN '
            f'(SELECT id FROM "Run" WHERE status = \'{RunStatus.PAUSED}\' AND resume_requested_at IS NOT NULL '
            f"AND {self.dialect.own_rows}"
            f" ORDER BY resume_requested_at LIMIT $free) AND status || '' = '{RunStatus.PAUSED}' RETURNING id",
            {"free": free, "me": self.core.node})
        for run_id in resumed:
            self.core.emit("run.resumed", {"run_id": run_id}, now)
        chosen = self._choose_queued(free - len(resumed), now, caps or {}, sorted(unreachable))
        ids, params = sql_list("id", chosen)
        started = self.core.returning(
            f"UPDATE \"Run\" SET status = '{RunStatus.RUNNING}', started_at = $now, node = $me, attempt = attempt + 1 "
            f"WHERE id IN {ids} AND status || '' = '{RunStatus.QUEUED}' RETURNING id",
            {"now": sql_time(now), "me": self.core.node, **params}) if chosen else []
        for run_id in sorted(started):   # run ids are ULIDs: queue order
            self.core.emit("run.started", {"run_id": run_id}, now)
        return [(r, True) for r in resumed] + [(r, False) for r in sorted(started)]

    def _choose_queued(self, free: int, now: datetime, caps: dict[str, int], unreachable: list[str]) -> list[str]:
        """The next ``free`` queued runs in FIFO order whose profile may start one now, of a
        repository this node reaches."""
        elsewhere, elsewhere_params = sql_list("u", unreachable) if unreachable else ("", {})
        held = set(self.held_profiles(now))
        counts = dict(self.db.select(f'SELECT agent, COUNT(*) FROM "Run" WHERE status = \'{RunStatus.RUNNING}\' '
                                     'GROUP BY agent'))
        held |= {name for name, cap in caps.items() if counts.get(name, 0) >= cap}
        chosen: list[str] = []
        while len(chosen) < free:   # each pass chooses a run or holds a profile: it ends
            (held_in, held_params), (chosen_in, chosen_params) = sql_list("h", sorted(held)), sql_list("c", chosen)
            rows = self.db.select(
                f'SELECT id, agent FROM "Run" WHERE status = \'{RunStatus.QUEUED}\''
                + (f" AND agent NOT IN {held_in}" if held else "") + (f" AND id NOT IN {chosen_in}" if chosen else "")
                + (f" AND repository NOT IN {elsewhere}" if unreachable else "")
                + " ORDER BY queued_at, id LIMIT $n",
                {**held_params, **chosen_params, **elsewhere_params, "n": free - len(chosen)})
            if not rows:
                break
            for run_id, agent in rows:
                if agent in held:
                    continue
                if agent in caps and counts.get(agent, 0) >= caps[agent]:
                    held.add(agent)
                    continue
                chosen.append(run_id)
                counts[agent] = counts.get(agent, 0) + 1
        return chosen

    def held_profiles(self, now: datetime) -> list[str]:
        """Profiles whose queued runs wait: limited until a reset still ahead, or paused for a login."""
        return self.db.select('SELECT name FROM "ProfileState" WHERE paused_reason IS NOT NULL '
                              'OR limited_until > $now', {"now": sql_time(now)})

    def next_limit_end(self, now: datetime) -> datetime | None:
        """When the first limit of a profile with queued runs ends (admission looks again then)."""
        at = self.db.select('SELECT MIN(p.limited_until) FROM "ProfileState" p WHERE p.limited_until > $now '
                            'AND EXISTS (SELECT 1 FROM "Run" r WHERE r.agent = p.name '
                            f'AND r.status = \'{RunStatus.QUEUED}\')',
                            {"now": sql_time(now)})[0]
        return sql_instant(at) if at else None

    # --- nodes (docs/fleet.md): the processes serving this database, and the runs they own ---------

    def requeue_unstarted(self, run_id: str, now: datetime, reason: str,
                          fence: tuple[str, int] | None = None) -> bool:
        """An admitted run whose agent never started goes back to the queue (the daemon stopped
        before its supervisor began, its node was lost, or its node cannot fetch its repository
        URL): nothing ran, so it waits for a slot again; a later admission's attempt fences the
        earlier one's writes (``fence``: only if it is still that (node, attempt)'s)."""
        fenced = " AND node = $node AND attempt = $attempt" if fence else ""
        if not self.core.returning(f"UPDATE \"Run\" SET status = '{RunStatus.QUEUED}', started_at = NULL, node = NULL, "
                                   f"steps = NULL WHERE id = $r AND status = '{RunStatus.RUNNING}' AND pid IS NULL"
                                   f"{fenced} RETURNING id",
                                   {"r": run_id, **({"node": fence[0], "attempt": fence[1]} if fence else {})}):
            return False
        self.core.emit("run.requeued", {"run_id": run_id, "reason": reason}, now)
        return True

    def queued_repositories(self) -> list[str]:
        return self.db.select(f'SELECT DISTINCT repository FROM "Run" WHERE status = \'{RunStatus.QUEUED}\' '
                              'ORDER BY repository')

    def cancels_requested(self, run_ids: list[str]) -> list[str]:
        """Of these live runs, those whose cancel was asked (possibly through another node)."""
        ids, params = sql_list("r", run_ids)
        return self.db.select(f'SELECT id FROM "Run" WHERE id IN {ids} AND cancel_requested', params)

    def pauses_recorded(self, run_ids: list[str]) -> list[str]:
        """Of these live runs, those paused (possibly through another node)."""
        ids, params = sql_list("r", run_ids)
        return self.db.select(f'SELECT id FROM "Run" WHERE id IN {ids} AND status = \'{RunStatus.PAUSED}\'', params)

    def append_log(self, run_id: str, at_byte: int, data: bytes) -> None:
        self.db.LogChunk(run_id=run_id, at_byte=at_byte, data=data)

    def replace_log(self, run_id: str, data: bytes) -> None:
        self.db.execute('DELETE FROM "LogChunk" WHERE run_id = $r', {"r": run_id})
        self.db.LogChunk(run_id=run_id, at_byte=0, data=data)

    def stored_log(self, run_id: str) -> bytes:
        return b"".join(bytes(c.data) for c in self.db.LogChunk.select(lambda c: c.run_id == run_id)
                        .order_by(lambda c: c.at_byte))

    def admit_next(self, max_running: int, now: datetime) -> tuple[str, bool] | None:
        """One admission at a time (what a single claim costs; tests and the benchmark's claim latency)."""
        admitted = self.admit_ready(max_running, now, limit=1)
        return admitted[0] if admitted else None

    def _handover_branch(self, r, o) -> str | None:
        """The branch an Office task was last worked on, when that was another agent's (the
        task changed hands): the newest started and settled run on the task, reviews aside."""
        rows = self.db.select(
            'SELECT r.result_branch FROM "OfficeRun" o JOIN "Run" r ON r.id = o.run_id JOIN "Wakeup" w '
            "ON w.id = o.wakeup_id WHERE o.task_id = $t AND o.run_id <> $run AND r.started_at IS NOT NULL "
            f"AND r.status NOT IN {ACTIVE_RUN_SQL} AND w.reason NOT IN {PARTICIPANT_SQL} "
            "ORDER BY r.finished_at DESC, r.id DESC LIMIT 1", {"t": o.task_id, "run": r.id})
        return rows[0] if rows and rows[0] != r.result_branch else None

    def launch_info(self, run_id: str) -> dict[str, Any]:
        r = self.db.Run[run_id]
        o = self.db.OfficeRun.get(run_id=run_id) if r.trigger == "wakeup" else None
        return {"id": r.id, "schedule_id": r.schedule.id if r.schedule else None, "agent": r.agent,
                "prompt": r.prompt, "repository": r.repository,
                "workdir": r.workdir, "source_ref": r.source_ref, "resolved_commit": r.resolved_commit,
                "result_branch": r.result_branch, "timeout_seconds": r.timeout_seconds, "model": r.model,
                "status": r.status, "pid": r.pid, "pid_started": r.pid_started, "node": r.node,
                "attempt": r.attempt,
                "office": o is not None, "task_id": o.task_id if o else None,
                "resume_session": r.resume_session_id, "continues_branch": r.continues_branch,
                "max_cost_usd": r.max_cost_usd, "trigger": r.trigger, "worktree_run": r.worktree_run,
                "due_at": aware(r.due_at), "started_at": aware(r.started_at),
                "handover_branch": self._handover_branch(r, o) if o and o.task_id and r.continues_branch else None}

    def mark_spawned(self, run_id: str, pid: int, pid_started: str | None, fence: tuple[str, int],
                     steps: dict[str, str] | None = None) -> bool:
        """Record the agent's process, and the steps of its launch so far (``run_steps``), if the
        run is still this admission's (``fence``: node, attempt); false when it is not (its node
        was declared lost): the caller ends the process."""
        return bool(self.core.returning(
            'UPDATE "Run" SET pid = $pid, pid_started = $started, steps = $steps WHERE id = $run_id AND node = $node '
            f"AND attempt = $attempt AND status IN {ACTIVE_RUN_SQL} RETURNING id",
            {"pid": pid, "started": pid_started, "run_id": run_id, "node": fence[0], "attempt": fence[1],
             "steps": json.dumps(steps) if steps else None}))

    def settle_run(self, run_id: str, outcome: Outcome, now: datetime, *, exit_code: int | None = None,
                   commits: int = 0, auth_hint: str = "", fence: tuple[str, int] | None = None,
                   steps: dict[str, str] | None = None) -> bool:
        """Record a run's end once, with its agent report and the steps of its launch its
        supervisor saw (``run_steps``; None keeps those recorded, as after a restart). A cancel
        asked for wins over how the process ended; a question the agent asked (``POST
        /api/agent/needs-you``) makes a run that ended on its own ``needs_you``. A limit or a
        login failure holds the run's profile. ``fence``: the (node, attempt) that admitted the
        run, as its supervisor knows it; a run admitted again since (its node was declared lost)
        is no longer that supervisor's to settle."""
        rows = self.db.select('SELECT status, cancel_requested, question, max_cost_usd, schedule, agent, trigger '
                              'FROM "Run" WHERE id = $run_id', {"run_id": run_id})
        if not rows:
            raise NotFound(f"no run {run_id}")
        was, cancel_requested, question, max_cost_usd, schedule_id, agent, trigger = rows[0]
        if was in SETTLED_RUN_STATUSES:
            return False
        status, error = outcome.status, outcome.error
        if cancel_requested and status != RunStatus.SUCCEEDED:
            status, error = RunStatus.CANCELLED, error if status == RunStatus.CANCELLED else "cancelled"
        elif question and (status == RunStatus.SUCCEEDED or outcome.failure_kind in ("agent", "no_result")):
            status, error = RunStatus.NEEDS_YOU, None
        report = outcome.report()
        r = SettledRun(id=run_id, schedule_id=schedule_id, agent=agent, trigger=trigger, status=status, error=error,
                       result=outcome.reading.result if outcome.reading else None, agent_report=report,
                       failure_kind=outcome.failure_kind if status == RunStatus.FAILED else None,
                       cost_usd=report["cost_usd"],
                       limit_named_reset=outcome.limit is not None and outcome.limit.resets_at is not None)
        # One conditional statement: of two settlers, the one that still finds ``was`` wins.
        if not self.core.returning(
                'UPDATE "Run" SET status = $status, exit_code = $exit_code, error = $error, commits = $commits, '
                'result = $result, agent_report = $report, failure_kind = $kind, cost_usd = $cost, '
                'question = $question, over_budget = $over, finished_at = $now, resume_requested_at = NULL'
                + (", steps = $steps" if steps else "")
                + " WHERE id = $run_id AND status = $was"
                + (" AND node = $node AND attempt = $attempt" if fence else "")
                + " RETURNING id",
                {**({"node": fence[0], "attempt": fence[1]} if fence else {}),
                 **({"steps": json.dumps(steps)} if steps else {}),
                 "status": str(status), "exit_code": exit_code, "error": error, "commits": commits,
                 "result": None if r.result is None else json.dumps(r.result), "report": json.dumps(report),
                 "kind": r.failure_kind, "cost": r.cost_usd, "question": question or outcome.question,
                 "over": max_cost_usd is not None and (r.cost_usd or 0) > max_cost_usd, "now": sql_time(now),
                 "run_id": run_id, "was": was}):
            return False
        self.core.emit("run.settled", {"run_id": run_id, "schedule_id": schedule_id, "status": str(status),
                                       "error": error, "failure_kind": r.failure_kind}, now)
        self._hold_profile(r, outcome, now, auth_hint)
        for settled in self.settled_hooks:
            settled(r, status, now)
        return True

    def empty_branch(self, run_id: str) -> tuple[str, str, str] | None:
        """docs/operations.md: (repository, result branch, commit it must still point at) of a settled run
        whose branch carries no work and may go now, else None. Not a run that continues a branch
        with earlier work (a reply to a run with commits, an Office task session); a ``needs_you``
        run's branch stays until it is answered (its reply takes the branch over) or its
        ``needs_you`` item is acknowledged."""
        r = self.db.Run.get(id=run_id)
        if (r is None or r.status not in SETTLED_RUN_STATUSES or r.commits or r.continues_branch
                or not r.resolved_commit):
            return None
        if r.status == RunStatus.NEEDS_YOU:
            items = [a.acknowledged_at is not None for a in self.db.Attention.select(
                lambda a: a.run_id == run_id and a.kind == "needs_you")]
            if r.answered_by or not items or not all(items):
                return None
        return r.repository, r.result_branch, r.resolved_commit

    def _profile_state(self, name: str, now: datetime):
        st = self.db.ProfileState.get(name=name)
        return st if st is not None else self.db.ProfileState(name=name, updated_at=naive(now))

    def _hold_profile(self, r: SettledRun, outcome: Outcome, now: datetime, auth_hint: str) -> None:
        """docs/agent-clis.md: a limit holds the profile until its reset (+30 s), with one
        ``agent_limited`` item per limit window; a login failure pauses it, with one
        ``agent_auth`` item, until ``resume``, and so does a spend limit that names no reset (its
        ``agent_limited`` item says who can raise it). A success ends the ladder of unnamed resets."""
        kind = outcome.failure_kind if r.status == RunStatus.FAILED else None
        if kind == "limit" and outcome.limit is not None and outcome.limit.raised_by is not None:
            st = self._profile_state(r.agent, now)   # a spend or credit limit no wait lifts: paused like auth
            if st.paused_reason is None:
                st.paused_reason, st.updated_at = f"spend limit: {outcome.limit.message[:300]}", naive(now)
                self.core.raise_attention("agent_limited", f"Agent profile {r.agent} hit a spend limit; its runs wait",
                                          f"{outcome.limit.message}\nWho can raise it: {outcome.limit.raised_by}. "
                                          f"Then resume the profile on the Agents page, or POST /v1/outpost/agents/"
                                          f'{r.agent}/control {{"action": "resume"}}.', now,
                                          schedule_id=r.schedule_id, run_id=r.id)
                self.core.emit("agent.paused", {"agent": r.agent, "reason": st.paused_reason}, now)
        elif kind == "limit" and outcome.limit is not None:
            st = self._profile_state(r.agent, now)
            new_window = st.limited_until is None or aware(st.limited_until) <= now
            until = limit_wait(outcome.limit, st.limit_streak, now, random.uniform(-1, 1))
            st.limited_until = naive(max(until, aware(st.limited_until) or until))
            st.limit_streak += outcome.limit.resets_at is None
            st.limit_message, st.updated_at = outcome.limit.message, naive(now)
            if new_window:
                words = outcome.limit.kind.replace("_", " ")
                self.core.raise_attention("agent_limited", f"Agent profile {r.agent} hit a {words}",
                                          f"{outcome.limit.message}\nIts queued runs wait until "
                                          f"{rfc3339(aware(st.limited_until))}; other profiles' runs go on.", now,
                                          schedule_id=r.schedule_id, run_id=r.id)
            self.core.emit("agent.limited", {"agent": r.agent, "limited_until": rfc3339(aware(st.limited_until))}, now)
        elif kind == "auth":
            st = self._profile_state(r.agent, now)
            if st.paused_reason is None:
                st.paused_reason, st.updated_at = f"login needed: {(r.error or '')[:300]}", naive(now)
                self.core.raise_attention("agent_auth", f"Agent profile {r.agent} is not logged in; its runs wait",
                                          f"{r.error}\n{auth_hint}".strip(), now,
                                          schedule_id=r.schedule_id, run_id=r.id)
                self.core.emit("agent.paused", {"agent": r.agent, "reason": st.paused_reason}, now)
        elif r.status == RunStatus.SUCCEEDED:
            st = self.db.ProfileState.get(name=r.agent)
            if st is not None and st.limit_streak:
                st.limit_streak = 0

    def resume_profile(self, name: str, now: datetime) -> None:
        """Lift a profile's login pause and its limit: its queued runs may start."""
        st = self._profile_state(name, now)
        st.paused_reason, st.limited_until, st.limit_streak, st.updated_at = None, None, 0, naive(now)
        self.core.emit("agent.resumed", {"agent": name}, now)

    def run_tallies(self) -> list[tuple[str, str, str, int, float]]:
        """Every run (fleet-wide) as (status, agent, trigger, count, cost in USD): one grouped
        pass for GET /metrics, the database being the source of every total."""
        return [(status, agent, trigger, n, cost or 0.0) for status, agent, trigger, n, cost in self.db.select(
            'SELECT status, agent, "trigger", COUNT(*), SUM(cost_usd) FROM "Run" GROUP BY status, agent, "trigger"')]

    def profile_states(self, names: list[str], now: datetime) -> list[dict[str, Any]]:
        """Every profile's standing: running and queued runs, limit, login pause, cost in 24 h."""
        counts = {(agent, status): n for agent, status, n in self.db.select(
            'SELECT agent, status, COUNT(*) FROM "Run" '
            f"WHERE status IN {sql_tuple((RunStatus.RUNNING, RunStatus.QUEUED))} GROUP BY agent, status")}
        since = sql_time(now - timedelta(days=1))
        cost = dict(self.db.select('SELECT agent, SUM(cost_usd) FROM "Run" WHERE cost_usd IS NOT NULL '
                                   'AND finished_at >= $since GROUP BY agent', {"since": since}))
        last = dict(self.db.select('SELECT agent, MAX(started_at) FROM "Run" GROUP BY agent'))
        return [profile_state_view(name, self.db.ProfileState.get(name=name),
                                   running=counts.get((name, RunStatus.RUNNING), 0),
                                   queued=counts.get((name, RunStatus.QUEUED), 0),
                                   last_run_at=sql_instant(last[name]) if last.get(name) else None,
                                   cost_usd_24h=cost.get(name) or 0.0, now=now) for name in names]

    def agent_versions(self) -> dict[str, str]:
        """The CLI version each profile's latest reporting run named, in one query."""
        version = self.dialect.json_text("agent_report", "agent_version")
        return dict(self.db.select(
            f'SELECT agent, {version} FROM "Run" r WHERE finished_at = '
            f'(SELECT MAX(finished_at) FROM "Run" WHERE agent = r.agent AND {version} IS NOT NULL)'))

    def own_runs_in(self, statuses: Iterable[RunStatus]) -> list[str]:
        """This node's runs (and those no node admitted) in these states."""
        states, params = sql_list("s", statuses)
        return self.db.select(f'SELECT id FROM "Run" WHERE status IN {states} AND {self.dialect.own_rows} '
                              "ORDER BY id", {"me": self.core.node, **params})

    def _run(self, run_id: str):
        r = self.db.Run.get(id=run_id)
        if r is None:
            raise NotFound(f"no run {run_id}")
        return r

    def get_run(self, run_id: str) -> dict[str, Any]:
        return run_view(self._run(run_id))

    def list_runs(self, schedule_id: str | None, status: str | None, limit: int, before: str | None, *,
                  agent: str | None = None, trigger: str | None = None, since: datetime | None = None,
                  until: datetime | None = None, q: str | None = None) -> dict[str, Any]:
        """Runs newest first (by id), a page of ``limit`` and the id to page on from; the filters of
        docs/http-api.md combine; ``q`` is text in the schedule's name, the result branch, the error
        or the agent's final message, any case."""
        where, params = ["1 = 1"], {"n": limit + 1}
        for column, value in (("r.schedule", schedule_id), ("r.status", status), ("r.agent", agent),
                              ("r.trigger", trigger)):
            if value:
                where.append(f"{column} = ${column[2:]}")
                params[column[2:]] = value
        for op, name, value in ((">=", "since", since), ("<", "until", until)):
            if value is not None:
                where.append(f"r.queued_at {op} ${name}")
                params[name] = naive(value)
        if before:
            where.append("r.id < $before")
            params["before"] = before
        if q:
            params["q"] = "%" + re.sub(r"([\\%_])", r"\\\1", q.lower()) + "%"
            texts = ("s.name", "r.result_branch", "r.error", self.dialect.json_text("r.agent_report", "final_message"))
            folded = [self.dialect.lower("COALESCE(" + t + ", '')") for t in texts]
            where.append("(" + " OR ".join(f"{t} LIKE $q ESCAPE '\\'" for t in folded) + ")")
        ids = self.db.select(f'SELECT r.id FROM "Run" r LEFT JOIN "Schedule" s ON s.id = r.schedule '
                             f'WHERE {" AND ".join(where)} ORDER BY r.id DESC LIMIT $n', params)
        runs = {r.id: r for r in self.db.Run.select(lambda r: r.id in ids)} if ids else {}
        return {"runs": [run_view(runs[i]) for i in ids[:limit]],
                "next": ids[limit - 1] if len(ids) > limit else None}

    def rerun(self, run_id: str, now: datetime) -> dict[str, Any]:
        """docs/schedules.md: a new run (trigger ``rerun``) with the same resolved commit, prompt, agent
        profile and model, on a branch of its own: is the agent deterministic enough for this job?"""
        r = self._run(run_id)
        if r.status not in SETTLED_RUN_STATUSES:
            raise Conflict(f"run {run_id} is {r.status}; re-run it once it has settled")
        if r.resolved_commit is None:
            raise Conflict(f"run {run_id} never resolved a commit (it failed before it started): fire again instead")
        if r.trigger == "wakeup":
            raise Conflict(f"run {run_id} is an Office run; wake its agent instead")
        again = self._follow_up(r, "rerun", r.prompt, r.source_ref, resolved_commit=r.resolved_commit, rerun_of=r.id)
        return {"run_id": self.queue_run(again, now)}

    def run_facts(self, run_id: str) -> dict[str, Any]:
        """A run as a comparison needs it: its view plus its prompt."""
        r = self._run(run_id)
        return {**run_view(r), "prompt": r.prompt}

    def daily_runs(self, now: datetime, tz: ZoneInfo, days: int, *, schedule_id: str | None = None,
                   office_agent_id: str | None = None) -> list[dict[str, Any]]:
        """Runs per day by outcome (succeeded, failed, needs you, skipped) and their cost, for the
        last ``days`` days in ``tz``, oldest first: the charts (docs/schedules.md)."""
        first = (now.astimezone(tz) - timedelta(days=days - 1)).date()
        since = sql_time(datetime.combine(first, datetime.min.time(), tz))
        where, params = "r.queued_at >= $since", {"since": since}
        if schedule_id:
            where, params["sid"] = where + " AND r.schedule = $sid", schedule_id
        if office_agent_id:
            where += ' AND r.id IN (SELECT run_id FROM "OfficeRun" WHERE agent_id = $aid)'
            params["aid"] = office_agent_id
        # Counted by the UTC hour in SQL (a month of a busy appliance is ~100 k runs), then each
        # hour to its day in ``tz``; by the minute in a zone whose offset is not whole hours.
        whole_hours = all(tz.utcoffset(at).total_seconds() % HOUR_S == 0
                          for at in (datetime.combine(first, datetime.min.time()), now.replace(tzinfo=None)))
        minute = functools.partial(self.dialect.bucket, hours=whole_hours)
        rows = self.db.select(f"SELECT {minute('r.queued_at')}, r.status, COUNT(*), SUM(r.cost_usd) FROM \"Run\" r "
                              f"WHERE {where} GROUP BY 1, 2", params)
        if office_agent_id:   # a day's skips: wakeups skipped (budget, checkout), or ledger slots skipped
            skips = self.db.select(f"SELECT {minute('finished_at')}, COUNT(*) FROM \"Wakeup\" WHERE agent_id = $aid "
                                   f"AND status = '{WakeupStatus.SKIPPED}' AND finished_at >= $since GROUP BY 1",
                                   params)
        else:
            skips = self.db.select(f"SELECT {minute('due_at')}, COUNT(*) FROM \"Occurrence\" "
                                   "WHERE substr(outcome, 1, 7) = 'skipped' AND due_at >= $since"
                                   + (" AND schedule = $sid" if schedule_id else "") + " GROUP BY 1", params)
        chart = {first + timedelta(days=i): {"succeeded": 0, "failed": 0, "needs_you": 0, "skipped": 0, "cost": 0.0}
                 for i in range(days)}

        def day_of(at: str) -> dict[str, Any] | None:
            return chart.get(datetime.fromisoformat(at if len(at) > 13 else f"{at}:00").replace(tzinfo=UTC)
                             .astimezone(tz).date())
        for at, status, count, cost in rows:
            if at and (day := day_of(at)) is not None:
                if status in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.NEEDS_YOU):
                    day[status] += count
                day["cost"] += cost or 0.0
        for at, count in skips:
            if at and (day := day_of(at)) is not None:
                day["skipped"] += count
        return [{"day": day.isoformat(), **counts} for day, counts in chart.items()]

    def adopt_run(self, run_id: str, workspace: str, now: datetime) -> dict[str, Any]:
        r = self._run(run_id)
        if r.owner and r.owner != workspace:
            raise Conflict(f"run {run_id} is already owned by workspace {r.owner!r}")
        r.owner = workspace
        self.core.emit("run.adopted", {"run_id": r.id, "owner": workspace}, now)
        return run_view(r)

    def reply_to_run(self, run_id: str, message: str, now: datetime, *, adopt_as: str | None = None,
                     as_owner: str | None = None) -> dict[str, Any]:
        """docs/agent-clis.md: answer an adopted ``needs_you`` run with a continuation run on the same
        result branch (a fresh worktree of its head) that resumes the agent's session. The
        answer is kept for the run's thread and its open ``needs_you`` item is acknowledged.
        ``adopt_as``: the dashboard's one step, adopting an unowned run for that workspace first."""
        r = self._run(run_id)
        if r.status != RunStatus.NEEDS_YOU:
            raise Conflict(f"run {run_id} is {r.status}; only a needs_you run can be answered")
        if adopt_as and not r.owner and not r.answered_by and r.trigger != "wakeup":
            self.adopt_run(run_id, adopt_as, now)
        if not r.owner:
            raise Conflict(f"run {run_id} is not adopted; adopt it first (POST /v1/outpost/runs/{run_id}/adopt)")
        if as_owner is not None and r.owner != as_owner:   # a proposer key answers only what it adopted
            raise Forbidden(f"run {run_id} is owned by workspace {r.owner!r}, not by this key")
        if r.answered_by:
            raise Conflict(f"run {run_id} was already answered by run {r.answered_by}")
        if r.trigger == "wakeup":
            raise Conflict(f"run {run_id} is an Office run; answer it with a comment on its task")
        session = (r.agent_report or {}).get("session_id")
        note = (f"\n\n(Outpost: this answers your question in run {r.id}: {r.question or 'see that run'}. "
                f"Go on with that work on branch {r.result_branch}.)")
        prompt = message + note if session else f"{r.prompt}\n\n(Outpost: you asked: {r.question}.)\n\n{message}"
        # The same worktree path as the answered run: a CLI that finds its sessions by directory finds it.
        # A branch that carries no work (docs/operations.md: it may have been deleted) is made again from the
        # answered run's commit; one with work is continued from its head.
        carries_work = bool(r.commits or r.continues_branch or not r.resolved_commit)
        reply = self.queue_run(self._follow_up(
            r, "reply", prompt[:MAX_PROMPT_CHARS], r.result_branch, result_branch=r.result_branch,
            continues_branch=carries_work, continues=r.id, resume_session_id=session, owner=r.owner,
            worktree_run=r.worktree_run or r.id, resolved_commit=None if carries_work else r.resolved_commit), now)
        r.answered_by, r.answer = reply, message
        self.core.emit("run.answered", {"run_id": r.id, "reply_run_id": reply}, now)
        for item in self.db.Attention.select(lambda a: a.run_id == run_id and a.kind == "needs_you"
                                             and a.acknowledged_at is None):
            item.acknowledged_at = naive(now)   # answered: it needs no one any more
            self.core.emit("attention.acknowledged", {"attention_id": item.id}, now)
        return {"run_id": reply}

    def thread(self, run_id: str) -> list[dict[str, Any]]:
        """The conversation a run belongs to, oldest first: each run's question, the answer it
        got and the run that answer started, from the first question to the latest run (at most
        THREAD_MAX runs either way)."""
        first = self._run(run_id)
        for _ in range(THREAD_MAX):
            earlier = first.continues and self.db.Run.get(id=first.continues)
            if not earlier:
                break
            first = earlier
        steps, r = [], first
        while r is not None and len(steps) < 2 * THREAD_MAX:
            steps.append({"id": r.id, "status": r.status, "question": r.question, "answer": r.answer,
                          "answered_by": r.answered_by, "final_message": (r.agent_report or {}).get("final_message"),
                          "error": r.error, "finished_at": rfc3339(aware(r.finished_at))})
            r = r.answered_by and self.db.Run.get(id=r.answered_by)
        return steps

    def ask_human(self, run_id: str, question: str, now: datetime) -> dict[str, Any]:
        """``POST /api/agent/needs-you``: the run's question; it settles ``needs_you``."""
        r = self._run(run_id)
        r.question = question
        self.core.emit("run.question", {"run_id": r.id}, now)
        return {"run_id": r.id, "question": question}

    def control_run(self, run_id: str, action: str, now: datetime) -> dict[str, Any]:
        """Record a cancel/pause/resume; the supervisor of a live run does the signalling."""
        r = self._run(run_id)
        if r.status in SETTLED_RUN_STATUSES:
            raise Conflict(f"run {run_id} is already settled ({r.status})")
        if action == "cancel":
            if r.status == RunStatus.QUEUED:
                self.settle_run(r.id, Outcome(RunStatus.CANCELLED, "cancelled before it started"), now)
                _forget_loaded(self.db)   # settled in plain SQL: read the run again
                r = self._run(run_id)
            else:
                r.cancel_requested = True
        elif action == "pause":
            if r.status != RunStatus.RUNNING:
                raise Conflict(f"run {run_id} is {r.status}; only a running run can be paused")
            r.status = str(RunStatus.PAUSED)
        elif action == "resume":
            if r.status != RunStatus.PAUSED:
                raise Conflict(f"run {run_id} is {r.status}; only a paused run can be resumed")
            r.resume_requested_at = naive(now)
        else:
            raise invalid("action", "must be cancel, pause or resume")
        self.core.emit("run.controlled", {"run_id": r.id, "action": action}, now)
        return run_view(r)

    def act_on_runs(self, action: str, run_ids: list[str], now: datetime) -> dict[str, Any]:
        """docs/http-api.md: cancel or re-run each of a selection, in one transaction; each one's
        outcome: its status after the action, why nothing was done, a re-run's new run."""
        results = []
        for run_id in run_ids:
            try:
                if action == "cancel":
                    status = self.control_run(run_id, "cancel", now)["status"]
                    detail = None if status == RunStatus.CANCELLED else "cancel requested: its agent is being stopped"
                    results.append({"id": run_id, "status": status, "detail": detail, "run_id": None})
                else:
                    again = self.rerun(run_id, now)["run_id"]
                    results.append({"id": run_id, "status": self.db.Run[run_id].status, "detail": None,
                                    "run_id": again})
            except (NotFound, Conflict) as refused:   # refused before anything was written
                r = self.db.Run.get(id=run_id)
                results.append({"id": run_id, "status": r.status if r else None, "detail": refused.detail,
                                "run_id": None})
        return {"results": results}

    def unnotified_runs(self) -> list[str]:
        """Settled runs the notification actor has not applied yet: a lookup in the partial
        index run_unnotified (``status || ''`` keeps SQLite off the status indexes, whose
        settled runs are most of a year's history)."""
        states, params = sql_list("s", SETTLED_RUN_STATUSES)
        return self.db.select(f'SELECT id FROM "Run" WHERE NOT notified AND status || \'\' IN {states} ORDER BY id',
                              params)

    def raise_run_attention(self, run_id: str, now: datetime):
        """A settled run's attention items, raised once (the schedules part's ``notify_run`` then
        counts its failure streak): the run, or None when it was applied already or has not settled."""
        r = self.db.Run[run_id]
        if r.notified or r.status not in SETTLED_RUN_STATUSES:
            return None
        r.notified = True
        status = RunStatus(r.status)
        s = r.schedule
        o = self.db.OfficeRun.get(run_id=r.id) if r.trigger == "wakeup" else None
        agent = self.db.Agent.get(id=o.agent_id) if o is not None else None
        label = f"'{s.name}'" if s else f"agent {agent.name}" if agent else "dispatch"
        titles = {"failed": f"Run of {label} failed", "needs_you": f"Run of {label} needs you",
                  "changes_returned": f"Run of {label} returned {r.commits} commit{'s' if r.commits != 1 else ''}",
                  "succeeded": f"Run of {label} succeeded"}
        details = {"failed": r.error, "needs_you": r.question,
                   "changes_returned": f"branch {r.result_branch}", "succeeded": (r.result or {}).get("summary")}
        muted = s.definition.get("mute", []) if s else []
        for kind in (k for k in attention_kinds(r.notify, status, r.commits, r.failure_kind) if k not in muted):
            detail = details[kind]
            self.core.raise_attention(kind, titles[kind], detail if isinstance(detail, str) else None, now,
                                      schedule_id=s.id if s else None, run_id=r.id,
                                      agent_id=agent.id if agent else None)
        return r


###############################################################################
# 9. Store: schedules and firing (the slot ledger, claims, manual fires, dispatches, the
#    failure streak and auto-pause).
###############################################################################

class ScheduleStore(StorePart):
    """Schedules and firing: definitions under revisions, the slot ledger, claiming due
    occurrences (UNIQUE per schedule and instant), manual fires and one-shot dispatches (each
    run queued through the runs part), and a schedule's failure streak and auto-pause."""

    def __init__(self, core: StoreCore, runs: RunStore):
        super().__init__(core)
        self.runs = runs

    def _schedule(self, schedule_id: str):
        s = self.db.Schedule.get(id=schedule_id)
        if s is None:
            raise NotFound(f"no schedule {schedule_id}")
        return s

    def _active_run(self, schedule_id: str):
        """The schedule's oldest queued, running or paused run (one index probe), or None.
        ``queued_at`` unindexed: the probe is run_schedule (schedule, status), never a walk of the
        schedule's year of runs through run_schedule_queued to skip the sort."""
        rows = self.db.select(f'SELECT id FROM "Run" WHERE schedule = $sid AND status IN {ACTIVE_RUN_SQL} '
                              f"ORDER BY {self.dialect.unindexed('queued_at')}, id LIMIT 1", {"sid": schedule_id})
        return self.db.Run[rows[0]] if rows else None

    def _schedule_view(self, s) -> dict[str, Any]:
        active = self._active_run(s.id)
        return schedule_view(s, active.id if active else None)

    def check_name_free(self, name: str, except_id: str | None = None) -> None:
        """Conflict (naming the field) when a schedule that is not archived, other than ``except_id``,
        has ``name``: create and update refuse it, the compose form tells it before Confirm."""
        self._check_name_free(name, except_id)

    def _check_name_free(self, name: str, except_id: str | None = None) -> None:
        clash = self.db.Schedule.get(lambda s: s.name == name and not s.archived and s.id != except_id)
        if clash:
            raise Conflict(f"a schedule named {name!r} already exists ({clash.id})",
                           errors=[{"field": "name", "message": "already used by another schedule"}])

    def create_schedule(self, definition: dict[str, Any], now: datetime,
                        profile_digest: str | None = None) -> dict[str, Any]:
        self._check_name_free(definition["name"])
        sid = new_id("sch")
        first = next_fires(definition["timing"], now, 1, anchor=now)
        s = self.db.Schedule(id=sid, name=definition["name"], definition=definition,
                             confirmation=confirmation_of(definition), confirmed_at=naive(now),
                             profile_digest=profile_digest,
                             next_fire_at=naive(first[0]) if first else None, anchored_at=naive(now),
                             created_at=naive(now), updated_at=naive(now))
        self.core.emit("schedule.created", {"schedule_id": sid, "revision": 1}, now)
        return self._schedule_view(s)

    def _guard(self, s, revision: int) -> None:
        if s.archived:
            raise Archived(f"schedule {s.id} is archived; create a new one instead")
        check_revision(s.id, s.revision, revision)

    def schedule_definition(self, schedule_id: str) -> dict[str, Any]:
        s = self._schedule(schedule_id)
        return {"definition": dict(s.definition), "revision": s.revision, "archived": s.archived}

    def update_schedule(self, schedule_id: str, revision: int, definition: dict[str, Any],
                        now: datetime, profile_digest: str | None = None) -> dict[str, Any]:
        s = self._schedule(schedule_id)
        self._guard(s, revision)
        self._check_name_free(definition["name"], except_id=s.id)
        if definition["timing"] != s.definition["timing"]:
            first = next_fires(definition["timing"], now, 1, anchor=now)
            s.next_fire_at = naive(first[0]) if first else None
            s.anchored_at = naive(now)
        s.name, s.definition = definition["name"], definition
        s.confirmation, s.confirmed_at = confirmation_of(definition), naive(now)
        s.profile_digest = profile_digest
        s.revision += 1
        s.updated_at = naive(now)
        self.core.emit("schedule.updated", {"schedule_id": s.id, "revision": s.revision}, now)
        sid = s.id   # confirmed again: the item that asked for it is done; so are the open items of a muted kind
        done_kinds = ["reconfirm", *definition.get("mute", [])]
        for a in self.db.Attention.select(lambda a: a.schedule_id == sid and a.kind in done_kinds
                                          and a.acknowledged_at is None):
            a.acknowledged_at = naive(now)
            self.core.emit("attention.acknowledged", {"attention_id": a.id}, now)
        return self._schedule_view(s)

    def control_schedule(self, schedule_id: str, revision: int, action: str, now: datetime) -> dict[str, Any]:
        """enable | pause | resume | archive | dismiss_catch_up (``fire`` is fire_manual); the
        schedule's view. approve_catch_up answers as fire does too (``outcome``, ``run_id``)."""
        s = self._schedule(schedule_id)
        self._guard(s, revision)
        if action == "approve_catch_up":
            outcome, run_id = self.decide_catch_up(s, True, now)
            if outcome == SlotOutcome.SKIPPED_OVERLAP:   # nothing changed: the plan waits, the revision stays
                return {**self._schedule_view(s), "outcome": str(outcome), "run_id": None}
            self._controlled(s, action, now)
            return {**self._schedule_view(s), "outcome": str(outcome), "run_id": run_id}
        if action == "enable":
            if s.auto_paused:
                raise AutoPaused(f"schedule {s.id} was auto-paused after {s.failure_streak} failures; "
                                 "inspect its failed runs, then use resume")
            if not s.enabled:
                self._settle_paused_slots(s, now)
            s.enabled = True
        elif action == "pause":
            s.enabled = False
        elif action == "resume":
            if not s.enabled:
                self._settle_paused_slots(s, now)
            s.enabled, s.auto_paused, s.failure_streak = True, False, 0
        elif action == "dismiss_catch_up":
            self.decide_catch_up(s, False, now)
        elif action == "archive":
            s.archived, s.enabled, s.next_fire_at = True, False, None
        else:
            raise invalid("action", "must be " + ", ".join(SCHEDULE_ACTIONS) + " or fire")
        self._controlled(s, action, now)
        return self._schedule_view(s)

    def _controlled(self, s, action: str, now: datetime) -> None:
        s.revision += 1
        s.updated_at = naive(now)
        self.core.emit("schedule.controlled", {"schedule_id": s.id, "action": action, "revision": s.revision}, now)

    def get_schedule(self, schedule_id: str) -> dict[str, Any]:
        return self._schedule_view(self._schedule(schedule_id))

    def find_schedule_id(self, id_or_name: str) -> str:
        s = self.db.Schedule.get(id=id_or_name) or self.db.Schedule.select(
            lambda s: s.name == id_or_name).order_by(lambda s: (s.archived, orm.desc(s.created_at))).first()
        if s is None:
            raise NotFound(f"no schedule with id or name {id_or_name!r}")
        return s.id

    def _listed(self, include_archived: bool, state: str | None):
        query = self.db.Schedule.select()
        if state == "archived":
            return query.filter(lambda s: s.archived)
        if not include_archived or state:
            query = query.filter(lambda s: not s.archived)
        if state == "enabled":
            query = query.filter(lambda s: s.enabled)
        elif state == "paused":
            query = query.filter(lambda s: not s.enabled and not s.auto_paused)
        elif state == "auto_paused":
            query = query.filter(lambda s: s.auto_paused)
        return query

    def list_schedules(self, include_archived: bool = False, page: int | None = None, *, state: str | None = None,
                       by_next_fire: bool = False) -> list[dict[str, Any]]:
        """All schedules (of a SCHEDULE_STATES ``state``), oldest first or soonest next fire first
        (none last); or one ``page`` of SCHEDULES_PAGE (the dashboard)."""
        query = self._listed(include_archived, state)
        if by_next_fire:   # an appliance's schedules are hundreds at most: sorted here, NULLs last on both databases
            ordered = sorted(query, key=lambda s: (s.next_fire_at is None, s.next_fire_at or s.created_at, s.id))
            rows = ordered[(page - 1) * SCHEDULES_PAGE:page * SCHEDULES_PAGE] if page else ordered
        else:
            query = query.order_by(lambda s: (s.created_at, s.id))
            rows = query.page(page, SCHEDULES_PAGE) if page else query
        active = dict(self.db.select(   # one query for every schedule's active run, not one each
            f"SELECT schedule, MIN(id) FROM \"Run\" WHERE status IN {ACTIVE_RUN_SQL} "
            "AND schedule IS NOT NULL GROUP BY schedule"))
        return [schedule_view(s, active.get(s.id)) for s in rows]

    def count_schedules(self, include_archived: bool = False, state: str | None = None) -> int:
        return self._listed(include_archived, state).count()

    def last_runs(self, schedule_ids: list[str]) -> dict[str, dict[str, Any]]:
        """The newest run of each of these schedules, in one query (an index probe each)."""
        if not schedule_ids:
            return {}
        ids, params = sql_list("s", schedule_ids)
        rows = self.db.select(
            'SELECT r.schedule, r.id, r.status, r.queued_at FROM "Schedule" s JOIN "Run" r ON r.id = '
            f'(SELECT MAX(id) FROM "Run" WHERE schedule = s.id) WHERE s.id IN {ids}', params)
        return {sid: {"id": rid, "status": status, "queued_at": rfc3339(sql_instant(queued))}
                for sid, rid, status, queued in rows}

    def schedules_page(self, include_archived: bool, page: int, state: str | None = None,
                       by_next_fire: bool = False) -> dict[str, Any]:
        """The dashboard's schedules page from one snapshot: a page of schedules, how many
        there are, and the newest run of each schedule shown."""
        schedules = self.list_schedules(include_archived, page, state=state, by_next_fire=by_next_fire)
        return {"schedules": schedules, "total": self.count_schedules(include_archived, state),
                "last_runs": self.last_runs([s["id"] for s in schedules])}

    def occurrences(self, schedule_id: str, limit: int = 100) -> list[dict[str, Any]]:
        self._schedule(schedule_id)
        query = self.db.Occurrence.select(lambda o: o.schedule.id == schedule_id)
        return [occurrence_view(o) for o in query.order_by(lambda o: orm.desc(o.due_at))[:limit]]

    def schedule_zones(self) -> dict[str, tuple[str, str]]:
        """schedule id -> (name, timezone), for pages that list runs of many schedules."""
        rows = self.db.select(f"SELECT id, name, {self.dialect.json_text('definition', 'timing', 'timezone')} "
                              'FROM "Schedule"')
        return {sid: (name, tz) for sid, name, tz in rows}

    def fire_sources(self) -> list[FireSource]:
        """The schedules that are not archived and fire on a timing, for the upcoming list."""
        return [FireSource("schedule", s.id, s.name, s.definition["timing"].get("timezone") or "UTC",
                           s.definition["timing"], aware(s.next_fire_at), not s.enabled, aware(s.anchored_at))
                for s in self.db.Schedule.select(lambda s: not s.archived)
                if s.definition["timing"]["kind"] in ("cron", "interval", "once")]

    def next_due_at(self) -> datetime | None:
        due = orm.min(s.next_fire_at for s in self.db.Schedule if not s.archived)
        return aware(due)

    def _record_slot(self, s, due_at: datetime, trigger: str, outcome: SlotOutcome, now: datetime,
                     *, run_id: str | None = None, missed_count: int = 0) -> str | None:
        """Insert one ledger row; None when the slot was already claimed (a second claimer)."""
        oid = new_id("occ")
        rows = self.core.returning(
            'INSERT INTO "Occurrence" (id, schedule, due_at, trigger, outcome, missed_count, run_id, created_at) '
            "VALUES ($oid, $sid, $due, $trigger, $outcome, $missed, $run_id, $now) "
            "ON CONFLICT (schedule, due_at) DO NOTHING RETURNING id",
            {"oid": oid, "sid": s.id, "due": sql_time(due_at), "trigger": trigger, "outcome": str(outcome),
             "missed": missed_count, "run_id": run_id, "now": sql_time(now)})
        return rows[0] if rows else None

    def _fire_slot(self, s, due_at: datetime, trigger: str, now: datetime, missed_count: int = 0,
                   since: datetime | None = None, counted_all: bool = True, head: str | None = None,
                   pending: str | None = None) -> tuple[SlotOutcome, str | None, str | None]:
        """Apply the overlap rule (and skip_if_unchanged: ``head`` is what source_ref resolves
        to now, and the commit a run it admits starts from: see RunPlan) to one due slot: returns
        (outcome, run id, occurrence id). ``pending`` is the ledger row of a slot that waited for
        a human (catch_up ask): it is decided, not added."""
        d = s.definition
        active = self._active_run(s.id)
        policy = d["concurrency_policy"]
        if active is not None and policy == "skip_if_active":
            outcome, run = SlotOutcome.SKIPPED_OVERLAP, active
        elif active is not None and policy == "coalesce_if_active":
            outcome, run = SlotOutcome.COALESCED, active
        elif head is not None and trigger != "manual" and head == self._last_success_commit(s.id):
            outcome, run = SlotOutcome.SKIPPED_UNCHANGED, None
        else:
            outcome, run = SlotOutcome.ADMITTED, None
        if pending is not None:
            self.db.execute('UPDATE "Occurrence" SET outcome = $o, trigger = $t, missed_count = $m, run_id = $r '
                            'WHERE id = $oid', {"o": str(outcome), "t": trigger, "m": missed_count,
                                                "r": run.id if run else None, "oid": pending})
            oid = pending
        else:
            oid = self._record_slot(s, due_at, trigger, outcome, now, run_id=run.id if run else None,
                                    missed_count=missed_count)
        if oid is None:
            return outcome, None, None
        if outcome == SlotOutcome.ADMITTED:
            tz = ZoneInfo(d["timing"]["timezone"])
            prompt = render_brief(d["brief"], due_at, tz)
            if trigger == "catch_up":
                prompt += catch_up_note(missed_count, since or due_at, tz, counted_all=counted_all)
            run_id = self.runs.queue_run(queued_from(d, trigger, prompt, schedule_id=s.id, label=s.name,
                                                     due_at=due_at, missed_count=missed_count, occurrence_id=oid,
                                                     resolved_commit=head), now)
            self.db.execute('UPDATE "Occurrence" SET run_id = $rid WHERE id = $oid', {"rid": run_id, "oid": oid})
            s.last_fired_at = naive(now)
            self.core.emit("occurrence.claimed", {"occurrence_id": oid, "schedule_id": s.id, "due_at": rfc3339(due_at),
                                                  "run_id": run_id, "trigger": trigger}, now)
            return outcome, run_id, oid
        if outcome == SlotOutcome.COALESCED and run.status == RunStatus.QUEUED:
            run.missed_count += 1
        self.core.emit("occurrence.skipped", {"occurrence_id": oid, "schedule_id": s.id, "due_at": rfc3339(due_at),
                                              "outcome": str(outcome), "active_run_id": run.id if run else None}, now)
        return outcome, None, oid

    def _last_success_commit(self, schedule_id: str) -> str | None:
        row = self.db.select("SELECT resolved_commit FROM \"Run\" WHERE schedule = $sid "
                             f"AND status = '{RunStatus.SUCCEEDED}' ORDER BY finished_at DESC, id DESC LIMIT 1",
                             {"sid": schedule_id})
        return row[0] if row else None

    def unchanged_checks(self, now: datetime) -> list[tuple[str, str, str]]:
        """(schedule id, repository, source_ref) of the due schedules that skip_if_unchanged:
        the cron actor resolves their refs (git) before it claims."""
        rows = self.db.select(   # the flag is stored only when true: a LIKE keeps the others unread
            'SELECT id, definition FROM "Schedule" WHERE enabled AND NOT archived AND next_fire_at <= $now '
            "AND CAST(definition AS TEXT) LIKE '%\"skip_if_unchanged\"%' ORDER BY next_fire_at, id",
            {"now": sql_time(now)})
        definitions = [(sid, json.loads(text) if isinstance(text, str) else text) for sid, text in rows]
        return [(sid, d["repository"], d["source_ref"]) for sid, d in definitions if d.get("skip_if_unchanged")]

    def _plan_catch_up(self, s, missed: list[datetime], total: int, now: datetime, *, first_due: datetime,
                       counted_all: bool = True) -> None:
        """catch_up ask: the missed slots wait (ledger ``pending_catch_up``) and one
        ``catch_up_plan`` item asks a human to approve one catch-up run or dismiss them.
        ``missed`` are the slots recorded (the newest of a long gap), ``first_due`` the gap's
        first slot; ``counted_all`` false: more than ``total`` were missed (counting stopped)."""
        kind = s.definition["timing"]["kind"]
        for slot in missed:
            self._record_slot(s, slot, kind, SlotOutcome.PENDING_CATCH_UP, now)
        plan = s.pending_catch_up or {}
        first = plan.get("first_missed_at") or rfc3339(first_due)
        exact = plan.get("missed_count_exact", True) and counted_all
        s.pending_catch_up = {"missed_count": plan.get("missed_count", 0) + total, "first_missed_at": first,
                              "last_missed_at": rfc3339(missed[-1]), "missed_count_exact": exact}
        # the item always tells the whole plan: a second outage updates its count and window
        title, detail = plan_words(s.name, s.definition["timing"]["timezone"], s.pending_catch_up)
        items = self._open_plan_items(s.id)
        for item in items:
            item.title, item.detail = title, detail
        if not items:
            self.core.raise_attention("catch_up_plan", title, detail, now, schedule_id=s.id, run_id=None)
        self.core.emit("occurrence.skipped", {"schedule_id": s.id, "outcome": SlotOutcome.PENDING_CATCH_UP,
                                              "count": total}, now)

    def _open_plan_items(self, schedule_id: str) -> list[Any]:
        """The schedule's open ``catch_up_plan`` item (one at most, as raised)."""
        return list(self.db.Attention.select(lambda a: a.schedule_id == schedule_id and a.kind == "catch_up_plan"
                                             and a.acknowledged_at is None))

    def decide_catch_up(self, s, approve: bool, now: datetime) -> tuple[SlotOutcome, str | None]:
        """approve_catch_up (one catch-up run, as enqueue_missed_with_cap with max 1) or
        dismiss_catch_up (the slots are ``skipped_missed``): the outcome, and the run's id if one
        was queued. Approved while a run of the schedule is active (its policy not
        always_enqueue) it is ``skipped_overlap``: the plan and its item stay, the item says so."""
        plan = s.pending_catch_up
        if not plan:
            raise Conflict(f"schedule {s.id} has no pending catch-up to decide")
        sid = s.id
        active = self._active_run(sid)
        if approve and active is not None and s.definition["concurrency_policy"] != "always_enqueue":
            _, detail = plan_words(s.name, s.definition["timing"]["timezone"], plan)
            for item in self._open_plan_items(sid):
                item.detail = (f"Run {active.id} of this schedule is still active, so the catch-up did not "
                               f"start: approve again when it ends. {detail}")
            return SlotOutcome.SKIPPED_OVERLAP, None
        rows = list(self.db.Occurrence.select(lambda o: o.schedule.id == sid
                                              and o.outcome == SlotOutcome.PENDING_CATCH_UP)
                    .order_by(lambda o: o.due_at))
        s.pending_catch_up = None
        for item in self._open_plan_items(sid):
            item.acknowledged_at = naive(now)
        if not approve or not rows:
            for o in rows:
                o.outcome = str(SlotOutcome.SKIPPED_MISSED)
            self.core.emit("occurrence.skipped", {"schedule_id": s.id, "outcome": SlotOutcome.SKIPPED_MISSED,
                                                  "count": plan["missed_count"]}, now)
            return SlotOutcome.SKIPPED_MISSED, None
        last = rows[-1]
        _, run_id, _ = self._fire_slot(s, aware(last.due_at), "catch_up", now, missed_count=plan["missed_count"],
                                       since=parse_instant(plan["first_missed_at"]), pending=last.id,
                                       counted_all=plan.get("missed_count_exact", True))
        for o in rows[:-1]:
            o.outcome, o.run_id = str(SlotOutcome.FOLDED), run_id
        return SlotOutcome.ADMITTED, run_id

    def _record_paused(self, s, slots: list[datetime], total: int, now: datetime) -> None:
        for slot in slots:
            self._record_slot(s, slot, s.definition["timing"]["kind"], SlotOutcome.PAUSED, now)
        self.core.emit("occurrence.skipped", {"schedule_id": s.id, "outcome": SlotOutcome.PAUSED, "count": total}, now)

    def _settle_paused_slots(self, s, now: datetime) -> None:
        """Before a paused schedule is enabled: its slots that came due are ``paused``, not missed."""
        if s.next_fire_at is None or aware(s.next_fire_at) > now:
            return
        timing, anchor = s.definition["timing"], aware(s.anchored_at)
        due = due_slots(timing, aware(s.next_fire_at), now, anchor=anchor)
        later = next_fires(timing, due.recent[-1], 1, anchor=anchor) if due.recent else []
        s.next_fire_at = naive(later[0]) if later else None
        self._record_paused(s, due.recent, due.count, now)

    def _held_for_reconfirm(self, s, digests: dict[str, str] | None, now: datetime) -> bool:
        """docs/agent-clis.md: the profile changed since the schedule was confirmed, so nothing runs
        under authority nobody confirmed; one ``reconfirm`` item asks a human (once per
        confirmation). A schedule confirmed before digests were kept adopts its profile's now."""
        if digests is None:
            return False
        current = digests.get(s.definition["agent"])
        if s.profile_digest is None:
            s.profile_digest = current
            return False
        if current == s.profile_digest:
            return False
        confirmed = s.confirmed_at
        sid = s.id
        if not self.db.Attention.exists(lambda a: a.schedule_id == sid and a.kind == "reconfirm"
                                        and a.created_at >= confirmed):
            agent = s.definition["agent"]
            change = "was removed from outpost.toml" if current is None else "changed in outpost.toml"
            self.core.raise_attention("reconfirm", f"Schedule '{s.name}' is held: agent profile {agent} {change}",
                                      "Its fires are held (held_reconfirm) until a human reviews the schedule and "
                                      "confirms it again (Edit, review, confirm; or compose + PATCH with the same "
                                      "definition).", now, schedule_id=s.id, run_id=None)
        return True

    def claim_due(self, now: datetime, grace_s: float = MISFIRE_GRACE_S, digests: dict[str, str] | None = None,
                  heads: dict[str, str] | None = None, up_since: datetime | None = None,
                  until: datetime | None = None) -> list[str]:
        """Claim every due slot of every schedule in one transaction; return the queued run ids.

        A slot more than ``grace_s`` late was missed (downtime) and follows ``catch_up``, and
        so was every slot due before ``up_since`` (the daemon was down) but the newest;
        a paused schedule's slots are recorded as ``paused``, and those of a schedule whose
        profile changed since it was confirmed ``held_reconfirm``. ``heads`` (schedule id ->
        commit) serve skip_if_unchanged. A slot missed while the daemon was up (due after
        ``up_since``: a stalled store, a clock step) raises the dead-man's ``missed_fire`` item.
        The next fire advances in the same transaction, and the ledger's UNIQUE (schedule,
        due_at) stops a second claimer. ``until``: claim only slots due by then (those whose
        ``heads`` were resolved); later ones wait for the next claim."""
        queued: list[str] = []
        cutoff = min(until, now) if until is not None else now
        due = self.db.Schedule.select(lambda s: not s.archived and s.next_fire_at is not None
                                      and s.next_fire_at <= naive(cutoff))
        for s in due.order_by(lambda s: s.next_fire_at):
            timing = s.definition["timing"]
            anchor = aware(s.anchored_at)
            first_due = aware(s.next_fire_at)
            due = due_slots(timing, first_due, cutoff, anchor=anchor)
            total, slots = due.count, due.recent
            later = next_fires(timing, slots[-1], 1, anchor=anchor) if slots else []
            s.next_fire_at = naive(later[0]) if later else None
            kind = timing["kind"]
            if not s.enabled:
                self._record_paused(s, slots, total, now)
                continue
            if self._held_for_reconfirm(s, digests, now):
                for slot in slots:
                    self._record_slot(s, slot, kind, SlotOutcome.HELD_RECONFIRM, now)
                self.core.emit("occurrence.skipped", {"schedule_id": s.id, "outcome": SlotOutcome.HELD_RECONFIRM,
                                                      "count": total}, now)
                continue
            missed = [t for t in slots if (now - t).total_seconds() > grace_s]
            if up_since is not None:   # back from downtime: only its newest slot can be on time
                missed += list(itertools.takewhile(lambda t: t < up_since, slots[len(missed):-1]))
            current = slots[len(missed):]
            policy = s.definition["catch_up"]["policy"]
            if up_since is not None and (while_up := [t for t in missed if t >= up_since]):
                self._missed_fire(s, while_up, now)
            if missed and policy == "enqueue_missed_with_cap":
                missed, current = slots, []   # the slot just due joins the catch-up: one run, not two
            missed_total = total - len(current)   # slots older than the recorded ones were missed too
            head = (heads or {}).get(s.id)
            if missed and policy == "ask":
                self._plan_catch_up(s, missed, missed_total, now, first_due=first_due, counted_all=due.counted_all)
            elif missed and policy == "skip_missed":
                for slot in missed:
                    self._record_slot(s, slot, kind, SlotOutcome.SKIPPED_MISSED, now)
                self.core.emit("occurrence.skipped", {"schedule_id": s.id, "outcome": SlotOutcome.SKIPPED_MISSED,
                                                      "count": missed_total}, now)
            elif missed:
                cap = s.definition["catch_up"]["max"]
                fired, folded = missed[-cap:], missed[:-cap]
                outcome, run_id, _ = self._fire_slot(s, fired[0], "catch_up", now,
                                                     missed_count=missed_total - len(fired) + 1, since=first_due,
                                                     counted_all=due.counted_all, head=head)
                for slot in folded:
                    self._record_slot(s, slot, kind, SlotOutcome.FOLDED, now, run_id=run_id)
                queued += [run_id] if run_id else []
                for slot in fired[1:]:
                    _, run_id, _ = self._fire_slot(s, slot, "catch_up", now, missed_count=1, since=slot, head=head)
                    queued += [run_id] if run_id else []
            for slot in current:
                _, run_id, _ = self._fire_slot(s, slot, kind, now, head=head)
                queued += [run_id] if run_id else []
        return queued

    def _missed_fire(self, s, late: list[datetime], now: datetime) -> None:
        """The dead-man alert: slots that came due while the daemon was up and were not claimed
        within MISFIRE_GRACE_S (a stalled actor or store, a clock step): one item per claim
        (folded into the open one), unless the schedule mutes it."""
        if "missed_fire" in s.definition.get("mute", []):
            return
        tz = ZoneInfo(s.definition["timing"]["timezone"])
        lateness = int((now - late[0]).total_seconds())
        more = f" and {len(late) - 1} more" if len(late) > 1 else ""
        self.core.raise_attention("missed_fire", f"Schedule '{s.name}' missed its fire at "
                                  f"{late[0].astimezone(tz):%Y-%m-%d %H:%M %Z}{more}",
                                  f"Claimed {lateness} s late while Outpost was running (a stalled scheduler or "
                                  f"database, or a clock step); catch_up {s.definition['catch_up']['policy']} applied.",
                                  now, schedule_id=s.id, run_id=None)

    def fire_manual(self, schedule_id: str, revision: int, now: datetime,
                    digests: dict[str, str] | None = None) -> dict[str, Any]:
        s = self._schedule(schedule_id)
        self._guard(s, revision)
        if self._held_for_reconfirm(s, digests, now):
            raise Conflict(f"schedule {s.id} is held: its agent profile {s.definition['agent']} changed since it "
                           "was confirmed; review and confirm it again before it runs")
        due = now
        while self.db.Occurrence.get(schedule=s, due_at=naive(due)):   # never two fires at one instant
            due += timedelta(milliseconds=1)
        outcome, run_id, oid = self._fire_slot(s, due, "manual", now)
        if outcome == SlotOutcome.ADMITTED:
            return {"occurrence_id": oid, "outcome": SlotOutcome.ADMITTED, "run_id": run_id}
        active = self._active_run(s.id)   # a manual fire never queues behind active work
        return {"occurrence_id": oid, "outcome": SlotOutcome.SKIPPED_OVERLAP, "run_id": active.id if active else None}

    def create_dispatch(self, payload: dict[str, Any], now: datetime, commit: str | None = None,
                        requested_by: str | None = None) -> dict[str, Any]:
        """A one-shot run; ``requested_by``: the proposer key that asked for it."""
        run = queued_from(payload, "dispatch", payload["brief"], resolved_commit=commit, requested_by=requested_by)
        return {"run_id": self.runs.queue_run(run, now)}

    def snapshot(self) -> dict[str, Any]:
        active = self.db.Run.select(lambda r: r.status in ACTIVE_RUN_STATUSES).order_by(
            lambda r: (r.queued_at, r.id))
        return {"cursor": self.core.latest_cursor(), "schedules": self.list_schedules(),
                "active_runs": [run_view(r) for r in active],
                "open_attention": self.core.list_attention(open_only=True)}

    def inspect(self, schedule_id: str) -> dict[str, Any]:
        """The six recovery checks, in order (docs/http-api.md)."""
        s = self._schedule(schedule_id)
        view = self._schedule_view(s)
        active = self._active_run(s.id)
        skips = self.db.Occurrence.select(lambda o: o.schedule == s and o.outcome != SlotOutcome.ADMITTED).order_by(
            lambda o: orm.desc(o.due_at))[:10]
        runs = self.db.Run.select(lambda r: r.schedule == s).order_by(lambda r: orm.desc(r.queued_at))[:5]
        latest = runs[0] if runs else None
        auto_item = self.db.Attention.select(lambda a: a.schedule_id == s.id and a.kind == "auto_pause").order_by(
            lambda a: orm.desc(a.created_at)).first()
        paused_since = self._paused_since(s.id) if not s.enabled or s.auto_paused else None
        if latest is None:
            boundary = "no run yet"
        elif latest.status == RunStatus.QUEUED:
            boundary = "queued: admitted but not started (it will start, also after a restart)"
        elif latest.status in (RunStatus.RUNNING, RunStatus.PAUSED):
            boundary = f"started at {rfc3339(aware(latest.started_at))}, not settled ({latest.status})"
        else:
            started = f"started at {rfc3339(aware(latest.started_at))}" if latest.started_at else "never started"
            boundary = f"{started}, settled {latest.status} at {rfc3339(aware(latest.finished_at))}"
        report = {
            "schedule_id": s.id, "name": s.name, "concurrency_policy": view["concurrency_policy"],
            "checks": [
                {"check": 1, "title": "definition and next fire",
                 "data": {**{k: view[k] for k in ("revision", "enabled", "archived", "auto_paused", "timing",
                                                  "next_fire_at", "last_fired_at")}, "paused_since": paused_since}},
                {"check": 2, "title": "active occurrence and recent skips",
                 "data": {"active_run_id": active.id if active else None,
                          "active_occurrence_id": active.occurrence_id if active else None,
                          "recent_skips": [occurrence_view(o) for o in skips]}},
                {"check": 3, "title": "recent runs",
                 "data": {"runs": [{"run_id": r.id, "status": r.status, "due_at": rfc3339(aware(r.due_at)),
                                    "resolved_commit": r.resolved_commit} for r in runs]}},
                {"check": 4, "title": "attempt boundary of the latest run",
                 "data": {"run_id": latest.id if latest else None, "boundary": boundary}},
                {"check": 5, "title": "failure streak and auto-pause",
                 "data": {"failure_streak": s.failure_streak, "auto_paused": s.auto_paused,
                          "auto_pause_attention_id": auto_item.id if auto_item else None,
                          "acknowledged": bool(auto_item and auto_item.acknowledged_at)}},
                {"check": 6, "title": "latest event cursor",
                 "data": {"cursor": self.core.latest_cursor()}},
            ]}
        return {**report, "verdict": inspect_verdict(report)}

    #: How far back in the event log the instant of a pause is looked for.
    PAUSE_EVENTS_READ = 500

    def _paused_since(self, schedule_id: str) -> str | None:
        """When the schedule was last paused (by a human or auto-pause), while the event log still has it."""
        events = self.db.Event.select(lambda e: e.type == "schedule.controlled").order_by(
            lambda e: orm.desc(e.cursor))[:self.PAUSE_EVENTS_READ]
        return next((rfc3339(aware(e.at)) for e in events if e.data.get("schedule_id") == schedule_id
                     and e.data.get("action") in ("pause", "auto_pause")), None)

    def notify_run(self, run_id: str, now: datetime) -> None:
        """Apply a settled run once: its attention items (the runs part), then its schedule's failure
        streak, and auto-pause after AUTO_PAUSE_STREAK failures in a row."""
        r = self.runs.raise_run_attention(run_id, now)
        if r is None or r.schedule is None:
            return
        s, status = r.schedule, RunStatus(r.status)
        s.failure_streak = next_failure_streak(s.failure_streak, status, r.failure_kind, r.error)
        if s.failure_streak >= AUTO_PAUSE_STREAK and not s.auto_paused and not s.archived:
            s.enabled, s.auto_paused = False, True
            s.revision += 1
            s.updated_at = naive(now)
            self.core.raise_attention("auto_pause",
                                      f"Schedule '{s.name}' was paused after {s.failure_streak} failures in a row",
                                      "Inspect its failed runs, fix the definition or repository, then resume it.", now,
                                      schedule_id=s.id, run_id=r.id)
            self.core.emit("schedule.controlled", {"schedule_id": s.id, "action": "auto_pause",
                                                   "revision": s.revision}, now)


###############################################################################
# 10. Store: the nodes of a fleet, access (keys, sessions), the notification outbox.
###############################################################################

class NodeStore(StorePart):
    """The nodes of a fleet (one on SQLite): a node's unique name, its heartbeat and
    max_running, and the settlement of the runs of a node that stopped beating."""

    def __init__(self, core: StoreCore, runs: RunStore):
        super().__init__(core)
        self.runs = runs

    def register_node(self, max_running: int) -> list[tuple[str, int, str]]:
        """This process is a node, up from now (a restart under the same name is the same node,
        starting again). Returns the agents its previous process may have left behind whose runs
        another node settled meanwhile (declared lost): (run id, pid, pid start time). In a fleet,
        NodeNameTaken if another process holds the name (it took it while this one was silent)."""
        if not self.dialect.fleet:   # the one process of an appliance is its only node, whatever it was called
            self.db.execute('DELETE FROM "Node" WHERE name <> $name', {"name": self.core.node})
        previous = self.db.select('SELECT orphans FROM "Node" WHERE name = $name', {"name": self.core.node})
        orphans = [tuple(agent) for agent in json.loads(previous[0])] if previous and previous[0] else []
        if not self.core.returning(
                'INSERT INTO "Node" (name, started_at, heartbeat_at, max_running, status, process) '
                f"VALUES ($name, {self.dialect.db_now()}, {self.dialect.db_now()}, $max, '{NodeStatus.UP}', $me) "
                "ON CONFLICT (name) DO UPDATE SET "
                "started_at = excluded.started_at, heartbeat_at = excluded.heartbeat_at, "
                f"max_running = excluded.max_running, status = '{NodeStatus.UP}', orphans = NULL, "
                "process = excluded.process"
                + self.dialect.node_takeover
                + " RETURNING name", {"name": self.core.node, "max": max_running, "me": self.core.process}):
            raise NodeNameTaken(f"node name {self.core.node!r} is held by another process now")
        return orphans

    def claim_node_name(self, replacing: str | None = None) -> str | None:
        """A node's name is one process's at a time (docs/fleet.md): two processes under one name would
        take each other's runs for their own. Claims it for this process, unless another process
        holds it and its heartbeat is under NODE_LOST_S old (and it is not ``replacing``, one the
        caller saw end): then returns that process and changes nothing."""
        held = self.db.select(f"SELECT process FROM \"Node\" WHERE name = $name AND status = '{NodeStatus.UP}' "
                              "AND process <> $me "
                              f"AND heartbeat_at >= {self.dialect.db_now(-NODE_LOST_S)}",
                              {"name": self.core.node, "me": self.core.process})
        if held and held[0] != replacing:
            return held[0]
        self.db.execute(
            'INSERT INTO "Node" (name, started_at, heartbeat_at, max_running, status, process) '
            f"VALUES ($name, {self.dialect.db_now()}, {self.dialect.db_now()}, 0, '{NodeStatus.UP}', $me) "
            "ON CONFLICT (name) DO UPDATE SET "
            "heartbeat_at = excluded.heartbeat_at, process = excluded.process", {"name": self.core.node,
                                                                                 "me": self.core.process})
        return None

    def release_node_name(self) -> None:
        """A clean stop: the name is free for the next process at once."""
        self.db.execute('UPDATE "Node" SET process = NULL WHERE name = $name AND process = $me',
                        {"name": self.core.node, "me": self.core.process})

    def node_heartbeat(self) -> float | None:
        """On the database's clock; returns the seconds since this node's previous heartbeat. None
        once a survivor has declared this node lost (the runs it was running are settled and no
        longer its own), or another process holds its name."""
        mine = {"name": self.core.node, "me": self.core.process}
        gap = self.db.select(f"SELECT {self.dialect.age_s('heartbeat_at')} FROM \"Node\" WHERE name = $name "
                             f"AND status = '{NodeStatus.UP}' AND process = $me", mine)
        if not gap or not self.core.returning(f'UPDATE "Node" SET heartbeat_at = {self.dialect.db_now()} '
                                              f"WHERE name = $name AND status = '{NodeStatus.UP}' AND process = $me "
                                              "RETURNING name", mine):
            return None
        return float(gap[0])

    def settle_lost_nodes(self, now: datetime, beat_gap_s: float) -> list[str]:
        """The nodes silent for NODE_LOST_S are lost. Their runs that never started go back to
        the queue (a later admission's attempt fences the lost one's writes); their in-flight
        Idempotency-Keys are forgotten; their started runs are settled failed/interrupted,
        never started again (docs/fleet.md): nothing here can reach their processes. Returns the
        runs it settled. Only a node that has been beating itself declares another lost
        (``beat_gap_s``: the time from its previous beat to its last, under NODE_LOST_S -
        NODE_HEARTBEAT_S): after the database was out of every node's reach, the first node back
        cannot tell a dead node from one that could not beat either, and looks again a beat later."""
        if beat_gap_s >= NODE_LOST_S - NODE_HEARTBEAT_S:
            return []
        lost = self.core.returning(f"UPDATE \"Node\" SET status = '{NodeStatus.LOST}' WHERE status = '{NodeStatus.UP}' "
                                   "AND name <> $me "
                                   f"AND heartbeat_at < {self.dialect.db_now(-NODE_LOST_S)} RETURNING name",
                                   {"me": self.core.node})
        if not lost:
            return []
        log.getChild("fleet").warning("node(s) lost: %s", ", ".join(lost))
        settled = []
        for name in lost:
            unstarted = self.db.select(f"SELECT id FROM \"Run\" WHERE node = $n AND status = '{RunStatus.RUNNING}' "
                                       "AND pid IS NULL ORDER BY id", {"n": name})
            requeued = [r for r in unstarted if self.runs.requeue_unstarted(r, now,
                                                                            "its node was lost before it started")]
            self.db.execute(f"DELETE FROM \"IdempotencyRecord\" WHERE state = '{IdempotencyState.IN_FLIGHT}' "
                            "AND node = $n", {"n": name})
            mine, orphans = [], []
            for run_id, attempt, pid, pid_started in self.db.select(
                    "SELECT id, attempt, pid, pid_started FROM \"Run\" WHERE node = $n "
                    f"AND status IN {sql_tuple((RunStatus.RUNNING, RunStatus.PAUSED))} ORDER BY id", {"n": name}):
                if self.runs.settle_run(run_id, failed(INTERRUPTED, "interrupted"), now, fence=(name, attempt)):
                    mine.append(run_id)
                    orphans.append([run_id, pid, pid_started])
            # its agents may live on: the node ends them when it comes back (register_node)
            self.db.execute('UPDATE "Node" SET orphans = $agents WHERE name = $n',
                            {"agents": json.dumps(orphans), "n": name})
            self.core.emit("node.lost", {"node": name, "settled": mine, "requeued": requeued}, now)
            settled += mine
        return settled

    def next_loss_in(self) -> float | None:
        """Seconds until the oldest heartbeat of another node up is NODE_LOST_S old (None: no
        other node is up), so a survivor settles a dead node's runs then, not up to a beat later."""
        oldest = self.db.select(f"SELECT MAX({self.dialect.age_s('heartbeat_at')}) FROM \"Node\" "
                                f"WHERE status = '{NodeStatus.UP}' AND name <> $me", {"me": self.core.node})[0]
        return None if oldest is None else NODE_LOST_S - float(oldest)

    def other_nodes_up(self) -> bool:
        """Another node of the fleet is up (its heartbeat younger than NODE_LOST_S)."""
        return bool(self.db.select(f"SELECT name FROM \"Node\" WHERE status = '{NodeStatus.UP}' AND name <> $me "
                                   f"AND heartbeat_at >= {self.dialect.db_now(-NODE_LOST_S)} LIMIT 1",
                                   {"me": self.core.node}))

    def list_nodes(self) -> list[dict[str, Any]]:
        running = dict(self.db.select(f'SELECT node, COUNT(*) FROM "Run" WHERE status = \'{RunStatus.RUNNING}\' '
                                      'GROUP BY node'))
        return [{"name": n.name, "started_at": rfc3339(aware(n.started_at)),
                 "heartbeat_at": rfc3339(aware(n.heartbeat_at)), "running": running.get(n.name, 0),
                 "max_running": n.max_running, "status": n.status}
                for n in self.db.Node.select().order_by(lambda n: n.name)]


class AccessStore(StorePart):
    """Access: Idempotency-Keys (reserved, answered, replayed), dashboard sessions and
    one-time sign-in codes, and their expiry."""

    def begin_idempotent(self, key: str, fingerprint: str, now: datetime) -> tuple[int, Any] | None:
        """Reserve a key; or the stored (status, body) to replay. Raises on reuse / in flight."""
        horizon = sql_time(now - timedelta(seconds=IDEMPOTENCY_TTL_S))
        self.db.execute('DELETE FROM "IdempotencyRecord" WHERE key = $key AND created_at < $h',
                        {"key": key, "h": horizon})
        rows = self.core.returning('INSERT INTO "IdempotencyRecord" (key, fingerprint, state, node, created_at) '
                                   f"VALUES ($key, $fp, '{IdempotencyState.IN_FLIGHT}', $node, $now) "
                                   "ON CONFLICT (key) DO NOTHING RETURNING key",
                                   {"key": key, "fp": fingerprint, "node": self.core.node, "now": sql_time(now)})
        if rows:
            return None
        rec = self.db.IdempotencyRecord[key]
        if rec.fingerprint != fingerprint:
            raise IdempotencyKeyReused("this Idempotency-Key was used for a different request "
                                       "(method, path or body); use a new key")
        if rec.state != IdempotencyState.DONE:
            if aware(rec.created_at) > now - timedelta(seconds=IN_FLIGHT_STALE_S):
                raise Conflict("a request with this Idempotency-Key is still in flight")
            rec.created_at = naive(now)   # its request died without an answer (it changed nothing): retry
            return None
        return rec.status, rec.body

    def finish_idempotent(self, key: str, status: int, body: Any) -> None:
        self.db.execute(f'UPDATE "IdempotencyRecord" SET state = \'{IdempotencyState.DONE}\', status = $status, '
                        'body = $body WHERE key = $key', {"status": status, "body": json.dumps(body), "key": key})

    def abandon_idempotent(self, key: str) -> None:
        self.db.execute("DELETE FROM \"IdempotencyRecord\" WHERE key = $key "
                        f"AND state = '{IdempotencyState.IN_FLIGHT}'", {"key": key})

    def create_session(self, now: datetime) -> tuple[str, str]:
        """A new signed-in browser: (cookie value, CSRF token)."""
        cookie, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(24)
        self.db.DashboardSession(id=hashlib.sha256(cookie.encode()).hexdigest(), csrf=csrf, created_at=naive(now),
                                 expires_at=naive(now + timedelta(seconds=SESSION_TTL_S)))
        return cookie, csrf

    def session_csrf(self, cookie: str, now: datetime) -> str | None:
        """The CSRF token of a live session, or None (unknown or expired cookie)."""
        found = self.db.DashboardSession.get(id=hashlib.sha256(cookie.encode()).hexdigest())
        return found.csrf if found and aware(found.expires_at) > now else None

    def set_flash(self, cookie: str, path: str, context: dict[str, Any]) -> None:
        """What the page at ``path`` shows once, the next time this session views it: a form's
        one-time secret, kept here rather than in the redirect's URL (POST/redirect/GET)."""
        found = self.db.DashboardSession.get(id=hashlib.sha256(cookie.encode()).hexdigest())
        if found is not None:
            found.flash = {"path": path, "context": context}

    def take_flash(self, cookie: str, path: str) -> dict[str, Any]:
        """The flash of ``path``, removed as it is read (a reload no longer shows it); {} when none."""
        found = self.db.DashboardSession.get(id=hashlib.sha256(cookie.encode()).hexdigest())
        if found is None or not found.flash or found.flash.get("path") != path:
            return {}
        context, found.flash = found.flash["context"], None
        return context

    def end_session(self, cookie: str) -> None:
        self.db.execute('DELETE FROM "DashboardSession" WHERE id = $sid',
                        {"sid": hashlib.sha256(cookie.encode()).hexdigest()})

    def create_signin_code(self, now: datetime) -> str:
        code = secrets.token_urlsafe(24)
        self.db.SigninCode(id=hashlib.sha256(code.encode()).hexdigest(),
                           expires_at=naive(now + timedelta(seconds=SIGNIN_CODE_TTL_S)))
        return code

    def use_signin_code(self, code: str, now: datetime) -> bool:
        """True once per code, within its lifetime (a conditional UPDATE: one use only)."""
        return bool(self.core.returning(
            'UPDATE "SigninCode" SET used_at = $now WHERE id = $cid AND used_at IS NULL AND expires_at > $now '
            "RETURNING id", {"now": sql_time(now), "cid": hashlib.sha256(code.encode()).hexdigest()}))

    # Keys of a person's own agent, and what they propose (docs/agent-clis.md).

    def create_key(self, name: str, role: str, now: datetime) -> dict[str, Any]:
        """A new key, returned this once; only its SHA-256 is stored."""
        if self.db.AccessKey.get(name=name):
            raise Conflict(f"a key named {name!r} exists; revoke it first or choose another name")
        key = PROPOSER_KEY_PREFIX + secrets.token_urlsafe(32)
        self.db.AccessKey(name=name, role=role, digest=hashlib.sha256(key.encode()).hexdigest(),
                          created_at=naive(now))
        return {"name": name, "role": role, "key": key, "created_at": rfc3339(now)}

    def list_keys(self) -> list[dict[str, Any]]:
        return [{"name": k.name, "role": k.role, "created_at": rfc3339(aware(k.created_at))}
                for k in self.db.AccessKey.select().order_by(lambda k: k.name)]

    def revoke_key(self, name: str) -> None:
        key = self.db.AccessKey.get(name=name)
        if key is None:
            raise NotFound(f"no key named {name!r} (`outpost keys list` lists them)")
        key.delete()

    def key_of(self, given: str) -> dict[str, Any] | None:
        """The key ``given`` is (name and role), or None: looked up by its digest, so a revoked
        key stops at once."""
        key = self.db.AccessKey.get(digest=hashlib.sha256(given.encode()).hexdigest())
        return {"name": key.name, "role": key.role} if key else None

    def create_proposal(self, kind: str, schedule_id: str | None, body: dict[str, Any], base_revision: int | None,
                        review: dict[str, Any], proposed_by: str, now: datetime) -> dict[str, Any]:
        """A proposal, and the ``proposal`` item that asks a human to confirm or decline it."""
        pid = new_id("prp")
        what = {"create": f"a new schedule {body.get('definition', {}).get('name', '')!r}",
                "change": f"a change to {review.get('name', schedule_id)!r}",
                "control": f"{body.get('action')} {review.get('name', schedule_id)!r}"}[kind]
        definition = review["definition"]   # its times are for its review page, in the schedule's zone
        detail = {"create": f"Agent {definition['agent']!r} on {definition['repository']}, "
                            f"{describe_timing(definition['timing'])}.",
                  "change": "Changes " + ", ".join(d["field"] for d in review.get("diff", [])) + ".",
                  "control": review.get("summary")}[kind] + " Review it, then confirm or decline."
        attention = self.core.raise_attention("proposal", f"{proposed_by} proposes {what}", detail, now,
                                              schedule_id=schedule_id, run_id=None, link=f"/proposals/{pid}")
        p = self.db.Proposal(id=pid, kind=kind, state=ProposalState.PENDING, schedule_id=schedule_id, body=body,
                             base_revision=base_revision, review=review, proposed_by=proposed_by,
                             attention_id=attention, created_at=naive(now))
        self.core.emit("proposal.created", {"proposal_id": pid, "kind": kind, "schedule_id": schedule_id}, now)
        return proposal_view(p, now)

    def get_proposal(self, proposal_id: str, now: datetime) -> dict[str, Any]:
        p = self.db.Proposal.get(id=proposal_id)
        if p is None:
            raise NotFound(f"no proposal {proposal_id}")
        return proposal_view(p, now)

    def list_proposals(self, state: str | None, now: datetime, limit: int = 100) -> list[dict[str, Any]]:
        """Newest first (ties by id); ``state`` as the views say it (a pending one past its week is stale)."""
        query = self.db.Proposal.select().order_by(lambda p: (orm.desc(p.created_at), orm.desc(p.id)))
        views = (proposal_view(p, now) for p in query)
        return list(itertools.islice((v for v in views if state in (None, v["state"])), limit))

    def decide_proposal(self, proposal_id: str, state: ProposalState, note: str | None, now: datetime,
                        schedule_id: str | None = None) -> dict[str, Any]:
        """Settle a pending proposal once (a conditional UPDATE: two confirms cannot both apply it)
        and close its item."""
        p = self.db.Proposal.get(id=proposal_id)
        if p is None:
            raise NotFound(f"no proposal {proposal_id}")
        current = proposal_view(p, now)
        if current["state"] != ProposalState.PENDING and state != ProposalState.STALE:
            raise Conflict(f"proposal {proposal_id} is {current['state']}; only a pending proposal can be decided")
        changed = self.db.execute('UPDATE "Proposal" SET state = $state, note = $note, decided_at = $now, '
                                  "schedule_id = COALESCE($sid, schedule_id) "
                                  f"WHERE id = $id AND state = '{ProposalState.PENDING}'",
                                  {"state": state, "note": note, "now": sql_time(now), "sid": schedule_id,
                                   "id": proposal_id}).rowcount
        if not changed:
            raise Conflict(f"proposal {proposal_id} was decided meanwhile")
        self.db.execute('UPDATE "Attention" SET acknowledged_at = $now WHERE id = $aid AND acknowledged_at IS NULL',
                        {"now": sql_time(now), "aid": p.attention_id})
        self.core.emit("proposal.decided", {"proposal_id": proposal_id, "state": state}, now)
        return {**current, "state": state, "note": note, "decided_at": rfc3339(now),
                "schedule_id": schedule_id or current["schedule_id"]}

    def forget_in_flight(self) -> int:
        """At boot: an in-flight key of this node belongs to its previous process, which died
        before committing its action (another node's are its own, still in flight)."""
        return self.db.execute(f"DELETE FROM \"IdempotencyRecord\" WHERE state = '{IdempotencyState.IN_FLIGHT}' "
                               f"AND {self.dialect.own_rows}", {"me": self.core.node}).rowcount

    def purge_expired(self, now: datetime) -> int:
        horizon = sql_time(now - timedelta(seconds=IDEMPOTENCY_TTL_S))
        self.db.execute('DELETE FROM "DashboardSession" WHERE expires_at < $now', {"now": sql_time(now)})
        self.db.execute('DELETE FROM "SigninCode" WHERE expires_at < $now', {"now": sql_time(now)})
        return self.db.execute('DELETE FROM "IdempotencyRecord" WHERE created_at < $h', {"h": horizon}).rowcount


class NotifyStore(StorePart):
    """The notification outbox (docs/operations.md): a row per attention item and ``[[notify]]`` entry,
    queued in the transaction that raises the item (``StoreCore.attention_hooks``), plus the
    daily digests and test messages; claimed before a send, marked after, retried with backoff."""

    def __init__(self, core: StoreCore):
        super().__init__(core)
        self.toml_entries: tuple[NotifyEntry, ...] = ()
        self.channels: tuple[ChannelEntry, ...] = ()
        self._queued = False   # set after a commit that queued a row: Deps.transaction nudges the actor
        core.attention_hooks.append(self.queue_item)

    def configure(self, entries: tuple[NotifyEntry, ...], channels: tuple[ChannelEntry, ...] = ()) -> None:
        """The ``[[notify]]`` entries, and the ``[[channels]]`` whose replies go out as rows too."""
        self.toml_entries, self.channels = entries, channels

    @property
    def entries(self) -> tuple[NotifyEntry, ...]:
        """outpost.toml's entries, then the dashboard's, read in this transaction: a change made from
        the dashboard (on any node) counts from its commit, without a restart."""
        stored = self.db.NotifyTarget.select().order_by(lambda t: t.id)
        return self.toml_entries + tuple(NotifyEntry(None, t.url, t.label, tuple(t.kinds), t.digest, t.id)
                                         for t in stored)

    def senders(self) -> dict[str, NotifyEntry | ChannelEntry]:
        """Every entry and channel by its outbox key (the outbox actor's, at each look)."""
        return {e.key: e for e in (*self.entries, *self.channels)}

    def _keys(self) -> list[str]:
        return [e.key for e in (*self.entries, *self.channels)]

    def add_entry(self, url: str, label: str, kinds: list[str], digest: str | None, now: datetime) -> dict[str, Any]:
        """A notification entry from the dashboard (its fields checked by ``notify_fields``)."""
        if any(e.url == url for e in self.entries):
            raise Conflict("an entry already sends to this URL: give it more kinds instead")
        t = self.db.NotifyTarget(id=new_id("ntf"), url=url, label=label, kinds=kinds, digest=digest,
                                 created_at=naive(now), updated_at=naive(now))
        return self._stored_state(t)

    def _target(self, entry_id: str):
        if entry_id.startswith("toml-") and any(e.id == entry_id for e in self.toml_entries):
            raise Conflict(f"entry {entry_id} is outpost.toml's: change it there and restart")
        t = self.db.NotifyTarget.get(id=entry_id)
        if t is None:
            raise NotFound(f"no notification entry {entry_id}")
        return t

    def update_entry(self, entry_id: str, changes: dict[str, Any], now: datetime) -> dict[str, Any]:
        t = self._target(entry_id)
        if "url" in changes and any(e.url == changes["url"] and e.id != t.id for e in self.entries):
            raise Conflict("an entry already sends to this URL: give it more kinds instead")
        for field, value in changes.items():
            setattr(t, field, value)
        t.updated_at = naive(now)
        return self._stored_state(t)

    def remove_entry(self, entry_id: str) -> None:
        """An entry from the dashboard goes; its messages not yet sent stay unsent."""
        self._target(entry_id).delete()

    def _stored_state(self, t) -> dict[str, Any]:
        return next(e for e in self.entry_states() if e["id"] == t.id)

    def take_queued(self) -> bool:
        """Whether a row was queued since the last look (set only once it was committed)."""
        queued, self._queued = self._queued, False
        return queued

    def _mark_queued(self) -> None:
        self._queued = True

    def _queue(self, entry: NotifyEntry | ChannelEntry, item: str | None, kind: str, title: str, body: str | None,
               link: str | None, now: datetime) -> int:
        row = self.db.Notification(entry=entry.key, item=item, kind=kind, title=title[:500], body=body,
                                   link=link, status=NotificationStatus.QUEUED, next_at=naive(now),
                                   created_at=naive(now))
        self.core.after_commit(self._mark_queued)
        orm.flush()
        return row.id

    def queue_channel_message(self, channel: ChannelEntry, item: str | None, text: str, now: datetime) -> int:
        """A message for a channel (an agent's comment, ``item`` its id: sent once; or a test)."""
        return self._queue(channel, item, "channel" if item else "test", channel.title, text, None, now)

    def queue_item(self, attention_id: str, kind: str, title: str, detail: str | None, run_id: str | None,
                   now: datetime) -> None:
        """In the transaction that raised the item: one row for each entry that wants its kind."""
        for entry in self.entries:
            if kind in entry.kinds:
                self._queue(entry, attention_id, kind, title, detail[:2000] if detail else None,
                            f"/runs/{run_id}" if run_id else "/attention", now)

    def queue_test(self, entry_id: str | None, now: datetime) -> list[dict[str, Any]]:
        """A test message to every entry (or the one of ``entry_id``): what was queued."""
        chosen = [e for e in self.entries if entry_id is None or e.id == entry_id]
        if entry_id is not None and not chosen:
            raise NotFound(f"no notification entry {entry_id}")
        return [{"entry": e.index, "entry_id": e.id, "url": e.label,
                 "id": self._queue(e, None, "test", "Outpost test notification",
                                   "This entry works: Outpost notifications reach you here.", "/settings", now)}
                for e in chosen]

    def queue_digest(self, entry: NotifyEntry, due: datetime, now: datetime) -> bool:
        """The daily digest of ``entry`` due at ``due`` (once per entry and local day)."""
        item = f"digest:{due.astimezone(ZoneInfo(entry.digest.partition(' ')[2] or 'UTC')).date()}"
        if self.db.Notification.get(entry=entry.key, item=item) is not None:
            return False
        self._queue(entry, item, "digest", f"Outpost: the last 24 h to {due:%Y-%m-%d %H:%M} UTC",
                    self.digest_text(due - timedelta(days=1), due), "/runs", now)
        return True

    def digest_text(self, since: datetime, until: datetime) -> str:
        """Runs settled between ``since`` and ``until`` by outcome, their commits and cost, and
        the open attention items."""
        rows = self.db.select('SELECT status, COUNT(*), COALESCE(SUM(commits), 0), COALESCE(SUM(cost_usd), 0) '
                              'FROM "Run" WHERE finished_at >= $since AND finished_at < $until GROUP BY status',
                              {"since": sql_time(since), "until": sql_time(until)})
        runs = sum(r[1] for r in rows)
        outcomes = ", ".join(f"{n} {status.replace('_', ' ')}" for status, n, _, _ in sorted(rows))
        lines = [f"Runs: {runs}{f' ({outcomes})' if runs else ''}",
                 f"Commits: {sum(r[2] for r in rows)}", f"Cost: ${sum(r[3] for r in rows):.2f}"]
        open_items = self.db.Attention.select(lambda a: a.acknowledged_at is None).order_by(
            orm.desc(self.db.Attention.created_at))[:5]
        lines.append(f"Open items: {self.core.open_attention_count()}")
        lines += [f"- {a.kind.replace('_', ' ')}: {a.title}" for a in open_items]
        return "\n".join(lines)

    def claim_next(self, now: datetime) -> dict[str, Any] | None:
        """The next due row of a configured entry, claimed ("sending") by a conditional UPDATE:
        one process sends it. A row left sending by a process that stopped is due again after
        NOTIFY_SENDING_STALE_S."""
        if not self._keys():
            return None
        keys, params = sql_list("k", self._keys())
        params |= {"now": sql_time(now), "stale": sql_time(now - timedelta(seconds=NOTIFY_SENDING_STALE_S))}
        due = self.db.select(f'SELECT id FROM "Notification" WHERE entry IN {keys} '
                             f"AND ((status = '{NotificationStatus.QUEUED}' AND next_at <= $now) "
                             f"OR (status = '{NotificationStatus.SENDING}' AND sending_at <= $stale)) "
                             "ORDER BY next_at, id LIMIT 1", params)
        if not due or not self.core.returning(
                f"UPDATE \"Notification\" SET status = '{NotificationStatus.SENDING}', sending_at = $now, "
                f"attempts = attempts + 1 WHERE id = $id AND (status = '{NotificationStatus.QUEUED}' "
                f"OR (status = '{NotificationStatus.SENDING}' AND sending_at <= $stale)) "
                "RETURNING id", {"id": due[0], "now": params["now"], "stale": params["stale"]}):
            return None
        n = self.db.Notification[due[0]]
        return {"id": n.id, "entry": n.entry, "kind": n.kind, "title": n.title, "body": n.body, "link": n.link,
                "attempts": n.attempts}

    def finish(self, notification_id: int, error: str | None, now: datetime) -> str:
        """After a send: delivered, or queued again with backoff, or given up once a day old."""
        n = self.db.Notification[notification_id]
        if error is None:
            n.status, n.delivered_at = NotificationStatus.DELIVERED, naive(now)
            return n.status
        n.last_error = error[:1000]
        if now - aware(n.created_at) >= timedelta(seconds=NOTIFY_GIVE_UP_S):
            n.status = NotificationStatus.GIVEN_UP
        else:
            n.status = NotificationStatus.QUEUED
            n.next_at = naive(now + timedelta(seconds=notify_backoff_s(n.attempts)))
        return n.status

    def next_due(self) -> datetime | None:
        """When a row of a configured entry is next due (a retry, or a stale send)."""
        if not self._keys():
            return None
        keys, params = sql_list("k", self._keys())
        row = self.db.select(f"SELECT MIN(next_at) FROM \"Notification\" WHERE entry IN {keys} "
                             f"AND status = '{NotificationStatus.QUEUED}'", params)
        sending = self.db.select(f"SELECT MIN(sending_at) FROM \"Notification\" WHERE entry IN {keys} "
                                 f"AND status = '{NotificationStatus.SENDING}'", params)
        times = [sql_instant(row[0])] if row and row[0] else []
        if sending and sending[0]:
            times.append(sql_instant(sending[0]) + timedelta(seconds=NOTIFY_SENDING_STALE_S))
        return min(times, default=None)

    def entry_states(self) -> list[dict[str, Any]]:
        """Each entry as Settings and the API show it: never its URL, only its label."""
        return [{"entry": e.index, "id": e.id, "source": "toml" if e.index is not None else "dashboard",
                 "url": e.label, "kinds": list(e.kinds), "digest": e.digest, **self._entry_state(e.key)}
                for e in self.entries]

    def _entry_state(self, key: str) -> dict[str, Any]:
        delivered, pending, given_up = self.db.select(
            "SELECT MAX(delivered_at), COALESCE(SUM(CASE WHEN status IN "
            f"{sql_tuple((NotificationStatus.QUEUED, NotificationStatus.SENDING))} THEN 1 ELSE 0 END), 0), "
            f"COALESCE(SUM(CASE WHEN status = '{NotificationStatus.GIVEN_UP}' THEN 1 ELSE 0 END), 0) "
            'FROM "Notification" WHERE entry = $key',
            {"key": key})[0]
        error = self.db.select('SELECT last_error FROM "Notification" WHERE entry = $key AND last_error IS NOT NULL '
                               "ORDER BY id DESC LIMIT 1", {"key": key})
        return {"last_delivered_at": rfc3339(sql_instant(delivered)) if delivered else None,
                "last_error": error[0] if error else None, "pending": pending, "given_up": given_up}

    def notifications(self, entry_index: int | None = None) -> list[dict[str, Any]]:
        """The outbox, newest first (tests and the settings page)."""
        keys = {e.key: e.index for e in self.entries}
        rows = self.db.Notification.select().order_by(orm.desc(self.db.Notification.id))[:200]
        return [{"id": n.id, "entry": keys.get(n.entry), "item": n.item, "kind": n.kind, "title": n.title,
                 "status": n.status, "attempts": n.attempts, "last_error": n.last_error,
                 "next_at": rfc3339(aware(n.next_at)), "last_attempt_at": rfc3339(aware(n.sending_at)),
                 "created_at": rfc3339(aware(n.created_at)), "delivered_at": rfc3339(aware(n.delivered_at))}
                for n in rows if entry_index is None or keys.get(n.entry) == entry_index]


###############################################################################
# 11. Store: the Office queue: wakeups, Office resources, the dispatch pipeline.
###############################################################################

class WakeupStore(StorePart):
    """Wakeup intake (Office): the persisted queue: enqueue with idempotency keys and the
    coalescing window, merges into unstarted runs, ending wakeups, task checkouts, and the facts
    a prompt is built from."""

    def wakeup_tallies(self) -> list[tuple[str, str, int]]:
        """Every wakeup as (source, status, count), for GET /metrics."""
        return list(self.db.select('SELECT source, status, COUNT(*) FROM "Wakeup" GROUP BY source, status'))

    def _coalescing_target(self, agent_id: str, source: str, task_id: str | None, reason: str,
                           now: datetime) -> str | None:
        """Where a new request of this agent and scope merges: first a wakeup whose run has not
        started (claimed with its run still queued, or waiting for a scheduled retry: new context
        can still reach it), else the coalescing window (a queued wakeup of the same source from
        the last 5 s; for WINDOW_ACROSS_TASKS of any of the agent's tasks). Three index probes
        (agent, scope, status), never the agent's whole history."""
        scope = "w.task_id = $t" if task_id else "w.task_id IS NULL"
        scope += f" AND {same_part_sql(reason)}"
        window = f"w.task_id IS NOT NULL AND {same_part_sql(reason)}" if task_id and source in WINDOW_ACROSS_TASKS \
            else scope
        rows = self.db.select(
            f'SELECT id FROM (SELECT 0 AS rank, w.id, w.requested_at FROM "Wakeup" w JOIN "Run" r ON r.id = w.run_id '
            f"WHERE w.agent_id = $a AND {scope} AND w.status = '{WakeupStatus.CLAIMED}' "
            f"AND r.status = '{RunStatus.QUEUED}' "
            f'UNION ALL SELECT 0, w.id, w.requested_at FROM "Wakeup" w WHERE w.agent_id = $a AND {scope} '
            f"AND w.status = '{WakeupStatus.QUEUED}' AND w.scheduled_retry_at > $now "
            f'UNION ALL SELECT 1, w.id, w.requested_at FROM "Wakeup" w WHERE w.agent_id = $a AND {window} '
            f"AND w.status = '{WakeupStatus.QUEUED}' AND w.source = $s AND w.requested_at >= $since "
            f"AND w.scheduled_retry_at IS NULL AND w.wake_at IS NULL) x ORDER BY rank, requested_at, id LIMIT 1",
            {"a": agent_id, "t": task_id, "s": source, "now": sql_time(now),
             "since": sql_time(now - timedelta(seconds=COALESCING_WINDOW_S))})
        return rows[0] if rows else None

    def coalesce(self, target, w, now: datetime) -> None:
        """Merge ``w`` into ``target``: its payload, and those of the requests merged into it
        before (they come along), join the context the agent will read. They take the target's
        run only if that run is the one to come (not a retry's failed run)."""
        run_id = target.run_id if target.status == WakeupStatus.CLAIMED else None
        wakeup_id = w.id
        riders = list(self.db.Wakeup.select(lambda q: q.coalesced_into == wakeup_id).order_by(
            lambda q: (q.requested_at, q.id)))
        w.status, w.coalesced_into, w.run_id, w.finished_at = WakeupStatus.COALESCED, target.id, run_id, naive(now)
        for q in [w, *riders]:
            q.coalesced_into, q.run_id = target.id, run_id
            target.context_snapshot = merge_context(target.context_snapshot, q.source, q.reason, q.payload,
                                                    aware(q.requested_at))
        target.coalesced_count += 1 + len(riders)
        w.coalesced_count = 1
        if run_id and (o := self.db.OfficeRun.get(run_id=run_id)) is not None:
            o.context_snapshot = target.context_snapshot
            o.assembled_prompt = self.office_prompt(self.db.Agent[o.agent_id], target, resumed=o.resumed,
                                                    summary=o.summary_injected,
                                                    tools=ACTING_WITH_TOOLS in (o.assembled_prompt or ""))
            self.db.Run[o.run_id].prompt = o.assembled_prompt
        self.core.emit("wakeup.coalesced", {"wakeup_id": w.id, "into": target.id, "agent_id": w.agent_id}, now)

    def release_riders(self, w, now: datetime) -> list[str]:
        """``w`` ends without a run that carried it to a successful end (docs/office.md, "Every merged
        wakeup reaches a run"): every
        request merged into it whose own reason still holds (its agent there, its task still this
        agent's to act on, its routine active) is queued again, keeping its source and payload (the
        oldest on its own, the others merged into it: they came together); the others end with
        their own reason. None stays ``coalesced`` into an ended wakeup. Returns the ids queued
        again."""
        wakeup_id = w.id
        agent = self.db.Agent.get(id=w.agent_id)
        requeued: list[Any] = []
        for q in self.db.Wakeup.select(lambda q: q.coalesced_into == wakeup_id
                                       and q.status == WakeupStatus.COALESCED).order_by(
                lambda q: (q.requested_at, q.id)):
            routine = self.db.Routine.get(id=q.payload.get("routine_id")) if q.source == WakeupSource.ROUTINE else None
            if agent is None:
                self.end_wakeup(q, WakeupStatus.FINISHED, now, note="agent deleted: no session",
                                fire=RoutineRunStatus.SKIPPED)
            elif q.task_id and (reason := stale_reason(self.task_facts(q.task_id, q.workspace_id), q.agent_id,
                                                       q.reason)):
                self.end_wakeup(q, WakeupStatus.CANCELLED, now, cancel_reason=str(reason))
            elif q.source == WakeupSource.ROUTINE and (routine is None or routine.status != RoutineStatus.ACTIVE):
                self.end_wakeup(q, WakeupStatus.FINISHED, now, fire=RoutineRunStatus.SKIPPED,
                                note=f"its routine is {routine.status if routine else 'deleted'}: no session")
            else:
                requeued.append(q)
        if not requeued:
            return []
        # They came together and go on together: the oldest queued, the others merged into it.
        first, snapshot = requeued[0], {}
        for q in requeued:
            q.coalesced_into, q.run_id = (None if q is first else first.id), None
            snapshot = merge_context(snapshot, q.source, q.reason, q.payload, aware(q.requested_at))
        first.status, first.finished_at, first.coalesced_count = WakeupStatus.QUEUED, None, len(requeued)
        first.context_snapshot = snapshot
        w.coalesced_count -= len(requeued)
        self.core.emit("wakeup.queued", {"wakeup_id": first.id, "agent_id": first.agent_id, "source": first.source,
                                         "split_from": wakeup_id}, now)
        return [q.id for q in requeued]

    def enqueue_wakeup(self, workspace_id: str, agent_id: str, source: WakeupSource, payload: dict[str, Any],
                       now: datetime, *, reason: str | None = None, wake_at: datetime | None = None,
                       idempotency_key: str | None = None) -> str:
        """Insert a wakeup request and return its id. A key seen in the last 24 h
        returns the earlier request and inserts nothing; a request for an agent whose run of the
        same scope has not started merges into it; otherwise it is queued. Plain SQL: an
        assignment burst enqueues many."""
        given = payload   # a field the request left out stays out (a mention has no user_id)
        payload = {k: v for k, v in dataclasses.asdict(wakeup_payload(source, payload)).items()
                   if k in given or v is not None}
        key = idempotency_key or wakeup_idempotency_key(source, payload, agent_id)
        if key is not None and (earlier := self.db.select('SELECT id, requested_at FROM "Wakeup" '
                                                          'WHERE idempotency_key = $k', {"k": key})):
            if sql_instant(earlier[0][1]) > now - timedelta(seconds=IDEMPOTENCY_TTL_S):
                return earlier[0][0]
            # outside the 24 h window: the key is free again
            self.db.execute('UPDATE "Wakeup" SET idempotency_key = NULL WHERE id = $w', {"w": earlier[0][0]})
        task_id, reason = payload_task_id(payload), reason or str(source)
        target = None if wake_at else self._coalescing_target(agent_id, str(source), task_id, reason, now)
        wakeup_id = new_id("wk")
        self.db.execute(
            'INSERT INTO "Wakeup" (id, workspace_id, agent_id, source, reason, payload, task_id, status, '
            'coalesced_count, idempotency_key, retry_count, wake_at, context_snapshot, requested_at) VALUES '
            f"($w, $ws, $a, $s, $reason, $payload, $t, '{WakeupStatus.QUEUED}', 1, $k, 0, $wake_at, $context, $now)",
            {"w": wakeup_id, "ws": workspace_id, "a": agent_id, "s": str(source), "reason": reason,
             "payload": json.dumps(payload), "t": task_id, "k": key,
             "wake_at": sql_time(wake_at) if wake_at else None, "now": sql_time(now),
             "context": json.dumps(merge_context({}, str(source), reason, payload, now))})
        if target is not None:
            self.coalesce(self.db.Wakeup[target], self.db.Wakeup[wakeup_id], now)
        else:
            self.core.emit("wakeup.queued", {"wakeup_id": wakeup_id, "agent_id": agent_id, "source": str(source)}, now)
            if source == WakeupSource.TASK_ASSIGNED and (t := self.db.Task.get(id=task_id)) is not None and (
                    waiting := self.open_blockers(t.blocked_by or [])):
                self.db.Wakeup[wakeup_id].note = f"{HELD_NOTE}: " + ", ".join(waiting)
        return wakeup_id

    def release_checkout(self, task_id: str | None, agent_id: str | None) -> None:
        """Drop the checkout lock of a task (held by ``agent_id``, or by anyone when None)."""
        t = self.db.Task.get(id=task_id) if task_id else None
        if t is not None and t.checkout_agent_id is not None and agent_id in (None, t.checkout_agent_id):
            t.checkout_agent_id, t.checkout_at = None, None

    def end_wakeup(self, w, status: WakeupStatus, now: datetime, note: str | None = None,
                   cancel_reason: str | None = None, *, fire: RoutineRunStatus | None = None,
                   carried: bool = False) -> None:
        """``fire``: what the lightweight routine fires it carries became (``skipped`` when it
        ended without a session); by default skipped or failed as the wakeup, else unchanged.
        ``carried``: its run ended well, and the requests merged into it with it; otherwise
        they are released (``release_riders``)."""
        if not carried:
            self.release_riders(w, now)
        w.status, w.note, w.cancel_reason, w.finished_at = status, note, cancel_reason, naive(now)
        self.core.emit("wakeup.ended", {"wakeup_id": w.id, "agent_id": w.agent_id, "status": status,
                                        "cancel_reason": cancel_reason}, now)
        fire = fire or {WakeupStatus.SKIPPED: RoutineRunStatus.SKIPPED, WakeupStatus.FAILED: RoutineRunStatus.FAILED,
                        WakeupStatus.CANCELLED: RoutineRunStatus.FAILED}.get(status)
        if fire and (w.source == WakeupSource.ROUTINE or w.coalesced_count > 1):   # it carries merged requests
            self._end_routine_runs(w, fire, note or cancel_reason, now)

    def _end_routine_runs(self, w, status: RoutineRunStatus, why: str | None, now: datetime) -> None:
        """The lightweight routine runs a wakeup carried (its own, or those merged into it) that
        came to nothing: skipped or failed, with why, with completed_at. One
        whose wakeup ran stays task_created."""
        wakeup_id = w.id
        carried = [wakeup_id, *self.db.select('SELECT id FROM "Wakeup" WHERE coalesced_into = $w', {"w": wakeup_id})]
        for x in self.db.RoutineRun.select(lambda x: x.wakeup_id in carried and x.linked_task_id is None
                                           and x.status in (RoutineRunStatus.RECEIVED, RoutineRunStatus.TASK_CREATED)):
            x.status, x.completed_at = status, naive(now)
            x.error = why if status == RoutineRunStatus.FAILED else None

    def cancel_stale(self, w, reason: CancelReason, now: datetime, code: str = "wakeup_stale_cancelled") -> None:
        """A stale wakeup (docs/office.md, "The wakeup lifecycle"): cancelled (never retried), locks
        released, activity logged."""
        log.getChild("office").info("wakeup %s cancelled: %s (task %s, agent %s)", w.id, reason, w.task_id, w.agent_id)
        self.release_checkout(w.task_id, w.agent_id)
        self.end_wakeup(w, WakeupStatus.CANCELLED, now, cancel_reason=str(reason))
        data = {"reason": str(reason)} if code == "wakeup_stale_cancelled" else {"reason": str(reason),
                                                                                 "old_agent": w.agent_id}
        self.core._activity(code, w.workspace_id, now, agent_id=w.agent_id, task_id=w.task_id, wakeup_id=w.id, **data)

    def open_blockers(self, blocker_ids: list[str]) -> list[str]:
        """The blockers not yet Done or Cancelled (a deleted or archived blocker blocks nothing)."""
        if not blocker_ids:
            return []
        ids, params = sql_list("b", blocker_ids)
        return self.db.select(f'SELECT id FROM "Task" WHERE id IN {ids} AND state NOT IN {TERMINAL_TASK_SQL} '
                              "AND archived_at IS NULL", params)

    def task_facts(self, task_id: str, workspace_id: str) -> dict[str, Any] | None:
        t = self.db.Task.get(id=task_id)
        return task_view(t) if t is not None and t.workspace_id == workspace_id else None

    def office_prompt(self, agent, w, *, resumed: bool, summary: str, task: dict[str, Any] | None = None,
                      tools: bool = False) -> str:
        """The prompt of a wakeup's run, from its context snapshot (rebuilt when a wakeup merges
        into the run before it starts). A resumed session gets comments since its last run;
        ``tools``: its CLI has Outpost's own tools (docs/agent-clis.md)."""
        task = task or (self.task_facts(w.task_id, w.workspace_id) if w.task_id else None)
        since = None   # a resumed session has read the comments up to its previous run's prompt
        if resumed and (session := self.db.AgentSession.get(agent_id=agent.id, task_id=w.task_id)):
            previous = self.db.OfficeRun.get(run_id=session.run_id)
            since = previous.queued_at if previous else session.updated_at
        comments = []
        if task is not None:   # the newest PROMPT_COMMENTS, oldest first, with their authors' names
            rows = self.db.select(
                'SELECT c.author_agent_id, a.name, c.created_at, c.body FROM "Comment" c LEFT JOIN "Agent" a '
                'ON a.id = c.author_agent_id WHERE c.task_id = $t AND c.created_at > $since '
                'ORDER BY c.created_at DESC, c.id DESC LIMIT $n',
                {"t": task["id"], "since": sql_time(aware(since) if since else EPOCH), "n": PROMPT_COMMENTS})
            comments = [{"author": (name or "agent") if author else "user",
                         "created_at": rfc3339(sql_instant(created)), "body": body}
                        for author, name, created, body in rows][::-1]
        blockers = []
        if task is not None and task["blocked_by"]:
            ids = task["blocked_by"]
            blockers = [{"id": b.id, "state": b.state} for b in self.db.Task.select(lambda b: b.id in ids)]
        snapshot = w.context_snapshot
        named = sorted({payload_task_id(x["payload"]) for x in snapshot.get("wakeups", [])} - {w.task_id, None})
        others = [{"id": o.id, "title": o.title, "state": o.state}
                  for o in self.db.Task.select(lambda o: o.id in named and o.workspace_id == w.workspace_id)
                  .order_by(lambda o: o.id)] if named else []
        routine = None
        if w.source == WakeupSource.ROUTINE and (r := self.db.Routine.get(id=w.payload.get("routine_id"))):
            routine = {"name": r.name, "description": render_variables(r.description or "",
                                                                       dict(w.payload.get("variables") or {}))}
        return assemble_prompt(
            agent={"name": agent.name, "role": agent.role, "instructions": agent.instructions},
            wakeups=snapshot.get("wakeups", []), task=task, comments=comments, blockers=blockers,
            summary=summary, resume=resumed, dropped=snapshot.get("dropped", 0), routine=routine, others=others,
            tools=tools)

    def coordinators(self, workspace_id: str, except_id: str):
        return self.db.Agent.select(lambda a: a.workspace_id == workspace_id and a.role == "coordinator"
                                    and a.id != except_id)

    def wakeups_by_agent(self, status: WakeupStatus) -> dict[str, int]:
        """How many wakeups in ``status`` each agent has (claimed ones are its sessions)."""
        return dict(self.db.select('SELECT agent_id, COUNT(*) FROM "Wakeup" WHERE status = $s GROUP BY agent_id',
                                   {"s": status}))


class OfficeStore(StorePart):
    """Office resources: workspaces and their settings, projects, agents, tasks with
    blockers and reviewers, comments and approvals; the wakeups their changes cause."""

    def __init__(self, core: StoreCore, runs: RunStore, wakeups: WakeupStore):
        super().__init__(core)
        self.runs, self.wakeups = runs, wakeups
        #: Called with (task, comment, now) in the transaction of every new comment.
        self.comment_hooks: list[Callable[[Any, Any, datetime], None]] = []

    def workspace_row(self, workspace_id: str | None):
        ws = self.db.Workspace.get(id=workspace_id or DEFAULT_WORKSPACE)
        if ws is None:
            raise NotFound(f"no workspace {workspace_id}")
        return ws

    def in_workspace(self, entity_name: str, entity_id: str, workspace_id: str, field: str):
        """An entity of the workspace, else a 422 naming the field: nothing crosses workspaces."""
        row = getattr(self.db, entity_name).get(id=entity_id)
        if row is None or row.workspace_id != workspace_id:
            raise invalid(field, f"no {entity_name.lower()} {entity_id} in this workspace")
        return row

    def list_workspaces(self) -> list[dict[str, Any]]:
        """The default workspace first, then oldest first (ties by id): a total order."""
        return [workspace_view(ws) for ws in sorted(self.db.Workspace.select(),
                                                    key=lambda ws: (ws.id != DEFAULT_WORKSPACE, ws.created_at, ws.id))]

    def create_workspace(self, name: str, now: datetime) -> dict[str, Any]:
        if self.db.Workspace.get(name=name):
            raise Conflict(f"a workspace named {name!r} exists", errors=[{"field": "name", "message": "already used"}])
        return workspace_view(self.db.Workspace(id=new_id("ws"), name=name, created_at=naive(now)))

    def office_settings(self, workspace_id: str | None) -> dict[str, Any]:
        ws = self.workspace_row(workspace_id)
        return {**workspace_view(ws), "repository_in_use": self.repository_of(ws)}

    def repository_waiting(self, workspace_id: str | None) -> str | None:
        """Why the workspace's wakeups wait for their repository (a queued wakeup's last_error),
        or None: nothing waits, so Office runs (the banner of the Office pages)."""
        rows = self.db.select('SELECT last_error FROM "Wakeup" WHERE workspace_id = $ws '
                              f"AND status = '{WakeupStatus.QUEUED}' "
                              "AND last_error LIKE $waiting ORDER BY requested_at, id LIMIT 1",
                              {"ws": self.workspace_row(workspace_id).id, "waiting": REPOSITORY_UNAVAILABLE + "%"})
        return rows[0] if rows else None

    def repository_of(self, ws) -> str | None:
        """The workspace's repository; the embedded one for the default workspace while it names none."""
        return ws.repository or (self.core.embedded_repository if ws.id == DEFAULT_WORKSPACE else None)

    def update_office_settings(self, workspace_id: str | None, settings: dict[str, Any]) -> dict[str, Any]:
        ws = self.workspace_row(workspace_id)
        clash = self.db.Workspace.get(name=settings["name"])
        if clash and clash.id != ws.id:
            raise Conflict(f"a workspace named {settings['name']!r} exists",
                           errors=[{"field": "name", "message": "already used"}])
        ws.set(**settings)
        workspace_id = ws.id   # wakeups waiting for a repository look again at once
        self.db.execute('UPDATE "Wakeup" SET scheduled_retry_at = NULL WHERE workspace_id = $ws '
                        f"AND status = '{WakeupStatus.QUEUED}' AND last_error LIKE $waiting",
                        {"ws": workspace_id, "waiting": REPOSITORY_UNAVAILABLE + "%"})
        return workspace_view(ws)

    def create_project(self, workspace_id: str | None, name: str, repository: str | None, executor: str | None,
                       now: datetime, budget: dict[str, Any] | None = None) -> dict[str, Any]:
        ws = self.workspace_row(workspace_id)
        p = self.db.Project(id=new_id("prj"), workspace_id=ws.id, name=name, repository=repository,
                            executor=executor, created_at=naive(now), **(budget or {}))
        return project_view(p)

    def list_projects(self, workspace_id: str | None) -> list[dict[str, Any]]:
        ws = self.workspace_row(workspace_id)
        return [project_view(p) for p in self.db.Project.select(lambda p: p.workspace_id == ws.id).order_by(
            lambda p: (p.created_at, p.id))]

    def agent_row(self, agent_id: str):
        a = self.db.Agent.get(id=agent_id)
        if a is None:
            raise NotFound(f"no agent {agent_id}")
        return a

    def agent_ref(self, workspace_id: str, ref: Any, field: str) -> str:
        """The id of the workspace's agent that ``ref`` names, by id or by name (any case): what an
        agent's tools take. A 422 naming the field and the agents there are, otherwise."""
        agents = list(self.db.Agent.select(lambda a: a.workspace_id == workspace_id).order_by(lambda a: a.name))
        if isinstance(ref, str):
            wanted = ref.strip().lstrip("@").casefold()
            found = [a for a in agents if a.id == ref or a.name.casefold() == wanted]
            if len(found) == 1:
                return found[0].id
        names = ", ".join(a.name for a in agents[:20]) or "none"
        raise invalid(field, f"names no agent of this workspace (its agents: {names})")

    def _check_agent_name(self, workspace_id: str, name: str, except_id: str | None = None) -> None:
        clash = self.db.Agent.get(lambda a: a.workspace_id == workspace_id and a.name == name and a.id != except_id)
        if clash:
            raise Conflict(f"an agent named {name!r} already exists ({clash.id})",
                           errors=[{"field": "name", "message": "already used by another agent"}])

    def create_agent(self, workspace_id: str | None, fields: dict[str, Any], now: datetime) -> dict[str, Any]:
        ws = self.workspace_row(workspace_id)
        self._check_agent_name(ws.id, fields["name"])
        a = self.db.Agent(id=new_id("agt"), workspace_id=ws.id, created_at=naive(now), updated_at=naive(now),
                          **fields)
        self.core.emit("agent.created", {"agent_id": a.id, "role": a.role}, now)
        return agent_view(a)

    def agent_fields(self, agent_id: str) -> dict[str, Any]:
        view = agent_view(self.agent_row(agent_id))
        return {k: view[k] for k in AGENT_FIELDS if k != "workspace_id"}

    def update_agent(self, agent_id: str, fields: dict[str, Any], now: datetime) -> dict[str, Any]:
        a = self.agent_row(agent_id)
        self._check_agent_name(a.workspace_id, fields["name"], a.id)
        if fields["status"] == AgentStatus.WORKING or (fields["status"] == AgentStatus.IDLE
                                                       and a.status == AgentStatus.WORKING):
            fields = {**fields, "status": a.status}   # working and idle follow the agent's sessions
        elif fields["status"] == AgentStatus.IDLE and self.active_sessions(a.id):
            fields = {**fields, "status": AgentStatus.WORKING}
        a.set(updated_at=naive(now), **fields)
        self.core.emit("agent.updated", {"agent_id": a.id, "status": a.status}, now)
        return agent_view(a)

    def get_agent(self, agent_id: str) -> dict[str, Any]:
        return agent_view(self.agent_row(agent_id))

    def list_agents(self, workspace_id: str | None) -> list[dict[str, Any]]:
        ws = self.workspace_row(workspace_id)
        return [agent_view(a) for a in
                self.db.Agent.select(lambda a: a.workspace_id == ws.id).order_by(lambda a: (a.created_at, a.id))]

    def active_sessions(self, agent_id: str) -> int:
        """Sessions of an agent: its claimed wakeups (each holds one queued, running or paused run)."""
        return self.db.select('SELECT COUNT(*) FROM "Wakeup" WHERE agent_id = $a '
                              f"AND status = '{WakeupStatus.CLAIMED}'", {"a": agent_id})[0]

    def _task(self, task_id: str, workspace_id: str | None = None):
        t = self.db.Task.get(id=task_id)
        if t is None or (workspace_id is not None and t.workspace_id != workspace_id):
            raise NotFound(f"no task {task_id}")
        return t

    def _check_task_refs(self, workspace_id: str, fields: dict[str, Any], task_id: str | None) -> None:
        if fields.get("assignee_agent_id"):
            self.in_workspace("Agent", fields["assignee_agent_id"], workspace_id, "assignee_agent_id")
        if fields.get("parent_id"):
            if fields["parent_id"] == task_id:
                raise invalid("parent_id", "a task cannot be its own parent")
            self.in_workspace("Task", fields["parent_id"], workspace_id, "parent_id")
        if fields.get("project_id"):
            self.in_workspace("Project", fields["project_id"], workspace_id, "project_id")
        for reviewer in fields.get("reviewers", []):
            self.in_workspace("Agent", reviewer, workspace_id, "reviewers")
        seen, todo = set(), list(fields.get("blocked_by", []))
        while todo:   # no task may (transitively) wait on itself
            blocker_id = todo.pop()
            if blocker_id == task_id:
                raise invalid("blocked_by", "would make the task wait on itself")
            if blocker_id not in seen:
                seen.add(blocker_id)
                todo += self.in_workspace("Task", blocker_id, workspace_id, "blocked_by").blocked_by or []

    def create_task(self, workspace_id: str | None, fields: dict[str, Any], now: datetime,
                    by_agent: str | None = None) -> dict[str, Any]:
        ws = self.workspace_row(workspace_id)
        self._check_task_refs(ws.id, fields, None)
        fields = {k: v for k, v in fields.items() if k != "archived"}
        t = self.db.Task(id=new_id("tsk"), workspace_id=ws.id, created_at=naive(now), updated_at=naive(now), **fields)
        self.core.emit("task.created", {"task_id": t.id, "by_agent": by_agent}, now)
        if t.assignee_agent_id:
            self._wake_assignee(t, WakeupSource.TASK_ASSIGNED, {"task_id": t.id}, now)
        return task_view(t)

    def task_fields(self, task_id: str) -> dict[str, Any]:
        view = task_view(self._task(task_id))
        return {k: view[k] for k in TASK_FIELDS if k in view and k not in ("workspace_id", "state")}

    def update_task(self, task_id: str, fields: dict[str, Any], now: datetime) -> dict[str, Any]:
        """An edit. A new assignee is woken (task_assigned); the previous one's scheduled
        retries for this task are cancelled now (retry_stale_assignee) and its run on the task
        is cancelled: the lock holds until that run has ended (its edits saved on its branch),
        so the new assignee starts after it, from where it left the task."""
        t = self._task(task_id)
        self._check_task_refs(t.workspace_id, fields, t.id)
        previous = t.assignee_agent_id
        was_open = self.wakeups.open_blockers(t.blocked_by or [])
        blocking = t.state not in TERMINAL_TASK_STATES and t.archived_at is None
        archived = fields.pop("archived", None)
        if archived is not None:
            t.archived_at = (t.archived_at or naive(now)) if archived else None
        t.set(updated_at=naive(now), **{k: v for k, v in fields.items() if k not in ("state", "parent_id", "workflow")})
        self.core.emit("task.updated", {"task_id": t.id}, now)
        stopping: list[str] = []
        if previous != t.assignee_agent_id:
            if previous:
                task_id = t.id
                for w in self.db.Wakeup.select(lambda w: w.agent_id == previous and w.task_id == task_id
                                               and w.status == WakeupStatus.QUEUED and w.retry_count > 0):
                    self.wakeups.cancel_stale(w, CancelReason.RETRY_STALE_ASSIGNEE, now, code="wakeup_retry_cancelled")
                stopping = self.db.select(
                    'SELECT w.run_id FROM "Wakeup" w JOIN "Run" r ON r.id = w.run_id WHERE w.agent_id = $a '
                    f"AND w.task_id = $t AND w.status = '{WakeupStatus.CLAIMED}' AND w.reason NOT IN {PARTICIPANT_SQL} "
                    f"AND r.status IN {ACTIVE_RUN_SQL} ORDER BY w.run_id", {"a": previous, "t": t.id})
                if not stopping:
                    self.wakeups.release_checkout(t.id, previous)
            if t.assignee_agent_id:   # a new assignment is a new event, even back to an earlier assignee
                self._wake_assignee(t, WakeupSource.TASK_ASSIGNED, {"task_id": t.id}, now,
                                    idempotency_key=f"task_assigned:{t.id}:{t.assignee_agent_id}:{now.timestamp():.3f}")
        if was_open and not self.wakeups.open_blockers(t.blocked_by or []):   # its last open blocker left its list
            resolved = ",".join(sorted(was_open))
            self._wake_assignee(t, WakeupSource.TASK_BLOCKERS_RESOLVED,
                                {"task_id": t.id, "resolved_blocker_ids": sorted(was_open)}, now,
                                idempotency_key=f"task_blockers_resolved:{t.id}:{resolved}:{now.timestamp():.3f}")
        if blocking and t.archived_at is not None:   # archived, it blocks nothing any more
            self._wake_unblocked(t, now)
        for run_id in stopping:   # last: a run that has not started settles at once, in plain SQL
            self.runs.control_run(run_id, "cancel", now)
        return task_view(self._task(task_id) if stopping else t)

    def running_tasks(self, workspace_id: str | None) -> dict[str, list[str]]:
        """The agents whose run is running on each task of the workspace (the board's badge)."""
        running: dict[str, list[str]] = {}
        for task_id, agent_id in self.db.select(
                'SELECT o.task_id, o.agent_id FROM "OfficeRun" o JOIN "Run" r ON r.id = o.run_id '
                f"WHERE o.workspace_id = $ws AND o.task_id IS NOT NULL AND r.status = '{RunStatus.RUNNING}' "
                "ORDER BY o.queued_at, o.run_id", {"ws": self.workspace_row(workspace_id).id}):
            running.setdefault(task_id, []).append(agent_id)
        return running

    def task_runs_active(self, task_id: str) -> list[dict[str, Any]]:
        """The runs on a task still going (queued, running, paused), oldest first: the task page's
        live status."""
        rows = self.db.select(
            'SELECT r.id, o.agent_id, r.status, r.queued_at, r.started_at FROM "OfficeRun" o JOIN "Run" r '
            f"ON r.id = o.run_id WHERE o.task_id = $t AND r.status IN {ACTIVE_RUN_SQL} ORDER BY r.id", {"t": task_id})
        return [{"id": run_id, "agent_id": agent_id, "status": status, "queued_at": rfc3339(sql_instant(queued)),
                 "started_at": rfc3339(sql_instant(started)) if started else None}
                for run_id, agent_id, status, queued, started in rows]

    def task_titles(self, task_ids: Iterable[str]) -> dict[str, str]:
        """The titles of these tasks (those that exist), for the tables that name a task."""
        ids, titles = sorted(set(task_ids)), {}
        for k in range(0, len(ids), 500):
            chunk = ids[k:k + 500]
            titles.update((t.id, t.title) for t in self.db.Task.select(lambda t: t.id in chunk))  # noqa: B023
        return titles

    def get_task(self, task_id: str, workspace_id: str | None = None) -> dict[str, Any]:
        """A task with its comments, approvals, subtasks and blockers (``workspace_id``: only there)."""
        t = self._task(task_id, workspace_id)
        view = task_view(t)
        blockers = list(t.blocked_by or [])
        view["blockers"] = [{"id": b.id, "title": b.title, "state": b.state}
                            for b in self.db.Task.select(lambda b: b.id in blockers).order_by(lambda b: b.id)
                            ] if blockers else []
        task_id = t.id   # each list oldest first, ties by id
        view["comments"] = [comment_view(c) for c in self.db.Comment.select(lambda c: c.task_id == task_id)
                            .order_by(lambda c: (c.created_at, c.id))]
        view["approvals"] = [approval_view(a) for a in self.db.Approval.select(lambda a: a.task_id == task_id)
                             .order_by(lambda a: (a.created_at, a.id))]
        view["subtasks"] = [task_view(c) for c in self.db.Task.select(lambda c: c.parent_id == task_id)
                            .order_by(lambda c: (c.created_at, c.id))]
        return view

    def list_tasks(self, workspace_id: str | None, assignee: str | None = None, state: str | None = None,
                   include_archived: bool = False) -> list[dict[str, Any]]:
        ws = self.workspace_row(workspace_id)
        query = self.db.Task.select(lambda t: t.workspace_id == ws.id)
        if assignee:
            query = query.filter(lambda t: t.assignee_agent_id == assignee)
        if state:
            query = query.filter(lambda t: t.state == state)
        if not include_archived:
            query = query.filter(lambda t: t.archived_at is None)
        return [task_view(t) for t in query.order_by(lambda t: (t.created_at, t.id))]

    def _wake_assignee(self, t, source: WakeupSource, payload: dict[str, Any], now: datetime,
                       reason: str | None = None, idempotency_key: str | None = None) -> None:
        """Office event subscribers: only an Office task with an assignee wakes anyone."""
        if (t.assignee_agent_id and t.archived_at is None and t.state not in TERMINAL_TASK_STATES
                and is_office_task(t.workflow, t.project_id)):
            self.wakeups.enqueue_wakeup(t.workspace_id, t.assignee_agent_id, source, payload, now, reason=reason,
                                        idempotency_key=idempotency_key)

    def move_task(self, task_id: str, state: str, now: datetime, by_agent: str | None = None,
                  workspace_id: str | None = None) -> dict[str, Any]:
        """The board's drag and drop (and an agent's move), with its rules (docs/office.md): a
        requires_approval task an agent moves to Done waits In Review for its approval."""
        if not isinstance(state, str) or state not in set(TaskState):
            raise invalid("state", "must be " + ", ".join(TaskState))
        t = self._task(task_id, workspace_id)
        if by_agent is not None and t.assignee_agent_id != by_agent:
            raise Forbidden(f"task {t.id} is not assigned to this agent")
        previous = t.state
        if state == TaskState.DONE and by_agent is not None and t.requires_approval:
            state = TaskState.IN_REVIEW   # the approval gate: the user decides when it is done
            self._request_approval(t, by_agent, "The agent finished this task; approve to mark it done.", now)
        if state == previous:
            return task_view(t)
        t.state, t.updated_at = str(state), naive(now)
        self.core.emit("task.moved", {"task_id": t.id, "from": previous, "to": str(state)}, now)
        if not is_office_task(t.workflow, t.project_id):
            return task_view(t)
        if state == TaskState.IN_PROGRESS and previous == TaskState.IN_REVIEW:
            c = self._comment(t, "Moved back from In Review to In Progress: changes are needed.", now, None)
            self._wake_assignee(t, WakeupSource.COMMENT, {"task_id": t.id, "comment_id": c.id}, now,
                                reason="review_rejected")
        elif state == TaskState.IN_PROGRESS and by_agent != t.assignee_agent_id:
            # A move is its own event: not deduplicated against the assignment's key.
            self._wake_assignee(t, WakeupSource.TASK_ASSIGNED, {"task_id": t.id}, now, reason="moved_in_progress",
                                idempotency_key=f"task_moved:{t.id}:{t.assignee_agent_id}:{now.timestamp():.3f}")
        elif state == TaskState.IN_REVIEW:
            for reviewer in t.reviewers or []:
                if self.db.Agent.get(id=reviewer, workspace_id=t.workspace_id):
                    self.wakeups.enqueue_wakeup(t.workspace_id, reviewer, WakeupSource.TASK_ASSIGNED, {"task_id": t.id},
                                                now, reason=REVIEW_REASON,   # each review round wakes the reviewer
                                                idempotency_key=f"review:{t.id}:{reviewer}:{now.timestamp():.3f}")
        elif state in TERMINAL_TASK_STATES:
            self.wakeups.release_checkout(t.id, None)
            self._resolve_dependents(t, now)
        return task_view(t)

    def _wake_unblocked(self, t, now: datetime) -> None:
        """``t`` stopped blocking (Done, Cancelled or archived): wake the tasks it was the last
        open blocker of (task_blockers_resolved); their held assignments are claimable again."""
        blocked = self.db.select('SELECT id FROM "Task" t WHERE workspace_id = $ws AND EXISTS '
                                 f'(SELECT 1 FROM {self.dialect.json_elements("t.blocked_by")} j WHERE j.value = $tid)',
                                 {"ws": t.workspace_id, "tid": t.id})
        for dependent in (self.db.Task[i] for i in blocked):
            blockers = dependent.blocked_by or []
            if not self.wakeups.open_blockers(blockers):
                self._wake_assignee(dependent, WakeupSource.TASK_BLOCKERS_RESOLVED,
                                    {"task_id": dependent.id, "resolved_blocker_ids": sorted(blockers)}, now)

    def _resolve_dependents(self, t, now: datetime) -> None:
        """A task reached Done or Cancelled: wake the tasks it was the last blocker of
        (task_blockers_resolved) and the parent whose children are all finished
        (task_children_completed)."""
        self._wake_unblocked(t, now)
        if t.parent_id and (parent := self.db.Task.get(id=t.parent_id)) is not None:
            open_children = self.db.select('SELECT COUNT(*) FROM "Task" WHERE parent_id = $p AND state NOT IN '
                                           f"{TERMINAL_TASK_SQL}", {"p": parent.id})[0]
            if open_children == 0:
                self._wake_assignee(parent, WakeupSource.TASK_CHILDREN_COMPLETED, {"task_id": parent.id}, now)

    def _comment(self, t, body: str, now: datetime, author_agent_id: str | None, author: str | None = None):
        c = self.db.Comment(id=new_id("cmt"), task_id=t.id, author_agent_id=author_agent_id, body=body,
                            author=author, created_at=naive(now))
        self.core.emit("comment.created", {"comment_id": c.id, "task_id": t.id, "author_agent_id": author_agent_id},
                       now)
        return c

    def add_comment(self, task_id: str, body: str, now: datetime, author_agent_id: str | None = None,
                    workspace_id: str | None = None, *, author: str | None = None) -> dict[str, Any]:
        """A comment wakes the task's assignee unless the assignee wrote it, and each agent it
        mentions (``@Name``, ``@"Release Bot"``) but its author and the assignee (docs/office.md, "Mentions").
        ``author``: a person's name on a channel. The ``comment_hooks`` see it last (a channel
        task's agent's comment is posted back)."""
        t = self._task(task_id, workspace_id)
        c = self._comment(t, body, now, author_agent_id, author)
        if t.assignee_agent_id != author_agent_id:
            self._wake_assignee(t, WakeupSource.COMMENT, {"task_id": t.id, "comment_id": c.id}, now)
        c.mentions = self._wake_mentioned(t, c, now)
        for hook in self.comment_hooks:
            hook(t, c, now)
        return comment_view(c)

    def _wake_mentioned(self, t, c, now: datetime) -> list[dict[str, Any]]:
        """The agents a comment names, each woken on its task (source user, reason mentioned);
        an unknown name wakes nobody and is listed with no agent id."""
        if "@" not in c.body:
            return []
        ws = t.workspace_id
        agents = {a.name.casefold(): a for a in self.db.Agent.select(lambda a: a.workspace_id == ws)}
        mentions: list[dict[str, Any]] = []
        open_task = t.state not in TERMINAL_TASK_STATES and t.archived_at is None
        relayed = c.author_agent_id is not None and self._woken_by_an_agents_mention(c.author_agent_id, t.id)
        for name in mentioned_names(c.body):
            a = agents.get(name.casefold())
            if sum((m["agent_id"] is None) is (a is None) for m in mentions) >= MAX_MENTIONS:
                continue
            mentions.append({"name": a.name if a else name, "agent_id": a.id if a else None})
            if a is not None and a.id not in (c.author_agent_id, t.assignee_agent_id) and open_task and not relayed:
                self.wakeups.enqueue_wakeup(ws, a.id, WakeupSource.USER, {
                    "task_id": t.id, "comment_id": c.id, "mentioned_by": c.author_agent_id or "user"}, now,
                    reason=MENTION_REASON)
        if relayed and any(m["agent_id"] for m in mentions):
            self.core._activity("mention_not_relayed", ws, now, agent_id=c.author_agent_id, task_id=t.id,
                                comment_id=c.id)
        return mentions

    def _woken_by_an_agents_mention(self, agent_id: str, task_id: str) -> bool:
        """The agent writes from a run that another agent's mention woke: its own mentions wake
        nobody, so two agents can never wake each other on and on (a person's mention can be
        passed on once)."""
        latest = self.db.Wakeup.select(lambda w: w.agent_id == agent_id and w.task_id == task_id
                                       and w.claimed_at is not None).order_by(
            lambda w: (orm.desc(w.claimed_at), orm.desc(w.id))).first()   # the run it writes from
        return (latest is not None and latest.reason == MENTION_REASON
                and latest.payload.get("mentioned_by") not in (None, "user"))

    def _request_approval(self, t, agent_id: str | None, note: str, now: datetime):
        a = self.db.Approval(id=new_id("apr"), workspace_id=t.workspace_id, task_id=t.id,
                             requested_by_agent_id=agent_id, note=note, status=ApprovalStatus.PENDING,
                             created_at=naive(now))
        self.core.raise_attention("approval", f"Approval asked: {t.title}", note or None, now, schedule_id=None,
                                  run_id=None)
        self.core.emit("approval.requested", {"approval_id": a.id, "task_id": t.id}, now)
        return a

    def request_approval(self, task_id: str, agent_id: str, note: str, now: datetime,
                         workspace_id: str, reviewers: list[str] | None = None) -> dict[str, Any]:
        """An agent asks a human to approve its task; ``reviewers`` (agent ids) become the task's,
        woken when it moves to In Review."""
        t = self._task(task_id, workspace_id)
        if t.assignee_agent_id != agent_id:
            raise Forbidden(f"task {t.id} is not assigned to this agent")
        if reviewers:
            t.reviewers, t.updated_at = list(dict.fromkeys(reviewers)), naive(now)
        return approval_view(self._request_approval(t, agent_id, note, now))

    def list_approvals(self, workspace_id: str | None, status: str | None = None) -> list[dict[str, Any]]:
        ws = self.workspace_row(workspace_id)
        query = self.db.Approval.select(lambda a: a.workspace_id == ws.id)
        if status:
            query = query.filter(lambda a: a.status == status)
        return [approval_view(a) for a in query.order_by(lambda a: (orm.desc(a.created_at), orm.desc(a.id)))]

    def resolve_approval(self, approval_id: str, status: str, decision_note: str, now: datetime) -> dict[str, Any]:
        """The user decides: approved moves an In Review task to Done (its dependents wake);
        rejected sends it back to In Progress. The requesting agent gets approval_resolved."""
        if status not in (ApprovalStatus.APPROVED, ApprovalStatus.REJECTED):
            raise invalid("status", "must be approved or rejected")
        a = self.db.Approval.get(id=approval_id)
        if a is None:
            raise NotFound(f"no approval {approval_id}")
        if a.status != ApprovalStatus.PENDING:
            raise Conflict(f"approval {a.id} was already {a.status}")
        a.status, a.decision_note, a.resolved_at = status, decision_note, naive(now)
        self.core.emit("approval.resolved", {"approval_id": a.id, "status": status}, now)
        t = self.db.Task.get(id=a.task_id)
        if t is not None and t.state == TaskState.IN_REVIEW:
            if status == ApprovalStatus.APPROVED:
                self.move_task(t.id, TaskState.DONE, now)
            else:
                t.state, t.updated_at = str(TaskState.IN_PROGRESS), naive(now)
                self.core.emit("task.moved", {"task_id": t.id, "from": TaskState.IN_REVIEW,
                                              "to": TaskState.IN_PROGRESS}, now)
        if a.requested_by_agent_id and self.db.Agent.get(id=a.requested_by_agent_id):
            self.wakeups.enqueue_wakeup(a.workspace_id, a.requested_by_agent_id, WakeupSource.APPROVAL_RESOLVED,
                                        {"approval_id": a.id, "status": status, "decision_note": decision_note}, now)
        return approval_view(a)

    def wake_agent(self, agent_id: str, source: WakeupSource, payload: dict[str, Any], now: datetime, *,
                   reason: str | None = None, wake_at: datetime | None = None,
                   workspace_id: str | None = None) -> dict[str, Any]:
        """A user wake from the UI, or an agent's self-wake (possibly for later)."""
        a = self.agent_row(agent_id)
        if workspace_id is not None and a.workspace_id != workspace_id:
            raise NotFound(f"no agent {agent_id}")
        if source == WakeupSource.SELF:
            self_wakes = self.db.select(
                f'SELECT COUNT(*) FROM "Wakeup" WHERE agent_id = $a AND source = \'{WakeupSource.SELF}\' '
                'AND requested_at > $since', {"a": a.id, "since": sql_time(now - timedelta(days=1))})[0]
            if self_wakes >= SELF_WAKES_PER_DAY:
                raise SelfWakeLimit(f"agent {a.name} woke itself {self_wakes} times in the last 24 hours, the most "
                                    "an agent may; a person's wake, a comment or a routine still wakes it")
        return wakeup_view(self.db.Wakeup[self.wakeups.enqueue_wakeup(a.workspace_id, a.id, source, payload, now,
                                                                      reason=reason, wake_at=wake_at)])

    def list_wakeups(self, workspace_id: str | None, agent_id: str | None = None, status: str | None = None,
                     source: str | None = None, limit: int = 100, task_id: str | None = None) -> list[dict[str, Any]]:
        ws = self.workspace_row(workspace_id)
        query = self.db.Wakeup.select(lambda w: w.workspace_id == ws.id)
        if agent_id:
            query = query.filter(lambda w: w.agent_id == agent_id)
        if task_id:
            query = query.filter(lambda w: w.task_id == task_id)
        if status:
            query = query.filter(lambda w: w.status == status)
        if source:
            query = query.filter(lambda w: w.source == source)
        return [wakeup_view(w) for w in query.order_by(lambda w: (orm.desc(w.requested_at), orm.desc(w.id)))[:limit]]

    def office_run(self, run_id: str) -> dict[str, Any]:
        """RunDetail: the run, and what the agent was given and gave back."""
        o = self.db.OfficeRun.get(run_id=run_id)
        if o is None:
            raise NotFound(f"no Office run {run_id}")
        r = self.db.Run[run_id]
        return {**run_view(r), "agent_id": o.agent_id, "workspace_id": o.workspace_id,
                "wakeup_id": o.wakeup_id, "task_id": o.task_id, "assembled_prompt": o.assembled_prompt,
                "summary_injected": o.summary_injected, "result_json": r.result or {},
                "context_snapshot": o.context_snapshot, "session_id": o.session_id, "resumed": o.resumed,
                "coalesced_wakeups": [w.id for w in self.db.Wakeup.select(lambda w: w.coalesced_into == o.wakeup_id)]}

    def agent_runs(self, agent_id: str, limit: int = 50) -> list[dict[str, Any]]:
        self.agent_row(agent_id)
        rows = orm.select((r, o) for r in self.db.Run for o in self.db.OfficeRun
                          if r.id == o.run_id and o.agent_id == agent_id).order_by(lambda r, o: orm.desc(r.id))[:limit]
        return [{**run_view(r), "task_id": o.task_id, "wakeup_id": o.wakeup_id} for r, o in rows]

    def list_activity(self, workspace_id: str | None, code: str | None = None,
                      limit: int = 100, *, empty_sweeps: bool = True) -> list[dict[str, Any]]:
        """Newest first. Without ``empty_sweeps``, the recovery sweeps that dispatched nothing
        (one every 5 minutes) are left out, in the query, so they cannot bury the rest."""
        ws = self.workspace_row(workspace_id)
        query = self.db.Activity.select(lambda x: x.workspace_id == ws.id)
        if code:
            query = query.filter(lambda x: x.code == code)
        if not empty_sweeps:
            query = query.filter(lambda x: x.code != "recovery_sweep_complete" or x.data["dispatched_count"] != 0)
        return [activity_view(x) for x in query.order_by(lambda x: orm.desc(x.id))[:limit]]

    def summary_of(self, agent_id: str) -> list[dict[str, Any]]:
        return [{"scope": s.scope, "content": s.content, "content_tokens": s.content_tokens,
                 "updated_at": rfc3339(aware(s.updated_at)), "updated_by_run_id": s.updated_by_run_id}
                for s in self.db.ContinuationSummary.select(lambda s: s.agent_id == agent_id)]

    def run_agent_context(self, run_id: str) -> dict[str, Any] | None:
        """Who a run token speaks for: a run that is running right now; an Office run also
        speaks for its agent (``agent_id`` is None for a schedule or dispatch run)."""
        r = self.db.Run.get(id=run_id)
        if r is None or r.status != RunStatus.RUNNING:
            return None
        o = self.db.OfficeRun.get(run_id=run_id)
        return {"run_id": run_id, "agent_id": o.agent_id if o else None,
                "workspace_id": o.workspace_id if o else None, "task_id": o.task_id if o else None}

    def next_admission_at(self, now: datetime) -> datetime | None:
        """When the claim actor next has something to do without being nudged: a wakeup to
        claim, or a profile's limit ending while its runs wait."""
        times = [t for t in (self.next_wakeup_at(now), self.runs.next_limit_end(now)) if t is not None]
        return min(times, default=None)

    def next_wakeup_at(self, now: datetime) -> datetime | None:
        """When the dispatcher next has something to claim without being nudged: a retry or
        self-wake coming due, a coalescing window closing, or a busy agent's cooldown ending."""
        due, window = sql_time(now), timedelta(seconds=COALESCING_WINDOW_S)
        times = [sql_instant(t) for t in self.db.select(
            f'SELECT MIN(scheduled_retry_at) FROM "Wakeup" WHERE status = \'{WakeupStatus.QUEUED}\' '
            'AND scheduled_retry_at > $due '
            f'UNION ALL SELECT MIN(wake_at) FROM "Wakeup" WHERE status = \'{WakeupStatus.QUEUED}\' AND wake_at > $due',
            {"due": due}) if t]
        times += [sql_instant(t) + window for t in self.db.select(
            f'SELECT MIN(requested_at) FROM "Wakeup" WHERE status = \'{WakeupStatus.QUEUED}\' '
            f'AND source IN {WINDOW_HELD_SQL} AND requested_at > $since', {"since": sql_time(now - window)}) if t]
        for last, cooldown in self.db.select(
                'SELECT a.last_wakeup_finished_at, a.cooldown_sec FROM "Agent" a WHERE a.last_wakeup_finished_at '
                'IS NOT NULL AND EXISTS (SELECT 1 FROM "Wakeup" w WHERE w.agent_id = a.id '
                f'AND w.status = \'{WakeupStatus.QUEUED}\')'):
            ends = sql_instant(last) + timedelta(seconds=cooldown)
            if ends > now:
                times.append(ends)
        return min(times, default=None)


class PipelineStore(StorePart):
    """The dispatch pipeline (docs/office.md, "The wakeup lifecycle"): claimable wakeups through its checks
    (staleness, capacity, cooldown, checkout, budget, idle skip) into runs; retries, escalation, and
    the settlement of a run's wakeup (registered with the runs' ``settled_hooks``) with its
    continuation summary."""

    def __init__(self, core: StoreCore, runs: RunStore, wakeups: WakeupStore, office: OfficeStore):
        super().__init__(core)
        self.runs, self.wakeups, self.office = runs, wakeups, office
        runs.settled_hooks.append(self.settle_wakeup_run)

    def _checkout(self, task_id: str, agent_id: str, now: datetime) -> bool:
        """The atomic checkout (CAS): one agent at a time works a task. Pony writes it as
        UPDATE ... WHERE checkout_agent_id IS NULL (its optimistic check), inside the
        transaction's write lock."""
        t = self.db.Task[task_id]
        if t.checkout_agent_id is not None:
            return False
        t.checkout_agent_id, t.checkout_at = agent_id, naive(now)
        return True

    def _spend(self, now: datetime, tz: ZoneInfo, column: str, value: str) -> Spend:
        """Runs and dollars of one scope: ``column`` is workspace_id, agent_id or project_id."""
        day = sql_time(now - timedelta(days=1))
        month = sql_time(now.astimezone(tz).replace(day=1, hour=0, minute=0, second=0, microsecond=0))
        scope = ('o.task_id IN (SELECT id FROM "Task" WHERE project_id = $v)' if column == "project_id"
                 else f"o.{column} = $v")
        runs, usd_day, usd_month = self.db.select(
            f'SELECT COALESCE(SUM(CASE WHEN o.queued_at >= $day THEN 1 ELSE 0 END), 0), COALESCE(SUM(CASE '
            f'WHEN o.queued_at >= $day THEN r.cost_usd END), 0), COALESCE(SUM(r.cost_usd), 0) FROM "OfficeRun" o '
            f'JOIN "Run" r ON r.id = o.run_id WHERE {scope} AND o.queued_at >= $since',
            {"v": value, "day": day, "since": min(day, month)})[0]
        return Spend(int(runs), float(usd_day), float(usd_month))

    def budget_exceeded(self, agent, ws, project, now: datetime) -> str | None:
        """The budget pre-check (workspace, project, agent): runs per 24 h and dollars per day
        and month, from the cost the runs already recorded."""
        tz = ZoneInfo(ws.timezone)
        for scope, entity, column in (("workspace", ws, "workspace_id"), ("project", project, "project_id"),
                                      ("agent", agent, "agent_id")):
            budget = {f: getattr(entity, f) for f in BUDGET_FIELDS} if entity is not None else {}
            if any(budget.values()) and (used := budget_used_up(scope, budget, self._spend(now, tz, column,
                                                                                           entity.id))):
                return used
        return None

    def _budget_alert(self, agent, ws, now: datetime) -> None:
        """When an agent reaches 80% of a budget, its coordinators hear of it once per window
        (the day or the month, in the wakeup's key), however far a run jumped past the mark."""
        budget = {f: getattr(agent, f) for f in BUDGET_FIELDS}
        if not any(budget.values()):
            return
        tz = ZoneInfo(ws.timezone)
        share, window = budget_share(budget, self._spend(now, tz, "agent_id", agent.id))
        if share * 100 >= BUDGET_ALERT_PCT:
            stamp = now.astimezone(tz).strftime("%Y-%m-%d" if window == "day" else "%Y-%m")
            for c in self.wakeups.coordinators(agent.workspace_id, agent.id):
                self.wakeups.enqueue_wakeup(agent.workspace_id, c.id, WakeupSource.BUDGET_ALERT,
                                            {"agent_instance_id": agent.id, "budget_pct": round(100 * share)}, now,
                                            idempotency_key=f"budget_alert:{agent.id}:{c.id}:{stamp}")

    def dispatch_wakeups(self, now: datetime, profiles: dict[str, AgentProfile],
                         limit: int = DISPATCH_BATCH) -> tuple[list[str], int]:
        """The dispatcher: every queued wakeup that may be claimed now, oldest first, through
        process_wakeup, in one transaction. Returns (runs queued, wakeups processed)."""
        queued, processed = [], 0
        claimable = self._claimable_wakeups(now, limit)
        self._load_batch(claimable)
        for wakeup_id in claimable:
            outcome = self.process_wakeup(wakeup_id, now, profiles)
            processed += outcome.claimed
            queued += [outcome.run_id] if outcome.run_id else []
        return queued, processed

    def _load_batch(self, wakeup_ids: list[str]) -> None:
        """The rows process_wakeup reads first of each wakeup of a batch (the wakeup, its agent, its
        task), loaded in three statements for the batch, not three per wakeup: Pony keeps them for
        the transaction, so each wakeup's own reads find them."""
        if len(wakeup_ids) < 2:
            return
        wakeups = self.db.Wakeup.select(lambda w: w.id in wakeup_ids)[:]
        agent_ids, task_ids = list({w.agent_id for w in wakeups}), list({w.task_id for w in wakeups if w.task_id})
        self.db.Agent.select(lambda a: a.id in agent_ids)[:]
        if task_ids:
            self.db.Task.select(lambda t: t.id in task_ids)[:]

    def fail_first_claimable(self, now: datetime, error: str) -> str | None:
        """After process_wakeup raised on its own (a bug, not a store error): the wakeup that
        would be claimed first is failed with the error, so one bad request cannot stop the
        dispatcher or crash the daemon again at every start. Returns its id."""
        for wakeup_id in self._claimable_wakeups(now, 1):
            w = self.db.Wakeup[wakeup_id]
            self.wakeups.end_wakeup(w, WakeupStatus.FAILED, now,
                                    note=f"internal error while dispatching: {error}"[:500])
            self.core.raise_attention("agent_error", f"A wakeup of agent {w.agent_id} could not be dispatched",
                                      error[:500], now, schedule_id=None, run_id=None, agent_id=w.agent_id)
            return wakeup_id
        return None

    def _claimable_wakeups(self, now: datetime, limit: int) -> list[str]:
        """The claim query, oldest first: only agents that are idle or working claim; a wakeup
        whose agent is paused or stopped, at max_concurrent_sessions or in its cooldown, or
        whose retry or wake time is ahead, stays queued."""
        due, window = sql_time(now), sql_time(now - timedelta(seconds=COALESCING_WINDOW_S))
        waiting = self.db.select(   # per agent an index probe, not a scan of every queued wakeup
            'SELECT a.id, a.status, a.last_wakeup_finished_at, a.cooldown_sec, a.max_concurrent_sessions '
            'FROM "Agent" a WHERE EXISTS (SELECT 1 FROM "Wakeup" w WHERE w.agent_id = a.id '
            f"AND w.status = '{WakeupStatus.QUEUED}' "
            "AND (w.scheduled_retry_at IS NULL OR w.scheduled_retry_at <= $due) "
            "AND (w.wake_at IS NULL OR w.wake_at <= $due))", {"due": due})
        active = self.wakeups.wakeups_by_agent(WakeupStatus.CLAIMED)
        held = (f'SELECT 1 FROM "Task" t WHERE t.id = w.task_id AND t.state NOT IN {TERMINAL_TASK_SQL} '
                f"AND t.archived_at IS NULL AND EXISTS (SELECT 1 FROM {self.dialect.json_elements('t.blocked_by')} j "
                f'JOIN "Task" b ON b.id = j.value WHERE b.state NOT IN {TERMINAL_TASK_SQL} AND b.archived_at IS NULL)')
        locked = ('SELECT 1 FROM "Task" t JOIN "Wakeup" h ON h.task_id = t.id AND h.agent_id = t.checkout_agent_id '
                  f"WHERE t.id = w.task_id AND t.checkout_agent_id <> $agent AND h.status = '{WakeupStatus.CLAIMED}'")
        candidates: list[tuple[Any, str]] = []
        for agent_id, status, last_finished, cooldown_sec, max_sessions in waiting:
            if status in (AgentStatus.PAUSED, AgentStatus.STOPPED):
                continue   # its wakeups wait for it to be resumed
            if last_finished is not None and sql_instant(last_finished) + timedelta(seconds=cooldown_sec) > now:
                continue
            room = max_sessions - active.get(agent_id, 0)
            if room <= 0:
                continue
            candidates += self.db.select(
                'SELECT requested_at, id FROM "Wakeup" w WHERE agent_id = $agent '
                f"AND status = '{WakeupStatus.QUEUED}' "
                'AND (scheduled_retry_at IS NULL OR scheduled_retry_at <= $due) '
                'AND (wake_at IS NULL OR wake_at <= $due) AND NOT EXISTS (SELECT 1 FROM "Task" t '
                'WHERE t.id = w.task_id AND t.checkout_agent_id = $agent) '   # its own session on the task
                f"AND NOT (w.source = '{WakeupSource.TASK_ASSIGNED}' AND EXISTS ({held})) "   # held by open blockers
                f"AND NOT (w.reason NOT IN {PARTICIPANT_SQL} AND EXISTS ({locked})) "   # another's session
                f"AND NOT (w.source IN {WINDOW_HELD_SQL} AND w.requested_at > $window) "   # its window is open
                'ORDER BY requested_at, id LIMIT $room', {"agent": agent_id, "due": due, "room": room,
                                                          "window": window})
        return [wakeup_id for _, wakeup_id in sorted(candidates)[:limit]]

    def process_wakeup(self, wakeup_id: str, now: datetime, profiles: dict[str, AgentProfile]) -> PipelineOutcome:
        """The dispatch pipeline up to launch (docs/office.md, "The wakeup lifecycle"); launch and finish are the
        run supervisor's and ``settle_run``'s. Returns whether it was claimed here
        and the run it queued (none when the wakeup ended without one)."""
        olog = log.getChild("office")
        w = self.db.Wakeup[wakeup_id]
        agent = self.db.Agent.get(id=w.agent_id)
        # 2. Guard: agent status, before the claim (only an idle or working agent's wakeups are
        # claimed): a paused or stopped agent's wakeups stay queued until it is resumed.
        if w.status != WakeupStatus.QUEUED or (agent is not None
                                               and agent.status in (AgentStatus.PAUSED, AgentStatus.STOPPED)):
            return PipelineOutcome(claimed=False)
        # 1. Claim: queued -> claimed; Pony's optimistic check makes it UPDATE ... WHERE status = 'queued'.
        w.status, w.claimed_at, w.scheduled_retry_at = WakeupStatus.CLAIMED, naive(now), None
        if agent is None:
            self.wakeups.end_wakeup(w, WakeupStatus.FINISHED, now, note="agent deleted: no session",
                                    fire=RoutineRunStatus.SKIPPED)
            return PipelineOutcome(claimed=True)
        task = self.wakeups.task_facts(w.task_id, w.workspace_id) if w.task_id else None
        if w.retry_count and w.task_id and (reason := retry_stale_reason(task, w.agent_id, w.reason)):
            self.wakeups.cancel_stale(w, reason, now, code="wakeup_retry_cancelled")
            return PipelineOutcome(claimed=True)
        if w.source == WakeupSource.ROUTINE:   # a routine deleted, paused or archived since it fired
            routine_id = w.payload.get("routine_id")
            r = self.db.Routine.get(id=routine_id)
            if r is None or r.status != RoutineStatus.ACTIVE:   # what merged into it from elsewhere still runs
                self.wakeups.end_wakeup(w, WakeupStatus.FINISHED, now,
                                        note=f"its routine is {r.status if r else 'deleted'}: no session",
                                        fire=RoutineRunStatus.SKIPPED)
                return PipelineOutcome(claimed=True)
        # 3. Staleness check.
        if w.task_id and (reason := stale_reason(task, w.agent_id, w.reason)):
            self.wakeups.cancel_stale(w, reason, now)
            return PipelineOutcome(claimed=True)
        # Held while blocked (the claim query leaves it queued): it runs once no blocker is open.
        if (w.source == WakeupSource.TASK_ASSIGNED and task and task["blocked_by"]
                and (waiting := self.wakeups.open_blockers(task["blocked_by"]))):
            w.status, w.claimed_at, w.note = WakeupStatus.QUEUED, None, f"{HELD_NOTE}: " + ", ".join(waiting)
            return PipelineOutcome(claimed=False)
        if (w.note or "").startswith(HELD_NOTE):
            w.note = None
        # 4. Idle skip.
        if w.source == WakeupSource.ROUTINE and not w.task_id and agent.skip_idle_wakeups:
            actionable = orm.count(t for t in self.db.Task if t.assignee_agent_id == agent.id
                                   and t.state in ACTIONABLE_TASK_STATES and t.archived_at is None)
            if idle_skip_applies(w.source, w.payload, agent.skip_idle_wakeups, actionable):
                olog.info("wakeup_idle_skipped wakeup_id=%s agent_instance_id=%s agent_name=%s "
                          "reason=no_actionable_tasks", w.id, agent.id, agent.name)
                # Only what the idle skip would end on its own is skipped (the routine's fires, its
                # own and those merged into it): a user, self or event wake that merged into it
                # (into its pending retry) is queued again and runs.
                wakeup_id = w.id
                for q in self.db.Wakeup.select(lambda q: q.coalesced_into == wakeup_id
                                               and q.status == WakeupStatus.COALESCED):
                    if not q.task_id and idle_skip_applies(q.source, q.payload, agent.skip_idle_wakeups, actionable):
                        q.coalesced_into, w.coalesced_count = None, w.coalesced_count - 1
                        self.wakeups.end_wakeup(q, WakeupStatus.FINISHED, now, note="no actionable tasks (idle skip)",
                                                fire=RoutineRunStatus.SKIPPED)
                self.wakeups.end_wakeup(w, WakeupStatus.FINISHED, now, note="no actionable tasks (idle skip)",
                                        fire=RoutineRunStatus.SKIPPED)
                self.core._activity("wakeup_idle_skipped", w.workspace_id, now, agent_id=agent.id, wakeup_id=w.id,
                                    reason="no_actionable_tasks")
                return PipelineOutcome(claimed=True)
        # 5. Checkout (a reviewer or a mentioned agent reads the task; only the one working it takes the lock).
        if w.task_id and w.reason not in PARTICIPANT_REASONS and not self._checkout(w.task_id, agent.id, now):
            holder = self.db.Task[w.task_id].checkout_agent_id
            self.wakeups.end_wakeup(w, WakeupStatus.SKIPPED, now, note=f"task is checked out by agent {holder}")
            return PipelineOutcome(claimed=True)
        # 6. Budget pre-check: the workspace's action_on_exceed pauses the agent, or skips the wakeup.
        ws = self.db.Workspace[w.workspace_id]
        t = self.db.Task.get(id=w.task_id) if w.task_id else None
        project = self.db.Project.get(id=t.project_id) if t is not None and t.project_id else None
        if blocked := self.budget_exceeded(agent, ws, project, now):
            self._budget_block(w, agent, ws, blocked, now)
            return PipelineOutcome(claimed=True)
        # 7. Build context: same-scope wakeups still queued join this one (claim-time merge). A
        # retry still waiting (a rate-limit reset, a backoff) is not pulled forward: this wakeup
        # joins it instead, so the later due time and the retry count stand.
        still_blocked = bool(task and task["blocked_by"] and self.wakeups.open_blockers(task["blocked_by"]))
        others = [self.db.Wakeup[other] for other in self.db.select(
            'SELECT id FROM "Wakeup" w WHERE agent_id = $a AND '
            + ("task_id = $t" if w.task_id else "task_id IS NULL") + f" AND {same_part_sql(w.reason)}"
            + (f" AND source <> '{WakeupSource.TASK_ASSIGNED}'" if still_blocked else "")   # a held assignment waits
            + f" AND status = '{WakeupStatus.QUEUED}' AND wake_at IS NULL AND id <> $w ORDER BY requested_at, id",
            {"a": agent.id, "t": w.task_id, "w": wakeup_id})]
        if waiting := [q for q in others if q.scheduled_retry_at is not None and aware(q.scheduled_retry_at) > now]:
            self.wakeups.release_checkout(w.task_id, agent.id)
            self.wakeups.coalesce(waiting[0], w, now)
            return PipelineOutcome(claimed=True)
        for other in others:
            self.wakeups.coalesce(w, other, now)
        # 8. Resolve executor (task override -> agent -> project -> workspace default), and the repository.
        executor = resolve_executor(t.executor if t else None, agent.executor,
                                    project.executor if project else None, ws.default_executor)
        repository = (project.repository if project else None) or self.office.repository_of(ws)
        problem = (None if executor in profiles else
                   f"agent profile {executor!r} is not configured" if executor else
                   "no executor: set one on the agent, the task, its project or the workspace settings")
        if problem is not None:
            self.handle_wakeup_failure(w, problem, now)
            return PipelineOutcome(claimed=True)
        if not repository:
            self._wait_for_repository(w, "the workspace has no repository: set one in Office settings", now)
            return PipelineOutcome(claimed=True)
        run_id = self._queue_wakeup_run(w, agent, ws, task, profiles[executor], executor, repository, now)
        agent.status = AgentStatus.WORKING
        self._budget_alert(agent, ws, now)
        self.core.emit("wakeup.claimed", {"wakeup_id": w.id, "agent_id": agent.id, "run_id": run_id}, now)
        return PipelineOutcome(claimed=True, run_id=run_id)

    def _queue_wakeup_run(self, w, agent, ws, task: dict | None, profile: AgentProfile, executor: str,
                          repository: str, now: datetime) -> str:
        """The last steps of process_wakeup: the run, one per claimed wakeup, on the shared FIFO
        admission queue, with its prompt and session; the wakeups merged into it point at it."""
        session = self.db.AgentSession.get(agent_id=agent.id, task_id=w.task_id) if w.task_id else None
        resumed = bool(session and profile.resume)
        row = None if w.task_id else self.db.ContinuationSummary.get(agent_id=agent.id, scope=summary_scope(w.payload))
        summary = row.content[:SUMMARY_PROMPT_CHARS] if row else ""
        prompt = self.wakeups.office_prompt(agent, w, resumed=resumed, summary=summary, task=task,
                                            tools=profile.kind.tools is not None)
        # docs/agent-clis.md: one worktree path and branch per (agent, task), continued run after run
        session_run = ({"result_branch": office_branch(w.task_id, agent.name), "continues_branch": True,
                        "resume_session_id": session.session_id if resumed else None} if w.task_id else {})
        run_id = self.runs.queue_run(QueuedRun(
            agent=executor, trigger="wakeup", prompt=prompt, repository=repository, workdir=".",
            source_ref=ws.source_ref, notify="wakeup", label=agent.name,
            timeout_seconds=profile.timeout_seconds or OFFICE_RUN_TIMEOUT_S, **session_run), now)
        self.db.OfficeRun(run_id=run_id, wakeup_id=w.id, agent_id=agent.id, workspace_id=w.workspace_id,
                          task_id=w.task_id, assembled_prompt=prompt, summary_injected=summary,
                          context_snapshot=w.context_snapshot, resumed=resumed,
                          session_id=session.session_id if resumed else None, queued_at=naive(now))
        w.run_id = run_id
        if w.coalesced_count > 1:   # the requests merged into it ride its run
            self.db.execute('UPDATE "Wakeup" SET run_id = $run WHERE coalesced_into = $w', {"run": run_id, "w": w.id})
        return run_id

    def _budget_block(self, w, agent, ws, blocked: str, now: datetime) -> None:
        """The budget pre-check of process_wakeup, over budget: the wakeup is skipped, and the agent paused
        unless the workspace says skip."""
        self.wakeups.release_checkout(w.task_id, agent.id)
        self.wakeups.end_wakeup(w, WakeupStatus.SKIPPED, now, note=blocked)
        if ws.budget_action == "skip":
            self.core._activity("wakeup_budget_skipped", w.workspace_id, now, agent_id=agent.id, task_id=w.task_id,
                                wakeup_id=w.id, detail=blocked)
            return
        agent.status, agent.updated_at = AgentStatus.PAUSED, naive(now)
        self.core._activity("wakeup_budget_blocked", w.workspace_id, now, agent_id=agent.id, task_id=w.task_id,
                            wakeup_id=w.id, detail=blocked)
        self.core.raise_attention("budget_blocked", f"Agent {agent.name} was paused: {blocked}",
                                  "Raise the budget or wait, then set the agent back to idle.", now,
                                  schedule_id=None, run_id=None)

    def handle_wakeup_failure(self, w, error: str, now: datetime, jitter: float | None = None,
                              limited_until: datetime | None = None, not_before: datetime | None = None) -> None:
        """A failed wakeup (docs/office.md "Retries"): at the end of its profile's limit (a parsed reset + 30 s),
        else the backoff table of its retry count (never before ``not_before``: its profile is
        held that long by a limit that named no reset); after MAX_RETRY_COUNT retries,
        escalateFailure."""
        plan = plan_retry(w.retry_count, now, random.uniform(-1, 1) if jitter is None else jitter, limited_until,
                          not_before)
        self.wakeups.release_checkout(w.task_id, w.agent_id)
        w.retry_count, w.last_error = plan.retry_count, error[:ERROR_TAIL_BYTES]
        if plan.retry_at is None:
            self._escalate_failure(w, error, now)
            return
        w.status, w.claimed_at, w.scheduled_retry_at = WakeupStatus.QUEUED, None, naive(plan.retry_at)
        log.getChild("office").info("wakeup %s retry %d at %s source=%s%s", w.id, plan.retry_count,
                                    rfc3339(plan.retry_at), plan.source,
                                    f" parsed_reset_at={rfc3339(plan.retry_at)}" if plan.source ==
                                    "rate_limit_parsed" else "")
        self.core.emit("wakeup.retry_scheduled", {"wakeup_id": w.id, "retry_count": w.retry_count,
                                                  "scheduled_retry_at": rfc3339(plan.retry_at),
                                                  "source": plan.source}, now)

    def _requeue_interrupted(self, w, now: datetime) -> None:
        """The daemon stopped or died under a running session: not the agent's failure (as
        ``interrupted`` never counts toward a schedule's failure streak), so the wakeup is
        claimed again at once (docs/office.md "Restarts"), with no
        retry counted: restarts during a long session never escalate it."""
        self.wakeups.release_checkout(w.task_id, w.agent_id)
        w.status, w.claimed_at, w.scheduled_retry_at = WakeupStatus.QUEUED, None, None
        w.note = "its run was interrupted by a shutdown or crash; claimed again"
        self.core.emit("wakeup.requeued", {"wakeup_id": w.id, "retry_count": w.retry_count}, now)

    def _wait_for_repository(self, w, reason: str, now: datetime) -> None:
        """docs/office.md: a wakeup whose repository is missing or broken waits with the reason; it
        is not a retry (the agent did nothing wrong) and starts once the repository is usable."""
        self.wakeups.release_checkout(w.task_id, w.agent_id)
        error = reason if reason.startswith(REPOSITORY_UNAVAILABLE) else f"{REPOSITORY_UNAVAILABLE}: {reason}"
        w.status, w.claimed_at, w.last_error = WakeupStatus.QUEUED, None, error[:ERROR_TAIL_BYTES]
        w.scheduled_retry_at = naive(now + timedelta(seconds=REPOSITORY_RECHECK_S))
        w.note = "waiting for its repository"
        self.core.emit("wakeup.waiting", {"wakeup_id": w.id, "reason": w.last_error}, now)

    def _wait_for_login(self, w, profile: str, now: datetime, why: str = "needs a login") -> None:
        """Its profile is not logged in (or hit a spend limit): not the agent's failure and no retry
        counted. The wakeup is claimed again; its new run waits in the queue until the profile is
        resumed."""
        self.wakeups.release_checkout(w.task_id, w.agent_id)
        w.status, w.claimed_at, w.scheduled_retry_at = WakeupStatus.QUEUED, None, None
        w.note = f"its agent profile {profile} {why}; its run waits until the profile is resumed"
        self.core.emit("wakeup.waiting", {"wakeup_id": w.id, "reason": w.note}, now)

    def _run_fresh(self, w, o, now: datetime) -> None:
        """The CLI no longer knows the stored session: it is dropped and the same wakeup runs
        once fresh, at once and without counting a retry (a fresh run cannot fail this way)."""
        self.wakeups.release_checkout(w.task_id, w.agent_id)
        self.db.execute('DELETE FROM "AgentSession" WHERE agent_id = $a AND task_id = $t',
                        {"a": o.agent_id, "t": o.task_id})
        w.status, w.claimed_at, w.scheduled_retry_at = WakeupStatus.QUEUED, None, None
        w.note = f"its stored session {o.session_id} was gone; runs once fresh"
        self.core._activity("session_dropped", w.workspace_id, now, agent_id=w.agent_id, task_id=w.task_id,
                            wakeup_id=w.id, session_id=o.session_id)

    def _escalate_failure(self, w, error: str, now: datetime) -> None:
        """Retries exhausted: the wakeup fails, an agent_error attention item is raised and
        the workspace's coordinators get an agent_error wakeup."""
        self.wakeups.end_wakeup(w, WakeupStatus.FAILED, now, note=f"failed {w.retry_count} times; escalated")
        agent = self.db.Agent.get(id=w.agent_id)
        name = agent.name if agent else w.agent_id
        self.core.raise_attention("agent_error", f"Agent {name} failed {w.retry_count} times ({w.source})",
                                  error[:ERROR_TAIL_BYTES], now, schedule_id=None, run_id=w.run_id,
                                  agent_id=w.agent_id)
        for c in self.wakeups.coordinators(w.workspace_id, w.agent_id):
            self.wakeups.enqueue_wakeup(w.workspace_id, c.id, WakeupSource.AGENT_ERROR,
                                        {"agent_profile_id": w.agent_id, "run_id": w.run_id or "",
                                         "error": error[:ERROR_TAIL_BYTES]}, now,
                                        idempotency_key=f"agent_error:{w.run_id or w.id}:{c.id}")   # no run: the wakeup

    def settle_wakeup_run(self, r: SettledRun, status: RunStatus, now: datetime) -> None:
        """A run was settled (a hook of the runs part, in its transaction): a wakeup's run settles
        its wakeup."""
        if r.trigger == "wakeup":
            self._settle_office_run(r, status, now)

    def _settle_office_run(self, r: SettledRun, status: RunStatus, now: datetime) -> None:
        """The pipeline's last step, in the run's settlement transaction: the wakeup finishes (or
        is retried), the lock is released, the session and the summary are kept."""
        o = self.db.OfficeRun.get(run_id=r.id)
        w = self.db.Wakeup.get(id=o.wakeup_id) if o is not None else None
        if w is None or w.status != WakeupStatus.CLAIMED or w.run_id != r.id:
            return
        agent = self.db.Agent.get(id=o.agent_id)
        self.wakeups.release_checkout(o.task_id, o.agent_id)
        result = r.result if isinstance(r.result, dict) else {}
        if status in (RunStatus.SUCCEEDED, RunStatus.NEEDS_YOU):
            self.wakeups.end_wakeup(w, WakeupStatus.FINISHED, now, carried=True)
            session_id = (r.agent_report or {}).get("session_id")
            if o.task_id and isinstance(session_id, str) and 0 < len(session_id) <= 200:
                o.session_id = session_id
                row = self.db.AgentSession.get(agent_id=o.agent_id, task_id=o.task_id)
                if row is None:
                    self.db.AgentSession(agent_id=o.agent_id, task_id=o.task_id, session_id=session_id,
                                         run_id=r.id, updated_at=naive(now))
                else:
                    row.set(session_id=session_id, run_id=r.id, updated_at=naive(now))
            if o.task_id and (refused := (r.agent_report or {}).get("session_refused")):
                self.db.execute('DELETE FROM "AgentSession" WHERE agent_id = $a AND task_id = $t',
                                {"a": o.agent_id, "t": o.task_id})   # what it resumes now is unknown: fresh
                self.core._activity("session_refused", w.workspace_id, now, agent_id=o.agent_id, task_id=o.task_id,
                                    wakeup_id=w.id, run_id=r.id, reason=refused)
            if not o.task_id and status == RunStatus.SUCCEEDED:   # every chain this run carried advances
                wakeup_id = w.id
                merged = self.db.Wakeup.select(lambda q: q.coalesced_into == wakeup_id and q.task_id is None)
                for scope in sorted({summary_scope(w.payload)} | {summary_scope(q.payload) for q in merged}):
                    self._update_summary(o, scope, result, now)
            t = self.db.Task.get(id=o.task_id) if o.task_id else None
            if t is not None and t.workflow == "routine" and status == RunStatus.SUCCEEDED:
                self.office.move_task(t.id, TaskState.DONE, now)   # the routine workflow completes itself
        elif status == RunStatus.CANCELLED:
            self.wakeups.end_wakeup(w, WakeupStatus.FINISHED, now, note="its run was cancelled")
        elif r.error == INTERRUPTED:
            self._requeue_interrupted(w, now)
        elif o.resumed and is_unknown_session(r.error or ""):
            self._run_fresh(w, o, now)
        elif (r.error or "").startswith(REPOSITORY_UNAVAILABLE):
            self._wait_for_repository(w, r.error, now)
        elif r.failure_kind == "auth":
            self._wait_for_login(w, r.agent, now)
        elif r.failure_kind == "limit" and (st := self.db.ProfileState.get(name=r.agent)) and st.paused_reason:
            self._wait_for_login(w, r.agent, now, "hit a spend limit")   # no wait lifts it: like a login
        else:
            held = self.db.ProfileState.get(name=r.agent) if r.failure_kind == "limit" else None
            until = aware(held.limited_until) if held else None   # a limit with no reset: the backoff
            self.handle_wakeup_failure(w, r.error or "the run failed", now,
                                       limited_until=until if r.limit_named_reset else None,
                                       not_before=None if r.limit_named_reset else until)
        if agent is not None:
            agent.last_wakeup_finished_at = naive(now)
            if agent.status == AgentStatus.WORKING and not self.office.active_sessions(agent.id):
                agent.status = AgentStatus.IDLE
            if r.cost_usd:   # the cost it reported may take the agent past 80% of a dollar budget
                self._budget_alert(agent, self.db.Workspace[o.workspace_id], now)

    def _update_summary(self, o, scope: str, result: dict[str, Any], now: datetime) -> None:
        """Upsert one continuation summary (``scope``) of a successful taskless run; on a
        builder failure the last good summary stays."""
        row = self.db.ContinuationSummary.get(agent_id=o.agent_id, scope=scope)
        stats = dict(zip(("open_tasks", "in_progress", "in_review"), self.db.select(
            f"SELECT COUNT(*), COALESCE(SUM(CASE WHEN state = '{TaskState.IN_PROGRESS}' THEN 1 ELSE 0 END), 0), "
            f"COALESCE(SUM(CASE WHEN state = '{TaskState.IN_REVIEW}' THEN 1 ELSE 0 END), 0) "
            f"FROM \"Task\" WHERE workspace_id = $ws AND state NOT IN {TERMINAL_TASK_SQL} "
            "AND archived_at IS NULL", {"ws": o.workspace_id})[0], strict=True))
        since = sql_time(now - timedelta(days=1))
        stats["failed_runs"] = self.db.select(
            'SELECT COUNT(*) FROM "OfficeRun" o JOIN "Run" r ON r.id = o.run_id WHERE o.workspace_id = $ws '
            f"AND o.queued_at >= $since AND r.status = '{RunStatus.FAILED}'", {"ws": o.workspace_id, "since": since})[0]
        stats["escalations"] = self.db.select(   # wakeups of this workspace that failed for good
            f'SELECT COUNT(*) FROM "Wakeup" WHERE workspace_id = $ws AND status = \'{WakeupStatus.FAILED}\' '
            "AND finished_at >= $since", {"ws": o.workspace_id, "since": since})[0]
        # Open tasks waiting on an open blocker: one query, only what the summary shows, however
        # many tasks the workspace has (this runs inside the settlement's write transaction).
        blocked = (f'FROM "Task" t WHERE t.workspace_id = $ws AND t.state NOT IN {TERMINAL_TASK_SQL} '
                   "AND t.archived_at IS NULL AND EXISTS "
                   f"(SELECT 1 FROM {self.dialect.json_elements('t.blocked_by')} j "
                   f"JOIN \"Task\" b ON b.id = j.value WHERE b.state NOT IN {TERMINAL_TASK_SQL} "
                   "AND b.archived_at IS NULL)")
        blockers = [f"{title} ({tid}) waits on {', '.join(json.loads(ids))}, since {str(created)[:10]}"
                    for tid, title, ids, created in self.db.select(
                        f"SELECT t.id, t.title, t.blocked_by, t.created_at {blocked} "
                        "ORDER BY t.created_at LIMIT $n", {"ws": o.workspace_id, "n": SUMMARY_BLOCKERS})]
        more = self.db.select(f"SELECT COUNT(*) {blocked}", {"ws": o.workspace_id})[0] - len(blockers)
        try:   # the builder alone: a store error here is the transaction's, never swallowed
            content = build_summary(row.content if row else "", result, stats, blockers, now, more=more)
        except Exception:   # noqa: BLE001 - a builder bug: last-good wins; the next successful run rebuilds
            log.getChild("office").exception("summary builder failed for agent %s scope %s", o.agent_id, scope)
            return
        fields = {"content": content, "content_tokens": len(content) // 4, "updated_at": naive(now),
                  "updated_by_run_id": o.run_id}
        if row is None:
            self.db.ContinuationSummary(agent_id=o.agent_id, scope=scope, **fields)
        else:
            row.set(**fields)


###############################################################################
# 12. Store: routines and recovery, housekeeping, and the Store made of its parts.
###############################################################################

class RoutineStore(StorePart):
    """Routines and recovery: routines with schedule, webhook and manual triggers,
    their ticks and fires, webhook deliveries, coordinator heartbeats, and the recovery sweep of
    unstarted assigned tasks."""

    def __init__(self, core: StoreCore, schedules: ScheduleStore, wakeups: WakeupStore, office: OfficeStore,
                 pipeline: PipelineStore):
        super().__init__(core)
        self.schedules, self.wakeups, self.office, self.pipeline = schedules, wakeups, office, pipeline

    def _routine_view(self, r, *, detail: bool = False) -> dict[str, Any]:
        routine_id = r.id
        triggers = self.db.RoutineTrigger.select(lambda t: t.routine_id == routine_id).order_by(
            lambda t: (t.created_at, t.id))
        runs = self.db.RoutineRun.select(lambda x: x.routine_id == routine_id).order_by(
            lambda x: (orm.desc(x.started_at), orm.desc(x.id)))
        view = {"id": r.id, "workspace_id": r.workspace_id, "name": r.name, "description": r.description,
                "assignee_agent_id": r.assignee_agent_id, "status": r.status,
                "concurrency_policy": r.concurrency_policy, "catch_up_policy": r.catch_up_policy,
                "catch_up_max": r.catch_up_max, "priority": r.priority, "task_template": r.task_template or {},
                "variables": r.variables or [], "triggers": [trigger_view(t) for t in triggers],
                "created_at": rfc3339(aware(r.created_at)), "updated_at": rfc3339(aware(r.updated_at))}
        last = runs.first()
        view["last_run"] = routine_run_view(last) if last else None
        if detail:
            view["runs"] = [routine_run_view(x) for x in runs[:50]]
            for t in view["triggers"]:
                if t["kind"] == "webhook":
                    t["refused_deliveries"] = self._refusals(t["id"])
        return view

    def _refusals(self, trigger_id: str) -> list[dict[str, Any]]:
        return [{"at": rfc3339(aware(f.created_at)), "reason": f.reason, "source_address": f.source_address,
                 "size": f.size} for f in self.db.WebhookRefusal.select(lambda f: f.trigger_id == trigger_id)
                .order_by(lambda f: orm.desc(f.id))[:50]]

    def _routine(self, routine_id: str):
        r = self.db.Routine.get(id=routine_id)
        if r is None:
            raise NotFound(f"no routine {routine_id}")
        return r

    def _add_trigger(self, r, trigger: dict[str, Any], now: datetime) -> dict[str, Any]:
        """A new trigger; a webhook's secret is in this answer and never again."""
        t = self.db.RoutineTrigger(id=new_id("trg"), routine_id=r.id, created_at=naive(now), **trigger)
        secret = None
        if t.kind == "schedule":
            t.next_run_at = naive(next_fires(trigger_timing(t.cron_expression, t.timezone), now, 1)[0])
        elif t.kind == "webhook":
            t.public_id = secrets.token_urlsafe(18)
            if t.signing_mode != "none":
                secret = t.secret = secrets.token_urlsafe(32)
        self.core.flush()
        view = trigger_view(t)
        if secret:
            view["secret"] = secret
        return view

    def create_routine(self, workspace_id: str | None, fields: dict[str, Any], triggers: list[dict[str, Any]],
                       now: datetime) -> dict[str, Any]:
        ws = self.office.workspace_row(workspace_id)
        self.office.in_workspace("Agent", fields["assignee_agent_id"], ws.id, "assignee_agent_id")
        r = self.db.Routine(id=new_id("rtn"), workspace_id=ws.id, created_at=naive(now), updated_at=naive(now),
                            **fields)
        created = [self._add_trigger(r, t, now) for t in triggers]
        self.core.emit("routine.created", {"routine_id": r.id}, now)
        view = self._routine_view(r)
        view["triggers"] = created   # with the secrets, this once
        return view

    def routine_fields(self, routine_id: str) -> dict[str, Any]:
        view = self._routine_view(self._routine(routine_id))
        return {k: view[k] for k in ROUTINE_FIELDS if k in view and k not in ("workspace_id", "triggers")}

    def update_routine(self, routine_id: str, fields: dict[str, Any], now: datetime) -> dict[str, Any]:
        r = self._routine(routine_id)
        self.office.in_workspace("Agent", fields["assignee_agent_id"], r.workspace_id, "assignee_agent_id")
        r.set(updated_at=naive(now), **fields)
        self.core.emit("routine.updated", {"routine_id": r.id, "status": r.status}, now)
        return self._routine_view(r, detail=True)

    def delete_routine(self, routine_id: str, now: datetime) -> None:
        r = self._routine(routine_id)
        for t in self.db.RoutineTrigger.select(lambda t: t.routine_id == routine_id):
            t.delete()
        for x in self.db.RoutineRun.select(lambda x: x.routine_id == routine_id):
            x.delete()
        r.delete()
        self.core.emit("routine.deleted", {"routine_id": routine_id}, now)

    def get_routine(self, routine_id: str) -> dict[str, Any]:
        return self._routine_view(self._routine(routine_id), detail=True)

    def list_routines(self, workspace_id: str | None) -> list[dict[str, Any]]:
        ws = self.office.workspace_row(workspace_id)
        return [self._routine_view(r) for r in
                self.db.Routine.select(lambda r: r.workspace_id == ws.id).order_by(lambda r: (r.created_at, r.id))]

    def add_trigger(self, routine_id: str, trigger: dict[str, Any], now: datetime) -> dict[str, Any]:
        r = self._routine(routine_id)
        view = self._add_trigger(r, trigger, now)
        self.core.emit("routine.updated", {"routine_id": r.id}, now)
        return view

    def _trigger(self, routine_id: str, trigger_id: str):
        t = self.db.RoutineTrigger.get(id=trigger_id)
        if t is None or t.routine_id != routine_id:
            raise NotFound(f"no trigger {trigger_id} on routine {routine_id}")
        return t

    def delete_trigger(self, routine_id: str, trigger_id: str, now: datetime) -> None:
        self._trigger(routine_id, trigger_id).delete()
        self.core.emit("routine.updated", {"routine_id": routine_id}, now)

    def rotate_secret(self, routine_id: str, trigger_id: str, now: datetime) -> dict[str, Any]:
        """A new webhook secret (shown this once); the old one is accepted for a grace period."""
        t = self._trigger(routine_id, trigger_id)
        if t.kind != "webhook" or not t.secret:
            raise Conflict("only a signed webhook trigger has a secret to rotate")
        t.previous_secret, t.previous_secret_until = t.secret, naive(now + timedelta(seconds=SECRET_ROTATION_GRACE_S))
        t.secret = secrets.token_urlsafe(32)
        self.core.emit("routine.updated", {"routine_id": routine_id}, now)
        return {**trigger_view(t), "secret": t.secret}

    def scheduled_wakeups(self, agent_id: str) -> int:
        """Enabled schedule triggers of active routines that wake this agent (the coordinator banner)."""
        return self.db.select('SELECT COUNT(*) FROM "RoutineTrigger" t JOIN "Routine" r ON r.id = t.routine_id '
                              f"WHERE r.assignee_agent_id = $a AND r.status = '{RoutineStatus.ACTIVE}' "
                              "AND t.kind = 'schedule' AND t.enabled", {"a": agent_id})[0]

    def install_heartbeat(self, agent_id: str, now: datetime) -> dict[str, Any]:
        """The pre-installed coordinator routine (docs/office.md "Coordinator heartbeat"); an ordinary
        routine the user may edit, pause or delete."""
        a = self.office.agent_row(agent_id)
        ws = self.office.workspace_row(a.workspace_id)
        fields = {"name": "Coordinator heartbeat",
                  "description": "Wakes the coordinator every 5 minutes to check workspace activity, react to errors "
                                 "and budget signals, and decide what to do next.",
                  "assignee_agent_id": a.id, "status": RoutineStatus.ACTIVE, "concurrency_policy": "coalesce_if_active",
                  "catch_up_policy": "enqueue_missed_with_cap", "catch_up_max": 25, "priority": 0,
                  "task_template": {}, "variables": []}
        trigger = {"kind": "schedule", "cron_expression": "*/5 * * * *", "timezone": ws.timezone or "UTC",
                   "enabled": True}
        return self.create_routine(ws.id, fields, [trigger], now)

    def _active_routine_run(self, r, fingerprint: str):
        """The routine's newest run with this dispatch fingerprint whose task (heavy) or
        wakeup (lightweight) is not over: what the concurrency policy is about."""
        routine_id = r.id
        for x in self.db.RoutineRun.select(lambda x: x.routine_id == routine_id and x.status in (
                RoutineRunStatus.RECEIVED, RoutineRunStatus.TASK_CREATED)
                and x.dispatch_fingerprint == fingerprint).order_by(lambda x: orm.desc(x.started_at))[:20]:
            if x.linked_task_id:
                t = self.db.Task.get(id=x.linked_task_id)
                if t is not None and t.state not in TERMINAL_TASK_STATES and t.archived_at is None:
                    return x
            elif x.wakeup_id:
                w = self.db.Wakeup.get(id=x.wakeup_id)
                target = self.db.Wakeup.get(id=w.coalesced_into) if w is not None and w.coalesced_into else w
                if target is not None and target.status in OPEN_WAKEUP_STATUSES:
                    return x
        return None

    def _task_has_work(self, task_id: str) -> bool:
        """A heavy routine's open task is worked on: a wakeup of its assignee on it is queued or
        claimed (a run to come, running, or a retry waiting; a reviewer's or a mentioned agent's
        wakeup works no task), or its latest run waits for a human with its item open."""
        t = self.db.Task[task_id]
        if self.db.select('SELECT 1 FROM "Wakeup" WHERE task_id = $t AND agent_id = $a '
                          f"AND status IN {sql_tuple(OPEN_WAKEUP_STATUSES)} AND reason NOT IN {PARTICIPANT_SQL} "
                          "LIMIT 1",
                          {"t": task_id, "a": t.assignee_agent_id}):
            return True
        return self._waiting_item(task_id) is not None

    def _waiting_item(self, task_id: str):
        """The open ``needs_you`` item of the task's latest run, if that run waits for a human
        (one acknowledged without an answer waits for nobody)."""
        latest = self.db.select(
            'SELECT r.id, r.status FROM "OfficeRun" o JOIN "Run" r ON r.id = o.run_id '
            "WHERE o.task_id = $t ORDER BY o.queued_at DESC, o.run_id DESC LIMIT 1", {"t": task_id})
        if not latest or latest[0][1] != RunStatus.NEEDS_YOU:
            return None
        return self.db.Attention.get(run_id=latest[0][0], kind="needs_you", acknowledged_at=None)

    def _count_on_waiting_item(self, active, now: datetime) -> None:
        """A fire coalesced into a task that waits for a human is counted on that run's open
        item: its detail is the run's question and how often the routine fired since."""
        item = self._waiting_item(active.linked_task_id)
        if item is None:
            return
        run_id = item.run_id
        since = self.db.Run[run_id].finished_at or self.db.Run[run_id].queued_at
        active_id = active.id
        fired = orm.count(x for x in self.db.RoutineRun if x.coalesced_into_run_id == active_id
                          and x.status == RoutineRunStatus.COALESCED and x.started_at >= since)
        item.detail = f"{self.db.Run[run_id].question or ''}\n\n{routine_waiting_note(fired)}".strip()

    def fire_routine(self, routine_id: str, trigger_id: str | None, source: str, provided: dict[str, Any],
                     now: datetime, *, due_at: datetime | None = None, missed_ticks: int = 0,
                     since: datetime | None = None, counted_all: bool = True) -> dict[str, Any]:
        """One firing: variables resolved (a missing required one refuses it), the concurrency
        policy applied by fingerprint, then a fresh task (heavy) or a taskless routine wakeup
        (lightweight). Recorded as a routine run either way. ``counted_all`` false: the missed
        ticks were counted up to a cap, and ``missed_ticks`` is a lower bound ("more than")."""
        r = self._routine(routine_id)
        if r.status != RoutineStatus.ACTIVE:
            raise Conflict(f"routine {r.id} is {r.status}; a {r.status} routine never fires")
        ws = self.office.workspace_row(r.workspace_id)
        tz = ZoneInfo(ws.timezone)
        fired_at = due_at or now
        values = resolve_variables(r.variables or [], provided, fired_at, tz)
        provided_values = {k: v for k, v in values.items() if k not in BUILTIN_VARIABLES}
        template = r.task_template or {}
        title_template = template.get("title") or f"{r.name} - {{{{date}}}}"
        title = render_variables(title_template, values)[:200]
        description = render_variables(template.get("description", ""), values)
        # What the fire would do, without the date built-ins: "release/2.0" and "release/3.0" differ,
        # yesterday's and today's tick of the same routine do not.
        fingerprint = dispatch_fingerprint(r.id, render_variables(title_template, provided_values) if template else "",
                                           render_variables(template.get("description", r.description or ""),
                                                            provided_values), r.assignee_agent_id)
        many = f"{missed_ticks}" if counted_all else f"more than {missed_ticks:,}"
        missed_note = (f"missed {many} tick{'s' if missed_ticks != 1 else ''} since "
                       f"{(since or fired_at).astimezone(tz):%Y-%m-%d %H:%M %Z}") if missed_ticks else ""
        if trigger_id is None and source == "manual":   # Run now is the routine's manual trigger, if it has one
            manual = self.db.RoutineTrigger.select(lambda t: t.routine_id == routine_id and t.kind == "manual")
            trigger_id = next((t.id for t in manual.order_by(lambda t: t.id)), None)
        x = self.db.RoutineRun(id=new_id("rrn"), routine_id=r.id, trigger_id=trigger_id or "manual", source=source,
                               status=RoutineRunStatus.RECEIVED, due_at=naive(due_at), missed_ticks=missed_ticks,
                               trigger_payload=provided_values, dispatch_fingerprint=fingerprint,
                               started_at=naive(now))
        if trigger_id and (t := self.db.RoutineTrigger.get(id=trigger_id)) is not None:
            t.last_fired_at = naive(now)
        active = None if r.concurrency_policy == "always_enqueue" else self._active_routine_run(r, fingerprint)
        agent = self.db.Agent.get(id=r.assignee_agent_id)
        if active is not None and active.linked_task_id and not self._task_has_work(active.linked_task_id):
            # Its task's run ended (failed, escalated, cancelled): the fire is not swallowed by a
            # task nobody works on; it wakes the task's agent again, on the task's session.
            task = self.db.Task[active.linked_task_id]
            payload = {"routine_id": r.id, "variables": values, "missed_ticks": missed_ticks, "task_id": task.id}
            x.wakeup_id = self.wakeups.enqueue_wakeup(
                r.workspace_id, task.assignee_agent_id or r.assignee_agent_id, WakeupSource.ROUTINE, payload, now,
                reason=f"routine {r.name} fired again; its task is still open",
                idempotency_key=routine_idempotency_key(r.id, trigger_id, due_at) if due_at and trigger_id else None)
            x.status, x.linked_task_id, x.completed_at = RoutineRunStatus.TASK_CREATED, task.id, naive(now)
        elif active is not None and active.id != x.id:
            x.status = (RoutineRunStatus.SKIPPED if r.concurrency_policy == "skip_if_active"
                        else RoutineRunStatus.COALESCED)
            x.coalesced_into_run_id = active.id if x.status == RoutineRunStatus.COALESCED else None
            x.completed_at = naive(now)
            if active.linked_task_id:
                self._count_on_waiting_item(active, now)
        elif agent is None or agent.workspace_id != r.workspace_id:
            x.status, x.error, x.completed_at = (RoutineRunStatus.FAILED, "the routine's assignee no longer exists",
                                                 naive(now))
        elif template:
            if missed_note:
                description += f"\n\n(Outpost: {missed_note}.)"
            task = self.office.create_task(r.workspace_id, {
                "title": title, "description": description, "state": str(TaskState.IN_PROGRESS),
                "assignee_agent_id": agent.id, "parent_id": None, "project_id": None, "blocked_by": [],
                "reviewers": [], "requires_approval": False, "workflow": "routine", "executor": None}, now)
            x.status, x.linked_task_id, x.completed_at = RoutineRunStatus.TASK_CREATED, task["id"], naive(now)
        else:
            payload = {"routine_id": r.id, "variables": values, "missed_ticks": missed_ticks}   # with {{date}}
            key = routine_idempotency_key(r.id, trigger_id, due_at) if due_at and trigger_id else None
            reason = f"routine {r.name}" + (f"; {missed_note}" if missed_note else "")
            x.wakeup_id = self.wakeups.enqueue_wakeup(r.workspace_id, agent.id, WakeupSource.ROUTINE, payload, now,
                                                      reason=reason, idempotency_key=key)
            # Dispatched, as a heavy fire's task: task_created, with no task linked.
            x.status, x.completed_at = RoutineRunStatus.TASK_CREATED, naive(now)
        self.core.emit("routine.fired", {"routine_id": r.id, "routine_run_id": x.id, "source": source,
                                         "status": x.status}, now)
        return routine_run_view(x)

    def _record_failed_fire(self, r, trigger_id: str, due_at: datetime, error: str, now: datetime) -> None:
        self.db.RoutineRun(id=new_id("rrn"), routine_id=r.id, trigger_id=trigger_id, source="cron",
                           status=RoutineRunStatus.FAILED, due_at=naive(due_at), error=error[:ERROR_TAIL_BYTES],
                           started_at=naive(now),
                           dispatch_fingerprint=dispatch_fingerprint(r.id, "", "", r.assignee_agent_id),
                           completed_at=naive(now))

    def skip_due_routines(self, now: datetime, error: str) -> int:
        """After an unexpected error claiming routine ticks: every due schedule trigger moves
        on without firing, each skipped tick recorded as a failed routine run with the error,
        so one broken routine can neither stop the cron actor nor make it spin."""
        skipped = 0
        for t in self.db.RoutineTrigger.select(lambda t: t.kind == "schedule" and t.next_run_at is not None
                                               and t.next_run_at <= naive(now)):
            timing = trigger_timing(t.cron_expression, t.timezone)
            due = aware(t.next_run_at)
            later = next_fires(timing, max(due, now), 1)
            t.next_run_at = naive(later[0]) if later else None
            if (r := self.db.Routine.get(id=t.routine_id)) is not None:
                self._record_failed_fire(r, t.id, due, f"internal error, tick skipped: {error}", now)
                skipped += 1
        return skipped

    def claim_due_routines(self, now: datetime) -> int:
        """The routines' part of the cron actor's claim: every due schedule trigger, its
        next_run_at advanced in the same transaction, through the same timing functions
        as schedules (``next_fires``, ``due_slots``). Catch-up follows the routine's policy.
        Paused or archived routines, and disabled triggers, advance without firing."""
        fired = 0
        due = self.db.RoutineTrigger.select(lambda t: t.kind == "schedule" and t.next_run_at is not None
                                            and t.next_run_at <= naive(now))
        for t in due.order_by(lambda t: t.next_run_at):
            timing = trigger_timing(t.cron_expression, t.timezone)
            first_due = aware(t.next_run_at)
            due = due_slots(timing, first_due, now, anchor=None, keep=1000)   # catch_up_max is at most 1000
            total, slots = due.count, due.recent
            later = next_fires(timing, slots[-1], 1) if slots else []
            t.next_run_at = naive(later[0]) if later else None
            r = self.db.Routine.get(id=t.routine_id)
            if r is None or r.status != RoutineStatus.ACTIVE or not t.enabled:
                continue
            plan, dropped = catch_up_plan(r.catch_up_policy, r.catch_up_max, slots, total)
            for i, slot in enumerate(plan):
                if self.db.RoutineRun.get(trigger_id=t.id, due_at=naive(slot)):
                    continue   # this tick fired already (the ledger is UNIQUE on it)
                try:
                    self.fire_routine(r.id, t.id, "cron", {}, now, due_at=slot,
                                      missed_ticks=dropped if i == 0 else 0, since=first_due,
                                      counted_all=due.counted_all)
                except OutpostError as err:   # e.g. a required variable with no default
                    self._record_failed_fire(r, t.id, slot, err.detail, now)
                fired += 1
        return fired

    def fire_sources(self) -> list[FireSource]:
        """The schedules and the routines' schedule triggers that are not archived (upcoming_list)."""
        routines = {r.id: r for r in self.db.Routine.select(lambda r: r.status != RoutineStatus.ARCHIVED)}
        return self.schedules.fire_sources() + [
            FireSource("routine", r.id, r.name, t.timezone, trigger_timing(t.cron_expression, t.timezone),
                       aware(t.next_run_at), r.status != RoutineStatus.ACTIVE or not t.enabled)
            for t in self.db.RoutineTrigger.select(lambda t: t.kind == "schedule")
            if (r := routines.get(t.routine_id)) is not None]

    def next_routine_due_at(self) -> datetime | None:
        return aware(orm.min(t.next_run_at for t in self.db.RoutineTrigger if t.kind == "schedule"))

    def next_fire_at(self) -> datetime | None:
        """The cron actor's wake-up: the earliest next fire of a schedule or a routine trigger."""
        return min((t for t in (self.schedules.next_due_at(), self.next_routine_due_at()) if t), default=None)

    def next_fire_plan(self) -> tuple[datetime | None, list[tuple[str, str, str]]]:
        """The cron actor's wake-up and, for it, the due schedules whose refs it resolves first."""
        upcoming = self.next_fire_at()
        return upcoming, self.schedules.unchanged_checks(upcoming) if upcoming is not None else []

    def webhook_trigger(self, public_id: str, now: datetime) -> dict[str, Any]:
        """What a delivery is checked against, in one query (each webhook fire asks)."""
        rows = self.db.select(
            'SELECT t.id, t.routine_id, t.signing_mode, t.secret, t.previous_secret, t.previous_secret_until, '
            't.enabled, r.status FROM "RoutineTrigger" t LEFT JOIN "Routine" r ON r.id = t.routine_id '
            "WHERE t.public_id = $p AND t.kind = 'webhook'", {"p": public_id})
        if not rows:
            raise NotFound("no webhook trigger at this address")
        trigger_id, routine_id, signing_mode, secret, previous, previous_until, enabled, status = rows[0]
        secrets_ = [secret] if secret else []
        if previous and previous_until and sql_instant(previous_until) > now:
            secrets_.append(previous)
        return {"trigger_id": trigger_id, "routine_id": routine_id, "signing_mode": signing_mode, "secrets": secrets_,
                "enabled": bool(enabled), "routine_status": status or RoutineStatus.ARCHIVED}

    def refuse_webhook(self, trigger_id: str, reason: str, source_address: str | None, size: int,
                       now: datetime) -> None:
        self.db.WebhookRefusal(trigger_id=trigger_id, reason=reason[:500], source_address=source_address,
                               size=size, created_at=naive(now))
        orm.flush()
        self.db.execute(   # only the newest REFUSED_DELIVERIES_KEPT stay
            'DELETE FROM "WebhookRefusal" WHERE trigger_id = $t AND id < (SELECT MIN(id) FROM ('
            '  SELECT id FROM "WebhookRefusal" WHERE trigger_id = $t ORDER BY id DESC LIMIT $kept) AS newest)',
            {"t": trigger_id, "kept": REFUSED_DELIVERIES_KEPT})
        self.core.emit("webhook.refused", {"trigger_id": trigger_id, "reason": reason[:200]}, now)

    def fire_webhook(self, trigger_id: str, provided: dict[str, Any], replay_keys: Iterable[str], replay_ttl_s: int,
                     now: datetime) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
        """(routine run, None) when fired; (None, (earlier routine run id, the key it matched))
        when a signature or delivery id was accepted before. The replay keys and the run share
        a transaction."""
        replay_keys = list(replay_keys)
        for key in replay_keys:
            earlier = self.db.select('SELECT routine_run_id, expires_at FROM "WebhookReplay" WHERE key = $k',
                                     {"k": key})
            if earlier and sql_instant(earlier[0][1]) > now:
                return None, (earlier[0][0], key)
            if earlier:   # expired: the key is free again
                self.db.execute('DELETE FROM "WebhookReplay" WHERE key = $k', {"k": key})
        t = self.db.RoutineTrigger[trigger_id]
        run = self.fire_routine(t.routine_id, t.id, "webhook", provided, now)
        for key in replay_keys:
            self.db.execute('INSERT INTO "WebhookReplay" (key, routine_run_id, expires_at) VALUES ($k, $run, $until)',
                            {"k": key, "run": run["id"], "until": sql_time(now + timedelta(seconds=replay_ttl_s))})
        return run, None

    def recovery_sweep(self, now: datetime) -> int:
        """Office maintenance (not the queue drain): authoritative Office TODO tasks with an
        assignee, created inside the workspace's lookback, that have no queued, running or
        finished run of any age (failed and cancelled ones do not count) are dispatched as
        task_assigned. Skipped entirely when no workspace uses Office (has an agent)."""
        if not self.db.select('SELECT EXISTS (SELECT 1 FROM "Agent")')[0]:
            return 0
        total = 0
        for ws in self.db.Workspace.select():
            if not self.db.select('SELECT EXISTS (SELECT 1 FROM "Agent" WHERE workspace_id = $w)', {"w": ws.id})[0]:
                continue
            since = sql_time(now - timedelta(hours=ws.recovery_lookback_hours))
            candidates = self.db.select(
                f'SELECT t.id FROM "Task" t WHERE t.workspace_id = $ws AND t.state = \'{TaskState.TODO}\' '
                "AND t.assignee_agent_id IS NOT NULL AND (t.workflow != 'kanban' OR t.project_id IS NOT NULL) "
                "AND t.archived_at IS NULL AND t.created_at >= $since AND NOT EXISTS ("
                '  SELECT 1 FROM "OfficeRun" o JOIN "Run" r ON r.id = o.run_id WHERE o.task_id = t.id '
                f"  AND r.status IN {sql_tuple((*ACTIVE_RUN_STATUSES, RunStatus.SUCCEEDED, RunStatus.NEEDS_YOU))}) "
                "ORDER BY t.created_at", {"ws": ws.id, "since": since})
            dispatched = 0
            for task_id in candidates:
                t = self.db.Task[task_id]
                agent = self.db.Agent.get(id=t.assignee_agent_id)
                if agent is None or agent.status in (AgentStatus.PAUSED, AgentStatus.STOPPED):
                    continue
                if self.db.select('SELECT COUNT(*) FROM "Wakeup" WHERE task_id = $t '
                                  f"AND status IN {sql_tuple(OPEN_WAKEUP_STATUSES)}", {"t": task_id})[0]:
                    continue
                project = self.db.Project.get(id=t.project_id) if t.project_id else None
                if self.pipeline.budget_exceeded(agent, ws, project, now):
                    continue
                if self.wakeups.open_blockers(t.blocked_by or []):
                    continue   # task_blockers_resolved wakes it when its blockers are done
                self.wakeups.enqueue_wakeup(ws.id, agent.id, WakeupSource.TASK_ASSIGNED, {"task_id": t.id}, now,
                                            reason="recovery", idempotency_key=f"recovery:{t.id}:{agent.id}:"
                                            f"{int(now.timestamp()) // HOUR_S}")
                self.core._activity("recovery_dispatch", ws.id, now, agent_id=agent.id, task_id=t.id)
                dispatched += 1
            self.core._activity("recovery_sweep_complete", ws.id, now, dispatched_count=dispatched)
            total += dispatched
        return total


class HousekeepingStore(StorePart):
    """Housekeeping (docs/operations.md): which settled runs are old enough to go, and the deletes, each a
    bounded batch in its own transaction. A run is kept whatever its age while it has an open
    attention item, while it is an unanswered ``needs_you``, while it is its schedule's latest
    run, and while an Office task session resumes from it."""

    def __init__(self, core: StoreCore, access: AccessStore):
        super().__init__(core)
        self.access = access

    def _gone(self, r: str) -> str:
        """SQL: run ``r`` (an alias of "Run") goes in a pass with ``$cutoff``. ``status || ''``
        keeps SQLite walking the primary key from ``$after`` rather than every settled run of a
        year through a status index (tests/bench, the year row)."""
        return (f"{r}.status || '' IN {sql_tuple(SETTLED_RUN_STATUSES)} "
                f"AND {r}.finished_at < $cutoff "
                f'AND NOT EXISTS (SELECT 1 FROM "Attention" a WHERE a.run_id = {r}.id AND a.acknowledged_at IS NULL) '
                f"AND NOT ({r}.status = '{RunStatus.NEEDS_YOU}' AND {r}.answered_by IS NULL) "
                f'AND ({r}.schedule IS NULL '
                f'OR {r}.id <> (SELECT MAX(n.id) FROM "Run" n WHERE n.schedule = {r}.schedule)) '
                f'AND NOT EXISTS (SELECT 1 FROM "AgentSession" s WHERE s.run_id = {r}.id)')

    def _kept(self, column: str, dry_run: bool) -> str:
        """SQL: ``column`` names a run that stays. After a pass's runs went (``dry_run`` False)
        that is any run still there, one primary-key lookup; a dry run asks the rules of each."""
        if dry_run:
            return f'{column} IN (SELECT k.id FROM "Run" k WHERE NOT ({self._gone("k")}))'
        return f'EXISTS (SELECT 1 FROM "Run" k WHERE k.id = {column})'

    def old_runs(self, cutoff: datetime, after: str, limit: int) -> list[dict[str, Any]]:
        """The next ``limit`` runs that go, by id after ``after``: what their branch check needs
        (the ref a reply's branch was made from is its first run's ``source_ref``)."""
        # A run's id begins with the millisecond it was made in (a ULID): the walk ends after the
        # millisecond of the last run queued before the cutoff (``~`` sorts after its random
        # part), rather than reading every newer run to find no more. One made out of order (a
        # clock step) goes in a later pass.
        last = self.db.select('SELECT id FROM "Run" WHERE queued_at < $cutoff ORDER BY queued_at DESC LIMIT 1',
                              {"cutoff": sql_time(cutoff)})
        if not last:
            return []
        rows = self.db.select(
            f'SELECT r.id, r.repository, r.result_branch, r.source_ref, r.continues FROM "Run" r '
            f"WHERE r.id > $after AND r.id <= $last AND {self._gone('r')} ORDER BY r.id LIMIT $limit",
            {"cutoff": sql_time(cutoff), "after": after, "last": last[0][:last[0].index("_") + 11] + "~",
             "limit": limit})
        runs = []
        for run_id, repository, branch, source_ref, continues in rows:
            for _ in range(20):   # a reply's source_ref is the branch it continues: its first run's
                if source_ref != branch or not continues:
                    break
                up = self.db.select('SELECT source_ref, continues FROM "Run" WHERE id = $c', {"c": continues})
                if not up:
                    break
                source_ref, continues = up[0]
            runs.append({"id": run_id, "repository": repository, "result_branch": branch,
                         "source_ref": None if source_ref == branch else source_ref})
        return runs

    def branches_in_use(self, branches: list[str], cutoff: datetime) -> list[str]:
        """Of these result branches, those a run that stays still names (a reply continuing
        it, an Office task session)."""
        if not branches:
            return []
        listed, params = sql_list("b", branches)
        return self.db.select(f'SELECT DISTINCT result_branch FROM "Run" r WHERE result_branch IN {listed} '
                              f"AND NOT ({self._gone('r')})", {**params, "cutoff": sql_time(cutoff)})

    def delete_runs(self, run_ids: list[str], cutoff: datetime) -> tuple[list[str], int]:
        """Delete these runs (those that still go) with their log chunks, Office facts and
        acknowledged attention items: (the runs deleted, bytes of log chunks deleted)."""
        listed, params = sql_list("r", run_ids)
        still_gone = self._gone('"Run"')
        gone = self.core.returning(f'DELETE FROM "Run" WHERE id IN {listed} AND {still_gone} RETURNING id',
                                   {**params, "cutoff": sql_time(cutoff)})
        if not gone:
            return [], 0
        listed, params = sql_list("g", gone)
        chunk_bytes = self.db.select(f'SELECT COALESCE(SUM(LENGTH(data)), 0) FROM "LogChunk" WHERE run_id IN {listed}',
                                     params)[0]
        for table in ("LogChunk", "OfficeRun", "Attention"):
            self.db.execute(f'DELETE FROM "{table}" WHERE run_id IN {listed}', params)
        return gone, int(chunk_bytes or 0)

    def _history(self, what: str, dry_run: bool) -> tuple[str, str, str]:
        """(table, key, SQL condition) of the rows of ``what`` that go with ``$cutoff``:
        events older than it (up to ``$last_event``, never the newest: a fleet's cursor is the newest
        event's) unless they name a run that stays; a schedule's ledger rows beyond its newest
        LEDGER_KEEP; finished wakeups; refused webhook deliveries; notifications sent or given up."""
        run_id = self.dialect.json_text("data", "run_id")
        if what == "events":
            return ("Event", "cursor", f"{self.dialect.unindexed('at')} < $cutoff AND cursor <= $last_event "
                                       f"AND ({run_id} IS NULL "
                                       f"OR NOT {self._kept(run_id, dry_run)})")
        if what == "occurrences":   # older than its schedule's LEDGER_KEEP-th newest slot (an index walk)
            return ("Occurrence", "id",
                    'created_at < $cutoff AND due_at < (SELECT o.due_at FROM "Occurrence" o WHERE o.schedule = '
                    '"Occurrence".schedule ORDER BY o.due_at DESC LIMIT 1 OFFSET $keep_offset) '
                    f"AND (run_id IS NULL OR NOT {self._kept('run_id', dry_run)})")
        if what == "wakeups":
            return ("Wakeup", "id", f"status IN {sql_tuple(ENDED_WAKEUP_STATUSES)} "
                                    "AND COALESCE(finished_at, requested_at) < $cutoff "
                                    f"AND (run_id IS NULL OR NOT {self._kept('run_id', dry_run)}) "
                                    # a merged one rides a wakeup still to run: it is not history yet
                                    'AND NOT EXISTS (SELECT 1 FROM "Wakeup" c WHERE c.id = "Wakeup".coalesced_into '
                                    f"AND c.status IN {sql_tuple(OPEN_WAKEUP_STATUSES)})")
        if what == "notifications":   # the outbox's sent and given-up messages (a queued one waits)
            ended = sql_tuple((NotificationStatus.DELIVERED, NotificationStatus.GIVEN_UP))
            return "Notification", "id", f"status IN {ended} AND created_at < $cutoff"
        return "WebhookRefusal", "id", "created_at < $cutoff"

    def _history_params(self, cutoff: datetime) -> dict[str, Any]:
        """``last_event``: the last event before the cutoff (events are numbered in time order),
        never the newest (a fleet's cursor is the newest event's): one bound, so a batch's walk
        of the primary key ends there rather than reading the rest of the log to find no more."""
        old = self.db.select('SELECT cursor FROM "Event" WHERE at < $cutoff ORDER BY at DESC LIMIT 1',
                             {"cutoff": sql_time(cutoff)})
        return {"cutoff": sql_time(cutoff), "keep_offset": LEDGER_KEEP - 1,
                "last_event": min(old[0], self.core.latest_cursor() - 1) if old else 0}

    def count_history(self, what: str, cutoff: datetime) -> int:
        table, _key, where = self._history(what, dry_run=True)
        return self.db.select(f'SELECT COUNT(*) FROM "{table}" WHERE {where}', self._history_params(cutoff))[0]

    def delete_history(self, what: str, cutoff: datetime) -> int:
        """One batch (at most HOUSEKEEPING_ROWS rows) of ``what``: how many went."""
        table, key, where = self._history(what, dry_run=False)
        return self.db.execute(f'DELETE FROM "{table}" WHERE {key} IN (SELECT {key} FROM "{table}" WHERE {where} '
                               f"LIMIT {HOUSEKEEPING_ROWS})", self._history_params(cutoff)).rowcount

    def database_bytes(self) -> int:
        return self.dialect.database_bytes(self.db)

    def give_back_space(self) -> int:
        return self.dialect.give_back_space(self.db)

    def finished(self, counts: dict[str, Any], keep_days: int, now: datetime) -> None:
        """Record a pass (its event is the record the dashboard reads)."""
        self.core.emit("housekeeping.finished", {**counts, "keep_days": keep_days}, now)

    def last_pass(self) -> dict[str, Any] | None:
        rows = self.db.select("SELECT at, data FROM \"Event\" WHERE type = 'housekeeping.finished' "
                              "ORDER BY cursor DESC LIMIT 1")
        if not rows:
            return None
        at, data = rows[0]
        return {"at": rfc3339(sql_instant(at)), **(json.loads(data) if isinstance(data, str) else data)}


class ChannelStore(StorePart):
    """Channels (docs/office.md, "Channels"): a Slack channel or a Telegram chat that feeds one Office task.
    A person's message there becomes a comment on the task (which wakes its agent, and whoever
    it mentions); the agent's own comments there go back out through the outbox."""

    def __init__(self, core: StoreCore, office: OfficeStore, notify: NotifyStore, routines: RoutineStore):
        super().__init__(core)
        self.office, self.notify, self.routines = office, notify, routines
        self.entries: dict[str, ChannelEntry] = {}
        office.comment_hooks.append(self.post_back)

    def sync(self, entries: tuple[ChannelEntry, ...], now: datetime) -> None:
        """At start: each entry's state and task (``"create"``: made once, assigned to its agent).
        A task or an agent that is not there stops ``serve`` with one line."""
        self.entries = {e.name: e for e in entries}
        fed: dict[str, str] = {}
        for e in entries:
            state = self.db.ChannelState.get(name=e.name)
            if e.task != "create":
                if self.db.Task.get(id=e.task) is None:
                    raise ConfigError(f"channels: {e.name}.task {e.task!r} is no task (give a task id, or \"create\")")
                task_id = e.task
            elif (agent := self.db.Agent.get(workspace_id=DEFAULT_WORKSPACE, name=e.agent)) is None:
                raise ConfigError(f"channels: {e.name}.agent {e.agent!r} is no agent of the default workspace")
            elif state is not None and self.db.Task.get(id=state.task_id) is not None:
                task_id = state.task_id   # made once: who works it is then the task's assignee
            else:
                where = f"the Slack channel {e.channel}" if e.kind == "slack" else f"the Telegram chat {e.channel}"
                task_id = self.office.create_task(DEFAULT_WORKSPACE, {
                    "title": e.title, "state": str(TaskState.IN_PROGRESS), "assignee_agent_id": agent.id,
                    "description": f"Messages from {where} arrive here as comments, each with its sender's name. "
                                   "Your comments on this task are posted back there.",
                    "parent_id": None, "project_id": None, "blocked_by": [], "reviewers": [],
                    "requires_approval": False, "workflow": "office", "executor": None}, now)["id"]
            if task_id in fed:   # each would get the other's replies
                raise ConfigError(f"channels: {e.name} and {fed[task_id]} feed the same task {task_id}; "
                                  "give each channel its own task")
            fed[task_id] = e.name
            if state is None:
                self.db.ChannelState(name=e.name, kind=e.kind, task_id=task_id)
            else:
                state.set(kind=e.kind, task_id=task_id)

    def delivered(self, name: str, delivery_id: str, now: datetime) -> bool:
        """Whether this delivery was taken in the last CHANNEL_DEDUP_S (a read: ``receive`` decides)."""
        cutoff = sql_time(now - timedelta(seconds=CHANNEL_DEDUP_S))
        return bool(self.db.select('SELECT 1 FROM "ChannelDelivery" WHERE channel = $c AND delivery_id = $d '
                                   "AND created_at >= $cutoff", {"c": name, "d": delivery_id, "cutoff": cutoff}))

    def receive(self, name: str, message: ChannelMessage, now: datetime) -> dict[str, Any]:
        """A person's message: a comment on the channel's task, once per delivery id (a retry or a
        replay within CHANNEL_DEDUP_S adds nothing and answers ``duplicate``)."""
        state = self.db.ChannelState[name]
        self.db.execute('DELETE FROM "ChannelDelivery" WHERE channel = $c AND created_at < $cutoff',
                        {"c": name, "cutoff": sql_time(now - timedelta(seconds=CHANNEL_DEDUP_S))})
        taken = self.core.returning(
            'INSERT INTO "ChannelDelivery" (channel, delivery_id, created_at) VALUES ($c, $d, $now) '
            "ON CONFLICT DO NOTHING RETURNING id", {"c": name, "d": message.delivery_id, "now": sql_time(now)})
        if not taken:
            return {"status": "duplicate"}
        comment = self.office.add_comment(state.task_id, message.text[:MAX_TEXT_CHARS], now, author=message.sender)
        self.db.ChannelDelivery[taken[0]].comment_id = comment["id"]
        state.last_in_at = naive(now)
        self.core.emit("channel.received", {"channel": name, "comment_id": comment["id"]}, now)
        return {"status": "comment", "comment_id": comment["id"], "task_id": state.task_id}

    def post_back(self, t, c, now: datetime) -> None:
        """A comment hook: the channel task's agent's comment goes out to its channel (once: the
        outbox's UNIQUE (entry, item))."""
        if c.author_agent_id is None or c.author_agent_id != t.assignee_agent_id:
            return
        task_id = t.id
        for state in self.db.ChannelState.select(lambda x: x.task_id == task_id):
            if (entry := self.entries.get(state.name)) is not None:
                self.notify.queue_channel_message(entry, c.id, c.body, now)

    def sent(self, name: str, error: str | None, now: datetime) -> None:
        """How a message to the channel went (Settings shows the last)."""
        if (state := self.db.ChannelState.get(name=name)) is not None:
            if error is None:
                state.last_out_at, state.last_error = naive(now), None
            else:
                state.last_error = error[:500]

    def refuse(self, name: str, reason: str, source_address: str | None, size: int, now: datetime) -> None:
        """A refused delivery, recorded as a refused webhook delivery is (never its body)."""
        self.routines.refuse_webhook(f"channel:{name}", reason, source_address, size, now)

    def queue_test(self, name: str, now: datetime) -> int:
        entry = self.entries.get(name)
        if entry is None:
            raise NotFound(f"no channel {name!r} in outpost.toml")
        return self.notify.queue_channel_message(entry, None, "Outpost test message: this channel works.", now)

    def states(self) -> list[dict[str, Any]]:
        """Each configured channel as the API and Settings show it (never a secret)."""
        views = []
        for e in self.entries.values():
            state = self.db.ChannelState.get(name=e.name)
            refused = self.db.select('SELECT created_at, reason, source_address, size FROM "WebhookRefusal" '
                                     "WHERE trigger_id = $k ORDER BY id DESC LIMIT $kept",
                                     {"k": f"channel:{e.name}", "kept": REFUSED_DELIVERIES_KEPT})
            views.append({"name": e.name, "kind": e.kind, "channel": e.channel,
                          "task_id": state.task_id if state else None,
                          "last_in_at": rfc3339(aware(state.last_in_at)) if state else None,
                          "last_out_at": rfc3339(aware(state.last_out_at)) if state else None,
                          "last_error": state.last_error if state else None,
                          "refused": [{"at": rfc3339(sql_instant(at)), "reason": reason, "source": source,
                                       "size": size} for at, reason, source, size in refused]})
        return views


class Store(StoreCore):
    """The store: the core session with its parts, each a set of synchronous functions run in
    one ``db_session`` through ``transaction`` (``Deps.transaction`` from trio), returning plain
    dicts, never entities. A part holds the parts below it that it calls, never one above:
    runs <- schedules; runs <- nodes; access; notify; wakeups <- office <- pipeline <- routines <- channels."""

    def __init__(self, database: Path | str, **kwargs: Any):
        super().__init__(database, **kwargs)
        self.runs = RunStore(self)
        self.schedules = ScheduleStore(self, self.runs)
        self.nodes = NodeStore(self, self.runs)
        self.access = AccessStore(self)
        self.notify = NotifyStore(self)
        self.wakeups = WakeupStore(self)
        self.office = OfficeStore(self, self.runs, self.wakeups)
        self.pipeline = PipelineStore(self, self.runs, self.wakeups, self.office)
        self.routines = RoutineStore(self, self.schedules, self.wakeups, self.office, self.pipeline)
        self.housekeeping = HousekeepingStore(self, self.access)
        self.channels = ChannelStore(self, self.office, self.notify, self.routines)


###############################################################################
# 13. Git and worktrees: the sandbox, refs and mirrors, a run's private clone.
###############################################################################

def present(path: Path) -> bool:
    """Whether ``path`` is there, False too where this user may not look (another's HOME)."""
    try:
        return path.exists()
    except OSError:
        return False


def create_new(path: Path, data: bytes) -> None:
    """``path`` with ``data``, only where nothing is yet: never through a link an agent left there
    (it would make the daemon write wherever the link points), never over a file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:   # there already (a file, or a link: left as it is), or the folder is not writable
        return
    with os.fdopen(fd, "wb") as f:
        f.write(data)


@dataclasses.dataclass(frozen=True, slots=True)
class Sandbox:
    """docs/security.md: the machine as one run's agent sees it under bubblewrap. Everything read-only
    but its worktree (a private clone, see add_worktree) and its CLIs' state in HOME; the data
    dir (API token, database, other runs) and /tmp replaced by empty ones, of which only the
    worktree, its prompt file and the repository it borrows objects from (read-only) are shown;
    its own PID, IPC, user and mount view (a fresh /proc: no daemon, no other run to see, signal or
    read; no user namespace of its own to make, SANDBOX_NO_USERNS), no capabilities when the
    daemon is root. No ``--die-with-parent``: its parent is the
    thread that spawned it, and trio spawns from worker threads that end when idle (a sandbox
    would be killed 10 s into its run); one that outlives the daemon is ended at the next start
    (end_survivor), as any agent is. Outpost's own
    git commands on the worktree run in it too: whatever the agent planted there (a filter, an
    fsmonitor, a hook, a redirected .git) runs, if at all, where the agent could run it anyway."""
    data_dir: Path
    worktree: Path
    repository: Path     # the user's repository (or its mirror), whose objects the worktree borrows
    private: Path        # the run's prompt file
    home: Path | None
    home_state: tuple[str, ...] = ()   # of AGENT_HOME_STATE, the folders of the run's own CLI
    tmp_mb: int = SANDBOX_TMP_MB        # its /tmp's and /dev/shm's size each: memory, as they are tmpfs
    cgroups: Cgroups | None = None      # what holds each of its process trees to ``caps``
    caps: ResourceCaps = ResourceCaps()
    no_userns: bool = True              # SANDBOX_NO_USERNS (False only with a bubblewrap before 0.8)

    def argv(self, argv: list[str], cwd: Path | None = None) -> list[str]:
        emptied = (Path("/tmp"), Path("/run"))   # host sockets live there (D-Bus, Docker, agents')
        hidden = (*emptied, self.data_dir.resolve())

        def shown(path: Path, how: str) -> list[str]:
            path = path.resolve()
            return [how, str(path), str(path)]

        def hide(path: Path | str) -> list[str]:
            return ["--size", str(HIDING_TMPFS_BYTES), "--tmpfs", str(path)]

        room = str(self.tmp_mb << 20)
        args = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--size", room, "--tmpfs", "/dev/shm",
                "--remount-ro", "/dev", *SANDBOX_NAMESPACES, *(SANDBOX_NO_USERNS if self.no_userns else ()),
                "--proc", "/proc",
                *(a for knob in PROC_HOST_KNOBS for a in ("--ro-bind-try", knob, knob)),
                "--new-session",   # no terminal of the daemon's to write to
                "--size", room, "--tmpfs", "/tmp", *hide("/run")]
        # Under the emptied folders, what the command needs stays visible, read-only: HOME, the
        # folders of PATH and of the command, Outpost itself (the demo agent), and the resolver's
        # file (/etc/resolv.conf is often a link into /run).
        needed = [self.home, Path(sys.prefix), INSTALLED, Path(shutil.which(argv[0]) or argv[0]).parent,
                  *(Path(p) for p in os.environ.get("PATH", "").split(os.pathsep) if p),
                  Path("/etc/resolv.conf").resolve().parent]
        for path in dict.fromkeys(p.resolve() for p in needed if p is not None):
            if any(path.is_relative_to(e) and path != e for e in emptied) and path.is_dir():
                args += shown(path, "--ro-bind")
        if self.home is not None:
            for name in AGENT_HOME_STATE:
                folder = self.home / name
                if name in self.home_state and present(folder):
                    args += shown(folder, "--bind")
                elif present(folder):   # another CLI's login and sessions
                    args += hide(folder.resolve())
            for name in AGENT_HOME_SETTINGS:
                if name.partition("/")[0] in self.home_state and present(self.home / name):
                    args += shown(self.home / name, "--ro-bind")
        secrets = [*(self.home / name for name in HOME_SECRETS if self.home is not None), *map(Path, SYSTEM_SECRETS)]
        for path in filter(present, secrets):   # a folder made empty, a file made /dev/null
            where = str(path.resolve())
            args += hide(where) if path.is_dir() else ["--ro-bind", "/dev/null", where]
        args += hide(hidden[-1])
        if any(self.repository.resolve().is_relative_to(h) for h in hidden):
            args += shown(self.repository, "--ro-bind")
        args += [*shown(self.worktree, "--bind"), "--ro-bind-try", str(self.private), str(self.private)]
        if os.geteuid() == 0:   # root keeps no capability: no umount of what hides the data dir
            args += ["--cap-drop", "ALL"]
        return [*args, "--chdir", str((cwd or self.worktree).resolve()), "--", *argv]

    def make_home_state(self) -> None:
        """The CLIs' state folders in HOME, made when missing (only they are writable inside), and
        Claude Code's ~/.claude.json copied once to where it keeps it inside."""
        if self.home is None or not self.home.is_dir():
            return
        for name in self.home_state:
            with contextlib.suppress(OSError):
                (self.home / name).mkdir(mode=0o700, exist_ok=True)
        for name, empty in AGENT_HOME_SETTINGS.items():
            if name.partition("/")[0] not in self.home_state:
                continue
            if (self.home / name).is_symlink() and not present(self.home / name):   # a link to nothing yet,
                with contextlib.suppress(OSError):                                 # which the agent could make
                    (self.home / name).unlink()
            if empty is None:
                with contextlib.suppress(OSError):
                    (self.home / name).mkdir(mode=0o700, exist_ok=True)
            else:
                create_new(self.home / name, empty.encode())
        if (self.home / ".claude.json").is_file():
            with contextlib.suppress(OSError):
                create_new(self.home / ".claude" / ".claude.json", (self.home / ".claude.json").read_bytes())

    @staticmethod
    def env(parent: dict[str, str]) -> dict[str, str]:
        """The environment of Outpost's own sandboxed git: no secret of the daemon's."""
        return {k: parent[k] for k in ("PATH", "HOME", "LANG", "LC_ALL", "TZ") if k in parent} | {"TMPDIR": "/tmp"}


def process_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from its third field (the state) on, or None: no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat: with the pid, names one process across pid reuse."""
    stat = process_stat(pid)
    return stat[19] if stat else None


def pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


#: A sandbox's process 1 (bubblewrap's reaper, its PID namespace's init): its pid and start time.
SandboxInit = tuple[int, str]


def sandbox_init(leader: int) -> SandboxInit | None:
    """The process 1 of the sandbox whose outer bubblewrap is ``leader``, while that one lives."""
    ours = pid_namespace(os.getpid())
    for entry in os.scandir("/proc"):
        stat = process_stat(int(entry.name)) if entry.name.isdigit() else None
        if stat and stat[1] == str(leader) and pid_namespace(int(entry.name)) not in (None, ours):
            return int(entry.name), stat[19]
    return None


def run_members(leader: int, init: SandboxInit | None = None) -> list[int]:
    """A run's processes: its leader, the process group it heads and, for a sandbox, every
    descendant of its process 1 (``init``, else found under a living leader): also one that left
    the group (a setsid, the sandbox's own new session) or made a PID namespace of its own, as
    orphans of a PID namespace become its init's. A pause, a cancel or a time limit reaches all
    of them, and none outlives its run."""
    stats = {int(e.name): stat for e in os.scandir("/proc") if e.name.isdigit() and (stat := process_stat(int(e.name)))}
    init = init or sandbox_init(leader)
    inside = {init[0]} if init and init[0] in stats and stats[init[0]][19] == init[1] else set()
    while grown := {pid for pid, stat in stats.items() if int(stat[1]) in inside} - inside:
        inside |= grown
    return [pid for pid, stat in stats.items() if pid == leader or stat[2] == str(leader) or pid in inside]


def signal_run(leader: int, sig: int, init: SandboxInit | None = None) -> bool:
    """``sig`` to every process of the run (run_members); whether any was there to get it."""
    sent = False
    for pid in run_members(leader, init):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
            sent = True
    return sent


# --- resource caps: a cgroup per process tree, else prlimit ----------------------------------------

#: The shell that puts itself in a cgroup (each file before ``--``: Held.entry), then becomes the
#: command: what the command starts is born inside, none escapes before it is held. It writes 0,
#: "the writer": on cgroup v1 into ``tasks``, which moves only the writing thread (the shell has no
#: other), and the kernel then spares the global lock a whole process's move takes (an RCU grace
#: period: 12 to 15 ms at each agent's start and each sandboxed git command, measured on 6.18).
CGROUP_ENTER = 'while [ "$1" != -- ]; do echo 0 > "$1" || exit 125; shift; done; shift; exec "$@"'
#: What one cap's cgroup files say when it was met, and the sentence that names it.
CAP_EVENTS = {("memory.events", "oom_kill"): "memory", ("memory.oom_control", "oom_kill"): "memory",
              ("pids.events", "max"): "processes"}


def cgroup_counts(path: Path) -> dict[str, int]:
    """A cgroup's "key value" file (memory.events, pids.events...), or nothing when unreadable."""
    counts = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            with contextlib.suppress(ValueError):
                counts[key] = int(value)
    return counts


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    """One process tree held to its ResourceCaps: in its own cgroup (``folders``, one per
    hierarchy), or by prlimit's ``limits`` on each of its processes, or not at all."""
    caps: ResourceCaps
    folders: tuple[Path, ...] = ()
    limits: tuple[str, ...] = ()
    entry: str = "cgroup.procs"   # the file a process joins by (v1: "tasks", see CGROUP_ENTER)

    def wrap(self, argv: list[str]) -> list[str]:
        if self.folders:
            return ["/bin/sh", "-c", CGROUP_ENTER, "outpost-cgroup",
                    *(str(f / self.entry) for f in self.folders), "--", *argv]
        return ["prlimit", *self.limits, "--", *argv] if self.limits else argv

    def met(self) -> CapMet | None:
        """The cap the tree met, with its run's failure reason, or None (also: not known)."""
        met = {cap for f in self.folders for (name, key), cap in CAP_EVENTS.items()
               if cgroup_counts(f / name).get(key, 0) > 0}
        if "memory" in met:
            return CapMet("memory", f"the run went over its memory cap (memory_mb = {self.caps.memory_mb}, "
                                    "files in its /tmp count), and the kernel killed what went over; raise "
                                    "memory_mb in its agent profile if it needs more")
        if "processes" in met:
            return CapMet("processes", f"the run met its process cap (max_processes = {self.caps.processes}, "
                                       "threads count): the kernel refused it more; raise max_processes in its "
                                       "agent profile if it needs more")
        return None

    async def release(self) -> None:
        """Its cgroups removed, once what is left in them is ended (a cgroup with a process in it
        cannot be removed). One left behind, busy past a second, goes at the next start."""
        for folder in self.folders:
            with contextlib.suppress(OSError):
                (folder / "cgroup.kill").write_text("1")   # v2: the whole tree at once
            for _ in range(100):
                with contextlib.suppress(OSError, ValueError):
                    for pid in (folder / "cgroup.procs").read_text().split():
                        os.kill(int(pid), signal.SIGKILL)
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    await trio.sleep(0.01)


@dataclasses.dataclass(frozen=True, slots=True)
class Cgroups:
    """How this machine holds a run to its caps, found once at start (find_cgroups): a cgroup of
    its own under each of ``parents`` (v2: the daemon's delegated cgroup; v1: the daemon's pids
    and memory cgroups), else prlimit, else nothing; ``message`` says which (start line, Settings)."""
    version: int            # 2 or 1; 0: no cgroup of ours to make runs' in
    parents: tuple[Path, ...]
    message: str
    prlimit: bool = False   # without a cgroup: prlimit's caps on each process
    owner: str = ""         # the data dir's mark in its cgroups' names (cgroup_owner)

    @contextlib.asynccontextmanager
    async def hold(self, caps: ResourceCaps) -> AsyncIterator[Held]:
        """A process tree's cgroup for as long as the block lasts (the tree ends before it goes)."""
        held = self.held(caps)
        try:
            yield held
        finally:
            with trio.CancelScope(shield=True):
                await held.release()

    def held(self, caps: ResourceCaps) -> Held:
        if not self.version:
            return Held(caps, limits=prlimit_options(caps) if self.prlimit else ())
        name = f"outpost-{self.owner}-{os.getpid()}-{secrets.token_hex(4)}"
        folders = tuple(parent / name for parent in self.parents)
        memory = str(caps.memory_mb << 20)
        settings = {"pids.max": str(caps.processes), "memory.max": memory, "memory.swap.max": "0",
                    "memory.oom.group": "1", "memory.limit_in_bytes": memory, "memory.memsw.limit_in_bytes": memory}
        try:
            for folder in folders:
                folder.mkdir()
                for file, value in settings.items():
                    if (folder / file).exists():
                        (folder / file).write_text(value)
        except OSError as exc:
            for folder in folders:   # made just now: nothing is in it yet
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise LaunchError(f"could not make the run's cgroup: {exc}") from None
        return Held(caps, folders=folders, entry="tasks" if self.version == 1 else "cgroup.procs")

    def room_short(self, config: Config) -> str | None:
        """Whether the cgroup the daemon shares with its runs' (v2: its service's, TasksMax; v1: its
        own) has room for every run at its process cap beside the daemon's own processes: if not,
        runs at their caps starve the daemon's git for the others. What to change, or None."""
        try:
            room = int((self.parents[0] / "pids.max").read_text()) if self.version else None
        except (OSError, ValueError, IndexError):   # "max": no limit
            room = None
        widest = max((a.caps.processes for a in config.agents), default=ResourceCaps().processes)
        needed = config.max_running * widest + DAEMON_TASKS
        if room is None or room >= needed:
            return None
        return (f"the daemon's cgroup allows {room} processes, fewer than max_running x max_processes "
                f"({config.max_running} x {widest}) plus the daemon's own {DAEMON_TASKS}: runs at their caps "
                "would leave the daemon none; raise TasksMax in outpost.service or lower max_processes")

    async def sweep(self) -> None:
        """The cgroups an earlier daemon of this data dir left (killed, its runs' survivors ended
        by now: end_survivor): what is still in them ended, and they are removed. Another data
        dir's, or another PID namespace's (a container's), are never touched."""
        mine = f"outpost-{self.owner}-"
        for parent in self.parents:
            with contextlib.suppress(OSError):
                left = [Path(e.path) for e in os.scandir(parent) if e.name.startswith(mine)
                        and e.name.split("-")[2] != str(os.getpid()) and e.is_dir()]
                for folder in left:
                    await Held(ResourceCaps(), folders=(folder,)).release()


#: Processes and threads the daemon needs of its own beside its runs' (its threads, its git).
DAEMON_TASKS = 64
#: Runs held to nothing: where no probe was made (tests' own Deps), or outside a run.
NO_CGROUPS = Cgroups(0, (), "runs are not held to max_processes and memory_mb (no probe was made)")
#: The leaf cgroup a v2 daemon moves itself into, so that its own may hold runs' (a cgroup v2
#: with controllers for its children holds no process itself).
CGROUP_DAEMON_LEAF = "outpost-daemon"


def cgroup_owner(data_dir: Path) -> str:
    """A data dir's mark in the names of its runs' cgroups: one daemon's sweep takes only its own."""
    return hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:8]


def find_cgroups(owner: str, root: Path = CGROUP_ROOT, membership: str | None = None) -> Cgroups:
    """Where this daemon can make its runs' cgroups: the v1 pids and memory hierarchies' cgroups
    it is in, when it may write there (root, mostly); else its v2 cgroup, when delegated to it
    (``Delegate=pids memory`` in outpost.service): it moves itself into a leaf (CGROUP_DAEMON_LEAF) and
    gives its cgroup's children the pids and memory controllers. Else prlimit, where installed.
    ``owner``: the data dir's mark (cgroup_owner) in its runs' cgroups' names."""
    if membership is None:
        try:
            membership = Path("/proc/self/cgroup").read_text()
        except OSError:
            membership = ""
    lines = [line.split(":", 2) for line in membership.splitlines() if line.count(":") >= 2]
    v1 = {c: (root / controllers / path.lstrip("/")) for _, controllers, path in lines for c in controllers.split(",")}
    unified = next((path for number, controllers, path in lines if number == "0" and not controllers), None)
    if "pids" in v1 and "memory" in v1:
        parents = (v1["pids"], v1["memory"])
        problem = None if all(os.access(p, os.W_OK) for p in parents) else (
            f"its cgroups {parents[0]} and {parents[1]} are not this user's to write")
        version = 1
    elif unified is not None and (root / "cgroup.controllers").exists():
        own = root / unified.lstrip("/")
        parents = (own.parent if own.name == CGROUP_DAEMON_LEAF else own,)
        problem, version = delegated(parents[0]), 2
    else:
        parents, problem, version = (), f"the machine has no cgroup hierarchy mounted under {root}", 0
    if problem is None:
        return Cgroups(version, parents, f"each run is held to its profile's max_processes and memory_mb "
                                         f"in a cgroup of its own (cgroup v{version})", owner=owner)
    if shutil.which("prlimit") and os.geteuid() == 0:   # root is never held to a process count
        return Cgroups(0, (), f"runs are held to memory_mb by prlimit (per process), and not to max_processes "
                              f"(a daemon running as root is never held to a process count), not by a cgroup: "
                              f"{problem}", prlimit=True)
    if shutil.which("prlimit"):
        return Cgroups(0, (), f"runs are held to max_processes and memory_mb by prlimit (per process; the "
                              f"process count is the service user's), not by a cgroup: {problem}", prlimit=True)
    return Cgroups(0, (), f"runs are not held to max_processes and memory_mb: {problem}, and prlimit is missing")


def delegated(own: Path) -> str | None:
    """Makes the daemon's v2 cgroup ``own`` one that holds its runs' cgroups; what stops it, or None."""
    try:
        available = (own / "cgroup.controllers").read_text().split()
        if not {"pids", "memory"} <= set(available):
            return (f"its cgroup {own} has no pids and memory controllers "
                    "(Delegate=pids memory in outpost.service gives them)")
        if {"pids", "memory"} <= set((own / "cgroup.subtree_control").read_text().split()):
            return None
        if not os.access(own / "cgroup.subtree_control", os.W_OK):
            return f"its cgroup {own} is not delegated to it (Delegate=pids memory in outpost.service does that)"
        (own / CGROUP_DAEMON_LEAF).mkdir(exist_ok=True)
        (own / CGROUP_DAEMON_LEAF / "cgroup.procs").write_text(str(os.getpid()))
        (own / "cgroup.subtree_control").write_text("+pids +memory")
    except OSError as exc:   # EBUSY: other processes share the daemon's cgroup
        return f"its cgroup {own} cannot hold runs' cgroups: {exc.strerror or exc}"
    return None


def prlimit_options(caps: ResourceCaps) -> tuple[str, ...]:
    """prlimit's caps where no cgroup can be made: each process's data to ``memory_mb``; and, for
    a daemon that is not root (root is never held to it), the service user's processes and
    threads to those it has now plus ``max_processes``: the count is the user's, shared by its runs.
    Never past the daemon's own hard limits, which prlimit may not raise (it would refuse to start
    the run)."""
    def within(limit: int, value: int) -> int:
        hard = resource.getrlimit(limit)[1]
        return value if hard == resource.RLIM_INFINITY else min(value, hard)

    data = (f"--data={within(resource.RLIMIT_DATA, caps.memory_mb << 20)}",)
    if os.geteuid() == 0:
        return data
    mine = 0
    for entry in os.scandir("/proc"):
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and entry.stat().st_uid == os.geteuid():
                mine += len(os.listdir(f"/proc/{entry.name}/task"))
    return (*data, f"--nproc={within(resource.RLIMIT_NPROC, mine + caps.processes)}")


async def git(repo: str | Path, *args: str, check: bool = True, sandbox: Sandbox | None = None) -> str:
    """Run git with an argument list (never a shell), hooks off; stdout, or LaunchError with
    stderr. In ``sandbox``: on a path an agent has written (docs/security.md)."""
    argv = ["git", "-C", str(repo), *GIT_NO_HOOKS, *args]
    try:
        if sandbox is None:
            done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False, stdin=b"")
        else:
            with trio.fail_after(SANDBOXED_GIT_S):
                async with (sandbox.cgroups or NO_CGROUPS).hold(sandbox.caps) as held:
                    done = await run_sandboxed_git(sandbox.argv(argv), Sandbox.env(dict(os.environ)), held)
    except OSError as exc:
        raise LaunchError(f"could not run git: {exc}") from None
    except trio.TooSlowError:
        raise LaunchError(f"git {' '.join(args)[:80]} did not finish within {SANDBOXED_GIT_S:.0f} s "
                          "in the run's sandbox") from None
    if check and done.returncode != 0:
        raise LaunchError(done.stderr.decode(errors="replace").strip() or f"git {args[0]} failed")
    return done.stdout.decode(errors="replace").strip()


class SandboxInfo:
    """bubblewrap's ``--info-fd``: the pipe through which it names its sandbox's process 1, so the
    sandbox can be ended after its outer bubblewrap has exited (which it does as soon as the
    command does, while what the command left running lives on under process 1)."""

    def __init__(self, argv: list[str]):
        self.read_end, self.write_end = os.pipe()
        self.argv = [argv[0], "--info-fd", str(self.write_end), *argv[1:]]

    async def init(self) -> SandboxInit | None:
        """Process 1, once bubblewrap has written it (None: it failed before, or took past
        SANDBOX_START_S). Call after the spawn. Shielded: the caller ends what it started."""
        os.close(self.write_end)
        text = b""
        async with trio.lowlevel.FdStream(self.read_end) as info:
            with trio.move_on_after(SANDBOX_START_S, shield=True):
                while chunk := await info.receive_some():
                    text += chunk
        with contextlib.suppress(ValueError, TypeError):
            pid = int(json.loads(text)["child-pid"])
            started = process_start_time(pid)
            return (pid, started) if started else None
        return None

    def close(self) -> None:
        """The spawn failed: no process will write."""
        os.close(self.read_end)
        os.close(self.write_end)


async def run_sandboxed_git(argv: list[str], env: dict[str, str], held: Held) -> subprocess.CompletedProcess:
    """Outpost's own git in a run's sandbox, ``held`` to the run's caps: when git exits, or is
    cancelled (its time limit), the whole sandbox ends with it, also what it started there (a
    planted fsmonitor's daemon, which would otherwise hold its output open, and write into the
    worktree, for ever)."""
    info = SandboxInfo(argv)
    init: SandboxInit | None = None
    done: list[subprocess.CompletedProcess] = []

    async def end_sandbox(process: trio.Process) -> None:
        signal_run(process.pid, signal.SIGKILL, init)

    async def git_process(task_status=trio.TASK_STATUS_IGNORED) -> None:
        done.append(await trio.run_process(held.wrap(info.argv), capture_stdout=True, capture_stderr=True, check=False,
                                           stdin=b"", env=env, pass_fds=(info.write_end,),
                                           deliver_cancel=end_sandbox, task_status=task_status))

    async with trio.open_nursery() as nursery:
        try:
            process = await nursery.start(git_process)
        except OSError:
            info.close()
            raise
        init = await info.init()
        await process.wait()
        signal_run(process.pid, signal.SIGKILL, init)   # what it left running holds its output open
    return done[0]


async def resolve_ref(repository: str, ref: str) -> str:
    """The exact commit a branch, tag or commit names now."""
    if not Path(repository).is_dir():
        raise RepositoryUnavailable(f"repository {repository} does not exist")
    try:
        return await git(repository, "rev-parse", "--verify", "--end-of-options", f"{ref}^{{commit}}")
    except LaunchError:
        if not (Path(repository) / ".git").exists() and not await _is_git_repo(repository):
            raise RepositoryUnavailable(f"{repository} is not a git repository") from None
        raise RepositoryUnavailable(f"source_ref {ref!r} does not resolve to a commit in {repository}"
                                    f"{await branches_hint(repository, ref)}") from None


#: How many branch names a source_ref that does not resolve lists.
BRANCHES_LISTED = 10


async def branches_hint(repository: str, ref: str) -> str:
    """What a source_ref that does not resolve could be instead: the repository's branches, or,
    when it has no commit at all, how to make the first one."""
    names = (await git(repository, "for-each-ref", f"--count={BRANCHES_LISTED + 1}", "--sort=-committerdate",
                       "--format=%(refname:short)", "refs/heads/", check=False)).splitlines()
    if not names:
        return (f"; the repository has no commit yet: make a first commit (git -C {shlex.quote(repository)} "
                "commit --allow-empty -m 'first commit'), then use its branch")
    more = ", ..." if len(names) > BRANCHES_LISTED else ""
    return f"; its branches: {', '.join(names[:BRANCHES_LISTED])}{more}{did_you_mean(ref, names)}"


class CatFile:
    """One resident ``git cat-file --batch-check`` of a repository: a question is one line in,
    one line out (``<sha> <type> <size>``, or ``<name> missing``), no process per question."""

    def __init__(self, process: trio.Process):
        self.process = process
        self.lock = trio.Lock()
        self.buffer = bytearray()
        self.closed = False

    async def ask(self, name: str) -> str:
        async with self.lock:
            try:
                await self.process.stdin.send_all(name.encode() + b"\n")
                while b"\n" not in self.buffer:
                    chunk = await self.process.stdout.receive_some(4096)
                    if not chunk:
                        raise LaunchError("git cat-file ended")
                    self.buffer += chunk
            except BaseException:   # a question cut short leaves its answer unread: never reuse it
                self.close()
                raise
            line, _, rest = bytes(self.buffer).partition(b"\n")
            self.buffer[:] = rest
            return line.decode(errors="replace")

    def alive(self) -> bool:
        return not self.closed and self.process.returncode is None

    def close(self) -> None:
        """Ends it; it counts as gone at once (the next question starts another), even before
        the killed process has been reaped."""
        if self.alive():
            self.process.kill()
        self.closed = True


class Mirrors:
    """docs/fleet.md: a repository named by URL is worked on in a bare mirror of its own under
    ``<data dir>/mirrors``, cloned on first use and fetched before a ref of it is resolved; a
    run's result branch is pushed back to the URL when it settles. Credentials are the service
    user's git configuration and SSH keys, never Outpost's. The fetch takes branches and tags
    and never touches ``outpost/*`` (result branches, some checked out in a worktree) nor
    deletes anything: a branch whose push failed stays in the mirror."""

    def __init__(self, root: Path):
        self.root = root
        self._locks: dict[str, trio.Lock] = collections.defaultdict(trio.Lock)
        self._unreachable: dict[str, float] = {}   # URL -> trio time until which its runs are left to others

    def leave_to_others(self, repository: str) -> None:
        """A fleet node could not fetch ``repository``: for REPOSITORY_RECHECK_S it admits none of its runs."""
        self._unreachable[repository] = trio.current_time() + REPOSITORY_RECHECK_S

    def unreachable(self, repositories: Iterable[str]) -> list[str]:
        """Of these URLs, those this node left to the other nodes a moment ago."""
        now = trio.current_time()
        return [r for r in repositories if self._unreachable.get(r, -math.inf) > now]

    def path(self, repository: str) -> str:
        """The local repository a run of ``repository`` works in: the path itself, or its mirror."""
        if not is_repository_url(repository):
            return repository
        tail = re.sub(r"[^\w.-]+", "-", repository.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1])
        digest = hashlib.sha256(repository.encode()).hexdigest()[:12]
        return str(self.root / f"{tail.removesuffix('.git')[:40]}-{digest}.git")

    async def fetched(self, repository: str) -> str:
        """``path``, cloned or fetched now; RepositoryUnavailable with git's words when it cannot be."""
        local = self.path(repository)
        if local == repository:
            return local
        async with self._locks[repository]:   # one git at a time per mirror (its lock files)
            try:
                if not Path(local, "HEAD").exists():
                    self.root.mkdir(parents=True, exist_ok=True)
                    await git(self.root, "clone", "--bare", "--quiet", "--", repository, local)
                else:
                    await git(local, "fetch", "--quiet", "--force", "--tags", "--", repository,
                              "+refs/heads/*:refs/heads/*", "^refs/heads/outpost/*")
            except LaunchError as exc:
                raise RepositoryUnreachable(f"cannot fetch {repository}: {exc}") from None
        self._unreachable.pop(repository, None)
        return local

    async def push(self, repository: str, branch: str) -> None:
        """The result branch to the URL it came from (never a mirror push: that branch only)."""
        async with self._locks[repository]:
            await git(self.path(repository), "push", "--quiet", "--", repository,
                      f"refs/heads/{branch}:refs/heads/{branch}")


class Refs:
    """Resolving refs to commits. While the daemon serves (``resident``), through one resident
    ``git cat-file --batch-check`` per repository, started on demand and restarted if it dies
    (Gitea keeps the same per open repository: go-gitea/gitea#15667); it reads refs afresh at
    each question, also after commits, ``pack-refs`` and ``gc``. Anything it cannot answer
    (a missing ref, a path that is no repository, a ref with blanks in it) takes the one-process
    ``git rev-parse`` path, which also words the error."""

    def __init__(self) -> None:
        self.serving = False
        self.cat_files: dict[str, CatFile] = {}

    @contextlib.asynccontextmanager
    async def resident(self):
        self.serving = True
        try:
            yield self
        finally:
            self.serving = False
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                for cat_file in self.cat_files.values():
                    cat_file.close()
                    await cat_file.process.wait()
            self.cat_files.clear()

    async def resolve(self, repository: str, ref: str) -> str:
        """The exact commit a branch, tag or commit names now."""
        if self.serving and ref.isprintable() and " " not in ref and Path(repository).is_dir():
            with contextlib.suppress(LaunchError, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                cat_file = await self._cat_file(repository)
                sha, _, kind = (await cat_file.ask(f"{ref}^{{commit}}")).partition(" ")
                if kind.startswith("commit "):
                    return sha
        return await resolve_ref(repository, ref)

    async def _cat_file(self, repository: str) -> CatFile:
        cat_file = self.cat_files.get(repository)
        if cat_file is None or not cat_file.alive():
            started = CatFile(await trio.lowlevel.open_process(
                ["git", "-C", repository, "cat-file", "--batch-check"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL))
            cat_file = self.cat_files.get(repository)
            if cat_file is not None and cat_file.alive():   # another question started one meanwhile
                started.close()
            else:
                cat_file = self.cat_files[repository] = started
        return cat_file


async def _is_git_repo(path: str) -> bool:
    return (await git(path, "rev-parse", "--git-dir", check=False)) != ""


async def check_repository(definition: dict[str, Any], deps: Deps) -> str:
    """The validation rules that need git: repository exists (a URL: it is fetched), source_ref
    resolves now. Returns the commit it resolves to (a dispatch records it, as a fire does)."""
    repo = definition["repository"]
    if is_repository_url(repo):
        try:
            return await deps.resolve_ref(repo, definition["source_ref"])
        except RepositoryUnavailable as exc:
            field = "source_ref" if str(exc).startswith("source_ref") else "repository"
            raise invalid(field, str(exc)) from None
    if not Path(repo).is_dir():
        raise invalid("repository", f"{repo} is not an existing git repository on this machine")
    try:
        return await deps.resolve_ref(repo, definition["source_ref"])
    except LaunchError as exc:
        field = "repository" if "not a git repository" in str(exc) else "source_ref"
        raise invalid(field, str(exc) if field == "source_ref" else
                      f"{repo} is not an existing git repository on this machine") from None


async def concurrently(*calls: Callable[[], Awaitable[Any]]) -> list[Any]:
    """Each call's result, the calls run at once (git commands that do not depend on each other:
    a run starts sooner). The first failure is raised as itself, the others cancelled."""
    results: list[Any] = [None] * len(calls)
    failures: list[BaseException] = []

    async def one(i: int, call: Callable[[], Awaitable[Any]], cancel: trio.CancelScope) -> None:
        try:
            results[i] = await call()
        except Exception as exc:
            failures.append(exc)
            cancel.cancel()

    async with trio.open_nursery() as nursery:
        for i, call in enumerate(calls):
            nursery.start_soon(one, i, call, nursery.cancel_scope)
    if failures:
        raise failures[0]
    return results


async def add_worktree(repository: str, commit: str, branch: str, path: Path) -> None:
    """A run's worktree: a private clone on ``branch`` at ``commit`` that borrows the repository's
    objects read-only (alternates), never a ``git worktree`` of it: an agent that can write a
    worktree's ``.git`` could write the repository's config, hooks and refs (docs/security.md). Made
    before the agent runs, so git here obeys only the user's own configuration."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = not path.exists()
    try:
        common, hooks_config, _ = await concurrently(
            functools.partial(git, repository, "rev-parse", "--git-common-dir"),
            functools.partial(git, repository, "config", "--show-scope", "--get-all", "core.hooksPath", check=False),
            functools.partial(git, path.parent, "init", "--quiet", "--template=", f"--initial-branch={branch}",
                              str(path)))
        common = Path(repository, common).resolve()
        (path / ".git" / "objects" / "info").mkdir(parents=True, exist_ok=True)
        (path / ".git" / "objects" / "info" / "alternates").write_text(f"{common / 'objects'}\n")
        # The user's hooks check the agent's commits as they check the user's own (inside the sandbox,
        # read-only): the repository's own core.hooksPath, else a global one (the clone reads it too),
        # else its hooks folder. Outpost's own git never runs them (GIT_NO_HOOKS).
        scoped = dict(line.split("\t", 1) for line in hooks_config.splitlines() if "\t" in line)
        steps = [functools.partial(git, path, "reset", "--quiet", "--hard", commit)]   # the unborn branch, at commit
        if "local" in scoped or not scoped.keys() & {"global", "system"}:
            hooks_path = scoped.get("local", str(common / "hooks"))
            steps.append(functools.partial(git, path, "config", "core.hooksPath", hooks_path))
        await concurrently(*steps)
    except BaseException:   # half made (the repository gone, a cancel): no worktree, whose "changes" would be kept
        if fresh:   # nothing of an agent's is in it yet
            with trio.CancelScope(shield=True), contextlib.suppress(OSError):
                await trio.to_thread.run_sync(remove_tree, path)
        raise


def worktree_intact(path: Path) -> bool:
    """Whether the worktree's ``.git`` is still the folder Outpost made (not a file or a link
    that redirects git elsewhere)."""
    return (path / ".git").is_dir() and not (path / ".git").is_symlink()


async def save_leftovers(workspace: Path, run_id: str, sandbox: Sandbox | None) -> bool:
    """Commit what the agent left uncommitted to the result branch: never lost. Outpost's own
    identity, no signing and no hooks: the user's git config must not decide whether it works.
    In the run's sandbox: the agent may have planted a filter or an fsmonitor in its worktree.
    A status that fails is LaunchError, never taken for a clean worktree. Returns whether
    there was anything to save."""
    if not workspace.exists() or not await git(workspace, "status", "--porcelain", sandbox=sandbox):
        return False
    await git(workspace, "add", "-A", sandbox=sandbox)
    await git(workspace, *GIT_IDENTITY, "commit", "--quiet", "--no-verify", "-m",
              f"outpost: save uncommitted changes of run {run_id}", sandbox=sandbox)
    return True


async def bring_back(repository: str, workspace: Path, branch: str, start: str | None,
                     sandbox: Sandbox | None) -> None:
    """The result branch from the run's worktree into the repository, and nothing else: a fetch
    of that one ref, its objects checked, whose far end (``git upload-pack`` in the worktree,
    which reads the worktree's config) runs in the run's sandbox. None when the branch is still
    at ``start`` (most runs that fail or change nothing)."""
    if start is not None and loose_ref(workspace, branch) == start:
        return
    upload_pack = shlex.join(sandbox.argv(["git-upload-pack"])) if sandbox else "git-upload-pack"
    await git(repository, "-c", "fetch.fsckObjects=true", "-c", "protocol.file.allow=always", "fetch", "--quiet",
              "--no-tags", "--no-write-fetch-head", f"--upload-pack={upload_pack}", "--", str(workspace),
              f"+refs/heads/{branch}:refs/heads/{branch}")
    await trio.to_thread.run_sync(bring_back_lfs, repository, workspace, branch, start)


def loose_ref(workspace: Path, branch: str) -> str | None:
    """What the worktree's loose ref file says (read, never run: the agent may have written it)."""
    try:
        fd = os.open(workspace / ".git" / "refs" / "heads" / branch, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            return f.read(100).decode(errors="replace").strip()
    except OSError:
        return None


#: A git-lfs pointer file (its version line, then keys in order): its oid.
LFS_POINTER = re.compile(rb"version https://git-lfs\.github\.com/spec/v1\n(?:[a-z0-9.-]+ [^\n]*\n)*?"
                         rb"oid sha256:([0-9a-f]{64})\n")
#: git-lfs's bound on a pointer file: larger blobs are never pointers.
LFS_POINTER_MAX_BYTES = 1024


def lfs_pointer_oids(batch: bytes) -> set[str]:
    """The oids named by the LFS pointer files among the objects of
    ``git cat-file --batch='%(objecttype) %(objectsize)'``'s output."""
    oids, at = set(), 0
    while (end := batch.find(b"\n", at)) != -1:
        header = batch[at:end].split(b" ")
        if len(header) != 2 or not header[1].isdigit():   # "<object> missing"
            at = end + 1
            continue
        size = int(header[1])
        if header[0] == b"blob" and (pointer := LFS_POINTER.match(batch, end + 1, end + 1 + size)):
            oids.add(pointer[1].decode())
        at = end + 2 + size
    return oids


def lfs_objects_of(repository: str, branch: str, start: str | None) -> set[str]:
    """The git-lfs objects the result branch's new commits point to (those since ``start``), read
    from the pointer files among their blobs in the repository, where the fetch brought them."""
    def run(*args: str, stdin: bytes = b"") -> bytes:
        done = subprocess.run(["git", "-C", repository, *GIT_NO_HOOKS, *args], input=stdin, capture_output=True,
                              check=False)
        if done.returncode:
            raise LaunchError(done.stderr.decode(errors="replace").strip() or f"git {args[0]} failed")
        return done.stdout
    listed = run("rev-list", "--objects", "--no-object-names", f"--filter=blob:limit={LFS_POINTER_MAX_BYTES}",
                 f"refs/heads/{branch}", *([f"^{start}"] if start else []), "--")
    return lfs_pointer_oids(run("cat-file", "--batch=%(objecttype) %(objectsize)", stdin=listed))


def lfs_object_fd(workspace: Path, oid: str) -> int | None:
    """The worktree's own LFS object ``oid``, opened, when it is a regular file reached through
    no link; else None."""
    try:
        folder = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        for part in (".git", "lfs", "objects", oid[:2], oid[2:4]):
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder)
            os.close(folder)
            folder = inner
        fd = os.open(oid, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)   # no link, and no FIFO's wait
    except OSError:
        return None
    finally:
        os.close(folder)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def bring_back_lfs(repository: str, workspace: Path, branch: str, start: str | None) -> int:
    """The git-lfs objects the result branch's new commits point to, copied from the run's
    worktree (it keeps its own; the repository's it reads through alternates) into the
    repository's store, so that the branch checks out there. Only those: whatever else the agent
    left in its LFS store stays behind; only regular files whose content hashes to their name,
    never through a link. How many."""
    oids = lfs_objects_of(repository, branch, start)
    if not oids:
        return 0
    common = Path(repository, subprocess.run(["git", "-C", repository, "rev-parse", "--git-common-dir"],
                                             capture_output=True, text=True, check=False).stdout.strip())
    copied = 0
    for oid in sorted(oids):
        target = common / "lfs" / "objects" / oid[:2] / oid[2:4] / oid
        if target.exists() or (fd := lfs_object_fd(workspace, oid)) is None:
            continue
        digest, part = hashlib.sha256(), target.with_name(f".{oid}.outpost-{secrets.token_hex(4)}")
        with os.fdopen(fd, "rb") as src:
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(part, "wb") as out:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
                if digest.hexdigest() == oid:
                    os.replace(part, target)
                    copied += 1
            finally:
                part.unlink(missing_ok=True)   # a forged object, or a copy a full disk cut short
    return copied


async def count_commits(repository: str, base: str, branch: str) -> int:
    out = await git(repository, "rev-list", "--count", f"{base}..{branch}", check=False)
    return int(out) if out.isdigit() else 0


async def drop_branch(repository: str, branch: str, expected: str) -> bool:
    """Delete a run's result branch from the repository (or its mirror) if it still points at
    ``expected``, where the run left it: one compare-and-delete (``git update-ref -d <ref> <old>``),
    so a branch that moved since (a push, a reply's commits) is never lost. Only Outpost's own
    ``outpost/`` branches, named by the store, never by an agent. Whether it was deleted."""
    if (not branch.startswith("outpost/") or ".." in branch or not re.fullmatch(r"[0-9a-f]{40,64}", expected)
            or not Path(repository).is_dir()):
        return False
    try:
        await git(repository, "check-ref-format", f"refs/heads/{branch}")
        await git(repository, "update-ref", "-d", f"refs/heads/{branch}", expected)
    except LaunchError:   # gone already, or moved: kept
        return False
    return True


async def remove_worktree(path: Path, sandbox: Sandbox | None, *, seen_clean: bool = False) -> None:
    """Remove a run's worktree once its changes are on the result branch. One that still holds
    uncommitted changes is never removed, nor one whose status fails (LaunchError).
    ``seen_clean``: its status was clean after its agent ended (save_leftovers had nothing to
    save), so it is not asked again; after a save it is (an embedded repository's own changes
    are not committed by the save, and stay)."""
    if not path.exists():
        return
    if not seen_clean and await git(path, "status", "--porcelain", sandbox=sandbox):
        log.getChild("run").warning("worktree %s holds uncommitted changes: kept", path)
        return
    await trio.to_thread.run_sync(remove_tree, path)


def remove_tree(path: Path) -> None:
    """``rm -rf`` of a tree an agent wrote, however deep: each folder met is first moved up into
    the top one, so nothing recurses and no path grows past two names (a chain of 1,500 folders
    is 1,500 moves); folders it made unwritable are made writable first; links are removed,
    never followed. OSError when something cannot be removed."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
        return
    try:
        top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return
    try:
        os.fchmod(top, 0o700)
        moved, tag = itertools.count(), secrets.token_hex(6)   # names the agent cannot have taken
        folders = [""]   # to empty and remove, by name in the top folder ("": the top folder)
        while folders:
            name = folders.pop()
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top) if name else top
            try:
                for entry in list(os.scandir(fd)):
                    if not entry.is_dir(follow_symlinks=False):
                        os.unlink(entry.name, dir_fd=fd)
                        continue
                    os.chmod(entry.name, 0o700, dir_fd=fd)   # to read it, and to move it (its "..")
                    if fd == top:
                        folders.append(entry.name)
                    else:
                        folders.append(f".outpost-removing-{tag}-{next(moved)}")
                        os.rename(entry.name, folders[-1], src_dir_fd=fd, dst_dir_fd=top)
            finally:
                if fd != top:
                    os.close(fd)
            if name:
                os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)
    path.rmdir()


def tree_bytes(path: Path) -> int:
    """Disk use of a folder, links never followed (``du``-like, by file sizes), however deep (a
    walk without recursion). A file that vanishes mid-walk (a run settling) is not counted, nor
    a folder that cannot be read (its path too long for the system, say): logged."""
    total, folders, unread = 0, [os.fspath(path)], 0
    while folders:
        try:
            with os.scandir(folders.pop()) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        folders.append(entry.path)
                    else:
                        with contextlib.suppress(OSError):
                            total += entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
        except OSError:
            unread += 1
    if unread:
        log.warning("size of %s: %d folder(s) could not be read and are not counted", path, unread)
    return total


@dataclasses.dataclass(frozen=True, slots=True)
class Isolation:
    """Whether agents run inside bubblewrap, and the sentence that says so (start line, dashboard)."""
    active: bool
    message: str
    no_userns: bool = False   # its sandboxes make no user namespace (SANDBOX_NO_USERNS)


def bubblewrap_problem(namespaces: tuple[str, ...]) -> str | None:
    """Why a sandbox with these namespaces cannot start here, or None."""
    try:
        probe = subprocess.run(["bwrap", "--ro-bind", "/", "/", *namespaces, "--proc", "/proc", "true"],
                               capture_output=True, timeout=10)
        return None if probe.returncode == 0 else probe.stderr.decode(errors="replace").strip()[:200]
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap is not installed ({exc.__class__.__name__})"


def agent_isolation(mode: str) -> Isolation:
    """Probe bubblewrap once at start, with the namespaces a run's sandbox uses: an agent runs as
    the daemon's user, so without it an agent could read the API token and the database."""
    if mode == "never":
        return Isolation(False, "agents are not isolated (isolate_agents = \"never\"): they can read the data dir")
    if (unblocked := bubblewrap_problem((*SANDBOX_NAMESPACES, *SANDBOX_NO_USERNS))) is None:
        return Isolation(True, "agents run isolated by bubblewrap: the data dir is hidden from them", no_userns=True)
    if (problem := bubblewrap_problem(SANDBOX_NAMESPACES)) is None:
        return Isolation(True, "agents run isolated by bubblewrap: the data dir is hidden from them, but an agent "
                               f"can make a user namespace and in it lift its own caps ({unblocked}; bubblewrap 0.8 "
                               "or newer blocks that)")
    if mode == "always":
        raise ConfigError(f'isolate_agents = "always", but bubblewrap does not work here: {problem}')
    return Isolation(False, f"agents are not isolated: bubblewrap does not work here ({problem}); "
                            "install the bubblewrap package to hide the data dir from them")


def ensure_embedded_repository(path: Path) -> None:
    """The default workspace's repository while the user names none (docs/office.md): a git
    repository with one empty commit, made once, so Office works with no setup."""
    if (path / ".git").exists():
        return
    path.mkdir(parents=True, exist_ok=True)
    for args in (("init", "--quiet", "--initial-branch", "main"),
                 (*GIT_IDENTITY, "commit", "--quiet", "--allow-empty", "--no-verify", "-m",
                  "Outpost: the default workspace's repository")):
        subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True, stdin=subprocess.DEVNULL)


###############################################################################
# 14. Running an agent: its process group, output capture, logs, the demo agent.
###############################################################################

def this_process() -> str:
    """Names this process across machines, boots and pid reuse (who holds a node's name)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "unknown"
    return f"{socket.gethostname()} boot {boot} pid {os.getpid()} start {process_start_time(os.getpid())}"


def process_alive_here(process: str) -> bool | None:
    """Whether ``process`` (another's ``this_process()``) is alive: known only for a process of
    this machine since its boot; None for one elsewhere (only its heartbeat can tell)."""
    theirs, mine = process.split(), this_process().split()
    if len(theirs) != len(mine) or theirs[:3] != mine[:3]:
        return None
    stat = process_stat(int(theirs[4]))
    return bool(stat) and stat[0] not in "ZX" and stat[19] == theirs[6]   # killed, not yet reaped: ended


class LogSink:
    """The run log: stdout and stderr interleaved. Past MAX_LOG_BYTES it keeps the first
    LOG_HEAD_BYTES and the last LOG_TAIL_BYTES with one line saying how much was cut
    (docs/http-api.md): the end of a run (its result, its error) is never the part that is lost.
    While the run goes on the file stops growing at the cap; the tail waits in memory and
    takes its place when the log is closed.

    Beside it, ``<run>.times`` keeps when its lines began (log_times_path): one "offset second"
    line each time a line begins in a new second of ``now``, offsets into the log as it is on
    disk (the cut rewrites them), so a day of output costs at most a line per second."""

    def __init__(self, path: Path, now: Callable[[], datetime]):
        self.path = path
        self.now = now
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "ab")  # noqa: SIM115 (closed by close(), spans many awaits)
            self.times = open(log_times_path(path), "ab")  # noqa: SIM115 (the same)
        except OSError as exc:   # the run fails with the reason; the daemon serves on
            raise LaunchError(f"cannot write the run's log {path}: {exc.strerror or exc}") from None
        self.written = self.file.tell()
        self.seen = self.written   # every byte the run printed, the cut ones too
        self.line_begins = True
        self.marks: list[tuple[int, int]] = []
        self.tail = bytearray()
        self.cut = 0
        self.broken = False

    def write(self, data: bytes) -> None:
        if self.broken or not data:
            return
        try:
            # Where the chunk's first line begins: all its lines arrived at the same moment.
            first = 0 if self.line_begins else data.find(b"\n") + 1 or len(data)
            if first < len(data):
                self.mark(self.seen + first)
            self.seen += len(data)
            self.line_begins = data.endswith(b"\n")
            room = max(0, MAX_LOG_BYTES - self.written)
            if room:
                self.file.write(data[:room])
                self.file.flush()
                self.written += min(room, len(data))
                data = data[room:]
            self.tail += data
            if len(self.tail) > LOG_TAIL_BYTES:
                self.cut += len(self.tail) - LOG_TAIL_BYTES
                del self.tail[:-LOG_TAIL_BYTES]
        except OSError as exc:   # a full disk loses log lines, never the run
            self.broken = True
            log.getChild("run").warning("run log %s: %s; later output dropped", self.path, exc)

    def mark(self, offset: int) -> None:
        second = int(self.now().timestamp())
        if not self.marks or self.marks[-1][1] != second:
            self.marks.append((offset, second))
            self.times.write(b"%d %d\n" % (offset, second))
            self.times.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.tail and not self.broken:
                # The last LOG_TAIL_BYTES written: the tail in memory and, when it is shorter,
                # the end of the file before it (never its head).
                start = max(LOG_HEAD_BYTES, self.written - (LOG_TAIL_BYTES - len(self.tail)))
                with open(self.path, "rb") as written:
                    written.seek(start)
                    keep = written.read(self.written - start) + bytes(self.tail)
                cut = self.written + self.cut + len(self.tail) - LOG_HEAD_BYTES - len(keep)
                marker = f"\n[... {cut} bytes cut ...]\n".encode()
                self.file.seek(LOG_HEAD_BYTES)
                self.file.truncate()
                self.file.write(marker + keep)
                self.times.seek(0)
                self.times.truncate()
                self.times.write(b"".join(b"%d %d\n" % m for m in cut_marks(
                    self.marks, self.seen - len(keep), LOG_HEAD_BYTES + len(marker))))
            self.file.close()
        with contextlib.suppress(OSError):
            self.times.close()


def cut_marks(marks: list[tuple[int, int]], kept_from: int, kept_at: int) -> list[tuple[int, int]]:
    """LogSink's line times once its middle is cut: those of the head as they were, the bytes
    from ``kept_from`` on moved to ``kept_at`` (after the cut's line), the kept part's first
    line under the time of the last mark before it."""
    head = [m for m in marks if m[0] < LOG_HEAD_BYTES]
    before = [m for m in marks if m[0] <= kept_from]
    kept = [(offset - kept_from + kept_at, second) for offset, second in marks if offset > kept_from]
    return head + [(kept_at, before[-1][1])] * bool(before) + kept


def log_times_path(log_path: Path) -> Path:
    """Where LogSink keeps when the lines of ``log_path`` began."""
    return log_path.with_suffix(".times")


def read_line_times(log_path: Path) -> list[tuple[int, int]]:
    """LogSink's marks of ``log_path``: (byte offset, epoch second), oldest first; none without
    the file (a log written before Outpost kept line times, or shipped from another node)."""
    try:   # at most a day of marks (a line a second): a bigger file was not written by LogSink
        with open(log_times_path(log_path), "rb") as f:
            text = f.read(LINE_TIMES_MAX_BYTES).decode(errors="replace")
    except OSError:
        return []
    # Only LogSink writes it, but an agent run without isolation could too: a second past the
    # year 9999 would make the run page fail, so a second has at most 11 digits (year 5138).
    return [(int(m[1]), int(m[2])) for m in re.finditer(r"^(\d{1,15}) (\d{1,11})$", text, re.MULTILINE | re.ASCII)]


def timed_log(data: bytes, marks: list[tuple[int, int]], tz: str) -> list[tuple[str, str]]:
    """A log as blocks of the lines that began in the same second, each with that second
    (``HH:MM:SS`` in ``tz``; "" before the first mark), newlines kept: joined, the log as
    decoded. Blocks, not lines: a page of a million empty lines stays one span per second."""
    zone = ZoneInfo(tz)
    blocks: list[tuple[str, str]] = []
    offset, at, shown, block = 0, 0, "", []
    for piece in re.split(b"(?<=\n)", data):
        if not piece:   # after the last newline
            continue
        while at < len(marks) and marks[at][0] <= offset:
            second = f"{datetime.fromtimestamp(marks[at][1], zone):%H:%M:%S}"
            if second != shown and block:
                blocks.append((shown, b"".join(block).decode(errors="replace")))
                block = []
            shown, at = second, at + 1
        block.append(piece)
        offset += len(piece)
    if block:
        blocks.append((shown, b"".join(block).decode(errors="replace")))
    return blocks


@dataclasses.dataclass
class LiveRun:
    """A run this process supervises, from its worktree to its settlement: what run control
    needs to signal it. ``pid`` is None until its process exists."""
    run_id: str
    scope: trio.CancelScope
    pid: int | None = None
    init: SandboxInit | None = None      # its sandbox's process 1 (SandboxInfo)
    cancelled: bool = False
    paused: bool = False                 # a pause is recorded: stopped, or stopped the moment it exists
    remaining_s: float | None = None     # of the timeout, while paused
    clock: Callable[[], datetime] = lambda: datetime.now(UTC)   # the daemon's (Deps.clock.now)
    #: The instants of its launch seen so far (``run_steps``), written with the next write of the run.
    steps: dict[str, str] = dataclasses.field(default_factory=dict)

    def step(self, name: str) -> None:
        """Note that ``name`` happened now, the first time only (first_output: of many chunks)."""
        if name not in self.steps:
            self.steps[name] = instant_ms(self.clock())

    def cancel(self) -> None:
        """End it for a cancel (run control, or its node declared lost): the one place a run
        becomes cancelled while it runs; run_outcome turns that into its outcome."""
        self.cancelled = True
        self.scope.cancel()

    @property
    def timed_out(self) -> bool:
        """Its time limit ended its process: the scope was cancelled, and no cancel did it."""
        return self.scope.cancelled_caught and not self.cancelled

    def pause(self) -> None:
        """SIGSTOP the run's processes and stop its timeout: paused time is not run time. Before
        its process exists (the worktree is being prepared), the pause waits for it (``spawned``)."""
        if self.paused:
            return
        self.paused = True
        if self.pid:
            signal_run(self.pid, signal.SIGSTOP, self.init)
            self.remaining_s = self.scope.deadline - trio.current_time()
            self.scope.deadline = math.inf

    def resume(self) -> None:
        if not self.paused:
            return
        self.paused = False
        if self.pid and self.remaining_s is not None:
            self.scope.deadline = trio.current_time() + self.remaining_s
            self.remaining_s = None
            signal_run(self.pid, signal.SIGCONT, self.init)

    def spawned(self, pid: int, timeout_s: float, init: SandboxInit | None) -> None:
        """The process exists: its timeout starts, or, paused before, it is stopped at once (docs/http-api.md)."""
        self.pid, self.init = pid, init
        if self.paused:
            signal_run(pid, signal.SIGSTOP, init)
            self.remaining_s, self.scope.deadline = timeout_s, math.inf
        else:
            self.scope.deadline = trio.current_time() + timeout_s


class LiveRuns:
    """The runs this process supervises, by id. Written by run supervisors (``add``,
    ``discard``); read by run control through ``signal``."""

    def __init__(self) -> None:
        self._runs: dict[str, LiveRun] = {}

    def __len__(self) -> int:
        return len(self._runs)

    def add(self, live: LiveRun) -> None:
        self._runs[live.run_id] = live

    def discard(self, run_id: str) -> None:
        self._runs.pop(run_id, None)

    def get(self, run_id: str) -> LiveRun | None:
        return self._runs.get(run_id)

    def ids(self) -> list[str]:
        return sorted(self._runs)

    def cancel_all(self) -> int:
        """End every agent of this process (its node was declared lost): how many."""
        for live in list(self._runs.values()):
            live.cancel()
        return len(self._runs)

    def has_process(self, run_id: str) -> bool:
        """The run's agent process exists (its worktree is made, its agent spawned)."""
        live = self._runs.get(run_id)
        return live is not None and live.pid is not None

    def signal(self, run_id: str, action: str) -> None:
        """Run control was recorded: cancel or pause the run (resume waits for a slot). A run
        not here yet (admitted, its supervisor not begun) reads its pause from the store."""
        live = self._runs.get(run_id)
        if live is not None and action == "cancel":
            live.cancel()
        elif live is not None and action == "pause":
            live.pause()


class OutputLines:
    """The stdout lines a preset's reader gets: the whole stream when it is small, else the
    first OUTPUT_HEAD_LINES within OUTPUT_HEAD_BYTES (a CLI names its session first) and the last
    OUTPUT_TAIL_BYTES (its result comes last), in order, each line cut at OUTPUT_LINE_BYTES. Memory
    stays bounded however long a run talks (about 13 MiB at most), and each chunk costs its own
    length: only it is searched for a newline, never the line so far."""

    def __init__(self) -> None:
        self.head: list[str] = []
        self.head_bytes = 0
        self.tail: collections.deque[str] = collections.deque()
        self.tail_bytes = 0
        self.pending = bytearray()   # the line being printed, up to OUTPUT_LINE_BYTES

    def feed(self, chunk: bytes) -> None:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            self._keep(chunk, start, end)
            self._add(bytes(self.pending))
            self.pending.clear()
            start = end + 1
        self._keep(chunk, start, len(chunk))

    def _keep(self, chunk: bytes, start: int, end: int) -> None:
        room = max(0, OUTPUT_LINE_BYTES - len(self.pending))
        self.pending += chunk[start:min(end, start + room)]

    def _add(self, raw: bytes) -> None:
        line = raw.decode(errors="replace")
        if len(self.head) < OUTPUT_HEAD_LINES and self.head_bytes + len(raw) <= OUTPUT_HEAD_BYTES and not self.tail:
            self.head.append(line)
            self.head_bytes += len(raw)
            return
        self.tail.append(line)
        self.tail_bytes += len(raw)
        while self.tail_bytes > OUTPUT_TAIL_BYTES and len(self.tail) > 1:
            self.tail_bytes -= len(self.tail.popleft().encode())

    def lines(self) -> list[str]:
        if self.pending:
            self._add(bytes(self.pending))
            self.pending.clear()
        return self.head + list(self.tail)


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessResult:
    exit_code: int | None
    lines: list[str]
    stderr_tail: str
    timed_out: bool


async def terminate_group(proc: trio.Process, grace_s: float, init: SandboxInit | None = None, *,
                          sandboxed: bool = False) -> None:
    """SIGTERM the run's processes (run_members), SIGKILL them after the grace. The grace is all
    of theirs, not only the leader's. The leader of an isolated agent is bubblewrap, which would
    die at SIGTERM at once while the agent inside goes on: it is spared the SIGTERM and ends with
    the agent, so the run's exit status is the agent's. Shielded: runs during shutdown."""
    with trio.CancelScope(shield=True):
        init = init or sandbox_init(proc.pid)   # found before its leader goes (a survivor's)
        for pid in run_members(proc.pid, init):
            if pid != proc.pid or not sandboxed:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGTERM)
        signal_run(proc.pid, signal.SIGCONT, init)   # a stopped (paused) process must wake to die
        with trio.move_on_after(grace_s):
            await proc.wait()
            while signal_run(proc.pid, 0, init):   # signal 0: is anyone of the run left?
                await trio.sleep(0.05)
            return
        signal_run(proc.pid, signal.SIGKILL, init)
        await proc.wait()


def check_startable(program: str, cwd: Path, env: dict[str, str]) -> None:
    """Raise what exec would for a program that cannot start. A wrapper (the cgroup's shell,
    prlimit) starts in its place and would fail to exec it only later, in words of its own."""
    found = program if "/" in program else shutil.which(program, path=env.get("PATH", os.defpath))
    if found is None or not (cwd / found).is_file():
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
    if not os.access(cwd / found, os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)


async def run_agent_process(argv: list[str], *, cwd: Path, env: dict[str, str], stdin_text: str | None,
                            timeout_s: float, log_path: Path, now: Callable[[], datetime], live: LiveRun,
                            on_spawn: Callable[[int], Awaitable[None]], grace_s: float = GRACE_S,
                            held: Held | None = None) -> ProcessResult:
    """Start the agent in its own process group, capture its output, enforce the timeout.

    Resource handling: the process group is always ended (SIGTERM, then SIGKILL) before
    this returns or raises, cancellation included. Error handling: a launch failure is
    a LaunchError; everything the process does is reported in ProcessResult. ``held``: the
    cgroup (or prlimit) it starts in."""
    sink = LogSink(log_path, now)
    stdout_lines = OutputLines()
    stderr_tail = bytearray()
    info = SandboxInfo(argv) if argv[0] == "bwrap" else None
    try:
        try:
            spawned = info.argv if info else argv
            if held and held.wrap(spawned) != spawned:
                check_startable(spawned[0], cwd, env)
            proc = await trio.lowlevel.open_process(
                held.wrap(spawned) if held else spawned, cwd=str(cwd), env=env, start_new_session=True,
                stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(info.write_end,) if info else ())
        except OSError as exc:
            if info:
                info.close()
            raise LaunchError(f"could not start agent command {argv[0]!r}: {exc.strerror or exc}") from None
        init = await info.init() if info else None
        live.spawned(proc.pid, timeout_s, init)
        live.step("agent_started")
        await on_spawn(proc.pid)

        async def feed() -> None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                async with proc.stdin:
                    await proc.stdin.send_all(stdin_text.encode())

        async def pump_stdout() -> None:
            async for chunk in proc.stdout:
                live.step("first_output")
                sink.write(chunk)
                stdout_lines.feed(chunk)

        async def pump_stderr() -> None:
            async for chunk in proc.stderr:
                live.step("first_output")
                sink.write(chunk)
                stderr_tail.extend(chunk)
                del stderr_tail[:-ERROR_TAIL_BYTES]

        try:
            with live.scope:
                async with trio.open_nursery() as nursery:
                    if stdin_text is not None:
                        nursery.start_soon(feed)
                    nursery.start_soon(pump_stdout)
                    nursery.start_soon(pump_stderr)
                    await proc.wait()
                    # The agent ended: so does what it left running (background children, a daemon
                    # under the sandbox's process 1), which would hold its output open for ever.
                    signal_run(proc.pid, signal.SIGKILL, init)
            timed_out = live.timed_out
        finally:
            if proc.returncode is None:
                await terminate_group(proc, grace_s, init, sandboxed=info is not None)
            else:
                signal_run(proc.pid, signal.SIGKILL, init)
            live.step("agent_exited")
        return ProcessResult(proc.returncode, stdout_lines.lines(), stderr_tail.decode(errors="replace"), timed_out)
    finally:
        sink.close()


def read_log_bytes(path: Path, offset: int = 0) -> bytes | None:
    """The log file from byte ``offset`` on; None when there is no file."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read()
    except OSError:   # none, or runs/ cannot be read: no log to show
        return None


def read_log(path: Path, offset: int = 0) -> tuple[str, int]:
    """The log from byte ``offset`` on, and the log's size (a live page asks for what is new)."""
    data = read_log_bytes(path, offset)
    return ("", 0) if data is None else (data.decode(errors="replace"), offset + len(data))


@dataclasses.dataclass(frozen=True, slots=True)
class FileDiff:
    """One file of a unified diff: its path, lines added and removed, and the diff text."""
    path: str
    added: int
    removed: int
    text: str


async def branch_diff(repository: str, base: str, branch: str) -> tuple[list[FileDiff], bool]:
    """The unified diff from ``base`` to ``branch``, file by file, capped at MAX_DIFF_BYTES
    (True when cut). Empty when the repository or a ref is gone."""
    if not Path(repository).is_dir():
        return [], False
    text = await git(repository, "diff", "--no-color", "--no-ext-diff", "--end-of-options", base, branch,
                     check=False)
    cut = len(text.encode()) > MAX_DIFF_BYTES
    text = text.encode()[:MAX_DIFF_BYTES].decode(errors="ignore")
    files = []
    for part in re.split(r"^(?=diff --git )", text, flags=re.MULTILINE):
        if not part.startswith("diff --git "):
            continue
        m = re.match(r"diff --git a/(.*?) b/(.*)$", part.splitlines()[0])
        lines = part.splitlines()
        files.append(FileDiff(m[2] if m else lines[0][11:], sum(1 for ln in lines if ln.startswith("+")
                                                                and not ln.startswith("+++")),
                              sum(1 for ln in lines if ln.startswith("-") and not ln.startswith("---")), part))
    return files, cut


async def compare_runs(a: dict[str, Any], b: dict[str, Any], local: str) -> tuple[dict[str, Any], list[FileDiff]]:
    """docs/schedules.md: whether two runs started alike, and the diff between their result branches
    (the report, and the diff file by file for the compare page). ``local``: a's repository
    on this machine (a URL's mirror)."""
    # A run without commits has no branch any more (docs/operations.md): its commit is what it returned.
    left, right = ((r["resolved_commit"] or r["result_branch"]) if not r["changes"]["commits"] else r["result_branch"]
                   for r in (a, b))
    files, cut = await branch_diff(local, left, right)
    stat = await git(local, "diff", "--stat", "--end-of-options", left, right,
                     check=False) if Path(local).is_dir() else ""
    return {"a": a["id"], "b": b["id"], "same_commit": a["resolved_commit"] == b["resolved_commit"],
            "same_prompt": a["prompt"] == b["prompt"],
            "same_profile": (a["agent"], a["model"]) == (b["agent"], b["model"]),
            "diff_stat": stat, "diff": "".join(f.text for f in files), "diff_cut": cut,
            "files": [{"path": f.path, "added": f.added, "removed": f.removed} for f in files]}, files


async def changes_summary(repository: str, base: str, branch: str) -> str:
    """``git log --stat`` of what a run added to its result branch (capped)."""
    if not Path(repository).is_dir():
        return ""
    text = await git(repository, "log", "--stat", "--format=%h %s (%an, %ar)", f"{base}..{branch}", check=False)
    return text[:MAX_TEXT_CHARS]


def demo_office_call(path: str, body: dict[str, Any]) -> None:
    """An Office agent's call on the agent API, with its run-scoped token."""
    request = urllib.request.Request(
        os.environ["OUTPOST_API_URL"] + path, data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": "Bearer " + os.environ["OUTPOST_RUN_TOKEN"], "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


def demo_agent(prompt: str, cwd: Path, out=sys.stdout, err=sys.stderr, session_id: str | None = None) -> int:
    """The built-in simulated agent (README.md): obeys the prompt's ``@`` lines. In an Office
    run it also knows ``@comment TEXT`` and ``@move STATE`` (on its task, through the agent
    API), and it reports a session id that a resumed run continues."""
    summary: list[str] = []
    session_id = session_id or f"demo-{secrets.token_hex(8)}"
    task_id = os.environ.get("OUTPOST_TASK_ID")
    for line in prompt.splitlines():
        if not line.startswith("@"):
            continue
        verb, _, rest = line[1:].partition(" ")
        if verb == "sleep":
            time.sleep(float(rest or 0))
            summary.append(f"slept {rest}s")
        elif verb == "print":
            print(rest, file=out, flush=True)
        elif verb == "fail":
            print(rest, file=err, flush=True)
            return 1
        elif verb in ("commit", "edit"):
            path, _, text = rest.partition(" ")
            target = cwd / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text + "\n")
            if verb == "commit":
                subprocess.run(["git", "add", "--", path], cwd=cwd, check=True)
                subprocess.run(["git", *GIT_IDENTITY, "commit", "--quiet", "-m", f"demo: write {path}"],
                               cwd=cwd, check=True)
            summary.append(f"{'committed' if verb == 'commit' else 'edited'} {path}")
        elif verb == "needs-you":
            print(json.dumps({"status": RunStatus.NEEDS_YOU, "question": rest, "session_id": session_id}), file=out,
                  flush=True)
            return 0
        elif verb == "result":
            try:
                print(json.dumps(json.loads(rest)), file=out, flush=True)
            except ValueError as exc:
                print(f"demo-agent: @result needs JSON, got {rest[:80]!r} ({exc})", file=err, flush=True)
                return 1
        elif verb in ("comment", "move") and task_id and "OUTPOST_RUN_TOKEN" in os.environ:
            if verb == "comment":
                demo_office_call("/api/agent/comments", {"task_id": task_id, "body": rest})
            else:
                demo_office_call(f"/api/agent/tasks/{task_id}/move", {"state": rest.strip()})
            summary.append(f"{verb} {rest.strip()[:60]}")
    print(json.dumps({"status": RunStatus.SUCCEEDED, "summary": "; ".join(summary) or "nothing to do",
                      "session_id": session_id}), file=out, flush=True)
    return 0


async def end_survivor(deps: Deps, run_id: str, pid: int | None, started: str | None) -> None:
    """An agent that outlived its daemon: its processes (run_members) are ended, if that pid is
    still the same process (a pid alone may have been reused)."""
    if pid and started and process_start_time(pid) == started:
        log.getChild("recovery").warning("run %s: ending its surviving processes (leader %d)", run_id, pid)
        init = sandbox_init(pid)   # found while its leader lives: what it leaves is ended after it
        signal_run(pid, signal.SIGTERM, init)
        signal_run(pid, signal.SIGCONT, init)
        with trio.move_on_after(deps.grace_s):
            while process_start_time(pid) == started:
                await trio.sleep(0.05)
        signal_run(pid, signal.SIGKILL, init)


###############################################################################
# 15. Wiring: clocks, channels, the Deps every actor and handler gets.
###############################################################################

class Clock:
    """Wall time plus trio sleeping. Actors read time only through this."""

    def now(self) -> datetime:
        raise NotImplementedError

    def deadline(self, instant: datetime) -> float:
        """The trio deadline at which ``instant`` (wall time) arrives."""
        return trio.current_time() + max(0.0, (instant - self.now()).total_seconds())


class WallClock(Clock):
    def now(self) -> datetime:
        return datetime.now(UTC)


class TrioClock(Clock):
    """Wall time = ``origin`` + trio time elapsed: with MockClock, days pass in milliseconds."""

    def __init__(self, origin: datetime):
        self.origin = origin
        self.started = trio.current_time()

    def now(self) -> datetime:
        return self.origin + timedelta(seconds=trio.current_time() - self.started)


@dataclasses.dataclass(frozen=True, slots=True)
class RunSettled:
    run_id: str


class SettledChannel:
    """Run supervisors -> the notification actor: one RunSettled per settlement. A message
    dropped on a full channel costs latency only: the actor also sweeps the store."""

    def __init__(self, size: int) -> None:
        self.tx, self.rx = trio.open_memory_channel[RunSettled](size)

    def announce(self, run_id: str) -> None:
        with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            self.tx.send_nowait(RunSettled(run_id))


class NudgeChannel:
    """A coalescing wake-up: many senders, one waiter; the store holds the actual work."""

    def __init__(self) -> None:
        self.tx, self.rx = trio.open_memory_channel[None](1)

    def poke(self) -> None:
        with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            self.tx.send_nowait(None)


class Hub:
    """Tells the SSE streams that events were committed (they read them from the store)."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def poke(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()


class Actor(enum.StrEnum):
    """An actor that other parts of the process wake with a nudge."""
    CRON = "cron"     # a schedule's or a routine trigger's next fire may have changed
    CLAIM = "claim"   # runs or wakeups may be ready, or a slot was freed
    NOTIFY = "notify"   # the notification outbox holds a new message


@dataclasses.dataclass
class CronWatch:
    """The dead-man's view of the cron and claim actors: the earliest due instant the cron
    actor has not claimed yet, and since when each actor has been in the pass it is in (absent:
    asleep, waiting for work). An actor held in one pass (a store another process holds, a git
    that hangs) makes no progress whether or not it knew of a due fire. A measurement for
    /healthz (the claims themselves are the store's)."""
    waiting_for: datetime | None = None
    busy_since: dict[str, datetime] = dataclasses.field(default_factory=dict)

    def lag_s(self, now: datetime) -> float:
        return max(0.0, (now - self.waiting_for).total_seconds()) if self.waiting_for else 0.0

    def busy(self, actor: str, now: datetime) -> None:
        self.busy_since[actor] = now

    def idle(self, actor: str) -> None:
        self.busy_since.pop(actor, None)

    def stuck(self, now: datetime) -> tuple[str, float] | None:
        """The actor (cron first) in one pass for more than MISFIRE_GRACE_S, and for how long."""
        for actor in ("cron", "claim"):
            since = self.busy_since.get(actor)
            if since is not None and (held := (now - since).total_seconds()) > MISFIRE_GRACE_S:
                return actor, round(held, 1)
        return None


#: Free space on the database's disk at which /healthz takes a full disk for freed (the next
#: write tells for sure).
DISK_ROOM_BYTES = 1 << 20


@dataclasses.dataclass
class DiskWatch:
    """Whether the database's disk was full at its latest write: set by a write that failed for
    a full disk, cleared by one that went through or, while nothing writes, by room on that
    disk again (``full_now``, when /healthz looks). A measurement for /healthz."""
    full: str | None = None   # why the latest write failed, while the disk is full

    def full_now(self, database: Path | None) -> str | None:
        if self.full is not None and database is not None:
            with contextlib.suppress(OSError):
                room = os.statvfs(database.parent)
                if room.f_bavail * room.f_frsize >= DISK_ROOM_BYTES:
                    self.full = None
        return self.full


#: Buckets of outpost_fire_lag_seconds: a fire is on time within a second (CRON_ON_TIME_S).
FIRE_LAG_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
#: Buckets of outpost_store_transaction_seconds: one fsync is a few milliseconds.
TRANSACTION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
#: How long GET /metrics reuses the sizes on disk it walked (the walk is off the event loop).
DISK_SIZES_TTL_S = 60.0
#: The run statuses outpost_runs_total counts: a run once settled stays so, so each series only grows.
COUNTED_RUN_STATUSES = tuple(str(s) for s in SETTLED_RUN_STATUSES)
#: The wakeup statuses outpost_wakeups_total counts: ended ones (queued and claimed ones move on).
COUNTED_WAKEUP_STATUSES = tuple(str(s) for s in ENDED_WAKEUP_STATUSES)


def disk_usage(data_dir: Path, database: Path | None) -> dict[str, int]:
    """Bytes on disk by what holds them: the SQLite database with its WAL (when there is one),
    the run logs, the worktrees and the mirrors. Blocking (it walks folders): call it off the
    event loop. A file that vanishes mid-walk (a run settling) is simply not counted."""
    sizes = {}
    if database is not None:
        sizes["database"] = sum(os.lstat(p).st_size for p in (database, Path(f"{database}-wal"))
                                if os.path.lexists(p))
    for what, folder in (("logs", "runs"), ("worktrees", "worktrees"), ("mirrors", "mirrors")):
        sizes[what] = tree_bytes(data_dir / folder)
    return sizes


@dataclasses.dataclass(frozen=True, slots=True)
class MetricsReading:
    """What GET /metrics read at one scrape: the store's tallies (fleet-wide) and this node's view."""
    runs: list[tuple[str, str, str, int, float]]
    wakeups: list[tuple[str, str, int]]
    attention: dict[str, int]
    nodes: list[dict[str, Any]] | None   # a fleet's nodes; None on one machine
    disk: dict[str, int]
    cron_lag_s: float


def read_metrics(store: Store) -> tuple[list, list, dict[str, int], list[dict[str, Any]] | None]:
    """The store's part of a scrape, in one transaction: four grouped reads."""
    return (store.runs.run_tallies(), store.wakeups.wakeup_tallies(), store.open_attention_by_kind(),
            store.nodes.list_nodes() if store.dialect.fleet else None)


class StoreCollector:
    """A prometheus_client collector of totals and gauges read from the database at each scrape
    (the source of truth: they survive a restart, and every node of a fleet reports the same).
    ``reading`` is set by the scrape just before the registry is written out, with no await
    between (one trio thread: no other scrape can interleave)."""

    def __init__(self) -> None:
        self.reading: MetricsReading | None = None

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        reading = self.reading
        if reading is None:
            return
        runs = CounterMetricFamily("outpost_runs", "Settled runs, by outcome, agent profile and trigger.",
                                   labels=["status", "agent", "trigger"])
        cost = collections.Counter()
        active = collections.Counter()
        for status, agent, trigger, n, usd in reading.runs:
            cost[agent] += usd
            active[status] += n
            if status in COUNTED_RUN_STATUSES:
                runs.add_metric([status, agent, trigger], n)
        yield runs
        yield GaugeMetricFamily("outpost_runs_running", "Runs running now.", value=active[RunStatus.RUNNING])
        yield GaugeMetricFamily("outpost_runs_queued", "Runs waiting for a slot.", value=active[RunStatus.QUEUED])
        usd = CounterMetricFamily("outpost_agent_cost_usd", "Cost the agents reported, in USD.", labels=["agent"])
        for agent, total in sorted(cost.items()):
            usd.add_metric([agent], total)
        yield usd
        wakeups = CounterMetricFamily("outpost_wakeups", "Office wakeups that ended, by source and how.",
                                      labels=["source", "status"])
        for source, status, n in reading.wakeups:
            if status in COUNTED_WAKEUP_STATUSES:
                wakeups.add_metric([source, status], n)
        yield wakeups
        attention = GaugeMetricFamily("outpost_attention_open", "Open attention items, by kind.", labels=["kind"])
        for kind, n in sorted(reading.attention.items()):
            attention.add_metric([kind], n)
        yield attention
        yield GaugeMetricFamily("outpost_cron_lag_seconds", "How far the cron actor is behind its earliest "
                                "due fire (0: on time).", value=reading.cron_lag_s)
        disk = GaugeMetricFamily("outpost_disk_bytes", "Bytes on disk, by what holds them.", labels=["what"])
        for what, n in reading.disk.items():
            disk.add_metric([what], n)
        yield disk
        if reading.nodes is not None:
            up = GaugeMetricFamily("outpost_node_up", "1 for a node of the fleet whose heartbeat is fresh.",
                                   labels=["node"])
            for node in reading.nodes:
                up.add_metric([node["name"]], 1 if node["status"] == NodeStatus.UP else 0)
            yield up


class Metrics:
    """One appliance's Prometheus registry (its own, never the process-global one: tests start
    many in one process): the in-process histograms (fire lag, store transactions), observed
    where they happen, and the collector of the database's totals. Sizes on disk are cached
    for DISK_SIZES_TTL_S."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Histogram
        self.registry = CollectorRegistry()
        self.fire_lag = Histogram("outpost_fire_lag_seconds", "From a run's scheduled instant to its start (cron, "
                                  "interval and once runs).", buckets=FIRE_LAG_BUCKETS_S, registry=self.registry)
        self.transactions = Histogram("outpost_store_transaction_seconds", "Store transactions (a group commit "
                                      "is one), start to commit.", buckets=TRANSACTION_BUCKETS_S,
                                      registry=self.registry)
        self.store = StoreCollector()
        self.registry.register(self.store)
        self.disk: tuple[datetime, dict[str, int]] | None = None

    def observe_start(self, info: dict[str, Any]) -> None:
        """A run of a schedule's own timing started: how late, from its instant (``launch_info``)."""
        if info["trigger"] in ("cron", "interval", "once") and info["due_at"] and info["started_at"]:
            self.fire_lag.observe(max(0.0, (info["started_at"] - info["due_at"]).total_seconds()))

    def render(self, reading: MetricsReading, accept: str) -> tuple[bytes, str]:
        """The exposition in the format the scraper asked for (``Accept``: OpenMetrics or text)."""
        from prometheus_client.exposition import choose_encoder
        encoder, content_type = choose_encoder(accept)
        self.store.reading = reading
        try:
            return encoder(self.registry), content_type
        finally:
            self.store.reading = None


@dataclasses.dataclass(frozen=True)
class Deps:
    """What the actors and the web share, fixed once built: config, clock, store access, and
    the channels between the actors, made and owned here, the one way an actor gets its own
    (each receives through a clone it closes on the way out): the nudges to the cron, claim and
    outbox actors, settled runs to the notification actor, committed events to the SSE streams.
    ``live`` is the registry of running processes. ``api_url`` is where agents reach the API:
    ``serve`` derives the actors' Deps with it once the web server is bound."""
    config: Config
    store: Store
    clock: Clock
    token: str
    inline_db: bool = False                      # tests with MockClock: no worker thread
    grace_s: float = GRACE_S
    api_url: str = ""
    cron_wake: NudgeChannel = dataclasses.field(default_factory=NudgeChannel)
    claim_wake: NudgeChannel = dataclasses.field(default_factory=NudgeChannel)
    notify_wake: NudgeChannel = dataclasses.field(default_factory=NudgeChannel)
    settled: SettledChannel = dataclasses.field(default_factory=lambda: SettledChannel(SETTLED_BUFFER))
    hub: Hub = dataclasses.field(default_factory=Hub)
    live: LiveRuns = dataclasses.field(default_factory=LiveRuns)
    isolation: Isolation = Isolation(False, "agents are not isolated (no bubblewrap probe was made)")
    cgroups: Cgroups = NO_CGROUPS
    versions: dict[str, str | None] = dataclasses.field(default_factory=dict)   # a CLI's --version, by profile
    cron_watch: CronWatch = dataclasses.field(default_factory=CronWatch)
    disk: DiskWatch = dataclasses.field(default_factory=DiskWatch)
    refs: Refs = dataclasses.field(default_factory=Refs)
    metrics: Metrics = dataclasses.field(default_factory=Metrics)   # GET /metrics: this appliance's registry
    writer: GroupCommit = None   # type: ignore[assignment]   # one per store; kept by dataclasses.replace
    mirrors: Mirrors = None      # type: ignore[assignment]   # one per data dir; kept by dataclasses.replace
    housekeeping: trio.Lock = dataclasses.field(default_factory=trio.Lock)   # one pass at a time (docs/operations.md)

    def __post_init__(self) -> None:
        if self.writer is None:
            object.__setattr__(self, "writer", GroupCommit(self.store, self.metrics.transactions.observe))
        if self.mirrors is None:
            object.__setattr__(self, "mirrors", Mirrors(self.config.data_dir / "mirrors"))

    async def resolve_ref(self, repository: str, ref: str) -> str:
        """The commit ``ref`` names now in ``repository`` (a URL's is fetched first)."""
        return await self.refs.resolve(await self.mirrors.fetched(repository), ref)

    @functools.cached_property
    def run_token_key(self) -> bytes:
        return hashlib.sha256(b"outpost run token\0" + self.token.encode()).digest()

    @functools.cached_property
    def profiles(self) -> dict[str, AgentProfile]:
        return {a.name: a for a in self.config.agents}

    def nudge(self, actor: Actor) -> None:
        {Actor.CRON: self.cron_wake, Actor.CLAIM: self.claim_wake, Actor.NOTIFY: self.notify_wake}[actor].poke()

    async def transaction(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one store function in a transaction on the one writer thread (grouped with the
        calls that arrive while another commits); inline in tests that drive a MockClock."""
        call = functools.partial(fn, *args, **kwargs)
        if self.inline_db:
            began = time.perf_counter()
            written = self.store._alone(call)
            self.metrics.transactions.observe(time.perf_counter() - began)
        else:
            written = await self.writer.run(call)
        if disk_full(written.error) and cannot_write(written.error):
            where = self.store.dialect.database_file(self.store.database)
            self.disk.full = f"the disk{f' of {where}' if where else ' of the database'} is full ({written.error})"
            raise DiskFull(f"{self.disk.full}: nothing was changed; free space there and retry") from None
        if cannot_write(written.error):
            raise StoreUnavailable(f"the database cannot be written now ({written.error}); nothing was "
                                   "changed, retry shortly") from None
        if written.error is not None:
            raise written.error
        if written.wrote:
            self.disk.full = None
            self.hub.poke()
        if self.store.notify.take_queued():   # committed outbox rows, whoever's call queued them
            self.notify_wake.poke()
        return written.result

    async def transaction_retrying(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A store call an actor must make: waits out a locked or full database."""
        return await self.until_stored(lambda: self.transaction(fn, *args, **kwargs), fn.__name__)

    async def until_stored(self, attempt: Callable[[], Awaitable[Any]], what: str) -> Any:
        """``attempt()`` again and again while the database is locked or full. Each attempt is
        built anew, so one that reads the clock reads it when it runs, not when the stall began."""
        while True:
            try:
                return await attempt()
            except StoreUnavailable as exc:
                log.warning("%s: %s; retrying in %.0f s", what, exc.detail, STORE_RETRY_S)
                await trio.sleep(STORE_RETRY_S)

    def log_path(self, run_id: str) -> Path:
        return self.config.data_dir / "runs" / f"{run_id}.log"

    def log_files(self, run_id: str) -> tuple[Path, Path]:
        """A run's files in runs/: its log and when its lines began (LogSink)."""
        return self.log_path(run_id), log_times_path(self.log_path(run_id))

    def worktree(self, run_id: str, session_branch: str | None = None) -> Path:
        """A run's worktree: its own, or the one stable path of an Office task session (the
        runs of one agent on one task), where a CLI that finds its sessions by directory finds them."""
        if session_branch:
            return self.config.data_dir / "worktrees" / session_branch.removeprefix("outpost/")
        return self.config.data_dir / "worktrees" / run_id

    def private_dir(self, run_id: str) -> Path:
        """Files of one run the agent may read but not others (its prompt file)."""
        return self.config.data_dir / "private" / run_id

    @functools.cached_property
    def profile_digests(self) -> dict[str, str]:
        return {a.name: profile_digest(a) for a in self.config.agents}

    @functools.cached_property
    def profile_caps(self) -> dict[str, int]:
        return {a.name: a.max_running for a in self.config.agents if a.max_running}


###############################################################################
# 16. Fleet: repositories other nodes reach, logs kept in the database, the node actor.
###############################################################################

async def run_log_bytes(deps: Deps, run_id: str, offset: int = 0) -> bytes:
    """A run's log from byte ``offset`` on: this node's file or, in a fleet, the copy that the
    node that ran it keeps in the database."""
    path = deps.log_path(run_id)
    if not deps.store.dialect.ships_logs or path.exists():
        return await trio.to_thread.run_sync(read_log_bytes, path, offset) or b""
    return (await deps.transaction(deps.store.runs.stored_log, run_id))[offset:]


async def run_log(deps: Deps, run_id: str, offset: int = 0) -> tuple[str, int]:
    """A run's log as text from byte ``offset`` on, and the offset it reached (run_log_bytes)."""
    data = await run_log_bytes(deps, run_id, offset)
    return data.decode(errors="replace"), offset + len(data)


async def log_shipped(deps: Deps, run_id: str, work: Callable[[], Awaitable[Any]]) -> Any:
    """``work()``, while in a fleet the run's log goes to the database beside it (ship_log).
    What ``work`` raises comes out as itself, never inside an exception group."""
    if not deps.store.dialect.ships_logs:
        return await work()
    failure: Exception | None = None
    async with trio.open_nursery() as shipping:
        shipping.start_soon(ship_log, deps, run_id)
        try:
            result = await work()
        except Exception as exc:   # noqa: BLE001 - raised below, unwrapped
            failure = exc
        shipping.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return result


async def ship_log(deps: Deps, run_id: str) -> None:
    """A fleet: what the run's log file gained, into the database every LOG_SHIP_S, so any
    node serves the live log. Ends when cancelled (finish_run stores the final log)."""
    shipped = 0
    while True:
        await trio.sleep(LOG_SHIP_S)
        data = await trio.to_thread.run_sync(read_log_bytes, deps.log_path(run_id), shipped)
        if data:
            await deps.transaction_retrying(deps.store.runs.append_log, run_id, shipped, data)
            shipped += len(data)


async def unreachable_repositories(deps: Deps) -> list[str]:
    """docs/fleet.md: the local paths of queued runs this node cannot reach, and the URLs it could not
    fetch a moment ago (``Mirrors.leave_to_others``); their runs wait for a node that can. Paths
    are asked off the event loop and the thread left behind on cancel: a shared mount that hangs
    must stop neither the loop nor the node's shutdown."""
    def missing(paths: list[str]) -> list[str]:
        return [p for p in paths if not Path(p).is_dir()]
    queued = await deps.transaction_retrying(deps.store.runs.queued_repositories)
    paths = [r for r in queued if not is_repository_url(r)]
    urls = deps.mirrors.unreachable(r for r in queued if is_repository_url(r))   # a fetch of them failed here
    return (await trio.to_thread.run_sync(missing, paths, abandon_on_cancel=True) if paths else []) + urls


async def left_to_another_node(deps: Deps, plan: RunPlan, exc: RepositoryUnreachable) -> bool:
    """docs/fleet.md: a node of a fleet that cannot fetch a run's repository URL puts the run back in
    the queue for a node that can, and leaves that URL's runs to the others for a while. False
    when no other node is up (or the run is no longer this admission's): the run fails, with
    a reason that never counts toward a failure streak."""
    if not deps.store.dialect.fleet or not await deps.transaction_retrying(deps.store.nodes.other_nodes_up):
        return False
    deps.mirrors.leave_to_others(plan.repository)
    reason = f"node {deps.store.node} {exc}"[:ERROR_TAIL_BYTES]
    if not await deps.transaction_retrying(deps.store.runs.requeue_unstarted, plan.run_id, deps.clock.now(), reason,
                                           fence=plan.fence):
        return False
    log.getChild("run").warning("run %s: %s; left in the queue for another node", plan.run_id, reason)
    return True


async def node_actor(deps: Deps, shutdown: trio.Event) -> None:
    """A fleet (docs/fleet.md): this node's heartbeat, on the database's clock, every
    NODE_HEARTBEAT_S; and every survivor's duty: a node silent for NODE_LOST_S is lost, its
    started runs settled interrupted and its unstarted ones queued again (settle_lost_nodes), as
    soon as its heartbeat comes of age (next_loss_in), by a survivor that has been beating itself. A
    node that finds itself declared lost (a long stall, a partition) ends its own agents, whose
    runs are no longer its to settle, and comes back up; if another process took its name
    meanwhile, this one stops (``shutdown``). Ends when cancelled."""
    flog = log.getChild("fleet")
    while True:
        if (beat_gap := await deps.transaction_retrying(deps.store.nodes.node_heartbeat)) is None:
            beat_gap = math.inf   # back from a stall: not the one to judge the others' silence now
            ended = deps.live.cancel_all()
            try:
                orphans = await deps.transaction_retrying(deps.store.nodes.register_node, deps.config.max_running)
            except NodeNameTaken as exc:
                flog.error("%s: ended this process's %d agent(s); stopping", exc, ended)
                shutdown.set()
                return
            flog.error("node %s was declared lost by another node: ended its %d agent(s); up again",
                       deps.store.node, ended)
            for run_id, pid, started in orphans:
                await end_survivor(deps, run_id, pid, started)
        if live := deps.live.ids():   # a cancel sent to another node reaches this node's agent here
            for run_id in await deps.transaction_retrying(deps.store.runs.cancels_requested, live):
                deps.live.signal(run_id, "cancel")
        if settled := await deps.transaction_retrying(deps.store.nodes.settle_lost_nodes, deps.clock.now(), beat_gap):
            flog.warning("settled %d run(s) of lost node(s) interrupted: %s", len(settled), " ".join(settled))
            for run_id in settled:
                deps.settled.announce(run_id)
            deps.nudge(Actor.CLAIM)
        loss_in = await deps.transaction_retrying(deps.store.nodes.next_loss_in)
        # a beat early when another node is about to be lost: the loop's next pass settles it
        await trio.sleep(NODE_HEARTBEAT_S if loss_in is None else min(NODE_HEARTBEAT_S, max(loss_in, 0) + 0.05))


def acquire_node_name(store: Store) -> None:
    """Before a fleet node serves: its name, unless another live process holds it. One of this
    machine is known alive or ended (a predecessor killed with -9 gives way at once); one
    elsewhere is waited for, until its heartbeat is NODE_LOST_S old."""
    deadline, replacing = time.monotonic() + NODE_LOST_S + NODE_HEARTBEAT_S, None
    while holder := store.transaction(store.nodes.claim_node_name, replacing)[0]:
        alive = process_alive_here(holder)
        if alive is False:
            replacing = holder
            continue
        if alive or time.monotonic() >= deadline:
            store.close()
            raise ConfigError(f"node name {store.node!r} is held by another running process ({holder}): "
                              "give each node its own [settings] node_name")
        log.getChild("fleet").warning("node name %r is held by %s; waiting for its heartbeat to stop",
                                      store.node, holder)
        time.sleep(NODE_HEARTBEAT_S)


###############################################################################
# 17. Actors: cron, claim (+ run supervisor), recovery, notification, outbox, housekeeping.
###############################################################################

async def resolve_new_runs(deps: Deps, run_ids: list[str]) -> None:
    """Right after a claim (docs/schedules.md, "Fire lifecycle"): record the exact commit each new
    run will use (one whose fire resolved it already, skip_if_unchanged's, has it). A ref that
    does not resolve is left for the supervisor, which fails the run with the reason."""
    with contextlib.suppress(StoreUnavailable):   # the supervisor resolves what is left
        for run_id, repository, ref in await deps.transaction(deps.store.runs.unresolved_runs, run_ids):
            with contextlib.suppress(LaunchError):
                await deps.transaction(deps.store.runs.set_resolved_commit, run_id, await deps.resolve_ref(repository,
                                                                                                           ref))


async def resolve_and_admit(deps: Deps, run_ids: list[str]) -> None:
    """Fired runs: record their commits, then wake admission."""
    await resolve_new_runs(deps, run_ids)
    deps.nudge(Actor.CLAIM)


async def after_fire(deps: Deps, fired: dict[str, Any]) -> None:
    """A manual fire was committed: resolve the new run's commit and wake admission."""
    if fired["outcome"] == SlotOutcome.ADMITTED:
        await resolve_and_admit(deps, [fired["run_id"]])


async def unchanged_heads(deps: Deps, now: datetime,
                          checks: list[tuple[str, str, str]] | None = None) -> dict[str, str]:
    """skip_if_unchanged: the commit each due schedule's source_ref names now (git, before the
    claim's transaction); a run the claim admits starts from it (the fire's one resolution).
    A ref that does not resolve is left out: that fire runs and says why.
    ``checks``: the due schedules that ask for it, as read before the sleep (None: read them now)."""
    heads = {}
    if checks is None:
        checks = await deps.transaction_retrying(deps.store.schedules.unchanged_checks, now)
    for schedule_id, repository, ref in checks:
        with contextlib.suppress(LaunchError):
            heads[schedule_id] = await deps.resolve_ref(repository, ref)
    return heads


async def cron_actor(deps: Deps) -> None:
    """In: nudges (``deps.cron_wake``: a schedule or routine changed). Out: queued runs and routine wakeups,
    announced to the claim actor. One timing engine for both: sleeps until the earliest
    next fire of a schedule or a routine's schedule trigger (no polling tick), then claims
    every due slot of each kind in one transaction. Ends when cancelled. Errors: a store error ends the process."""
    clog = log.getChild("cron")
    up_since = deps.clock.now()   # a slot due before this was missed in downtime: catch_up, no alarm
    # Read while asleep, for the instant it sleeps until: the due schedules that skip_if_unchanged.
    # Then the due instant costs no read before the claim, and the claim takes only the slots due
    # by that instant (a later one waits for the next pass, which reads its checks first).
    checks, prepared_for = None, None
    # git runs beside the clock, never in the way of the next fire
    async with deps.cron_wake.rx.clone() as wake_in, trio.open_nursery() as resolving:
        while True:
            deps.cron_watch.busy("cron", deps.clock.now())
            if prepared_for is not None and deps.clock.now() - prepared_for > timedelta(seconds=CRON_ON_TIME_S):
                checks, prepared_for = None, None   # woke late (a stall, a clock step): read them for now
            heads = await unchanged_heads(deps, deps.clock.now(), checks)
            # now is read when the claim runs: after a stall its slots are late, and the dead-man says so
            queued = await deps.until_stored(lambda heads=heads, until=prepared_for: deps.transaction(
                deps.store.schedules.claim_due, deps.clock.now(), digests=deps.profile_digests, heads=heads,
                up_since=up_since, until=until), "claim_due")
            if queued:
                clog.info("claimed %d occurrence(s): %s", len(queued), " ".join(queued))
                resolving.start_soon(resolve_and_admit, deps, queued)
            try:
                fired = await deps.until_stored(lambda: deps.transaction(deps.store.routines.claim_due_routines,
                                                                         deps.clock.now()), "claim_due_routines")
            except Exception as exc:   # noqa: BLE001 - one broken routine must not stop every schedule
                clog.exception("claiming routine ticks failed; skipping the due ticks")
                fired = await deps.transaction_retrying(deps.store.routines.skip_due_routines, deps.clock.now(),
                                                        f"{type(exc).__name__}: {exc}"[:300])
            if fired:
                clog.info("fired %d routine tick(s)", fired)
                deps.nudge(Actor.CLAIM)   # their wakeups wait for the dispatcher
            upcoming, checks = await deps.transaction_retrying(deps.store.routines.next_fire_plan)
            prepared_for = upcoming
            deps.cron_watch.waiting_for = upcoming
            wake_at = deps.clock.now() + timedelta(seconds=deps.store.dialect.cron_sleep_s)
            if upcoming is not None and upcoming < wake_at:
                wake_at = upcoming
            deps.cron_watch.idle("cron")
            with trio.move_on_at(deps.clock.deadline(wake_at)):
                await wake_in.receive()
                checks, prepared_for = None, None   # nudged: a schedule changed; read them again


async def claim_actor(deps: Deps) -> None:
    """In: nudges (``deps.claim_wake``: work may be ready or a slot was freed). Out: one
    RunSettled per run (``deps.settled``).
    Owns: the runs nursery. Each pass first dispatches the Office wakeups that may be
    claimed (their runs join the queue), then admits FIFO as many runs as there are free
    slots of max_running, in one transaction. Sleeps until nudged or until a retry, self-wake or cooldown comes due.
    Ends when cancelled; run supervisors then end their processes and record it."""
    async with deps.claim_wake.rx.clone() as wake_in, trio.open_nursery() as runs:
        while True:
            deps.cron_watch.busy("claim", deps.clock.now())
            await dispatch_wakeups(deps)
            unreachable = await unreachable_repositories(deps) if deps.store.dialect.fleet else []
            if deps.store.dialect.fleet and (supervised := deps.live.ids()):   # a pause sent through another node
                for run_id in await deps.transaction_retrying(deps.store.runs.pauses_recorded, supervised):
                    deps.live.signal(run_id, "pause")
            for run_id, is_resume in await deps.transaction_retrying(
                    deps.store.runs.admit_ready, deps.config.max_running, deps.clock.now(), caps=deps.profile_caps,
                    fleet_max=deps.config.fleet_max_running, unreachable=unreachable):
                if is_resume:
                    live = deps.live.get(run_id)
                    if live is not None:
                        live.resume()
                else:
                    runs.start_soon(run_supervisor, deps, run_id)
            # Asleep until nudged, or until a scheduled retry, a self-wake, a cooldown or a limit ends.
            wake_at = await deps.transaction_retrying(deps.store.office.next_admission_at, deps.clock.now())
            if deps.store.dialect.claim_poll_s:   # another node's requests and freed slots reach this one by looking
                soon = deps.clock.now() + timedelta(seconds=deps.store.dialect.claim_poll_s)
                wake_at = min(wake_at, soon) if wake_at else soon
            deps.cron_watch.idle("claim")
            with trio.move_on_at(deps.clock.deadline(wake_at) if wake_at else math.inf):
                await wake_in.receive()


async def dispatch_wakeups(deps: Deps) -> None:
    """The Office dispatcher: claimable wakeups through process_wakeup, a batch per
    transaction, until none is left that may be claimed now; their runs join admission."""
    while True:
        try:
            queued, processed = await deps.transaction_retrying(deps.store.pipeline.dispatch_wakeups, deps.clock.now(),
                                                                deps.profiles)
        except Exception as exc:   # noqa: BLE001 - a bug in one wakeup must not stop every agent
            log.getChild("office").exception("dispatching wakeups failed; finding the wakeup that fails")
            try:   # one at a time: the batch that failed, without the wakeup that makes it fail
                queued, processed = await deps.transaction_retrying(deps.store.pipeline.dispatch_wakeups,
                                                                    deps.clock.now(),
                                                                    deps.profiles, 1)
            except Exception:   # noqa: BLE001
                failed = await deps.transaction_retrying(deps.store.pipeline.fail_first_claimable, deps.clock.now(),
                                                         f"{type(exc).__name__}: {exc}")
                log.getChild("office").error("wakeup %s failed: it could not be dispatched", failed)
                queued, processed = [], 1
        if queued:
            log.getChild("office").info("dispatched %d wakeup run(s): %s", len(queued), ", ".join(queued[:20]))
            await resolve_new_runs(deps, queued)
        if not processed:
            return


def run_workspace(deps: Deps, plan: RunPlan) -> Path:
    """Where a run works: an Office task session's one path, the path of the run a reply
    answers, or a path of its own."""
    return deps.worktree(plan.worktree_run or plan.run_id,
                         plan.result_branch if plan.office and plan.task_id else None)


def outpost_tool_server(api_url: str, folder: Path) -> ToolServer:
    """``outpost mcp`` as a run's CLI starts it: this Python in isolated mode (``-I``: no
    PYTHONPATH or user site a project's config could set), this outpost.py."""
    return ToolServer(sys.executable, ("-I", str(OUTPOST_PY), "mcp"), api_url, folder)


#: The most of a CLI config file Outpost reads to learn the MCP servers it names.
CONFIG_READ_BYTES = 1 << 20


def config_servers(path: Path) -> dict[str, Any]:
    """The ``mcp_servers`` table of a Codex config file, read as a regular file only (never
    through a link, a FIFO or a device a repository could leave there) and at most
    CONFIG_READ_BYTES; {} for anything else, or what does not parse (Codex refuses it itself)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        data = f.read(CONFIG_READ_BYTES + 1)
    try:
        servers = tomllib.loads(data.decode()).get("mcp_servers", {}) if len(data) <= CONFIG_READ_BYTES else {}
    except (ValueError, RecursionError):
        return {}
    return servers if isinstance(servers, dict) else {}


#: Where an admin installs Gemini CLI's settings for Outpost's runs when the daemon is not root
#: (Gemini reads system settings only from a file root owns: ``outpost gemini-settings``).
GEMINI_SETTINGS_INSTALLED = Path("/etc/outpost/gemini-settings.json")


def root_owned(path: Path) -> bool:
    """Whether ``path`` and every folder above it belong to root and only root may write them."""
    try:
        return all((st := p.stat()).st_uid == 0 and not st.st_mode & 0o022 for p in (path, *path.parents))
    except OSError:
        return False


def tool_server(api_url: str, private: Path, cwd: Path, workspace: Path) -> ToolServer:
    """Outpost's MCP server for one run (docs/agent-clis.md): ``outpost mcp`` in isolated mode
    (``python -I``: no PYTHONPATH a project's config could set), the MCP servers Codex's config
    files name (disabled for the run), and Gemini CLI's system settings, written into the run's
    private folder when the daemon is root, else the file an admin installed; LaunchError when
    Gemini would not read it (it would run without the tools and the agent could not act). It
    reads files the agent wrote: run it off the event loop."""
    server = outpost_tool_server(api_url, private)
    user = Path(os.environ.get("CODEX_HOME") or Path.home() / ".codex") / "config.toml"
    configs = [user, *(d / ".codex" / "config.toml" for d in (cwd, *cwd.parents) if d.is_relative_to(workspace))]
    others = [(name, "" if config == user else "url" if isinstance(entry, dict) and "url" in entry else "command")
              for config in configs for name, entry in config_servers(config).items()]
    settings = private / "gemini-system-settings.json"
    if os.geteuid() != 0:
        settings = GEMINI_SETTINGS_INSTALLED
    return dataclasses.replace(server, others=tuple(dict.fromkeys(others)), system_settings=settings)


async def wire_tools(profile: AgentProfile, argv: list[str], env: dict[str, str],
                     server: ToolServer) -> tuple[list[str], dict[str, str]]:
    """The run's command line and env with Outpost's MCP server, its files written first."""
    wiring = profile.kind.tools(argv, server)
    files = dict(wiring.files)
    if wiring.system_settings is not None and server.system_settings.parent == server.folder:
        files[server.system_settings.name] = json.dumps(wiring.system_settings)
    elif wiring.system_settings is not None:
        await trio.to_thread.run_sync(check_installed_settings, server.system_settings, wiring.system_settings)
    for name, text in files.items():
        (server.folder / name).parent.mkdir(parents=True, exist_ok=True)
        (server.folder / name).write_text(text)
    return wiring.argv, env | wiring.env


def check_installed_settings(path: Path, wanted: dict[str, Any]) -> None:
    """A daemon that is not root runs Gemini CLI with the settings file an admin installed: it
    must be root's and say what ``outpost gemini-settings`` says now, else the run fails saying how."""
    fix = f"install it once as root: `outpost gemini-settings | sudo install -D -m 0644 /dev/stdin {path}`"
    if not root_owned(path):
        raise LaunchError(f"Gemini CLI takes Outpost's tools only from a settings file root owns; {fix}")
    try:
        installed = json.loads(path.read_text())
    except (OSError, ValueError):
        installed = None
    if installed != wanted:
        raise LaunchError(f"{path} is not what this Outpost needs (another install, or an older one); {fix}")


def run_sandbox(deps: Deps, plan: RunPlan) -> Sandbox | None:
    """The run's sandbox (docs/security.md), or None when agents are not isolated."""
    if not deps.isolation.active:
        return None
    home = os.environ.get("HOME")
    state = plan.profile.kind.home_state if plan.profile is not None else None
    return Sandbox(deps.config.data_dir, run_workspace(deps, plan), Path(deps.mirrors.path(plan.repository)),
                   deps.private_dir(plan.run_id), Path(home) if home else None, (state,) if state else (),
                   plan.profile.tmp_mb if plan.profile is not None else SANDBOX_TMP_MB, deps.cgroups,
                   plan.profile.caps if plan.profile is not None else ResourceCaps(), deps.isolation.no_userns)


async def take_over(repository: str, branch: str, left_on: str, head: str) -> str:
    """An Office task changed hands: its new agent starts where the task was left, the head of
    ``left_on`` (the previous agent's branch); its own ``branch`` is moved there when it is new
    or behind. A branch of its own with work the other one lacks is kept as it is."""
    left = await git(repository, "rev-parse", "--verify", "--quiet", f"refs/heads/{left_on}", check=False)
    if not left or left == head:
        return head
    if head and await git(repository, "merge-base", head, left, check=False) != head:
        log.getChild("run").warning("branch %s has work %s lacks: not taken over", branch, left_on)
        return head
    await git(repository, "update-ref", f"refs/heads/{branch}", left)
    return left


async def prepare_worktree(deps: Deps, plan: RunPlan, workspace: Path) -> str:
    """The run's worktree, and the commit it starts from: a fresh branch from the commit its
    fire recorded (``source_ref`` is resolved here only when none was: see RunPlan), or, for a
    run that continues a branch (an Office task session, a reply), that branch's head, on a
    fresh worktree of it. The branch is made in the repository now; the agent's commits reach
    it when the run settles (bring_back)."""
    repository, branch = await deps.mirrors.fetched(plan.repository), plan.result_branch
    head = (await git(repository, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", check=False)
            if plan.continues_branch and Path(repository).is_dir() else "")
    if plan.handover_branch and Path(repository).is_dir() and not workspace.exists():
        head = await take_over(repository, branch, plan.handover_branch, head)
    if not head:   # most runs' commit was recorded when they were queued: nothing to write
        commit = plan.resolved_commit or await deps.transaction_retrying(
            deps.store.runs.set_resolved_commit, plan.run_id, await deps.refs.resolve(repository, plan.source_ref))
        await concurrently(   # the run's own branch (a retried start redoes it), and its worktree
            functools.partial(git, repository, "update-ref", f"refs/heads/{branch}", commit),
            functools.partial(add_worktree, repository, commit, branch, workspace))
        return commit
    commit = await deps.transaction_retrying(deps.store.runs.set_resolved_commit, plan.run_id, head)
    if workspace.exists():   # kept by an earlier run of the session (its changes could not be saved)
        on = (await git(workspace, "rev-parse", "--abbrev-ref", "HEAD", check=False, sandbox=run_sandbox(deps, plan))
              if worktree_intact(workspace) else "")
        if on != branch:
            raise LaunchError(f"{workspace} exists and is not a worktree of {branch}; remove it")
        return commit
    await add_worktree(repository, head, branch, workspace)
    return commit


async def agent_version(deps: Deps, profile: AgentProfile, env: dict[str, str],
                        sandbox: Sandbox | None) -> str | None:
    """The version of a profile's CLI, asked once per process (for the agent report), in the run's
    sandbox: the CLI reads the state folders that agents write."""
    if profile.name not in deps.versions:
        binary = shutil.which(profile.command[0], path=env.get("PATH", os.defpath)) or profile.command[0]
        argv = [binary, *profile.kind.version[1:]]
        deps.versions[profile.name] = await trio.to_thread.run_sync(
            cli_version, sandbox.argv(argv) if sandbox else argv, env)
    return deps.versions[profile.name]


def login_hint(profile: AgentProfile) -> str:
    """What the ``agent_auth`` item tells a human to do, and as which user."""
    import getpass
    how = profile.kind.login or "log the agent's CLI in"
    return (f"Log in as user {getpass.getuser()} (HOME={os.environ.get('HOME', '?')}): {how}. Then resume "
            f"the profile on the Agents page, or POST /v1/outpost/agents/{profile.name}/control "
            '{"action": "resume"}.')


def run_plan(deps: Deps, row: dict[str, Any]) -> RunPlan:
    """The plan of the run whose row ``launch_info`` read, made once: every step of its start and
    settlement reads it."""
    return RunPlan.of(row, deps.config.agent(row["agent"]))


async def run_supervisor(deps: Deps, run_id: str) -> None:
    """One run, from worktree to settlement. Its failures settle the run as failed. When
    cancelled (shutdown), the process group is ended and the run recorded ``interrupted``
    before the cancellation goes on."""
    rlog = log.getChild("run")
    live = LiveRun(run_id, trio.CancelScope(), clock=deps.clock.now)
    deps.live.add(live)   # before the read: a pause recorded from now on reaches it, one before is read
    try:
        row = await deps.transaction_retrying(deps.store.runs.launch_info, run_id)
    except trio.Cancelled:   # the daemon stopped between its admission and its start: nothing ran
        deps.live.discard(run_id)
        with trio.move_on_after(CLEANUP_S, shield=True):
            await deps.transaction_retrying(deps.store.runs.requeue_unstarted, run_id, deps.clock.now(),
                                            "the daemon stopped before it started")
        raise
    deps.metrics.observe_start(row)
    plan = run_plan(deps, row)
    if plan.paused:   # paused between its admission and now
        live.pause()
    workspace = run_workspace(deps, plan)
    made_here = not workspace.exists()   # else kept by an earlier run of its session, with its changes
    commit, settled, exit_code = plan.resolved_commit, False, None
    try:
        try:
            profile = plan.profile
            if profile is None:
                raise LaunchError(f"agent profile {plan.agent!r} is not configured")
            commit = await prepare_worktree(deps, plan, workspace)
            live.step("worktree_ready")
            cwd = (workspace / plan.workdir).resolve()
            if not cwd.is_relative_to(workspace.resolve()):   # a symlink in the tree pointing elsewhere
                raise LaunchError(f"workdir {plan.workdir!r} leads outside the worktree (a symlink); refused")
            if not cwd.is_dir():
                raise LaunchError(f"workdir {plan.workdir!r} does not exist in commit {commit[:12]}")
            private = deps.private_dir(run_id)
            private.mkdir(parents=True, exist_ok=True, mode=0o700)
            (private / "prompt.md").write_text(plan.prompt)
            argv = profile_argv(profile, model=plan.model, run_id=run_id, session_id=plan.session_id,
                                prompt_file=str(private / "prompt.md"), max_cost_usd=plan.max_cost_usd)
            env = agent_env(profile, dict(os.environ), run_id)
            if profile.kind.tools is not None:   # Outpost's own tools, its MCP server (docs/agent-clis.md)
                server = await trio.to_thread.run_sync(tool_server, deps.api_url, private, cwd, workspace)
                argv, env = await wire_tools(profile, argv, env, server)
            if sandbox := run_sandbox(deps, plan):
                await trio.to_thread.run_sync(sandbox.make_home_state)
                argv, env["TMPDIR"] = sandbox.argv(argv, cwd), "/tmp"
                if sandbox.home is not None:
                    env.setdefault("CLAUDE_CONFIG_DIR", str(sandbox.home / ".claude"))
            env |= {RUN_TOKEN_ENV: run_token(deps.run_token_key, run_id), API_URL_ENV: deps.api_url}
            if plan.office:   # the agent acts on Office through the run-scoped token
                env["OUTPOST_TASK_ID"] = plan.task_id or ""
            rlog.info("run %s starting %s in %s%s", run_id, profile.name, cwd, " (resumed)" if plan.session_id else "")

            async def on_spawn(pid: int) -> None:
                if not await deps.transaction_retrying(deps.store.runs.mark_spawned, run_id, pid,
                                                       process_start_time(pid), plan.fence, dict(live.steps)):
                    rlog.warning("run %s is no longer this node's (declared lost): ending its agent", run_id)
                    live.cancel()

            async with deps.cgroups.hold(profile.caps) as held:
                done = await log_shipped(deps, run_id, functools.partial(
                    run_agent_process, argv, cwd=cwd, env=env, stdin_text=plan.prompt,
                    timeout_s=plan.timeout_seconds, log_path=deps.log_path(run_id), now=deps.clock.now, live=live,
                    on_spawn=on_spawn, grace_s=deps.grace_s, held=held))
                cap_met = held.met()
            exit_code = done.exit_code
            reading = await trio.to_thread.run_sync(profile.kind.read, done.lines)   # off the event loop
            if reading.agent_version is None and profile.kind.version:   # a CLI that does not print it
                reading.agent_version = await agent_version(deps, profile, env, sandbox)
            outcome = capped(run_outcome(reading, done.exit_code, done.stderr_tail, timed_out=done.timed_out,
                                         cancelled=live.cancelled, now=deps.clock.now(), tz=profile.zone), cap_met)
        except (LaunchError, OSError) as exc:   # OSError: a file of the run (worktree, prompt) cannot be made
            if isinstance(exc, RepositoryUnreachable) and await left_to_another_node(deps, plan, exc):
                settled = True   # nothing ran: back in the queue, not settled
                return
            unavailable = isinstance(exc, RepositoryUnavailable)
            reason = str(exc) if isinstance(exc, LaunchError) else f"cannot prepare the run's files: {exc}"
            outcome = failed(f"{REPOSITORY_UNAVAILABLE}: {exc}" if unavailable else reason, "launch")
            with contextlib.suppress(LaunchError):
                sink = LogSink(deps.log_path(run_id), deps.clock.now)
                sink.write(f"[outpost] {reason}\n".encode())
                sink.close()
        await finish_run(deps, plan, commit, outcome, exit_code, live.steps)
        settled = True
    finally:
        deps.live.discard(run_id)
        try:
            remove_tree(deps.private_dir(run_id))
        except OSError as exc:
            rlog.warning("run %s: its private folder could not be removed: %s", run_id, exc)
        if not settled:
            with trio.move_on_after(CLEANUP_S, shield=True):
                if made_here and "worktree_ready" not in live.steps:   # stopped while making it: no agent ran
                    with contextlib.suppress(OSError):                 # there, so nothing is to be saved
                        await trio.to_thread.run_sync(remove_tree, workspace)
                await finish_run(deps, plan, commit, failed(INTERRUPTED, "interrupted"), None, live.steps)


async def finish_run(deps: Deps, plan: RunPlan, commit: str | None, outcome: Outcome, exit_code: int | None,
                     steps: dict[str, str] | None = None) -> None:
    """A run's end (docs/schedules.md, "Fire lifecycle"): keep leftovers, bring the result branch
    back, count commits, drop the worktree, record settlement. ``steps``: the launch's steps its
    supervisor saw (``run_steps``), settled with it and branch_back added; None after a restart
    (those recorded stay)."""
    run_id = plan.run_id
    workspace, sandbox = run_workspace(deps, plan), run_sandbox(deps, plan)
    local = deps.mirrors.path(plan.repository)
    kept, kept_title, back_at, saved = None, "uncommitted changes kept in its worktree", None, True
    try:
        if workspace.exists() and not worktree_intact(workspace):
            raise LaunchError("the agent replaced the worktree's .git, so git would work on another repository; "
                              "nothing was brought back")
        saved = await save_leftovers(workspace, run_id, sandbox)
        if workspace.exists() and Path(local).is_dir():
            await bring_back(local, workspace, plan.result_branch, commit, sandbox)
            back_at = deps.clock.now()
    except (LaunchError, OSError) as exc:   # the edits stay where they are: never deleted, never called a success
        full = "the disk is full, so " if disk_full(exc) else ""
        kept = f"{full}the agent's changes could not be saved ({exc}); they are kept in {workspace}"
    try:
        commits = await count_commits(local, commit, plan.result_branch) if commit else 0
    except LaunchError as exc:   # git could not start (the machine's processes at their limit): kept, uncounted
        commits = 0
        kept = kept or f"the run's commits could not be counted ({exc}); its worktree is kept in {workspace}"
    if kept is None:
        try:
            # after a restart (no steps) processes the agent left may live until the cgroups' sweep
            await remove_worktree(workspace, sandbox, seen_clean=not saved and steps is not None)
        except (LaunchError, OSError) as exc:   # what the agent left there cannot be removed: the daemon serves on
            kept = f"the run's worktree could not be removed ({exc}); what is left is in {workspace}"
            kept_title = "its worktree could not be removed"
    if kept is not None:
        log.getChild("run").warning("run %s: %s", run_id, kept)
        outcome = failed(kept, "agent", outcome.reading)
    unpushed = None
    if commits and is_repository_url(plan.repository):   # docs/fleet.md: the result goes back where it came from
        try:
            await deps.mirrors.push(plan.repository, plan.result_branch)
            back_at = deps.clock.now()
        except LaunchError as exc:
            unpushed = (f"git push of {plan.result_branch} to {plan.repository} failed: {exc}\n"
                        f"The branch is kept in {local}; push it from there, or fix the access and re-run.")
            log.getChild("run").warning("run %s: %s", run_id, unpushed.splitlines()[0])
    if deps.store.dialect.ships_logs and (
            ended := await trio.to_thread.run_sync(read_log_bytes, deps.log_path(run_id))):
        await deps.transaction_retrying(deps.store.runs.replace_log, run_id, ended)   # as it ended, for every node
    # An empty result branch goes (docs/operations.md), before settling: a settled run is done.
    if (kept is None and not commits and commit and not plan.continues_branch
            and outcome.status != RunStatus.NEEDS_YOU):
        await drop_branch_of(run_id, local, plan.result_branch, commit)
    if steps is not None and commits and unpushed is None and back_at is not None:
        steps = {**steps, "branch_back": instant_ms(back_at)}   # where its user fetches it: the mirror, or pushed
    now = deps.clock.now()
    hint = login_hint(plan.profile) if plan.profile else ""
    settled = await deps.transaction_retrying(deps.store.runs.settle_run, run_id, outcome, now, exit_code=exit_code,
                                              commits=commits, auth_hint=hint, fence=plan.fence if plan.node else None,
                                              steps=steps)
    if unpushed is not None:
        await deps.transaction_retrying(deps.store.raise_attention, "push_failed",
                                        f"Run {run_id}: its result branch was not pushed", unpushed, now,
                                        schedule_id=plan.schedule_id, run_id=run_id)
    if kept is not None:
        await deps.transaction_retrying(deps.store.raise_attention, "worktree_kept",
                                        f"Run {run_id}: {kept_title}", kept, now,
                                        schedule_id=plan.schedule_id, run_id=run_id)
    log.getChild("run").info("run %s settled %s%s", run_id, outcome.status,
                             f" ({outcome.error})" if outcome.error else "")
    if settled:
        deps.settled.announce(run_id)
    deps.nudge(Actor.CLAIM)


async def drop_empty_branch(deps: Deps, run_id: str) -> bool:
    """docs/operations.md: a settled run's result branch goes when it carries no work (its
    ``result_branch`` still names it; ``changes.commits`` 0 says it was empty). ``finish_run``
    drops a run's empty branch before it settles; this, when a ``needs_you`` item is
    acknowledged. Whether a branch was deleted."""
    found = await deps.transaction_retrying(deps.store.runs.empty_branch, run_id)
    if found is None:
        return False
    repository, branch, commit = found
    return await drop_branch_of(run_id, deps.mirrors.path(repository), branch, commit)


async def drop_branch_of(run_id: str, local: str, branch: str, commit: str) -> bool:
    dropped = await drop_branch(local, branch, commit)
    if dropped:
        log.getChild("run").info("run %s: empty result branch %s deleted", run_id, branch)
    return dropped


async def recover_at_boot(deps: Deps) -> None:
    """docs/schedules.md: a run that was running when the daemon died is settled failed/interrupted
    (its process group ended first if it is still the same process); queued runs stay
    queued and start normally; half-done idempotent requests are forgotten."""
    rlog = log.getChild("recovery")
    forgotten = await deps.transaction_retrying(deps.store.access.forget_in_flight)
    if forgotten:
        rlog.info("forgot %d in-flight idempotency key(s) of the previous process", forgotten)
    for run_id, pid, started in await deps.transaction_retrying(deps.store.nodes.register_node,
                                                                deps.config.max_running):
        await end_survivor(deps, run_id, pid, started)   # settled by another node: not ours to settle
    for run_id in await deps.transaction_retrying(deps.store.runs.own_runs_in,
                                                  [RunStatus.RUNNING, RunStatus.PAUSED]):
        plan = run_plan(deps, await deps.transaction_retrying(deps.store.runs.launch_info, run_id))
        await end_survivor(deps, run_id, plan.pid, plan.pid_started)
        await finish_run(deps, plan, plan.resolved_commit, failed(INTERRUPTED, "interrupted"), None)
    await deps.cgroups.sweep()   # what its survivors were held in


async def recovery_actor(deps: Deps, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Boot reconciliation, then Office maintenance every 5 minutes (the recovery sweep of
    unstarted assigned tasks) and hourly hygiene (expired idempotency keys). Reports
    started once the store is consistent, so admission begins only after it."""
    await recover_at_boot(deps)
    task_status.started()
    purge_at = trio.current_time() + HOUR_S
    while True:
        if dispatched := await deps.transaction_retrying(deps.store.routines.recovery_sweep, deps.clock.now()):
            log.getChild("recovery").info("recovery sweep dispatched %d unstarted task(s)", dispatched)
            deps.nudge(Actor.CLAIM)
        if trio.current_time() >= purge_at:
            await deps.transaction_retrying(deps.store.access.purge_expired, deps.clock.now())
            purge_at += HOUR_S
        await trio.sleep(RECOVERY_SWEEP_S)


def file_bytes(paths: Iterable[Path], *, remove: bool) -> int:
    """The size of these files (those that exist), removed with ``remove``."""
    total = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            total += path.lstat().st_size
            if remove:
                path.unlink()
    return total


async def outpost_branches(local: str) -> dict[str, str]:
    """Every ``outpost/`` branch of a repository and its tip, in one git call."""
    if not Path(local).is_dir():
        return {}
    out = await git(local, "for-each-ref", "--format=%(refname:strip=2) %(objectname)", "refs/heads/outpost/",
                    check=False)
    return dict(line.rsplit(" ", 1) for line in out.splitlines() if " " in line)


async def merged_branch(deps: Deps, run: dict[str, Any], heads: dict[str, dict[str, str]]) -> tuple[str, str] | None:
    """(local repository, tip) of a run's result branch when its commits are already in the
    run's ``source_ref`` (``git merge-base --is-ancestor``), else None: work nobody merged is
    never deleted. None too when the branch is gone or the repository cannot be read.
    ``heads``: the ``outpost/`` branches of each repository, read once per pass."""
    local, branch = deps.mirrors.path(run["repository"]), run["result_branch"]
    if run["source_ref"] is None or not branch.startswith("outpost/"):
        return None
    if local not in heads:
        heads[local] = await outpost_branches(local)
    tip = heads[local].get(branch)
    if not tip:
        return None
    try:
        base = await deps.refs.resolve(local, run["source_ref"])
        await git(local, "merge-base", "--is-ancestor", tip, base)   # exit 1: not merged
    except LaunchError:
        return None
    return local, tip


async def housekeeping_pass(deps: Deps, keep_days: int, *, dry_run: bool) -> dict[str, Any]:
    """docs/operations.md: settled runs older than ``keep_days`` go with their logs, events and Office facts,
    and their result branch when its commits are in ``source_ref``; then old events, ledger rows
    (each schedule's newest LEDGER_KEEP stay), finished wakeups, refused deliveries, sent or given-up
    notifications and expired
    Idempotency-Keys; then the database gives its space back. Each transaction deletes a bounded
    batch, and the loop yields between them, so cron and claim wait a few milliseconds at most.
    ``dry_run``: the same counts, nothing deleted. The caller holds ``deps.housekeeping``."""
    hk, now = deps.store.housekeeping, deps.clock.now()
    cutoff = now - timedelta(days=keep_days)
    counts: dict[str, Any] = {"dry_run": dry_run, "runs": 0, "log_bytes": 0, "events": 0, "wakeups": 0,
                              "deliveries": 0, "branches": 0,
                              "database_bytes_before": await deps.transaction_retrying(hk.database_bytes)}
    after, seen, heads = "", set(), {}
    while batch := await deps.transaction_retrying(hk.old_runs, cutoff, after, HOUSEKEEPING_RUNS):
        after = batch[-1]["id"]
        in_use = set(await deps.transaction_retrying(hk.branches_in_use, sorted({r["result_branch"] for r in batch}),
                                                     cutoff))
        merged: dict[tuple[str, str], tuple[str, set[str]]] = {}
        for run in batch:
            key = (deps.mirrors.path(run["repository"]), run["result_branch"])
            if key in merged:
                merged[key][1].add(run["id"])
            elif (run["result_branch"] not in in_use and key not in seen
                  and (found := await merged_branch(deps, run, heads))):
                merged[key] = (found[1], {run["id"]})
        seen |= merged.keys()
        if dry_run:
            counts["runs"] += len(batch)
            counts["branches"] += len(merged)
            counts["log_bytes"] += await trio.to_thread.run_sync(functools.partial(
                file_bytes, [p for r in batch for p in deps.log_files(r["id"])], remove=False))
            continue
        gone, chunk_bytes = await deps.transaction_retrying(hk.delete_runs, [r["id"] for r in batch], cutoff)
        counts["runs"] += len(gone)
        counts["log_bytes"] += chunk_bytes + await trio.to_thread.run_sync(functools.partial(
            file_bytes, [p for run_id in gone for p in deps.log_files(run_id)], remove=True))
        for (local, branch), (tip, runs) in merged.items():
            if runs & set(gone) and await drop_branch(local, branch, tip):
                counts["branches"] += 1
        await trio.sleep(0)
    for what in ("events", "occurrences", "wakeups", "deliveries", "notifications"):
        if dry_run:
            counts[what] = await deps.transaction_retrying(hk.count_history, what, cutoff)
            continue
        counts[what] = 0
        while went := await deps.transaction_retrying(hk.delete_history, what, cutoff):
            counts[what] += went
            await trio.sleep(0)
    occurrences = counts.pop("occurrences")
    counts["deliveries"] += counts.pop("notifications")   # deliveries: refused webhooks and sent notifications
    if not dry_run:
        await deps.transaction_retrying(deps.store.access.purge_expired, now)
        left = None
        while (now_left := await deps.transaction_retrying(hk.give_back_space)) and now_left != left:
            left = now_left
            await trio.sleep(0)
    counts["database_bytes_after"] = await deps.transaction_retrying(hk.database_bytes)
    if not dry_run:
        await deps.transaction_retrying(hk.finished, counts, keep_days, deps.clock.now())
    log.getChild("housekeeping").info(
        "housekeeping%s (keep_days %d): %d run(s), %d log byte(s), %d event(s), %d ledger row(s), %d wakeup(s), "
        "%d refused deliveries, %d branch(es); database %d -> %d bytes", " (dry run)" if dry_run else "", keep_days,
        counts["runs"], counts["log_bytes"], counts["events"], occurrences, counts["wakeups"], counts["deliveries"],
        counts["branches"], counts["database_bytes_before"], counts["database_bytes_after"])
    return counts


async def housekeeping_actor(deps: Deps) -> None:
    """In: nothing but time. Out: a housekeeping pass (``housekeeping_pass``) with the configured
    ``keep_days`` HOUSEKEEPING_FIRST_S after the start and then once a day. Owns nothing; a pass
    asked for over the API at the same moment goes first. Ends when cancelled; a database that
    is locked or full is waited out; a repository git cannot read keeps its branches."""
    await trio.sleep(HOUSEKEEPING_FIRST_S)
    while True:
        async with deps.housekeeping:
            await housekeeping_pass(deps, deps.config.keep_days, dry_run=False)
        await trio.sleep(HOUSEKEEPING_EVERY_S)


async def notification_actor(deps: Deps) -> None:
    """In: RunSettled (``deps.settled``). Out: failure streak, auto-pause and attention items (in the store).
    Applies every settled run exactly once (the run's ``notified`` flag), including runs
    that settled before a crash. Ends when its channel closes or it is cancelled."""
    async with deps.settled.rx.clone() as settled_in:
        while True:
            # Every settled run not yet applied, not only the one announced: a message
            # dropped on a full channel, or lost in a crash, costs latency, never an item.
            for run_id in await deps.transaction_retrying(deps.store.runs.unnotified_runs):
                await deps.transaction_retrying(deps.store.schedules.notify_run, run_id, deps.clock.now())
                deps.nudge(Actor.CRON)   # an auto-pause changes what the cron actor waits for
            with trio.move_on_after(NOTIFY_SWEEP_S):
                try:
                    await settled_in.receive()
                except trio.EndOfChannel:
                    return


def send_notification(url: str, title: str, body: str) -> str | None:
    """Send one message with Apprise (blocking: a worker thread's). None when the receiver took
    it, else why not: Apprise reports a failure in its log only, so the log is captured."""
    import apprise  # noqa: PLC0415 - 0.15 s to import: only with [[notify]] entries

    with apprise.LogCapture(level=apprise.logging.WARNING, fmt="%(message)s") as captured:
        target = apprise.Apprise.instantiate(url, suppress_exceptions=True)
        if target is not None and target.notify(body=body, title=title):
            return None
    lines = [line for line in captured.getvalue().splitlines() if line.strip()]
    return lines[-1][:1000] if lines else "the receiver did not accept the message"


def channel_call(url: str, payload: dict[str, Any] | None, token: str | None = None,
                 timeout_s: float = NOTIFY_SEND_TIMEOUT_S) -> tuple[dict[str, Any] | None, str | None]:
    """POST JSON to a Slack or Telegram API method (None: GET, its arguments in the URL) in a
    worker thread: (its answer, None), or (None, why not). Both answer ``{"ok": false, ...}``
    for a refusal, often with HTTP 200; a 429 names when to come back."""
    headers = {"Content-Type": "application/json; charset=utf-8"} if payload is not None else {}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, json.dumps(payload).encode() if payload is not None else None, headers,
                                     method="POST" if payload is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:   # noqa: S310 - an http(s) setting
            reply = json.loads(response.read(1 << 20) or b"{}")
    except urllib.error.HTTPError as exc:
        with contextlib.suppress(ValueError, OSError):
            refusal = json.loads(exc.read(1 << 20) or b"{}")
            if isinstance(refusal, dict) and refusal.get("ok") is False:
                wait = exc.headers.get("Retry-After") or (refusal.get("parameters") or {}).get("retry_after")
                return None, (f"HTTP {exc.code}: {refusal.get('error') or refusal.get('description')}"
                              + (f" (retry after {wait} s)" if wait else ""))
        return None, f"HTTP {exc.code} {exc.reason}"
    except (OSError, ValueError, http.client.HTTPException) as exc:   # its text may hold the URL: the caller redacts
        return None, f"{type(exc).__name__}: {exc}"[:500]
    if not isinstance(reply, dict) or reply.get("ok") is not True:
        why = reply.get("error") or reply.get("description") if isinstance(reply, dict) else None
        return None, f"refused: {why or 'no ok in the answer'}"
    return reply, None


def send_channel_message(config: Config, entry: ChannelEntry, text: str) -> str | None:
    """One message to a channel: Slack ``chat.postMessage`` with the bot token, Telegram
    ``sendMessage``; a text longer than the service takes is cut, saying so. None when sent."""
    limit = CHANNEL_TEXT_MAX[entry.kind]
    if len(text) > limit:
        text = text[:limit - 40].rstrip() + "\n[cut: the full comment is on the task]"
    if entry.kind == "slack":   # Slack reads & < > as markup (<!channel> pings everyone): escaped
        text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        _, error = channel_call(f"{config.slack_api_url}/chat.postMessage", {"channel": entry.channel, "text": text},
                                entry.bot_token)
    else:
        _, error = channel_call(f"{config.telegram_api_url}/bot{entry.bot_token}/sendMessage",
                                {"chat_id": entry.channel, "text": text})
    return error.replace(entry.bot_token, "<bot token>") if error else None


def slack_user_name(config: Config, entry: ChannelEntry, user_id: str) -> str:
    """A Slack user's display name (``users.info``, scope users:read), else the real name, else
    the id; asked within a second, as Slack waits 3 s for the event's answer."""
    reply, _ = channel_call(f"{config.slack_api_url}/users.info?user={urllib.parse.quote(user_id)}", None,
                            entry.bot_token, timeout_s=1.0)
    user = (reply or {}).get("user")
    user = user if isinstance(user, dict) else {}
    profile = user.get("profile") if isinstance(user.get("profile"), dict) else {}
    for name in (profile.get("display_name"), profile.get("real_name"), user.get("real_name")):
        if isinstance(name, str) and name.strip():
            return plain_text(name.strip())[:100]
    return user_id


def within_real_time(work: Callable[[], str | None], timeout_s: float) -> str | None:
    """``work()`` in a daemon thread of its own, given ``timeout_s`` real seconds (a socket
    that hangs past Apprise's own timeouts); then its answer, or why there is none. Real
    time, not trio's: the send waits on a receiver, whatever clock drives the actors."""
    told: list[str | None] = []
    done = threading.Event()

    def run() -> None:
        try:
            told.append(work())
        except Exception as exc:   # a plugin's bug is this message's failure, never the actor's
            told.append(f"{type(exc).__name__}: {exc}")
        finally:
            done.set()

    threading.Thread(target=run, name="outpost-notify", daemon=True).start()
    if not done.wait(timeout_s):
        return f"no answer within {timeout_s:.0f} s"
    return told[0]


async def deliver_one(deps: Deps, row: dict[str, Any], entries: dict[str, NotifyEntry | ChannelEntry]) -> None:
    """Send one claimed outbox row, then record how it went."""
    nlog = log.getChild("notify")
    entry = entries[row["entry"]]
    if isinstance(entry, ChannelEntry):
        send = functools.partial(send_channel_message, deps.config, entry, row["body"] or "")
    else:
        base = deps.api_url.rstrip("/")
        body = "\n\n".join(part for part in (row["body"], f"{base}{row['link']}" if row["link"] else None) if part)
        send = functools.partial(send_notification, entry.url, row["title"], body or row["title"])
    error = await trio.to_thread.run_sync(within_real_time, send, NOTIFY_SEND_TIMEOUT_S + 5, abandon_on_cancel=True)
    status = await deps.transaction_retrying(deps.store.notify.finish, row["id"], error, deps.clock.now())
    if isinstance(entry, ChannelEntry):
        await deps.transaction_retrying(deps.store.channels.sent, entry.name, error, deps.clock.now())
        nlog.info("channel %s message %d: %s", entry.name, row["id"], error or "sent")
        return
    if status == NotificationStatus.DELIVERED:
        nlog.info("notification %d (%s) delivered to %s %s", row["id"], row["kind"], entry.name, entry.label)
    elif status == NotificationStatus.GIVEN_UP:
        nlog.error("notification %d (%s) to %s %s given up after %d attempts: %s", row["id"], row["kind"],
                   entry.name, entry.label, row["attempts"], error)
    else:
        nlog.warning("notification %d (%s) to %s %s failed (attempt %d), retrying: %s", row["id"],
                     row["kind"], entry.name, entry.label, row["attempts"], error)


async def outbox_actor(deps: Deps) -> None:
    """In: nudges (``deps.notify_wake``: an outbox row was committed). Out: the outbox's messages, sent one at a time
    through Apprise in a worker thread, so no other actor ever waits for a receiver. Queues each
    entry's daily digest when due. The rows are the truth: it wakes for the next retry (read from
    the store) and every OUTBOX_SWEEP_S, so a restart or a lost nudge delays, never loses. The
    entries are read at each look: one added on Settings counts from its commit."""
    async with deps.notify_wake.rx.clone() as wake_in:
        while True:
            now = deps.clock.now()
            senders = await deps.transaction_retrying(deps.store.notify.senders)
            notify = [e for e in senders.values() if isinstance(e, NotifyEntry)]
            for entry in notify:
                due = entry.digest_due(now)
                if due is not None and now - due <= timedelta(seconds=DIGEST_LATE_S):
                    await deps.transaction_retrying(deps.store.notify.queue_digest, entry, due, now)
            while row := await deps.transaction_retrying(deps.store.notify.claim_next, deps.clock.now()):
                if row["entry"] not in senders:   # added (or removed) since this look began
                    senders = await deps.transaction_retrying(deps.store.notify.senders)
                if row["entry"] not in senders:   # removed: its row waits unclaimed, as a removed entry's do
                    await deps.transaction_retrying(deps.store.notify.finish, row["id"], "its entry was removed",
                                                    deps.clock.now())
                    continue
                await deliver_one(deps, row, senders)
            now = deps.clock.now()
            wake = [now + timedelta(seconds=OUTBOX_SWEEP_S)]
            if (due := await deps.transaction_retrying(deps.store.notify.next_due)) is not None:
                wake.append(due)
            wake += [d + timedelta(days=1) for e in notify if (d := e.digest_due(now)) is not None]
            with trio.move_on_at(deps.clock.deadline(min(wake))):
                try:
                    await wake_in.receive()
                except trio.EndOfChannel:
                    return


###############################################################################
# 18. Web: requests: the route tables, the request a handler sees, authentication,
#     idempotency, errors and security headers.
###############################################################################

LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")
#: The dashboard's session cookie (HttpOnly, SameSite=Strict).
SESSION_COOKIE = "outpost_session"
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
#: No inline script or style, no framing, forms post only here.
CSP = "default-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'; object-src 'none'"
#: Paths of the JSON APIs: their errors are always problem+json.
API_PREFIXES = ("/v1/", "/api/")
#: Methods that change nothing: no CSRF token needed.
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


def problem_response(err: OutpostError):
    from quart import Response
    headers = {"Retry-After": "5"} if isinstance(err, StoreUnavailable) else {}
    if isinstance(err, PayloadTooLarge):
        headers["Connection"] = "close"   # the unread rest of the body must not be taken for a request
    return Response(json.dumps(err.problem()), status=err.status, content_type="application/problem+json",
                    headers=headers)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None):
    from quart import Response
    return Response(json.dumps(body), status=status, content_type="application/json", headers=headers or {})


def choice_arg(args, name: str, choices: Iterable[str]) -> str | None:
    """An optional query filter that must be one of ``choices``; a 422 naming it otherwise."""
    value = args.get(name) or None
    choices = [str(c) for c in choices]
    if value is not None and value not in choices:
        raise invalid(name, "must be one of " + ", ".join(choices))
    return value


def run_filters(args, agents: Iterable[str], tz: ZoneInfo = UTC) -> dict[str, Any]:
    """The runs list's filters from a query string (docs/http-api.md), each checked: a 422 naming
    every parameter that is wrong. ``since``/``until`` are RFC 3339 instants, or dates (the
    dashboard's date boxes) read in ``tz``, ``until`` then through the end of its day."""
    errors = FieldErrors()
    found: dict[str, Any] = dict.fromkeys(("status", "agent", "trigger", "since", "until"))
    found |= {"schedule_id": args.get("schedule_id") or None, "q": (args.get("q") or "").strip() or None}
    for name, choices in (("status", RunStatus), ("agent", sorted(agents)), ("trigger", RUN_TRIGGERS)):
        with errors.check():
            found[name] = choice_arg(args, name, choices)
    with errors.check():
        if found["q"] is not None and (len(found["q"]) > 200 or not found["q"].isprintable()):
            raise invalid("q", "must be at most 200 printable characters")
    for name in ("since", "until"):
        text = (args.get(name) or "").strip()
        with errors.check():
            try:
                if not text:
                    continue
                if re.fullmatch(r"\d{4}-\d{2}-\d{2}", text):
                    midnight = datetime.fromisoformat(text).replace(tzinfo=tz)
                    found[name] = midnight + timedelta(days=1) if name == "until" else midnight
                else:
                    found[name] = parse_instant(text)
                found[name] = found[name].astimezone(UTC)   # an instant past year 9999 in UTC fails here, not later
            except (ValueError, OverflowError):
                raise invalid(name, "must be an RFC 3339 instant with its offset (2026-12-01T08:00:00Z) "
                                    "or a date (2026-12-01)") from None
    with errors.check():
        if found["since"] and found["until"] and found["since"] >= found["until"]:
            raise invalid("until", "is not after since: no run can match (swap them?)")
    errors.raise_any()
    return found


def host_allowed(host_header: str, allowed: Iterable[str]) -> bool:
    m = re.fullmatch(r"(\[[0-9a-f:.]+\]|[^:\[\]]+)(?::\d{1,5})?", host_header.strip().lower())
    if m is None:
        return False
    name = m[1]
    return name in LOCAL_HOSTS or name in {h.lower() for h in allowed}


#: Short notices a redirect can ask the next page to show (``?done=``).
DONE_NOTICES = {
    "created": "Schedule created. It fires on its timing; use Fire now to run it at once.",
    "updated": "Schedule updated.", "enable": "Schedule enabled.", "pause": "Schedule paused.",
    "resume": "Schedule resumed: enabled, failure streak cleared.", "archive": "Schedule archived.",
    "admitted": "Fired: this run is queued; it starts when a slot is free and updates live here.",
    "admitted_started": "Fired: this run has started; it updates live here.",
    "skipped_overlap": "Not fired: a run of this schedule is still active.",
    "cancel": "Cancel requested.", "run_pause": "Run paused: its slot is free.",
    "resume_run": "Resume requested: the run continues when a slot is free.",
    "acked": "Acknowledged.", "acked_all": "All open items acknowledged.",
    "acked_selected": "The selected items are acknowledged.",
    "notify_saved": "Notification entry saved: it counts from now.", "notify_removed": "Notification entry removed.",
    "agent_created": "Agent created. Assign it a task on the board to wake it.", "agent_updated": "Agent saved.",
    "woken": "Wakeup queued: the agent wakes as soon as it has room.", "task_created": "Task created.",
    "task_updated": "Task saved.", "moved": "Task moved.", "commented": "Comment posted.",
    "approval_resolved": "Decision recorded.", "settings_saved": "Settings saved.",
    "routine_created": "Routine created.", "routine_updated": "Routine saved.", "routine_deleted": "Routine deleted.",
    "trigger_added": "Trigger added.", "trigger_deleted": "Trigger removed.",
    "secret_rotated": "Secret rotated: callers still signing with the old one are accepted for a grace period.",
    "fired_received": "Fired: the agent's wakeup is queued.", "fired_task_created": "Fired: a task was created.",
    "fired_skipped": "Not fired: the routine's previous run is still active (skip_if_active).",
    "fired_coalesced": "Merged into the routine's active run (coalesce_if_active).",
    "fired_woke_task": "Fired: its open task's last run had ended, so its agent is woken on that task again.",
    "adopted": "Run adopted: you can reply to it.",
    "replied": "Reply sent: this run continues the answered one, and its attention item is closed.",
    "resumed": "Profile resumed: its queued runs may start.",
    "rerun": "Re-run queued: same commit, prompt, profile and model.",
    "rerun_started": "Re-run started: same commit, prompt, profile and model.",
    "approve_catch_up": "Catch-up approved: one catch-up run is queued.",
    "approve_catch_up_later": "Not started: a run of this schedule is still active. Approve the catch-up again "
                              "when it ends; the plan waits.",
    "dismiss_catch_up": "Catch-up dismissed: the missed occurrences are recorded as skipped.",
    "proposal_confirmed": "Proposal confirmed: the schedule is changed as reviewed.",
    "proposal_declined": "Proposal declined: the agent that proposed it sees your note.",
    "notify_test": "Test message queued: it arrives in a few seconds (see each entry's last delivery below).",
    "channel_test": "Test message queued for the channel: it arrives in a few seconds (see its last out below).",
}


# --- route tables ---------------------------------------------------------------------------------

#
# Every route is a module-level handler declared in one of the tables below with its method, rule
# and auth; ``create_app`` only installs the tables. List them all with
# ``python -c "import outpost; print(*outpost.route_list(), sep=chr(10))"``.

class Auth(enum.StrEnum):
    """Who may call a route. Declared per route, so a new path never inherits the wrong auth."""
    TOKEN = "token"           # the API token (Bearer), or a dashboard session with its CSRF token on writes
    SESSION = "session"       # a dashboard page: the session cookie (or the token); GET without one: sign-in
    RUN = "run"               # a running Office run's own token ($OUTPOST_RUN_TOKEN)
    ANY_RUN = "any_run"       # the run token of any running run (a schedule's or a dispatch's too)
    SIGNATURE = "signature"   # a webhook: its trigger's signing mode, checked by the handler (docs/office.md)
    METRICS = "metrics"       # a scraper: the API token or [settings] metrics_token (Bearer), nothing else
    PUBLIC = "public"         # no credentials: health and sign-in


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    """One declared route (bottle's ``Route`` with its config)."""
    method: str
    rule: str
    handler: Callable[..., Awaitable[Any]]
    auth: Auth
    idempotent: bool = False          # docs/http-api.md's Idempotency-Key rules
    status: int = 200                 # the status of the handler's JSON answer
    etag: bool = False                # the answer is a schedule: send its revision as the ETag
    nudges: tuple[Actor, ...] = ()    # actors woken after a successful answer
    #: A write a proposer key may make (docs/agent-clis.md: compose, propose, dispatch, adopt,
    #: reply); every read of the API token's routes it may make anyway.
    proposer: bool = False


class Routes:
    """One surface's route table. ``key_required``: an idempotent route refuses a request
    without an Idempotency-Key (428) rather than running it unkeyed."""

    def __init__(self, surface: str, *, key_required: bool = False):
        self.surface = surface
        self.key_required = key_required
        self.routes: list[Route] = []

    def route(self, method: str, rule: str, *, auth: Auth, **options: Any):
        def declare(handler):
            self.routes.append(Route(method, rule, handler, auth, **options))
            return handler
        return declare

    def get(self, rule: str, **options: Any):
        return self.route("GET", rule, **options)

    def post(self, rule: str, **options: Any):
        return self.route("POST", rule, **options)

    def patch(self, rule: str, **options: Any):
        return self.route("PATCH", rule, **options)

    def delete(self, rule: str, **options: Any):
        return self.route("DELETE", rule, **options)


#: ``/v1/outpost/`` (docs/http-api.md) and ``/healthz``.
api = Routes("api", key_required=True)
#: ``/api/office/`` (docs/office.md): the Idempotency-Key is optional there.
office_api = Routes("office_api")
#: ``/api/agent/``: what a running Office agent may do with its run token.
agent_api = Routes("agent_api")
#: ``/api/routine-triggers/``: webhook fires, signed by their trigger's secret.
hooks = Routes("hooks")
#: The browser dashboard: server-rendered pages and the forms that post back to them.
pages = Routes("pages")
ROUTE_TABLES = (api, office_api, agent_api, hooks, pages)


def route_list() -> list[str]:
    """Every route as ``METHOD rule auth (surface)``: the map of the web layer."""
    return [f"{r.method:6} {r.rule} {r.auth} ({t.surface})" for t in ROUTE_TABLES for r in t.routes]


# --- the request a handler sees -------------------------------------------------------------------

class Web:
    """One request as its handler sees it: the deps, the Quart request, who is asking
    (``caller``: "api", "dashboard" or "agent"; ``agent``: the Office run a run token speaks
    for; ``csrf``: a signed-in session's token) and the Idempotency-Key being applied."""

    def __init__(self, deps: Deps, request: Any, route: Route | None):
        self.deps = deps
        self.store = deps.store
        self.request = request
        self.route = route
        self.caller = "anonymous"
        self.agent: dict[str, Any] | None = None
        self.csrf: str | None = None
        self.key: str | None = None
        self.proposer: str | None = None   # the name of the proposer key asking (caller "proposer")
        #: A dashboard page's event cursor, read with its first store call: its live stream
        #: resumes after it, so an event committed while the page read its data still refreshes it.
        self.cursor: int | None = None

    @property
    def now(self) -> datetime:
        return self.deps.clock.now()

    @property
    def args(self):
        return self.request.args

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One store function in its own transaction."""
        if self.cursor is None and self.route is not None and self.route.auth is Auth.SESSION:
            def first():
                self.cursor = self.store.latest_cursor()
                return fn(*args, **kwargs)
            return await self.deps.transaction(first)
        return await self.deps.transaction(fn, *args, **kwargs)

    async def commit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A write, in one transaction with the stored answer of the Idempotency-Key being
        applied (if any): the action and its replay commit together or not at all."""
        key, route = self.key, self.route

        def action():
            body = fn(*args, **kwargs)
            if key is not None:
                self.store.access.finish_idempotent(key, route.status, {"body": body, "headers": answer_headers(route,
                                                                                                                body)})
            return body
        return await self.call(action)

    async def json(self) -> Any:
        data = await self.request.get_data(cache=True)
        if len(data) > MAX_BODY_BYTES:
            raise PayloadTooLarge(f"request bodies are limited to {MAX_BODY_BYTES} bytes")
        if not data.strip():
            return {}
        try:
            value = json.loads(data)
            _check_unicode(value, "")
            return value
        except RecursionError:
            raise invalid("body", "JSON nested too deeply") from None
        except ValueError as exc:
            raise ValidationFailed(f"malformed JSON: {exc}", errors=[{"field": "body", "message": str(exc)}]) from None

    async def body(self) -> dict[str, Any]:
        """The JSON body, which must be an object."""
        return body_object(await self.json())

    async def form(self):
        return await self.request.form

    async def see_other(self, target: str, **once: Any):
        """A form's answer (POST/redirect/GET): 303 to the GET page ``target``, which a reload
        views again without posting twice. ``once``: context that page shows the next time this
        session views it, then never (a new secret), kept in the session, never in the URL."""
        from quart import redirect
        if once:
            path = urllib.parse.urlsplit(target).path
            await self.call(self.store.access.set_flash, self.request.cookies.get(SESSION_COOKIE, ""), path, once)
        return redirect(target, 303)

    def int_arg(self, name: str, default: int, lo: int, hi: int) -> int:
        text = self.args.get(name)
        if text is None:
            return default
        try:
            return _int(int(text), name, lo, hi)
        except ValueError:
            raise invalid(name, "must be a whole number") from None

    def flag_arg(self, name: str) -> bool:
        return self.args.get(name, "false").lower() in ("1", "true", "yes")

    def choice_arg(self, name: str, choices: Iterable[str]) -> str | None:
        return choice_arg(self.args, name, choices)

    def workspace_arg(self, raw: dict[str, Any] | None = None) -> str | None:
        """The workspace a request names: the body's workspace_id, else ?workspace_id=, else the default."""
        value = (raw or {}).get("workspace_id", self.args.get("workspace_id"))
        if value is not None and (not isinstance(value, str) or not value):
            raise invalid("workspace_id", "must be a workspace id")
        return value

    @property
    def profile_names(self) -> list[str]:
        return [a.name for a in self.deps.config.agents]

    async def page(self, template: str, *, status: int = 200, section: str | None = None, live: bool = False,
                   **context: Any):
        """A dashboard page: the template with the nav's counts, a ``?done=`` notice and what
        the form that redirected here left to show once (``see_other``'s ``once``)."""
        from quart import render_template
        signed_in = bool(self.csrf)
        cookie, path = self.request.cookies.get(SESSION_COOKIE, ""), self.request.path
        viewed = self.request.method == "GET"   # read here: the store call runs on the writer's thread

        def nav():
            once = self.store.access.take_flash(cookie, path) if viewed else {}
            cursor = self.store.latest_cursor() if self.cursor is None else self.cursor
            return self.store.open_attention_count(), cursor, once
        counts = await self.call(nav) if signed_in else (0, 0, {})
        notice = DONE_NOTICES.get(context.pop("done", self.args.get("done", "")))   # a page may drop its own
        html = await render_template(template, signed_in=signed_in, csrf=self.csrf, section=section,
                                     live=live, open_attention=counts[0], cursor=counts[1],
                                     isolation=self.deps.isolation,
                                     flash={"kind": "ok", "text": notice} if notice else None,
                                     **{**context, **counts[2]})
        return html, status, {"Content-Type": "text/html; charset=utf-8", "Cache-Control": "no-store"}


def body_object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid("body", "must be a JSON object")
    return value


def answer_headers(route: Route | None, body: Any) -> dict[str, str]:
    if route is not None and route.etag and isinstance(body, dict) and "revision" in body:
        return {"ETag": f'"{body["revision"]}"'}
    return {}


def answer(route: Route, body: Any):
    """A handler's plain answer as JSON, with the route's status (and ETag)."""
    from quart import Response
    if body is None:
        return Response("", status=route.status)
    return json_response(body, route.status, answer_headers(route, body))


def replayed(status: int, stored: dict[str, Any]):
    from quart import Response
    headers = {**stored["headers"], "Idempotent-Replayed": "true"}
    if stored["body"] is None:
        return Response("", status=status, headers=headers)
    response = json_response(stored["body"], status, headers)
    if status >= 400:
        response.content_type = "application/problem+json"
    return response


def check_same_origin(request) -> None:
    site = request.headers.get("Sec-Fetch-Site")
    if site is not None and site not in ("same-origin", "none"):
        raise CrossSiteRefused(f"cross-site request refused (Sec-Fetch-Site: {site})")
    origin = request.headers.get("Origin")
    if origin is not None and urllib.parse.urlsplit(origin).netloc != request.headers.get("Host", ""):
        raise CrossSiteRefused(f"request from another origin refused ({origin[:100]})")


async def screen_request(deps: Deps) -> None:
    """Every request, routed or not: the Host allowlist (DNS-rebinding defence) and the size cap."""
    from quart import request
    if not host_allowed(request.headers.get("Host", ""), deps.config.allowed_hosts):
        raise ForbiddenHost("this Host is not allowed (DNS-rebinding defence); use 127.0.0.1 or "
                            "name the host in [settings] allowed_hosts")
    length = request.content_length
    if length is not None and length > MAX_BODY_BYTES:
        raise PayloadTooLarge(f"request bodies are limited to {MAX_BODY_BYTES} bytes")


async def read_body_to_end(response):
    """Every answer, refusals included (401, 403, 404, 428 before the handler read the body): the
    request's body is read to its end (at most MAX_BODY_BYTES) before the answer goes out.
    Hypercorn takes the next request of a keep-alive connection only once this one is read
    whole; unread, that request would wait for the read timeout."""
    from quart import request
    from werkzeug.exceptions import RequestEntityTooLarge, RequestTimeout
    try:
        await request.get_data(cache=True)
    except (RequestEntityTooLarge, RequestTimeout):   # the rest of the body is not read: no next request
        response.headers["Connection"] = "close"
    return response


async def authenticate(web: Web):
    """The route's declared auth. Returns a redirect to sign-in for a signed-out page view."""
    from quart import redirect
    auth, request = web.route.auth, web.request
    if auth in (Auth.PUBLIC, Auth.SIGNATURE):
        return None
    header = request.headers.get("Authorization")
    if auth in (Auth.RUN, Auth.ANY_RUN):   # a live run's own token; only an Office run's speaks for an agent
        run_id = run_of_token(web.deps.run_token_key, bearer(header))
        web.agent = run_id and await web.call(web.store.office.run_agent_context, run_id)
        if not web.agent:
            raise Unauthorized("the agent API takes the run token of a running run ($OUTPOST_RUN_TOKEN)")
        if auth is Auth.RUN and web.agent["agent_id"] is None:
            raise Forbidden("a schedule or dispatch run may only call POST /api/agent/needs-you")
        web.caller = "agent"
        return None
    if auth is Auth.METRICS:
        if not scraper_token(web.deps, bearer(header)):
            raise Unauthorized("send Authorization: Bearer <token>: the API token or [settings] metrics_token")
        web.caller = "scraper"
        return None
    if header is not None:
        given = bearer(header)
        if given and hmac.compare_digest(given.encode(), web.deps.token.encode()):
            web.caller = "api"
            return None
        if not given.startswith(PROPOSER_KEY_PREFIX):
            raise Unauthorized("send Authorization: Bearer <token> (`outpost token` prints it)")
        key = await web.call(web.store.access.key_of, given)
        if key is None:
            raise Unauthorized("this proposer key is unknown or revoked (`outpost keys list` lists the live ones; "
                               "`outpost keys create --proposer` makes a new one)")
        check_proposer(web.route, request.method)
        web.caller, web.proposer = "proposer", key["name"]
        return None
    cookie = request.cookies.get(SESSION_COOKIE)
    web.csrf = cookie and await web.call(web.store.access.session_csrf, cookie, web.now)
    if not web.csrf:
        if auth is Auth.SESSION and request.method == "GET":
            return redirect("/signin?next=" + urllib.parse.quote(request.full_path.rstrip("?")))
        if auth is Auth.SESSION:
            raise Unauthorized("sign in to the dashboard first")
        raise Unauthorized("send Authorization: Bearer <token> (`outpost token` prints it)")
    web.caller = "dashboard"
    if request.method not in SAFE_METHODS:
        check_same_origin(request)
        form = await request.form if request.mimetype in FORM_TYPES else {}
        given = request.headers.get("X-CSRF-Token") or form.get("csrf", "")
        if not hmac.compare_digest(given.encode(), web.csrf.encode()):
            raise CrossSiteRefused("the form's CSRF token is missing or stale: reload the page and try again")
    return None


def check_proposer(route: Route, method: str) -> None:
    """What a proposer key may do: read what the API token reads, and the writes its routes
    declare (``Route.proposer``); never confirm, create, change or control a schedule, nor
    change settings or agents. A 403 that says so, naming the route."""
    if route.auth is Auth.TOKEN and (method in SAFE_METHODS or route.proposer):
        return
    raise Forbidden(f"a proposer key may not {method} {route.rule}: it may read, compose, propose, dispatch, "
                    "adopt and reply; a change to schedules, settings or agents is a proposal a human confirms "
                    "(POST /v1/outpost/proposals)")


def scraper_token(deps: Deps, given: str) -> bool:
    """Whether ``given`` may read GET /metrics: the API token, or the metrics token, which opens
    nothing else (compared in constant time, each)."""
    tokens = [deps.token, *([deps.config.metrics_token] if deps.config.metrics_token else [])]
    return bool(given) and any([hmac.compare_digest(given.encode(), t.encode()) for t in tokens])


async def credentialed(web: Web) -> bool:
    """Whether a request that matched no route carries the API token, a live proposer key (which
    reads every path the token does) or a signed-in session."""
    header = web.request.headers.get("Authorization")
    if header is not None:
        given = bearer(header)
        if given.startswith(PROPOSER_KEY_PREFIX):
            return bool(await web.call(web.store.access.key_of, given))
        return hmac.compare_digest(given.encode(), web.deps.token.encode())
    cookie = web.request.cookies.get(SESSION_COOKIE)
    return bool(cookie and await web.call(web.store.access.session_csrf, cookie, web.now))


async def run_idempotently(web: Web, table: Routes, params: dict[str, Any]) -> Any:
    """docs/http-api.md: replay, reuse and in-flight rules of the Idempotency-Key. The handler's
    ``web.commit`` stores the answer in the action's own transaction; a refusal is stored
    too, except one whose fix is a header or a retry (the retry may reuse the key)."""
    key = web.request.headers.get("Idempotency-Key")
    if key is None and not table.key_required:
        return await web.route.handler(web, **params)
    if key is None:
        raise IdempotencyKeyRequired("send an Idempotency-Key header (1-255 printable ASCII)")
    if not valid_idempotency_key(key):
        raise invalid("Idempotency-Key", "must be 1-255 printable ASCII characters, no outer spaces")
    body = await web.request.get_data(cache=True)
    fingerprint = request_fingerprint(web.request.method, web.request.full_path.rstrip("?"), body)
    if web.proposer is not None:   # a key's Idempotency-Keys are its own: it can neither replay nor claim a human's
        key = "proposer:" + hashlib.sha256(f"{web.proposer}\n{key}".encode()).hexdigest()
    replay = await web.call(web.store.access.begin_idempotent, key, fingerprint, web.now)
    if replay is not None:
        return replayed(*replay)
    web.key = key
    try:
        return await web.route.handler(web, **params)
    except (PreconditionRequired, RevisionMismatch, StoreUnavailable):
        with contextlib.suppress(StoreUnavailable):
            await web.call(web.store.access.abandon_idempotent, key)
        raise
    except OutpostError as err:
        await web.call(web.store.access.finish_idempotent, key, err.status, {"body": err.problem(), "headers": {}})
        raise
    except BaseException:
        with trio.CancelScope(shield=True):
            await web.call(web.store.access.abandon_idempotent, key)
        raise


def endpoint(deps: Deps, table: Routes, route: Route):
    """The adapter between Quart and one declared route: a ``Web`` for the request, the
    route's auth, its idempotency, the handler, then the nudges it declared. Errors go to
    the app's one error boundary (``answer_error``)."""
    from quart import g, request

    async def handle(**params: Any):
        web = g.web = Web(deps, request, route)
        signed_out = await authenticate(web)
        if signed_out is not None:
            return signed_out
        if route.idempotent:
            result = await run_idempotently(web, table, params)
        else:
            result = await route.handler(web, **params)
        for actor in route.nudges:
            deps.nudge(actor)
        return answer(route, result) if isinstance(result, dict | list) or result is None else result
    handle.__name__ = route.handler.__name__
    return handle


def wants_html(web: Web) -> bool:
    """Errors of dashboard pages (and unknown paths outside the APIs) read as a page in a browser."""
    path = web.request.path
    if web.route is not None and web.route not in pages.routes:
        return False
    return not path.startswith(API_PREFIXES) and "text/html" in web.request.headers.get("Accept", "")


async def answer_error(web: Web, err: BaseException):
    """The one error boundary: a refusal a user can read (problem+json, or the error page in
    a browser), an unknown path or method, or a logged 500 that never shows a traceback."""
    from werkzeug.exceptions import HTTPException
    if isinstance(err, HTTPException) and web.request.path.startswith(API_PREFIXES) and not await credentialed(web):
        err = Unauthorized("send Authorization: Bearer <token> (`outpost token` prints it)")   # reveals no paths
    elif isinstance(err, HTTPException):
        known = {404: NotFound("no such endpoint"), 405: MethodNotAllowed("method not allowed here"),
                 413: PayloadTooLarge("request body over 1 MiB")}
        err = known.get(err.code) or OutpostError(err.description or err.name)
    elif not isinstance(err, OutpostError):
        log.getChild("web").error("unexpected error on %s %s", web.request.method, web.request.path,
                                  exc_info=err)
        err = InternalError("Outpost hit an internal error; it is in the daemon's log")
    if wants_html(web):
        return await web.page("error.html", status=err.status, error=err, section=None)
    return problem_response(err)


async def security_headers(response):
    response.headers.setdefault("Content-Security-Policy", CSP)
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    return response


###############################################################################
# 19. Web: actions shared by the JSON API and the dashboard, one function each: the
#     checked definition and triggers, fires, proposals, the runs chart.
###############################################################################

# --- the checked definition and triggers ----------------------------------------------------------

def raise_with_missing_repository(err: ValidationFailed, repo: Any) -> NoReturn:
    """Re-raise a form's refusal with one more error when its local repository is not there: the
    git check would only tell it once the other fields are right."""
    errors = FieldErrors()
    errors.errors = list(err.errors)
    if (isinstance(repo, str) and os.path.isabs(repo) and not is_repository_url(repo) and not Path(repo).is_dir()
            and "repository" not in {e["field"] for e in errors.errors}):
        errors.errors.append({"field": "repository", "message": f"{repo} is not an existing git repository "
                                                                "on this machine"})
    errors.raise_any()
    raise err


async def checked_definition(deps: Deps, raw: Any, current: dict[str, Any] | None = None) -> dict[str, Any]:
    """Normalize a definition and run the git checks. For an edit (``current`` given) a
    once-instant in the past is refused only when the timing really changed."""
    now = deps.clock.now()
    try:
        definition = normalize_definition(raw, now, agents=[a.name for a in deps.config.agents],
                                          check_past=current is None)
    except ValidationFailed as err:   # with the other fields' errors: a local repository that is not there
        raise_with_missing_repository(err, raw.get("repository") if isinstance(raw, dict) else None)
    if current is not None and definition["timing"] != current["timing"]:
        normalize_timing(definition["timing"], now, check_past=True)
    await check_repository(definition, deps)
    return definition


async def checked_triggers(deps: Deps, raw: Any, workspace_id: str | None) -> list[dict[str, Any]]:
    """A routine's triggers, validated; a schedule trigger without a timezone takes the workspace's."""
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > 20:
        raise invalid("triggers", "must be a list of at most 20 triggers")
    tz = (await deps.transaction(deps.store.office.office_settings, workspace_id))["timezone"]
    triggers, errors = [], FieldErrors()   # every trigger's errors at once
    for i, t in enumerate(raw):
        with errors.check():
            triggers.append(normalize_trigger(t, i, deps.clock.now(), tz))
    errors.raise_any()
    return triggers


# --- actions --------------------------------------------------------------------------------------

#: What a person's own agent may propose (docs/agent-clis.md), and the fields of each.
PROPOSAL_KINDS = ("create", "change", "control")
#: Who a proposal made without a key is by (``Web.caller``): a key may not take these names.
HUMAN_CALLERS = ("api", "dashboard")
PROPOSAL_FIELDS = {"create": ("definition",), "change": ("schedule_id", "changes"),
                   "control": ("schedule_id", "action")}


async def install_heartbeat(deps: Deps, agent_id: str) -> None:
    """A new coordinator gets the "Coordinator heartbeat" routine, in its own transaction: if
    that fails the agent stays created and its page shows the no-scheduled-wake-ups banner."""
    try:
        await deps.transaction(deps.store.routines.install_heartbeat, agent_id, deps.clock.now())
        deps.nudge(Actor.CRON)
    except Exception:   # noqa: BLE001 - logged and warned, never fatal to the agent
        log.getChild("office").warning("could not install the coordinator heartbeat for %s", agent_id, exc_info=True)


#: A control action in the words of a proposal's review.
CONTROL_WORDS = {"enable": "Enable", "pause": "Pause", "resume": "Resume (enable, clear the failure streak of)",
                 "archive": "Archive (for good)", "approve_catch_up": "Approve the catch-up of",
                 "dismiss_catch_up": "Dismiss the catch-up of", "fire": "Fire now"}


async def create_schedule(web: Web, raw: Any, confirmation: Any) -> dict[str, Any]:
    """A new schedule (``POST /v1/outpost/schedules``, docs/http-api.md): its definition checked
    (git included) and confirmed against what its review showed, then committed. The API's POST
    and the dashboard's Confirm both call it."""
    definition = await checked_definition(web.deps, raw)
    check_confirmation(definition, confirmation)
    return await web.commit(web.store.schedules.create_schedule, definition, web.now,
                            web.deps.profile_digests.get(definition["agent"]))


async def update_schedule(web: Web, schedule_id: str, revision: int, edit: Callable[[dict[str, Any]], Any],
                          confirmation: Any) -> dict[str, Any]:
    """An edit (``PATCH /v1/outpost/schedules/<id>``, docs/http-api.md): refused for an archived
    schedule, and for a revision that is not the current one before anything else is judged (412).
    ``edit`` makes the whole new definition from the stored one (the API merges its changes in, the
    dashboard's Confirm gives what its review showed), checked against the stored one (a
    once-instant in the past is refused only if the timing changed) and confirmed, then committed
    under ``revision``. The API's PATCH and the dashboard's Confirm both call it."""
    current = await web.call(web.store.schedules.schedule_definition, schedule_id)
    if current["archived"]:
        raise Archived(f"schedule {schedule_id} is archived; create a new one instead")
    check_revision(schedule_id, current["revision"], revision)   # a concurrent edit: 412, not a mismatch
    definition = await checked_definition(web.deps, edit(current["definition"]), current["definition"])
    check_confirmation(definition, confirmation)
    return await web.commit(web.store.schedules.update_schedule, schedule_id, revision, definition, web.now,
                            web.deps.profile_digests.get(definition["agent"]))


async def fire_schedule(web: Web, schedule_id: str, revision: int) -> dict[str, Any]:
    """A manual occurrence (docs/http-api.md ``fire``): committed, then its commit resolved and admission woken."""
    fired = await web.commit(web.store.schedules.fire_manual, schedule_id, revision, web.now, web.deps.profile_digests)
    await after_fire(web.deps, fired)
    return fired


async def control_schedule(web: Web, schedule_id: str, revision: int, action: Any) -> dict[str, Any]:
    """enable | pause | resume | archive | approve_catch_up | dismiss_catch_up (the schedule's
    view) or fire (the occurrence)."""
    if action == "fire":
        return await fire_schedule(web, schedule_id, revision)
    if action not in SCHEDULE_ACTIONS:
        raise invalid("action", "must be " + ", ".join(SCHEDULE_ACTIONS) + " or fire")
    view = await web.commit(web.store.schedules.control_schedule, schedule_id, revision, action, web.now)
    web.deps.nudge(Actor.CRON)
    web.deps.nudge(Actor.CLAIM)   # an approved catch-up queued a run
    return view


async def control_run(web: Web, run_id: str, action: Any) -> dict[str, Any]:
    """cancel | pause | resume (docs/http-api.md): recorded, then the live process is signalled. A
    running run is paused also while its worktree is prepared: its process is stopped the moment
    it exists; on another node of a fleet, that node's claim actor reads the pause."""
    if action not in ("cancel", "pause", "resume"):
        raise invalid("action", "must be cancel, pause or resume")
    view = await web.commit(web.store.runs.control_run, run_id, action, web.now)
    web.deps.live.signal(run_id, action)
    web.deps.nudge(Actor.CLAIM)   # pause frees a slot, resume asks for one
    return view


async def act_on_runs(web: Web, action: str, run_ids: list[str]) -> dict[str, Any]:
    """Cancel or re-run a selection (docs/http-api.md); the live ones among the cancelled are signalled."""
    answer = await web.commit(web.store.runs.act_on_runs, action, run_ids, web.now)
    for result in answer["results"]:
        if action == "cancel" and result["status"] in ACTIVE_RUN_STATUSES:
            web.deps.live.signal(result["id"], "cancel")
    web.deps.nudge(Actor.CLAIM)
    return answer


async def reply_to_run(web: Web, run_id: str, message: Any, adopt_as: Any = None) -> dict[str, Any]:
    """docs/agent-clis.md: answer an adopted needs_you run; its continuation joins the FIFO queue.
    ``adopt_as`` (the dashboard): adopt an unowned run for this workspace in the same step."""
    if not isinstance(message, str) or not message.strip() or len(message) > MAX_TEXT_CHARS:
        raise invalid("message", f"the answer, 1-{MAX_TEXT_CHARS} characters, is required")
    if adopt_as is not None and (not isinstance(adopt_as, str) or not 1 <= len(adopt_as.strip()) <= 200):
        raise invalid("workspace", "a workspace name of 1-200 characters is required")
    if web.proposer is not None:
        adopt_as = web.proposer
    reply = await web.commit(web.store.runs.reply_to_run, run_id, message.strip(), web.now,
                             adopt_as=adopt_as and adopt_as.strip(), as_owner=web.proposer)
    web.deps.nudge(Actor.CLAIM)
    return reply


async def adopt_run(web: Web, run_id: str, workspace: Any) -> dict[str, Any]:
    """A workspace takes a needs_you run before it replies; a proposer key's is its name (docs/agent-clis.md)."""
    if web.proposer is not None:
        workspace = workspace or web.proposer
    if not isinstance(workspace, str) or not 1 <= len(workspace.strip()) <= 200:
        raise invalid("workspace", "a workspace name of 1-200 characters is required")
    return await web.commit(web.store.runs.adopt_run, run_id, workspace.strip(), web.now)


async def propose(web: Web, raw: dict[str, Any]) -> dict[str, Any]:
    """docs/agent-clis.md: a proposal of a new schedule (``definition``), a change (``schedule_id``,
    ``changes``) or a control action (``schedule_id``, ``action``), checked as a confirmation
    would be and reviewed as compose reviews; a human confirms or declines it."""
    kind = raw.get("kind")
    if kind not in PROPOSAL_KINDS:
        raise invalid("kind", "must be " + ", ".join(PROPOSAL_KINDS))
    _unknown(raw, ("kind", *PROPOSAL_FIELDS[kind]), f"a {kind} proposal")
    now, by = web.now, web.proposer or web.caller
    if kind == "create":
        definition = await checked_definition(web.deps, raw.get("definition"))
        review = {**composed(definition, now, (raw.get("definition") or {}).get("timing")), "name": definition["name"]}
        return await web.commit(web.store.access.create_proposal, kind, None, {"definition": definition}, None,
                                review, by, now)
    schedule_id = raw.get("schedule_id")
    if not isinstance(schedule_id, str) or not schedule_id:
        raise invalid("schedule_id", "the schedule this proposal is for is required")
    current = await web.call(web.store.schedules.schedule_definition, schedule_id)
    if current["archived"]:
        raise Archived(f"schedule {schedule_id} is archived; propose a new one instead")
    before = current["definition"]
    if kind == "change":
        definition = await checked_definition(web.deps, merge_changes(before, raw.get("changes")), before)
        diff = definition_diff(before, definition)
        if not diff:
            raise invalid("changes", "match the schedule's definition as it is: there is nothing to propose")
        review = {**composed(definition, now, definition["timing"]), "name": before["name"], "diff": diff}
        body = {"changes": {k: definition[k] for k in raw["changes"] if k in definition}}
    else:
        action = raw.get("action")
        if action not in (*SCHEDULE_ACTIONS, "fire"):
            raise invalid("action", "must be " + ", ".join(SCHEDULE_ACTIONS) + " or fire")
        review = {**composed(before, now, before["timing"]), "name": before["name"],
                  "summary": f"{CONTROL_WORDS[action]} schedule {before['name']!r}."}
        if action not in ("enable", "resume", "fire"):   # after it the schedule does not fire: no fires to read
            review |= {"next_fires": [], "warnings": []}
        body = {"action": action}
    return await web.commit(web.store.access.create_proposal, kind, schedule_id, body, current["revision"], review,
                            by, now)


async def confirm_proposal(web: Web, proposal_id: str) -> dict[str, Any]:
    """A human applies a proposal as it was reviewed: a change or control with the revision it was
    made from (412 if the schedule moved meanwhile, and the proposal is then stale), in one
    transaction with the proposal's decision."""
    p, now = await web.call(web.store.access.get_proposal, proposal_id, web.now), web.now
    if p["state"] != ProposalState.PENDING:
        raise Conflict(f"proposal {proposal_id} is {p['state']}; only a pending proposal can be confirmed")
    digests, decide = web.deps.profile_digests, web.store.access.decide_proposal
    if p["kind"] == "create":
        definition = await checked_definition(web.deps, p["definition"])

        def apply():
            schedule = web.store.schedules.create_schedule(definition, now, digests.get(definition["agent"]))
            return decide(proposal_id, ProposalState.CONFIRMED, None, now, schedule["id"])
        return await web.commit(apply)
    current = await web.call(web.store.schedules.schedule_definition, p["schedule_id"])
    if current["revision"] != p["base_revision"] or current["archived"]:
        why = ("the schedule was archived" if current["archived"] else
               f"the schedule changed (it is at revision {current['revision']} now, this was made from "
               f"revision {p['base_revision']})")
        await web.call(decide, proposal_id, ProposalState.STALE, f"{why} after this was proposed", now)
        check_revision(p["schedule_id"], current["revision"], p["base_revision"])
        raise Archived(f"schedule {p['schedule_id']} is archived")
    if p["kind"] == "change":
        definition = await checked_definition(web.deps, merge_changes(current["definition"], p["changes"]),
                                              current["definition"])

        def apply():
            web.store.schedules.update_schedule(p["schedule_id"], p["base_revision"], definition, now,
                                                digests.get(definition["agent"]))
            return decide(proposal_id, ProposalState.CONFIRMED, None, now)
        return await web.commit(apply)
    fired = {}

    def apply():
        if p["action"] == "fire":
            fired.update(web.store.schedules.fire_manual(p["schedule_id"], p["base_revision"], now, digests))
        else:
            web.store.schedules.control_schedule(p["schedule_id"], p["base_revision"], p["action"], now)
        return decide(proposal_id, ProposalState.CONFIRMED, None, now)
    decided = await web.commit(apply)
    if fired:
        await after_fire(web.deps, fired)
    return decided


async def decline_proposal(web: Web, proposal_id: str, note: Any) -> dict[str, Any]:
    if note is not None and (not isinstance(note, str) or len(note) > MAX_TEXT_CHARS):
        raise invalid("note", f"must be text of at most {MAX_TEXT_CHARS} characters")
    return await web.commit(web.store.access.decide_proposal, proposal_id, ProposalState.DECLINED,
                            (note or "").strip() or None, web.now)


async def ack_attention(web: Web, attention_id: str) -> dict[str, Any]:
    """Acknowledge an item; an acknowledged ``needs_you`` run lets its empty branch go (docs/operations.md)."""
    item = await web.commit(web.store.ack_attention, attention_id, web.now)
    if item["kind"] == "needs_you" and item["run_id"]:
        await drop_empty_branch(web.deps, item["run_id"])
    return item


async def ack_attention_items(web: Web, attention_ids: list[str] | None) -> dict[str, Any]:
    """Acknowledge a selection, or every open item (None), as ``ack_attention`` does one."""
    answer = await web.commit(web.store.ack_attention_items, attention_ids, web.now)
    for item in answer["acknowledged"]:
        if item["kind"] == "needs_you" and item["run_id"]:
            await drop_empty_branch(web.deps, item["run_id"])
    return answer


async def agents_overview(web: Web) -> list[dict[str, Any]]:
    """Every agent profile (docs/agent-clis.md): its configuration and its standing, by name."""
    profiles = sorted(web.deps.config.agents, key=lambda a: a.name)
    states = await web.call(web.store.runs.profile_states, [a.name for a in profiles], web.now)
    versions = await web.call(web.store.runs.agent_versions)
    return [{**state, "preset": a.preset, "model": a.model, "max_running": a.max_running,
             "agent_version": versions.get(a.name), "timeout_seconds": a.timeout_seconds}
            for a, state in zip(profiles, states, strict=True)]


async def control_profile(web: Web, name: str, action: Any) -> dict[str, Any]:
    if web.deps.config.agent(name) is None:
        raise NotFound(f"no agent profile {name!r} (profiles are declared in outpost.toml)")
    if action != "resume":
        raise invalid("action", "must be resume")
    await web.commit(web.store.runs.resume_profile, name, web.now)
    web.deps.nudge(Actor.CLAIM)
    return next(a for a in await agents_overview(web) if a["name"] == name)


async def wake_agent(web: Web, agent_id: str, context: str | None) -> dict[str, Any]:
    """A user's wakeup of an agent, recording who asked: the dashboard user or the API token."""
    return await web.commit(web.store.office.wake_agent, agent_id, WakeupSource.USER,
                            {"user_id": web.caller, "context": context}, web.now)


async def create_agent(web: Web, workspace_id: str | None, raw: dict[str, Any]) -> dict[str, Any]:
    fields = normalize_agent(raw, profiles=web.profile_names)
    agent = await web.commit(web.store.office.create_agent, workspace_id, fields, web.now)
    if fields["role"] == "coordinator":
        await install_heartbeat(web.deps, agent["id"])
    return agent


async def update_agent(web: Web, agent_id: str, raw: dict[str, Any]) -> dict[str, Any]:
    current = await web.call(web.store.office.agent_fields, agent_id)
    fields = normalize_agent(raw, profiles=web.profile_names, current=current)
    return await web.commit(web.store.office.update_agent, agent_id, fields, web.now)


async def create_task(web: Web, workspace_id: str | None, raw: dict[str, Any]) -> dict[str, Any]:
    return await web.commit(web.store.office.create_task, workspace_id, normalize_task(raw, profiles=web.profile_names),
                            web.now)


async def update_task(web: Web, task_id: str, raw: dict[str, Any]) -> dict[str, Any]:
    """An edit; a reassignment's cancel of the previous assignee's run reaches its process."""
    current = await web.call(web.store.office.task_fields, task_id)
    view = await web.commit(web.store.office.update_task, task_id,
                            normalize_task(raw, profiles=web.profile_names, current=current), web.now)
    if live := web.deps.live.ids():
        for run_id in await web.call(web.store.runs.cancels_requested, live):
            web.deps.live.signal(run_id, "cancel")
    return view


async def update_settings(web: Web, workspace_id: str | None, raw: dict[str, Any]) -> dict[str, Any]:
    current = await web.call(web.store.office.office_settings, workspace_id)
    try:
        settings = normalize_settings(raw, profiles=web.profile_names, current=current)
    except ValidationFailed as err:   # with the other fields' errors: a local repository that is not there
        raise_with_missing_repository(err, raw.get("repository"))
    if settings["repository"] and (settings["repository"], settings["source_ref"]) != (current["repository"],
                                                                                       current["source_ref"]):
        await check_repository(settings, web.deps)   # refused now, not at the next wake (422 naming the field)
    return await web.commit(web.store.office.update_office_settings, workspace_id, settings)


async def create_routine(web: Web, workspace_id: str | None, raw: dict[str, Any],
                         raw_triggers: Any) -> dict[str, Any]:
    errors = FieldErrors()   # the routine's errors and its triggers' at once
    with errors.check():
        fields = normalize_routine(raw, current=None)
    with errors.check():
        triggers = await checked_triggers(web.deps, raw_triggers, workspace_id)
    errors.raise_any()
    routine = await web.commit(web.store.routines.create_routine, workspace_id, fields, triggers, web.now)
    web.deps.nudge(Actor.CRON)
    return routine


async def update_routine(web: Web, routine_id: str, raw: dict[str, Any]) -> dict[str, Any]:
    current = await web.call(web.store.routines.routine_fields, routine_id)
    routine = await web.commit(web.store.routines.update_routine, routine_id, normalize_routine(raw, current=current),
                               web.now)
    web.deps.nudge(Actor.CRON)
    return routine


async def add_trigger(web: Web, routine_id: str, raw: dict[str, Any]) -> dict[str, Any]:
    routine = await web.call(web.store.routines.get_routine, routine_id)
    (trigger,) = await checked_triggers(web.deps, [raw], routine["workspace_id"])
    added = await web.commit(web.store.routines.add_trigger, routine_id, trigger, web.now)
    web.deps.nudge(Actor.CRON)
    return added


async def fire_routine(web: Web, routine_id: str, variables: Any) -> dict[str, Any]:
    """A manual Run now of a routine, with its variables."""
    if not isinstance(variables, dict):
        raise invalid("variables", "must be an object of name: value")
    return await web.commit(web.store.routines.fire_routine, routine_id, None, "manual", variables, web.now)


def composed(definition: dict[str, Any], now: datetime, raw_timing: Any, after: datetime | None = None,
             count: int = 5) -> dict[str, Any]:
    """What a human reads before confirming (docs/http-api.md compose): the definition, a
    sentence, the next fires, the warnings and the digest a confirmation signs."""
    fires = next_fires(definition["timing"], after or now, count, anchor=now)
    return {"definition": definition, "summary": schedule_summary(definition, fires[0] if fires else None),
            "next_fires": [rfc3339(f) for f in fires], "confirmation": confirmation_of(definition),
            "warnings": timing_warnings(definition["timing"], now, raw_timing)}


# --- the runs chart (SVG) -------------------------------------------------------------------------

#: The outcomes a chart stacks, bottom to top, with their words.
CHART_OUTCOMES = (("succeeded", "succeeded"), ("failed", "failed"), ("needs_you", "needs you"),
                  ("skipped", "skipped"))
#: What a chart with no runs in its days says instead of an empty plot.
CHART_EMPTY = f"No runs in the last {CHART_DAYS} days"


def _svg_text(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def runs_chart_svg(days: list[dict[str, Any]], title: str) -> str:
    """Runs per day by outcome (stacked bars) and cost per day (a second row when any run cost
    something), as inline SVG: classes for colours (the stylesheet's, light and dark), a
    <title> per bar for readers and tooltips, no script."""
    width, bar_h, gap = 24 * len(days), 110, 4
    if not any(d[k] for d in days for k, _ in CHART_OUTCOMES):   # an empty plot would say nothing
        return (f'<svg class="chart chart-empty" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} 40" '
                f'role="img" aria-label="{_svg_text(title)}: {CHART_EMPTY}"><title>{_svg_text(title)}</title>'
                f'<text class="axis" x="{width // 2}" y="24" text-anchor="middle">{CHART_EMPTY}</text></svg>')
    peak = max((sum(d[k] for k, _ in CHART_OUTCOMES) for d in days), default=0) or 1
    costs = [d["cost"] for d in days]
    cost_peak = max(costs, default=0.0)
    height = bar_h + (70 if cost_peak else 0) + 24
    parts = [f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="{_svg_text(title)}"><title>{_svg_text(title)}</title>']
    for i, d in enumerate(days):
        x, y = i * 24 + gap // 2, bar_h
        words = ", ".join(f"{d[k]} {w}" for k, w in CHART_OUTCOMES if d[k]) or "no runs"
        cost = f", {format_usd(d['cost'])}" if d["cost"] else ""
        parts.append(f'<g class="day" data-day="{d["day"]}"><title>{d["day"]}: {words}{cost}</title>')
        for key, _ in CHART_OUTCOMES:
            if d[key]:
                h = max(2, round(d[key] / peak * (bar_h - 10)))
                y -= h
                parts.append(f'<rect class="bar bar-{key}" data-count="{d[key]}" x="{x}" y="{y}" width="{24 - gap}" '
                             f'height="{h}"/>')
        if cost_peak:
            h = max(1, round(d["cost"] / cost_peak * 56)) if d["cost"] else 0
            parts.append(f'<rect class="bar bar-cost" x="{x}" y="{bar_h + 64 - h}" width="{24 - gap}" height="{h}"/>')
        parts.append("</g>")
    label_y = height - 6
    parts.append(f'<text class="axis" x="0" y="{label_y}">{days[0]["day"][5:]}</text>'
                 f'<text class="axis" x="{width}" y="{label_y}" text-anchor="end">{days[-1]["day"][5:]}</text>')
    if cost_peak:
        parts.append(f'<text class="axis" x="0" y="{bar_h + 12}">cost per day (peak {format_usd(cost_peak)})</text>')
    parts.append("</svg>")
    return "".join(parts)


async def runs_chart(web: Web, title: str, tz: str = "UTC", **scope: str) -> str:
    days = await web.call(web.store.runs.daily_runs, web.now, zone(tz, "tz"), CHART_DAYS, **scope)
    return runs_chart_svg(days, title)


#: Filters the templates use.
def format_usd(value: float | None) -> str:
    """A cost: cents from $1 on; under $1 three significant digits ($0.0123, $0.50), as runs of
    a cent or less are common and "$0.01" would hide a tenfold difference."""
    if value is None:
        return "-"
    if value == 0 or abs(value) >= 1:
        return f"${value:,.2f}"
    decimals = min(8, max(2, 2 - math.floor(math.log10(abs(value)))))
    whole, fraction = f"{value:.{decimals}f}".split(".")
    return f"${whole}.{fraction.rstrip('0').ljust(2, '0')}"


###############################################################################
# 20. Web: the JSON API: /v1/outpost/, the Office API, webhooks, channels, the agent API,
#     the event stream.
###############################################################################

# --- JSON API: /v1/outpost/ (docs/http-api.md) ----------------------------------------------------

@api.get("/healthz", auth=Auth.PUBLIC)
async def api_healthz(web: Web):
    """Answered by the event loop alone (it stays up while another process locks the database):
    503 when the database's disk was full at the latest write and still has no room, when the
    cron actor is more than MISFIRE_GRACE_S behind a due fire, or the cron or claim actor has
    been in one pass that long, whether or not it knew of a due fire (docs/schedules.md)."""
    from quart import jsonify
    lag = round(web.deps.cron_watch.lag_s(web.now), 1)
    stuck = web.deps.cron_watch.stuck(web.now)
    full = web.deps.disk.full_now(web.store.dialect.database_file(web.store.database))
    body = {"status": "ok", "ok": True, "cron_lag_seconds": lag, "live_runs": len(web.deps.live)}
    if full is not None:   # first: it is why the actors below would be held
        body |= {"status": "disk_full", "ok": False,
                 "reason": f"{full}: runs cannot settle and nothing can be recorded until space is freed"}
    elif lag > MISFIRE_GRACE_S:
        body |= {"status": "cron_lagging", "ok": False,
                 "reason": f"the cron actor is {lag:.0f} s behind a due fire"}
    elif stuck is not None:
        actor, held_s = stuck
        body |= {"status": f"{actor}_stuck", "ok": False,
                 "reason": f"the {actor} actor has made no progress for {held_s:.0f} s, held in one step "
                           "(a database another process holds, or a git command that hangs)"}
    return body if body["ok"] else (jsonify(body), 503)


@api.get("/metrics", auth=Auth.METRICS)
async def api_metrics(web: Web):
    """Prometheus exposition (docs/operations.md), written by prometheus_client from this appliance's
    registry: the database's totals and gauges read in one transaction, the sizes on disk
    (walked off the event loop, at most once a DISK_SIZES_TTL_S), this process's histograms."""
    deps = web.deps
    runs, wakeups, attention, nodes = await web.call(read_metrics, deps.store)
    reading = MetricsReading(runs, wakeups, attention, nodes, await disk_sizes(deps),
                             round(deps.cron_watch.lag_s(web.now), 3))
    body, content_type = deps.metrics.render(reading, web.request.headers.get("Accept", ""))
    return body, 200, {"Content-Type": content_type, "Cache-Control": "no-store"}


async def disk_sizes(deps: Deps) -> dict[str, int]:
    """``disk_usage`` of the data dir, reused for DISK_SIZES_TTL_S (a scrape every few seconds
    must not walk every worktree each time)."""
    cached, now = deps.metrics.disk, deps.clock.now()
    if cached is not None and (now - cached[0]).total_seconds() < DISK_SIZES_TTL_S:
        return cached[1]
    database = deps.store.dialect.database_file(deps.store.database)
    sizes = await trio.to_thread.run_sync(disk_usage, deps.config.data_dir, database)
    deps.metrics.disk = (now, sizes)
    return sizes


def _text_field(raw: dict[str, Any], key: str, hi: int, *, single_line: bool = False) -> str:
    value = _text(raw, key, 1, hi, single_line=single_line)
    if not value.strip():
        raise invalid(key, "must not be blank")
    return value


@api.post("/v1/outpost/schedules/compose", auth=Auth.TOKEN, proposer=True)
async def api_compose(web: Web):
    raw = await web.body()
    now = web.now
    current = None
    if "schedule_id" in raw:
        changes = dict(raw)
        current = (await web.call(web.store.schedules.schedule_definition,
                                  str(changes.pop("schedule_id"))))["definition"]
        raw = merge_changes(current, changes)
    definition = await checked_definition(web.deps, raw, current)
    after = now
    if web.args.get("from"):
        try:
            after = parse_instant(web.args["from"])
            if not 1970 <= after.astimezone(UTC).year <= MAX_YEAR:
                raise OverflowError(web.args["from"])
        except ValueError:
            raise invalid("from", "must be an RFC 3339 instant with an offset, e.g. 2027-03-27T00:00:00Z") from None
        except OverflowError:
            raise invalid("from", f"must be between 1970 and {MAX_YEAR}") from None
    return composed(definition, now, raw.get("timing"), after, web.int_arg("count", 5, 1, 100))


@api.post("/v1/outpost/schedules", auth=Auth.TOKEN, idempotent=True, status=201, etag=True, nudges=(Actor.CRON,))
async def api_create_schedule(web: Web):
    raw = await web.body()
    return await create_schedule(web, raw.get("definition"), raw.get("confirmation"))


@api.get("/v1/outpost/schedules", auth=Auth.TOKEN)
async def api_list_schedules(web: Web):
    state, sort = web.choice_arg("state", SCHEDULE_STATES), web.choice_arg("sort", ("created", "next_fire"))
    return {"schedules": await web.call(web.store.schedules.list_schedules, web.flag_arg("include_archived"),
                                        state=state, by_next_fire=sort == "next_fire")}


@api.get("/v1/outpost/schedules/<schedule_id>", auth=Auth.TOKEN, etag=True)
async def api_get_schedule(web: Web, schedule_id: str):
    return await web.call(web.store.schedules.get_schedule, schedule_id)


@api.patch("/v1/outpost/schedules/<schedule_id>", auth=Auth.TOKEN, idempotent=True, etag=True,
           nudges=(Actor.CRON,))
async def api_patch_schedule(web: Web, schedule_id: str):
    revision = parse_if_match(web.request.headers.get("If-Match"))
    raw = await web.body()
    return await update_schedule(web, schedule_id, revision, lambda current: merge_changes(current, raw.get("changes")),
                                 raw.get("confirmation"))


@api.post("/v1/outpost/schedules/<schedule_id>/control", auth=Auth.TOKEN, idempotent=True, etag=True)
async def api_control_schedule(web: Web, schedule_id: str):
    revision = parse_if_match(web.request.headers.get("If-Match"))
    return await control_schedule(web, schedule_id, revision, (await web.body()).get("action"))


@api.get("/v1/outpost/schedules/<schedule_id>/occurrences", auth=Auth.TOKEN)
async def api_schedule_occurrences(web: Web, schedule_id: str):
    limit = web.int_arg("limit", 100, 1, 1000)
    return {"occurrences": await web.call(web.store.schedules.occurrences, schedule_id, limit)}


@api.get("/v1/outpost/schedules/<schedule_id>/inspect", auth=Auth.TOKEN)
async def api_inspect_schedule(web: Web, schedule_id: str):
    return await web.call(web.store.schedules.inspect, schedule_id)


@api.get("/v1/outpost/runs", auth=Auth.TOKEN)
async def api_list_runs(web: Web):
    found = run_filters(web.args, web.profile_names)
    return await web.call(web.store.runs.list_runs, found.pop("schedule_id"), found.pop("status"),
                          web.int_arg("limit", 50, 1, 500), web.args.get("before") or None, **found)


@api.get("/v1/outpost/runs/<run_id>", auth=Auth.TOKEN)
async def api_get_run(web: Web, run_id: str):
    return await web.call(web.store.runs.get_run, run_id)


@api.get("/v1/outpost/runs/<run_id>/log", auth=Auth.TOKEN)
async def api_run_log(web: Web, run_id: str):
    from quart import Response
    await web.call(web.store.runs.get_run, run_id)
    text, size = await run_log(web.deps, run_id, web.int_arg("offset", 0, 0, 2**40))
    return Response(text, content_type="text/plain; charset=utf-8", headers={"X-Log-Size": str(size)})


@api.post("/v1/outpost/runs/<run_id>/adopt", auth=Auth.TOKEN, idempotent=True, proposer=True)
async def api_adopt_run(web: Web, run_id: str):
    return await adopt_run(web, run_id, (await web.body()).get("workspace"))


@api.post("/v1/outpost/runs/<run_id>/rerun", auth=Auth.TOKEN, idempotent=True, status=202, nudges=(Actor.CLAIM,))
async def api_rerun(web: Web, run_id: str):
    return await web.commit(web.store.runs.rerun, run_id, web.now)


@api.post("/v1/outpost/runs/cancel", auth=Auth.TOKEN, idempotent=True)
async def api_cancel_runs(web: Web):
    return await act_on_runs(web, "cancel", selected_ids(await web.body()))


@api.post("/v1/outpost/runs/rerun", auth=Auth.TOKEN, idempotent=True)
async def api_rerun_runs(web: Web):
    return await act_on_runs(web, "rerun", selected_ids(await web.body()))


@api.get("/v1/outpost/runs/<run_id>/compare/<other_id>", auth=Auth.TOKEN)
async def api_compare(web: Web, run_id: str, other_id: str):
    a, b = await web.call(web.store.runs.run_facts, run_id), await web.call(web.store.runs.run_facts, other_id)
    return (await compare_runs(a, b, web.deps.mirrors.path(a["repository"])))[0]


@api.get("/v1/outpost/charts/runs.svg", auth=Auth.TOKEN)
async def api_runs_chart(web: Web):
    """Runs per day by outcome and cost per day, last 30 days: of a schedule, an Office agent, or all."""
    scope = {}
    if schedule_id := web.args.get("schedule_id"):
        await web.call(web.store.schedules.get_schedule, schedule_id)   # 404 for an unknown one
        scope["schedule_id"] = schedule_id
    if agent_id := web.args.get("agent_id"):
        await web.call(web.store.office.get_agent, agent_id)
        scope["office_agent_id"] = agent_id
    svg = await runs_chart(web, "Runs per day, last 30 days", web.args.get("tz", "UTC"), **scope)
    return svg, 200, {"Content-Type": "image/svg+xml; charset=utf-8", "Cache-Control": "no-store"}


@api.post("/v1/outpost/runs/<run_id>/reply", auth=Auth.TOKEN, idempotent=True, status=202, proposer=True)
async def api_reply_run(web: Web, run_id: str):
    return await reply_to_run(web, run_id, (await web.body()).get("message"))


@api.get("/v1/outpost/agents", auth=Auth.TOKEN)
async def api_agents(web: Web):
    return {"agents": await agents_overview(web)}


@api.post("/v1/outpost/agents/<name>/control", auth=Auth.TOKEN, idempotent=True)
async def api_control_agent(web: Web, name: str):
    return await control_profile(web, name, (await web.body()).get("action"))


@api.post("/v1/outpost/runs/<run_id>/control", auth=Auth.TOKEN, idempotent=True)
async def api_control_run(web: Web, run_id: str):
    return await control_run(web, run_id, (await web.body()).get("action"))


@api.post("/v1/outpost/dispatches", auth=Auth.TOKEN, idempotent=True, status=202, nudges=(Actor.CLAIM,),
          proposer=True)
async def api_dispatch(web: Web):
    payload = normalize_dispatch(await web.body(), web.now, agents=web.profile_names)
    commit = await check_repository(payload, web.deps)   # resolved once, recorded with the run: one transaction
    return await web.commit(web.store.schedules.create_dispatch, payload, web.now, commit, web.proposer)


@api.get("/v1/outpost/proposals", auth=Auth.TOKEN)
async def api_list_proposals(web: Web):
    state = web.choice_arg("state", ProposalState)
    return {"proposals": await web.call(web.store.access.list_proposals, state, web.now,
                                        web.int_arg("limit", 100, 1, 500))}


@api.get("/v1/outpost/proposals/<proposal_id>", auth=Auth.TOKEN)
async def api_get_proposal(web: Web, proposal_id: str):
    return await web.call(web.store.access.get_proposal, proposal_id, web.now)


@api.post("/v1/outpost/proposals", auth=Auth.TOKEN, idempotent=True, status=201, proposer=True)
async def api_propose(web: Web):
    return await propose(web, await web.body())


@api.post("/v1/outpost/proposals/<proposal_id>/confirm", auth=Auth.TOKEN, idempotent=True,
          nudges=(Actor.CRON, Actor.CLAIM))
async def api_confirm_proposal(web: Web, proposal_id: str):
    return await confirm_proposal(web, proposal_id)


@api.post("/v1/outpost/proposals/<proposal_id>/decline", auth=Auth.TOKEN, idempotent=True)
async def api_decline_proposal(web: Web, proposal_id: str):
    return await decline_proposal(web, proposal_id, (await web.body()).get("note"))


@api.get("/v1/outpost/keys", auth=Auth.TOKEN)
async def api_list_keys(web: Web):
    return {"keys": await web.call(web.store.access.list_keys)}


@api.post("/v1/outpost/keys", auth=Auth.TOKEN, idempotent=True, status=201)
async def api_create_key(web: Web):
    """A proposer key for a person's own agent (docs/agent-clis.md), shown in this answer only."""
    raw = await web.body()
    _unknown(raw, ("name", "role"), "a key")
    if raw.get("role", "proposer") != "proposer":
        raise invalid("role", "must be proposer (the only kind of key)")
    name = _text_field(raw, "name", 100).strip() if raw.get("name") is not None else f"agent-{secrets.token_hex(3)}"
    if not re.fullmatch(r"[\w.@-]{1,100}", name):
        raise invalid("name", "letters, digits, '.', '@', '_' and '-' only (it names the key in lists and runs)")
    if name in HUMAN_CALLERS:
        raise invalid("name", f"{name!r} names a human's proposals (the API token, the dashboard): choose another")
    return await web.commit(web.store.access.create_key, name, "proposer", web.now)


@api.delete("/v1/outpost/keys/<name>", auth=Auth.TOKEN, status=204)
async def api_revoke_key(web: Web, name: str):
    await web.call(web.store.access.revoke_key, name)


@api.get("/v1/outpost/nodes", auth=Auth.TOKEN)
async def api_list_nodes(web: Web):
    return {"nodes": await web.call(web.store.nodes.list_nodes)}


@api.get("/v1/outpost/attention", auth=Auth.TOKEN)
async def api_list_attention(web: Web):
    state = web.args.get("state", "open")
    if state not in ("open", "all"):
        raise invalid("state", "must be open or all")
    return {"attention": await web.call(web.store.list_attention, state == "open")}


async def list_upcoming(web: Web) -> dict[str, Any]:
    """The upcoming fires of ``?days=`` (1-31, 7 when empty): the sources read in one store call, the
    fires counted on a worker thread, so a thousand sparse crons hold neither the store nor the loop."""
    days = 7 if web.args.get("days", "") == "" else web.int_arg("days", 7, 1, 31)
    sources = await web.call(web.store.routines.fire_sources)
    return {**await trio.to_thread.run_sync(upcoming_list, sources, web.now, days), "days": days}


@api.get("/v1/outpost/upcoming", auth=Auth.TOKEN)
async def api_upcoming(web: Web):
    return await list_upcoming(web)


@api.post("/v1/outpost/attention/ack", auth=Auth.TOKEN, idempotent=True)
async def api_ack_attention_items(web: Web):
    return await ack_attention_items(web, selected_ids(await web.body()))


@api.post("/v1/outpost/attention/<attention_id>/ack", auth=Auth.TOKEN, idempotent=True)
async def api_ack_attention(web: Web, attention_id: str):
    return await ack_attention(web, attention_id)


@api.post("/v1/outpost/housekeeping", auth=Auth.TOKEN, idempotent=True)
async def api_housekeeping(web: Web):
    """docs/operations.md: a housekeeping pass now, ``{"keep_days"?: n, "dry_run"?: bool}`` (``keep_days``
    0 here means every settled run the rules allow); its counts."""
    raw = await web.body()
    _unknown(raw, ("keep_days", "dry_run"), "housekeeping")
    keep_days = raw.get("keep_days", web.deps.config.keep_days)
    if not isinstance(keep_days, int) or isinstance(keep_days, bool) or not 0 <= keep_days <= 100_000:
        raise invalid("keep_days", "must be a whole number of days from 0 to 100000")
    dry_run = raw.get("dry_run", False)
    if not isinstance(dry_run, bool):
        raise invalid("dry_run", "must be true or false")
    if web.deps.housekeeping.locked():
        raise Conflict("a housekeeping pass is running; try again when it has finished")
    async with web.deps.housekeeping:
        counts = await housekeeping_pass(web.deps, keep_days, dry_run=dry_run)
    return await web.commit(lambda: counts)   # stores the answer of its Idempotency-Key


@api.get("/v1/outpost/notify", auth=Auth.TOKEN)
async def api_notify(web: Web):
    return {"entries": await web.call(web.store.notify.entry_states)}


async def queue_test_notifications(web: Web, raw: Any) -> dict[str, Any]:
    """``POST /v1/outpost/notify/test``: a test message to every notification entry, or to the
    ``[[notify]]`` entry at index ``entry``."""
    toml = web.deps.config.notify
    if raw is not None and (not isinstance(raw, int) or isinstance(raw, bool) or not any(e.index == raw for e in toml)):
        raise invalid("entry", f"must be the index of a [[notify]] entry (0 to {len(toml) - 1})" if toml else
                      "names no [[notify]] entry (outpost.toml has none)")
    chosen = None if raw is None else next(e.id for e in toml if e.index == raw)
    queued = await web.commit(web.store.notify.queue_test, chosen, web.now)
    if not queued:
        raise Conflict("no notification entries: add one on Settings or in outpost.toml "
                       "(docs/operations.md#notifications)")
    return {"queued": queued}


def notify_fields(raw: Any, *, partial: bool) -> dict[str, Any]:
    """A notification entry from a request: ``url`` (an Apprise URL, checked as Apprise reads it,
    kept with its masked ``label``), ``kinds``, ``digest``, each checked as outpost.toml's are;
    every field's error at once."""
    raw = body_object(raw)
    _unknown(raw, NOTIFY_KEYS, "a notification entry")
    errors, fields = FieldErrors(), {}
    if not partial:
        raw = {"kinds": list(NOTIFY_DEFAULT_KINDS), "digest": None, **raw}
    for key in ("url", "kinds", "digest"):
        if key not in raw or (key == "digest" and raw[key] in (None, "")):
            if key == "digest" and key in raw:
                fields["digest"] = None
            elif key == "url" and not partial:
                errors.errors.append({"field": "url", "message": "an Apprise URL is required, such as "
                                                                 "ntfy://ntfy.sh/my-topic"})
            continue
        with errors.check():
            if (problem := NOTIFY_KEYS[key](raw[key])) is not None:
                raise invalid(key, problem)
            fields[key] = raw[key].strip() if key == "url" else raw[key]
    if "url" in fields:
        with errors.check():
            if len(fields["url"]) > NOTIFY_URL_MAX:
                raise invalid("url", f"must be at most {NOTIFY_URL_MAX} characters")
            if (label := notify_label(fields["url"])) is None:
                raise invalid("url", "is not a URL Apprise can send to (see https://github.com/caronc/apprise/wiki "
                                     "for each service's URL)")
            fields["label"] = label
    errors.raise_any()
    return fields


async def checked_notify_fields(raw: Any, *, partial: bool) -> dict[str, Any]:
    """``notify_fields`` on a worker thread: Apprise's import (0.15 s) and its URL parsing never hold
    the event loop."""
    return await trio.to_thread.run_sync(functools.partial(notify_fields, raw, partial=partial))


@api.post("/v1/outpost/notify/test", auth=Auth.TOKEN, idempotent=True, status=202, nudges=(Actor.NOTIFY,))
async def api_notify_test(web: Web):
    return await queue_test_notifications(web, (await web.body()).get("entry"))


@api.get("/v1/outpost/notify/entries", auth=Auth.TOKEN)
async def api_notify_entries(web: Web):
    return {"entries": await web.call(web.store.notify.entry_states)}


@api.post("/v1/outpost/notify/entries", auth=Auth.TOKEN, idempotent=True, status=201, nudges=(Actor.NOTIFY,))
async def api_add_notify_entry(web: Web):
    f = await checked_notify_fields(await web.body(), partial=False)
    return await web.commit(web.store.notify.add_entry, f["url"], f["label"], f["kinds"], f["digest"], web.now)


@api.patch("/v1/outpost/notify/entries/<entry_id>", auth=Auth.TOKEN, idempotent=True, nudges=(Actor.NOTIFY,))
async def api_update_notify_entry(web: Web, entry_id: str):
    return await web.commit(web.store.notify.update_entry, entry_id,
                            await checked_notify_fields(await web.body(), partial=True),
                            web.now)


@api.delete("/v1/outpost/notify/entries/<entry_id>", auth=Auth.TOKEN, idempotent=True, status=204)
async def api_remove_notify_entry(web: Web, entry_id: str):
    await web.commit(web.store.notify.remove_entry, entry_id)


@api.post("/v1/outpost/notify/entries/<entry_id>/test", auth=Auth.TOKEN, idempotent=True, status=202,
          nudges=(Actor.NOTIFY,))
async def api_test_notify_entry(web: Web, entry_id: str):
    return {"queued": await web.commit(web.store.notify.queue_test, entry_id, web.now)}


@api.get("/v1/outpost/events", auth=Auth.TOKEN)
async def api_events(web: Web):
    after = web.int_arg("after", 0, 0, 2**62)
    return await web.call(web.store.events_after, after, web.int_arg("limit", 100, 1, 1000))


@api.get("/v1/outpost/events/stream", auth=Auth.TOKEN)
async def api_event_stream(web: Web):
    from quart import Response
    last = web.request.headers.get("Last-Event-ID") or web.args.get("after")
    cursor = parse_count(last)
    if last and cursor is None:
        raise invalid("after", "must be an event cursor (a whole number)")
    if cursor is None:
        cursor = await web.call(web.store.latest_cursor)
    response = Response(event_stream(web.deps, cursor), content_type="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.timeout = None
    return response


async def event_stream(deps: Deps, cursor: int):
    """Server-sent events from ``cursor`` on: read from the store, woken by the hub (in a
    fleet also every FLEET_POLL_S: another node's events do not poke this one's hub)."""
    yield b"retry: 2000\n\n"
    quiet_since = trio.current_time()
    while True:
        page = await deps.transaction(deps.store.events_after, cursor, 200)
        for event in page["events"]:
            yield f"id: {event['cursor']}\nevent: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
        cursor = page["next_cursor"]
        if len(page["events"]) == 200:
            continue
        if page["events"]:
            quiet_since = trio.current_time()
        elif trio.current_time() - quiet_since >= 15:
            yield b": keep-alive\n\n"
            quiet_since = trio.current_time()
        with trio.move_on_after(deps.store.dialect.stream_poll_s):
            await deps.hub.wait()


@api.get("/v1/outpost/snapshot", auth=Auth.TOKEN)
async def api_snapshot(web: Web):
    return await web.call(web.store.schedules.snapshot)


# --- Office API: /api/office/ (docs/office.md) ----------------------------------------------------

@office_api.get("/api/office/workspaces", auth=Auth.TOKEN)
async def office_workspaces(web: Web):
    return {"workspaces": await web.call(web.store.office.list_workspaces)}


@office_api.post("/api/office/workspaces", auth=Auth.TOKEN, idempotent=True, status=201, nudges=(Actor.CLAIM,))
async def office_create_workspace(web: Web):
    name = _text_field(await web.body(), "name", 100, single_line=True).strip()
    return await web.commit(web.store.office.create_workspace, name, web.now)


@office_api.get("/api/office/projects", auth=Auth.TOKEN)
async def office_projects(web: Web):
    return {"projects": await web.call(web.store.office.list_projects, web.workspace_arg())}


@office_api.post("/api/office/projects", auth=Auth.TOKEN, idempotent=True, status=201, nudges=(Actor.CLAIM,))
async def office_create_project(web: Web):
    raw = await web.body()
    _unknown(raw, ("workspace_id", "name", "repository", "executor", *BUDGET_FIELDS), "a project")
    repository = _repository(raw) if raw.get("repository") is not None else None
    executor = _optional_name(raw, "executor", web.profile_names, "agent profile")
    return await web.commit(web.store.office.create_project, web.workspace_arg(raw),
                            _text_field(raw, "name", 100, single_line=True), repository, executor, web.now,
                            budget_fields(raw, 1_000_000))


@office_api.get("/api/office/agents", auth=Auth.TOKEN)
async def office_agents(web: Web):
    return {"agents": await web.call(web.store.office.list_agents, web.workspace_arg())}


@office_api.post("/api/office/agents", auth=Auth.TOKEN, idempotent=True, status=201, nudges=(Actor.CLAIM,))
async def office_create_agent(web: Web):
    raw = await web.body()
    return await create_agent(web, web.workspace_arg(raw), raw)


@office_api.get("/api/office/agents/<agent_id>", auth=Auth.TOKEN)
async def office_agent(web: Web, agent_id: str):
    def detail():
        view = web.store.office.get_agent(agent_id)
        view["continuation_summaries"] = web.store.office.summary_of(agent_id)
        return view
    return await web.call(detail)


@office_api.patch("/api/office/agents/<agent_id>", auth=Auth.TOKEN, idempotent=True, nudges=(Actor.CLAIM,))
async def office_patch_agent(web: Web, agent_id: str):
    return await update_agent(web, agent_id, await web.body())


@office_api.get("/api/office/agents/<agent_id>/runs", auth=Auth.TOKEN)
async def office_agent_runs(web: Web, agent_id: str):
    return {"runs": await web.call(web.store.office.agent_runs, agent_id, web.int_arg("limit", 50, 1, 500))}


@office_api.post("/api/office/agents/<agent_id>/wake", auth=Auth.TOKEN, idempotent=True, status=202,
                 nudges=(Actor.CLAIM,))
async def office_wake_agent(web: Web, agent_id: str):
    raw = await web.body()
    _unknown(raw, ("context",), "a wake")
    return await wake_agent(web, agent_id, _text(raw, "context", 0, MAX_TEXT_CHARS, "") or None)


@office_api.get("/api/office/tasks", auth=Auth.TOKEN)
async def office_tasks(web: Web):
    state = web.choice_arg("state", TaskState)
    return {"tasks": await web.call(web.store.office.list_tasks, web.workspace_arg(), web.args.get("assignee_agent_id"),
                                    state, web.flag_arg("include_archived"))}


@office_api.post("/api/office/tasks", auth=Auth.TOKEN, idempotent=True, status=201, nudges=(Actor.CLAIM,))
async def office_create_task(web: Web):
    raw = await web.body()
    return await create_task(web, web.workspace_arg(raw), raw)


@office_api.get("/api/office/tasks/<task_id>", auth=Auth.TOKEN)
async def office_task(web: Web, task_id: str):
    return await web.call(web.store.office.get_task, task_id)


@office_api.patch("/api/office/tasks/<task_id>", auth=Auth.TOKEN, idempotent=True, nudges=(Actor.CLAIM,))
async def office_patch_task(web: Web, task_id: str):
    return await update_task(web, task_id, await web.body())


@office_api.post("/api/office/tasks/<task_id>/move", auth=Auth.TOKEN, idempotent=True, nudges=(Actor.CLAIM,))
async def office_move_task(web: Web, task_id: str):
    raw = await web.body()
    _unknown(raw, ("state",), "a move")
    return await web.commit(web.store.office.move_task, task_id, raw.get("state"), web.now)


@office_api.post("/api/office/tasks/<task_id>/comments", auth=Auth.TOKEN, idempotent=True, status=201,
                 nudges=(Actor.CLAIM,))
async def office_comment(web: Web, task_id: str):
    raw = await web.body()
    _unknown(raw, ("body",), "a comment")
    return await web.commit(web.store.office.add_comment, task_id, _text_field(raw, "body", MAX_TEXT_CHARS), web.now)


@office_api.get("/api/office/approvals", auth=Auth.TOKEN)
async def office_approvals(web: Web):
    status = web.choice_arg("status", ApprovalStatus)
    return {"approvals": await web.call(web.store.office.list_approvals, web.workspace_arg(), status)}


@office_api.post("/api/office/approvals/<approval_id>/resolve", auth=Auth.TOKEN, idempotent=True,
                 nudges=(Actor.CLAIM,))
async def office_resolve_approval(web: Web, approval_id: str):
    raw = await web.body()
    _unknown(raw, ("status", "decision_note"), "a decision")
    return await web.commit(web.store.office.resolve_approval, approval_id, raw.get("status"),
                            _text(raw, "decision_note", 0, MAX_TEXT_CHARS, ""), web.now)


@office_api.get("/api/office/wakeups", auth=Auth.TOKEN)
async def office_wakeups(web: Web):
    status = web.choice_arg("status", WakeupStatus)
    source = web.choice_arg("source", WakeupSource)
    return {"wakeups": await web.call(web.store.office.list_wakeups, web.workspace_arg(), web.args.get("agent_id"),
                                      status,
                                      source, web.int_arg("limit", 100, 1, 1000))}


@office_api.get("/api/office/runs/<run_id>", auth=Auth.TOKEN)
async def office_run(web: Web, run_id: str):
    return await web.call(web.store.office.office_run, run_id)


@office_api.get("/api/office/activity", auth=Auth.TOKEN)
async def office_activity(web: Web):
    return {"activity": await web.call(web.store.office.list_activity, web.workspace_arg(), web.args.get("code"),
                                       web.int_arg("limit", 100, 1, 1000))}


@office_api.get("/api/office/settings", auth=Auth.TOKEN)
async def office_settings(web: Web):
    return await web.call(web.store.office.office_settings, web.workspace_arg())


@office_api.patch("/api/office/settings", auth=Auth.TOKEN, idempotent=True, nudges=(Actor.CLAIM,))
async def office_patch_settings(web: Web):
    raw = await web.body()
    return await update_settings(web, web.workspace_arg(), raw)


@office_api.get("/api/office/routines", auth=Auth.TOKEN)
async def office_routines(web: Web):
    return {"routines": await web.call(web.store.routines.list_routines, web.workspace_arg())}


@office_api.post("/api/office/routines", auth=Auth.TOKEN, idempotent=True, status=201, nudges=(Actor.CLAIM,))
async def office_create_routine(web: Web):
    raw = await web.body()
    fields = {k: v for k, v in raw.items() if k not in ("workspace_id", "triggers")}
    return await create_routine(web, web.workspace_arg(raw), fields, raw.get("triggers"))


@office_api.get("/api/office/routines/<routine_id>", auth=Auth.TOKEN)
async def office_routine(web: Web, routine_id: str):
    return await web.call(web.store.routines.get_routine, routine_id)


@office_api.patch("/api/office/routines/<routine_id>", auth=Auth.TOKEN, idempotent=True, nudges=(Actor.CLAIM,))
async def office_patch_routine(web: Web, routine_id: str):
    return await update_routine(web, routine_id, await web.body())


@office_api.delete("/api/office/routines/<routine_id>", auth=Auth.TOKEN, idempotent=True, status=204,
                   nudges=(Actor.CRON, Actor.CLAIM))
async def office_delete_routine(web: Web, routine_id: str):
    return await web.commit(web.store.routines.delete_routine, routine_id, web.now)


@office_api.post("/api/office/routines/<routine_id>/fire", auth=Auth.TOKEN, idempotent=True, status=202,
                 nudges=(Actor.CLAIM,))
async def office_fire_routine(web: Web, routine_id: str):
    raw = await web.body()
    _unknown(raw, ("variables",), "a fire")
    return await fire_routine(web, routine_id, raw.get("variables") or {})


@office_api.post("/api/office/routines/<routine_id>/triggers", auth=Auth.TOKEN, idempotent=True, status=201,
                 nudges=(Actor.CLAIM,))
async def office_add_trigger(web: Web, routine_id: str):
    return await add_trigger(web, routine_id, await web.body())


@office_api.delete("/api/office/routines/<routine_id>/triggers/<trigger_id>", auth=Auth.TOKEN, idempotent=True,
                   status=204, nudges=(Actor.CRON, Actor.CLAIM))
async def office_delete_trigger(web: Web, routine_id: str, trigger_id: str):
    return await web.commit(web.store.routines.delete_trigger, routine_id, trigger_id, web.now)


@office_api.post("/api/office/routines/<routine_id>/triggers/<trigger_id>/rotate", auth=Auth.TOKEN,
                 idempotent=True, nudges=(Actor.CLAIM,))
async def office_rotate_secret(web: Web, routine_id: str, trigger_id: str):
    return await web.commit(web.store.routines.rotate_secret, routine_id, trigger_id, web.now)


# --- webhooks: /api/routine-triggers/ (docs/office.md) --------------------------------------------

@hooks.post("/api/routine-triggers/<public_id>/fire", auth=Auth.SIGNATURE)
async def hook_fire(web: Web, public_id: str):
    """No API token: the trigger's signing mode decides. Every refusal is recorded (time,
    reason, source address, size; never the secret)."""
    now, request = web.now, web.request
    body = await request.get_data(cache=True)
    target = await web.call(web.store.routines.webhook_trigger, public_id, now)

    async def refuse(err: OutpostError, reason: str):
        await web.call(web.store.routines.refuse_webhook, target["trigger_id"], reason, request.remote_addr,
                       len(body), now)
        return problem_response(err)

    check = verify_webhook(target["signing_mode"], target["secrets"],
                           {k.lower(): v for k, v in request.headers.items()}, body, now)
    if not check.ok:
        return await refuse(WebhookRefused(f"webhook refused: {check.reason}"), check.reason)
    if target["routine_status"] != RoutineStatus.ACTIVE or not target["enabled"]:
        state = "disabled" if target["routine_status"] == RoutineStatus.ACTIVE else target["routine_status"]
        return await refuse(Conflict(f"this trigger's routine is {state}; it does not fire"), f"routine {state}")
    try:
        provided = body_object(json.loads(body) if body.strip() else {})
        _check_unicode(provided, "")
    except (ValueError, RecursionError):
        return await refuse(invalid("body", "must be a JSON object (its keys are the variables)"),
                            "body is not a JSON object")
    except OutpostError as err:
        return await refuse(err, err.detail)
    try:
        run, earlier = await web.call(web.store.routines.fire_webhook, target["trigger_id"], provided,
                                      check.replay_keys,
                                      check.replay_ttl_s, now)
    except ValidationFailed as err:
        return await refuse(err, err.detail)
    if earlier is not None and earlier[1] == check.redelivery_key:   # GitHub's "Redeliver": the same delivery id
        return json_response({"routine_run_id": earlier[0], "status": "duplicate"}, 200)
    if earlier is not None:
        return await refuse(WebhookRefused("webhook refused: this signature was already used (replay)"),
                            "replayed signature")
    web.deps.nudge(Actor.CLAIM)
    return json_response({"routine_run_id": run["id"], "status": run["status"]}, 202)


# --- channels: /api/channels/ (docs/office.md "Channels") -----------------------------------------

def channel_of(web: Web, kind: str, name: str) -> ChannelEntry:
    entry = next((e for e in web.deps.config.channels if e.name == name and e.kind == kind), None)
    if entry is None:
        raise NotFound(f"no {kind} channel {name!r} in outpost.toml")
    return entry


async def channel_body(web: Web, name: str, body: bytes) -> dict[str, Any] | None:
    """The request's JSON object, or None (the refusal recorded)."""
    with contextlib.suppress(ValueError, RecursionError):
        if isinstance(parsed := json.loads(body), dict):
            return parsed
    await web.call(web.store.channels.refuse, name, "body is not a JSON object", web.request.remote_addr,
                   len(body), web.now)
    return None


async def channel_refused(web: Web, name: str, reason: str, body: bytes):
    log.getChild("channels").warning("channel %s refused a delivery from %s (%d bytes): %s", name,
                                     web.request.remote_addr, len(body), reason)
    await web.call(web.store.channels.refuse, name, reason, web.request.remote_addr, len(body), web.now)
    return problem_response(WebhookRefused(f"channel delivery refused: {reason}"))


async def channel_received(web: Web, name: str, message: ChannelMessage) -> dict[str, Any]:
    """The message as a comment (or a duplicate), logged: the first step of its journey."""
    taken = await web.commit(web.store.channels.receive, name, message, web.now)
    log.getChild("channels").info("channel %s delivery %s from %s: %s", name, message.delivery_id, message.sender,
                                  f"comment {taken['comment_id']} on task {taken['task_id']}"
                                  if taken["status"] == "comment" else taken["status"])
    return taken


@hooks.post("/api/channels/slack/<name>", auth=Auth.SIGNATURE, nudges=(Actor.CLAIM,))
async def hook_slack(web: Web, name: str):
    """Slack's Events API: signed (v0, within 300 s), ``url_verification`` answered with its
    challenge, a person's ``message`` in the channel a comment (by ``event_id`` once; Slack's
    own retries add nothing); anything else answered 200 and ignored, so Slack does not retry."""
    entry = channel_of(web, "slack", name)
    body = await web.request.get_data(cache=True)
    headers = {k.lower(): v for k, v in web.request.headers.items()}
    if reason := slack_refusal(entry.signing_secret, headers, body, web.now):
        return await channel_refused(web, name, reason, body)
    if (envelope := await channel_body(web, name, body)) is None:
        return problem_response(invalid("body", "must be a JSON object (a Slack event)"))
    if envelope.get("type") == "url_verification":
        return {"challenge": str(envelope.get("challenge", ""))[:200]}
    if (message := slack_message(envelope, entry.channel)) is None:
        return {"status": "ignored"}
    if await web.call(web.store.channels.delivered, name, message.delivery_id, web.now):
        return {"status": "duplicate"}   # Slack's retry: answered before any lookup
    sender = message.sender
    with trio.move_on_after(SLACK_NAME_LOOKUP_S):   # Slack waits 3 s for the answer, whatever users.info does
        sender = await trio.to_thread.run_sync(slack_user_name, web.deps.config, entry, message.sender,
                                               abandon_on_cancel=True)
    return await channel_received(web, name, dataclasses.replace(message, sender=sender))


@hooks.post("/api/channels/telegram/<name>", auth=Auth.SIGNATURE, nudges=(Actor.CLAIM,))
async def hook_telegram(web: Web, name: str):
    """A Telegram webhook update: its ``X-Telegram-Bot-Api-Secret-Token`` (setWebhook's
    ``secret_token``) compared in constant time; ``message.text`` from the chat a comment, by
    ``update_id`` once; anything else answered 200 and ignored (Telegram retries other answers)."""
    entry = channel_of(web, "telegram", name)
    body = await web.request.get_data(cache=True)
    given = web.request.headers.get("X-Telegram-Bot-Api-Secret-Token", "")
    if not hmac.compare_digest(given.encode(), entry.secret_token.encode()):
        return await channel_refused(web, name, "missing or wrong X-Telegram-Bot-Api-Secret-Token", body)
    if (update := await channel_body(web, name, body)) is None:
        return problem_response(invalid("body", "must be a JSON object (a Telegram update)"))
    if (message := telegram_message(update, entry.channel)) is None:
        return {"status": "ignored"}
    return await channel_received(web, name, message)


@office_api.get("/api/office/channels", auth=Auth.TOKEN)
async def office_channels(web: Web):
    return {"channels": await web.call(web.store.channels.states)}


@office_api.post("/api/office/channels/<name>/test", auth=Auth.TOKEN, status=202, nudges=(Actor.NOTIFY,))
async def office_channel_test(web: Web, name: str):
    return {"id": await web.commit(web.store.channels.queue_test, name, web.now)}


# --- agent API: /api/agent/ (a running Office agent, with its run token) --------------------------

def own_task(web: Web, raw: dict[str, Any]) -> str:
    task_id = raw.get("task_id") or web.agent["task_id"]
    if not isinstance(task_id, str) or not task_id:
        raise invalid("task_id", "this run has no task; name one")
    return task_id


@agent_api.post("/api/agent/needs-you", auth=Auth.ANY_RUN)
async def agent_needs_you(web: Web):
    """docs/agent-clis.md: the run asks a human; it settles ``needs_you`` with this question."""
    question = (await web.body()).get("question")
    if not isinstance(question, str) or not question.strip() or len(question) > MAX_TEXT_CHARS:
        raise invalid("question", f"the question, 1-{MAX_TEXT_CHARS} characters, is required")
    return await web.commit(web.store.runs.ask_human, web.agent["run_id"], question.strip(), web.now)


@agent_api.get("/api/agent/run", auth=Auth.ANY_RUN)
async def agent_run(web: Web):
    """Who this run token speaks for: ``outpost mcp`` offers an Office run's tools only when
    ``office`` is true (docs/agent-clis.md)."""
    return {**web.agent, "office": web.agent["agent_id"] is not None}


@agent_api.get("/api/agent/me", auth=Auth.RUN)
async def agent_me(web: Web):
    ctx = web.agent

    def me():
        view = {**ctx, "agent": web.store.office.get_agent(ctx["agent_id"])}
        if ctx["task_id"]:
            view["task"] = web.store.office.get_task(ctx["task_id"])
        return view
    return await web.call(me)


@agent_api.post("/api/agent/comments", auth=Auth.RUN, status=201, nudges=(Actor.CLAIM,))
async def agent_comment(web: Web):
    raw = await web.body()
    _unknown(raw, ("task_id", "body"), "a comment")
    return await web.commit(web.store.office.add_comment, own_task(web, raw), _text_field(raw, "body", MAX_TEXT_CHARS),
                            web.now, web.agent["agent_id"], web.agent["workspace_id"])


@agent_api.post("/api/agent/tasks/<task_id>/move", auth=Auth.RUN, nudges=(Actor.CLAIM,))
async def agent_move(web: Web, task_id: str):
    raw = await web.body()
    _unknown(raw, ("state",), "a move")
    return await web.commit(web.store.office.move_task, task_id, raw.get("state"), web.now,
                            by_agent=web.agent["agent_id"], workspace_id=web.agent["workspace_id"])


@agent_api.get("/api/agent/tasks", auth=Auth.RUN)
async def agent_list_tasks(web: Web):
    """The tasks of the run's workspace; ``assignee``: an agent's name or id."""
    state = web.choice_arg("state", TaskState)
    ws = web.agent["workspace_id"]

    def tasks():
        assignee = web.args.get("assignee")
        who = web.store.office.agent_ref(ws, assignee, "assignee") if assignee else None
        return {"tasks": web.store.office.list_tasks(ws, who, state)}
    return await web.call(tasks)


@agent_api.get("/api/agent/tasks/<task_id>", auth=Auth.RUN)
async def agent_get_task(web: Web, task_id: str):
    return await web.call(web.store.office.get_task, task_id, web.agent["workspace_id"])


#: What an agent may set on a task it creates: never its executor (which profile's command and
#: secrets serve it), workspace, workflow, project or state (a new task starts in TODO).
AGENT_TASK_FIELDS = ("title", "description", "assignee", "assignee_agent_id", "parent_id", "blocked_by",
                     "requires_approval", "reviewers")


def agent_refs(web: Web, raw: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """An agent's body with agents named by name or id (``names``: its key -> the stored field)
    turned into ids of its own workspace (a store call: run inside a transaction)."""
    out, ws = dict(raw), web.agent["workspace_id"]
    for key, field in names.items():
        if key not in out:
            continue
        value = out.pop(key)
        if isinstance(value, list):
            if len(value) > 10:
                raise invalid(key, "at most 10 agents")
            out[field] = [web.store.office.agent_ref(ws, v, f"{key}[{i}]") for i, v in enumerate(value)]
        else:
            out[field] = None if value is None else web.store.office.agent_ref(ws, value, key)
    return out


@agent_api.post("/api/agent/tasks", auth=Auth.RUN, status=201, nudges=(Actor.CLAIM,))
async def agent_create_task(web: Web):
    """A task (a subtask with ``parent_id``), its assignee and reviewers named by name or id."""
    raw = await web.body()
    _unknown(raw, AGENT_TASK_FIELDS, "an agent's task")

    def create():
        named = agent_refs(web, {"parent_id": web.agent["task_id"], **raw},
                           {"assignee": "assignee_agent_id", "reviewers": "reviewers"})
        fields = normalize_task(named, profiles=web.profile_names)
        return web.store.office.create_task(web.agent["workspace_id"], fields, web.now, web.agent["agent_id"])
    return await web.commit(create)


@agent_api.post("/api/agent/approvals", auth=Auth.RUN, status=201, nudges=(Actor.CLAIM,))
async def agent_request_approval(web: Web):
    raw = await web.body()
    _unknown(raw, ("task_id", "note", "reviewers"), "an approval request")
    if raw.get("reviewers") is not None and not isinstance(raw["reviewers"], list):
        raise invalid("reviewers", "must be a list of agent names or ids")
    note = _text(raw, "note", 0, MAX_TEXT_CHARS, "")

    def request():
        reviewers = agent_refs(web, {"reviewers": raw.get("reviewers") or []}, {"reviewers": "reviewers"})
        return web.store.office.request_approval(own_task(web, raw), web.agent["agent_id"], note, web.now,
                                                 web.agent["workspace_id"], reviewers["reviewers"])
    return await web.commit(request)


@agent_api.post("/api/agent/wake", auth=Auth.RUN, status=202, nudges=(Actor.CLAIM,))
async def agent_self_wake(web: Web):
    raw = await web.body()
    _unknown(raw, ("reason", "payload", "delay_sec", "agent"), "a wake")
    payload = raw.get("payload")
    if payload is not None and not isinstance(payload, dict):
        raise invalid("payload", "must be an object or null")
    delay = _int(raw.get("delay_sec", 0), "delay_sec", 0, 7 * DAY_S)
    reason, now, me, ws = _text_field(raw, "reason", 200), web.now, web.agent["agent_id"], web.agent["workspace_id"]
    wake_at = now + timedelta(seconds=delay) if delay else None

    def wake():
        """Itself (source self), or another agent of its workspace, as a mention would (source user)."""
        target = web.store.office.agent_ref(ws, raw["agent"], "agent") if raw.get("agent") is not None else me
        if target == me:
            return web.store.office.wake_agent(me, WakeupSource.SELF, {"reason": reason, "payload": payload}, now,
                                               wake_at=wake_at, workspace_id=ws)
        return web.store.office.wake_agent(target, WakeupSource.USER, {"user_id": f"agent:{me}", "context": reason},
                                           now, reason=reason, wake_at=wake_at, workspace_id=ws)
    return await web.commit(wake)


###############################################################################
# 21. Web: the dashboard: form and view helpers, template filters, every page, and
#     create_app.
###############################################################################

# --- dashboard: template filters and view helpers -------------------------------------------------

def local_time(instant: str | datetime | None, tz_name: str = "UTC", *, seconds: bool = False) -> str:
    """An instant in a schedule's timezone with its offset: ``2026-11-30 09:05 CET (+01:00)``
    (``09:05:12`` with ``seconds``: a run's own instants, which are seconds apart)."""
    if not instant:
        return "-"
    dt = parse_instant(instant) if isinstance(instant, str) else instant
    local = dt.astimezone(ZoneInfo(tz_name))
    offset = local.strftime("%z")
    return f"{local:%Y-%m-%d %H:%M{':%S' if seconds else ''}} {local.tzname()} ({offset[:3]}:{offset[3:]})"


def schedule_state(s: dict[str, Any]) -> str:
    if s["archived"]:
        return "archived"
    if s["auto_paused"]:
        return "auto-paused"
    return "enabled" if s["enabled"] else "paused"


def definition_from_form(form: dict[str, str]) -> dict[str, Any]:
    """The dashboard's compose form -> a raw definition (validation is normalize_definition's)."""
    def number(name: str, default: str = "") -> Any:
        text = (form.get(name) or default).strip()
        return int(text) if re.fullmatch(r"-?\d{1,12}", text) else text

    kind = form.get("timing_kind", "cron")
    timing: dict[str, Any] = {"kind": kind, "timezone": form.get("timezone", "").strip()}
    if kind == "cron":
        timing["expression"] = form.get("expression", "")
    elif kind == "interval":
        amount, unit = number("interval_amount"), INTERVAL_UNITS.get(form.get("interval_unit", ""), 1)
        timing["seconds"] = amount * unit if isinstance(amount, int) else amount
    else:
        timing["at"] = form.get("at", "")
    catch_up: dict[str, Any] = {"policy": form.get("catch_up_policy", "enqueue_missed_with_cap")}
    if catch_up["policy"] == "enqueue_missed_with_cap":
        catch_up["max"] = number("catch_up_max", "1")
    return {
        "name": form.get("name", ""), "brief": form.get("brief", "").replace("\r\n", "\n"),
        "repository": form.get("repository", "").strip(), "workdir": form.get("workdir", "").strip() or ".",
        "source_ref": form.get("source_ref", "").strip() or "HEAD", "agent": form.get("agent", "demo"),
        "timing": timing,
        "limits": {"timeout_seconds": number("timeout_seconds", "3600"), "model": form.get("model") or None},
        "notify": form.get("notify", "attention"),
        "concurrency_policy": form.get("concurrency_policy", "skip_if_active"),
        "catch_up": catch_up, "skip_if_unchanged": form.get("skip_if_unchanged") == "yes",
        "mute": [k for k in MUTABLE_ATTENTION_KINDS if form.get(f"mute_{k}") == "yes"]}


def form_from_definition(d: dict[str, Any]) -> dict[str, str]:
    """A stored definition -> the compose form's fields (for edit)."""
    t = d["timing"]
    form = {k: str(d[k]) for k in ("name", "brief", "repository", "workdir", "source_ref", "agent", "notify",
                                   "concurrency_policy")}
    form |= {"timing_kind": t["kind"], "timezone": t["timezone"], "expression": t.get("expression", ""),
             "timeout_seconds": str(d["limits"]["timeout_seconds"]), "model": d["limits"]["model"] or "",
             "catch_up_policy": d["catch_up"]["policy"], "catch_up_max": str(d["catch_up"].get("max", 1)),
             "skip_if_unchanged": "yes" if d.get("skip_if_unchanged") else ""}
    form |= {f"mute_{k}": "yes" for k in d.get("mute", [])}
    if t["kind"] == "interval":
        unit = next(u for u, n in reversed(INTERVAL_UNITS.items()) if t["seconds"] % n == 0)
        form |= {"interval_amount": str(t["seconds"] // INTERVAL_UNITS[unit]), "interval_unit": unit}
    if t["kind"] == "once":
        form["at"] = parse_instant(t["at"]).astimezone(ZoneInfo(t["timezone"])).strftime("%Y-%m-%dT%H:%M")
    return form


INTERVAL_UNITS = {"seconds": 1, "minutes": MINUTE_S, "hours": HOUR_S, "days": DAY_S}
#: The wakeup list's badge for a wakeup that ended without its run (docs/office.md, "The wakeup lifecycle").
CANCEL_LABELS = {CancelReason.ASSIGNEE_CHANGED: "Cancelled - assignee changed",
                 CancelReason.TASK_TERMINAL: "Cancelled - task completed",
                 CancelReason.RETRY_TASK_CANCELLED: "Cancelled - task cancelled",
                 CancelReason.RETRY_STALE_ASSIGNEE: "Cancelled - retry stale",
                 CancelReason.TASK_NOT_FOUND: "Cancelled - task not found",
                 CancelReason.REVIEW_PARTICIPANT_CHANGED: "Cancelled - reviewer changed"}


def curl_example(url: str, mode: str) -> str:
    """A copyable curl command that fires a webhook trigger with a valid signature."""
    body = '{"branch": "main"}'
    if mode == "none":
        return f"curl -X POST {url} -H 'Content-Type: application/json' -d '{body}'"
    if mode == "bearer":
        return (f"curl -X POST {url} -H \"Authorization: Bearer $SECRET\" -H 'Content-Type: application/json' "
                f"-d '{body}'")
    if mode == "github":
        return (f"BODY='{body}'; SIG=$(printf %s \"$BODY\" | openssl dgst -sha256 -hmac \"$SECRET\" | sed 's/^.* //')\n"
                f"curl -X POST {url} -H \"X-Hub-Signature-256: sha256=$SIG\" -H \"X-GitHub-Delivery: $(uuidgen)\" "
                f"-H 'Content-Type: application/json' -d \"$BODY\"")
    return (f"BODY='{body}'; T=$(date +%s); SIG=$(printf %s \"$T.$BODY\" | openssl dgst -sha256 -hmac \"$SECRET\" "
            f"| sed 's/^.* //')\ncurl -X POST {url} -H \"X-Outpost-Signature: t=$T,v1=$SIG\" "
            f"-H 'Content-Type: application/json' -d \"$BODY\"")


def wakeup_label(w: dict[str, Any]) -> str:
    if w["status"] == WakeupStatus.CANCELLED:
        return CANCEL_LABELS.get(w["cancel_reason"], "Cancelled")
    if w["status"] == WakeupStatus.QUEUED and (w["last_error"] or "").startswith(REPOSITORY_UNAVAILABLE):
        return "Waiting for its repository"
    if w["status"] == WakeupStatus.QUEUED and w["scheduled_retry_at"]:
        return f"Retry {w['retry_count']}/{MAX_RETRY_COUNT} scheduled"
    if w["status"] == WakeupStatus.QUEUED and w["wake_at"]:
        return "Waiting to wake"
    if w["status"] == WakeupStatus.COALESCED:
        return f"Merged into {w['coalesced_into'][-6:]}"
    if w["status"] == WakeupStatus.FINISHED and not w["run_id"]:
        return "Finished, no run"   # idle-skipped or its routine paused: the note says which
    if w["reason"] == "recovery" and w["status"] in (WakeupStatus.CLAIMED, WakeupStatus.FINISHED):
        return "Recovered"
    return w["status"].capitalize()


#: A webhook trigger's signing modes in the words of the routine forms' menus.
SIGNING_WORDS = {"hmac_sha256": "signed with HMAC-SHA256 (X-Outpost-Signature)",
                 "github": "signed as GitHub signs (X-Hub-Signature-256)",
                 "bearer": "a bearer token (Authorization header)",
                 "none": "unsigned: anyone with its URL can fire it"}


def next_fire_tag(instant: str | datetime | None, state: str, tz_name: str | None = None):
    """A next fire as a list or a page shows it: the instant (``time_tag``) while the schedule
    is enabled or the routine active, else the state ("paused", "archived", "off"): a paused
    one's stored next fire is not when it fires."""
    from markupsafe import Markup
    if state not in ("enabled", RoutineStatus.ACTIVE):
        return Markup('<span class="muted" data-next-fire="{0}">{0}</span>').format(state.replace("_", " "))
    return time_tag(instant, tz_name)


@functools.cache
def zone_names() -> list[str]:
    """The IANA zones the dashboard's pickers offer."""
    import zoneinfo
    return sorted(z for z in zoneinfo.available_timezones() if "/" in z or z == "UTC")


def time_tag(instant: str | datetime | None, tz_name: str | None = None, *, seconds: bool = False):
    """An instant as a ``<time>`` element. Without a zone (lists): ``data-rel``, which
    static/outpost.js turns into "3 min ago" with the exact instant in the viewer's zone on
    hover; without JavaScript it reads in UTC. With a zone (a schedule's own page): the
    instant in that zone, the exact second and the zone's name on hover."""
    from markupsafe import Markup
    if not instant:
        return "-"
    dt = (parse_instant(instant) if isinstance(instant, str) else instant).astimezone(UTC)
    iso = f"{dt:%Y-%m-%dT%H:%M:%SZ}"
    if tz_name is None:
        return Markup('<time datetime="{}" title="{}" data-rel>{}</time>').format(
            iso, f"{dt:%Y-%m-%d %H:%M:%S} UTC", f"{dt:%Y-%m-%d %H:%M} UTC")
    local = dt.astimezone(ZoneInfo(tz_name))
    return Markup('<time datetime="{}" title="{}">{}</time>').format(
        iso, f"{local:%Y-%m-%d %H:%M:%S} {local.tzname()} ({tz_name})", local_time(dt, tz_name, seconds=seconds))


def words_of_seconds(seconds: float) -> str:
    """A duration as the dashboard shows it: ``45 s``, ``1 m 12 s``, ``3 h 5 m``, ``2 d 4 h``
    (static/outpost.js has the same rule for a run still going)."""
    s = int(seconds)
    if s < 1:
        return "< 1 s"
    for unit, size, small, small_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if s >= size:
            rest = (s % size) // small_size
            return f"{s // size} {unit}" + (f" {rest} {small}" if rest else "")
    return f"{s} s"


def run_duration(run: dict[str, Any]):
    """How long a run took (started to finished); one still going counts on in the page."""
    from markupsafe import Markup
    def instant(value: str | datetime) -> datetime:
        return parse_instant(value) if isinstance(value, str) else value
    if not run.get("started_at"):
        return "-"
    started = instant(run["started_at"])
    if run.get("finished_at"):
        return words_of_seconds((instant(run["finished_at"]) - started).total_seconds())
    so_far = words_of_seconds((datetime.now(UTC) - started).total_seconds())
    return Markup('<span data-since="{}">{}</span>').format(f"{started.astimezone(UTC):%Y-%m-%dT%H:%M:%SZ}", so_far)


TEMPLATE_FILTERS: dict[str, Callable[..., Any]] = {
    "local": local_time, "timing_words": describe_timing, "state": schedule_state,
    "when": time_tag, "at": time_tag, "duration": run_duration,
    "pretty": lambda v: json.dumps(v, indent=2, ensure_ascii=False), "wakeup_label": wakeup_label,
    "curl_example": curl_example, "next_fire": next_fire_tag,
    "usd": format_usd, "counted": lambda n, noun: f"{n} {noun}{'' if n == 1 else 's'}",
    "tokens": lambda v: "-" if v is None else f"{v / 1000:,.1f}k" if v >= 1000 else str(v),
    "size": lambda v: "-" if v is None else next(f"{v / 1024 ** i:,.1f} {unit}" if i else f"{v:,} {unit}"
                                                 for i, unit in enumerate(("B", "KiB", "MiB", "GiB", "TiB"))
                                                 if v < 1024 ** (i + 1) or unit == "TiB")}
#: A folded attention item's "and 12 more runs returned changes", by kind.
FOLD_WORDS = {"changes_returned": ("run returned changes", "runs returned changes"),
              "succeeded": ("run succeeded", "runs succeeded"), "failed": ("run failed", "runs failed"),
              "missed_fire": ("missed fire", "missed fires"), "agent_error": ("failure", "failures")}
#: Constants the templates use, so a status set is spelled once.
TEMPLATE_GLOBALS = {"ACTIVE_RUN_STATUSES": ACTIVE_RUN_STATUSES, "TERMINAL_TASK_STATES": TERMINAL_TASK_STATES,
                    "MUTABLE_ATTENTION_KINDS": MUTABLE_ATTENTION_KINDS, "FOLD_WORDS": FOLD_WORDS,
                    "UPCOMING_MAX_EACH": UPCOMING_MAX_EACH,
                    "POLICY_WORDS": POLICY_WORDS, "SIGNING_WORDS": SIGNING_WORDS,
                    "NO_REPORT": {**{f: None for f in REPORT_FIELDS}, "limit": None, "failure_kind": None}}


# --- dashboard: sign-in ---------------------------------------------------------------------------

def same_origin_path(target: str) -> str:
    """Where signing in may send the browser: ``target`` when it is a path of this origin, else
    ``/``. Browsers read ``//host`` and ``/\\host`` as another origin and drop tabs and line
    breaks before parsing, so none of those pass (nor any backslash)."""
    if target.startswith("/") and target[1:2] != "/" and "\\" not in target and not any(map(is_control, target)):
        return target
    return "/"


async def signed_in_response(web: Web, target: str):
    from quart import redirect
    cookie, _ = await web.call(web.store.access.create_session, web.now)
    response = redirect(same_origin_path(target), 303)
    response.set_cookie(SESSION_COOKIE, cookie, max_age=SESSION_TTL_S, httponly=True, samesite="Strict", path="/")
    return response


@pages.get("/signin", auth=Auth.PUBLIC)
async def page_signin(web: Web):
    return await web.page("signin.html", next=web.args.get("next", "/schedules"))


@pages.post("/signin", auth=Auth.PUBLIC)
async def page_signin_post(web: Web):
    check_same_origin(web.request)   # no login CSRF
    form = await web.form()
    token = form.get("token", "").strip()
    if not token or not hmac.compare_digest(token.encode(), web.deps.token.encode()):
        log.getChild("web").warning("dashboard sign-in refused from %s", web.request.remote_addr)
        return await web.page("signin.html", status=401, next=form.get("next", "/schedules"),
                              error="That is not the API token. `outpost token` prints it.")
    return await signed_in_response(web, form.get("next", "/schedules"))


@pages.get("/signin/<code>", auth=Auth.PUBLIC)
async def page_signin_link(web: Web, code: str):
    if not await web.call(web.store.access.use_signin_code, code, web.now):
        return await web.page("signin.html", status=401, next="/schedules",
                              error="This sign-in link was used already or has expired. Paste the token.")
    return await signed_in_response(web, "/schedules")


@pages.post("/signout", auth=Auth.SESSION)
async def page_signout(web: Web):
    from quart import redirect
    await web.call(web.store.access.end_session, web.request.cookies.get(SESSION_COOKIE, ""))
    response = redirect("/signin", 303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


# --- dashboard: schedules -------------------------------------------------------------------------

def errors_by_field(err: OutpostError) -> dict[str, str]:
    return {e["field"]: e["message"] for e in err.errors} or {"form": err.detail}


def form_context(web: Web, form: dict[str, str], errors: dict[str, str], **extra: Any) -> dict[str, Any]:
    return {"form": form, "errors": errors, "zones": zone_names(), "agents": web.profile_names,
            "units": list(INTERVAL_UNITS), **extra}


def form_revision(form) -> int:
    try:
        return int(form.get("revision", ""))
    except ValueError:
        raise invalid("revision", "the form has no revision; reload the page") from None


@pages.get("/", auth=Auth.SESSION)
async def page_home(web: Web):
    from quart import redirect
    return redirect("/schedules")


@pages.get("/schedules", auth=Auth.SESSION)
async def page_schedules(web: Web):
    show_archived = web.args.get("archived") == "1"
    page = parse_count(web.args.get("page")) or 1
    state, sort = web.choice_arg("state", SCHEDULE_STATES), web.choice_arg("sort", ("created", "next_fire"))
    listed = await web.call(web.store.schedules.schedules_page, show_archived, page, state, sort == "next_fire")
    query = {k: v for k, v in (("archived", "1" if show_archived else ""), ("state", state), ("sort", sort)) if v}
    return await web.page("schedules.html", section="schedules", live=True, **listed, show_archived=show_archived,
                          page=page, pages=max(1, math.ceil(listed["total"] / SCHEDULES_PAGE)),
                          per_page=SCHEDULES_PAGE, state_filter=state, sort=sort or "created", query=query,
                          states=SCHEDULE_STATES)


@pages.get("/schedules/new", auth=Auth.SESSION)
async def page_new_schedule(web: Web):
    defaults = {"timing_kind": "cron", "expression": "0 9 * * 1-5", "timezone": "UTC", "agent": "demo",
                "brief": "Say hello and leave a note.\n@print hello from {{date}}\n@commit notes.txt hello",
                "timeout_seconds": "3600", "notify": "attention", "concurrency_policy": "skip_if_active",
                "catch_up_policy": "enqueue_missed_with_cap", "catch_up_max": "1", "workdir": ".",
                "source_ref": "HEAD", "interval_amount": "1", "interval_unit": "hours"}
    return await web.page("schedule_form.html", section="schedules", **form_context(web, defaults, {}, edit=None))


async def review_page(web: Web, form: dict[str, str], edit: dict[str, Any] | None):
    """The compose step of the dashboard: the normalized definition, its fires and warnings."""
    current = edit["definition"] if edit else None
    raw, errors = definition_from_form(form), FieldErrors()
    with errors.check():
        definition = await checked_definition(web.deps, raw, current)
    if isinstance(raw["name"], str) and raw["name"].strip() and "name" not in {e["field"] for e in errors.errors}:
        try:   # a name another schedule has is told now, with the rest, not only at Confirm
            await web.call(web.store.schedules.check_name_free, raw["name"].strip(), edit["id"] if edit else None)
        except Conflict as err:
            errors.errors[:0] = err.errors
    try:
        errors.raise_any()
    except OutpostError as err:
        return await web.page("schedule_form.html", status=422, section="schedules",
                              **form_context(web, form, errors_by_field(err), edit=edit))
    now = web.now
    fires = next_fires(definition["timing"], now, 5, anchor=now)
    return await web.page(
        "schedule_review.html", section="schedules", definition=definition, edit=edit,
        definition_json=canonical_json(definition), confirmation=confirmation_of(definition),
        summary=schedule_summary(definition, fires[0] if fires else None),
        fires=[local_time(f, definition["timing"]["timezone"]) for f in fires],
        warnings=timing_warnings(definition["timing"], now, definition_from_form(form)["timing"]), form=form)


@pages.post("/schedules/review", auth=Auth.SESSION)
async def page_review_new(web: Web):
    return await review_page(web, dict((await web.form()).items()), None)


def reviewed_definition(form: dict[str, str]) -> Any:
    """The definition the review step showed, carried by its Confirm form."""
    try:
        return json.loads(form.get("definition", ""))
    except ValueError:
        raise invalid("definition", "the reviewed definition is missing; compose it again") from None


def in_full(web: Web, reviewed: Any) -> dict[str, Any]:
    """A reviewed definition with every field, as its check filled it in, for a form or a diff
    drawn after the action refused it (a forged form need not carry them all)."""
    return normalize_definition(reviewed, web.now, agents=web.profile_names, check_past=False)


@pages.post("/schedules", auth=Auth.SESSION, nudges=(Actor.CRON,))
async def page_confirm_new(web: Web):
    form = dict((await web.form()).items())
    reviewed = reviewed_definition(form)
    try:
        created = await create_schedule(web, reviewed, form.get("confirmation"))
    except Conflict as err:
        return await web.page("schedule_form.html", status=409, section="schedules",
                              **form_context(web, form_from_definition(in_full(web, reviewed)), errors_by_field(err),
                                             edit=None))
    return await web.see_other(f"/schedules/{created['id']}?done=created")


@pages.get("/schedules/<schedule_id>", auth=Auth.SESSION)
async def page_schedule(web: Web, schedule_id: str):
    def data():
        return (web.store.schedules.get_schedule(schedule_id), web.store.schedules.occurrences(schedule_id, 50),
                web.store.runs.list_runs(schedule_id, None, 20, None)["runs"], web.store.schedules.inspect(schedule_id))
    schedule, ledger, runs, report = await web.call(data)
    tz = schedule["timing"]["timezone"]
    chart = await runs_chart(web, f"Runs of {schedule['name']} per day, last 30 days", tz, schedule_id=schedule_id)
    return await web.page("schedule.html", section="schedules", live=True, s=schedule, ledger=ledger,
                          runs=runs, checks=report["checks"], verdict=report["verdict"], tz=tz,
                          chart=chart)


@pages.get("/schedules/<schedule_id>/edit", auth=Auth.SESSION)
async def page_edit_schedule(web: Web, schedule_id: str):
    current = await web.call(web.store.schedules.schedule_definition, schedule_id)
    if current["archived"]:
        raise Archived(f"schedule {schedule_id} is archived; create a new one instead")
    edit = {"id": schedule_id, "revision": current["revision"], "definition": current["definition"]}
    form = form_from_definition(current["definition"])
    muting = web.args.get("mute")
    if muting in MUTABLE_ATTENTION_KINDS:   # an attention item's "mute these": the form says what it ticked
        form[f"mute_{muting}"] = "yes"
    return await web.page("schedule_form.html", section="schedules", **form_context(web, form, {}, edit=edit),
                          muting=muting if muting in MUTABLE_ATTENTION_KINDS else None)


def edit_from(schedule_id: str, form: dict[str, str]) -> dict[str, Any]:
    try:
        base = json.loads(form.get("base", ""))
        revision = int(form.get("revision", ""))
    except ValueError:
        base = None
    if not isinstance(base, dict) or not isinstance(base.get("timing"), dict):
        raise invalid("revision", "the edit form is incomplete; open Edit again")
    return {"id": schedule_id, "revision": revision, "definition": base}


@pages.post("/schedules/<schedule_id>/review", auth=Auth.SESSION)
async def page_review_edit(web: Web, schedule_id: str):
    form = dict((await web.form()).items())
    return await review_page(web, form, edit_from(schedule_id, form))


@pages.post("/schedules/<schedule_id>", auth=Auth.SESSION, nudges=(Actor.CRON,))
async def page_confirm_edit(web: Web, schedule_id: str):
    form = dict((await web.form()).items())
    edit = edit_from(schedule_id, form)
    reviewed = reviewed_definition(form)
    try:
        await update_schedule(web, schedule_id, edit["revision"], lambda _stored: reviewed, form.get("confirmation"))
    except RevisionMismatch:
        current, yours = await web.call(web.store.schedules.get_schedule, schedule_id), in_full(web, reviewed)
        diff = [{"field": f, "base": edit["definition"].get(f), "now": current.get(f), "yours": yours.get(f)}
                for f in sorted(DEFINITION_FIELDS)   # skip_if_unchanged is only there when true
                if edit["definition"].get(f) != current.get(f) or yours.get(f) != current.get(f)]
        return await web.page("schedule_stale.html", status=412, section="schedules", s=current, edit=edit,
                              diff=diff)
    return await web.see_other(f"/schedules/{schedule_id}?done=updated")


@pages.post("/schedules/<schedule_id>/control", auth=Auth.SESSION)
async def page_schedule_control(web: Web, schedule_id: str):
    form = await web.form()
    action = form.get("action", "")
    result = await control_schedule(web, schedule_id, form_revision(form), action)
    if action == "fire" and result["outcome"] == SlotOutcome.ADMITTED:   # Fire now: on to the new run, live
        return await web.see_other(f"/runs/{result['run_id']}?done=admitted")
    later = action == "approve_catch_up" and result["outcome"] == SlotOutcome.SKIPPED_OVERLAP
    done = result["outcome"] if action == "fire" else "approve_catch_up_later" if later else action
    return await web.see_other(f"/schedules/{schedule_id}?done={done}")


# --- dashboard: runs and attention ----------------------------------------------------------------

@pages.get("/runs", auth=Auth.SESSION)
async def page_runs(web: Web):
    """Every run, newest first, with the API's filters in the URL (a filtered view is a bookmark);
    the date boxes read in the viewer's zone, which the page's script puts in ``tz``."""
    query = {k: web.args.get(k, "") for k in ("schedule_id", "status", "agent", "trigger", "since", "until", "q", "tz")
             if web.args.get(k)}
    try:
        found = run_filters(web.args, web.profile_names, zone(web.args.get("tz") or "UTC", "tz"))
        refused: list[dict[str, str]] = []
        page = await web.call(web.store.runs.list_runs, found["schedule_id"], found["status"], 50,
                              web.args.get("before") or None, **{k: v for k, v in found.items()
                                                                 if k not in ("schedule_id", "status")})
    except ValidationFailed as bad:   # a mistyped bookmark: the page says which filter, with the form to fix it
        found = dict.fromkeys(("schedule_id", "status", "agent", "trigger", "since", "until", "q"))
        refused, page = bad.errors or [{"field": "query", "message": bad.detail}], {"runs": [], "next": None}
    chart = await runs_chart(web, "Runs per day, last 30 days (UTC)", "UTC",
                             **({"schedule_id": found["schedule_id"]} if found["schedule_id"] else {}))
    return await web.page("runs.html", section="runs", live=True, runs=page["runs"], next=page["next"],
                          schedules=await web.call(web.store.schedules.schedule_zones), filters=found, query=query,
                          schedule_id=found["schedule_id"], status_filter=found["status"],
                          statuses=[s.value for s in RunStatus], agents=sorted(web.profile_names),
                          triggers=RUN_TRIGGERS, chart=chart, refused=refused, status=422 if refused else 200)


@pages.post("/runs/bulk", auth=Auth.SESSION)
async def page_runs_bulk(web: Web):
    """Cancel or re-run the runs ticked on the Runs page; each one's outcome shows there once."""
    form = await web.form()
    action = form.get("action", "")
    if action not in ("cancel", "rerun"):
        raise invalid("action", "must be cancel or rerun")
    answer = await act_on_runs(web, action, selected_ids({"ids": form.getlist("ids")}))
    back = form.get("back", "")   # the filtered list it was posted from: only ever a query of /runs
    return await web.see_other(back if re.fullmatch(r"/runs\?[\w.~%&=+:-]*", back, re.ASCII) else "/runs",
                               bulk=answer["results"], bulk_action=action)


async def run_log_blocks(deps: Deps, run_id: str, tz: str) -> tuple[str, int, list[tuple[str, str]]]:
    """The run page's log read once: its text, its size (where following it live goes on) and its
    blocks of lines by the second they began in ``tz`` (timed_log). A log only the database keeps (a
    fleet: another node ran it) shows without times: they stay beside the file on that node."""
    data = await run_log_bytes(deps, run_id)
    path = deps.log_path(run_id)
    blocks = await trio.to_thread.run_sync(lambda: timed_log(data, read_line_times(path), tz))
    return data.decode(errors="replace"), len(data), blocks


async def run_transcript(web: Web, run: dict[str, Any], log_text: str) -> dict[str, Any] | None:
    """A settled run's log as a transcript (its CLI's format: the report's, else its profile's),
    or None (the raw log only). A running run's log stays raw: the page appends to it live."""
    if run["status"] in ACTIVE_RUN_STATUSES or not log_text:
        return None
    profile = web.deps.profiles.get(run["agent"])
    fmt = (run["agent_report"] or {}).get("format") or (profile.preset if profile else None)
    return await trio.to_thread.run_sync(transcript, log_text, fmt)


#: A run's steps in the run page's words (RUN_STEPS).
STEP_WORDS = {"queued": "Queued", "worktree_ready": "Worktree ready", "agent_started": "Agent started",
              "first_output": "First output", "agent_exited": "Agent exited", "branch_back": "Branch brought back",
              "settled": "Settled"}


def gap_words(seconds: float) -> str:
    """A step's distance from the one before: tenths under a minute (a worktree is ready in 0.4 s),
    then as words_of_seconds."""
    if seconds < 10:
        return f"{seconds:.2f} s" if seconds < 1 else f"{seconds:.1f} s"
    return words_of_seconds(seconds) if seconds >= 60 else f"{seconds:.0f} s"


def run_timeline(steps: list[dict[str, str]], tz: str) -> list[dict[str, Any]]:
    """The run page's timeline: each step in ``tz`` to the millisecond, with the time since the
    step before and since the run was queued."""
    rows: list[dict[str, Any]] = []
    for step in steps:
        at = parse_instant(step["at"])
        local = at.astimezone(ZoneInfo(tz))
        first = parse_instant(steps[0]["at"])
        rows.append({"step": step["step"], "words": STEP_WORDS.get(step["step"], step["step"]), "at": step["at"],
                     "shown": f"{local:%H:%M:%S}.{local.microsecond // 1000:03d}",
                     "since_previous": gap_words((at - parse_instant(rows[-1]["at"])).total_seconds()) if rows else "",
                     "since_queued": gap_words((at - first).total_seconds())})
    return rows


def run_gaps(run: dict[str, Any]) -> dict[str, str]:
    """The run page's distances between its instants: due to queued (``late``), queued to started
    (``waited``)."""
    def between(a: str | None, b: str | None) -> str:   # "" for none (a manual fire is due when queued)
        seconds = (parse_instant(b) - parse_instant(a)).total_seconds() if a and b else 0
        return gap_words(seconds) if seconds > 0 else ""
    return {"late": between(run["due_at"], run["queued_at"]), "waited": between(run["queued_at"], run["started_at"])}


def queue_notice(done: str, run: dict[str, Any]) -> str:
    """A ``?done=`` notice that speaks of the queue says so only while the run is queued: the page
    refreshes live, and once the run has started the notice says that instead."""
    return done if done not in ("admitted", "rerun") or run["status"] == RunStatus.QUEUED else f"{done}_started"


@pages.get("/runs/<run_id>", auth=Auth.SESSION)
async def page_run(web: Web, run_id: str):
    """One page per run. An Office run's also has the Office tabs (its prompt, result JSON and
    context) and links to its agent, task and wakeup; /office/runs/<id> comes here."""
    run = await web.call(web.store.runs.get_run, run_id)
    office = None
    if run["trigger"] == "wakeup":
        with contextlib.suppress(NotFound):   # a wakeup run is an Office run; its row is its own
            office = await web.call(web.store.office.office_run, run_id)
    name, tz = (await web.call(web.store.schedules.schedule_zones)).get(run["schedule_id"], ("dispatch", "UTC"))
    if office is not None:
        tz = (await web.call(web.store.office.office_settings, office["workspace_id"]))["timezone"]
    log_text, log_size, log_blocks = await run_log_blocks(web.deps, run_id, tz)
    log_transcript = await run_transcript(web, run, log_text)
    changes, files, cut = "", [], False
    if run["changes"]["commits"] and run["resolved_commit"]:
        local = web.deps.mirrors.path(run["repository"])
        changes = await changes_summary(local, run["resolved_commit"], run["result_branch"])
        files, cut = await branch_diff(local, run["resolved_commit"], run["result_branch"])
    thread = await web.call(web.store.runs.thread, run_id) if run["continues"] or run["answered_by"] else []
    context = dict(run=run, schedule_name=name, log_text=log_text, log_size=log_size, log_blocks=log_blocks,
                   log_tz=tz, changes=changes, files=files,
                   diff_cut=cut, transcript=log_transcript, raw=web.args.get("raw") == "1", thread=thread,
                   office=office, done=queue_notice(web.args.get("done", ""), run), gaps=run_gaps(run),
                   live=run["status"] in ACTIVE_RUN_STATUSES)
    if office is not None:
        return await office_page(web, "run.html", tab="agents", timeline=run_timeline(run["steps"], tz), **context)
    return await web.page("run.html", section="runs", tz=tz, timeline=run_timeline(run["steps"], tz), **context)


@pages.get("/runs/<run_id>/log", auth=Auth.SESSION)
async def page_run_log(web: Web, run_id: str):
    """The raw log as a download, under the session cookie (the API's log route is for tokens and
    for following; this one names the file)."""
    from quart import Response
    await web.call(web.store.runs.get_run, run_id)
    text, _ = await run_log(web.deps, run_id)
    return Response(text, content_type="text/plain; charset=utf-8",
                    headers={"Content-Disposition": f'attachment; filename="{run_id}.log"',
                             "Cache-Control": "no-store"})


@pages.post("/runs/<run_id>/rerun", auth=Auth.SESSION, nudges=(Actor.CLAIM,))
async def page_run_rerun(web: Web, run_id: str):
    again = await web.commit(web.store.runs.rerun, run_id, web.now)
    return await web.see_other(f"/runs/{again['run_id']}?done=rerun")


@pages.get("/runs/<run_id>/compare", auth=Auth.SESSION)
async def page_compare(web: Web, run_id: str):
    a = await web.call(web.store.runs.run_facts, run_id)
    other = web.args.get("with") or a["rerun_of"] or ""
    candidates = [r for r in (await web.call(web.store.runs.list_runs, a["schedule_id"], None, 20, None))["runs"]
                  if r["id"] != run_id] if a["schedule_id"] else []
    b = await web.call(web.store.runs.run_facts, other) if other else None
    report, files = await compare_runs(a, b, web.deps.mirrors.path(a["repository"])) if b else (None, [])
    name, tz = (await web.call(web.store.schedules.schedule_zones)).get(a["schedule_id"], ("dispatch", "UTC"))
    return await web.page("compare.html", section="runs", a=a, b=b, report=report, files=files,
                          candidates=candidates, schedule_name=name, tz=tz)


@pages.post("/runs/<run_id>/adopt", auth=Auth.SESSION)
async def page_run_adopt(web: Web, run_id: str):
    await adopt_run(web, run_id, (await web.form()).get("workspace", ""))
    return await web.see_other(f"/runs/{run_id}?done=adopted")


@pages.post("/runs/<run_id>/reply", auth=Auth.SESSION)
async def page_run_reply(web: Web, run_id: str):
    form = await web.form()
    message = form.get("message", "").replace("\r\n", "\n")   # a textarea's line breaks are CRLF
    reply = await reply_to_run(web, run_id, message, form.get("workspace", "default"))
    return await web.see_other(f"/runs/{reply['run_id']}?done=replied")


@pages.get("/agents", auth=Auth.SESSION)
async def page_agents(web: Web):
    return await web.page("agents.html", section="agents", agents=await agents_overview(web),
                          nodes=await web.call(web.store.nodes.list_nodes), this_node=web.store.node,
                          fleet=web.store.dialect.fleet, tz=host_zone().key)


async def disk_use(deps: Deps) -> dict[str, int | None]:
    """Bytes on disk (docs/operations.md): the database (a fleet's, as its server counts it), run logs,
    worktrees and mirrors; the folders are walked on a worker thread, never on the event loop."""
    data = deps.config.data_dir
    if deps.store.dialect.fleet:
        database = await deps.transaction(deps.store.housekeeping.database_bytes)
    else:
        database = await trio.to_thread.run_sync(functools.partial(
            file_bytes, [Path(f"{deps.config.db_path}{tail}") for tail in ("", "-wal", "-shm")], remove=False))
    sizes = [await trio.to_thread.run_sync(tree_bytes, data / folder) for folder in ("runs", "worktrees", "mirrors")]
    return dict(zip(("database", "logs", "worktrees", "mirrors"), [database, *sizes], strict=True))


@pages.post("/agents/<name>/resume", auth=Auth.SESSION)
async def page_agent_resume(web: Web, name: str):
    await control_profile(web, name, "resume")
    return await web.see_other("/agents?done=resumed")


@pages.post("/runs/<run_id>/control", auth=Auth.SESSION)
async def page_run_control(web: Web, run_id: str):
    action = (await web.form()).get("action", "")
    await control_run(web, run_id, action)
    notice = {"cancel": "cancel", "pause": "run_pause", "resume": "resume_run"}[action]
    return await web.see_other(f"/runs/{run_id}?done={notice}")


#: A schedule firing more often than this in a day shows as one row of that day ("288 fires").
UPCOMING_ROWS_EACH = 6


def folded_fires(fires: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One day's fires for the page: a frequent schedule's as one row at its first (its count, its
    last time, late if any is), so every 5 minutes does not bury the daily ones."""
    mine: dict[str, list[dict[str, Any]]] = {}
    for fire in fires:
        mine.setdefault(fire["id"], []).append(fire)
    rows = []
    for fire in fires:
        same = mine[fire["id"]]
        if len(same) <= UPCOMING_ROWS_EACH:
            rows.append({**fire, "count": 1})
        elif fire is same[0]:
            state = next((s for s in ("late", "paused") if any(f["state"] == s for f in same)), "scheduled")
            rows.append({**fire, "count": len(same), "last": same[-1]["local"], "state": state})
    return rows


@pages.get("/upcoming", auth=Auth.SESSION)
async def page_upcoming(web: Web):
    """The next days' fires of every schedule and routine, by day in the viewer's zone (the page's
    script asks for it in ``tz``; the host's zone until then)."""
    viewer = zone(web.args.get("tz") or host_zone().key, "tz")
    listed = await list_upcoming(web)
    days, fires = listed["days"], listed["fires"]
    by_day: dict[str, list[dict[str, Any]]] = {}
    for fire in fires:
        at = parse_instant(fire["at"]).astimezone(viewer)
        by_day.setdefault(f"{at:%A %d %B %Y}", []).append({**fire, "local": f"{at:%H:%M}"})
    names = {f["id"]: f["name"] for f in fires}
    return await web.page("upcoming.html", section="upcoming", live=True, days=days, zone=viewer.key,
                          by_day={day: folded_fires(day_fires) for day, day_fires in by_day.items()},
                          late=sum(f["state"] == "late" for f in fires), count=len(fires),
                          cut=[names[i] for i in listed["cut"] if i in names])


@pages.get("/attention", auth=Auth.SESSION)
async def page_attention(web: Web):
    items = await web.call(web.store.list_attention, False)
    open_items = [a for a in items if not a["acknowledged_at"]]
    done_items = [a for a in items if a["acknowledged_at"]][:50]
    pending = await web.call(web.store.access.list_proposals, ProposalState.PENDING, web.now)
    return await web.page("attention.html", section="attention", live=True, open_items=open_items,
                          done_items=done_items, schedules=await web.call(web.store.schedules.schedule_zones),
                          pending_proposals=len(pending))


@pages.post("/attention/<attention_id>/ack", auth=Auth.SESSION)
async def page_attention_ack(web: Web, attention_id: str):
    await ack_attention(web, attention_id)
    return await web.see_other("/attention?done=acked")


@pages.post("/attention/ack-all", auth=Auth.SESSION)
async def page_attention_ack_all(web: Web):
    await ack_attention_items(web, None)
    return await web.see_other("/attention?done=acked_all")


@pages.post("/attention/ack-selected", auth=Auth.SESSION)
async def page_attention_ack_selected(web: Web):
    await ack_attention_items(web, selected_ids({"ids": (await web.form()).getlist("ids")}))
    return await web.see_other("/attention?done=acked_selected")


@pages.get("/proposals", auth=Auth.SESSION)
async def page_proposals(web: Web):
    """Every proposal, newest first: what a person's own agents asked for."""
    proposals = await web.call(web.store.access.list_proposals, None, web.now)
    return await web.page("proposals.html", section="attention", proposals=proposals,
                          schedules=await web.call(web.store.schedules.schedule_zones))


async def proposal_page(web: Web, proposal_id: str, *, status: int = 200, error: OutpostError | None = None):
    """A proposal's review: what confirming would do (for a change, the diff against the revision
    it was made from), and Confirm / Decline while it is pending."""
    proposal = await web.call(web.store.access.get_proposal, proposal_id, web.now)
    moved = None   # a pending change or action whose schedule moved on: it can no longer be confirmed
    if proposal["state"] == ProposalState.PENDING and proposal["schedule_id"]:
        current = await web.call(web.store.schedules.schedule_definition, proposal["schedule_id"])
        moved = current if current["revision"] != proposal["base_revision"] or current["archived"] else None
    return await web.page("proposal.html", status=status, section="attention", p=proposal, error=error, moved=moved,
                          by_key=proposal["proposed_by"] not in HUMAN_CALLERS)


@pages.get("/proposals/<proposal_id>", auth=Auth.SESSION)
async def page_proposal(web: Web, proposal_id: str):
    return await proposal_page(web, proposal_id)


@pages.post("/proposals/<proposal_id>/confirm", auth=Auth.SESSION, nudges=(Actor.CRON, Actor.CLAIM))
async def page_confirm_proposal(web: Web, proposal_id: str):
    try:
        decided = await confirm_proposal(web, proposal_id)
    except (RevisionMismatch, Archived):   # the proposal is stale now: its page says why
        return await web.see_other(f"/proposals/{proposal_id}")
    except (Conflict, ValidationFailed) as err:
        return await proposal_page(web, proposal_id, status=err.status, error=err)
    if decided["kind"] == "create":
        return await web.see_other(f"/schedules/{decided['schedule_id']}?done=created")
    return await web.see_other(f"/proposals/{proposal_id}?done=proposal_confirmed")


@pages.post("/proposals/<proposal_id>/decline", auth=Auth.SESSION)
async def page_decline_proposal(web: Web, proposal_id: str):
    try:
        await decline_proposal(web, proposal_id, (await web.form()).get("note"))
    except (Conflict, ValidationFailed) as err:
        return await proposal_page(web, proposal_id, status=err.status, error=err)
    return await web.see_other(f"/proposals/{proposal_id}?done=proposal_declined")


@pages.get("/settings", auth=Auth.SESSION)
async def page_settings(web: Web):
    return await settings_page(web)


async def settings_page(web: Web, status: int = 200, **form: Any):
    return await web.page("settings.html", status=status, section="settings",
                          notify=await web.call(web.store.notify.entry_states),
                          channels=await web.call(web.store.channels.states), disk=await disk_use(web.deps),
                          last_pass=await web.call(web.store.housekeeping.last_pass),
                          keep_days=web.deps.config.keep_days, attention_kinds=ATTENTION_KINDS,
                          default_kinds=NOTIFY_DEFAULT_KINDS, cgroups=web.deps.cgroups,
                          default_caps=ResourceCaps(), default_tmp_mb=SANDBOX_TMP_MB, **form)


@pages.post("/settings/notify/test", auth=Auth.SESSION, nudges=(Actor.NOTIFY,))
async def page_notify_test(web: Web):
    entry = (await web.form()).get("entry", "")
    if entry.isdigit():   # an outpost.toml entry by its index, as the API names it
        await queue_test_notifications(web, int(entry))
    else:
        await web.commit(web.store.notify.queue_test, entry or None, web.now)
    return await web.see_other("/settings?done=notify_test")


def notify_form_fields(form) -> dict[str, Any]:
    """Settings' entry form -> the API's fields: kinds ticked, a digest time with its zone."""
    digest = " ".join(part for part in (form.get("digest_time", "").strip(), form.get("digest_zone", "").strip())
                      if part)
    raw = {"kinds": form.getlist("kinds"), "digest": digest or None}
    if form.get("url", "").strip() or not form.get("entry_id"):   # editing: an empty URL keeps the one stored
        raw["url"] = form.get("url", "")
    return raw


@pages.post("/settings/notify/entries", auth=Auth.SESSION, nudges=(Actor.NOTIFY,))
async def page_save_notify_entry(web: Web):
    """Add an entry, or save one (``entry_id``); a refused form comes back with every error at its field."""
    form = await web.form()
    entry_id = form.get("entry_id", "")
    try:
        f = await checked_notify_fields(notify_form_fields(form), partial=bool(entry_id))
        if entry_id:
            await web.commit(web.store.notify.update_entry, entry_id, f, web.now)
        else:
            await web.commit(web.store.notify.add_entry, f["url"], f["label"], f["kinds"], f["digest"], web.now)
    except (ValidationFailed, Conflict) as refused:
        field_errors = {e["field"]: e["message"] for e in refused.errors} or {"url": refused.detail}
        if not form.getlist("kinds"):   # the form's words, not the API's
            field_errors["kinds"] = "tick at least one kind"
        if form.get("digest_zone", "").strip() and not form.get("digest_time", "").strip():
            field_errors["digest"] = "give the time of day too (HH:MM), or leave the zone empty"
        return await settings_page(web, 422, notify_form={"entry_id": entry_id, "kinds": form.getlist("kinds"),
                                                          "url": "" if entry_id else form.get("url", ""),
                                                          "digest_time": form.get("digest_time", ""),
                                                          "digest_zone": form.get("digest_zone", "")},
                                   notify_errors=field_errors)
    return await web.see_other("/settings?done=notify_saved#notifications")


@pages.post("/settings/notify/entries/<entry_id>/delete", auth=Auth.SESSION)
async def page_remove_notify_entry(web: Web, entry_id: str):
    await web.commit(web.store.notify.remove_entry, entry_id)
    return await web.see_other("/settings?done=notify_removed#notifications")


@pages.post("/settings/channels/<name>/test", auth=Auth.SESSION)
async def page_channel_test(web: Web, name: str):
    await web.commit(web.store.channels.queue_test, name, web.now)
    web.deps.nudge(Actor.NOTIFY)
    return await web.see_other("/settings?done=channel_test")


# --- dashboard: Office ----------------------------------------------------------------------------

def mentioned_task_ids(value: Any, depth: int = 4) -> set[str]:
    """The ``task_id`` and ``linked_task_id`` of the rows a page's context lists (a routine's runs
    inside the routine too): the tasks its tables name by title."""
    found: set[str] = set()
    if depth and isinstance(value, dict):
        found |= {v for k in ("task_id", "linked_task_id") if isinstance(v := value.get(k), str)}
        for item in value.values():
            if isinstance(item, list | dict):
                found |= mentioned_task_ids(item, depth - 1)
    elif depth and isinstance(value, list):
        for item in value:
            found |= mentioned_task_ids(item, depth - 1)
    return found


async def office_page(web: Web, template: str, *, tab: str, status: int = 200, live: bool = True, **context: Any):
    """An Office page: the workspace's settings and agents for its header and tables, and the
    titles of the tasks its tables name."""
    named = mentioned_task_ids(context)

    def common():
        return {"settings": web.store.office.office_settings(None),
                "repository_waiting": web.store.office.repository_waiting(None),
                "agents_by_id": {a["id"]: a for a in web.store.office.list_agents(None)},
                "task_titles": web.store.office.task_titles(named)}
    shared = await web.call(common)
    return await web.page(template, status=status, section="office", live=live, tab=tab,
                          tz=shared["settings"]["timezone"], profiles=web.profile_names, task_states=list(TaskState),
                          **shared, **context)


async def office_form(web: Web, action: Callable[[Any], Awaitable[Any]], on_error: Callable[..., Awaitable[Any]]):
    """A dashboard form: 303 to the action's target (a path, or the action's own ``see_other``),
    else the form's page again with the errors by field (nothing was written); then the
    dispatcher is nudged, as new wakeups may wait."""
    form = await web.form()
    try:
        target = await action(form)
    except OutpostError as err:
        return await on_error(web, form=form, errors=errors_by_field(err), status=err.status)
    web.deps.nudge(Actor.CLAIM)
    return await web.see_other(target) if isinstance(target, str) else target


def checkbox(form: dict[str, str], name: str) -> bool:
    return form.get(name) in ("1", "on", "true")


def form_number(text: str) -> int | str:
    """A whole number typed in a form, or the text as typed (the validator names its field)."""
    text = text.strip()
    return int(text) if re.fullmatch(r"-?[0-9]{1,12}", text) else text


def agent_form(form: dict[str, str]) -> dict[str, Any]:
    raw: dict[str, Any] = {k: form[k] for k in ("name", "role", "status", "instructions") if form.get(k)}
    raw["executor"] = form.get("executor") or None
    for key in ("max_concurrent_sessions", "cooldown_sec", "budget_runs_per_day"):
        if form.get(key, "").strip():   # not a number: as typed, refused with the other fields' errors
            raw[key] = form_number(form[key])
        elif key == "budget_runs_per_day":
            raw[key] = None
    if form.get("skip_idle_wakeups") in ("yes", "no"):
        raw["skip_idle_wakeups"] = form["skip_idle_wakeups"] == "yes"
    return raw | dollars_form(form)


def dollars_form(form: dict[str, str]) -> dict[str, Any]:
    """The dollar budgets of a form (blank: no budget)."""
    raw: dict[str, Any] = {}
    for key in ("budget_usd_per_day", "budget_usd_per_month"):
        text = form.get(key, "").strip().lstrip("$").replace(",", "")
        try:
            raw[key] = float(text) if text else None
        except ValueError:   # as typed: refused with the other fields' errors
            raw[key] = text
    return raw


def task_form(form, fields: tuple[str, ...]) -> dict[str, Any]:
    raw: dict[str, Any] = {k: form.get(k, "") for k in fields if k in ("title", "description")}
    for key in ("assignee_agent_id", "parent_id", "executor"):
        if key in fields:
            raw[key] = form.get(key) or None
    if "blocked_by" in fields:
        raw["blocked_by"] = [t for t in form.getlist("blocked_by") if t]
    if "requires_approval" in fields:
        raw["requires_approval"] = checkbox(form, "requires_approval")
    return raw


def routine_form(form) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The routine dialog's fields, as the API takes them (variables: one per line,
    ``name:type:default:required``, options of a select after ``|``)."""
    raw: dict[str, Any] = {k: form.get(k, "") for k in ("name", "description", "assignee_agent_id",
                                                        "concurrency_policy", "catch_up_policy")}
    raw["catch_up_max"] = parse_count(form.get("catch_up_max", "25").strip()) or 0
    title, body = form.get("template_title", ""), form.get("template_description", "")
    raw["task_template"] = {"title": title, "description": body} if form.get("heavy") else {}
    variables = []
    for line in form.get("variables", "").splitlines():
        if line.strip():
            name, kind, default, required = [*(p.strip() for p in line.split(":")), "", "", "", ""][:4]
            kind, _, options = kind.partition("|")
            variables.append({"name": name, "type": kind or "text", "default": default or None,
                              "required": required in ("required", "yes", "true"),
                              "options": [o.strip() for o in options.split(",") if o.strip()]})
    raw["variables"] = variables
    triggers = []
    if form.get("cron_expression", "").strip():
        triggers.append({"kind": "schedule", "cron_expression": form["cron_expression"].strip(),
                         "timezone": form.get("timezone") or None})
    if form.get("webhook_mode"):
        triggers.append({"kind": "webhook", "signing_mode": form["webhook_mode"]})
    return raw, triggers


@pages.get("/office", auth=Auth.SESSION)
async def page_office(web: Web):
    from quart import redirect
    return redirect("/office/agents")


@pages.get("/office/agents", auth=Auth.SESSION)
async def page_office_agents(web: Web, form: dict[str, str] | None = None, errors: dict[str, str] | None = None,
                             status: int = 200):
    def data():
        return (web.store.office.list_agents(None), web.store.wakeups.wakeups_by_agent(WakeupStatus.CLAIMED),
                web.store.wakeups.wakeups_by_agent(WakeupStatus.QUEUED))
    agents, active, queued = await web.call(data)
    return await office_page(web, "office_agents.html", tab="agents", status=status, agents=agents, active=active,
                             queued=queued, form=form or {}, errors=errors or {})


@pages.post("/office/agents", auth=Auth.SESSION)
async def page_office_agents_create(web: Web):
    async def create(form):
        agent = await create_agent(web, None, agent_form(form))
        return f"/office/agents/{agent['id']}?done=agent_created"
    return await office_form(web, create, page_office_agents)


@pages.get("/office/agents/<agent_id>", auth=Auth.SESSION)
async def page_office_agent(web: Web, agent_id: str, form: dict[str, str] | None = None,
                            errors: dict[str, str] | None = None, status: int = 200):
    def data():
        return (web.store.office.get_agent(agent_id), web.store.office.agent_runs(agent_id, 30),
                web.store.office.list_wakeups(None, agent_id, None, None, 30), web.store.office.summary_of(agent_id),
                web.store.office.list_tasks(None, agent_id), web.store.routines.scheduled_wakeups(agent_id))
    agent, runs, wakeups, summaries, tasks, scheduled = await web.call(data)
    chart = await runs_chart(web, f"Runs of {agent['name']} per day, last 30 days (UTC)", office_agent_id=agent_id)
    return await office_page(web, "office_agent.html", tab="agents", status=status, agent=agent, runs=runs,
                             wakeups=wakeups, hide_agent=True, summaries=summaries, tasks=tasks,
                             scheduled_wakeups=scheduled, form=form or agent, errors=errors or {}, chart=chart)


@pages.post("/office/agents/<agent_id>", auth=Auth.SESSION)
async def page_office_agent_save(web: Web, agent_id: str):
    async def save(form):
        await update_agent(web, agent_id, agent_form(form))
        return f"/office/agents/{agent_id}?done=agent_updated"
    return await office_form(web, save, functools.partial(page_office_agent, agent_id=agent_id))


@pages.post("/office/agents/<agent_id>/wake", auth=Auth.SESSION)
async def page_office_agent_wake(web: Web, agent_id: str):
    async def wake(form):
        await wake_agent(web, agent_id, _text(form, "context", 0, MAX_TEXT_CHARS, "") or None)
        return f"/office/agents/{agent_id}?done=woken"
    return await office_form(web, wake, functools.partial(page_office_agent, agent_id=agent_id))


def open_blocker_counts(tasks: list[dict[str, Any]], shown: dict[str, dict[str, Any]]) -> dict[str, int]:
    """How many blockers of each shown task are still open (not Done or Cancelled; ``tasks``: the
    workspace's, archived ones left out, so an archived blocker blocks nothing, as
    ``open_blockers`` says). A task that is Done or Cancelled itself is blocked by nothing."""
    still_open = {t["id"] for t in tasks if t["state"] not in TERMINAL_TASK_STATES}
    return {t["id"]: n for t in shown.values() if t["state"] not in TERMINAL_TASK_STATES
            and (n := sum(b in still_open for b in t["blocked_by"] or []))}


@pages.get("/office/board", auth=Auth.SESSION)
async def page_office_board(web: Web, form: dict[str, str] | None = None, errors: dict[str, str] | None = None,
                            status: int = 200):
    show_routine = web.args.get("routine") == "1"
    tasks, running = await web.call(lambda: (web.store.office.list_tasks(None), web.store.office.running_tasks(None)))
    hidden = sum(t["workflow"] == "routine" for t in tasks)
    shown = [t for t in tasks if show_routine or t["workflow"] != "routine"]   # routine tasks: hidden by default
    columns = {state: [t for t in shown if t["state"] == state] for state in TaskState}
    return await office_page(web, "office_board.html", tab="board", status=status, tasks=shown, columns=columns,
                             show_routine=show_routine, hidden_routine=hidden, running=running, form=form or {},
                             errors=errors or {}, open_blockers=open_blocker_counts(tasks, {t["id"]: t for t in shown}))


@pages.post("/office/tasks", auth=Auth.SESSION)
async def page_office_task_create(web: Web):
    async def create(form):
        raw = task_form(form, ("title", "description", "assignee_agent_id", "parent_id", "blocked_by",
                               "requires_approval"))
        task = await create_task(web, None, raw)
        return f"/office/tasks/{task['id']}?done=task_created"
    return await office_form(web, create, page_office_board)


@pages.get("/office/tasks/<task_id>", auth=Auth.SESSION)
async def page_office_task(web: Web, task_id: str, form: dict[str, str] | None = None,
                           errors: dict[str, str] | None = None, status: int = 200):
    def data():
        return (web.store.office.get_task(task_id), web.store.office.list_tasks(None),
                web.store.office.list_wakeups(None, None, None, None, 200, task_id),
                web.store.office.task_runs_active(task_id))
    task, tasks, wakeups, active = await web.call(data)
    waiting = [w for w in wakeups if w["status"] == WakeupStatus.QUEUED]
    return await office_page(web, "office_task.html", tab="board", status=status, task=task, tasks=tasks,
                             titles={t["id"]: t for t in tasks}, wakeups=wakeups, hide_agent=False,
                             form=form or {}, errors=errors or {}, active_runs=active, waiting_wakeups=waiting,
                             open_blockers=open_blocker_counts(tasks, {task["id"]: task}))


@pages.post("/office/tasks/<task_id>", auth=Auth.SESSION)
async def page_office_task_save(web: Web, task_id: str):
    async def save(form):
        await update_task(web, task_id, task_form(form, ("title", "description", "assignee_agent_id", "blocked_by",
                                                         "requires_approval", "executor")))
        return f"/office/tasks/{task_id}?done=task_updated"
    return await office_form(web, save, functools.partial(page_office_task, task_id=task_id))


@pages.post("/office/tasks/<task_id>/move", auth=Auth.SESSION)
async def page_office_task_move(web: Web, task_id: str):
    async def move(form):
        await web.commit(web.store.office.move_task, task_id, form.get("state", ""), web.now)
        return form.get("next") if form.get("next") == "/office/board" else f"/office/tasks/{task_id}?done=moved"
    return await office_form(web, move, functools.partial(page_office_task, task_id=task_id))


@pages.post("/office/tasks/<task_id>/comments", auth=Auth.SESSION)
async def page_office_task_comment(web: Web, task_id: str):
    async def comment(form):
        body = _text(form, "body", 1, MAX_TEXT_CHARS)
        if not body.strip():
            raise invalid("body", "write something first")
        await web.commit(web.store.office.add_comment, task_id, body, web.now)
        return f"/office/tasks/{task_id}?done=commented#comments"
    return await office_form(web, comment, functools.partial(page_office_task, task_id=task_id))


@pages.post("/office/approvals/<approval_id>/resolve", auth=Auth.SESSION, nudges=(Actor.CLAIM,))
async def page_office_approval_resolve(web: Web, approval_id: str):
    form = await web.form()
    approval = await web.commit(web.store.office.resolve_approval, approval_id, form.get("status", ""),
                                _text(form, "decision_note", 0, MAX_TEXT_CHARS, ""), web.now)
    return await web.see_other(f"/office/tasks/{approval['task_id']}?done=approval_resolved")


@pages.get("/office/wakeups", auth=Auth.SESSION)
async def page_office_wakeups(web: Web):
    agent_id = web.args.get("agent_id") or None
    status = web.choice_arg("status", WakeupStatus)
    wakeups = await web.call(web.store.office.list_wakeups, None, agent_id, status, None, 200)
    return await office_page(web, "office_wakeups.html", tab="wakeups", wakeups=wakeups, agent_id=agent_id,
                             status_filter=status, statuses=list(WakeupStatus))


@pages.get("/office/runs/<run_id>", auth=Auth.SESSION)
async def page_office_run(web: Web, run_id: str):
    """An Office run's page was its own; it is the run page now (old links still land)."""
    await web.call(web.store.office.office_run, run_id)
    query = web.request.query_string.decode()
    return await web.see_other(f"/runs/{run_id}" + (f"?{query}" if query else ""))


@pages.get("/office/activity", auth=Auth.SESSION)
async def page_office_activity(web: Web):
    code = web.args.get("code") or None
    activity = await web.call(web.store.office.list_activity, None, code, 200, empty_sweeps=code is not None)
    return await office_page(web, "office_activity.html", tab="activity", activity=activity, code=code)


@pages.get("/office/routines", auth=Auth.SESSION)
async def page_office_routines(web: Web, form: Any = None, errors: dict[str, str] | None = None, status: int = 200):
    return await office_page(web, "office_routines.html", tab="routines", status=status, zones=zone_names(),
                             routines=await web.call(web.store.routines.list_routines, None), form=form or {},
                             errors=errors or {})


@pages.post("/office/routines", auth=Auth.SESSION)
async def page_office_routines_create(web: Web):
    async def create(form):
        raw, triggers = routine_form(form)
        routine = await create_routine(web, None, raw, triggers)
        new_secrets = {t["id"]: t["secret"] for t in routine["triggers"] if t.get("secret")}
        target = f"/office/routines/{routine['id']}?done=routine_created"
        return await web.see_other(target, new_secrets=new_secrets) if new_secrets else target
    return await office_form(web, create, page_office_routines)


@pages.get("/office/routines/<routine_id>", auth=Auth.SESSION)
async def page_office_routine(web: Web, routine_id: str, form: Any = None, errors: dict[str, str] | None = None,
                              status: int = 200):
    """A routine; a new or rotated webhook secret is shown once here (``new_secrets``, the
    flash ``see_other`` left), after the form that made it redirected."""
    routine = await web.call(web.store.routines.get_routine, routine_id)
    return await office_page(web, "office_routine.html", tab="routines", status=status, live=False, zones=zone_names(),
                             routine=routine, base_url=web.request.host_url.rstrip("/"), form=form,
                             errors=errors or {}, new_secrets={})


@pages.post("/office/routines/<routine_id>", auth=Auth.SESSION)
async def page_office_routine_save(web: Web, routine_id: str):
    async def save(form):
        raw, _ = routine_form(form)
        raw["status"] = form.get("status", RoutineStatus.ACTIVE)
        await update_routine(web, routine_id, raw)
        return f"/office/routines/{routine_id}?done=routine_updated"
    return await office_form(web, save, functools.partial(page_office_routine, routine_id=routine_id))


@pages.post("/office/routines/<routine_id>/status", auth=Auth.SESSION)
async def page_office_routine_status(web: Web, routine_id: str):
    form = await web.form()
    await update_routine(web, routine_id, {"status": form.get("status", "")})
    return await web.see_other(form.get("next") if form.get("next") == "/office/routines" else
                               f"/office/routines/{routine_id}?done=routine_updated")


@pages.post("/office/routines/<routine_id>/delete", auth=Auth.SESSION, nudges=(Actor.CRON,))
async def page_office_routine_delete(web: Web, routine_id: str):
    await web.commit(web.store.routines.delete_routine, routine_id, web.now)
    return await web.see_other("/office/routines?done=routine_deleted")


@pages.post("/office/routines/<routine_id>/fire", auth=Auth.SESSION)
async def page_office_routine_fire(web: Web, routine_id: str):
    async def fire(form):
        variables = {k[4:]: v for k, v in form.items() if k.startswith("var_") and v != ""}
        run = await fire_routine(web, routine_id, variables)
        done = ("received" if run["status"] == RoutineRunStatus.TASK_CREATED and not run["linked_task_id"] else
                "woke_task" if run["status"] == RoutineRunStatus.TASK_CREATED and run["wakeup_id"] else run["status"])
        return f"/office/routines/{routine_id}?done=fired_{done}"
    return await office_form(web, fire, functools.partial(page_office_routine, routine_id=routine_id))


@pages.post("/office/routines/<routine_id>/triggers", auth=Auth.SESSION)
async def page_office_routine_add_trigger(web: Web, routine_id: str):
    async def add(form):
        raw = {"kind": form.get("kind", "")}
        if raw["kind"] == "schedule":
            raw |= {"cron_expression": form.get("cron_expression", ""), "timezone": form.get("timezone") or None}
        elif raw["kind"] == "webhook":
            raw["signing_mode"] = form.get("signing_mode", "hmac_sha256")
        trigger = await add_trigger(web, routine_id, raw)
        target = f"/office/routines/{routine_id}?done=trigger_added"
        if trigger.get("secret"):   # shown once
            return await web.see_other(target, new_secrets={trigger["id"]: trigger["secret"]})
        return target
    return await office_form(web, add, functools.partial(page_office_routine, routine_id=routine_id))


@pages.post("/office/routines/<routine_id>/triggers/<trigger_id>/delete", auth=Auth.SESSION, nudges=(Actor.CRON,))
async def page_office_routine_delete_trigger(web: Web, routine_id: str, trigger_id: str):
    await web.commit(web.store.routines.delete_trigger, routine_id, trigger_id, web.now)
    return await web.see_other(f"/office/routines/{routine_id}?done=trigger_deleted")


@pages.post("/office/routines/<routine_id>/triggers/<trigger_id>/rotate", auth=Auth.SESSION)
async def page_office_routine_rotate(web: Web, routine_id: str, trigger_id: str):
    trigger = await web.commit(web.store.routines.rotate_secret, routine_id, trigger_id, web.now)
    return await web.see_other(f"/office/routines/{routine_id}?done=secret_rotated",
                               new_secrets={trigger_id: trigger["secret"]})


@pages.get("/office/settings", auth=Auth.SESSION)
async def page_office_settings(web: Web, form: dict[str, str] | None = None, errors: dict[str, str] | None = None,
                               status: int = 200):
    return await office_page(web, "office_settings.html", tab="settings", status=status, live=False,
                             zones=zone_names(), form=form, errors=errors or {})


@pages.post("/office/settings", auth=Auth.SESSION)
async def page_office_settings_save(web: Web):
    async def save(form):
        raw: dict[str, Any] = {k: form[k] for k in ("name", "timezone", "source_ref") if form.get(k)}
        raw["repository"] = form.get("repository", "").strip() or None
        raw["default_executor"] = form.get("default_executor") or None
        for key in ("recovery_lookback_hours", "budget_runs_per_day"):
            text = form.get(key, "").strip()   # not a number: as typed, refused with the other fields' errors
            raw[key] = form_number(text) if text else (24 if key == "recovery_lookback_hours" else None)
        raw |= dollars_form(form)
        raw["budget_action"] = form.get("budget_action") or "pause"
        await update_settings(web, None, raw)
        return "/office/settings?done=settings_saved"
    return await office_form(web, save, page_office_settings)


# --- the app: every table installed ---------------------------------------------------------------

def check_installed() -> None:
    """The dashboard's files are beside outpost.py (an install made with ``pip install -e``): a
    plain ``pip install`` copies outpost.py alone, and every page would answer 500."""
    if not (INSTALLED / "templates").is_dir() or not (INSTALLED / "static").is_dir():
        raise ConfigError(f"the dashboard's templates/ and static/ are not beside {INSTALLED / 'outpost.py'}: "
                          "install Outpost from its checkout with pip install -e (README.md, Quickstart)")


def create_app(deps: Deps):
    """The Quart-Trio application: installs the route tables through ``endpoint``."""
    from quart import g, request
    from quart_trio import QuartTrio

    app = QuartTrio("outpost", template_folder=str(INSTALLED / "templates"), static_folder=str(INSTALLED / "static"))
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.jinja_env.filters.update(TEMPLATE_FILTERS)
    app.jinja_env.globals.update(TEMPLATE_GLOBALS)
    app.before_request(functools.partial(screen_request, deps))
    app.after_request(security_headers)
    app.after_request(read_body_to_end)

    async def error_boundary(err: Exception):
        return await answer_error(getattr(g, "web", None) or Web(deps, request, None), err)
    app.register_error_handler(Exception, error_boundary)
    for table in ROUTE_TABLES:
        for route in table.routes:
            app.add_url_rule(route.rule, f"{table.surface}.{route.handler.__name__}", endpoint(deps, table, route),
                             methods=[route.method])
    return app


###############################################################################
# 22. Supervisor: systemd, logging, serve.
###############################################################################

def sd_notify(state: str) -> bool:
    """Tell systemd about our state (READY=1, STOPPING=1, WATCHDOG=1): one datagram to
    $NOTIFY_SOCKET, no library. False when not under a notify-type unit."""
    import socket
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]   # abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)
            sock.sendall(state.encode())
        except OSError as exc:
            log.warning("sd_notify %s failed: %s", state.split("=")[0], exc)
            return False
    return True


def watchdog_interval_s() -> float | None:
    """Half of systemd's WatchdogSec, when the watchdog is meant for this process."""
    usec, pid = os.environ.get("WATCHDOG_USEC"), os.environ.get("WATCHDOG_PID")
    if not usec or not usec.isdigit() or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6


async def watchdog_actor() -> None:
    """Pings systemd's watchdog from the trio loop: a blocked loop stops the pings and
    systemd restarts the service. Ends when cancelled."""
    interval = watchdog_interval_s()
    if interval is None:
        return
    while True:
        sd_notify("WATCHDOG=1")
        await trio.sleep(interval)


#: The lock ``serve`` holds for its life: one daemon per data dir (docs/configuration.md).
SERVE_LOCK = "serve.lock"


def hold_serve_lock(data_dir: Path) -> Any:
    """The open, exclusively locked ``<data dir>/serve.lock`` (the kernel drops the lock when the
    process ends, however it ends), or ConfigError naming the ``serve`` that holds it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    held = open(data_dir / SERVE_LOCK, "a")  # noqa: SIM115 - kept open for the process's life
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held.close()
        try:
            running = json.loads((data_dir / SERVE_FILE).read_text())
            who = f"pid {running['pid']}, {running['url']}"
        except (OSError, ValueError, KeyError, TypeError):
            who = "it has not recorded its address yet"
        raise ConfigError(f"another outpost serve runs on the data dir {data_dir} ({who}); stop it first, "
                          "or give this one its own --data-dir") from None
    return held


def open_deps(config: Config, clock: Clock | None = None) -> Deps:
    config.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = api_token(config.data_dir, create=True)
    store = Store(config.database or config.db_path, data_dir=config.data_dir, node=config.node,
                  process=this_process())
    if store.dialect.fleet:
        acquire_node_name(store)
    else:
        os.chmod(config.db_path, 0o600)   # it holds webhook secrets (HMAC needs them as they are)
    ensure_embedded_repository(Path(store.embedded_repository))
    store.notify.configure(config.notify, config.channels)
    store.transaction(store.channels.sync, config.channels, datetime.now(UTC))
    return Deps(config=config, store=store, clock=clock or WallClock(), token=token,
                isolation=agent_isolation(config.isolate_agents),
                cgroups=find_cgroups(cgroup_owner(config.data_dir)))


async def serve(deps: Deps, shutdown: trio.Event, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The whole appliance in one root nursery, until ``shutdown`` is set.

    Order: recovery reconciles the store first; then the web server binds; then the
    actors that need its URL (agents reach the API through it): notification, cron,
    claim. On shutdown the web server stops through its trigger (never cancelled
    mid-request), then the actors are cancelled: run supervisors end their process
    groups and record ``interrupted``. The caller closes the store after this returns."""
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve as hypercorn_serve

    hc = HypercornConfig()
    hc.bind = [f"{deps.config.host}:{deps.config.port}"]
    hc.graceful_timeout = 0.5        # hypercorn under quart-trio keeps idle connections open
    hc.read_timeout = 60
    hc.accesslog = None
    hc.errorlog = log.getChild("hypercorn")
    web_done = trio.Event()

    async def web_server(task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            await hypercorn_serve(create_app(deps), hc, shutdown_trigger=shutdown.wait, task_status=task_status)
        finally:
            web_done.set()

    async with deps.refs.resident(), trio.open_nursery() as nursery:
        await nursery.start(recovery_actor, deps)
        binds = await nursery.start(web_server)
        actors = dataclasses.replace(deps, api_url=binds[0] if binds else f"http://{deps.config.host}:{deps.config.port}")
        nursery.start_soon(notification_actor, actors)
        nursery.start_soon(cron_actor, actors)
        nursery.start_soon(claim_actor, actors)
        nursery.start_soon(outbox_actor, actors)
        nursery.start_soon(housekeeping_actor, actors)
        if deps.store.dialect.fleet:
            nursery.start_soon(node_actor, actors, shutdown)
        task_status.started(binds)
        nursery.start_soon(watchdog_actor)
        sd_notify("READY=1\nSTATUS=listening")
        await shutdown.wait()
        sd_notify("STOPPING=1")
        log.info("shutting down: stopping the web server, then the actors")
        with trio.move_on_after(hc.graceful_timeout + 2):
            await web_done.wait()
        nursery.cancel_scope.cancel()
    if deps.store.dialect.fleet:
        with contextlib.suppress(StoreUnavailable):   # then the name frees itself in NODE_LOST_S
            await deps.transaction(deps.store.nodes.release_node_name)
    log.info("group commit: %s", deps.writer.summary())
    if deps.store.dialect.fleet:
        log.info("%d transaction(s) ran again after a serialization failure", deps.store.serialization_retries)


async def run_until_signal(deps: Deps) -> None:
    """Serve until SIGTERM or SIGINT; a second signal stops at once."""
    shutdown = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as appliance:
                async def watch_signals() -> None:
                    async for signum in signals:
                        log.info("received %s", signal.Signals(signum).name)
                        if shutdown.is_set():
                            appliance.cancel_scope.cancel()
                        shutdown.set()

                outer.start_soon(watch_signals)
                binds = await appliance.start(serve, deps, shutdown)
                port = int(binds[0].rsplit(":", 1)[1]) if binds else deps.config.port
                base = f"http://{deps.config.host}:{port}"
                try:
                    record_address(deps.config.data_dir, binds[0] if binds else base)
                except OSError as exc:   # the CLI then needs --url; serving goes on
                    log.warning("cannot record the address in %s: %s", deps.config.data_dir / SERVE_FILE, exc)
                code = await deps.transaction(deps.store.access.create_signin_code, deps.clock.now())
                print(f"Outpost is listening: dashboard and API on {base}/", flush=True)
                print(f"Sign in once (link valid 15 minutes, one use): {base}/signin/{code}", flush=True)
                print(f"API token: `outpost token --data-dir {deps.config.data_dir}`", flush=True)
                print(f"Sandbox: {deps.isolation.message}; {deps.cgroups.message}", flush=True)
                if short := deps.cgroups.room_short(deps.config):
                    print(f"Warning: {short}", flush=True)
                if os.geteuid() == 0:
                    print("Running as root: a dedicated user is safer (see docs/security.md): an agent's "
                          "sandbox is all that stands between it and the whole machine", flush=True)
            outer.cancel_scope.cancel()   # serve() has returned: stop watching signals
    forget_address(deps.config.data_dir)


class LogFormatter(logging.Formatter):
    """One record, one line: what a message carries from an agent (its stderr in a run's error,
    git's words) shows its control characters and newlines as ``\\x1b`` and ``\\x0a`` rather than
    driving the operator's terminal or forging a line; a traceback after it prints as it is."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return visible(super().formatMessage(record), lines=False)


class JournalFormatter(LogFormatter):
    """journald adds the time; a ``<N>`` prefix gives it the level (sd-daemon(3))."""
    PRIORITIES = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def format(self, record: logging.LogRecord) -> str:
        return f"<{self.PRIORITIES.get(record.levelno, 6)}>{super().format(record)}"


def setup_logging(verbose: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("JOURNAL_STREAM"):
        handler.setFormatter(JournalFormatter("%(levelname)s %(name)s: %(message)s"))
    else:
        handler.setFormatter(LogFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if verbose else logging.INFO)


# --- the CLI that talks to a running daemon ----------------------------------------------------



###############################################################################
# 23. CLI and main(): the commands that talk to a running daemon, doctor, migrate, backup.
###############################################################################

class Client:
    """A small HTTP client for the daemon's API (stdlib only)."""

    def __init__(self, base_url: str, token: str):
        self.base_url = base_url.rstrip("/")
        self.token = token

    def call(self, method: str, path: str, body: Any = None, *, headers: dict[str, str] | None = None,
             idempotent: bool = False, raw: bool = False) -> Any:
        payload, _ = self.exchange(method, path, body, headers=headers, idempotent=idempotent)
        return payload.decode() if raw else json.loads(payload or b"null")

    def exchange(self, method: str, path: str, body: Any = None, *, headers: dict[str, str] | None = None,
                 idempotent: bool = False) -> tuple[bytes, Any]:
        """The answer's body and headers; a refusal or no daemon is a CliError."""
        data = json.dumps(body).encode() if body is not None else None
        hdrs = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json", **(headers or {})}
        if idempotent:
            hdrs["Idempotency-Key"] = "cli-" + secrets.token_hex(12)
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.read(), resp.headers
        except urllib.error.HTTPError as exc:
            try:
                problem = json.loads(exc.read())
            except ValueError:
                problem = {"detail": exc.reason}
            fields = "; ".join(f"{e['field']}: {e['message']}" for e in problem.get("errors", []))
            detail = problem.get("detail") or problem.get("title") or str(exc)
            if fields and fields not in detail:
                detail += f" ({fields})"
            raise CliError(f"refused ({exc.code} {problem.get('code', '')}): {detail}", EXIT_REFUSED) from None
        except (urllib.error.URLError, OSError) as exc:
            raise CliError(f"cannot reach the Outpost daemon at {self.base_url} ({exc}); "
                           "is `outpost serve` running?", EXIT_UNREACHABLE) from None


def read_definition_file(path: str) -> dict[str, Any]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}", EXIT_USAGE) from None
    try:
        return json.loads(text) if path.endswith(".json") or text.lstrip().startswith("{") else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise CliError(f"{path} is neither valid JSON nor TOML: {exc}", EXIT_USAGE) from None


def print_table(rows: list[list[str]], headers: list[str]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]
    for row in [headers, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip())


def confirm(question: str, assume_yes: bool) -> None:
    if assume_yes:
        return
    if not sys.stdin.isatty():
        raise CliError("not confirmed: stdin is not a terminal (pass --yes to confirm in scripts)", EXIT_DECLINED)
    if input(f"{question} [y/N] ").strip().lower() not in ("y", "yes"):
        raise CliError("not confirmed; nothing was changed", EXIT_DECLINED)


def show_compose(composed: dict[str, Any]) -> None:
    tz = composed["definition"]["timing"]["timezone"]
    print(composed["summary"])
    print("Next fires:")
    for instant in composed["next_fires"]:
        print(f"  {local_time(instant, tz)}   ({instant})")
    for warning in composed["warnings"]:
        print(f"Warning: {warning}")


def cli_schedules(client: Client, args: argparse.Namespace) -> None:
    action = args.action
    if action == "list":
        schedules = client.call("GET", f"/v1/outpost/schedules?include_archived={str(args.all).lower()}")["schedules"]
        if args.json:
            print(json.dumps(schedules, indent=2))
            return
        if not schedules:
            print("No schedules yet. Compose one with `outpost schedules create FILE` (README has an example).")
            return
        print_table([[s["id"], s["name"], describe_timing(s["timing"]),
                      local_time(s["next_fire_at"], s["timing"]["timezone"]), schedule_state(s),
                      str(s["failure_streak"])] for s in schedules],
                    ["ID", "NAME", "TIMING", "NEXT FIRE", "STATE", "FAILURES"])
        return
    if action == "create":
        definition = read_definition_file(args.target)
        composed = client.call("POST", "/v1/outpost/schedules/compose", definition)
        show_compose(composed)
        confirm("Create this schedule?", args.yes)
        created = client.call("POST", "/v1/outpost/schedules", {"definition": composed["definition"],
                              "confirmation": composed["confirmation"]}, idempotent=True)
        print(json.dumps(created, indent=2) if args.json else f"Created {created['id']} ({created['name']}).")
        return
    sid = resolve_schedule(client, args.target)
    current = client.call("GET", f"/v1/outpost/schedules/{sid}")
    if action == "show":
        occurrences = client.call("GET", f"/v1/outpost/schedules/{sid}/occurrences?limit=20")["occurrences"]
        if args.json:
            print(json.dumps({**current, "occurrences": occurrences}, indent=2))
            return
        tz = current["timing"]["timezone"]
        for key in ("id", "name", "revision", "agent", "repository", "source_ref", "workdir"):
            print(f"{key:>15}: {current[key]}")
        print(f"{'timing':>15}: {describe_timing(current['timing'])}")
        print(f"{'state':>15}: {schedule_state(current)} (failure streak {current['failure_streak']})")
        print(f"{'next fire':>15}: {local_time(current['next_fire_at'], tz)}")
        print(f"{'active run':>15}: {current['active_run_id'] or '-'}")
        print("\nSlot ledger (newest first):")
        if not occurrences:
            print("  no due slot yet")
        print_table([[local_time(o["due_at"], tz), o["trigger"], o["outcome"], o["run_id"] or "-",
                      str(o["missed_count"] or "")] for o in occurrences],
                    ["DUE", "TRIGGER", "OUTCOME", "RUN", "MISSED"]) if occurrences else None
        return
    match_rev = {"If-Match": f'"{current["revision"]}"'}
    if action == "edit":
        changes = read_definition_file(args.target_file)
        composed = client.call("POST", "/v1/outpost/schedules/compose", {"schedule_id": sid, **changes})
        show_compose(composed)
        confirm(f"Apply this edit to {current['name']}?", args.yes)
        updated = client.call("PATCH", f"/v1/outpost/schedules/{sid}", {"changes": changes,
                              "confirmation": composed["confirmation"]}, headers=match_rev, idempotent=True)
        print(json.dumps(updated, indent=2) if args.json else f"Updated {sid} to revision {updated['revision']}.")
        return
    result = client.call("POST", f"/v1/outpost/schedules/{sid}/control", {"action": action},
                         headers=match_rev, idempotent=True)
    if args.json:
        print(json.dumps(result, indent=2))
    elif action == "fire":
        print(f"{result['outcome']}: run {result['run_id']} (occurrence {result['occurrence_id']})")
    else:
        print(f"{current['name']} is now {schedule_state(result)} (revision {result['revision']}).")


def resolve_schedule(client: Client, id_or_name: str) -> str:
    if id_or_name.startswith("sch_"):
        return id_or_name
    schedules = client.call("GET", "/v1/outpost/schedules?include_archived=true")["schedules"]
    matches = [s for s in schedules if s["name"] == id_or_name]
    live = [s for s in matches if not s["archived"]] or matches
    if not live:
        raise CliError(f"no schedule named {id_or_name!r}", EXIT_REFUSED)
    return live[0]["id"]


def cli_runs(client: Client, args: argparse.Namespace) -> None:
    if args.action == "list":
        schedule_id = resolve_schedule(client, args.schedule) if args.schedule else None
        query = urllib.parse.urlencode({k: v for k, v in (("schedule_id", schedule_id), ("status", args.status),
                                                          ("limit", args.limit)) if v})
        page = client.call("GET", f"/v1/outpost/runs?{query}")
        if args.json:
            print(json.dumps(page, indent=2))
            return
        if not page["runs"]:
            print("No runs match." if args.schedule or args.status else
                  "No runs yet. Fire a schedule with `outpost schedules fire NAME`.")
            return
        print_table([[r["id"], r["status"], r["trigger"], r["queued_at"], str(r["changes"]["commits"]),
                      visible((r["error"] or "")[:50], lines=False)] for r in page["runs"]],
                    ["ID", "STATUS", "TRIGGER", "QUEUED", "COMMITS", "ERROR"])
        return
    if args.target is None:
        raise CliError(f"`outpost runs {args.action}` needs a run id", EXIT_USAGE)
    if args.action == "show":
        run = client.call("GET", f"/v1/outpost/runs/{args.target}")
        if args.json:
            print(json.dumps(run, indent=2))
            return
        for key, value in run.items():   # JSON escapes what a dict holds; a string is the agent's words
            print(f"{key:>16}: {json.dumps(value) if isinstance(value, dict) else visible(str(value), lines=False)}")
    elif args.action == "log" and args.follow:
        follow_log(client, args.target)
    elif args.action == "log":
        sys.stdout.write(visible(client.call("GET", f"/v1/outpost/runs/{args.target}/log", raw=True)))
    elif args.action == "cancel":
        run = client.call("POST", f"/v1/outpost/runs/{args.target}/control", {"action": "cancel"}, idempotent=True)
        print(json.dumps(run, indent=2) if args.json else f"Run {run['id']} is {run['status']}"
              + (" (cancel requested)" if run["status"] not in SETTLED_RUN_STATUSES else "") + ".")


def follow_log(client: Client, run_id: str) -> None:
    """``outpost runs log ID --follow``: the log so far, then what is new each FOLLOW_POLL_S, until
    the run settles. The status is read before the log, so the read after it settled is its end."""
    offset = 0
    while True:
        status = client.call("GET", f"/v1/outpost/runs/{run_id}")["status"]
        text, headers = client.exchange("GET", f"/v1/outpost/runs/{run_id}/log?offset={offset}")
        sys.stdout.write(visible(text.decode(errors="replace")))
        sys.stdout.flush()
        offset = int(headers.get("X-Log-Size") or offset)
        if status not in ACTIVE_RUN_STATUSES:
            return
        time.sleep(FOLLOW_POLL_S)


def cli_keys(client: Client, args: argparse.Namespace, folder: Path) -> None:
    """``outpost keys``: a proposer key is printed once, alone on the last line, and kept in
    ``<data dir>/keys/NAME`` (0600): the data dir is hidden from every run, so no agent reads it
    there, unlike a key written into a CLI's own config (docs/agent-clis.md)."""
    if args.action == "create":
        if not args.proposer:
            raise CliError("say what the key may do: `outpost keys create --proposer` (look and propose, never "
                           "decide; the only kind)", EXIT_USAGE)
        made = client.call("POST", "/v1/outpost/keys", {"name": args.key_name, "role": "proposer"} if args.key_name
                           else {"role": "proposer"}, idempotent=True)
        saved = folder / made["name"]
        with contextlib.suppress(OSError):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(saved, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(made["key"] + "\n")
        if args.json:
            print(json.dumps({**made, "file": str(saved) if saved.exists() else None}))
            return
        where = f"saved in {saved} (0600; no run sees the data dir)" if saved.exists() else "not saved"
        print(f"Proposer key {made['name']!r} made, {where}. Give your CLI `outpost mcp --key-file {saved}` "
              "(docs/agent-clis.md); never write the key into a CLI's config, which runs can read:", file=sys.stderr)
        print(made["key"])
    elif args.action == "list":
        keys = client.call("GET", "/v1/outpost/keys")["keys"]
        if args.json:
            print(json.dumps(keys, indent=2))
        elif not keys:
            print("No keys yet: `outpost keys create --proposer --name my-agent` makes one.")
        else:
            print_table([[k["name"], k["role"], k["created_at"]] for k in keys], ["NAME", "ROLE", "CREATED"])
    else:
        if not args.name:
            raise CliError("`outpost keys revoke` needs the key's name (`outpost keys list`)", EXIT_USAGE)
        client.call("DELETE", f"/v1/outpost/keys/{urllib.parse.quote(args.name, safe='')}")
        with contextlib.suppress(OSError):
            (folder / Path(args.name).name).unlink()
        print(f"Key {args.name!r} revoked: it opens nothing from now on.")


def cli_proposals(client: Client, args: argparse.Namespace) -> None:
    """``outpost proposals``: what proposer keys asked for; confirm and decline need the API token."""
    if args.action == "list":
        query = f"?state={urllib.parse.quote(args.state)}" if args.state else ""
        proposals = client.call("GET", "/v1/outpost/proposals" + query)["proposals"]
        if args.json:
            print(json.dumps(proposals, indent=2))
        elif not proposals:
            print("No proposals.")
        else:
            print_table([[p["id"], p["state"], p["kind"], p["review"].get("name", ""), p["proposed_by"]]
                         for p in proposals], ["ID", "STATE", "KIND", "SCHEDULE", "BY"])
        return
    if not args.id:
        raise CliError(f"`outpost proposals {args.action}` needs a proposal id (`outpost proposals list`)", EXIT_USAGE)
    path = f"/v1/outpost/proposals/{urllib.parse.quote(args.id, safe='')}"
    p = client.call("GET", path)
    if args.action == "show" or not args.json:
        show_proposal(p, args.json)
    if args.action == "confirm":
        confirm(f"Confirm {p['id']} ({p['kind']} {p['review'].get('name', '')!r})?", args.yes)
        p = client.call("POST", path + "/confirm", {}, idempotent=True)
    elif args.action == "decline":
        p = client.call("POST", path + "/decline", {"note": args.note}, idempotent=True)
    if args.action != "show":
        print(json.dumps(p, indent=2) if args.json else f"{p['id']}: {p['state']}"
              + (f", schedule {p['schedule_id']}" if p["state"] == ProposalState.CONFIRMED and p["schedule_id"] else "")
              + (f", with the note: {p['note']}" if p["note"] else ""))


def show_proposal(p: dict[str, Any], as_json: bool) -> None:
    """What a human reviews before confirming (as ``schedules create`` shows it)."""
    if as_json:
        print(json.dumps(p, indent=2))
        return
    review = p["review"]
    print(f"{p['id']}: {p['kind']} {review.get('name', '')!r}, {p['state']} (proposed by {p['proposed_by']})")
    print(review.get("summary", ""))
    for d in review.get("diff", []):
        print(f"  {d['field']}: {json.dumps(d['before'])} -> {json.dumps(d['after'])}")
    if p["kind"] == "create":
        print("Brief:\n  " + review["definition"]["brief"].replace("\n", "\n  "))
    zone_name = review["definition"]["timing"]["timezone"]
    for fire in review.get("next_fires", []):
        print(f"  fires {local_time(fire, zone_name)}")
    for w in review.get("warnings", []):
        print(f"  warning: {w}")


def cli_gc(client: Client, args: argparse.Namespace) -> None:
    """``outpost gc``: a housekeeping pass of the running daemon (docs/operations.md), its counts."""
    body: dict[str, Any] = {"dry_run": args.dry_run}
    if args.keep_days is not None:
        body["keep_days"] = args.keep_days
    counts = client.call("POST", "/v1/outpost/housekeeping", body, idempotent=True)
    if args.json:
        print(json.dumps(counts, indent=2))
        return
    verb = "would delete" if counts["dry_run"] else "deleted"
    print(f"{verb}: {counts['runs']} run(s), {counts['log_bytes']} log byte(s), {counts['events']} event(s), "
          f"{counts['wakeups']} wakeup(s), {counts['deliveries']} refused deliveries, "
          f"{counts['branches']} merged result branch(es)")
    print(f"database: {counts['database_bytes_before']} -> {counts['database_bytes_after']} bytes")


def cli_client(data_dir: Path, url: str | None) -> Client:
    """The daemon's API with its token, for the commands that call it."""
    token = api_token(data_dir, create=False)
    if token is None:
        raise CliError(f"no API token in {data_dir}: name the daemon's data dir with --data-dir, set "
                       f"OUTPOST_API_TOKEN, or start `outpost serve` once (it writes {data_dir / 'api-token'})",
                       EXIT_NO_TOKEN)
    return Client(daemon_url(data_dir, url), token)


def print_inspect(report: dict[str, Any]) -> None:
    print(f"{report['name']} ({report['schedule_id']}): {report['verdict']}")
    print("\nThe recovery checks:")
    for check in report["checks"]:
        print(f"\n{check['check']}. {check['title']}")
        for key, value in check["data"].items():
            if isinstance(value, list):
                print(f"   {key}: {'none' if not value else ''}")
                for item in value:
                    print("     - " + ", ".join(f"{k}={v}" for k, v in item.items() if k != "schedule_id"))
            else:
                print(f"   {key}: {json.dumps(value) if isinstance(value, dict) else value}")


def doctor_line(profile: AgentProfile, parent: dict[str, str]) -> tuple[bool, str]:
    """One profile, checked as its runs will see it: its binary on the PATH it gets, then its
    preset's check (version, login)."""
    if profile.name == "demo":
        return True, "demo: ok, built in (outpost demo-agent)"
    env = agent_env(profile, parent, "doctor")
    binary = shutil.which(profile.command[0], path=env.get("PATH", os.defpath))
    if binary is None:
        return False, (f"{profile.name}: {profile.command[0]!r} not found on the PATH it gets "
                       f"({env.get('PATH', os.defpath)}); install it for this user, or name it by absolute path")
    usable, said = profile.kind.doctor(binary, env)
    return usable, f"{profile.name}: {said}"


def cli_doctor(config: Config) -> int:
    """``outpost doctor``: one line per profile; exit 0 when every one is usable."""
    usable = True
    for profile in sorted(config.agents, key=lambda a: a.name):
        ok, line = doctor_line(profile, dict(os.environ))
        usable &= ok
        print(line)
    return 0 if usable else EXIT_REFUSED


def cli_migrate(data_dir: Path, url: str) -> None:
    """An appliance's SQLite history into an empty PostgreSQL database (docs/fleet.md)."""
    if not (data_dir / "outpost.sqlite3").exists():
        raise CliError(f"no Outpost database in {data_dir}", EXIT_USAGE)
    if problem := _database_url(url):
        raise CliError(f"--to {problem}", EXIT_USAGE)
    try:
        if not postgres_is_empty(url):
            raise CliError(f"{database_label(url)} is not empty: outpost migrate copies into a new, empty "
                           "database only (create one: createdb --owner outpost outpost)", EXIT_REFUSED)
        source = Store(data_dir / "outpost.sqlite3")
        target = Store(url, data_dir=data_dir)
    except (ConfigError, orm.dbapiprovider.DatabaseError) as exc:
        raise CliError(f"{database_label(url)}: {exc}".strip(), EXIT_USAGE) from None
    try:
        counts = source.copy_into(target, logs=data_dir / "runs")
    finally:
        source.close()
        target.close()
    width = max(map(len, counts))
    for table, count in counts.items():
        print(f"{table:{width}}  {count}")
    print(f"copied {sum(counts.values())} rows of {data_dir / 'outpost.sqlite3'} into {database_label(url)}; "
          f"serve it with: outpost serve --database {database_label(url)}")


#: The members of an ``outpost backup`` archive, the only names ``restore`` writes (each a plain file).
BACKUP_MEMBERS = ("manifest.json", "outpost.sqlite3", "outpost.toml", "api-token")
#: What a backup's manifest says it is.
BACKUP_FORMAT, BACKUP_VERSION = "outpost-backup", 1
#: The most a member other than the database may hold (a manifest, a config, a token).
BACKUP_SMALL_BYTES = 1024 * 1024


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def checked_database_copy(path: Path) -> dict[str, int]:
    """Open a copied database: whole (``PRAGMA quick_check``), Outpost's, not newer than this
    Outpost. Its schedule and run counts, for the one line the CLI prints."""
    try:
        db = sqlite3.connect(f"file:{urllib.parse.quote(str(path))}?mode=ro", uri=True)
        try:
            check = db.execute("PRAGMA quick_check").fetchone()[0]
            version = db.execute("SELECT version FROM schema_version").fetchone()
            counts = {"schedules": db.execute('SELECT COUNT(*) FROM "Schedule"').fetchone()[0],
                      "runs": db.execute('SELECT COUNT(*) FROM "Run"').fetchone()[0]}
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        raise CliError(f"the database in the backup is not an Outpost database: {exc}", EXIT_REFUSED) from None
    if check != "ok" or version is None:
        raise CliError(f"the database in the backup is damaged ({check})", EXIT_REFUSED)
    if version[0] > SCHEMA_VERSION:
        raise CliError(f"the backup's database is at schema version {version[0]}, newer than this Outpost "
                       f"({SCHEMA_VERSION}); upgrade Outpost first", EXIT_REFUSED)
    return counts


def cli_backup(data_dir: Path, file: Path) -> None:
    """``outpost backup FILE`` (docs/operations.md): the live database (SQLite's online backup, consistent
    while ``serve`` writes), ``outpost.toml`` and ``api-token`` in one gzipped tar with a manifest
    of their SHA-256s. Written beside FILE as 0600 (it holds the token and webhook secrets), then
    renamed over it: FILE is either the old backup or the whole new one. On PostgreSQL the
    database's own tools back it up (the Dialect says so)."""
    import tarfile
    import tempfile
    try:
        config = load_config(data_dir)
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    database = config.database or config.db_path
    dialect = dialect_of(database)
    if dialect.backup_refusal:
        raise CliError(dialect.backup_refusal, EXIT_USAGE)
    if not config.db_path.is_file():
        raise CliError(f"no Outpost database in {data_dir}", EXIT_USAGE)
    target = file.expanduser().absolute()
    made: list[str] = []
    try:
        fd, archive = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")   # 0600
        made.append(archive)
        fd_db, snapshot = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".sqlite3")
        made.append(snapshot)
        os.close(fd_db)
        os.unlink(snapshot)   # sqlite3 makes it anew; mkstemp only chose a free name in a writable place
        dialect.backup(database, Path(snapshot))
        os.chmod(snapshot, 0o600)
        counts = checked_database_copy(Path(snapshot))
        files = {"outpost.sqlite3": Path(snapshot)}
        files |= {name: data_dir / name for name in ("outpost.toml", "api-token") if (data_dir / name).is_file()}
        manifest = {"format": BACKUP_FORMAT, "version": BACKUP_VERSION, "schema_version": SCHEMA_VERSION,
                    "created_at": rfc3339(datetime.now(UTC)), "data_dir": str(data_dir), **counts,
                    "files": {name: sha256_file(path) for name, path in files.items()}}
        with os.fdopen(fd, "wb") as out, tarfile.open(fileobj=out, mode="w:gz") as tar:
            text = json.dumps(manifest, indent=2).encode()
            info = tarfile.TarInfo("manifest.json")
            info.size, info.mode, info.mtime = len(text), 0o600, int(time.time())
            tar.addfile(info, io.BytesIO(text))
            for name, path in files.items():   # read through a link (a managed outpost.toml): a plain file
                with open(path, "rb") as f:
                    info = tar.gettarinfo(arcname=name, fileobj=f)
                    info.mode, info.uid, info.gid, info.uname, info.gname = 0o600, 0, 0, "", ""
                    tar.addfile(info, f)
            tar.close()
            out.flush()
            os.fsync(out.fileno())
        os.replace(archive, target)
        made.remove(archive)
    except sqlite3.Error as exc:
        raise CliError(f"could not copy {config.db_path}: {exc}", EXIT_REFUSED) from None
    except OSError as exc:   # an unwritable or missing folder, a full disk, FILE a directory
        raise CliError(f"cannot write the backup {target}: {exc.strerror or exc}", EXIT_REFUSED) from None
    finally:
        for path in made:
            with contextlib.suppress(OSError):
                os.unlink(path)
    names = ", ".join(files)
    print(f"backed up {data_dir} to {target} ({target.stat().st_size} bytes: {names}; "
          f"{counts['schedules']} schedules, {counts['runs']} runs)")
    if "api-token" not in files:
        print("note: no api-token file (the token came from $OUTPOST_API_TOKEN): keep that value with the backup")


def backup_members(tar: Any) -> dict[str, Any]:
    """The archive's members by name, refused unless each is one of BACKUP_MEMBERS, once, and a
    plain file: a link, a device, a folder, an absolute name or one with ``..`` is never written."""
    members: dict[str, Any] = {}
    for member in tar.getmembers():
        if member.name not in BACKUP_MEMBERS or member.name in members or not member.isreg():
            kind = "a link" if member.issym() or member.islnk() else "not a plain file" if not member.isreg() else ""
            raise CliError(f"not an Outpost backup: it holds {member.name!r}{f' ({kind})' if kind else ''}; "
                           f"a backup holds only {', '.join(BACKUP_MEMBERS)}", EXIT_REFUSED)
        if member.name != "outpost.sqlite3" and member.size > BACKUP_SMALL_BYTES:
            raise CliError(f"not an Outpost backup: {member.name} is {member.size} bytes", EXIT_REFUSED)
        members[member.name] = member
    if "manifest.json" not in members or "outpost.sqlite3" not in members:
        raise CliError("not an Outpost backup: it has no manifest.json or no outpost.sqlite3", EXIT_REFUSED)
    return members


def restore_into(tar: Any, members: dict[str, Any], data_dir: Path) -> dict[str, Any]:
    """Write the members into the new ``data_dir`` (0700, files 0600, never through a link),
    each checked against the manifest's SHA-256. Returns the manifest."""
    try:
        manifest = json.loads(tar.extractfile(members["manifest.json"]).read())
        digests = dict(manifest["files"])
        version = manifest["version"] if manifest["format"] == BACKUP_FORMAT else None
    except (ValueError, KeyError, TypeError):
        version = None
    if not isinstance(version, int):
        raise CliError("not an Outpost backup: its manifest.json is not one", EXIT_REFUSED)
    if manifest["version"] > BACKUP_VERSION:
        raise CliError(f"the backup's format is version {manifest['version']}, newer than this Outpost reads "
                       f"({BACKUP_VERSION}); upgrade Outpost first", EXIT_REFUSED)
    if set(digests) != set(members) - {"manifest.json"}:
        raise CliError("the backup's files do not match its manifest (a damaged or altered backup)", EXIT_REFUSED)
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name in digests:
        digest = hashlib.sha256()
        fd = os.open(data_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            source = tar.extractfile(members[name])
            while chunk := source.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if not hmac.compare_digest(digest.hexdigest(), str(digests[name])):
            raise CliError(f"{name} in the backup does not match its manifest (a damaged or altered backup)",
                           EXIT_REFUSED)
    return manifest


def cli_restore(file: Path, data_dir: Path) -> None:
    """``outpost restore FILE --data-dir DIR`` (docs/operations.md): a backup into a new, empty data dir,
    refusing one that holds anything. What it wrote is removed again when the backup is refused."""
    import tarfile
    if data_dir.is_symlink() or (data_dir.exists() and (not data_dir.is_dir() or any(data_dir.iterdir()))):
        raise CliError(f"{data_dir} is not empty: restore writes into a new, empty data dir only "
                       "(choose another --data-dir, or move this one away)", EXIT_REFUSED)
    existed = data_dir.exists()
    try:
        with tarfile.open(file, "r:gz") as tar:   # what ``backup`` writes, nothing else
            members = backup_members(tar)
            try:
                manifest = restore_into(tar, members, data_dir)
                counts = checked_database_copy(data_dir / "outpost.sqlite3")
            except BaseException:
                for name in BACKUP_MEMBERS:
                    with contextlib.suppress(OSError):
                        (data_dir / name).unlink()
                if not existed:
                    with contextlib.suppress(OSError):
                        data_dir.rmdir()
                raise
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise CliError(f"{file} is not an Outpost backup ({' '.join(str(exc).split())})", EXIT_REFUSED) from None
    except OSError as exc:
        raise CliError(f"cannot restore {file} into {data_dir}: {exc.strerror or exc}"
                       f"{f' ({exc.filename})' if exc.filename else ''}", EXIT_REFUSED) from None
    token = "" if "api-token" in manifest["files"] else " (it holds no api-token: set $OUTPOST_API_TOKEN)"
    print(f"restored {file} ({manifest.get('created_at')}) into {data_dir}: {counts['schedules']} schedules, "
          f"{counts['runs']} runs{token}; start it with: outpost serve --data-dir {data_dir}")


def cli_inspect(data_dir: Path, target: str, as_json: bool) -> None:
    """Reads the store directly, so it answers even while the daemon is down: the data dir's
    SQLite file, or a fleet's database (``[settings] database``, ``$OUTPOST_DATABASE_URL``)."""
    try:
        database = load_config(data_dir).database
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    if database is None and not (data_dir / "outpost.sqlite3").exists():
        raise CliError(f"no Outpost database in {data_dir}", EXIT_USAGE)
    try:
        store = Store(database or data_dir / "outpost.sqlite3", data_dir=data_dir)
    except (ConfigError, SchemaTooNew, orm.dbapiprovider.DatabaseError) as exc:
        raise CliError(f"{database_label(database or data_dir)}: {exc}".strip(), EXIT_USAGE) from None
    try:
        sid = store.transaction(store.schedules.find_schedule_id, target)[0]
        report = store.transaction(store.schedules.inspect, sid)[0]
    except NotFound as exc:
        raise CliError(str(exc), EXIT_REFUSED) from None
    finally:
        store.close()
    print(json.dumps(report, indent=2)) if as_json else print_inspect(report)


#: The CLI's --url, as ``daemon_url`` resolves it.
URL_HELP = "daemon URL (default: 127.0.0.1:$OUTPOST_PORT, else the address serve recorded in the data dir, else :8321)"


# --- outpost mcp: Outpost's own tools for agents (docs/agent-clis.md) ----------------------------------
#
# A stdio MCP server on the official SDK, a thin client of the daemon's HTTP API: every rule is the
# API's, checked there for the credential this process started with. Inside a run (a run token) it
# offers an Office run's task tools, or only ask_human; with a person's proposer key, reads and
# proposals. A refusal reaches the model as the tool's error text (the problem's detail), never a
# traceback.

#: The tools each credential gets. No run ever gets a schedule, dispatch, control or confirmation tool.
OFFICE_RUN_TOOLS = ("get_task", "list_tasks", "comment", "move_task", "create_task", "request_approval", "wake",
                    "ask_human")
RUN_TOOLS = ("ask_human",)
PROPOSER_TOOLS = ("list_schedules", "get_schedule", "inspect_schedule", "preview", "list_runs", "get_run", "run_log",
                  "list_attention", "propose_schedule", "propose_change", "propose_control", "get_proposal",
                  "dispatch", "adopt_run", "reply")
#: What a schedule definition holds, for the tools that take one (docs/schedules.md).
DEFINITION_HELP = """definition: {"name", "brief" (the agent's instructions), "repository" (the absolute path of
a git repository on Outpost's machine), "agent" (a profile), "timing": {"kind": "cron", "expression":
"0 9 * * 1-5", "timezone": "Europe/Berlin"} or {"kind": "interval", "seconds": 3600, "timezone"} or
{"kind": "once", "at": "2027-01-04T09:00", "timezone"}; optional "source_ref", "workdir",
"limits": {"timeout_seconds", "model"}, "notify", "concurrency_policy", "catch_up"}."""
#: Lines of a run's log ``run_log`` answers with unless asked for another tail.
RUN_LOG_TAIL = 200


def url_segment(text: str) -> str:
    """``text`` as one segment of a URL path (an id a model typed: ``../keys`` stays one segment)."""
    return urllib.parse.quote(text, safe="")


class AgentTools:
    """The tools of ``outpost mcp``. Each is one call of the daemon's API; its docstring is what
    the model reads. ``task_id``: the run's own task (an Office run), the default of its tools."""

    def __init__(self, client: Client, task_id: str | None = None):
        self.client = client
        self.task_id = task_id

    @staticmethod
    def _refused(text: str) -> Exception:
        """A tool's error, which the model reads (the SDK's, imported only when ``outpost mcp`` runs)."""
        from mcp.server.mcpserver.exceptions import ToolError
        return ToolError(text)

    def _request(self, method: str, path: str, body: Any = None, *, idempotent: bool = False,
                 raw: bool = False) -> Any:
        """The API's answer; its refusal as the tool's error (the problem's words, never a traceback)."""
        try:
            return self.client.call(method, path, body, idempotent=idempotent, raw=raw)
        except CliError as exc:
            raise self._refused(str(exc)) from None

    def _call(self, method: str, path: str, body: Any = None, *, idempotent: bool = False) -> str:
        return json.dumps(self._request(method, path, body, idempotent=idempotent), ensure_ascii=False)

    def _task(self, task_id: str | None) -> str:
        if not (task_id or self.task_id):
            raise self._refused("this run has no task of its own: name one with task_id")
        return task_id or self.task_id

    # An Office run's tools (its run token; its own workspace).

    def get_task(self, task_id: str | None = None) -> str:
        """A task with its blockers, subtasks, comments and approvals (default: this run's task)."""
        return self._call("GET", f"/api/agent/tasks/{url_segment(self._task(task_id))}")

    def list_tasks(self, state: str | None = None, assignee: str | None = None) -> str:
        """The tasks of your workspace; state: TODO, IN_PROGRESS, IN_REVIEW, DONE or CANCELLED;
        assignee: an agent's name or id."""
        query = urllib.parse.urlencode({k: v for k, v in (("state", state), ("assignee", assignee)) if v})
        return self._call("GET", "/api/agent/tasks" + (f"?{query}" if query else ""))

    def comment(self, body: str, task_id: str | None = None) -> str:
        """Comment on a task (default: this run's task); its assignee is woken unless it is you,
        and so is each agent you mention: @Name, or @"Two Words"."""
        return self._call("POST", "/api/agent/comments", {"body": body, "task_id": self._task(task_id)})

    def move_task(self, state: Literal["TODO", "IN_PROGRESS", "IN_REVIEW", "DONE", "CANCELLED"],
                  task_id: str | None = None) -> str:
        """Move a task (default: this run's task) to TODO, IN_PROGRESS, IN_REVIEW, DONE or CANCELLED.
        Done or Cancelled wakes the agents its end unblocks."""
        return self._call("POST", f"/api/agent/tasks/{url_segment(self._task(task_id))}/move", {"state": state})

    def create_task(self, title: str, description: str | None = None, assignee: str | None = None,
                    parent_id: str | None = None, blocked_by: list[str] | None = None,
                    requires_approval: bool | None = None, reviewers: list[str] | None = None) -> str:
        """Create a task in your workspace. parent_id makes it a subtask (given explicitly: none is
        assumed); blocked_by lists task ids it waits for (its assignee is woken when they are all
        done); assignee and reviewers are agent names or ids."""
        body: dict[str, Any] = {"title": title, "parent_id": parent_id}
        for key, value in (("description", description), ("assignee", assignee), ("blocked_by", blocked_by),
                           ("requires_approval", requires_approval), ("reviewers", reviewers)):
            if value is not None:
                body[key] = value
        return self._call("POST", "/api/agent/tasks", body)

    def request_approval(self, note: str, task_id: str | None = None, reviewers: list[str] | None = None) -> str:
        """Ask a human to approve a task assigned to you (default: this run's task); reviewers (agent
        names or ids) become the task's, woken when it moves to IN_REVIEW. You are woken with the decision."""
        body: dict[str, Any] = {"note": note, "task_id": self._task(task_id)}
        if reviewers is not None:
            body["reviewers"] = reviewers
        return self._call("POST", "/api/agent/approvals", body)

    def wake(self, agent: str, reason: str) -> str:
        """Wake an agent of your workspace (its name or id; your own name wakes you again later)."""
        return self._call("POST", "/api/agent/wake", {"agent": agent, "reason": reason})

    def ask_human(self, question: str) -> str:
        """Stop and ask a human: this run ends as "needs you" with your question, and a person's
        answer continues your session. Use it when you cannot go on without a decision."""
        return self._call("POST", "/api/agent/needs-you", {"question": question})

    # A person's own agent (a proposer key): read, propose, dispatch, adopt, reply.

    def _schedule(self, schedule: str) -> str:
        """A schedule's id, from its id or its name."""
        try:
            return resolve_schedule(self.client, schedule)
        except CliError as exc:
            raise self._refused(str(exc)) from None

    def list_schedules(self, include_archived: bool = False) -> str:
        """Every schedule with its state, timing and next fire."""
        return self._call("GET", f"/v1/outpost/schedules?include_archived={str(include_archived).lower()}")

    def get_schedule(self, schedule_id: str) -> str:
        """One schedule (its id, or its name)."""
        return self._call("GET", f"/v1/outpost/schedules/{url_segment(self._schedule(schedule_id))}")

    def inspect_schedule(self, schedule_id: str) -> str:
        """Why a schedule did or did not run: a verdict first, then the six recovery checks."""
        report = self._request("GET", f"/v1/outpost/schedules/{url_segment(self._schedule(schedule_id))}/inspect")
        return json.dumps({"verdict": inspect_verdict(report), **report}, ensure_ascii=False)

    def preview(self, definition: dict[str, Any]) -> str:
        """What a schedule definition would do, changing nothing: a sentence, the next 5 fires in its
        timezone with their offsets, and warnings (DST, cron quirks). Errors name the field."""
        composed = self._request("POST", "/v1/outpost/schedules/compose", definition)
        zone_name = composed["definition"]["timing"]["timezone"]
        local = [local_time(f, zone_name) for f in composed["next_fires"]]
        return json.dumps({**composed, "next_fires_local": local}, ensure_ascii=False)

    def list_runs(self, schedule_id: str | None = None, status: str | None = None, limit: int = 20) -> str:
        """Runs, newest first; status: queued, running, paused, succeeded, failed, needs_you or cancelled."""
        query = {"limit": str(limit), **({"status": status} if status else {})}
        if schedule_id:
            query["schedule_id"] = self._schedule(schedule_id)
        return self._call("GET", "/v1/outpost/runs?" + urllib.parse.urlencode(query))

    def get_run(self, run_id: str) -> str:
        """One run: its status, error, agent report, branch and commits."""
        return self._call("GET", f"/v1/outpost/runs/{url_segment(run_id)}")

    def run_log(self, run_id: str, tail: int | None = None) -> str:
        """The last lines of a run's log (default 200)."""
        text = self._request("GET", f"/v1/outpost/runs/{url_segment(run_id)}/log", raw=True)
        lines = text.splitlines()[-max(1, min(tail or RUN_LOG_TAIL, 5000)):]
        return "\n".join(lines)[-64 * 1024:]

    def list_attention(self, state: Literal["open", "all"] = "open") -> str:
        """What waits for a human (state open or all): failures, questions, returned changes, proposals."""
        return self._call("GET", f"/v1/outpost/attention?state={urllib.parse.quote(state)}")

    def propose_schedule(self, definition: dict[str, Any]) -> str:
        """Propose a new schedule. Nothing is created: a human reviews it and confirms or declines;
        follow it with get_proposal."""
        return self._proposal("POST", "/v1/outpost/proposals", {"kind": "create", "definition": definition})

    def propose_change(self, schedule_id: str, changes: dict[str, Any]) -> str:
        """Propose changed fields of a schedule (its id or name); a human sees the diff and confirms.
        Each field given replaces the schedule's whole field: timing with all its keys
        ({"timing": {"kind": "cron", "expression": "0 7 * * *", "timezone": "Europe/Berlin"}})."""
        return self._proposal("POST", "/v1/outpost/proposals",
                              {"kind": "change", "schedule_id": self._schedule(schedule_id), "changes": changes})

    def propose_control(self, schedule_id: str, action: Literal["enable", "pause", "resume", "archive", "fire",
                                                                "approve_catch_up", "dismiss_catch_up"]) -> str:
        """Propose an action on a schedule (its id or name); a human confirms it."""
        return self._proposal("POST", "/v1/outpost/proposals",
                              {"kind": "control", "schedule_id": self._schedule(schedule_id), "action": action})

    def get_proposal(self, proposal_id: str) -> str:
        """A proposal's state: pending, confirmed (with the schedule id), declined (with the note) or stale."""
        return self._proposal("GET", f"/v1/outpost/proposals/{url_segment(proposal_id)}")

    def _proposal(self, method: str, path: str, body: Any = None) -> str:
        """A proposal as the agent needs it: its state and the note first, then what a human reviews."""
        p = self._request(method, path, body, idempotent=method == "POST")
        review = p["review"]
        zone_name = review["definition"]["timing"]["timezone"]
        return json.dumps({k: v for k, v in {
            "id": p["id"], "state": p["state"], "note": p["note"], "schedule_id": p["schedule_id"],
            "kind": p["kind"], "summary": review.get("summary"), "diff": review.get("diff"),
            "next_fires": [local_time(f, zone_name) for f in review.get("next_fires", [])],
            "warnings": review.get("warnings"), "decided_at": p["decided_at"]}.items() if v not in (None, [])},
            ensure_ascii=False)

    def dispatch(self, brief: str, repository: str, agent: str | None = None, source_ref: str | None = None,
                 workdir: str | None = None) -> str:
        """Run an agent once, now, on its own worktree and result branch. repository: the absolute
        path of a git repository on Outpost's machine; agent: a profile (list_runs shows those in use)."""
        body = {"brief": brief, "repository": repository, **{k: v for k, v in (
            ("agent", agent), ("source_ref", source_ref), ("workdir", workdir)) if v is not None}}
        return self._call("POST", "/v1/outpost/dispatches", body, idempotent=True)

    def adopt_run(self, run_id: str) -> str:
        """Take a run that waits for a human ("needs you") as yours, before you reply to it."""
        return self._call("POST", f"/v1/outpost/runs/{url_segment(run_id)}/adopt", {},
                          idempotent=True)

    def reply(self, run_id: str, message: str) -> str:
        """Answer a needs-you run you adopted: a new run continues its session with your message."""
        return self._call("POST", f"/v1/outpost/runs/{url_segment(run_id)}/reply",
                          {"message": message}, idempotent=True)


def mcp_credential(args: argparse.Namespace) -> tuple[str, bool]:
    """What ``outpost mcp`` acts with: a run's token inside a run (it wins: a run never gets a
    person's tools), else a proposer key from $OUTPOST_KEY or --key-file. (credential, is a run)"""
    if os.environ.get(RUN_TOKEN_ENV):
        return os.environ[RUN_TOKEN_ENV], True
    key = os.environ.get("OUTPOST_KEY", "").strip()
    if args.key_file:
        path = Path(args.key_file).expanduser()
        try:
            if path.stat().st_mode & 0o077:
                raise CliError(f"the key file {path} may be read by others: `chmod 600 {path}`", EXIT_NO_TOKEN)
            key = path.read_text().strip()
        except OSError as exc:
            raise CliError(f"cannot read the key file {args.key_file}: {exc.strerror or exc}", EXIT_NO_TOKEN) from None
        if not key:
            raise CliError(f"the key file {path} is empty: put the key `outpost keys create` printed in it",
                           EXIT_NO_TOKEN)
    if not key:
        raise CliError("no proposer key: make one with `outpost keys create --proposer --name my-agent`, then pass "
                       "--key-file <data dir>/keys/my-agent (or set OUTPOST_KEY)", EXIT_NO_TOKEN)
    if not key.startswith(PROPOSER_KEY_PREFIX):   # never the API token: a person's agent only proposes
        raise CliError(f"that is no proposer key (they begin with {PROPOSER_KEY_PREFIX}); make one with "
                       "`outpost keys create --proposer`", EXIT_NO_TOKEN)
    return key, False


def cli_mcp(data_dir: Path, args: argparse.Namespace) -> int:
    """``outpost mcp``: serve the tools its credential allows on stdio until the client hangs up."""
    import anyio
    from mcp.server.mcpserver import MCPServer
    credential, in_run = mcp_credential(args)
    client = Client(args.url or os.environ.get(API_URL_ENV) or daemon_url(data_dir, None), credential)
    if in_run:
        run = client.call("GET", "/api/agent/run")
        tools, names = AgentTools(client, run.get("task_id")), OFFICE_RUN_TOOLS if run["office"] else RUN_TOOLS
    else:
        try:   # a bad or revoked key stops here, in one line
            client.call("GET", "/v1/outpost/proposals?limit=1")
        except CliError as exc:
            if "(404" in str(exc):
                raise CliError(f"no Outpost daemon answers at {client.base_url} (404): check --url",
                               EXIT_UNREACHABLE) from None
            raise
        tools, names = AgentTools(client), PROPOSER_TOOLS
    purpose = "your run's tools." if in_run else "look at schedules and runs, and propose changes a human confirms."
    server = MCPServer("outpost", version=OUTPOST_VERSION, log_level="WARNING",
                       instructions="Outpost, the scheduler that runs coding agents: " + purpose)
    for name in names:
        tool = getattr(tools, name)
        server.add_tool(tool, name=name, structured_output=False,   # the API's JSON as the text, not wrapped again
                        description=inspect.cleandoc(tool.__doc__)
                        + ("\n" + DEFINITION_HELP if name in ("preview", "propose_schedule") else ""))
    anyio.run(server.run_stdio_async, backend="trio")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="outpost", description="Durable scheduler for coding agents.")
    parser.add_argument("--data-dir", type=Path, default=None, help="state directory (default $OUTPOST_DATA_DIR "
                        "or ~/.local/state/outpost)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run the appliance")
    p.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--max-running", type=int, default=None)
    p.add_argument("--database", default=None, help="a postgresql:// URL: one of a fleet's nodes (default $OUTPOST_"
                   "DATABASE_URL, [settings] database, or SQLite in the data dir)")
    p.add_argument("--verbose", action="store_true")
    p = sub.add_parser("token", help="print the API token")
    p.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS)
    p = sub.add_parser("inspect", help="print the recovery checks of a schedule (id or name)")
    p.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS)
    p.add_argument("schedule")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("migrate", help="copy this appliance's SQLite database into an empty PostgreSQL one")
    p.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS)
    p.add_argument("--to", required=True, metavar="URL", help="postgresql://user@host:5432/dbname (the password "
                   "from $OUTPOST_DATABASE_PASSWORD)")
    p = sub.add_parser("backup", help="copy the database, outpost.toml and api-token into one file (while "
                       "serve runs)")
    p.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS)
    p.add_argument("file", type=Path, help="the backup to write (0600; replaced whole when it exists)")
    p = sub.add_parser("restore", help="unpack a backup into a new, empty data dir")
    p.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS, help="the new, empty data dir")
    p.add_argument("file", type=Path, help="a file `outpost backup` wrote")
    p = sub.add_parser("gc", help="housekeeping now: delete settled runs and history older than keep_days")
    p.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS)
    p.add_argument("--keep-days", type=int, default=None, metavar="N",
                   help="keep N days (0: every settled run the rules allow; default [settings] keep_days)")
    p.add_argument("--dry-run", action="store_true", help="count what would go, delete nothing")
    p.add_argument("--url", default=None, help=URL_HELP)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("doctor", help="check each agent profile: binary, version, login")
    p.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS)
    p = sub.add_parser("mcp", help="Outpost's tools for an agent, as a stdio MCP server (a proposer key in "
                       "$OUTPOST_KEY, or a run's token inside a run)")
    p.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS)
    p.add_argument("--url", default=None, help=URL_HELP)
    p.add_argument("--key-file", default=None, help="read the proposer key from this file instead of $OUTPOST_KEY")
    p = sub.add_parser("gemini-settings", help=f"print the Gemini CLI settings a daemon that is not root needs in "
                       f"{GEMINI_SETTINGS_INSTALLED} (root's)")
    p.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS)
    p = sub.add_parser("keys", help="proposer keys for your own agents: create, list, revoke")
    p.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS)
    p.add_argument("action", choices=("create", "list", "revoke"))
    p.add_argument("name", nargs="?", help="revoke: the key's name")
    p.add_argument("--proposer", action="store_true", help="create: a key that may look and propose, never decide")
    p.add_argument("--name", dest="key_name", default=None, help="create: the key's name (default agent-<hex>)")
    p.add_argument("--url", default=None, help=URL_HELP)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("proposals", help="what your agents proposed: list, show, confirm, decline")
    p.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS)
    p.add_argument("action", choices=("list", "show", "confirm", "decline"))
    p.add_argument("id", nargs="?", help="the proposal (prp_...)")
    p.add_argument("--note", default=None, help="decline: why, for the agent that proposed it")
    p.add_argument("--state", default=None, help="list: only pending, confirmed, declined or stale")
    p.add_argument("--yes", action="store_true", help="confirm: without asking")
    p.add_argument("--url", default=None, help=URL_HELP)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    demo = sub.add_parser("demo-agent", help="the built-in simulated agent (reads the prompt on stdin)")
    demo.add_argument("--resume", metavar="SESSION_ID", help="continue this session (Office resumes)")
    for name, actions in (("schedules", ("list", "show", "create", "edit", "fire", "pause", "resume", "archive")),
                          ("runs", ("list", "show", "log", "cancel"))):
        p = sub.add_parser(name, help=f"{name}: {', '.join(actions)}")
        p.add_argument("--data-dir", type=Path, default=argparse.SUPPRESS)
        p.add_argument("action", choices=actions)
        p.add_argument("target", nargs="?", help="schedule id/name, definition file, or run id")
        p.add_argument("target_file", nargs="?", help="for edit: the file of changed fields")
        p.add_argument("--url", default=None, help=URL_HELP)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--yes", action="store_true", help="confirm without asking")
        p.add_argument("--all", action="store_true", help="list: include archived")
        p.add_argument("--follow", action="store_true", help="runs log: stream the live log until the run settles")
        p.add_argument("--schedule", help="runs list: only this schedule (id or name)")
        p.add_argument("--status", help="runs list: only this status")
        p.add_argument("--limit", type=int, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    data_dir = (args.data_dir or default_data_dir()).expanduser().absolute()
    try:
        if args.command == "demo-agent":
            return demo_agent(sys.stdin.read(), Path.cwd(), session_id=args.resume)
        if args.command == "serve":
            setup_logging(args.verbose)
            try:
                config = load_config(data_dir, host=args.host, port=args.port, max_running=args.max_running,
                                     database=args.database)
                check_installed()
                lock = hold_serve_lock(config.data_dir)   # held until the store is closed
                deps = open_deps(config)
            except (ConfigError, SchemaTooNew, orm.dbapiprovider.DatabaseError) as exc:
                print(f"outpost: {exc}", file=sys.stderr)
                return EXIT_USAGE
            except OSError as exc:   # a read-only or unwritable data dir: one line, never a traceback
                print(f"outpost: the data dir {data_dir} cannot be used: {exc.strerror or exc}"
                      f"{f' ({exc.filename})' if exc.filename else ''}", file=sys.stderr)
                return EXIT_USAGE
            try:
                trio.run(run_until_signal, deps)
            finally:
                deps.store.close()
                lock.close()
            return 0
        if args.command == "doctor":
            try:
                return cli_doctor(load_config(data_dir))
            except ConfigError as exc:
                raise CliError(str(exc), EXIT_USAGE) from None
        if args.command == "token":
            token = api_token(data_dir, create=False)
            if token is None:
                raise CliError(f"no token yet in {data_dir}: start `outpost serve` once", EXIT_NO_TOKEN)
            print(token)
            return 0
        if args.command == "inspect":
            cli_inspect(data_dir, args.schedule, args.json)
            return 0
        if args.command == "migrate":
            cli_migrate(data_dir, args.to)
            return 0
        if args.command == "backup":
            cli_backup(data_dir, args.file)
            return 0
        if args.command == "restore":
            cli_restore(args.file.expanduser().absolute(), data_dir)
            return 0
        if args.command == "gc":
            cli_gc(cli_client(data_dir, args.url), args)
            return 0
        if args.command == "mcp":
            return cli_mcp(data_dir, args)
        if args.command == "gemini-settings":   # docs/agent-clis.md: for a daemon that is not root
            print(json.dumps(gemini_settings(outpost_tool_server("", data_dir)), indent=2))
            return 0
        if args.command == "keys":
            cli_keys(cli_client(data_dir, args.url), args, data_dir / "keys")
            return 0
        if args.command == "proposals":
            cli_proposals(cli_client(data_dir, args.url), args)
            return 0
        if args.target is None and args.action not in ("list",):
            raise CliError(f"`outpost {args.command} {args.action}` needs a target", EXIT_USAGE)
        (cli_schedules if args.command == "schedules" else cli_runs)(cli_client(data_dir, args.url), args)
        return 0
    except CliError as exc:
        print(f"outpost: {exc}", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
