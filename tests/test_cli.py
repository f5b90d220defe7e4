"""The ``safl`` command and the light-import promise of ``edge_client``."""

from __future__ import annotations

import ast
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from safl.cli import main


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
    assert _loaded_after("from safl import cli; cli._parser()") == []


def test_safl_device_dispatches_without_loading_the_aggregator(tmp_path):
    # A bad config stops the device at start-up: everything up to there is what it loads.
    code = (f"from safl.cli import main\n"
            f"assert main(['device', '--config', r'{tmp_path / 'none.toml'}']) == 2")
    assert _loaded_after(code) == []


def _imports(package: str) -> dict[str, set[str]]:
    """Top-level packages each module of ``package`` imports, lazily or not (from source)."""
    found = {}
    for path in (Path(__file__).parent.parent / package).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        found[str(path)] = names
    return found


def test_the_layers_import_downwards_only():
    # edge_client (devices) < models (artifacts on the trainers' registry) and aggregator
    # (stations, cloud) < lab (simulation, experiments, demo) < safl (the command, the only
    # composition root).  Nothing that runs in a factory imports the lab.
    upward = {"edge_client": {"aggregator", "models", "lab", "safl"},
              "models": {"aggregator", "lab", "safl"}, "aggregator": {"models", "lab", "safl"},
              "lab": {"models", "safl"}}
    for package, banned in upward.items():
        for path, names in _imports(package).items():
            assert not names & banned, f"{path} imports {names & banned}"


def _module_graph() -> dict[str, set[str]]:
    """Each module of the project and the project modules it imports (lazily, under
    TYPE_CHECKING or not), from source.  Importing a module's own ancestor package is no
    edge: that package is being imported already when the module is."""
    root = Path(__file__).parent.parent
    modules = {}
    for package in ("edge_client", "aggregator", "models", "lab", "safl"):
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            init = parts[-1] == "__init__"
            modules[".".join(parts[:-1] if init else parts)] = (path, init)
    graph = {}
    for name, (path, init) in modules.items():
        here = name.split(".") if init else name.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + [node.module or ""]
                                if node.level else [node.module or ""]).strip(".")
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    edges.add(target)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = [stack.pop()]
            while component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_of_the_project_imports_itself_round_a_circle():
    graph = _module_graph()
    assert {"lab.fleet", "edge_client.trainers.numpy_layers"} <= graph.keys()
    assert "lab.engine" in graph["lab.ray_engine"]  # the graph sees relative imports
    assert "lab.ray_engine" in graph["lab.simulation"]  # and lazy ones
    assert _cycles(graph) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.slow
@pytest.mark.timeout(600)  # three real federations; at the suite's busiest, past 300 s once
def test_demo_writes_metrics_plot_and_table(tmp_path, capsys):
    assert main(["demo", "--rounds", "3", "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "safl+fedgs" in table and "fedavg" in table and "final_accuracy" in table
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert {r["strategy"] for r in rows} == {"safl+fedgs", "fedgs", "fedavg"}
    assert max(int(r["round"]) for r in rows) == 3
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["strategies"]) == 3
    # Where every update went: the devices' own counts against what their stations counted.
    for row in summary["strategies"]:
        assert row["sent"] >= row["uploads"] + row["skips"] > 0, row
        assert row["sent"] - row["uploads"] - row["skips"] >= row["late"] + row["refused"]
    assert "lost (never counted by a station)" in table
    assert (tmp_path / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Over MQTT, every device of every recipe as a monitor saw it, and all of it in a report.
    devices = list(csv.DictReader(open(tmp_path / "devices.csv")))
    assert {(r["strategy"], r["device"]) for r in devices} == {
        (s, f"dev{k:03d}") for s in ("safl+fedgs", "fedgs", "fedavg") for k in range(12)}
    # accuracy by round, and per recipe its devices' accuracy and uploads (the processes count
    # their bytes, but only at the end: no accuracy-against-bytes curve)
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 7 and "<th>lost</th>" in page


def test_cli_reports_errors_with_exit_code(tmp_path, capsys):
    assert main(["demo", "--rounds", "0", "--out", str(tmp_path)]) == 2
    assert "rounds" in capsys.readouterr().err


def test_version_models_list_and_json_logs(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "safl", *args],
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
    assert out.returncode == 6 and any(r["level"] == "WARNING" for r in logged)



def test_services_log_at_info_by_default_and_commands_at_warning():
    import logging

    from safl.cli import _parser, _setup_logging
    root = logging.getLogger()
    saved = root.level, list(root.handlers)
    try:
        for argv, level in ((["device", "--config", "d.toml"], logging.INFO),
                            (["experiment", "e.toml"], logging.WARNING),
                            (["--log-level", "error", "cloud", "--config", "c.toml"],
                             logging.ERROR)):
            root.handlers.clear()
            _setup_logging(_parser().parse_args(argv))
            assert root.level == level, argv
    finally:
        root.setLevel(saved[0])
        root.handlers[:] = saved[1]


def test_demo_without_matplotlib_still_writes_its_csv(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from safl.cli import main\n"
            f"sys.exit(main(['demo', '--bus', 'local', '--rounds', '2', '--out', r'{tmp_path}']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "pip install 'safl-edge[plot]'" in out.stderr + out.stdout
    assert (tmp_path / "metrics.csv").exists() and not (tmp_path / "accuracy.png").exists()


def _children(parent: int) -> list[int]:
    import os
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if int(fh.read().rsplit(")", 1)[1].split()[1]) == parent:
                    found.append(int(pid))
        except (OSError, IndexError, ValueError):
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_sigterm_stops_the_demo_its_roles_and_its_broker(tmp_path):
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "safl", "demo", "--rounds", "200",
                             "--out", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("*/logs/dev*.log")) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2.0)  # the fleet is up: the broker and 15 role processes
    children = _children(proc.pid)
    assert len(children) >= 16
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 130
    err = proc.stderr.read()
    assert "interrupted" in err and "Traceback" not in err
    time.sleep(1.0)
    assert [pid for pid in children if _alive(pid)] == []  # roles and broker are gone


def test_a_busy_broker_port_is_one_line():
    import socket
    pytest.importorskip("amqtt")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = subprocess.run([sys.executable, "-m", "safl", "broker", "--port",
                              str(taken.getsockname()[1])], capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 1 and "port taken" in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60  # the roles' cores and their parts


def _oversized(package: Path) -> list[str]:
    """Modules of ``package`` over MAX_MODULE_LINES lines, functions over
    MAX_FUNCTION_LINES (decorators and docstrings included)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            found.append(f"{path.relative_to(package.parent)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if node.end_lineno - first + 1 > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno} "
                                 f"{node.name}: {node.end_lineno - first + 1} lines")
    return found


def test_the_runtime_packages_keep_modules_and_functions_small(tmp_path):
    root = Path(__file__).resolve().parent.parent
    assert _oversized(root / "aggregator") == [] and _oversized(root / "edge_client") == []
    at = tmp_path / "pkg"  # the check itself, at exactly the bounds and one past them
    at.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    (at / "fits.py").write_text("def f():\n" + body + "\n" * (MAX_MODULE_LINES - 60))
    assert _oversized(at) == []
    (at / "fits.py").write_text("def f():\n" + body + "    y = 0\n")
    (at / "long.py").write_text("\n" * (MAX_MODULE_LINES + 1))
    assert _oversized(at) == ["pkg/fits.py:1 f: 61 lines", "pkg/long.py: 401 lines"]


def test_make_test_names_what_it_could_not_install_in_one_line(tmp_path):
    """One list of Debian packages (deploy/system-packages.sh): .ci/run installs it,
    `make test` installs it where it may and otherwise ends with one line naming what was
    skipped and the command that installs it."""
    import os
    import re
    import subprocess

    root = Path(__file__).resolve().parent.parent
    script = root / "deploy" / "system-packages.sh"
    assert "deploy/system-packages.sh install" in (root / ".ci" / "run").read_text()
    recipe = (root / "Makefile").read_text().split("\ntest:")[1].split("\n\n")[0]
    assert "system-packages.sh auto" in recipe and "system-packages.sh report" in recipe
    listed = re.findall(r"^    ([a-z0-9][^#\n]*)$", script.read_text().split("PACKAGES=(")[1]
                        .split("\n)")[0], re.M)
    packages = " ".join(listed).split()
    assert {"mosquitto", "chromium", "ffmpeg", "dataset-fashion-mnist"} <= set(packages)
    for installed, expected in ((False, 1), (True, 0)):
        fake = tmp_path / ("yes" if installed else "no")
        fake.mkdir()
        status = "install ok installed" if installed else "unknown ok not-installed"
        (fake / "dpkg-query").write_text(f"#!/bin/sh\nprintf '{status}'\n")
        (fake / "dpkg-query").chmod(0o755)
        out = subprocess.run(["bash", str(script), "report"], capture_output=True, text=True,
                             env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
        assert out.returncode == 0 and len(out.stdout.splitlines()) == expected, out.stdout
        if not installed:
            assert all(p in out.stdout for p in packages)
            assert "sudo deploy/system-packages.sh install" in out.stdout
