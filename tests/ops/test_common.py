"""ops/_common.py: PassedOnce (host-side value checks once per tensor state)."""

import gc

import torch

from hf_attention_backends.ops._common import PassedOnce


def counting(once: PassedOnce, tensors: tuple, value: bool = True):
    """once.passes(tensors, predicate) and how many times it ran the predicate (0 or 1)."""
    runs = []
    result = once.passes(tensors, lambda: runs.append(1) or value)
    return result, len(runs)


def test_a_passed_tensor_is_not_checked_again_until_it_changes_in_place():
    once, x = PassedOnce(), torch.nn.Parameter(torch.ones(3))
    assert counting(once, (x,)) == (True, 1)
    assert counting(once, (x,)) == (True, 0)
    with torch.no_grad():
        x.add_(1.0)
    assert counting(once, (x,)) == (True, 1)
    assert counting(once, (x,)) == (True, 0)


def test_a_failed_check_is_not_remembered():
    once, x = PassedOnce(), torch.ones(3)
    assert counting(once, (x,), value=False) == (False, 1)
    assert counting(once, (x,), value=False) == (False, 1)


def test_views_count_by_base_place_and_shape():
    once, base = PassedOnce(), torch.ones(4, 6)
    assert counting(once, (base[:, 2:],)) == (True, 1)
    assert counting(once, (base[:, 2:],)) == (True, 0)  # a new view of the same elements
    assert counting(once, (base[:, 1:],)) == (True, 1)  # other elements of the same base
    assert counting(once, (base[:, 1:5],)) == (True, 1)
    base[0, 0] = 2.0  # through the base: the views share its version counter
    assert counting(once, (base[:, 1:5],)) == (True, 1)


def test_every_tensor_of_a_group_counts():
    once, a, b = PassedOnce(), torch.ones(2), torch.ones(2)
    assert counting(once, (a, b)) == (True, 1)
    assert counting(once, (a, b)) == (True, 0)
    assert counting(once, (a, torch.ones(2))) == (True, 1)
    b.mul_(2.0)
    assert counting(once, (a, b)) == (True, 1)


def test_inference_tensors_are_checked_every_call():
    once = PassedOnce()
    with torch.inference_mode():
        x = torch.ones(3)
    assert counting(once, (x,)) == (True, 1)
    assert counting(once, (x,)) == (True, 1)


def test_an_entry_leaves_with_its_tensor():
    once, x = PassedOnce(), torch.ones(3)
    counting(once, (x,))
    assert len(once._passed) == 1
    del x
    gc.collect()
    assert not once._passed
    y = torch.ones(3)  # may reuse the id and the storage of x: checked anew
    assert counting(once, (y,)) == (True, 1)
