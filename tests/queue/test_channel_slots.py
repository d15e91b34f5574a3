"""The worker channel's slot accounting (`cv_server.channel.slots`, docs/protocol.md "The worker
channel"): the server never holds more rows for a worker than the slots it offered."""

from __future__ import annotations

import pytest

from cv_server.channel import Slots
from cv_server.channel.slots import SLOTS_MAX


def test_a_claim_takes_every_free_slot_and_gives_back_what_it_did_not_fill() -> None:
    slots = Slots()
    slots.offer(3)
    assert slots.take() == 3
    assert (slots.free, slots.claiming) == (0, True)
    slots.offer(2)  # freed while the claim was in flight
    slots.settle(3, 1)
    assert (slots.free, slots.claiming) == (4, False)


def test_nothing_is_taken_once_stopped() -> None:
    slots = Slots()
    slots.offer(2)
    slots.stop()
    assert (slots.take(), slots.free) == (0, 0)


def test_an_offer_past_the_cap_is_refused_and_changes_nothing() -> None:
    slots = Slots()
    slots.offer(SLOTS_MAX - 1)
    taken = slots.take()
    with pytest.raises(ValueError, match="at most"):
        slots.offer(2)  # the slots a claim holds count too
    slots.settle(taken, 0)
    assert slots.free == SLOTS_MAX - 1
    with pytest.raises(ValueError, match=">= 0"):
        slots.offer(-1)


def test_a_claim_cannot_hand_more_rows_than_it_took() -> None:
    slots = Slots()
    slots.offer(1)
    taken = slots.take()
    with pytest.raises(ValueError, match="settled"):
        slots.settle(taken, 2)


def test_slots_offered_with_a_refused_report_are_withdrawn_as_far_as_still_free() -> None:
    slots = Slots()
    slots.offer(1)
    slots.offer(2)
    slots.withdraw(2)
    assert slots.free == 1
    slots.withdraw(5)
    assert slots.free == 0
