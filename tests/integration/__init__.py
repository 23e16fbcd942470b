"""Integration tests: real etcd, msrun, MindSpore workers, signals, network namespaces."""
