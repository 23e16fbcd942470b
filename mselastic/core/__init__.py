"""Pure logic: job spec, etcd records, states, the planner. Imports nothing of ours above it."""
