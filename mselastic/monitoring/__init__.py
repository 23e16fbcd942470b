"""Prometheus alert rules for mselastic's metrics (``mselastic.rules.yml``), their tests for
``promtool test rules`` and a scrape configuration to start from: package data, installed with
the wheel (docs/operations.md, "Monitoring and alerts")."""
