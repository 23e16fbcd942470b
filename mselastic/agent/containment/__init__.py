"""Containment: every process of a job in its cgroup, under its uid, with its limits, and the
files a job writes read without trusting them (cgroups, users, procs, jobfiles, logcap,
snapshot_folders, envexec). Imports nothing else of the agent."""
