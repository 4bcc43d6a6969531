"""Strategy benchmarks, each against its peer in the same run: ``python benchmarks/strategies.py ddp``.

Each technique lives in its own module (``benchmarks/strategy_<name>.py``) with a ``main(argv)``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

TECHNIQUES = ("ddp", "fsdp", "pipeline")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in TECHNIQUES:
        print(f"usage: python benchmarks/strategies.py {{{','.join(TECHNIQUES)}}} [options]", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    module = importlib.import_module(f"benchmarks.strategy_{argv[0]}")
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
