"""Configuration: TOML, environment and overrides, with errors that name the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from aggregator.config import CloudConfig, StationConfig
from edge_client.config import BrokerConfig, DeviceConfig, load_config
from edge_client.errors import ConfigError


def test_toml_env_and_overrides_in_order(tmp_path):
    path = tmp_path / "device.toml"
    path.write_text('[device]\ndevice_id = "cam1"\nstation = "s1"\nlr = 0.2\nmix = 0.3\n')
    cfg = load_config(DeviceConfig, "device", path, overrides={"mix": 0.9},
                      environ={"SAFL_DEVICE_LR": "0.01", "SAFL_DEVICE_NU": "2"})
    assert (cfg.device_id, cfg.lr, cfg.mix, cfg.nu) == ("cam1", 0.01, 0.9, 2.0)


def test_the_wire_version_a_role_writes_comes_from_broker_toml_or_env(tmp_path):
    path = tmp_path / "device.toml"
    path.write_text('[broker]\nwire_version = 1\n')
    assert load_config(BrokerConfig, "broker", path).wire_version == 1
    assert load_config(BrokerConfig, "broker", None).wire_version == 2  # the newest
    env = {"SAFL_BROKER_WIRE_VERSION": "1"}
    assert load_config(BrokerConfig, "broker", None, environ=env).wire_version == 1
    path.write_text('[broker]\nwire_version = 3\n')
    with pytest.raises(ConfigError, match="wire_version"):
        load_config(BrokerConfig, "broker", path)


def test_station_roster_from_toml_list(tmp_path):
    path = tmp_path / "station.toml"
    path.write_text('[station]\nstation_id = "s1"\ndevices = ["a", "b", "c"]\n'
                    'super_node_size = 3\n')
    assert load_config(StationConfig, "station", path).devices == ("a", "b", "c")


@pytest.mark.parametrize("text, key", [
    ('[device]\ndevice_id = "a"\nstation = "s"\nlearning_rate = 1\n', "learning_rate"),
    ('[device]\ndevice_id = "a"\nstation = "s"\ntemperature = -1.0\n', "temperature"),
    ('[device]\ndevice_id = "a"\nstation = "s"\nmix = 1.5\n', "mix"),
    ('[device]\ndevice_id = "a"\nstation = "s"\nbatch_size = "big"\n', "batch_size"),
    ('[device]\ndevice_id = "a/b"\nstation = "s"\n', "device_id"),
    ('[device\n', "config"),
])
def test_broken_device_config_names_the_key(tmp_path, text, key):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=key):
        load_config(DeviceConfig, "device", path)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(DeviceConfig, "device", tmp_path / "nope.toml")


@pytest.mark.parametrize("kw, key", [
    (dict(super_node_size=5), "super_node_size"),  # more than the 3 devices it has
    (dict(rand_per_group=4), "rand_per_group"),
    (dict(selector="magic"), "selector"),
    (dict(fusion="mean"), "fusion"),
    (dict(devices=("a", "a", "b")), "devices"),
    (dict(sync_period=0), "sync_period"),
])
def test_station_config_out_of_range(kw, key):
    base = dict(station_id="s", devices=("a", "b", "c"), super_node_size=2)
    with pytest.raises(ConfigError, match=key):
        StationConfig(**{**base, **kw})


def test_cloud_config_out_of_range():
    with pytest.raises(ConfigError, match="rounds"):
        CloudConfig(stations=("s",), rounds=-1)
    with pytest.raises(ConfigError, match="min_stations"):
        CloudConfig(stations=("s",), rounds=1, min_stations=2)
    with pytest.raises(ConfigError, match="server_optimizer"):
        CloudConfig(stations=("s",), rounds=1, server_optimizer="adam")


def test_a_missing_required_key_is_named():
    from edge_client.config import DeviceConfig, from_mapping
    with pytest.raises(ConfigError, match="'station': is required by DeviceConfig"):
        from_mapping(DeviceConfig, {"device_id": "d0"})


def test_python_310_is_served_by_one_toml_reader_and_the_version_is_the_installed_one():
    """Python 3.10 (JetPack 6) has no tomllib: only loading.py may import it, behind the
    tomli fallback; and the package's version is pyproject's, not a second copy."""
    import ast
    import importlib.metadata
    from pathlib import Path

    import edge_client

    root = Path(__file__).parent.parent
    for package in ("edge_client", "aggregator", "lab", "models", "safl"):
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) else [])
                if "tomllib" in names:
                    assert path.name == "loading.py", f"{path} imports tomllib"
    assert edge_client.__version__ == importlib.metadata.version("safl-edge")


def test_no_unseeded_generator_anywhere():
    """Every draw comes from a generator someone seeded: a run repeats, and no module keeps
    global random state (no ``random`` module, no ``np.random.default_rng()`` without a seed,
    no legacy ``np.random.<draw>``)."""
    import ast
    from pathlib import Path

    root = Path(__file__).parent.parent
    for package in ("edge_client", "aggregator", "lab", "models", "safl"):
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    assert "random" not in {a.name for a in node.names}, path
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    func = ast.unparse(node.func)
                    if func.endswith("default_rng"):
                        assert node.args, f"{path}:{node.lineno} draws from an unseeded generator"
                    elif ast.unparse(node.func.value) in ("np.random", "numpy.random"):
                        assert node.func.attr in ("Generator", "PCG64", "SeedSequence"), \
                            f"{path}:{node.lineno} uses numpy's global random state ({func})"


def test_the_configuration_reference_is_current_and_says_what_every_key_means():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "docs" / "make_config_doc.py"
    spec = importlib.util.spec_from_file_location("make_config_doc", path)
    doc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(doc)
    for _role, _command, tables in doc.ROLES:
        for name, cls in tables.items():
            texts: dict[str, str] = {}
            for f in dataclasses.fields(cls):
                text = doc.meaning(cls, f.name)
                assert text, f"[{name}] {f.name} has no comment to show"
                # Each key says what it is: a comment over a run of keys, or a docstring
                # sentence naming several, would give them all one text.
                assert text not in texts, f"[{name}] {f.name} and {texts[text]} share {text!r}"
                assert text.count("(") == text.count(")"), f"[{name}] {f.name}: a fragment " \
                                                           f"{text!r}"
                texts[text] = f.name
    assert doc.OUT.read_text() == doc.render(), (
        "docs/config.md is stale: run python docs/make_config_doc.py")
