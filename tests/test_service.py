"""Outpost under systemd: sd_notify readiness, watchdog and stopping over a real notify
socket, secrets kept out of agents' environments, journald log lines, and the unit file."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import OUTPOST_PY, wait_for

import outpost

UNIT = Path(__file__).resolve().parent.parent / "outpost.service"


@pytest.fixture
def notify_socket(tmp_path: Path):
    """A datagram socket standing in for systemd's NOTIFY_SOCKET; yields (path, messages())."""
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(0.05)
    received: list[str] = []

    def messages() -> list[str]:
        while True:
            try:
                received.append(sock.recv(4096).decode())
            except TimeoutError:
                return received

    yield path, messages
    sock.close()


def test_ready_watchdog_and_stopping_reach_the_notify_socket(server_factory, notify_socket, git_repo, tmp_path):
    path, messages = notify_socket
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "outpost.toml").write_text(
        '[agents.envdump]\ncommand = ["sh", "-c", "env"]\n'
        'pass_env = ["PATH", "HOME", "NOTIFY_SOCKET", "WATCHDOG_USEC", "OUTPOST_API_TOKEN"]\n')
    server = server_factory(data_dir=data_dir, env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "400000",
                                                    "OUTPOST_API_TOKEN": "secret-token-for-test"})
    ready = wait_for(lambda: [m for m in messages() if m.startswith("READY=1")], timeout_s=10)
    assert ready
    time.sleep(1.0)
    pings = [m for m in messages() if m == "WATCHDOG=1"]
    assert len(pings) >= 3, f"expected a ping every 0.2 s, got {messages()}"

    with server.client() as api:
        run_id = api.post("/v1/outpost/dispatches", headers={"Idempotency-Key": "env-1"},
                          json={"brief": "dump", "repository": str(git_repo), "agent": "envdump"}).json()["run_id"]
        wait_for(lambda: api.get(f"/v1/outpost/runs/{run_id}").json()["status"] == "succeeded")
        env = api.get(f"/v1/outpost/runs/{run_id}/log").text
    assert f"OUTPOST_RUN_ID={run_id}" in env
    for secret in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "OUTPOST_API_TOKEN", "secret-token-for-test"):
        assert secret not in env, f"{secret} leaked into the agent's environment"

    assert server.stop(signal.SIGTERM) == 0
    assert "STOPPING=1" in messages()
    assert messages().index("STOPPING=1") > messages().index(ready[0])


def test_no_watchdog_pings_when_the_watchdog_is_for_another_process(server_factory, notify_socket):
    path, messages = notify_socket
    server_factory(env={"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"})
    wait_for(lambda: "READY=1\nSTATUS=listening" in messages(), timeout_s=10)
    time.sleep(0.6)
    assert "WATCHDOG=1" not in messages()


def test_under_journald_log_lines_carry_a_priority_and_no_timestamp(server_factory, git_repo):
    server = server_factory(env={"JOURNAL_STREAM": "8:12345"})
    with server.client() as api:
        api.post("/v1/outpost/dispatches", headers={"Idempotency-Key": "j-1"},
                 json={"brief": "@print hi", "repository": str(git_repo)}).raise_for_status()
        wait_for(lambda: "settled" in server.logs())
    assert server.stop() == 0
    lines = [line for line in server.logs().splitlines() if line.strip()]
    assert lines and all(line.startswith(("<6>INFO", "<4>WARNING", "<7>DEBUG")) for line in lines), lines
    settled = next(line for line in lines if "settled" in line)
    assert settled.startswith("<6>INFO outpost.run: run out_")


def test_the_unit_stops_the_daemon_first_so_it_records_its_agents_interrupted():
    """Defect 3: under KillMode=control-group systemd's SIGTERM reached the agents with the
    daemon, and their runs settled as ordinary failures ("exit code -15") that fed the streak.
    KillMode=mixed sends SIGTERM to the daemon alone; it ends its agents and records them."""
    unit = UNIT.read_text()
    assert "KillMode=mixed" in unit and "KillMode=control-group" not in unit


def test_the_unit_keeps_the_agents_home_out_of_the_data_dir_and_allows_bubblewrap():
    """Defect 20: under the shipped unit the service user's HOME (the agents' HOME) was the data
    dir itself; and RestrictNamespaces=yes would stop bubblewrap, as would ProtectKernelTunables
    (the sandbox's fresh /proc)."""
    unit = UNIT.read_text()
    assert "--home-dir /home/outpost" in unit and "--home-dir /var/lib/outpost" not in unit
    allowed = set(unit.split("\nRestrictNamespaces=")[1].split("\n")[0].split())
    sandbox = outpost.Sandbox(Path("/nonexistent/data"), Path("/nonexistent/w"), Path("/nonexistent/r"),
                              Path("/nonexistent/p"), None)
    unshared = {arg.removeprefix("--unshare-") for arg in sandbox.argv(["true"]) if arg.startswith("--unshare-")}
    assert unshared and {"user", "mnt"} | unshared <= allowed, f"bubblewrap unshares {unshared}"
    assert "/home/outpost" in unit.split("ReadWritePaths=")[1].split("\n")[0]
    assert "\nProtectKernelTunables=" not in unit


def test_the_unit_file_declares_notify_watchdog_and_hardening():
    unit = UNIT.read_text()
    for directive in ("Type=notify", "NotifyAccess=main", "WatchdogSec=", "User=outpost", "StateDirectory=outpost",
                      "Restart=on-failure", "KillMode=mixed", "TimeoutStopSec=30", "NoNewPrivileges=yes",
                      "ProtectSystem=strict", "ReadWritePaths=", "PrivateTmp=yes", "PrivateDevices=yes",
                      "CapabilityBoundingSet=\n", "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", "UMask=0077"):
        assert directive in unit, directive
    assert "\nDelegate=pids memory\n" in unit   # docs/security.md "Resource caps": a cgroup per run
    for explained in ("MemoryDenyWriteExecute", "ProtectHome", "ProtectKernelTunables", "ProtectControlGroups"):
        assert f"# - {explained}" in unit, f"the unit must say why {explained} is left off"
    stop_s = int(unit.split("TimeoutStopSec=")[1].split()[0])
    assert stop_s > 5 + 5, "TimeoutStopSec must outlast the agents' grace plus settlement"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_analyze_verify_passes(tmp_path):
    outpost_bin = Path(sys.executable).parent / "outpost"
    exec_start = str(outpost_bin) if outpost_bin.exists() else f"{sys.executable} {OUTPOST_PY}"
    unit = tmp_path / "outpost.service"
    unit.write_text(UNIT.read_text().replace("/opt/outpost/.venv/bin/outpost", exec_start))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "outpost.service" not in done.stderr, done.stderr



def test_a_service_manager_that_forbids_a_namespace_of_the_sandbox_is_found_at_start(tmp_path, monkeypatch):
    """A unit whose RestrictNamespaces= lacks one the sandbox unshares (uts was missing) makes every
    sandboxed run fail to start: the start's probe asks for the same namespaces, and says so."""
    fake = tmp_path / "bin" / "bwrap"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nfor a; do [ "$a" = --unshare-uts ] && { echo "bwrap: Creating new namespace '
                    'failed: Operation not permitted" >&2; exit 1; }; done; exit 0\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    isolation = outpost.agent_isolation("auto")
    assert not isolation.active and "Creating new namespace failed" in isolation.message, isolation
    with pytest.raises(outpost.ConfigError, match="bubblewrap does not work here"):
        outpost.agent_isolation("always")


def test_an_install_without_the_dashboard_s_files_refuses_to_serve_saying_how_to_install(tmp_path):
    """Found by review: ``pip install /opt/outpost`` (not ``-e``, as the unit's comment said) copied
    outpost.py alone, and every dashboard page answered 500."""
    alone = tmp_path / "site-packages"
    alone.mkdir()
    shutil.copy(OUTPOST_PY, alone / "outpost.py")
    done = subprocess.run([sys.executable, str(alone / "outpost.py"), "serve", "--data-dir", str(tmp_path / "data"),
                           "--port", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "templates/ and static/ are not beside" in done.stderr and "pip install -e" in done.stderr
    assert "Traceback" not in done.stderr
    assert "pip install -e /opt/outpost" in (OUTPOST_PY.parent / "outpost.service").read_text()
