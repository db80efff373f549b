"""Resource caps (docs/security.md "Resource caps"): a run's processes are held together to its
profile's ``max_processes`` and ``memory_mb``, in a cgroup of their own where the machine lets the
daemon make one, else by prlimit. A real ``outpost serve`` runs agents that fork without end and
that take memory without end: the host keeps its processes and memory, the run fails naming the
cap it met, and the daemon keeps serving."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
import trio
from conftest import OUTPOST_PY, SETTLED, Server, make_repo, wait_for

import outpost

CGROUPS = outpost.find_cgroups("tests")
needs_cgroups = pytest.mark.skipif(not CGROUPS.version, reason=f"no cgroup here to test with: {CGROUPS.message}")

#: An agent that forks until the kernel refuses, each child sleeping: how many it got, and why it stopped.
FORK_BOMB = r'''
import os, sys, time
started = 0
try:
    while started < 400:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        started += 1
except OSError as exc:
    print(f"started {started}: {exc.strerror}", flush=True)
    sys.exit(3)
print(f"started {started}: never refused", flush=True)
'''

#: An agent that writes 300 MiB into its memory, page by page (zeros alone would not be charged).
MEMORY_HOG = r'''
chunks = [bytes([1]) * (1 << 20) for _ in range(300)]
print("held", len(chunks), "MiB", flush=True)
'''


@pytest.fixture
def base():
    path = Path(tempfile.mkdtemp(prefix="outpost-caps-", dir="/var/tmp"))
    os.chmod(path, 0o755)
    yield path
    with contextlib.suppress(OSError):
        outpost.remove_tree(path)


def one_run(base: Path, script: str, settings: str, runner: tuple[str, ...] = ()) -> tuple[dict, str]:
    """One dispatch to a Python ``script`` agent with its profile's ``settings``, on a real server
    (served through ``runner``): the settled run and its log."""
    data = base / "data"
    data.mkdir()
    repo = make_repo(base / "repo")
    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
    (data / "outpost.toml").write_text(
        f'[agents.script]\ncommand = [{json.dumps(python)}, "-c", {json.dumps(script)}]\n{settings}')
    if runner:
        subprocess.run(["chown", "-R", "65534:65534", str(base)], check=True)
    server = Server(data, env={"HOME": str(base)}, runner=runner).start()
    try:
        with server.client() as client:
            run_id = client.post("/v1/outpost/dispatches", headers={"Idempotency-Key": uuid.uuid4().hex}, json={
                "brief": "go", "repository": str(repo), "agent": "script"}).json()["run_id"]
            run = wait_for(lambda: (r := client.get(f"/v1/outpost/runs/{run_id}").json())["status"] in SETTLED and r,
                           timeout_s=60)
            log = client.get(f"/v1/outpost/runs/{run_id}/log").text
            assert client.get("/healthz").status_code == 200   # the daemon serves on
            assert not [d for p in CGROUPS.parents for d in os.listdir(p)   # its cgroup went with it
                        if d.startswith(f"outpost-{outpost.cgroup_owner(data)}-")]
            return run, log
    finally:
        server.stop()


def started(log: str) -> int:
    return int(log.split("started ", 1)[1].split(":", 1)[0])


@needs_cgroups
def test_an_agent_that_forks_without_end_meets_its_profile_s_max_processes(base):
    run, log = one_run(base, FORK_BOMB, "max_processes = 40\n")
    assert started(log) < 40, log          # the outer bubblewrap, its process 1 and the agent count too
    assert run["status"] == "failed"
    assert run["error"].startswith("the run met its process cap (max_processes = 40"), run["error"]


@needs_cgroups
def test_an_agent_that_takes_memory_without_end_is_ended_at_its_profile_s_memory_mb(base):
    run, log = one_run(base, MEMORY_HOG, "memory_mb = 64\n")
    assert "held 300" not in log
    assert run["status"] == "failed"
    assert run["error"].startswith("the run went over its memory cap (memory_mb = 64,"), run["error"]


#: An agent that makes a user namespace of its own (and cgroup and mount ones), where it would hold
#: every capability, mounts its own pids cgroup there and lifts its cap; then forks as FORK_BOMB.
LIFTS_ITS_CAP = r'''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x10000000 | 0x00020000 | 0x02000000) != 0:   # CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWCGROUP
    print("no user namespace:", os.strerror(ctypes.get_errno()), flush=True)
else:
    libc.mount(None, b"/", None, (1 << 18) | (1 << 14), None)   # MS_PRIVATE | MS_REC
    os.makedirs("/tmp/pids", exist_ok=True)
    if libc.mount(b"none", b"/tmp/pids", b"cgroup", 0, b"pids") != 0:
        libc.mount(b"none", b"/tmp/pids", b"cgroup2", 0, None)
    with open("/tmp/pids/pids.max", "w") as cap:
        cap.write("max")
    print("lifted its cap", flush=True)
''' + FORK_BOMB


@needs_cgroups
@pytest.mark.skipif(not outpost.agent_isolation("auto").no_userns,
                    reason="no bubblewrap here that blocks user namespaces (0.8 or newer)")
def test_an_agent_cannot_lift_its_own_cap_from_a_user_namespace_of_its_own(base):
    """Adversary review: in a user namespace of its own an agent held every capability, mounted
    its cgroup and wrote pids.max = max (and the memory limits); its sandbox now makes no user
    namespace."""
    run, log = one_run(base, LIFTS_ITS_CAP, "max_processes = 40\n")
    assert "no user namespace: No space left on device" in log and "lifted" not in log, log
    assert run["error"].startswith("the run met its process cap (max_processes = 40"), run["error"]


#: An agent whose child takes memory without end, and which then ends well itself.
CHILD_HOG = f"""
import subprocess, sys
child = subprocess.run([sys.executable, "-c", {MEMORY_HOG!r}])
print("child ended", child.returncode, "and the agent goes on", flush=True)
"""


@needs_cgroups
def test_a_run_whose_child_the_kernel_ended_at_its_memory_cap_fails_though_the_agent_ended_well(base):
    """cgroup v1 kills the one process that asked for more; the agent may go on and end well: its
    work is not whole, so the run fails, naming the cap."""
    run, log = one_run(base, CHILD_HOG, "memory_mb = 64\n")
    assert "held 300" not in log
    assert run["status"] == "failed", (run, log)
    assert run["error"].startswith("the run went over its memory cap (memory_mb = 64,"), run["error"]


def test_a_run_that_met_a_cap_says_the_cap_then_only_its_last_line():
    """A fork bomb's stderr repeats one complaint a thousand times: the error is the cap and the last line."""
    said = "bomb.sh: fork: retry: Resource temporarily unavailable\n" * 60 + "bomb.sh: gave up\n\n"
    outcome = outpost.Outcome(outpost.RunStatus.FAILED, said, failure_kind=None)
    met = outpost.CapMet("processes", "the run met its process cap (max_processes = 40, threads count)")
    assert outpost.capped(outcome, met).error == met.reason + "; its last line: bomb.sh: gave up"
    handled = outpost.Outcome(outpost.RunStatus.SUCCEEDED, None)
    assert outpost.capped(handled, met) == handled   # a refused fork it handled: still a success
    memory = outpost.CapMet("memory", "the run went over its memory cap (memory_mb = 64)")
    assert (outpost.capped(handled, memory).status, outpost.capped(handled, memory).error) == (
        outpost.RunStatus.FAILED, memory.reason)
    cancelled = outpost.Outcome(outpost.RunStatus.CANCELLED, "cancelled")
    assert outpost.capped(cancelled, memory) == cancelled


@pytest.mark.parametrize("euid, says", [
    (0, "runs are held to memory_mb by prlimit (per process), and not to max_processes"),
    (1000, "runs are held to max_processes and memory_mb by prlimit (per process; the process count is the")])
def test_where_no_cgroup_can_be_made_prlimit_is_named_for_what_it_holds(tmp_path, monkeypatch, euid, says):
    """prlimit never holds root to a process count: a root daemon must not claim it does."""
    if not Path("/usr/bin/prlimit").exists():
        pytest.skip("no prlimit here")
    monkeypatch.setattr(outpost.os, "geteuid", lambda: euid)
    found = outpost.find_cgroups("tests", tmp_path, "0::/\n")
    assert found.prlimit and found.message.startswith(says), found.message


@needs_cgroups
def test_a_run_within_its_caps_is_not_held_back(base):
    run, log = one_run(base, "import os\nprint('pid', os.getpid())\n", "max_processes = 40\nmemory_mb = 64\n")
    assert (run["status"], run["error"]) == ("succeeded", None)


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/usr/bin/prlimit").exists(),
                    reason="needs root, to serve as an unprivileged user, and prlimit")
def test_a_daemon_that_cannot_make_cgroups_holds_a_fork_bomb_by_prlimit(base):
    """nobody may not write the machine's cgroups: the service user's process count holds the run."""
    runner = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--")
    if subprocess.run([*runner, sys.executable, "-c", f"open({str(OUTPOST_PY)!r}).close()"],
                      capture_output=True).returncode:
        pytest.skip(f"an unprivileged user cannot run {OUTPOST_PY} (a private folder holds the checkout)")
    run, log = one_run(base, FORK_BOMB, "max_processes = 40\n", runner)
    assert started(log) < 40, log
    assert run["status"] == "failed"


# --- where the caps come from: the machine's cgroups, read as the kernel shows them ---------------

def fake_v2(root: Path, own: str, controllers: str = "cpu io memory pids") -> Path:
    folder = root / own.lstrip("/")
    folder.mkdir(parents=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (folder / "cgroup.controllers").write_text(controllers + "\n")
    (folder / "cgroup.subtree_control").write_text("\n")
    (folder / "cgroup.procs").write_text(f"{os.getpid()}\n")
    return folder


def test_a_delegated_v2_cgroup_holds_runs_after_the_daemon_moves_into_a_leaf(tmp_path):
    own = fake_v2(tmp_path, "/system.slice/outpost.service")
    found = outpost.find_cgroups("tests", tmp_path, "0::/system.slice/outpost.service\n")
    assert (found.version, found.parents) == (2, (own,))
    assert (own / "outpost-daemon" / "cgroup.procs").read_text() == str(os.getpid())
    assert (own / "cgroup.subtree_control").read_text() == "+pids +memory"
    # started again inside its leaf: its runs still go beside the leaf
    again = outpost.find_cgroups("tests", tmp_path, "0::/system.slice/outpost.service/outpost-daemon\n")
    assert again.parents == (own,)


def test_a_v2_cgroup_without_the_controllers_falls_back_to_prlimit_saying_why(tmp_path):
    fake_v2(tmp_path, "/user.slice/session-1.scope", controllers="cpu io")
    found = outpost.find_cgroups("tests", tmp_path, "0::/user.slice/session-1.scope\n")
    assert found.version == 0 and found.prlimit
    assert "has no pids and memory controllers (Delegate=pids memory" in found.message


def test_v1_hierarchies_hold_runs_in_the_daemon_s_own_pids_and_memory_cgroups(tmp_path):
    for folder in ("pids", "memory/process_api/abc", "cpu,cpuacct"):
        (tmp_path / folder).mkdir(parents=True)
    membership = "9:name=systemd:/\n8:pids:/\n4:memory:/process_api/abc\n1:cpu,cpuacct:/\n0::/\n"
    found = outpost.find_cgroups("tests", tmp_path, membership)
    assert (found.version, found.parents) == (1, (tmp_path / "pids", tmp_path / "memory/process_api/abc"))


@needs_cgroups
async def test_the_sweep_ends_and_removes_only_its_own_data_dir_s_leftover_cgroups():
    """Another daemon's cgroups (another data dir, or another PID namespace's whose pids mean
    nothing here) are never touched; an earlier daemon of this data dir's are, with what is in them."""
    mine, other = (dataclasses.replace(CGROUPS, owner=outpost.cgroup_owner(Path(d))) for d in ("/a", "/b"))
    leftover = dataclasses.replace(mine, owner=mine.owner).held(outpost.ResourceCaps())
    names = [(f.parent, f.name.replace(f"-{os.getpid()}-", "-999999-")) for f in leftover.folders]
    for folder, (parent, name) in zip(leftover.folders, names, strict=True):
        folder.rename(parent / name)   # as an earlier daemon (pid 999999) of the same data dir named it
    stray = subprocess.Popen(outpost.Held(outpost.ResourceCaps(), folders=tuple(p / n for p, n in names)).wrap(
        ["sleep", "60"]))
    theirs, own_now = other.held(outpost.ResourceCaps()), mine.held(outpost.ResourceCaps())
    try:
        wait_for(lambda: all((p / n / "cgroup.procs").read_text().strip() for p, n in names), timeout_s=10)
        await mine.sweep()
        assert stray.wait(timeout=10) == -9                         # what was left in it is ended
        assert not [n for p, n in names if (p / n).exists()]        # and its cgroups are gone
        assert all(f.exists() for f in (*theirs.folders, *own_now.folders))   # the others' and its own stay
    finally:
        stray.kill()
        await theirs.release()
        await own_now.release()


def test_the_cap_a_tree_met_is_read_from_its_cgroup_s_events(tmp_path):
    caps = outpost.ResourceCaps(processes=40, memory_mb=64)
    (tmp_path / "pids.events").write_text("max 0\n")
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 0\n")
    held = outpost.Held(caps, folders=(tmp_path,))
    assert held.met() is None   # the memory cap pressed (max 12) but killed nothing: not met
    (tmp_path / "pids.events").write_text("max 3\n")
    assert held.met().cap == "processes"
    assert held.met().reason.startswith("the run met its process cap (max_processes = 40")
    (tmp_path / "memory.events").write_text("oom_kill 1\n")
    assert held.met().cap == "memory"
    assert held.met().reason.startswith("the run went over its memory cap (memory_mb = 64")


def test_a_held_command_is_in_its_cgroup_before_it_starts_anything(tmp_path):
    """The shell enters each cgroup (0: itself), then becomes the command (same pid): nothing it
    starts is outside."""
    folders = (tmp_path / "pids", tmp_path / "memory")
    for folder in folders:
        folder.mkdir()
    held = outpost.Held(outpost.ResourceCaps(), folders=folders, entry="tasks")
    shell = subprocess.Popen(held.wrap(["sh", "-c", "echo $$"]), stdout=subprocess.PIPE, text=True)
    assert shell.communicate(timeout=10)[0].strip() == str(shell.pid)
    assert [(f / "tasks").read_text().strip() for f in folders] == ["0", "0"]
    (folders[1] / "tasks").unlink()
    folders[1].rmdir()   # a cgroup it cannot enter: the command never runs
    refused = subprocess.run(held.wrap(["sh", "-c", "echo ran"]), capture_output=True, text=True)
    assert (refused.returncode, refused.stdout) == (125, "")


@needs_cgroups
async def test_a_held_command_and_what_it_starts_are_in_the_run_s_own_cgroups():
    held = CGROUPS.held(outpost.ResourceCaps())
    try:
        done = subprocess.run(held.wrap(["sh", "-c", "cat /proc/self/cgroup; sh -c 'cat /proc/self/cgroup'"]),
                              capture_output=True, text=True, check=True, timeout=10)
        joined = ("pids", "memory") if CGROUPS.version == 1 else ("",)   # v2: the one unified line
        names = [line.rsplit("/", 1)[-1] for line in done.stdout.splitlines() if line.split(":")[1] in joined]
        assert names == [held.folders[0].name] * 2 * len(joined)   # the shell's command, and its child
    finally:
        await held.release()


def writable_cgroup2() -> Path | None:
    """A cgroup v2 mount this test may make a cgroup in (a hybrid machine's /sys/fs/cgroup/unified, as root)."""
    for line in Path("/proc/mounts").read_text().splitlines():
        _, where, kind, *_ = line.split()
        if kind == "cgroup2" and os.access(where, os.W_OK):
            return Path(where)
    return None


@pytest.mark.skipif(writable_cgroup2() is None, reason="no cgroup v2 mount here this user may write")
async def test_on_cgroup_v2_a_held_command_joins_through_cgroup_procs():
    """0 written into v2's cgroup.procs moves the writing process, as a pid did."""
    folder = writable_cgroup2() / f"outpost-tests-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    held = outpost.Held(outpost.ResourceCaps(), folders=(folder,))
    try:
        done = subprocess.run(held.wrap(["sh", "-c", "cat /proc/self/cgroup"]), capture_output=True, text=True,
                              check=True, timeout=10)
        unified = next(line for line in done.stdout.splitlines() if line.startswith("0::"))
        assert unified.endswith("/" + folder.name)
    finally:
        await held.release()


@pytest.mark.parametrize("hold", ["cgroup", "prlimit"])
@pytest.mark.parametrize("program, reason", [("/nonexistent/agent", "No such file or directory"),
                                             ("no-such-agent-cli", "No such file or directory"),
                                             ("./agent.txt", "Permission denied")])
async def test_a_held_agent_that_cannot_start_is_a_launch_failure_as_unheld(tmp_path, hold, program, reason):
    """The wrapper (the cgroup's shell, prlimit) would start and only then fail to exec, so its own
    words would stand as the run's error: the run says, as without caps, that its command could not start."""
    if hold == "prlimit" and not Path("/usr/bin/prlimit").exists():
        pytest.skip("no prlimit here")
    (tmp_path / "agent.txt").write_text("not a program\n")
    (tmp_path / "cgroup.procs").write_text("")
    held = (outpost.Held(outpost.ResourceCaps(), folders=(tmp_path,)) if hold == "cgroup"
            else outpost.Held(outpost.ResourceCaps(), limits=("--nproc=4096",)))

    async def no_op(pid: int) -> None:
        pass

    with pytest.raises(outpost.LaunchError) as failed:
        await outpost.run_agent_process(
            [program], cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, stdin_text=None, timeout_s=5,
            log_path=tmp_path / "run.log", now=lambda: datetime.now(UTC), held=held,
            live=outpost.LiveRun("out_x", trio.CancelScope()), on_spawn=no_op)
    assert str(failed.value) == f"could not start agent command {program!r}: {reason}"


def test_prlimit_never_asks_past_the_daemon_s_own_hard_limits(monkeypatch):
    """Found by attack: a daemon under a hard process limit asked prlimit for more than it may
    give (the user's tasks + max_processes), so every run failed before its agent ran."""
    import resource
    hard = {resource.RLIMIT_NPROC: 110, resource.RLIMIT_DATA: 512 << 20}
    monkeypatch.setattr(outpost.resource, "getrlimit", lambda limit: (hard[limit], hard[limit]))
    monkeypatch.setattr(outpost.os, "geteuid", lambda: 65534)
    options = outpost.prlimit_options(outpost.ResourceCaps(processes=1024, memory_mb=4096))
    assert options == (f"--data={512 << 20}", "--nproc=110")


def test_a_cgroup_too_small_for_every_run_at_its_cap_beside_the_daemon_is_said_at_start(tmp_path):
    """Found by attack: under a TasksMax of 150, three fork bombs left the daemon no process for its
    own git. Each run's cap holds, but not their sum: the start says what to change."""
    own = fake_v2(tmp_path, "/system.slice/outpost.service")
    found = outpost.find_cgroups("tests", tmp_path, "0::/system.slice/outpost.service\n")
    config = outpost.Config(data_dir=tmp_path, max_running=4, agents=(
        outpost.AgentProfile("wide", ("sh",), max_processes=2048), outpost.AgentProfile("narrow", ("sh",))))
    (own / "pids.max").write_text("4915\n")   # systemd's DefaultTasksMax on a 2-core machine
    assert found.room_short(config) == (
        "the daemon's cgroup allows 4915 processes, fewer than max_running x max_processes (4 x 2048) plus the "
        "daemon's own 64: runs at their caps would leave the daemon none; raise TasksMax in outpost.service or "
        "lower max_processes")
    (own / "pids.max").write_text("max\n")
    assert found.room_short(config) is None
    (own / "pids.max").write_text("9000\n")
    assert found.room_short(config) is None
