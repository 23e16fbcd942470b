"""One generation on this node: its launch (cold under its shim, or warm from standbys), its
shim (the fence with the generation, outliving elasticd) and adoption, its heartbeats, how its
ranks are judged, its planned stop (supervisor, launch, launch_env, shim, adopt, beats, observe,
ranks, verdict, preflight, stop). Imports containment, devices and standbys of the agent; the
node (node, service, committed, reports, peers, config) sits above it."""
