"""The ``safl`` command and the light-import promise of ``edge_client``."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from edge_client.cli import main


def _loaded_after(code: str) -> list[str]:
    probe = (f"{code}\nimport sys\n"
             "print(' '.join(m for m in ('torch', 'aggregator', 'sklearn', 'matplotlib') "
             "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_importing_edge_client_loads_neither_torch_nor_aggregator():
    assert _loaded_after("import edge_client, edge_client.device, edge_client.trainers") == []


def test_numpy_device_runs_a_training_step_without_torch():
    code = ("import numpy as np\nfrom edge_client.trainers import build_trainer\n"
            "t = build_trainer('mlp', input_shape=(4,), num_classes=2, lr=0.1)\n"
            "t.train_step(np.zeros((2, 4), np.float32), np.array([0, 1]))")
    assert "torch" not in _loaded_after(code)


def test_cli_parser_does_not_import_the_aggregator():
    assert _loaded_after("from edge_client import cli; cli._parser()") == []


@pytest.mark.slow
def test_demo_writes_metrics_plot_and_table(tmp_path, capsys):
    assert main(["demo", "--rounds", "3", "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "safl+fedgs" in table and "fedavg" in table and "final_accuracy" in table
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert {r["strategy"] for r in rows} == {"safl+fedgs", "fedgs", "fedavg"}
    assert max(int(r["round"]) for r in rows) == 3
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["strategies"]) == 3
    assert (tmp_path / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_reports_errors_with_exit_code(tmp_path, capsys):
    assert main(["demo", "--rounds", "0", "--out", str(tmp_path)]) == 2
    assert "rounds" in capsys.readouterr().err


def test_version_models_list_and_json_logs(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "edge_client.cli", *args],
                              capture_output=True, text=True, timeout=60)
    assert run("--version").stdout.startswith("safl ")
    listing = run("models", "list").stdout
    assert "small_cnn" in listing or "needs" in listing
    config = tmp_path / "bad.toml"
    config.write_text('[device]\ndevice_id = "d0"\n[source]\nkind = "synthetic"\n')
    out = run("--log-format", "json", "device", "--config", str(config))
    # A missing required key is named, in one line, with no traceback.
    assert out.returncode == 2 and "'station': is required" in out.stderr
    assert "Traceback" not in out.stderr
    config.write_text('[device]\ndevice_id = "d0"\nstation = "s"\n[source]\nkind = "synthetic"\n'
                      '[broker]\nurl = "mqtt://127.0.0.1:1"\nconnect_timeout = 1.0\n')
    out = run("--log-format", "json", "device", "--config", str(config))
    logged = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    assert out.returncode == 6 and logged and logged[0]["level"] == "WARNING"
