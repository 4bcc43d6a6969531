"""Strategy benchmarks, each against its peer in the same run: ``python -m benchmarks.strategies ddp``.

Each technique lives in its own module (``benchmarks/strategy_<name>.py``) with a ``main(argv)``.
"""

from __future__ import annotations

import importlib
import sys

TECHNIQUES = ("ddp", "fsdp", "hybrid", "pipeline", "pp_fsdp")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in TECHNIQUES:
        print(f"usage: python -m benchmarks.strategies {{{','.join(TECHNIQUES)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.strategy_{argv[0]}")
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
