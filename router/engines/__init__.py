"""Real engines as event sources: ZMQ streams (direct mode and the bridge), engine metrics, Dynamo over NATS."""
