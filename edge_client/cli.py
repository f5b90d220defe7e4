"""The device's own entry point, and what every ``safl`` command shares with it.

``safl-device --config device.toml`` (or ``python -m edge_client``) runs one device
service and nothing else; ``safl-device export --config device.toml --out model.onnx`` writes
the model that device deploys as plain ONNX for the line's own application;
``safl-device backends`` lists the training backends this install can run, and why not the
others.  It loads
numpy, the chosen trainer and paho, never the aggregator
or torch unless the device's model needs torch.  The ``safl`` command (``safl.cli``, the
composition root) builds its ``device`` subcommand from the same functions, and its logging,
version and error handling too, so both entry points behave alike.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import SaflError

if TYPE_CHECKING:
    from .config import ModelConfig
    from .trainers import Trainer

__all__ = ["main", "version", "add_common_arguments", "add_role_arguments",
           "add_device_arguments", "overrides", "run_device", "run_export", "run_backends",
           "setup_logging", "run_guarded"]


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("safl-edge")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log shippers."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {"time": self.formatTime(record), "level": record.levelname,
               "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def add_common_arguments(parser: argparse.ArgumentParser, prog: str) -> None:
    parser.add_argument("--version", action="version", version=f"{prog} {version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                        default=None, help="log level (default: info for the device, station, "
                        "cloud and broker services, warning otherwise; -v means info)")
    parser.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="text lines, or one JSON object per line")


def setup_logging(args: argparse.Namespace, service: bool) -> None:
    # Services say what they do (a device logs each round); one-shot commands stay quiet.
    level = args.log_level.upper() if args.log_level else (
        "INFO" if args.verbose or service else "WARNING")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if args.log_format == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])


def add_role_arguments(p: argparse.ArgumentParser, role: str) -> None:
    """The flags every role service takes."""
    p.add_argument("--config", type=Path, required=True, help=f"the {role}'s TOML file")
    p.add_argument("--broker", default=None, help="mqtt://host:port (overrides [broker] url)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (overrides [service])")


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    add_role_arguments(p, "device")
    p.add_argument("--device-id", default=None)
    p.add_argument("--station", default=None)
    p.add_argument("--keep-running", action="store_true",
                   help="stay connected after the federation's final model, predicting with "
                        "it (the board's unit passes it)")
    p.add_argument("--state-dir", default=None,
                   help="where the device keeps its model in use (overrides [service])")


def overrides(args: argparse.Namespace, **tables: dict[str, str]) -> dict[str, dict[str, Any]]:
    """CLI flags that override keys of a role's TOML tables (None means not given)."""
    return {table: {key: getattr(args, attr) for attr, key in keys.items()}
            for table, keys in tables.items()}


def run_device(args: argparse.Namespace) -> int:
    from .service import DEVICE_TABLES, DeviceService, load_role_file

    cfg = load_role_file(args.config, DEVICE_TABLES,
                         overrides(args, broker={"broker": "url"},
                                   service={"metrics_port": "metrics_port",
                                            "state_dir": "state_dir"},
                                   device={"device_id": "device_id", "station": "station"}))
    DeviceService(**cfg).run(exit_when_done=not args.keep_running)
    return 0


def _kept_model(args: argparse.Namespace) -> tuple[str, Trainer, ModelConfig]:
    """A device file's state directory, its model's trainer, and its ``[model]`` table."""
    from .service import DEVICE_TABLES, load_role_file, model_trainer

    cfg = load_role_file(args.config, DEVICE_TABLES,
                         overrides(args, service={"state_dir": "state_dir"}))
    state_dir = cfg["service"].state_dir
    if not state_dir:
        from .errors import ConfigError
        raise ConfigError("state_dir", "the device keeps its deployable model in [service] "
                          "state_dir: set it (or pass --state-dir)")
    return state_dir, model_trainer(cfg["model"], cfg["device"].lr), cfg["model"]


def run_export(args: argparse.Namespace) -> int:
    """Export the deployable model a device keeps in its ``[service] state_dir``."""
    from .body import body_manifest
    from .service import federation_layout
    from .serving import load_deployable
    from .trainers.onnx_export import export_onnx

    state_dir, trainer, model = _kept_model(args)
    saved = load_deployable(state_dir, layout_hash=federation_layout(model, trainer))
    out = export_onnx(trainer, saved.weights, args.out, input_shape=tuple(model.input_shape),
                      num_classes=model.num_classes, model_round=saved.round,
                      model_name=model.spec, body=body_manifest(model))
    print(f"wrote {out}: {model.spec}, round {saved.round}, input {tuple(model.input_shape)}, "
          f"{model.num_classes} classes")
    return 0


def run_rollback(args: argparse.Namespace) -> int:
    """Put the model a device used before its latest promotion back into use."""
    from .service import federation_layout
    from .serving import roll_back

    state_dir, trainer, model = _kept_model(args)
    now, aside = roll_back(state_dir, layout_hash=federation_layout(model, trainer))
    print(f"{state_dir}: the model of round {now.round} (iteration {now.iteration}) is in "
          f"use again; round {aside.round}'s is set aside (a second rollback restores it). "
          "Start the device for it to take effect.")
    return 0


def run_backends(args: argparse.Namespace) -> int:
    """Print which backends can train here (each probed for real) and why not the others."""
    import platform

    from .trainers.availability import probe_all

    found = probe_all()
    if args.json:
        print(json.dumps([b.as_dict() for b in found], indent=1))
        return 0
    print(f"safl-edge {version()} on {platform.system()} {platform.machine()}, "
          f"Python {platform.python_version()}")
    for b in found:
        state = "yes" if b.usable else "no"
        step = f"{b.step_ms:.1f} ms/step" if b.step_ms is not None else ""
        print(f"  {b.name:<6} {state:<4} {b.version:<14} {', '.join(b.devices):<24} {step}")
        print(f"         {b.why}")
    return 0


def run_guarded(run: Callable[[argparse.Namespace], int], args: argparse.Namespace,
                prog: str) -> int:
    """Run a command; a safl error is one line and its exit code, never a traceback."""
    try:
        return run(args)
    except SaflError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; stopped what was started", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="safl-device", description="run one safl-edge "
                                     "device: SAFL on its sensor stream")
    add_common_arguments(parser, "safl-device")
    add_device_arguments(parser)
    return parser


def _kept_model_parser(command: str, description: str) -> argparse.ArgumentParser:
    """A command on the model a device keeps: its TOML file, and where it keeps it."""
    parser = argparse.ArgumentParser(prog=f"safl-device {command}", description=description)
    add_common_arguments(parser, "safl-device")
    parser.add_argument("--config", type=Path, required=True, help="the device's TOML file")
    parser.add_argument("--state-dir", default=None,
                        help="where the device keeps its model (overrides [service])")
    return parser


def _export_parser() -> argparse.ArgumentParser:
    parser = _kept_model_parser("export", "write the device's deployable model as ONNX (its "
                                "input shape, class count and round in the metadata)")
    parser.add_argument("--out", type=Path, required=True, help="the .onnx file to write")
    return parser


def _rollback_parser() -> argparse.ArgumentParser:
    return _kept_model_parser("rollback", "put the model the device predicted with before "
                              "its latest promotion back into use (stop the device first)")


def _backends_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="safl-device backends", description="which "
                                     "training backends this install can run (each takes one "
                                     "real step), and why not the others")
    add_common_arguments(parser, "safl-device")
    parser.add_argument("--json", action="store_true", help="one JSON object per backend")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["backends"]:
        args = _backends_parser().parse_args(argv[1:])
        setup_logging(args, service=False)
        return run_guarded(run_backends, args, "safl-device backends")
    if argv[:1] == ["rollback"]:
        args = _rollback_parser().parse_args(argv[1:])
        setup_logging(args, service=False)
        return run_guarded(run_rollback, args, "safl-device rollback")
    if argv[:1] == ["export"]:
        args = _export_parser().parse_args(argv[1:])
        setup_logging(args, service=False)
        return run_guarded(run_export, args, "safl-device export")
    args = _parser().parse_args(argv)
    setup_logging(args, service=True)
    return run_guarded(run_device, args, "safl-device")


if __name__ == "__main__":
    sys.exit(main())
