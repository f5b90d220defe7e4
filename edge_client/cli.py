"""The ``safl`` command: one subcommand per role and task, imported lazily.

Each handler imports its module only when chosen, so a device command never
loads the aggregator or torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from .errors import ConfigError, SaflError

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from aggregator.demo import run_demo

    if args.fleet_out:
        from aggregator.demo import write_demo_fleet
        write_demo_fleet(args.fleet_out, broker=args.broker or "mqtt://127.0.0.1:1883",
                         rounds=args.rounds or 20, seed=args.seed)
        print(f"wrote a fleet to {args.fleet_out.resolve()}: start it with the commands in "
              f"{args.fleet_out.resolve() / 'README.md'}")
        return 0
    bus = args.bus or "mqtt"
    if args.broker and bus == "local":
        raise ConfigError("broker", "--broker runs the fleet over MQTT; drop --bus local")
    # SIGTERM unwinds like Ctrl-C, so the demo stops its role processes and its broker.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    run_demo(rounds=args.rounds, out=args.out, seed=args.seed, bus=bus, broker=args.broker)
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


def _broker(args: argparse.Namespace) -> int:
    from aggregator.broker import run_broker

    return run_broker(args.host, args.port)


def _overrides(args: argparse.Namespace, **tables: dict[str, str]) -> dict[str, dict]:
    """CLI flags that override keys of a role's TOML tables (None means not given)."""
    return {table: {key: getattr(args, attr) for attr, key in keys.items()}
            for table, keys in tables.items()}


def _device(args: argparse.Namespace) -> int:
    from .config import BrokerConfig, DeviceConfig, ModelConfig, ServiceConfig, SourceConfig
    from .service import DeviceService, load_role_file

    cfg = load_role_file(args.config, {"device": DeviceConfig, "model": ModelConfig,
                                       "source": SourceConfig, "broker": BrokerConfig,
                                       "service": ServiceConfig},
                         _overrides(args, broker={"broker": "url"},
                                    service={"metrics_port": "metrics_port"},
                                    device={"device_id": "device_id", "station": "station"}))
    DeviceService(**cfg).run(exit_when_done=not args.keep_running)
    return 0


def _station(args: argparse.Namespace) -> int:
    from aggregator.config import StationConfig
    from aggregator.services import StationService

    from .config import BrokerConfig, ModelConfig, ServiceConfig
    from .service import load_role_file

    cfg = load_role_file(args.config, {"station": StationConfig, "model": ModelConfig,
                                       "broker": BrokerConfig, "service": ServiceConfig},
                         _overrides(args, broker={"broker": "url"},
                                    service={"metrics_port": "metrics_port",
                                             "state_dir": "state_dir"}))
    StationService(**cfg).run()
    return 0


def _cloud(args: argparse.Namespace) -> int:
    from aggregator.config import CloudConfig
    from aggregator.services import CloudService

    from .config import BrokerConfig, ModelConfig, ServiceConfig
    from .service import load_role_file

    cfg = load_role_file(args.config, {"cloud": CloudConfig, "model": ModelConfig,
                                       "broker": BrokerConfig, "service": ServiceConfig},
                         _overrides(args, broker={"broker": "url"}, cloud={"rounds": "rounds"},
                                    service={"metrics_port": "metrics_port",
                                             "state_dir": "state_dir"}))
    CloudService(**cfg, eval_path=args.eval or "", out=str(args.out or "")).run()
    return 0


def _status(args: argparse.Namespace) -> int:
    from aggregator.status import fleet_status, format_status

    from .config import BrokerConfig, load_config

    broker = load_config(BrokerConfig, "broker", args.config, {"url": args.broker})
    print(format_status(fleet_status(broker, args.fleet, args.wait), args.fleet))
    return 0


def _experiment(args: argparse.Namespace) -> int:
    from aggregator.claims import assess_claims, markdown_section
    from aggregator.experiment import load_experiment, result_rows, run_experiment

    sections = []
    for config in args.configs:
        out = args.out / config.stem if args.out and len(args.configs) > 1 else args.out
        attacks = load_experiment(config, args.full).attacks
        for attack in attacks:
            folder_out = out / attack if out and len(attacks) > 1 else out
            cfg, results, folder = run_experiment(config, out=folder_out, jobs=args.jobs,
                                                  full=args.full, attack=attack,
                                                  fresh=args.fresh,
                                                  finished_only=args.finished_only)
            rows = result_rows(results, cfg.target_accuracy)
            claims = assess_claims(results, cfg.target_accuracy) if attack == "none" else []
            for c in claims:
                print(f"{c.verdict:>15}: {c.claim} ({c.evidence})")
            command = f"safl experiment {config}" + (" --full" if args.full else "") + (
                f" --jobs {args.jobs}" if args.jobs > 1 else "")
            settings = {k: v for k, v in vars(cfg).items()
                        if k not in ("name", "strategies", "attacks")}
            title = cfg.name + ("" if attack == "none" else f": attack '{attack}'")
            sections.append(markdown_section(title, command, settings, rows, claims))
            print(f"wrote {folder}/results.csv, metrics.csv, accuracy.png, "
                  "accuracy_vs_bytes.png")
    if args.report:
        args.report.write_text(REPORT_HEAD + "\n".join(sections))
        print(f"wrote {args.report}")
    return 0


REPORT_HEAD = """# Results: which paper claims reproduce

Generated by `safl experiment ... --report docs/results.md`; do not edit by hand. Seed k of
every strategy in a section ran on the same partitions, initial weights and device seeds,
through the same roles (`aggregator/strategies.py` lists the recipes).

How to read the tables: `accuracy` is each run's mean over its last 3 evaluations on the
test set, then the mean and sample sd (`accuracy_sd`) over seeds. `samples_to_X` is the
samples trained when the accuracy reached X and held it at every later evaluation (mean over
seeds; `never (k/n)` when k seeds never held it). `local_q1` is the mean device-local
accuracy (each device's deployable model on its own held-out stream) over the first quarter
of the samples, `worst10_q1` the same over the worst 10% of devices, `local_end` at the end.
A verdict compares the paired per-seed effect with its spread (sd over seeds): *reproduced*
(larger than its spread, and not reliably below the claimed size), *not reproduced* (effect
plus spread below the claim), *inconclusive* (within the spread, or one seed). The scaling
from the papers' settings is in `docs/experiments.md`.

"""


def _sweep(args: argparse.Namespace) -> int:
    from aggregator.sweep import run_sweep

    run_sweep(args.config, out=args.out, jobs=args.jobs)
    return 0


def _provision(args: argparse.Namespace) -> int:
    from aggregator.provision import provision

    created = provision(args.fleet, args.out, force=args.force, revoke=tuple(args.revoke),
                        prefix=args.prefix)
    print(f"provisioned {args.out}: CA {'created' if created['ca'] else 'kept'}, "
          f"{len(created['credentials'])} new credentials"
          + (f", revoked {', '.join(created['revoked'])}" if created["revoked"] else ""))
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("safl-edge")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


class _JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {"time": self.formatTime(record), "level": record.levelname,
               "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def _setup_logging(args: argparse.Namespace) -> None:
    # Services say what they do (a device logs each round); one-shot commands stay quiet.
    service = args.command in ("device", "station", "cloud", "broker")
    level = args.log_level.upper() if args.log_level else (
        "INFO" if args.verbose or service else "WARNING")
    handler = logging.StreamHandler()
    handler.setFormatter(_JsonFormatter() if args.log_format == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])


def _models_list(args: argparse.Namespace) -> int:
    try:
        from .trainers.zoo import DEFAULT_INPUT, MODELS
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
    parser.add_argument("--version", action="version", version=f"safl {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                        default=None, help="log level (default: info for the device, station, "
                        "cloud and broker services, warning otherwise; -v means info)")
    parser.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="text lines, or one JSON object per line")
    sub = parser.add_subparsers(dest="command", required=True)
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
    demo.add_argument("--fleet-out", type=Path, default=None, metavar="DIR",
                      help="write the SAFL+FedGS fleet's files (absolute paths, README with "
                      "the commands) to DIR and start nothing")
    demo.set_defaults(run=_demo)

    for name, run, text in (("device", _device, "run a device (SAFL on its sensor stream)"),
                            ("station", _station, "run a base station (FedGS super nodes)"),
                            ("cloud", _cloud, "run the cloud aggregator")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", type=Path, required=True, help=f"the {name}'s TOML file")
        p.add_argument("--broker", default=None, help="mqtt://host:port (overrides [broker] url)")
        p.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus metrics on this port (overrides [service])")
        p.set_defaults(run=run)
        if name == "device":
            p.add_argument("--device-id", default=None)
            p.add_argument("--station", default=None)
            p.add_argument("--keep-running", action="store_true",
                           help="stay connected after the federation's final model")
        if name in ("station", "cloud"):
            p.add_argument("--state-dir", default=None, help="checkpoint every round here and "
                           "resume from it on start (overrides [service] state_dir)")
        if name == "cloud":
            p.add_argument("--rounds", type=int, default=None)
            p.add_argument("--eval", default=None, help=".npz test set (x, y) to score rounds")
            p.add_argument("--out", type=Path, default=None, help="where metrics.csv goes")
    status = sub.add_parser("status", help="print the fleet: stations, devices online, round")
    status.add_argument("--broker", default=None, help="mqtt://host:port")
    status.add_argument("--config", type=Path, default=None, help="a TOML file with [broker]")
    status.add_argument("--fleet", default="default")
    status.add_argument("--wait", type=float, default=1.5, help="seconds to collect retained state")
    status.set_defaults(run=_status)

    exp = sub.add_parser("experiment", help="strategies side by side on one fleet (in process)")
    exp.add_argument("configs", type=Path, nargs="+", help="experiment TOML files "
                     "(experiments/*.toml)")
    exp.add_argument("--out", type=Path, default=None, help="output folder (default runs/<name>)")
    exp.add_argument("--jobs", type=int, default=1, help="strategies run in parallel")
    exp.add_argument("--full", action="store_true",
                     help="the papers' unscaled settings (SPEC §5; hours on 2 cores)")
    exp.add_argument("--report", type=Path, default=None,
                     help="write a results.md with tables and claim verdicts")
    exp.add_argument("--fresh", action="store_true",
                     help="rerun every strategy instead of reusing finished runs in --out")
    exp.add_argument("--finished-only", action="store_true",
                     help="report the runs already finished in --out, run nothing")
    exp.set_defaults(run=_experiment)

    sweep = sub.add_parser("sweep", help="an experiment's strategies over the grid in its "
                           "[sweep] table, to choose defaults")
    sweep.add_argument("config", type=Path)
    sweep.add_argument("--out", type=Path, default=None, help="default runs/<name>-sweep")
    sweep.add_argument("--jobs", type=int, default=1, help="runs in parallel")
    sweep.set_defaults(run=_sweep)

    prov = sub.add_parser("provision", help="CA, credentials, broker configs and role configs "
                          "for a fleet file")
    prov.add_argument("fleet", type=Path, help="the fleet TOML file")
    prov.add_argument("--out", type=Path, required=True)
    prov.add_argument("--revoke", action="append", default=[], metavar="ID",
                      help="remove a device's or station's credential (repeatable)")
    prov.add_argument("--prefix", type=Path, default=None,
                      help="where the files will live on the hosts (default: --out)")
    prov.add_argument("--force", action="store_true", help="start over: a new CA and credentials")
    prov.set_defaults(run=_provision)

    broker = sub.add_parser("broker", help="the embedded amqtt broker on loopback (development)")
    broker.add_argument("--host", default="127.0.0.1")
    broker.add_argument("--port", type=int, default=1883)
    broker.set_defaults(run=_broker)

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
    listing = models.add_parser("list", help="the zoo's models and their default input shapes")
    listing.set_defaults(run=_models_list)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging(args)
    try:
        return args.run(args)
    except SaflError as exc:
        print(f"safl: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("safl: interrupted; stopped what was started", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
