"""`python -m launch.info --config NAME [--set key=value ...]`: parameter counts and NSA cost."""

from __future__ import annotations

import argparse
import sys

from nsa_jax.config import ConfigError, load_config
from nsa_jax.info import describe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.info", description=__doc__)
    parser.add_argument("--config", default="a100_pcie", help="config name in configs/ or a YAML path")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(describe(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
