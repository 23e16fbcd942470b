"""Warm standbys: a fork server per job that imported MindSpore once, and the standby workers it
forks for the next relaunch (forkserver, pools). Imports containment alone of the agent."""
