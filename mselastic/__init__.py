"""mselastic: a fault-tolerant, elastic training daemon for MindSpore.

Layers, from the top down (each only imports the ones below it):
``daemon`` (elasticd: coordinator, Control service) -> ``agent`` (registration,
msrun supervisor, Agent service) -> ``store`` (etcd keys, leases, election)
-> ``core`` (job spec, plan, planner, states: pure). ``ctl`` (elasticctl)
speaks to the daemon only through the generated ``v1`` code. ``trainer`` stands
apart: it runs inside MindSpore workers and imports none of the daemon.
"""

__version__ = "0.1.0"
