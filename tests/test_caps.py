"""Resource caps (docs/security.md "Resource caps"): a run's processes are held together to its
profile's ``max_processes`` and ``memory_mb``, in a cgroup of their own where the machine lets the
daemon make one, else by prlimit. A real ``outpost serve`` runs agents that fork without end and
that take memory without end: the host keeps its processes and memory, the run fails naming the
cap it met, and the daemon keeps serving."""
from __future__ import annotations

import contextlib
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

CGROUPS = outpost.find_cgroups()
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
                        if d.startswith(f"outpost-{server.proc.pid}-")]
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
    assert run["error"].startswith("the run went over its memory cap (memory_mb = 64)"), run["error"]


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
    found = outpost.find_cgroups(tmp_path, "0::/system.slice/outpost.service\n")
    assert (found.version, found.parents) == (2, (own,))
    assert (own / "outpost-daemon" / "cgroup.procs").read_text() == str(os.getpid())
    assert (own / "cgroup.subtree_control").read_text() == "+pids +memory"
    # started again inside its leaf: its runs still go beside the leaf
    again = outpost.find_cgroups(tmp_path, "0::/system.slice/outpost.service/outpost-daemon\n")
    assert again.parents == (own,)


def test_a_v2_cgroup_without_the_controllers_falls_back_to_prlimit_saying_why(tmp_path):
    fake_v2(tmp_path, "/user.slice/session-1.scope", controllers="cpu io")
    found = outpost.find_cgroups(tmp_path, "0::/user.slice/session-1.scope\n")
    assert found.version == 0 and found.prlimit
    assert "has no pids and memory controllers (Delegate=yes" in found.message


def test_v1_hierarchies_hold_runs_in_the_daemon_s_own_pids_and_memory_cgroups(tmp_path):
    for folder in ("pids", "memory/process_api/abc", "cpu,cpuacct"):
        (tmp_path / folder).mkdir(parents=True)
    membership = "9:name=systemd:/\n8:pids:/\n4:memory:/process_api/abc\n1:cpu,cpuacct:/\n0::/\n"
    found = outpost.find_cgroups(tmp_path, membership)
    assert (found.version, found.parents) == (1, (tmp_path / "pids", tmp_path / "memory/process_api/abc"))


def test_cgroups_of_daemons_that_are_gone_are_swept_and_live_ones_kept(tmp_path):
    own = fake_v2(tmp_path, "/outpost.service")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    for name in (f"outpost-{gone.stdout.strip()}-aa", f"outpost-{os.getpid()}-bb", "user-folder"):
        (own / name).mkdir()
    outpost.find_cgroups(tmp_path, "0::/outpost.service\n")
    assert sorted(p.name for p in own.iterdir() if p.is_dir()) == sorted(
        [f"outpost-{os.getpid()}-bb", "outpost-daemon", "user-folder"])


def test_the_cap_a_tree_met_is_read_from_its_cgroup_s_events(tmp_path):
    caps = outpost.ResourceCaps(processes=40, memory_mb=64)
    (tmp_path / "pids.events").write_text("max 0\n")
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 0\n")
    held = outpost.Held(caps, folders=(tmp_path,))
    assert held.met() is None   # the memory cap pressed (max 12) but killed nothing: not met
    (tmp_path / "pids.events").write_text("max 3\n")
    assert held.met().startswith("the run met its process cap (max_processes = 40")
    (tmp_path / "memory.events").write_text("oom_kill 1\n")
    assert held.met().startswith("the run went over its memory cap (memory_mb = 64)")


def test_a_held_command_is_in_its_cgroup_before_it_starts_anything(tmp_path):
    """The shell enters each cgroup, then becomes the command (same pid): nothing it starts is outside."""
    folders = (tmp_path / "pids", tmp_path / "memory")
    for folder in folders:
        folder.mkdir()
    held = outpost.Held(outpost.ResourceCaps(), folders=folders)
    done = subprocess.run(held.wrap(["sh", "-c", "echo $$"]), capture_output=True, text=True, check=True)
    assert [(f / "cgroup.procs").read_text().strip() for f in folders] == [done.stdout.strip()] * 2
    (folders[1] / "cgroup.procs").unlink()
    folders[1].rmdir()   # a cgroup it cannot enter: the command never runs
    refused = subprocess.run(held.wrap(["sh", "-c", "echo ran"]), capture_output=True, text=True)
    assert (refused.returncode, refused.stdout) == (125, "")


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
