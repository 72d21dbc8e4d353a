"""The ``gradcomp`` command. For now: ``gradcomp demo``, and help listing what is registered."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from lightning_gradcomp.compressors import COMPRESSORS
from lightning_gradcomp.compressors.topk import validate_density
from lightning_gradcomp.strategy import NAMED_STRATEGIES


def _parser() -> argparse.ArgumentParser:
    strategies = "\n".join(f"  {name:<22} {desc}" for name, (desc, _) in NAMED_STRATEGIES.items())
    parser = argparse.ArgumentParser(
        prog="gradcomp",
        description="Compressed gradient exchange for PyTorch Lightning DDP.",
        epilog=f"registered strategies:\n{strategies}\ncompressors: {', '.join(sorted(COMPRESSORS))}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command")
    demo = commands.add_parser("demo", help="train a small MLP on CPU processes and show the bytes saved")
    demo.add_argument("--devices", type=int, default=2, help="CPU processes (default: 2)")
    demo.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    demo.add_argument("--compressor", choices=sorted(COMPRESSORS), default="topk")
    demo.add_argument("--density", type=float, default=0.01, help="Top-k density in (0, 1] (default: 0.01)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradcomp`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.devices < 1 or args.steps < 1:
            parser.error(f"--devices and --steps must be >= 1, got {args.devices} and {args.steps}")
        try:
            validate_density(args.density)
        except ValueError as err:
            parser.error(f"--density: {err}")
        from lightning_gradcomp.examples.demo import run_demo

        run_demo(devices=args.devices, steps=args.steps, compressor=args.compressor, density=args.density)
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
