"""Guards that keep outpost.py navigable: every route declared once in a table with its auth,
handlers at module level, short functions and classes, sections and store layers that only
reach downward, statuses written as their enums' members. A failure here names the place that
broke the shape."""

from __future__ import annotations

import ast
import enum
import re
from pathlib import Path

import outpost

SOURCE = Path(outpost.__file__).read_text()
TREE = ast.parse(SOURCE)
#: Functions allowed past the length cap: the schema reads best whole.
LONG_ALLOWED = {"define_entities"}
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 120, 700
MAX_METHODS = 80
#: The sections of outpost.py, one per concern, in reading order (each uses only names defined above).
SECTIONS = ["Imports and constants.", "Errors", "Agent CLIs", "Configuration", "Schedules and runs, the domain",
            "Office, the domain", "Store", "Store", "Store", "Store", "Store", "Store", "Git and worktrees",
            "Running an agent", "Wiring", "Fleet", "Actors", "Web", "Web", "Web", "Web", "Supervisor",
            "CLI and main()"]
#: The store's parts, bottom to top, and the attribute of ``Store`` (and of the parts above) that holds each.
STORE_PARTS = ["RunStore", "ScheduleStore", "NodeStore", "AccessStore", "NotifyStore", "WakeupStore", "OfficeStore",
               "PipelineStore", "RoutineStore", "HousekeepingStore", "ChannelStore"]
PART_ATTRIBUTES = {"schedules": "ScheduleStore", "runs": "RunStore", "nodes": "NodeStore", "access": "AccessStore",
                   "notify": "NotifyStore",
                   "wakeups": "WakeupStore", "office": "OfficeStore", "pipeline": "PipelineStore",
                   "routines": "RoutineStore", "channels": "ChannelStore", "housekeeping": "HousekeepingStore"}

#: Every route of the appliance: (method, rule, auth). Reviewed: a change here is a change of the
#: contract or of who may call what.
ROUTES = [
    ("GET", "/healthz", "public"),
    ("GET", "/metrics", "metrics"),
    ("POST", "/v1/outpost/schedules/compose", "token"),
    ("POST", "/v1/outpost/schedules", "token"),
    ("GET", "/v1/outpost/schedules", "token"),
    ("GET", "/v1/outpost/schedules/<schedule_id>", "token"),
    ("PATCH", "/v1/outpost/schedules/<schedule_id>", "token"),
    ("POST", "/v1/outpost/schedules/<schedule_id>/control", "token"),
    ("GET", "/v1/outpost/schedules/<schedule_id>/occurrences", "token"),
    ("GET", "/v1/outpost/schedules/<schedule_id>/inspect", "token"),
    ("GET", "/v1/outpost/runs", "token"),
    ("GET", "/v1/outpost/runs/<run_id>", "token"),
    ("GET", "/v1/outpost/runs/<run_id>/log", "token"),
    ("POST", "/v1/outpost/runs/<run_id>/adopt", "token"),
    ("POST", "/v1/outpost/runs/<run_id>/rerun", "token"),
    ("POST", "/v1/outpost/runs/cancel", "token"),
    ("POST", "/v1/outpost/runs/rerun", "token"),
    ("GET", "/v1/outpost/runs/<run_id>/compare/<other_id>", "token"),
    ("GET", "/v1/outpost/charts/runs.svg", "token"),
    ("POST", "/v1/outpost/runs/<run_id>/reply", "token"),
    ("GET", "/v1/outpost/agents", "token"),
    ("POST", "/v1/outpost/agents/<name>/control", "token"),
    ("POST", "/v1/outpost/runs/<run_id>/control", "token"),
    ("POST", "/v1/outpost/dispatches", "token"),
    ("GET", "/v1/outpost/proposals", "token"),
    ("GET", "/v1/outpost/proposals/<proposal_id>", "token"),
    ("POST", "/v1/outpost/proposals", "token"),
    ("POST", "/v1/outpost/proposals/<proposal_id>/confirm", "token"),
    ("POST", "/v1/outpost/proposals/<proposal_id>/decline", "token"),
    ("GET", "/v1/outpost/keys", "token"),
    ("POST", "/v1/outpost/keys", "token"),
    ("DELETE", "/v1/outpost/keys/<name>", "token"),
    ("GET", "/v1/outpost/nodes", "token"),
    ("GET", "/v1/outpost/attention", "token"),
    ("GET", "/v1/outpost/upcoming", "token"),
    ("POST", "/v1/outpost/attention/ack", "token"),
    ("POST", "/v1/outpost/attention/<attention_id>/ack", "token"),
    ("POST", "/v1/outpost/housekeeping", "token"),
    ("GET", "/v1/outpost/notify", "token"),
    ("POST", "/v1/outpost/notify/test", "token"),
    ("GET", "/v1/outpost/notify/entries", "token"),
    ("POST", "/v1/outpost/notify/entries", "token"),
    ("PATCH", "/v1/outpost/notify/entries/<entry_id>", "token"),
    ("DELETE", "/v1/outpost/notify/entries/<entry_id>", "token"),
    ("POST", "/v1/outpost/notify/entries/<entry_id>/test", "token"),
    ("GET", "/v1/outpost/events", "token"),
    ("GET", "/v1/outpost/events/stream", "token"),
    ("GET", "/v1/outpost/snapshot", "token"),
    ("GET", "/api/office/workspaces", "token"),
    ("POST", "/api/office/workspaces", "token"),
    ("GET", "/api/office/projects", "token"),
    ("POST", "/api/office/projects", "token"),
    ("GET", "/api/office/agents", "token"),
    ("POST", "/api/office/agents", "token"),
    ("GET", "/api/office/agents/<agent_id>", "token"),
    ("PATCH", "/api/office/agents/<agent_id>", "token"),
    ("GET", "/api/office/agents/<agent_id>/runs", "token"),
    ("POST", "/api/office/agents/<agent_id>/wake", "token"),
    ("GET", "/api/office/tasks", "token"),
    ("POST", "/api/office/tasks", "token"),
    ("GET", "/api/office/tasks/<task_id>", "token"),
    ("PATCH", "/api/office/tasks/<task_id>", "token"),
    ("POST", "/api/office/tasks/<task_id>/move", "token"),
    ("POST", "/api/office/tasks/<task_id>/comments", "token"),
    ("GET", "/api/office/approvals", "token"),
    ("POST", "/api/office/approvals/<approval_id>/resolve", "token"),
    ("GET", "/api/office/wakeups", "token"),
    ("GET", "/api/office/runs/<run_id>", "token"),
    ("GET", "/api/office/activity", "token"),
    ("GET", "/api/office/settings", "token"),
    ("PATCH", "/api/office/settings", "token"),
    ("GET", "/api/office/routines", "token"),
    ("POST", "/api/office/routines", "token"),
    ("GET", "/api/office/routines/<routine_id>", "token"),
    ("PATCH", "/api/office/routines/<routine_id>", "token"),
    ("DELETE", "/api/office/routines/<routine_id>", "token"),
    ("POST", "/api/office/routines/<routine_id>/fire", "token"),
    ("POST", "/api/office/routines/<routine_id>/triggers", "token"),
    ("DELETE", "/api/office/routines/<routine_id>/triggers/<trigger_id>", "token"),
    ("POST", "/api/office/routines/<routine_id>/triggers/<trigger_id>/rotate", "token"),
    ("GET", "/api/office/channels", "token"),
    ("POST", "/api/office/channels/<name>/test", "token"),
    ("POST", "/api/agent/needs-you", "any_run"),
    ("GET", "/api/agent/run", "any_run"),
    ("GET", "/api/agent/me", "run"),
    ("POST", "/api/agent/comments", "run"),
    ("POST", "/api/agent/tasks/<task_id>/move", "run"),
    ("GET", "/api/agent/tasks", "run"),
    ("GET", "/api/agent/tasks/<task_id>", "run"),
    ("POST", "/api/agent/tasks", "run"),
    ("POST", "/api/agent/approvals", "run"),
    ("POST", "/api/agent/wake", "run"),
    ("POST", "/api/routine-triggers/<public_id>/fire", "signature"),
    ("POST", "/api/channels/slack/<name>", "signature"),
    ("POST", "/api/channels/telegram/<name>", "signature"),
    ("GET", "/signin", "public"),
    ("POST", "/signin", "public"),
    ("GET", "/signin/<code>", "public"),
    ("POST", "/signout", "session"),
    ("GET", "/", "session"),
    ("GET", "/schedules", "session"),
    ("GET", "/schedules/new", "session"),
    ("POST", "/schedules/review", "session"),
    ("POST", "/schedules", "session"),
    ("GET", "/schedules/<schedule_id>", "session"),
    ("GET", "/schedules/<schedule_id>/edit", "session"),
    ("POST", "/schedules/<schedule_id>/review", "session"),
    ("POST", "/schedules/<schedule_id>", "session"),
    ("POST", "/schedules/<schedule_id>/control", "session"),
    ("GET", "/runs", "session"),
    ("POST", "/runs/bulk", "session"),
    ("GET", "/runs/<run_id>", "session"),
    ("GET", "/runs/<run_id>/log", "session"),
    ("POST", "/runs/<run_id>/rerun", "session"),
    ("GET", "/runs/<run_id>/compare", "session"),
    ("POST", "/runs/<run_id>/adopt", "session"),
    ("POST", "/runs/<run_id>/reply", "session"),
    ("GET", "/agents", "session"),
    ("POST", "/agents/<name>/resume", "session"),
    ("POST", "/runs/<run_id>/control", "session"),
    ("GET", "/upcoming", "session"),
    ("GET", "/attention", "session"),
    ("POST", "/attention/<attention_id>/ack", "session"),
    ("POST", "/attention/ack-all", "session"),
    ("POST", "/attention/ack-selected", "session"),
    ("GET", "/proposals", "session"),
    ("GET", "/proposals/<proposal_id>", "session"),
    ("POST", "/proposals/<proposal_id>/confirm", "session"),
    ("POST", "/proposals/<proposal_id>/decline", "session"),
    ("GET", "/settings", "session"),
    ("POST", "/settings/notify/test", "session"),
    ("POST", "/settings/notify/entries", "session"),
    ("POST", "/settings/notify/entries/<entry_id>/delete", "session"),
    ("POST", "/settings/channels/<name>/test", "session"),
    ("GET", "/office", "session"),
    ("GET", "/office/agents", "session"),
    ("POST", "/office/agents", "session"),
    ("GET", "/office/agents/<agent_id>", "session"),
    ("POST", "/office/agents/<agent_id>", "session"),
    ("POST", "/office/agents/<agent_id>/wake", "session"),
    ("GET", "/office/board", "session"),
    ("POST", "/office/tasks", "session"),
    ("GET", "/office/tasks/<task_id>", "session"),
    ("POST", "/office/tasks/<task_id>", "session"),
    ("POST", "/office/tasks/<task_id>/move", "session"),
    ("POST", "/office/tasks/<task_id>/comments", "session"),
    ("POST", "/office/approvals/<approval_id>/resolve", "session"),
    ("GET", "/office/wakeups", "session"),
    ("GET", "/office/runs/<run_id>", "session"),
    ("GET", "/office/activity", "session"),
    ("GET", "/office/routines", "session"),
    ("POST", "/office/routines", "session"),
    ("GET", "/office/routines/<routine_id>", "session"),
    ("POST", "/office/routines/<routine_id>", "session"),
    ("POST", "/office/routines/<routine_id>/status", "session"),
    ("POST", "/office/routines/<routine_id>/delete", "session"),
    ("POST", "/office/routines/<routine_id>/fire", "session"),
    ("POST", "/office/routines/<routine_id>/triggers", "session"),
    ("POST", "/office/routines/<routine_id>/triggers/<trigger_id>/delete", "session"),
    ("POST", "/office/routines/<routine_id>/triggers/<trigger_id>/rotate", "session"),
    ("GET", "/office/settings", "session"),
    ("POST", "/office/settings", "session"),
]


def declared() -> list[tuple[str, str, str]]:
    return [(r.method, r.rule, str(r.auth)) for t in outpost.ROUTE_TABLES for r in t.routes]


def test_every_route_is_declared_once_with_an_auth():
    routes = declared()
    assert len(routes) == len(set((m, rule) for m, rule, _ in routes))
    assert all(r.auth in outpost.Auth for t in outpost.ROUTE_TABLES for r in t.routes)


def test_the_route_table_matches_the_reviewed_snapshot():
    assert declared() == ROUTES


def test_the_app_serves_exactly_the_declared_routes(tmp_path):
    deps = outpost.Deps(config=outpost.Config(data_dir=tmp_path), store=outpost.Store(tmp_path / "db.sqlite3"),
                        clock=outpost.WallClock(), token="t")
    app = outpost.create_app(deps)
    served = {(m, rule.rule) for rule in app.url_map.iter_rules() for m in rule.methods - {"HEAD", "OPTIONS"}
              if rule.endpoint != "static"}
    assert served == {(m, rule) for m, rule, _ in ROUTES}
    deps.store.close()


def test_json_api_routes_never_use_the_dashboard_auth():
    for table in (outpost.api, outpost.office_api, outpost.agent_api, outpost.hooks):
        assert all(r.auth is not outpost.Auth.SESSION for r in table.routes), table.surface
    assert all(r.auth in (outpost.Auth.SESSION, outpost.Auth.PUBLIC) for r in outpost.pages.routes)


def function_nodes():
    return [n for n in ast.walk(TREE) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def test_no_function_defines_route_handlers_inside_itself():
    tables = {t.surface for t in outpost.ROUTE_TABLES} | {"app"}
    for fn in function_nodes():
        for inner in ast.walk(fn):
            if inner is fn or not isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for d in inner.decorator_list:
                target = d.func if isinstance(d, ast.Call) else d
                assert not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                            and target.value.id in tables), f"{fn.name} defines the route {inner.name}"


def test_create_app_only_installs_the_tables():
    (create_app,) = [n for n in function_nodes() if n.name == "create_app"]
    nested = [n for n in ast.walk(create_app)
              if n is not create_app and isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef)]
    assert len(nested) <= 2, [n.name for n in nested]


def test_functions_and_classes_stay_short():
    too_long = [(n.name, n.end_lineno - n.lineno + 1) for n in function_nodes()
                if n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES and n.name not in LONG_ALLOWED]
    too_long += [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(TREE)
                 if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > MAX_CLASS_LINES]
    assert too_long == []


def section_of(lineno: int, banners: list[tuple[int, int]]) -> int:
    return max((n for line, n in banners if line <= lineno), default=1)


def module_names(banners) -> dict[str, int]:
    """Each module-level name with the section that defines it."""
    names: dict[str, int] = {}
    for node in TREE.body:
        targets = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            targets = [node.name]
        elif isinstance(node, ast.Assign):
            targets = [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            targets = [node.target.id]
        for name in targets:
            names.setdefault(name, section_of(node.lineno, banners))
    return names


def annotations() -> set[int]:
    """Annotation nodes: strings under ``from __future__ import annotations``, never evaluated."""
    found: set[int] = set()
    for n in ast.walk(TREE):
        parts = [n.annotation] if isinstance(n, ast.AnnAssign | ast.arg) and n.annotation else []
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.returns:
            parts.append(n.returns)
        for part in parts:
            found |= {id(x) for x in ast.walk(part)}
    return found


def test_sections_are_in_order_and_only_use_names_defined_above():
    banners = [(i + 1, int(m[1])) for i, line in enumerate(SOURCE.split("\n")) if (m := re.match(r"^# (\d+)\. ", line))]
    assert [n for _, n in banners] == list(range(1, len(SECTIONS) + 1))
    titles = [line.split(". ", 1)[1].split(":")[0] for line in SOURCE.split("\n") if re.match(r"^# \d+\. ", line)]
    assert titles == SECTIONS
    names, skip = module_names(banners), annotations()
    upward = sorted({(getattr(node, "name", node.lineno), n.id) for node in TREE.body
                     for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                     and id(n) not in skip and names.get(n.id, 0) > section_of(node.lineno, banners)})
    assert upward == []


def methods_with_bases(cls: type) -> set[str]:
    """The methods a class carries, its own and its bases' (those of Python's own classes aside)."""
    return {name for klass in cls.__mro__ if klass.__module__ == "outpost" for name, value in vars(klass).items()
            if callable(value) or isinstance(value, property | staticmethod | classmethod)}


def test_no_class_carries_more_than_80_methods_with_its_bases():
    heavy = {name: len(methods_with_bases(cls)) for name, cls in vars(outpost).items()
             if isinstance(cls, type) and cls.__module__ == "outpost"}
    assert {name: n for name, n in heavy.items() if n > MAX_METHODS} == {}


def test_store_parts_hold_only_the_parts_below_them():
    """Each part is built from the core and the parts below it (its __init__'s parameters), and
    reaches other parts only through those: ``self.runs.settle_run``, never a part above."""
    assert [cls.__name__ for cls in outpost.StorePart.__subclasses__()] == STORE_PARTS
    store = outpost.Store(":memory:")
    try:
        built = [type(value).__name__ for value in vars(store).values() if isinstance(value, outpost.StorePart)]
        assert built == STORE_PARTS
        below: set[str] = set()
        for part in (value for value in vars(store).values() if isinstance(value, outpost.StorePart)):
            held = {type(v).__name__ for k, v in vars(part).items() if isinstance(v, outpost.StorePart)}
            assert held <= below, (type(part).__name__, held - below)
            below.add(type(part).__name__)
    finally:
        store.close()
    classes = {n.name: n for n in TREE.body if isinstance(n, ast.ClassDef) and n.name in STORE_PARTS}
    for name, cls in classes.items():
        reached = {n.value.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
                   and isinstance(n.value, ast.Attribute) and isinstance(n.value.value, ast.Name)
                   and n.value.value.id == "self" and n.value.attr in PART_ATTRIBUTES}
        above = [a for a in reached if STORE_PARTS.index(PART_ATTRIBUTES[a]) >= STORE_PARTS.index(name)]
        assert above == [], name


def test_only_the_dialect_tells_sqlite_from_postgresql():
    """One Dialect chosen at start holds the SQL that differs and the fleet's behaviour; nobody
    tests a ``postgres`` flag, and provider-specific SQL lives in the dialect's classes."""
    assert not [n.lineno for n in ast.walk(TREE) if isinstance(n, ast.Attribute) and n.attr == "postgres"]
    dialects = [n for n in TREE.body if isinstance(n, ast.ClassDef) and n.name in ("Dialect", "PostgresDialect")]
    inside = {id(x) for cls in dialects for x in ast.walk(cls)}
    inside |= {id(n.body[0].value) for n in ast.walk(TREE) if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef)
               and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    markers = ("clock_timestamp", "jsonb_", "json_each", "json_extract", "PRAGMA table_info",
               "information_schema.columns",
               "pg_advisory_xact_lock")
    outside = [(n.lineno, marker) for n in ast.walk(TREE) if isinstance(n, ast.Constant) and isinstance(n.value, str)
               and id(n) not in inside for marker in markers if marker in n.value]
    assert outside == []
    assert isinstance(outpost.dialect_of("postgresql://u@h/db"), outpost.PostgresDialect)
    assert type(outpost.dialect_of(":memory:")) is outpost.Dialect


def test_each_preset_holds_its_reader_and_nothing_else_names_a_cli():
    """One home for agent CLIs: a preset carries its reader (a function, not a format string),
    its transcriber and its doctor check; outside the Agent CLIs section no code names a CLI."""
    assert all(callable(p.reader) and p.reader.__name__.startswith("read_") for p in outpost.PRESETS.values())
    assert {p.reader for p in outpost.PRESETS.values()} == {outpost.read_claude, outpost.read_codex,
                                                           outpost.read_gemini, outpost.read_aider,
                                                           outpost.read_generic}
    assert not hasattr(outpost, "READERS") and not hasattr(outpost, "TRANSCRIBERS")
    banners = [i + 1 for i, line in enumerate(SOURCE.split("\n")) if re.match(r"^# \d+\. ", line)]
    clis = (banners[SECTIONS.index("Agent CLIs")], banners[SECTIONS.index("Agent CLIs") + 1])
    named = [n.lineno for n in ast.walk(TREE) if isinstance(n, ast.Constant) and n.value in outpost.PRESETS
             and n.value != "generic" and not clis[0] <= n.lineno < clis[1]]
    assert named == []


def test_a_schedule_is_created_and_edited_by_one_action_each():
    """The JSON API and the dashboard create and edit a schedule through one action each
    (``create_schedule``, ``update_schedule``): its checks and confirmation are written once.
    Confirming a proposal commits the same store calls inside its own transaction."""
    callers = {}
    for node in TREE.body:
        if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            for n in ast.walk(node):
                if (isinstance(n, ast.Attribute) and n.attr in ("create_schedule", "update_schedule")
                        and isinstance(n.value, ast.Attribute) and n.value.attr == "schedules"):
                    callers.setdefault(n.attr, set()).add(node.name)
    assert callers == {"create_schedule": {"create_schedule", "confirm_proposal"},
                       "update_schedule": {"update_schedule", "confirm_proposal"}}


def test_the_docstring_map_and_the_development_docs_list_every_section():
    """The module docstring's map of sections and docs/development.md's table number the same
    sections as the banners, so neither goes stale when a section is split or added."""
    numbers = list(range(1, len(SECTIONS) + 1))
    docstring = ast.get_docstring(TREE)
    listed = sorted(int(n) for n in re.findall(r"\b(\d+)\. [a-zA-Z]", docstring.split("Sections of this file")[1]))
    assert listed == numbers
    development = (Path(outpost.__file__).parent / "docs" / "development.md").read_text()
    assert [int(n) for n in re.findall(r"^\| (\d+)\. ", development, re.M)] == numbers


def test_actors_get_their_channels_one_way():
    """Deps makes and owns the channels between the actors; an actor takes none as an argument
    and receives only through a handle it opened with ``async with`` (a clone it closes on its
    way out), as trio's memory channels are meant to be held."""
    actors = [n for n in TREE.body if isinstance(n, ast.AsyncFunctionDef) and n.name.endswith("_actor")]
    assert len(actors) >= 6
    for node in actors:
        annotations = [ast.unparse(a.annotation) for a in node.args.args if a.annotation]
        assert not [a for a in annotations if "Channel" in a], node.name
        receivers = {n.func.value.id for n in ast.walk(node) if isinstance(n, ast.Call)
                     and isinstance(n.func, ast.Attribute) and n.func.attr == "receive"
                     and isinstance(n.func.value, ast.Name)}
        opened = {item.optional_vars.id for n in ast.walk(node) if isinstance(n, ast.AsyncWith)
                  for item in n.items if isinstance(item.optional_vars, ast.Name)}
        assert receivers <= opened, node.name


#: The status sets of outpost.py by the name of what holds one of their values: an attribute, a
#: key, a variable or a parameter called so, or ending so (``routine_status``).
STATUS_SETS = {"status": ("RunStatus", "WakeupStatus", "AgentStatus", "RoutineStatus", "RoutineRunStatus",
                          "ApprovalStatus", "NodeStatus", "NotificationStatus"),
               "state": ("TaskState", "ProposalState", "IdempotencyState"), "outcome": ("SlotOutcome",),
               "source": ("WakeupSource",), "cancel_reason": ("CancelReason",)}
#: Raw SQL comparing a status column with quoted values: ``status = 'queued'``, ``w.status IN ('a', 'b')``.
SQL_STATUS = re.compile(r"\b(" + "|".join(STATUS_SETS) + r")(?:\s*\|\|\s*'')?\s*(?:=|<>|!=|\bNOT IN\b|\bIN\b)\s*"
                        r"(\(\s*'[^)]*\)|'\w+')")


def status_set(name: str) -> str | None:
    return next((key for key in STATUS_SETS if name == key or name.endswith("_" + key)), None)


def holder(node: ast.AST) -> str | None:
    """The status set of what ``node`` names: ``w.status``, ``status``, ``row["status"]``, ``raw.get("status")``."""
    if isinstance(node, ast.Attribute):
        return status_set(node.attr)
    if isinstance(node, ast.Name):
        return status_set(node.id)
    key = node.slice if isinstance(node, ast.Subscript) else node.args[0] if (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
        and node.args) else None
    return status_set(key.value) if isinstance(key, ast.Constant) and isinstance(key.value, str) else None


def literals(node: ast.AST) -> list[ast.Constant]:
    """The strings a value is made of: itself, a tuple's items, both sides of ``a if c else b`` or ``a or b``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node]
    parts = (node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else
             [node.body, node.orelse] if isinstance(node, ast.IfExp) else
             node.values if isinstance(node, ast.BoolOp) else [])
    return [c for part in parts for c in literals(part)]


def status_positions(tree: ast.Module):
    """(status set or None, value) for every value Python code puts where a status goes: compared
    with one, assigned to one (tuple targets too), a keyword, a dict entry, a ``.get`` default, a
    parameter's default, or the argument of a parameter called so."""
    params: dict[str, list[list[str]]] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            args = fn.args.posonlyargs + fn.args.args
            names = [a.arg for a in args]
            params.setdefault(fn.name, []).append(names[1:] if names[:1] in (["self"], ["cls"]) else names)
            defaults = [*zip(args[len(args) - len(fn.args.defaults):], fn.args.defaults, strict=True),
                        *zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True)]
            yield from ((status_set(a.arg), d) for a, d in defaults if d is not None)
    for n in ast.walk(tree):
        if isinstance(n, ast.Compare):
            sides = [n.left, *n.comparators]
            yield from ((key, side) for key in {holder(s) for s in sides} for side in sides)
        elif isinstance(n, ast.Assign | ast.AnnAssign) and n.value is not None:
            for target in n.targets if isinstance(n, ast.Assign) else [n.target]:
                paired = (isinstance(target, ast.Tuple) and isinstance(n.value, ast.Tuple)
                          and len(target.elts) == len(n.value.elts))
                yield from ((holder(t), v) for t, v in (zip(target.elts, n.value.elts, strict=True) if paired
                                                        else [(target, n.value)]))
        elif isinstance(n, ast.keyword) and n.arg:
            yield status_set(n.arg), n.value
        elif isinstance(n, ast.Dict):
            yield from ((status_set(k.value), v) for k, v in zip(n.keys, n.values, strict=True)
                        if isinstance(k, ast.Constant) and isinstance(k.value, str))
        elif isinstance(n, ast.Call):
            if len(n.args) == 2:
                yield holder(n), n.args[1]   # raw.get("status", "idle")
            called = n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
            yield from ((status_set(p), arg) for names in params.get(called, [])
                        for p, arg in zip(names, n.args, strict=False))


def bare_status_literals(source: str) -> list[tuple[int, str]]:
    """(line, value) of each status value ``source`` spells as a bare string where a status goes,
    in Python or in raw SQL; the enum classes that define the values, and docstrings, aside."""
    tree = ast.parse(source)
    values = {key: {m.value for name in names for m in getattr(outpost, name)} for key, names in STATUS_SETS.items()}
    skip = {id(x) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
            and any(getattr(base, "attr", None) == "StrEnum" for base in n.bases) for x in ast.walk(n)}
    skip |= {id(n.body[0].value) for n in ast.walk(tree)
             if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
             and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    banners = [i + 1 for i, line in enumerate(source.split("\n")) if re.match(r"^# \d+\. ", line)]
    clis = range(banners[SECTIONS.index("Agent CLIs")], banners[SECTIONS.index("Agent CLIs") + 1])
    python = {(c.lineno, c.col_offset, c.value) for key, value in status_positions(tree) if key
              for c in literals(value) if c.value in values[key] and id(c) not in skip}
    sql = [(n.lineno, n.col_offset, value) for n in ast.walk(tree) if isinstance(n, ast.Constant)
           and isinstance(n.value, str) and id(n) not in skip
           for m in SQL_STATUS.finditer(n.value) for value in re.findall(r"'(\w+)'", m[2]) if value in values[m[1]]]
    return sorted((line, value) for line, _, value in [*python, *sql] if line not in clis)


def test_statuses_are_written_as_their_enum_members():
    """A status is its enum's member (``WakeupStatus.QUEUED``; in raw SQL ``'{WakeupStatus.QUEUED}'``),
    never a bare string that a typo breaks silently: wherever Python compares, assigns, passes or
    stores one, and wherever raw SQL compares a status column. The Agent CLIs section, above the
    enums, reads the CLIs' own output. Every status enum is listed here."""
    assert bare_status_literals(SOURCE) == []
    enums = {name for name, value in vars(outpost).items() if isinstance(value, type)
             and issubclass(value, enum.StrEnum) and name.endswith(("Status", "State", "Outcome"))}
    assert enums <= {name for names in STATUS_SETS.values() for name in names}


def test_the_status_guard_finds_a_bare_literal_in_python_and_in_sql():
    """The guard itself: a literal planted in a tuple assignment and one in raw SQL are both found."""
    planted = SOURCE.replace("w.last_error = WakeupStatus.QUEUED", 'w.last_error = "queued"')
    planted = planted.replace("SET status = '{NodeStatus.LOST}'", "SET status = 'lost'")
    assert [value for _, value in bare_status_literals(planted)] == ["lost", "queued"]


def test_continuation_lines_line_up():
    """A continuation line starts under what it continues (pycodestyle's E127 and E128, which
    ruff does not check): a refactor that renames a call leaves its arguments where they were."""
    import pycodestyle
    report = pycodestyle.Checker(outpost.__file__, select=["E127", "E128"], max_line_length=120, quiet=True)
    assert report.check_all() == 0


def test_comments_cite_what_the_repository_holds():
    """A comment or docstring cites docs/ (or says it in words), never the specifications the
    code was written from, which are not in the repository: "spec processWakeup", "fire step 2",
    "shared/API.md 7.3" send a reader nowhere."""
    cited = re.compile(r"\bspec\b(?!=)|\bspec's|shared/API\.md|\bAPI\.md \d|\b(?:fire |pipeline )?steps? \d+\b(?!\.)",
                       re.I)
    comments = [(i + 1, line) for i, line in enumerate(SOURCE.split("\n")) if line.lstrip().startswith("#")]
    docstrings = [(n.body[0].lineno, n.body[0].value.value) for n in ast.walk(TREE)
                  if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)]
    assert [(line, text[:80]) for line, text in comments + docstrings if cited.search(text)] == []
