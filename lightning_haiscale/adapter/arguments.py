"""Construction-time checks of strategy and callback arguments: a bad value fails when the object is built,
with a message naming the argument and the fix, not later inside ``fit`` with a raw error from deep code."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import Strategy

__all__ = ["check_bool", "check_choice", "check_int", "check_number", "check_timeout", "strategy_repr"]


def _kind(value: Any) -> str:
    return type(value).__name__


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} ({_kind(value)}) must be True or False")
    return value


def check_int(name: str, value: Any, minimum: int, fix: str = "") -> int:
    """An ``int`` (not a bool, not a float such as 2.5) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} ({_kind(value)}) must be an integer; {fix or f'e.g. {name}={minimum}'}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be at least {minimum}{'; ' + fix if fix else ''}")
    return value


def check_number(name: str, value: Any, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}={value!r} ({_kind(value)}) must be a number")
    if positive and not value > 0:
        raise ValueError(f"{name}={value} must be positive")
    return value


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> Any:
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {', '.join(repr(c) for c in choices)}")
    return value


def check_timeout(value: Any) -> timedelta | None:
    """``timeout``: a positive ``datetime.timedelta`` (or ``None`` for the default)."""
    if value is None:
        return None
    if not isinstance(value, timedelta):
        raise TypeError(f"timeout={value!r} ({_kind(value)}) must be a datetime.timedelta, e.g. timedelta(minutes=30)")
    if value <= timedelta(0):
        raise ValueError(f"timeout={value} must be positive")
    return value


def strategy_repr(strategy: Any, peer: str) -> str:
    """A strategy's ``repr`` that names its class and the class of the other Lightning layer (``peer``).

    The Trainer and Fabric have one strategy class each per technique, under the same name. Given the other
    layer's instance, Lightning refuses it with "invalid strategy name: `strategy=<repr>`": this ``repr`` makes
    that message name the class to use instead.
    """
    cls = type(strategy)
    layer, other = ("the Trainer", "Fabric") if isinstance(strategy, Strategy) else ("Fabric", "the Trainer")
    return f"<{cls.__module__}.{cls.__qualname__}: a strategy for {layer}; {other} takes {peer}>"
