"""The ``safl`` command: one subcommand per role and task, imported lazily.

Each handler imports its module only when chosen, so a device command never
loads the aggregator or torch.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from .errors import SaflError

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from aggregator.demo import run_demo

    run_demo(rounds=args.rounds, out=args.out, seed=args.seed)
    return 0


def _export(args: argparse.Namespace) -> int:
    from models.export import export_model

    shape = tuple(int(d) for d in args.input_shape.split(",")) if args.input_shape else None
    manifest = export_model(args.name, args.out, optimizer=args.optimizer,
                            num_classes=args.classes, input_shape=shape, force=args.force)
    print(f"exported {manifest.model}: {manifest.num_params} parameters, input "
          f"{manifest.input_shape}, layout {manifest.layout_hash} -> {args.out}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="safl", description="safl-edge: SAFL and FedGS "
                                     "federated learning for edge fleets")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="SAFL+FedGS vs FedAvg on an in-process fleet")
    demo.add_argument("--rounds", type=int, default=100, help="external syncs (default 100)")
    demo.add_argument("--out", type=Path, default=None, help="output folder "
                      "(default runs/<timestamp>)")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)

    models = sub.add_parser("models", help="the model zoo").add_subparsers(dest="models_command",
                                                                          required=True)
    export = models.add_parser("export", help="write ONNX Runtime training artifacts, an "
                               "inference model and a manifest (needs torch and onnx)")
    export.add_argument("name", help="zoo model: mlp, small_cnn, femnist_cnn, camera_cnn")
    export.add_argument("--out", type=Path, required=True, help="artifacts folder")
    export.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    export.add_argument("--classes", type=int, default=10)
    export.add_argument("--input-shape", default=None,
                        help="comma-separated sample shape, e.g. 3,64,64 (default per model)")
    export.add_argument("--force", action="store_true", help="overwrite a non-empty folder")
    export.set_defaults(run=_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except SaflError as exc:
        print(f"safl: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
