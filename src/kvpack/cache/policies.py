"""The placement policies by name, in one table, and the placement a cache uses unless told otherwise.

A new policy is a `PlacementPolicy` subclass in its own file and one entry here; a cache takes it by name:
`KVCache(model, method, placement=["anchors", "tiers", "my-policy", "budget"])`.
"""

from __future__ import annotations

from collections.abc import Sequence

from .anchors import AttentionAnchors
from .budget import BudgetPolicy
from .placement import Placement, PlacementPolicy
from .tiers import AgeTiers

POLICIES: dict[str, type[PlacementPolicy]] = {
    "anchors": AttentionAnchors,  # MethodConfig.anchors: the most-attended compressed tokens stay exact
    "tiers": AgeTiers,  # MethodConfig.tiers: blocks age into older tiers
    "budget": BudgetPolicy,  # KVCache(budget=MemoryBudget(...)): free slack, demote early, then evict, to stay within a byte budget
}

# Each policy acts only when its method option (or the cache's budget) asks for it, so one order serves every method:
# anchors are chosen before the tokens are routed, and the budget acts last, on what the tiers left.
DEFAULT_POLICIES = ("anchors", "tiers", "budget")


def build_placement(placement: Placement | Sequence[str | PlacementPolicy] | None = None) -> Placement:
    """A `Placement` from policy names (`POLICIES`) and/or policy objects, in the order given; None: `DEFAULT_POLICIES`."""
    if isinstance(placement, Placement):
        return placement
    if isinstance(placement, str) or not isinstance(placement, Sequence | None):
        raise TypeError(f"placement must be a Placement or a sequence of policy names / PlacementPolicy objects, got {placement!r}")
    policies = []
    for entry in DEFAULT_POLICIES if placement is None else placement:
        if isinstance(entry, str):
            if entry not in POLICIES:
                raise ValueError(f"unknown placement policy {entry!r}; registered: {', '.join(POLICIES)}")
            entry = POLICIES[entry]()
        policies.append(entry)
    return Placement(policies)


DEFAULT_PLACEMENT = build_placement()
