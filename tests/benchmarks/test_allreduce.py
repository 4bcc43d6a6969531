"""``benchmarks/allreduce.py``'s DeepSpeed column is skipped, with a note, where deepspeed cannot run."""

from __future__ import annotations

import sys

from benchmarks.allreduce import deepspeed_all_reduce
from tests.distributed import run_distributed


def _without_deepspeed(rank: int, world: int) -> tuple[bool, str]:
    sys.modules["deepspeed"] = None  # type: ignore[assignment]  # `import deepspeed` raises ImportError
    op, note = deepspeed_all_reduce(world)
    return op is None, note


def test_deepspeed_column_is_skipped_with_a_note_when_deepspeed_is_missing() -> None:
    for skipped, note in run_distributed(_without_deepspeed, 2):
        assert skipped
        assert note.startswith("DeepSpeed column skipped: ModuleNotFoundError")

