"""elasticd: settings, the leader-elected coordinator, the Control service, the process entry point."""
