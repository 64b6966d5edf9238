"""The drafter's fast forward (dflashkit.drafter.fast): rebuilt when parameters are updated or replaced."""

from __future__ import annotations

import torch


def test_the_fast_forward_follows_the_parameters_updated_or_replaced():
    """The drafter's fast path drafts with its parameters as they are now: updated in place (an optimizer step)
    or replaced by new Parameter objects, without walking the module tree on every step."""
    from tests.conftest import tiny_drafter, tiny_target

    drafter = tiny_drafter(tiny_target(), block_size=4)
    drafter.use_fast_path()
    first = drafter._fast_forward()
    assert drafter._fast_forward() is first  # nothing changed: kept
    torch.nn.Linear(2, 2)  # parameters registered elsewhere: the list is taken again, the fast forward kept
    assert drafter._fast_forward() is first
    with torch.no_grad():
        drafter.fc.weight.mul_(2)  # in place: its version moves
    second = drafter._fast_forward()
    assert second is not first and torch.equal(second.fc.weight, drafter.fc.weight.detach())
    old_norm = drafter.norm.weight
    drafter.norm.weight = torch.nn.Parameter(old_norm.detach() + 1)  # replaced: a new object, its version as the
    assert drafter.norm.weight._version == old_norm._version  # old one's, so the versions' sum cannot tell
    third = drafter._fast_forward()
    assert third is not second and torch.equal(third.norm.weight, drafter.norm.weight.detach())
