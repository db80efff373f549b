"""GET /metrics (docs/operations.md): Prometheus exposition written by prometheus_client, its auth (the API
token or ``[settings] metrics_token``, which opens nothing else), totals read from the database,
and a real Prometheus scraping a real server (skipped, saying so, without Debian's prometheus)."""

from __future__ import annotations

import dataclasses
import shutil
import socket
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from conftest import AUTH, T0, Api, assert_problem, make_deps, wait_for
from prometheus_client.parser import text_string_to_metric_families

import outpost

PROMETHEUS = Path("/usr/bin/prometheus")
METRICS_TOKEN = "scrape-only-0123456789abcdef"


@pytest.fixture
async def api(tmp_path: Path, git_repo: Path):
    deps = make_deps(tmp_path)
    deps = dataclasses.replace(deps, config=dataclasses.replace(deps.config, metrics_token=METRICS_TOKEN))
    yield Api(deps, git_repo)
    deps.store.close()


def families(text: str) -> dict[str, list]:
    """The exposition parsed by prometheus_client's own parser: samples by family name."""
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def sample(parsed: dict[str, list], family: str, name: str | None = None, **labels: str) -> float | None:
    return next((s.value for s in parsed.get(family, []) if s.name == (name or family) and s.labels == labels), None)


async def test_metrics_parse_and_carry_every_series_of_the_contract(api):
    sched = await api.schedule()
    fired = await api.fire(sched["id"])
    await api.settle(fired["run_id"], outpost.RunStatus.FAILED, exit_code=1, error="boom")
    api.clock.at += timedelta(minutes=1)
    queued = await api.fire(sched["id"])
    reply = await api.get("/metrics")
    assert reply.status == 200, reply.body
    assert reply.headers["Content-Type"].startswith("text/plain")
    parsed = families(reply.text)
    assert sample(parsed, "outpost_runs", "outpost_runs_total", status="failed", agent="demo", trigger="manual") == 1
    assert sample(parsed, "outpost_runs_queued") == 1 and sample(parsed, "outpost_runs_running") == 0
    assert queued["run_id"] not in reply.text
    assert sample(parsed, "outpost_attention_open", kind="failed") == 1
    assert sample(parsed, "outpost_cron_lag_seconds") == 0
    assert sample(parsed, "outpost_agent_cost_usd", "outpost_agent_cost_usd_total", agent="demo") == 0
    assert {s.labels["what"] for s in parsed["outpost_disk_bytes"]} == {"database", "logs", "worktrees", "mirrors"}
    assert sample(parsed, "outpost_disk_bytes", what="database") > 0
    assert sample(parsed, "outpost_store_transaction_seconds", "outpost_store_transaction_seconds_count") > 0
    assert sample(parsed, "outpost_fire_lag_seconds", "outpost_fire_lag_seconds_count") == 0   # manual fires only
    assert "outpost_wakeups" in parsed
    assert "outpost_node_up" not in parsed   # one machine, no fleet


async def test_metrics_answer_openmetrics_to_a_scraper_that_asks_for_it(api):
    reply = await api.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("application/openmetrics-text")
    assert reply.text.rstrip().endswith("# EOF")


@pytest.mark.parametrize("authorization", [None, "Bearer nope", f"Basic {METRICS_TOKEN}", METRICS_TOKEN,
                                           f"Bearer {METRICS_TOKEN}x", "Bearer "])
async def test_metrics_without_a_good_token_is_401(api, authorization):
    headers = {"Authorization": authorization} if authorization is not None else {}
    assert_problem(await api.get("/metrics", auth=False, headers=headers), 401, "unauthorized")


async def test_the_metrics_token_reads_metrics_and_opens_nothing_else(api):
    scraper = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    assert (await api.get("/metrics", auth=False, headers=scraper)).status == 200
    for path in ("/v1/outpost/schedules", "/v1/outpost/snapshot", "/api/office/agents", "/v1/outpost/events"):
        assert_problem(await api.get(path, auth=False, headers=scraper), 401, "unauthorized")
    assert_problem(await api.post("/v1/outpost/dispatches", {"brief": "x"}, auth=False, headers=scraper),
                   401, "unauthorized")
    page = await api.get("/schedules", auth=False, headers=scraper)   # no dashboard either
    assert page.status in (401, 302) and "nightly" not in page.text
    assert (await api.get("/metrics", headers=AUTH)).status == 200   # the API token reads it too


async def test_a_signed_in_dashboard_session_alone_does_not_read_metrics(api):
    cookie, _csrf = api.store.transaction(api.store.access.create_session, T0)[0]
    api.client.set_cookie("127.0.0.1", outpost.SESSION_COOKIE, cookie)
    assert_problem(await api.get("/metrics", auth=False), 401, "unauthorized")


@pytest.mark.parametrize("value", ["short", 12345, "has spaces in it, sixteen+", "x" * 15])
def test_a_weak_metrics_token_stops_serve_naming_the_key_never_echoing_it(tmp_path, value):
    toml_value = f'"{value}"' if isinstance(value, str) else str(value)
    (tmp_path / "outpost.toml").write_text(f"[settings]\nmetrics_token = {toml_value}\n")
    with pytest.raises(outpost.ConfigError) as raised:
        outpost.load_config(tmp_path)
    assert "settings.metrics_token" in str(raised.value) and str(value) not in str(raised.value)


def test_fire_lag_is_observed_for_a_schedule_s_own_timing_only():
    metrics = outpost.Metrics()
    due = T0
    metrics.observe_start({"trigger": "cron", "due_at": due, "started_at": due + timedelta(seconds=0.3)})
    metrics.observe_start({"trigger": "manual", "due_at": due, "started_at": due + timedelta(hours=1)})
    metrics.observe_start({"trigger": "catch_up", "due_at": due, "started_at": due + timedelta(hours=1)})
    get = metrics.registry.get_sample_value
    assert get("outpost_fire_lag_seconds_count") == 1
    assert get("outpost_fire_lag_seconds_bucket", {"le": "0.25"}) == 0
    assert get("outpost_fire_lag_seconds_bucket", {"le": "0.5"}) == 1


def test_a_fleet_reports_each_node_up_or_lost():
    metrics = outpost.Metrics()
    reading = outpost.MetricsReading(runs=[("succeeded", "demo", "cron", 4, 1.5), ("running", "demo", "cron", 1, 0.0)],
                                     wakeups=[("user", "finished", 2), ("user", "queued", 1)], attention={},
                                     nodes=[{"name": "a:1", "status": "up"}, {"name": "b:1", "status": "lost"}],
                                     disk={"logs": 0}, cron_lag_s=0.0)
    parsed = families(metrics.render(reading, "")[0].decode())
    assert sample(parsed, "outpost_node_up", node="a:1") == 1 and sample(parsed, "outpost_node_up", node="b:1") == 0
    assert sample(parsed, "outpost_runs", "outpost_runs_total", status="succeeded", agent="demo", trigger="cron") == 4
    assert sample(parsed, "outpost_runs", "outpost_runs_total", status="running", agent="demo", trigger="cron") is None
    assert sample(parsed, "outpost_runs_running") == 1
    assert sample(parsed, "outpost_agent_cost_usd", "outpost_agent_cost_usd_total", agent="demo") == 1.5
    assert sample(parsed, "outpost_wakeups", "outpost_wakeups_total", source="user", status="finished") == 2
    assert sample(parsed, "outpost_wakeups", "outpost_wakeups_total", source="user", status="queued") is None


# --- a real Prometheus ----------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(prometheus: str, expr: str) -> list[dict]:
    reply = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=5)
    reply.raise_for_status()
    return reply.json()["data"]["result"]


@pytest.mark.slow
@pytest.mark.skipif(not PROMETHEUS.exists(), reason="no /usr/bin/prometheus: .ci/run installs Debian's prometheus")
def test_a_real_prometheus_scrapes_the_runs_with_the_bearer_token(server_factory, git_repo, tmp_path):
    server = server_factory()
    with server.client() as client:
        runs = []
        for i in range(3):
            reply = client.post("/v1/outpost/dispatches", headers={"Idempotency-Key": f"metrics-{i}"},
                                json={"brief": f"@print run {i}", "repository": str(git_repo), "agent": "demo"})
            assert reply.status_code == 202, reply.text
            runs.append(reply.json()["run_id"])
        wait_for(lambda: all(client.get(f"/v1/outpost/runs/{r}").json()["status"] == "succeeded" for r in runs))
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(f"""global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: outpost
    metrics_path: /metrics
    authorization:
      credentials: {server.token}
    static_configs:
      - targets: ["{server.url.removeprefix('http://')}"]
""")
    log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115
    argv = [str(PROMETHEUS), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}"]
    prometheus = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def scraped():
            try:
                up = query(url, 'up{job="outpost"}')
                total = query(url, "sum(outpost_runs_total)")
            except httpx.HTTPError:   # not listening yet
                return None
            return (up, total) if up and total else None
        started = time.monotonic()
        up, total = wait_for(scraped, timeout_s=30, interval_s=0.2)
        assert up[0]["value"][1] == "1"
        assert float(total[0]["value"][1]) == 3
        succeeded = query(url, 'outpost_runs_total{status="succeeded",agent="demo",trigger="dispatch"}')
        assert float(succeeded[0]["value"][1]) == 3
        assert query(url, "outpost_fire_lag_seconds_count") and query(url, "outpost_disk_bytes")
        print(f"prometheus scraped Outpost {time.monotonic() - started:.1f} s after it started")
    finally:
        prometheus.terminate()
        prometheus.wait(10)
        log.close()
    shutil.rmtree(tmp_path / "tsdb", ignore_errors=True)
