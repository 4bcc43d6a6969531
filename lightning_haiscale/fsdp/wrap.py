"""Which submodules become sharded units (``auto_wrap_policy``), and which unit owns each parameter.

[Note: ownership of shared parameters]
A parameter reachable from several modules (GPT's token embedding, tied to the LM head) is owned by the
innermost unit that encloses every module holding it: the lowest common ancestor unit. That unit is
unsharded whenever any holder runs, because its forward encloses theirs, and autograd accumulates the
gradients of every use into the one flat gradient before the unit's post-backward hook fires.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

__all__ = [
    "AutoWrapPolicy",
    "ParamRef",
    "assign_params",
    "check_policy",
    "unit_modules",
    "unit_scopes",
    "with_units",
]

AutoWrapPolicy = Callable[..., bool] | Iterable[type[nn.Module]]
"""A torch policy (``size_based_auto_wrap_policy``, ``ModuleWrapPolicy``, a ``transformer_auto_wrap_policy``
partial: called as ``policy(module=, recurse=, nonwrapped_numel=)``) or a set of module classes."""


@dataclass
class ParamRef:
    """One parameter of the original module and every place it is registered.

    Attributes:
        param: the original parameter (possibly on the meta device).
        fqns: its names relative to the root module, in registration order (the wrapper replaces them by
            the root's ``state_dict()`` keys for it, see names [Note: state-dict keys are not parameter names]).
        holders: ``(module, attribute)`` pairs that hold it.
    """

    param: nn.Parameter
    fqns: list[str]
    holders: list[tuple[nn.Module, str]]


def check_policy(policy: AutoWrapPolicy | None) -> None:
    """``TypeError`` naming ``auto_wrap_policy`` unless it is ``None``, a callable policy or module classes."""
    if policy is not None:
        _as_callable(policy)


def _as_callable(policy: AutoWrapPolicy) -> Callable[..., bool]:
    if callable(policy):
        return policy
    classes = tuple(policy) if isinstance(policy, Iterable) and not isinstance(policy, str | bytes) else ()
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(
            "auto_wrap_policy must be a torch wrap policy (size_based_auto_wrap_policy, ModuleWrapPolicy, "
            f"transformer_auto_wrap_policy partial) or a set of nn.Module classes, got {policy!r}"
        )
    return lambda module, recurse, nonwrapped_numel: recurse or isinstance(module, classes)


def with_units(policy: AutoWrapPolicy | None, modules: Iterable[nn.Module]) -> AutoWrapPolicy:
    """``policy``, and ``modules`` each a unit of its own too (a pipeline puts a parameter tied across stages in
    a unit of its own, so that both stages shard it alike)."""
    chosen = {id(m) for m in modules}
    base = _as_callable(policy) if policy is not None else None

    def wrap(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        if recurse:
            return True  # reach every chosen module, wherever it is
        chosen_here = id(module) in chosen
        return chosen_here or (
            base is not None and base(module=module, recurse=False, nonwrapped_numel=nonwrapped_numel)
        )

    return wrap


def unit_modules(root: nn.Module, policy: AutoWrapPolicy | None) -> list[nn.Module]:
    """The root followed by the modules ``policy`` wraps, in pre-order (torch's ``_recursive_wrap`` rules)."""
    units: list[nn.Module] = []
    if policy is not None:
        _recurse(root, _as_callable(policy), units, is_root=True)
    return [root, *(m for m in units if m is not root)]


def _recurse(module: nn.Module, policy: Callable[..., bool], units: list[nn.Module], is_root: bool) -> int:
    """Appends the wrapped modules under ``module``; returns how many parameter elements they cover."""
    numel = sum(p.numel() for p in module.parameters())
    if not policy(module=module, recurse=True, nonwrapped_numel=numel):
        return 0
    position = len(units)
    wrapped = sum(_recurse(child, policy, units, is_root=False) for child in module.children())
    if not is_root and policy(module=module, recurse=False, nonwrapped_numel=numel - wrapped):
        units.insert(position, module)  # pre-order: a parent before its children
        return numel
    return wrapped


def assign_params(root: nn.Module, units: list[nn.Module]) -> dict[nn.Module, list[ParamRef]]:
    """Each unit's parameters, in module order; a shared one goes to its holders' common unit (see Note)."""
    unit_set = set(units)
    chains: dict[str, tuple[nn.Module, ...]] = {"": (root,)}  # enclosing units, outermost first, by name
    refs: dict[int, ParamRef] = {}
    owner_chain: dict[int, tuple[nn.Module, ...]] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        if name:
            parent = chains[name.rpartition(".")[0]]
            chains[name] = (*parent, module) if module in unit_set else parent
        chain = chains[name]
        for attr, param in module.named_parameters(recurse=False, remove_duplicate=False):
            fqn = f"{name}.{attr}" if name else attr
            ref = refs.get(id(param))
            if ref is None:
                refs[id(param)] = ParamRef(param, [fqn], [(module, attr)])
                owner_chain[id(param)] = chain
            else:
                ref.fqns.append(fqn)
                ref.holders.append((module, attr))
                owner_chain[id(param)] = _common_prefix(owner_chain[id(param)], chain)
    owned: dict[nn.Module, list[ParamRef]] = {u: [] for u in units}
    for key, ref in refs.items():
        owned[owner_chain[key][-1]].append(ref)
    return owned


def _common_prefix(a: tuple[nn.Module, ...], b: tuple[nn.Module, ...]) -> tuple[nn.Module, ...]:
    n = 0
    while n < min(len(a), len(b)) and a[n] is b[n]:
        n += 1
    return a[:n]


def unit_scopes(root: nn.Module, units: list[nn.Module]) -> dict[nn.Module, list[nn.Module]]:
    """The modules whose innermost enclosing unit is each unit (a unit is in its own scope)."""
    unit_set = set(units)
    innermost: dict[str, nn.Module] = {"": root}
    scopes: dict[nn.Module, list[nn.Module]] = {u: [] for u in units}
    for name, module in root.named_modules():
        if name:
            parent = innermost[name.rpartition(".")[0]]
            innermost[name] = module if module in unit_set else parent
        scopes[innermost[name]].append(module)
    return scopes
