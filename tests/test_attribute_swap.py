"""common.attribute_swap: attributes replaced inside a block, restored as they were."""

from __future__ import annotations

import pytest

from common.attribute_swap import attributes_replaced


class Base:
    def greet(self) -> str:
        return "base"


class Child(Base):
    def name(self) -> str:
        return "child"

    @staticmethod
    def kind() -> str:
        return "static"


def test_own_and_inherited_attributes_come_back_as_they_were() -> None:
    own, inherited = Child.__dict__["name"], Base.__dict__["greet"]
    with attributes_replaced([(Child, "name", lambda self: "swapped"),
                              (Child, "greet", lambda self: "shadowed"),
                              (Child, "kind", staticmethod(lambda: "other"))]):
        assert Child().name() == "swapped" and Child().greet() == "shadowed"
        assert Base().greet() == "base" and Child().kind() == "other"
    assert Child.__dict__["name"] is own
    assert "greet" not in Child.__dict__ and Child.greet is inherited
    assert Child().kind() == "static"  # still a staticmethod: no self passed


def test_an_exception_in_the_block_still_restores() -> None:
    holder = Child()
    holder.value = 1
    with pytest.raises(RuntimeError), attributes_replaced([(holder, "value", 2)]):
        assert holder.value == 2
        raise RuntimeError("inside")
    assert holder.value == 1
