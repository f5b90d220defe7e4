"""The ``safl`` command: one subcommand per role and task, each importing its module only
when chosen (``safl device`` loads what ``safl-device`` loads; see ``safl/__init__.py``)."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from edge_client.cli import (
    add_common_arguments,
    add_device_arguments,
    add_role_arguments,
    overrides,
    run_device,
    run_guarded,
    setup_logging,
)
from edge_client.errors import ConfigError

__all__ = ["main"]

SERVICES = ("device", "station", "cloud", "broker")  # log at INFO by default


def _demo(args: argparse.Namespace) -> int:
    from lab.demo import run_demo

    if args.fleet_out:  # what a written fleet cannot honour is refused, not ignored
        for flag, given in (("--bus", args.bus), ("--out", args.out)):
            if given is not None:
                raise ConfigError(flag.lstrip("-"), f"{flag} is for a demo that runs; "
                                  "--fleet-out only writes a fleet's files (its README says "
                                  "how to start them)")
    bus = args.bus or "mqtt"
    if args.broker and bus == "local":
        raise ConfigError("broker", "--broker runs the fleet over MQTT; drop --bus local")
    body_dir = ""
    if args.body != "none":
        from safl.bodies import ensure_body
        body_dir = str(ensure_body(args.body, (3, 64, 64)))
    if args.fleet_out:
        from lab.demo import write_demo_fleet
        write_demo_fleet(args.fleet_out, broker=args.broker or "mqtt://127.0.0.1:1883",
                         rounds=args.rounds or 20, seed=args.seed, body=args.body,
                         body_dir=body_dir)
        print(f"wrote a fleet to {args.fleet_out.resolve()}: start it with the commands in "
              f"{args.fleet_out.resolve() / 'README.md'}")
        return 0
    # SIGTERM unwinds like Ctrl-C, so the demo stops its role processes and its broker.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    run_demo(rounds=args.rounds, out=args.out, seed=args.seed, bus=bus, broker=args.broker,
             body=args.body, body_dir=body_dir)
    return 0


def _export(args: argparse.Namespace) -> int:
    from models.export import export_model, export_onnx

    shape = tuple(int(d) for d in args.input_shape.split(",")) if args.input_shape else None
    sources = [x for x in (args.name, args.from_module, args.from_onnx) if x]
    if len(sources) != 1:
        raise ConfigError("name", "give one of: a zoo name, --from-module package.module:"
                          "factory, or --from-onnx FILE")
    if args.from_onnx:
        manifest = export_onnx(args.from_onnx, args.out, optimizer=args.optimizer,
                               input_shape=shape, force=args.force)
    else:
        if args.from_module and not shape:
            raise ConfigError("input-shape", "--from-module needs --input-shape (e.g. 1,28,28)")
        manifest = export_model(args.name or args.from_module, args.out,
                                optimizer=args.optimizer, num_classes=args.classes,
                                input_shape=shape, force=args.force)
    print(f"exported {manifest.model}: {manifest.num_params} parameters, input "
          f"{manifest.input_shape}, layout {manifest.layout_hash} -> {args.out}")
    return 0


def _export_body(args: argparse.Namespace) -> int:
    from safl.bodies import export_checked

    shape = tuple(int(d) for d in args.input_shape.split(","))
    if len(shape) != 3:
        raise ConfigError("input-shape", f"a body takes frames (C,H,W), got {args.input_shape}")
    manifest = export_checked(args.name, args.out, shape)
    import json
    checked = json.loads((Path(args.out) / "body.json").read_text())["checked_against_torch"]
    print(f"exported body {manifest.name} (hash {manifest.hash}): frames {manifest.input_shape}"
          f" -> {manifest.embedding} features -> {args.out}"
          + "".join(f"; {k}: relative error {v:.1e} against torch" for k, v in checked.items()))
    return 0


def _broker(args: argparse.Namespace) -> int:
    from aggregator.broker import run_broker

    return run_broker(args.host, args.port)


def _aggregator_role(args: argparse.Namespace, table: str, config: type, service: type,
                     flags: dict[str, dict[str, str]] | None = None, **service_kw) -> int:
    """Load a station's or the cloud's role file (its table, [model], [broker], [service])
    with the flags every role takes, and run its service until the federation ends."""
    from edge_client.service import SHARED_TABLES, load_role_file

    cfg = load_role_file(args.config, {table: config, **SHARED_TABLES},
                         overrides(args, broker={"broker": "url"},
                                   service={"metrics_port": "metrics_port",
                                            "state_dir": "state_dir"}, **(flags or {})))
    service(**cfg, **service_kw).run()
    return 0


def _station(args: argparse.Namespace) -> int:
    from aggregator.config import StationConfig
    from aggregator.services import StationService

    return _aggregator_role(args, "station", StationConfig, StationService)


def _cloud(args: argparse.Namespace) -> int:
    from aggregator.config import CloudConfig
    from aggregator.services import CloudService

    return _aggregator_role(args, "cloud", CloudConfig, CloudService,
                            {"cloud": {"rounds": "rounds"}}, eval_path=args.eval or "",
                            out=str(args.out or ""), config_path=args.config or "")


def _status(args: argparse.Namespace) -> int:
    from aggregator.status import fleet_status, format_status
    from edge_client.config import BrokerConfig, load_config

    broker = load_config(BrokerConfig, "broker", args.config, {"url": args.broker})
    print(format_status(fleet_status(broker, args.fleet, args.wait), args.fleet))
    return 0


def _predictions(args: argparse.Namespace) -> int:
    from aggregator.status import watch_predictions
    from edge_client.config import BrokerConfig, load_config

    broker = load_config(BrokerConfig, "broker", args.config, {"url": args.broker})
    n = watch_predictions(broker, args.fleet, tuple(args.device), seconds=args.seconds,
                          count=args.count, emit=lambda line: print(line, flush=True))
    print(f"{n} predictions", file=sys.stderr)
    if not n and (args.count or args.seconds):
        print("safl predictions: none arrived: is inference publishing on, and may this "
              "certificate read the devices' predictions topics?", file=sys.stderr)
        return 1
    return 0


def _monitor(args: argparse.Namespace) -> int:
    from aggregator.monitor import run_monitor

    # --http, else the [monitor] table provisioning writes into monitor/monitor-*.toml
    from edge_client.config import BrokerConfig, load_config, read_toml
    from edge_client.errors import ConfigError
    table = read_toml(args.config, "config").get("monitor", {}) if args.config else {}
    http = args.http or str(table.get("http", "127.0.0.1:8080"))
    host, _, port = http.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError("--http", f"must be HOST:PORT, got {http!r}")
    broker = load_config(BrokerConfig, "broker", args.config, {"url": args.broker})
    run_monitor(broker, args.fleet, host, int(port), out=args.out)
    return 0


def _export_bodies(configs: list[Path], full: bool = False) -> None:
    """Export (and check) the body an experiment file names, once, before its runs."""
    from lab.experiment import load_experiment
    from safl.bodies import ensure_body

    for config in configs:
        cfg = load_experiment(config, full)
        if cfg.body != "none":
            ensure_body(cfg.body, tuple(cfg.camera_shape), cfg.body_dir)


def _experiment(args: argparse.Namespace) -> int:
    from lab.results import run_experiments

    _export_bodies(args.configs, args.full)
    run_experiments(args.configs, out=args.out, jobs=args.jobs, full=args.full,
                    fresh=args.fresh, finished_only=args.finished_only, report=args.report,
                    ray=args.ray)
    return 0


def _report(args: argparse.Namespace) -> int:
    from lab.run_report import write_run_report

    print(f"wrote {write_run_report(args.run_dir)}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from lab.sweep import run_sweep

    _export_bodies([args.config])
    run_sweep(args.config, out=args.out, jobs=args.jobs, report=args.report, ray=args.ray)
    return 0


def _provision(args: argparse.Namespace) -> int:
    from aggregator.kick import kick
    from aggregator.provision import provision

    if args.kick and args.revoke:
        raise ConfigError("kick", "revoke first, reload the brokers, then kick: not in one call")
    if args.kick:
        kicked, failed = kick(args.fleet, args.out, tuple(args.kick))
        for user, urls in kicked.items():
            print(f"ended {user}'s sessions on {', '.join(urls) or 'no broker'}")
        for url, why in failed.items():
            print(f"could not reach {url}: {why}", file=sys.stderr)
        return 7 if failed else 0
    created = provision(args.fleet, args.out, force=args.force, revoke=tuple(args.revoke),
                        prefix=args.prefix)
    print(f"provisioned {args.out}: CA {'created' if created['ca'] else 'kept'}, "
          f"{len(created['credentials'])} new credentials"
          + (f", revoked {', '.join(created['revoked'])}" if created["revoked"] else ""))
    for note in created["notes"]:
        print(f"warning: {note}", file=sys.stderr)
    return 0


def _models_list(args: argparse.Namespace) -> int:
    try:
        from edge_client.trainers.zoo import DEFAULT_INPUT, MODELS
    except ImportError:
        print("mlp, softmax (numpy backend); the torch zoo needs: pip install "
              "'safl-edge[torch]'")
        return 0
    for name in MODELS:
        print(f"{name:<12} input {DEFAULT_INPUT.get(name, '?')}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="safl", description="safl-edge: SAFL and FedGS "
                                     "federated learning for edge fleets")
    add_common_arguments(parser, "safl")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_demo, _add_roles, _add_status, _add_lab, _add_provision, _add_broker,
                _add_models):
        add(sub)
    return parser


def _add_demo(sub) -> None:
    """``safl demo``: the three recipes on one fleet."""
    demo = sub.add_parser("demo", help="SAFL+FedGS vs FedGS vs FedAvg on a real fleet")
    demo.add_argument("--rounds", type=int, default=None,
                      help="external syncs (default 20 over MQTT, 100 with --bus local)")
    demo.add_argument("--bus", choices=("mqtt", "local"), default=None,
                      help="mqtt (default): one process per role over a broker; local: the "
                      "in-process bus")
    demo.add_argument("--broker", default=None,
                      help="mqtt://host:port of an external broker (default: start the "
                      "embedded amqtt broker)")
    demo.add_argument("--out", type=Path, default=None, help="output folder "
                      "(default runs/<timestamp>)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--body", default="none", metavar="NAME",
                      help="a frozen pretrained body (efficientnet-lite0): the devices train a "
                      "linear head on its embeddings of camera frames (docs/bodies.md)")
    demo.add_argument("--fleet-out", type=Path, default=None, metavar="DIR",
                      help="write the SAFL+FedGS fleet's files (absolute paths, README with "
                      "the commands) to DIR and start nothing")
    demo.set_defaults(run=_demo)


def _add_roles(sub) -> None:
    """``safl device``, ``safl station``, ``safl cloud``: the services."""
    for name, run, text in (("device", run_device, "run a device (SAFL on its sensor stream)"),
                            ("station", _station, "run a base station (FedGS super nodes)"),
                            ("cloud", _cloud, "run the cloud aggregator")):
        p = sub.add_parser(name, help=text)
        p.set_defaults(run=run)
        if name == "device":
            add_device_arguments(p)
            continue
        add_role_arguments(p, name)
        p.add_argument("--state-dir", default=None, help="checkpoint every round here and "
                       "resume from it on start (overrides [service] state_dir)")
        if name == "cloud":
            p.add_argument("--rounds", type=int, default=None)
            p.add_argument("--eval", default=None, help=".npz test set (x, y) to score rounds")
            p.add_argument("--out", type=Path, default=None, help="where metrics.csv goes")


def _add_status(sub) -> None:
    """``safl status`` and ``safl monitor``: what the fleet's retained documents say."""
    status = sub.add_parser("status", help="print the fleet: stations, devices online, round")
    monitor = sub.add_parser("monitor", help="serve a live page of the fleet (read-only)")
    predictions = sub.add_parser("predictions", help="print devices' predictions as they "
                                 "arrive (with a line application's certificate: line.toml)")
    for p in (status, monitor, predictions):
        p.add_argument("--broker", default=None, help="mqtt://host:port")
        p.add_argument("--config", type=Path, default=None,
                       help="a TOML file with [broker] (provisioning writes monitor/status-*.toml "
                       "for status, monitor/monitor-*.toml for monitor and lines/<id>/watch.toml "
                       "for predictions)")
        p.add_argument("--fleet", default="default")
    status.add_argument("--wait", type=float, default=1.5, help="seconds to collect retained state")
    predictions.add_argument("--device", action="append", default=[],
                             help="a device to watch (repeatable; default: every device the "
                             "certificate may read)")
    predictions.add_argument("--seconds", type=float, default=0.0,
                             help="stop after this long (default: until Ctrl-C)")
    predictions.add_argument("--count", type=int, default=0,
                             help="stop after this many predictions")
    predictions.set_defaults(run=_predictions)
    status.set_defaults(run=_status)
    monitor.add_argument("--http", default=None, metavar="HOST:PORT",
                         help="where to serve the page (default: the config's [monitor] http, "
                         "else 127.0.0.1:8080)")
    monitor.add_argument("--out", type=Path, default=None, help="record the field test here "
                         "for `safl report` (devices.csv, metrics.csv, fleet.json)")
    monitor.set_defaults(run=_monitor)


def _add_lab(sub) -> None:
    """``safl experiment`` and ``safl sweep``: the lab's runs."""
    exp = sub.add_parser("experiment", help="strategies side by side on one fleet (in process)")
    exp.add_argument("configs", type=Path, nargs="+", help="experiment TOML files "
                     "(experiments/*.toml)")
    exp.add_argument("--out", type=Path, default=None, help="output folder (default runs/<name>)")
    exp.add_argument("--jobs", type=int, default=1, help="strategies run in parallel")
    exp.add_argument("--full", action="store_true",
                     help="the papers' unscaled settings (SPEC §5; hours on 2 cores)")
    exp.add_argument("--report", type=Path, default=None,
                     help="write the tables and claim verdicts into a results.md (each "
                     "experiment's own sections; the rest of the file is kept)")
    exp.add_argument("--fresh", action="store_true",
                     help="rerun every strategy instead of reusing finished runs in --out")
    exp.add_argument("--finished-only", action="store_true",
                     help="report the runs already finished in --out, run nothing")
    sweep = sub.add_parser("sweep", help="an experiment's strategies over the grid in its "
                           "[sweep] table, to choose defaults")
    sweep.add_argument("config", type=Path)
    sweep.add_argument("--out", type=Path, default=None, help="default runs/<name>-sweep")
    sweep.add_argument("--jobs", type=int, default=1, help="runs in parallel")
    sweep.add_argument("--report", type=Path, default=None,
                       help="write the sweep's table into a results.md as its own section")
    for p in (exp, sweep):
        p.add_argument("--ray", default=None, metavar="ADDRESS",
                       help="run each (strategy, seed) as a Ray task on the cluster at ADDRESS "
                       "('auto': the one `ray start` began here, HOST:PORT, or 'local': a Ray "
                       "instance for this command); needs the ray extra")
    exp.set_defaults(run=_experiment)
    sweep.set_defaults(run=_sweep)

    report = sub.add_parser("report", help="a finished run or field test as one HTML file "
                            "with pictures (report.html, report_*.png)")
    report.add_argument("run_dir", type=Path, help="the run's folder (metrics.csv, and "
                        "devices.csv, fleet.json and *.toml where it has them)")
    report.set_defaults(run=_report)



def _add_provision(sub) -> None:
    """``safl provision``: a fleet's credentials and configs."""
    prov = sub.add_parser("provision", help="CA, credentials, broker configs and role configs "
                          "for a fleet file")
    prov.add_argument("fleet", type=Path, help="the fleet TOML file")
    prov.add_argument("--out", type=Path, required=True)
    prov.add_argument("--revoke", action="append", default=[], metavar="ID",
                      help="remove a device's or station's credential (repeatable)")
    prov.add_argument("--kick", action="append", default=[], metavar="ID",
                      help="after the brokers reloaded the CRL, end a revoked participant's "
                      "live connections (repeatable)")
    prov.add_argument("--prefix", type=Path, default=None,
                      help="where the files will live on the hosts (default: --out)")
    prov.add_argument("--force", action="store_true", help="start over: a new CA and credentials")
    prov.set_defaults(run=_provision)


def _add_broker(sub) -> None:
    """``safl broker``: the embedded broker."""
    broker = sub.add_parser("broker", help="the embedded amqtt broker on loopback (development)")
    broker.add_argument("--host", default="127.0.0.1")
    broker.add_argument("--port", type=int, default=1883)
    broker.set_defaults(run=_broker)


def _add_models(sub) -> None:
    """``safl models``: export and list the zoo's models."""
    models = sub.add_parser("models", help="the model zoo").add_subparsers(dest="models_command",
                                                                          required=True)
    export = models.add_parser("export", help="write ONNX Runtime training artifacts, an "
                               "inference model and a manifest (needs torch and onnx)")
    export.add_argument("name", nargs="?", default=None,
                        help="zoo model: mlp, small_cnn, femnist_cnn, camera_cnn")
    export.add_argument("--from-module", default=None, metavar="PACKAGE.MODULE:FACTORY",
                        help="your torch model: factory(input_shape, num_classes) -> nn.Module")
    export.add_argument("--from-onnx", default=None, metavar="FILE",
                        help="your ONNX classifier (first output: logits); ORT devices only")
    export.add_argument("--out", type=Path, required=True, help="artifacts folder")
    export.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    export.add_argument("--classes", type=int, default=10)
    export.add_argument("--input-shape", default=None,
                        help="comma-separated sample shape, e.g. 3,64,64 (default per model)")
    export.add_argument("--force", action="store_true", help="overwrite a non-empty folder")
    export.set_defaults(run=_export)
    body = models.add_parser("export-body", help="write a frozen pretrained body as an ONNX "
                             "inference graph and its manifest (docs/bodies.md)")
    body.add_argument("name", help="efficientnet-lite0, package.module:factory, or FILE.onnx")
    body.add_argument("--out", type=Path, required=True, help="the body's folder")
    body.add_argument("--input-shape", default="3,64,64", help="the frames it takes, C,H,W")
    body.set_defaults(run=_export_body)
    listing = models.add_parser("list", help="the zoo's models and their default input shapes")
    listing.set_defaults(run=_models_list)


def _setup_logging(args: argparse.Namespace) -> None:
    setup_logging(args, service=args.command in SERVICES)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging(args)
    return run_guarded(args.run, args, "safl")


if __name__ == "__main__":
    sys.exit(main())
