"""Simulated engine workers and trace replay: the instrument that measures routing quality.

- `mocker.config`, `mocker.timing`: an engine's geometry, limits and forward-pass timing model.
- `mocker.block_pool`: the KV block pool (prefix caching, reference counts, LRU) and its KV events.
- `mocker.engine`: `MockEngine`, a vLLM-like scheduler stepped one forward pass at a time.
- `mocker.worker`: `MockWorker`, an engine serving over NATS in real time (``kv-router mock-worker``).
- `mocker.trace`, `mocker.tokens`, `mocker.workload`: Mooncake traces, token synthesis, and seeded generated
  workloads (shared prefixes; multi-tenant agentic, RAG, bursty mix: ``kv-router replay --workload``).
- `mocker.routers`, `mocker.baselines`: the routers a replay measures (ours, SGLang and llm-d emulations,
  or any ``module:factory``).
- `mocker.simulation`: offline replay, a discrete-event simulation in simulated time.
- `mocker.online`, `mocker.service`: online replay over HTTP and NATS; an in-process router service.
- `mocker.report`, `mocker.plots`, `mocker.progress`: what a replay measured, and how it is shown.
- `mocker.tune`: ``kv-router tune``, the `latency` policy's knobs searched on a trace, in parallel and resumable.
- `mocker.replay`, `mocker.demo`, `mocker.cli`: ``kv-router replay``, ``kv-router demo`` and the commands.
"""
