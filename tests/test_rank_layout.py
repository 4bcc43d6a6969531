"""The one rank layout ([Note: rank order] in lightning_haiscale/rank_layout.py): its arithmetic against a
brute-force enumeration of every rank's coordinates, its errors, and the groups it builds on 4 gloo ranks
against the ones the pipelines and hybrid sharding had before (make_subgroups', the mesh's)."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

from lightning_haiscale.rank_layout import RankLayout
from tests.distributed import run_distributed

LAYOUTS = [(1, 1, 1), (4, 1, 1), (4, 2, 1), (4, 4, 1), (4, 1, 2), (4, 2, 2), (8, 2, 2), (12, 3, 2), (16, 2, 4)]


def _coordinates(layout: RankLayout) -> dict[int, tuple[int, int, int]]:
    """rank -> (replicate, shard, stage), enumerated with the pipeline dimension innermost."""
    grid = itertools.product(range(layout.replicate_size), range(layout.shard_size), range(layout.pp_size))
    return dict(enumerate(grid))


@pytest.mark.parametrize(("world", "pp", "replicate"), LAYOUTS)
def test_groups_partition_the_world_by_their_coordinates(world: int, pp: int, replicate: int) -> None:
    layout = RankLayout(world, pp_size=pp, replicate_size=replicate)
    where = _coordinates(layout)
    assert layout.dp_size * pp == world and layout.shard_size * replicate * pp == world
    for name, same in (
        ("pipelines", lambda c: (c[0], c[1])),  # one pipeline: same replicate and shard coordinates
        ("data_parallel_groups", lambda c: c[2]),  # one stage
        ("shard_groups", lambda c: (c[0], c[2])),
        ("replicate_groups", lambda c: (c[1], c[2])),
    ):
        groups = getattr(layout, name)()
        assert sorted(r for g in groups for r in g) == list(range(world)), name
        for group in groups:
            assert len({same(where[r]) for r in group}) == 1, (name, group)
            assert group == sorted(group), (name, group)
    for rank, (r, k, s) in where.items():
        assert layout.stage(rank) == s
        assert layout.dp_rank(rank) == r * layout.shard_size + k


def test_pipelines_are_consecutive_ranks_and_hosts_hold_whole_replicas() -> None:
    layout = RankLayout(8, pp_size=2, replicate_size=2)  # 2 hosts of 4 ranks: 2 pipelines of 2 stages each
    assert layout.pipelines() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.data_parallel_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.shard_groups() == [[0, 2], [4, 6], [1, 3], [5, 7]]  # within a host
    assert layout.replicate_groups() == [[0, 4], [2, 6], [1, 5], [3, 7]]  # across the hosts


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 4, "pp_size": 3}, "pp_size=3 must divide the world size 4"),
        ({"world_size": 8, "pp_size": 2, "replicate_size": 3}, "replicate_size=3 must divide the data-parallel size 4"),
        ({"world_size": 4, "pp_size": 0}, "pp_size=0 must be a positive int"),
        ({"world_size": 4, "replicate_size": True}, "replicate_size=True must be a positive int"),
        ({"world_size": 4.0}, "world_size=4.0 must be a positive int"),
    ],
)
def test_a_layout_that_does_not_fit_names_the_argument(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RankLayout(**kwargs)


def test_a_rank_outside_the_world_is_named() -> None:
    with pytest.raises(ValueError, match="rank=4 is outside the layout's world of 4 ranks"):
        RankLayout(4, pp_size=2).stage(4)


def _groups_on_ranks(rank: int, world: int) -> dict:
    from lightning_haiscale.fsdp.mesh import hybrid_groups
    from lightning_haiscale.pipeline import make_subgroups

    groups = RankLayout(world, pp_size=2, replicate_size=2).groups()
    dp_group, pp_group = make_subgroups(pp_size=2)
    shard, replicate = hybrid_groups((2, 2))
    try:
        RankLayout(8).groups()
        mismatch = ""
    except ValueError as error:
        mismatch = str(error)
    return {
        name: dist.get_process_group_ranks(group)
        for name, group in [
            *groups._asdict().items(),
            ("make_subgroups_dp", dp_group),
            ("make_subgroups_pp", pp_group),
            ("mesh_shard", shard),
            ("mesh_replicate", replicate),
        ]
    } | {"mismatch": mismatch}


def _mine(rank: int, groups: list[list[int]]) -> list[int]:
    return next(g for g in groups if rank in g)


def test_the_groups_are_this_ranks_and_match_the_pipelines_and_the_mesh() -> None:
    results = run_distributed(_groups_on_ranks, 4)
    layout = RankLayout(4, pp_size=2, replicate_size=2)
    for rank, got in enumerate(results):
        assert got["pipeline"] == got["make_subgroups_pp"] == _mine(rank, layout.pipelines())
        assert got["data_parallel"] == got["make_subgroups_dp"] == _mine(rank, layout.data_parallel_groups())
        assert got["shard"] == _mine(rank, layout.shard_groups())
        assert got["replicate"] == _mine(rank, layout.replicate_groups())
        assert (
            got["mesh_shard"]
            == _mine(rank, RankLayout(4, replicate_size=2).shard_groups())
            == [rank // 2 * 2, rank // 2 * 2 + 1]
        )
        assert got["mesh_replicate"] == _mine(rank, RankLayout(4, replicate_size=2).replicate_groups())
        assert "RankLayout(world_size=8) but torch.distributed's world has 4 ranks" in got["mismatch"]
