"""etcd: key layout, the client with its retry policy, leases, election, the embedded server."""
