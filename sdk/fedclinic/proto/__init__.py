"""Generated protobuf and gRPC modules of protocol fedclinic.v1 (see protos/)."""
