"""Generated gRPC/protobuf code for ``proto/mselastic/v1`` (do not edit; run ``make proto``)."""
