"""Unit tests: pure logic, no processes, no etcd, no MindSpore (`make test-fast`)."""
