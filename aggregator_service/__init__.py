"""The fedclinic aggregator service: gRPC wiring, authorization, round engine, durable store."""
