"""Dashboards, provisioning and compose as files: what is committed is what the code generates, the
dashboards are well-formed (stable unique uids, datasource variables on every query), and the compose
file is accepted by `docker compose config` where the compose plugin exists."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from stepwatch_server.grafana import generate
from stepwatch_server.grafana.dashboards import DASHBOARDS
from stepwatch_server.grafana.panels import POSTGRES_TYPE, PROMETHEUS_TYPE, panel_queries
from stepwatch_server.grafana.provisioning import POSTGRES_UID, PROMETHEUS_UID
from tests.metrics.prometheus import require_prometheus

DIR = generate.REPO / "dashboards"
COMPOSE = generate.REPO / "docker-compose.yml"
UIDS = {
    "run-overview": "stepwatch-run-overview",
    "ranks": "stepwatch-ranks",
    "numerics": "stepwatch-numerics",
    "collector": "stepwatch-collector",
    "scale": "stepwatch-scale",
}


def test_committed_files_equal_what_the_code_generates() -> None:
    stale = [rel for rel, content in generate.outputs().items() if (DIR / rel).read_text() != content]
    assert not stale, f"run `python -m stepwatch_server.grafana.generate` and commit: {stale}"
    assert generate.main(["--check"]) == 0
    committed = {p.name for p in DIR.glob("*.json")}
    assert committed == {f"{name}.json" for name in DASHBOARDS}, "a dashboard JSON the code does not make"


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_dashboards_have_stable_uids_and_datasource_variables(name: str) -> None:
    doc = json.loads((DIR / f"{name}.json").read_text())
    assert doc["uid"] == UIDS[name]
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == PROMETHEUS_TYPE
    assert variables["postgres"]["query"] == POSTGRES_TYPE
    ids = [panel["id"] for panel in doc["panels"]]
    assert ids == list(range(1, len(ids) + 1))
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            ref = target.get("datasource") or panel["datasource"]
            assert ref["uid"] in ("${datasource}", "${postgres}"), (panel["title"], ref)
    kinds = {kind for _, kind, _ in panel_queries(doc)}
    assert PROMETHEUS_TYPE in kinds


def test_provisioning_names_the_datasources_the_dashboards_use() -> None:
    sources = yaml.safe_load((DIR / "provisioning/datasources/stepwatch.yml").read_text())["datasources"]
    assert {(s["uid"], s["type"]) for s in sources} == {
        (PROMETHEUS_UID, PROMETHEUS_TYPE),
        (POSTGRES_UID, POSTGRES_TYPE),
    }
    providers = yaml.safe_load((DIR / "provisioning/dashboards/stepwatch.yml").read_text())["providers"]
    assert providers[0]["options"]["path"] in COMPOSE.read_text()


def test_compose_stack_has_every_service_with_healthchecks_and_volumes() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) >= {"collector", "postgres", "redis", "prometheus", "grafana"}
    for name, service in services.items():
        assert "healthcheck" in service, f"{name} has no healthcheck"
    assert services["collector"]["build"]
    assert {"postgres-data", "prometheus-data", "grafana-data", "redis-data"} <= set(compose["volumes"])
    # The scale profile (README, "Running at scale"): a second replica and the workers, all on the bus.
    bus = "redis://redis:6379/0"
    assert services["collector-2"]["profiles"] == services["detect"]["profiles"] == ["scale"]
    assert (
        services["collector-2"]["environment"]["STEPWATCH_BUS"]
        == services["detect"]["environment"]["STEPWATCH_BUS"]
        == bus
    )
    assert services["detect"]["command"][0] == "detect" and "--metrics-port" in services["detect"]["command"]
    assert "--appendonly" in services["redis"]["command"] and "yes" in services["redis"]["command"]
    # Prometheus scrapes the collector, and finds the profile's replica and every worker by DNS (any count).
    scrape = yaml.safe_load((DIR / "prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    assert jobs["stepwatch"]["static_configs"][0]["targets"] == ["collector:8000"]
    found = {
        (name, sd["port"])
        for job in jobs.values()
        for sd in job.get("dns_sd_configs", [])
        for name in sd["names"]
    }
    assert found == {("collector-2", 8000), ("detect", int(services["detect"]["command"][2]))}, found
    assert all(name.startswith("stepwatch") for name in jobs)  # the dashboards match job=~"stepwatch.*"


def test_promtool_accepts_the_compose_stacks_prometheus_configuration() -> None:
    _, promtool = require_prometheus()
    checked = subprocess.run(
        [promtool, "check", "config", "--syntax-only", str(DIR / "prometheus/prometheus.yml")],
        capture_output=True,
        timeout=30,
    )
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()


def test_docker_compose_config_accepts_the_file() -> None:
    docker = shutil.which("docker")
    plugin = (
        docker is not None
        and subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30).returncode == 0
    )
    if not plugin:
        pytest.skip("the docker compose plugin is not installed (the issue allows skipping only this check)")
    checked = subprocess.run(
        [str(docker), "compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True, timeout=60
    )
    assert checked.returncode == 0, checked.stderr.decode()
