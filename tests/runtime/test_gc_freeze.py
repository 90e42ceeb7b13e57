"""The services freeze what survives a full collection (sits.runtime.lifecycle.freeze_long_lived_objects)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from sits.runtime import lifecycle


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def freezing() -> Iterator[None]:
    gc.unfreeze()
    lifecycle.freeze_long_lived_objects()
    lifecycle.freeze_long_lived_objects()  # a second install adds nothing
    try:
        yield
    finally:
        while lifecycle._freeze_after_full_collection in gc.callbacks:
            gc.callbacks.remove(lifecycle._freeze_after_full_collection)
        gc.unfreeze()


def test_what_survives_a_full_collection_is_frozen_and_still_freed_when_dropped(freezing: None) -> None:
    assert gc.callbacks.count(lifecycle._freeze_after_full_collection) == 1
    long_lived = [Node() for _ in range(2_000)]
    first = weakref.ref(long_lived[0])
    gc.collect()
    # The next full collection does not walk them.
    assert gc.get_freeze_count() >= len(long_lived)
    # Reference counting still frees them: a window's old samples go as before.
    del long_lived
    assert first() is None


def test_a_cycle_made_after_the_freeze_is_still_collected(freezing: None) -> None:
    gc.collect()
    node = Node()
    node.other = node
    ref = weakref.ref(node)
    del node
    gc.collect()
    assert ref() is None
