"""The operators' stack: the Prometheus configuration provisioning writes and its alert
rules (checked and unit-tested by ``promtool``), a real Prometheus scraping every role of a
running fleet, and the Grafana dashboard's queries against the series it found."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from aggregator.prometheus import JOBS, scrape_config
from aggregator.provision import provision

PROMTOOL = shutil.which("promtool")
DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
needs_prometheus = pytest.mark.skipif(
    PROMTOOL is None or shutil.which("prometheus") is None,
    reason="Debian's prometheus package (promtool) is installed by .ci/run")


def _promtool(*args: str, cwd: Path | None = None) -> str:
    out = subprocess.run([PROMTOOL or "promtool", *args], capture_output=True, text=True,
                         cwd=cwd, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@needs_prometheus
def test_provisioning_writes_a_valid_scrape_config_and_tested_alert_rules(tmp_path):
    provision(DEPLOY / "fleet.example.toml", tmp_path / "fleet")
    written = tmp_path / "fleet" / "prometheus"
    for name in ("prometheus.yml", "alerts.yml"):  # the shipped copies are what it writes
        assert (written / name).read_text() == (DEPLOY / "prometheus" / name).read_text(), name
    config = (written / "prometheus.yml").read_text()
    assert all(f'job_name: "{job}"' in config for job in JOBS.values())
    # Each role its own port (the cloud's, a station's +1, a device's +2): roles sharing a
    # host never collide. A device is reached at its host, or at its id.
    assert '["cloud.example.com:9101"]' in config and '["10.1.0.2:9102"]' in config
    assert '["10.2.0.57:9103"]' in config and '["cam-01:9103"]' in config
    fleet = tmp_path / "fleet"
    ports = {name: re.search(r"metrics_port = (\d+)", (fleet / path).read_text()).group(1)
             for name, path in (("cloud", "cloud/cloud.toml"),
                                ("station", "stations/hall-1/station.toml"),
                                ("device", "devices/cam-01/device.toml"))}
    assert ports == {"cloud": "9101", "station": "9102", "device": "9103"}
    assert "SUCCESS" in _promtool("check", "config", str(written / "prometheus.yml"))
    assert "7 rules found" in _promtool("check", "rules", str(written / "alerts.yml"))
    assert "SUCCESS" in _promtool("test", "rules", "alerts.test.yml",
                                  cwd=DEPLOY / "prometheus")


def test_a_fleet_without_metrics_gets_no_scrape_config(tmp_path):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text((DEPLOY / "fleet.example.toml").read_text().replace(
        "metrics_port = 9101", "metrics_port = 0"))
    provision(fleet, tmp_path / "out")
    assert not (tmp_path / "out" / "prometheus").exists()
    device = (tmp_path / "out" / "devices" / "cam-01" / "device.toml").read_text()
    assert "metrics_port" not in device and "state_dir" in device
    fleet.write_text(fleet.read_text().replace("metrics_port = 0", 'metrics_port = "x"'))
    with pytest.raises(Exception, match="fleet.metrics_port"):
        provision(fleet, tmp_path / "again")


def _query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())["data"]["result"]


def _metric_names(expr: str) -> set[str]:
    """The series a PromQL expression reads (functions and label names left out)."""
    bare = re.sub(r"\{[^}]*\}", "", re.sub(r"\[[^]]*\]", "", expr))
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare))
    return {w for w in words if w.startswith("safl_") or w == "up"}


@pytest.mark.slow
@needs_prometheus
@pytest.mark.skipif(shutil.which("mosquitto") is None, reason="Mosquitto is installed by .ci/run")
def test_prometheus_scrapes_every_role_and_the_dashboard_reads_real_series(tmp_path, digits):
    import paho.mqtt.client as paho
    from brokers import Mosquitto, free_port
    from paho.mqtt.enums import CallbackAPIVersion
    from test_mqtt import STRATEGY, _creds, _mosquitto, _spec

    from lab.launch import launch_fleet
    from lab.simulation import plan_fleet

    spec = _spec(digits, rounds=200)  # about 20 s: long enough for scrapes every second
    plan = plan_fleet(STRATEGY, spec)
    server = _mosquitto(tmp_path, spec)
    names = ["cloud", *(s["station_id"] for s in plan.stations),
             *(d for s in plan.stations for d in s["devices"])]
    ports = {name: free_port() for name in names}
    role = {name: "cloud" if name == "cloud" else "station" if name.startswith("st")
            else "device" for name in names}
    targets: dict[str, list[tuple[str, str]]] = {}
    for name in names:
        targets.setdefault(role[name], []).append((name, f"127.0.0.1:{ports[name]}"))
    (tmp_path / "prometheus.yml").write_text(scrape_config(plan.fleet, targets, interval="1s"))
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", tmp_path / "alerts.yml")
    web = free_port()
    prometheus = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
    found: dict[str, list] = {}

    def garbage() -> None:  # a refusal, so the refusal panel reads a real series
        client = paho.Client(CallbackAPIVersion.VERSION2, client_id="tester")
        client.username_pw_set("tester", Mosquitto.PASSWORD)
        client.connect("127.0.0.1", server.port)
        client.loop_start()
        device = plan.stations[0]["devices"][0]
        client.publish(f"safl/{plan.fleet}/dev/{device}/update", b"\x00" * 64,
                       qos=1).wait_for_publish(5)
        client.loop_stop()
        client.disconnect()

    dashboard = json.loads((DEPLOY / "grafana" / "safl-edge.json").read_text())
    used = {name for panel in dashboard["panels"] for t in panel["targets"]
            for name in _metric_names(t["expr"])}

    def watch(fleet) -> None:
        """While every service runs (scraped each second): its series, under its job."""
        if "up" in found or fleet.last_round < 4:
            return
        garbage()
        deadline = time.monotonic() + 60
        while "up" not in found and time.monotonic() < deadline:
            time.sleep(1.0)
            rounds = _query(web, "last_over_time(safl_round[5m])")
            refused = _query(web, "last_over_time(safl_rejected_total[5m])")
            with urllib.request.urlopen(f"http://127.0.0.1:{web}/api/v1/label/__name__/"
                                        "values", timeout=5) as r:
                found["names"] = json.loads(r.read())["data"]
            # Each series from its first scrape on (a device's local accuracy once it has
            # held-out samples): wait for every one the dashboard reads.
            if len(rounds) == len(names) and refused and used <= set(found["names"]):
                found.update(rounds=rounds, refused=refused,
                             up=_query(web, 'max_over_time(up{job=~"safl-.*"}[5m])'))

    try:
        rows = launch_fleet(tmp_path / "run", digits, STRATEGY, spec, server.url,
                            credentials=_creds, timeout=300, during=watch,
                            extra_args={n: ["--metrics-port", str(p)] for n, p in ports.items()})
    finally:
        prometheus.terminate()
        prometheus.wait(10)
        server.stop()
    assert rows[-1]["round"] == spec.rounds
    assert "up" in found, (sorted(used - set(found.get("names", ()))),
                           (tmp_path / "prometheus.log").read_text()[-2000:])
    seen = {(r["metric"]["job"], r["metric"]["participant"]) for r in found["rounds"]}
    assert seen == {(JOBS[role[n]], n) for n in names}  # every participant, under its job
    assert {r["metric"]["reason"] for r in found["refused"]} and all(
        r["metric"]["role"] == "station" for r in found["refused"])
    assert all(r["value"][1] == "1" for r in found["up"])
    served = set(found["names"])
    assert used and used <= served, sorted(used - served)
    print(f"Prometheus held {len(served)} series names; the dashboard reads {sorted(used)}",
          file=sys.stderr)
