"""``outpost backup FILE`` and ``outpost restore FILE --data-dir DIR`` (docs/operations.md): a consistent copy
of a running appliance in one 0600 file, restored only into an empty data dir, a hostile archive
never written outside it; on PostgreSQL, pg_dump's job."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import httpx
import pytest
from conftest import OUTPOST_PY, YEARLY, definition, wait_for

import outpost


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "OUTPOST_API_TOKEN"} | (env or {})
    return subprocess.run([sys.executable, str(OUTPOST_PY), *args], capture_output=True, text=True, timeout=60,
                          env=environment)


@pytest.fixture
def run(capsys):
    """``outpost ARGS`` in this process (fast): its exit status and output, as a subprocess's."""
    def run_main(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        status = outpost.main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, status, out, err)
    return run_main


def one_line_refusal(done: subprocess.CompletedProcess, status: int, *words: str) -> None:
    assert done.returncode == status, (done.stdout, done.stderr)
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in done.stderr, done.stderr


def create_schedule(client: httpx.Client, raw: dict) -> dict:
    composed = client.post("/v1/outpost/schedules/compose", json=raw)
    assert composed.status_code == 200, composed.text
    created = client.post("/v1/outpost/schedules", headers={"Idempotency-Key": f"create-{raw['name']}"},
                          json={"definition": composed.json()["definition"],
                                "confirmation": composed.json()["confirmation"]})
    assert created.status_code == 201, created.text
    return created.json()


@pytest.fixture
def appliance(tmp_path: Path) -> Path:
    """A data dir with a migrated database, an outpost.toml and an api-token (no daemon)."""
    data = tmp_path / "data"
    data.mkdir()
    outpost.Store(data / "outpost.sqlite3").close()
    outpost.api_token(data, create=True)
    (data / "outpost.toml").write_text("[settings]\nmax_running = 3\n")
    return data


@pytest.mark.slow
def test_a_backup_of_a_serving_appliance_restores_to_the_same_schedules_runs_and_token(server_factory, git_repo,
                                                                                         tmp_path):
    server = server_factory()
    with server.client() as client:
        schedules = [create_schedule(client, definition(git_repo, name=f"nightly-{i}", timing=YEARLY))
                     for i in range(3)]
        before = {r["id"] for r in client.get("/v1/outpost/runs").json()["runs"]}
        writing, written = threading.Event(), []

        def write_while_backing_up():   # dispatches land in the database while the backup copies it
            with server.client() as writer:
                while not writing.is_set():
                    reply = writer.post("/v1/outpost/dispatches", headers={"Idempotency-Key": f"w-{len(written)}"},
                                        json={"brief": "@print x", "repository": str(git_repo), "agent": "demo"})
                    assert reply.status_code == 202, reply.text
                    written.append(reply.json()["run_id"])
        thread = threading.Thread(target=write_while_backing_up)
        thread.start()
        try:
            wait_for(lambda: len(written) >= 2)
            backup = tmp_path / "outpost-backup.tar.gz"
            done = cli("backup", "--data-dir", str(server.data_dir), str(backup))
        finally:
            writing.set()
            thread.join()
        assert done.returncode == 0, done.stderr
        assert "3 schedules" in done.stdout
        assert stat.S_IMODE(backup.stat().st_mode) == 0o600
        with tarfile.open(backup) as tar:
            assert sorted(tar.getnames()) == ["api-token", "manifest.json", "outpost.sqlite3"]
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".outpost-backup")] == []   # no leftovers
        expected = {s["id"]: s["name"] for s in client.get("/v1/outpost/schedules").json()["schedules"]}
    server.stop()

    restored = tmp_path / "restored"
    done = cli("restore", str(backup), "--data-dir", str(restored))
    assert done.returncode == 0, done.stderr
    assert "3 schedules" in done.stdout
    assert stat.S_IMODE(restored.stat().st_mode) == 0o700
    assert all(stat.S_IMODE((restored / name).stat().st_mode) == 0o600 for name in ("outpost.sqlite3", "api-token"))
    again = server_factory(data_dir=restored)
    assert again.token == server.token
    with httpx.Client(base_url=again.url, headers={"Authorization": f"Bearer {server.token}"}) as client:
        listed = client.get("/v1/outpost/schedules")
        assert listed.status_code == 200
        assert {s["id"]: s["name"] for s in listed.json()["schedules"]} == expected
        assert {s["id"] for s in schedules} == set(expected)
        runs = {r["id"] for r in client.get("/v1/outpost/runs", params={"limit": 500}).json()["runs"]}
        assert before <= runs and set(written[:2]) <= runs   # what was committed before the copy began


def test_restore_refuses_a_data_dir_that_is_not_empty(appliance, tmp_path, run):
    backup = tmp_path / "b.tgz"
    assert run("backup", "--data-dir", str(appliance), str(backup)).returncode == 0
    target = tmp_path / "busy"
    target.mkdir()
    (target / "notes").write_text("mine\n")
    one_line_refusal(run("restore", str(backup), "--data-dir", str(target)), 1, "not empty")
    assert sorted(p.name for p in target.iterdir()) == ["notes"]
    one_line_refusal(run("restore", str(backup), "--data-dir", str(appliance)), 1, "not empty")
    done = run("restore", str(backup), "--data-dir", str(tmp_path / "new"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "new" / "outpost.toml").read_text() == "[settings]\nmax_running = 3\n"
    assert (tmp_path / "new" / "api-token").read_text() == (appliance / "api-token").read_text()


@pytest.mark.parametrize("where", ["file/x.tgz", "missing/x.tgz", "folder"])
def test_a_backup_to_a_path_that_cannot_be_written_is_one_line_exit_1(appliance, tmp_path, where, run):
    (tmp_path / "file").write_text("a file, not a folder\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "keep").write_text("x\n")
    one_line_refusal(run("backup", "--data-dir", str(appliance), str(tmp_path / where)), 1, "cannot write")
    assert sorted(p.name for p in (tmp_path / "folder").iterdir()) == ["keep"]   # nothing left beside it
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_backup_without_a_database_or_on_postgresql_is_refused_with_exit_2(tmp_path, run):
    one_line_refusal(run("backup", "--data-dir", str(tmp_path / "none"), str(tmp_path / "b.tgz")), 2, "no Outpost")
    fleet = tmp_path / "fleet"
    fleet.mkdir()
    (fleet / "outpost.toml").write_text('[settings]\ndatabase = "postgresql://outpost@127.0.0.1:1/outpost"\n')
    one_line_refusal(run("backup", "--data-dir", str(fleet), str(tmp_path / "b.tgz")), 2, "pg_dump")
    assert not (tmp_path / "b.tgz").exists()


def hostile(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


def genuine_members(run, appliance: Path, tmp_path: Path) -> dict[str, bytes]:
    backup = tmp_path / "genuine.tgz"
    assert run("backup", "--data-dir", str(appliance), str(backup)).returncode == 0
    with tarfile.open(backup) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


@pytest.mark.parametrize("evil", [
    member("../escaped"), member("/tmp/outpost-absolute-escape"), member("sub/../../escaped"),
    member("api-token", tarfile.SYMTYPE, "../escaped"), member("outpost.toml", tarfile.LNKTYPE, "/etc/passwd"),
    member("outpost.toml", tarfile.DIRTYPE), member("outpost.toml", tarfile.FIFOTYPE), member("extra.txt")],
    ids=["dotdot", "absolute", "nested-dotdot", "symlink", "hardlink", "directory", "fifo", "unknown-name"])
def test_restore_refuses_a_hostile_archive_and_writes_nothing(appliance, tmp_path, evil, run):
    files = genuine_members(run, appliance, tmp_path)
    archive = hostile(tmp_path / "evil.tgz", [(member(name), data) for name, data in files.items()
                                              if name != evil.name] + [(evil, b"pwned\n")])
    target = tmp_path / "deep" / "target"
    one_line_refusal(run("restore", str(archive), "--data-dir", str(target)), 1, "not an Outpost backup")
    assert not target.exists()
    assert not (tmp_path / "deep" / "escaped").exists() and not (tmp_path / "escaped").exists()
    assert not Path("/tmp/outpost-absolute-escape").exists()


def test_restore_refuses_an_altered_backup_and_removes_what_it_wrote(appliance, tmp_path, run):
    files = genuine_members(run, appliance, tmp_path)
    files["api-token"] = b"attacker-chosen-token\n"   # the manifest still names the real one's digest
    archive = hostile(tmp_path / "altered.tgz", [(member(name), data) for name, data in files.items()])
    target = tmp_path / "target"
    one_line_refusal(run("restore", str(archive), "--data-dir", str(target)), 1, "does not match its manifest")
    assert not target.exists()
    one_line_refusal(run("restore", str(tmp_path / "nothing.tgz"), "--data-dir", str(target)), 1)
    (tmp_path / "garbage.tgz").write_bytes(b"\x1f\x8b not really gzip")
    one_line_refusal(run("restore", str(tmp_path / "garbage.tgz"), "--data-dir", str(target)), 1,
                     "not an Outpost backup")
    manifest = json.loads(files["manifest.json"])
    assert manifest["format"] == "outpost-backup" and set(manifest["files"]) == {"outpost.sqlite3", "outpost.toml",
                                                                                 "api-token"}
