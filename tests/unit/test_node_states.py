"""The node's lifecycle (core.states.NodeState, #45): the table NodeAgent moves by, read as rules."""

from __future__ import annotations

import pytest

from mselastic.core.states import NODE_TRANSITIONS, IllegalTransition, NodeState, check_node_transition


def test_every_state_has_its_row_and_every_path_ends_closed_through_draining() -> None:
    assert set(NODE_TRANSITIONS) == set(NodeState)
    for state in NodeState:
        if state is not NodeState.CLOSED:
            assert NodeState.DRAINING in NODE_TRANSITIONS[state] or state is NodeState.DRAINING, state
    assert NODE_TRANSITIONS[NodeState.DRAINING] == {NodeState.CLOSED}
    assert not NODE_TRANSITIONS[NodeState.CLOSED]


def test_a_fenced_node_launches_nothing_until_registered_again() -> None:
    """FENCED is left only for HOLDING (registered again, the fence's kill over) or DRAINING: not
    for REGISTERING, which would let a launch through before the registration."""
    assert NODE_TRANSITIONS[NodeState.FENCED] == {NodeState.HOLDING, NodeState.DRAINING}
    for state in (NodeState.REGISTERING, NodeState.REREGISTERING, NodeState.HOLDING, NodeState.UNREACHABLE):
        assert NodeState.FENCED in NODE_TRANSITIONS[state], state  # (a fence may be decided anywhere)
    assert NodeState.FENCED not in NODE_TRANSITIONS[NodeState.STARTING]  # (no lease yet: nothing to fence on)


@pytest.mark.parametrize("old,new", [(NodeState.FENCED, NodeState.REGISTERING), (NodeState.DRAINING, NodeState.HOLDING),
                                     (NodeState.CLOSED, NodeState.STARTING), (NodeState.STARTING, NodeState.HOLDING)])
def test_an_illegal_move_raises(old: NodeState, new: NodeState) -> None:
    with pytest.raises(IllegalTransition, match=f"node state {old.value} -> {new.value}"):
        check_node_transition(old, new)


def test_the_legal_moves_pass() -> None:
    for old, news in NODE_TRANSITIONS.items():
        for new in news:
            check_node_transition(old, new)
