"""The store under pressure from outside: another process holding the database lock, and a
full disk. Requests wait or get 503, never a 2xx without a commit; the loop stays responsive."""

from __future__ import annotations

import contextlib
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import Server, wait_for


def dispatch(api: httpx.Client, repo: Path, key: str) -> httpx.Response | None:
    try:
        return api.post("/v1/outpost/dispatches", headers={"Idempotency-Key": key}, timeout=20,
                        json={"brief": "@print hi", "repository": str(repo)})
    except httpx.TransportError:
        return None


def stored_runs(data_dir: Path) -> set[str]:
    with contextlib.closing(sqlite3.connect(data_dir / "outpost.sqlite3")) as db:
        return {row[0] for row in db.execute('SELECT id FROM "Run"')}


def test_an_outside_exclusive_lock_gives_waits_or_503_never_a_2xx_without_commit(tmp_path, git_repo):
    data_dir = tmp_path / "data"
    server = Server(data_dir).start()
    api = server.client()
    assert dispatch(api, git_repo, "before").status_code == 202
    locker = subprocess.Popen(["python3", "-c", (
        "import sqlite3, sys, time\n"
        f"db = sqlite3.connect({str(data_dir / 'outpost.sqlite3')!r}, isolation_level=None)\n"
        "db.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(10); db.execute('COMMIT')\n")],
        stdout=subprocess.PIPE, text=True)
    assert locker.stdout.readline().strip() == "locked"
    replies: list[httpx.Response | None] = []
    workers = [threading.Thread(target=lambda i=i: replies.append(dispatch(server.client(), git_repo, f"k{i}")))
               for i in range(4)]
    for w in workers:
        w.start()
    health = []
    while locker.poll() is None:   # the event loop answers while the store is locked
        started = time.monotonic()
        assert httpx.get(server.url + "/healthz", timeout=2).status_code == 200
        health.append(time.monotonic() - started)
        time.sleep(0.25)
    for w in workers:
        w.join(30)
    statuses = sorted(r.status_code for r in replies if r is not None)
    assert statuses and set(statuses) <= {202, 503}, statuses
    assert 503 in statuses, "a 10 s lock outlasts the 5 s busy timeout: someone must have been told to retry"
    assert max(health) < 1.0, f"/healthz stalled {max(health):.2f} s"
    acked = {r.json()["run_id"] for r in replies if r is not None and r.status_code == 202}
    assert acked <= stored_runs(data_dir)
    retry = dispatch(api, git_repo, "after")   # afterwards everything works again
    assert retry.status_code == 202
    assert server.stop() == 0


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_gives_503_corrupts_nothing_and_recovers(small_disk, git_repo):
    data_dir = small_disk / "data"
    server = Server(data_dir).start()
    api = server.client()
    first = dispatch(api, git_repo, "fits")
    assert first.status_code == 202
    wait_for(lambda: api.get(f"/v1/outpost/runs/{first.json()['run_id']}").json()["status"] == "succeeded")
    filler = small_disk / "filler"
    # unbuffered: a write the full disk cut short leaves nothing for close() to flush (and fail on)
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    replies = [dispatch(api, git_repo, f"full{i}") for i in range(20)]
    statuses = [r.status_code for r in replies if r is not None]
    assert set(statuses) <= {202, 503}, (statuses, server.logs()[-6000:].replace("\\n", "\n"))
    assert 503 in statuses, f"a full disk must refuse intake with 503, got {statuses}"
    health = httpx.get(server.url + "/healthz", timeout=2)   # alive, and saying what is wrong
    assert (health.status_code, health.json()["status"]) == (503, "disk_full"), health.text
    acked = {r.json()["run_id"] for r in replies if r is not None and r.status_code == 202}

    filler.unlink()   # space is back: work resumes
    again = dispatch(api, git_repo, "room-again")
    assert again.status_code == 202
    assert httpx.get(server.url + "/healthz", timeout=2).status_code == 200
    wait_for(lambda: api.get(f"/v1/outpost/runs/{again.json()['run_id']}").json()["status"] == "succeeded")
    assert server.stop() == 0
    assert acked | {again.json()["run_id"]} <= stored_runs(data_dir)
    with contextlib.closing(sqlite3.connect(data_dir / "outpost.sqlite3")) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
