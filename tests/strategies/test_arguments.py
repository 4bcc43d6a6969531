"""Every strategy's arguments are checked when it is built: the message names the argument and the fix.

Was: ``chunks=2.5`` failed at fit with a raw ``'float' object cannot be interpreted as an integer``,
``pp_size=0`` silently meant "the world", ``auto_wrap_policy=123`` gave ``'int' object is not iterable``,
and options of one schedule given to another were ignored.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from torch import nn

from lightning_haiscale import (
    GPipeStrategy,
    HaiDDPStrategy,
    HaiFSDPStrategy,
    Interleaved1F1BStrategy,
    PipeDreamStrategy,
)

PIPELINES = [GPipeStrategy, PipeDreamStrategy, Interleaved1F1BStrategy]
CASES: list[tuple[type, dict[str, Any], str]] = [
    *(
        (cls, kwargs, match)
        for cls in PIPELINES
        for kwargs, match in [
            ({"chunks": 2.5}, r"chunks=2.5 \(float\) must be an integer; the number of microbatches"),
            ({"chunks": 0}, r"chunks=0 must be at least 1"),
            ({"pp_size": 0}, r"pp_size=0 must be at least 1; .*pp_size=None for one pipeline over the world"),
            ({"pp_size": 1.0}, r"pp_size=1.0 \(float\) must be an integer"),
            ({"balance": "memory"}, r"balance='memory' must be None, 'time' or a list of layer counts"),
            ({"balance": [2, 0]}, r"balance=\[2, 0\] must hold positive integer layer counts"),
            ({"balance": [2, 2, 2], "pp_size": 2}, r"must have pp_size x num_model_chunks = \d layer counts"),
            ({"checkpoint": "sometimes"}, r"checkpoint='sometimes' must be one of 'never', 'always', 'except_last'"),
            ({"module_name": 3}, r"module_name=3 must be the name"),
            ({"example_inputs": [1]}, r"example_inputs=\[1\] must be a tuple"),
            ({"timeout": 60}, r"timeout=60 \(int\) must be a datetime.timedelta"),
            ({"timeout": timedelta(seconds=-1)}, r"must be positive"),
            ({"process_group_backend": 1}, r"process_group_backend=1 must be a name"),
        ]
    ),
    (PipeDreamStrategy, {"num_model_chunks": 2}, r"num_model_chunks=2: .* use Interleaved1F1BStrategy"),
    (GPipeStrategy, {"num_model_chunks": 2}, r"num_model_chunks=2: .* use Interleaved1F1BStrategy"),
    (PipeDreamStrategy, {"checkpoint": "always"}, r"checkpoint='always' is GPipe's .*; use GPipeStrategy"),
    (Interleaved1F1BStrategy, {"num_model_chunks": 0}, r"num_model_chunks=0 must be at least 1"),
    (Interleaved1F1BStrategy, {"chunks": 3, "pp_size": 2}, r"chunks=3 must be a multiple of the number of pipeline"),
    (HaiFSDPStrategy, {"auto_wrap_policy": 123}, r"auto_wrap_policy must be a torch wrap policy .* got 123"),
    (HaiFSDPStrategy, {"auto_wrap_policy": {int}}, r"auto_wrap_policy must be .* a set of nn.Module classes"),
    (HaiFSDPStrategy, {"backward_prefetch": "pre"}, r"backward_prefetch='pre' must be None, BackwardPrefetch"),
    (HaiFSDPStrategy, {"reshard_after_forward": "no"}, r"reshard_after_forward='no' \(str\) must be True or False"),
    (HaiFSDPStrategy, {"state_dict_type": "local"}, r"state_dict_type='local' must be one of 'full', 'sharded'"),
    (HaiFSDPStrategy, {"param_init_fn": 1}, r"param_init_fn=1 must be a function"),
    (HaiFSDPStrategy, {"timeout": 1.5}, r"timeout=1.5 \(float\) must be a datetime.timedelta"),
    (HaiDDPStrategy, {"bucket_cap_mb": -1}, r"bucket_cap_mb=-1 must be positive"),
]


@pytest.mark.parametrize(("cls", "kwargs", "match"), CASES, ids=lambda v: getattr(v, "__name__", None))
def test_bad_argument_is_named_at_construction(cls: type, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match):
        cls(**kwargs)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (GPipeStrategy, {"chunks": 8, "pp_size": 2, "balance": [3, 2], "checkpoint": "except_last"}),
        (PipeDreamStrategy, {"balance": "time", "example_inputs": (1,), "timeout": timedelta(seconds=30)}),
        (Interleaved1F1BStrategy, {"chunks": 4, "pp_size": 2, "balance": [1, 1, 1, 1]}),
        (HaiFSDPStrategy, {"auto_wrap_policy": {nn.Linear}, "state_dict_type": "sharded"}),
    ],
)
def test_good_arguments_are_taken(cls: type, kwargs: dict[str, Any]) -> None:
    cls(**kwargs)
