"""Strategy names registered once in Lightning's registries (the Trainer's and Fabric's), however often the package
is imported or reloaded."""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies.registry import _StrategyRegistry

__all__ = ["register_once"]


def register_once(strategy: type[Any], registry: _StrategyRegistry) -> None:
    """Registers ``strategy.register_strategies``'s names in ``registry`` (Trainer's or Fabric's), skipping those
    already there, so importing or reloading the package twice registers nothing twice (Lightning's registry
    raises on a second registration)."""
    fresh = _StrategyRegistry()
    strategy.register_strategies(fresh)
    for name, entry in fresh.items():
        if name not in registry:
            registry.register(name, entry["strategy"], entry["description"], **entry["init_params"])
