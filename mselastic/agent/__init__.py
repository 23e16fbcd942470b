"""The node agent: registration, the msrun supervisor, the Agent gRPC service."""
