"""``hfreduce.kept_collectives``: torch's results, each work kept (see [Note: the last reference to a gloo work] in
lightning_haiscale/hfreduce/at_exit.py), over the world and over a subgroup whose first rank is not global rank 0."""

from __future__ import annotations

from typing import Any

from lightning_haiscale.testing.distributed import run_distributed


def _against_torch(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from lightning_haiscale.hfreduce import at_exit, kept_collectives

    sub = dist.new_group([1, 2])
    result: dict[str, Any] = {"kept": {}}

    def kept(name: str, call: Any) -> Any:
        before = list(at_exit._RETAINED)
        out = call()
        result["kept"][name] = len([w for w in at_exit._RETAINED if not any(w is b for b in before)])
        return out

    mine = {"rank": rank, "weights": torch.arange(rank + 1.0), "text": "x" * (100 * rank)}  # sizes differ
    theirs: list[Any] = [None] * world
    dist.all_gather_object(theirs, mine)
    gathered = kept("all_gather_object", lambda: kept_collectives.all_gather_object(mine))
    result["all_gather_object"] = [
        (a["rank"], a["weights"].tolist(), a["text"]) == (b["rank"], b["weights"].tolist(), b["text"])
        for a, b in zip(gathered, theirs, strict=True)
    ]
    if rank in (1, 2):
        box = [mine]
        dist.broadcast_object_list(box, src=2, group=sub)
        got = kept("broadcast_object", lambda: kept_collectives.broadcast_object(mine, 2, sub))
        result["broadcast_object"] = (got["rank"], got["text"] == box[0]["text"], got is mine)
        tensor = torch.full((3,), float(rank))
        kept("broadcast", lambda: kept_collectives.broadcast(tensor, 1, sub))
        result["broadcast"] = tensor.tolist()
        outputs = [torch.empty(2) for _ in range(2)]
        kept("all_gather", lambda: kept_collectives.all_gather(outputs, torch.full((2,), rank + 0.5), sub))
        result["all_gather"] = [o.tolist() for o in outputs]
    total = torch.tensor([rank + 1.0])
    kept("all_reduce", lambda: kept_collectives.all_reduce(total, dist.ReduceOp.MAX))
    result["all_reduce"] = total.item()
    kept("barrier", kept_collectives.barrier)
    return result


def test_kept_collectives_give_torchs_results_and_keep_each_work() -> None:
    for rank, result in enumerate(run_distributed(_against_torch, 3)):
        assert result["all_gather_object"] == [True, True, True]
        assert result["all_reduce"] == 3.0
        kept = {"all_gather_object": 2, "all_reduce": 1, "barrier": 1}  # an object collective: sizes, then bytes
        if rank in (1, 2):
            assert result["broadcast_object"] == (2, True, rank == 2)  # src keeps its own object
            assert result["broadcast"] == [1.0, 1.0, 1.0]
            assert result["all_gather"] == [[1.5, 1.5], [2.5, 2.5]]
            kept.update(broadcast_object=2, broadcast=1, all_gather=1)
        assert result["kept"] == kept
