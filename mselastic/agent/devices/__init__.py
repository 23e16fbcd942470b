"""The node's accelerators as the slots: detected (detect), set aside when they fail (health,
xid), checked before a launch. Imports containment alone of the agent."""
