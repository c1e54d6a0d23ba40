"""Generated protobuf and gRPC modules of the tollgate.v1 API (run `make proto`)."""
