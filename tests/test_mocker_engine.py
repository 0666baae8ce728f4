"""The simulated engine: scheduling, prefix-cache accounting, preemption, timing, and KV events.

Expected times marked "Dynamo 1.6.1" were measured with `run_mocker_trace_replay` on the same requests
(see docs/routing-quality.md); with ``prefill_form="dynamo"`` and no per-sequence decode term the
engine reproduces them.
"""

from __future__ import annotations

import random
from array import array

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from indexer.radix_tree import RadixTree
from mocker.block_pool import Cleared
from mocker.config import EngineConfig, TimingConfig
from mocker.engine import MockEngine, PassResult, SeqState, Sequence
from mocker.timing import PassTimer
from tests.test_mocker_block_pool import WORKER, index_of, indexed_blocks

DYNAMO_TIMING = TimingConfig(prefill_form="dynamo", decode_per_seq_ms=0.0)


def prompt(*blocks: int, length: int | None = None, block: int = 512) -> bytes:
    tokens = array("I")
    for b in blocks:
        tokens.extend(range(b * block + 7, b * block + 7 + block))
    return tokens[: length if length is not None else len(tokens)].tobytes()


def run(
    engine: MockEngine, arrivals: list[tuple[float, bytes, int]], *, skip_quiet: bool = False
) -> tuple[list[Sequence], list[PassResult]]:
    """Step ``engine`` through requests arriving at the given times (ms); returns them and the passes."""
    seqs: list[Sequence] = []
    passes: list[PassResult] = []
    pending = sorted(arrivals, key=lambda a: a[0])
    now = 0.0
    i = 0
    while i < len(pending) or engine.has_work():
        if not engine.has_work():
            now = max(now, pending[i][0])
        while i < len(pending) and pending[i][0] <= now:
            at, tokens, max_tokens = pending[i]
            seqs.append(engine.submit(f"r{i}", tokens, max_tokens, at))
            i += 1
        quiet = engine.quiet_passes(now) if skip_quiet else []
        next_arrival = pending[i][0] if i < len(pending) else float("inf")
        if quiet:
            taken = next((n + 1 for n, end in enumerate(quiet) if end > next_arrival), len(quiet))
            engine.skip_quiet(taken)
            now = quiet[taken - 1]
            continue
        result = engine.step(now)
        passes.append(result)
        now = result.end_ms
    return seqs, passes


def test_a_lone_request_costs_one_prefill_then_one_decode_step_per_token() -> None:
    engine = MockEngine(EngineConfig(timing=DYNAMO_TIMING))
    (seq,), _ = run(engine, [(0.0, prompt(1, 2, length=1000), 5)])
    assert seq.first_token_ms == pytest.approx(32.105859, abs=1e-5)  # Dynamo 1.6.1
    assert seq.finished_ms == pytest.approx(55.272311, abs=1e-5)
    assert seq.state is SeqState.FINISHED
    assert engine.pool.active_blocks == 0


def test_long_prompts_are_prefilled_in_chunks_of_the_token_budget() -> None:
    config = EngineConfig()
    engine = MockEngine(config)
    (seq,), passes = run(engine, [(0.0, prompt(*range(40), length=20000), 2)])
    assert [p.prefill_tokens for p in passes[:3]] == [8192, 8192, 3616]
    timer = PassTimer(config)
    # Each chunk attends to the chunks before it.
    expected = sum(timer.prefill_ms(n, n * (n + 2 * c)) for n, c in ((8192, 0), (8192, 8192), (3616, 16384)))
    assert seq.first_token_ms == pytest.approx(expected)
    dynamo = MockEngine(EngineConfig(timing=DYNAMO_TIMING))
    (seq,), _ = run(dynamo, [(0.0, prompt(*range(40), length=20000), 2)])
    assert seq.first_token_ms == pytest.approx(415.183328, abs=1e-5)  # Dynamo 1.6.1


def test_a_cached_prefix_is_reused_except_the_block_holding_the_last_token() -> None:
    engine = MockEngine(EngineConfig(timing=DYNAMO_TIMING))
    seqs, _ = run(engine, [(0.0, prompt(1, 2, length=1024), 3), (5000.0, prompt(1, 2, length=1024), 3)])
    # 1024 tokens are 16 full blocks, but the last token must be computed: 15 blocks come from cache.
    assert [s.cached_tokens for s in seqs] == [0, 960]
    assert seqs[1].first_token_ms - seqs[1].arrival_ms == pytest.approx(17.474885, abs=1e-5)  # Dynamo 1.6.1
    stats = engine.stats
    assert (stats.prompt_tokens, stats.cached_tokens) == (2048, 960)
    assert (stats.prompt_blocks, stats.cached_blocks) == (32, 15)


def test_requests_admitted_in_one_pass_share_blocks_allocated_in_it() -> None:
    engine = MockEngine(EngineConfig(timing=DYNAMO_TIMING))
    seqs, passes = run(engine, [(0.0, prompt(*range(6), length=3000), 4), (0.0, prompt(*range(6), length=3000), 4)])
    assert [s.cached_tokens for s in seqs] == [0, 2944]
    assert passes[0].prefill_tokens == 3000 + 56
    assert seqs[0].first_token_ms == seqs[1].first_token_ms


@pytest.mark.parametrize("gap_ms", [0.0, 5.0, 30.0, 200.0])
def test_a_prefix_in_flight_is_reused_however_soon_the_next_request_comes(gap_ms: float) -> None:
    # Same pass (0 ms), during the holder's pass (5, 30 ms) or after it: the prefix's blocks are the
    # holder's from the pass that allocates them, so the second request never computes them again.
    engine = MockEngine(EngineConfig())
    arrivals = [(0.0, prompt(*range(6), 100, length=3500), 4), (gap_ms, prompt(*range(6), 200, length=3500), 4)]
    seqs, _ = run(engine, arrivals)
    assert [s.cached_tokens for s in seqs] == [0, 6 * 512]


def test_a_request_arriving_during_decode_pays_prefill_plus_the_decode_step() -> None:
    engine = MockEngine(EngineConfig(timing=DYNAMO_TIMING))
    seqs, _ = run(engine, [(0.0, prompt(1, 2, length=1000), 100), (100.0, prompt(5, 6, 7, 8, length=2000), 3)])
    assert seqs[1].first_token_ms - seqs[1].arrival_ms == pytest.approx(55.952137, abs=1e-4)  # Dynamo 1.6.1
    assert seqs[0].finished_ms == pytest.approx(654.475658, abs=1e-4)


def test_eviction_keeps_the_prefixes_of_released_sequences_longest() -> None:
    engine = MockEngine(EngineConfig(num_gpu_blocks=40, timing=DYNAMO_TIMING))
    families = [(1, 2), (3, 4), (5, 6), (1, 2), (3, 4)]
    seqs, _ = run(engine, [(1000.0 * i, prompt(*f, length=1024), 1) for i, f in enumerate(families)])
    assert [s.cached_tokens for s in seqs] == [0, 0, 0, 512, 512]  # Dynamo 1.6.1


def test_admission_waits_for_blocks_and_preemption_recomputes() -> None:
    # 12 blocks of 16 tokens; two requests that each grow to 8 blocks cannot both stay resident.
    config = EngineConfig(num_gpu_blocks=12, block_size=16, max_num_batched_tokens=64)
    engine = MockEngine(config)
    arrivals = [(0.0, prompt(10, 11, 12, 13, block=16), 60), (0.0, prompt(20, 21, 22, 23, block=16), 60)]
    seqs, passes = run(engine, arrivals)
    assert all(s.state is SeqState.FINISHED for s in seqs)
    assert all(engine.generated(s) == 60 for s in seqs)
    assert engine.stats.preemptions >= 1
    assert sum(s.preemptions for s in seqs) == engine.stats.preemptions
    assert engine.pool.active_blocks == 0
    tree = index_of([op for p in passes for op in p.ops])
    assert indexed_blocks(tree) == engine.pool.full_blocks()
    # Each output block opened is reported once, as a gateway streaming the tokens would see it, even
    # when the sequence was preempted in the very pass it opened the block in.
    for seq in seqs:
        reported = sum(p.opened_blocks.count(seq) for p in passes)
        assert reported == sum(1 for g in range(1, 60) if (64 + g) % 16 == 1)


@settings(max_examples=150, deadline=None)
@example(blocks=8, block_size=16, requests=[(0.0, 32, 50)] * 3)  # the third preempts itself opening a block
@given(
    blocks=st.integers(10, 40),
    block_size=st.sampled_from([4, 16]),
    requests=st.lists(st.tuples(st.floats(0.0, 50.0), st.integers(1, 64), st.integers(1, 60)), min_size=2, max_size=6),
)
def test_every_output_block_opened_is_reported_once_whatever_preemption_does(
    blocks: int, block_size: int, requests: list[tuple[float, int, int]]
) -> None:
    """A gateway streaming the tokens sees each block the output opens once; the engine reports the
    same, also when opening it preempts its own sequence, or a sequence is preempted in the very pass
    its token opened one."""
    engine = MockEngine(EngineConfig(num_gpu_blocks=blocks, block_size=block_size, max_num_batched_tokens=64))
    arrivals = [(at, prompt(4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3, block=16, length=length), out)
                for i, (at, length, out) in enumerate(requests)]  # fmt: skip
    seqs, passes = run(engine, arrivals)
    for seq in seqs:
        if seq.state is SeqState.REJECTED:
            continue
        assert seq.state is SeqState.FINISHED
        opened = sum(1 for g in range(1, seq.max_tokens) if (seq.prompt_len + g) % block_size == 1)
        assert sum(p.opened_blocks.count(seq) for p in passes) == opened


def test_a_prompt_larger_than_the_pool_is_rejected() -> None:
    engine = MockEngine(EngineConfig(num_gpu_blocks=4, block_size=16))
    seq = engine.submit("big", prompt(*range(5), block=16), 3, 0.0)
    assert seq.state is SeqState.REJECTED
    assert not engine.has_work()


@pytest.mark.parametrize(("max_tokens", "state"), [(17, SeqState.FINISHED), (18, SeqState.REJECTED)])
def test_a_request_whose_output_would_outgrow_the_pool_is_rejected_and_one_just_fitting_completes(
    max_tokens: int, state: SeqState
) -> None:
    """Four blocks of 16: a prompt of 48 tokens fits, and 17 output tokens still do (the last one's KV is
    never computed: 64 tokens held); 18 do not, and the request used to preempt itself for ever (the
    offline replay's "made no progress"), whatever else ran."""
    engine = MockEngine(EngineConfig(num_gpu_blocks=4, block_size=16))
    seq = engine.submit("r", prompt(0, 1, 2, block=16), max_tokens, 0.0)
    now = 0.0
    for _ in range(2 * max_tokens):  # bounded: a request preempting itself would never finish
        if not engine.has_work():
            break
        now = engine.step(now).end_ms
    assert seq.state is state and not engine.has_work()
    assert engine.config.fits(48, max_tokens) is (state is SeqState.FINISHED)


def random_workload(seed: int, count: int, *, gap_ms: float = 15.0, output: int = 90) -> list[tuple[float, bytes, int]]:
    """Prompts from six families of shared prefixes, Poisson arrivals ``gap_ms`` apart on average."""
    rng = random.Random(seed)
    arrivals = []
    now = 0.0
    for _ in range(count):
        family = rng.randrange(6)
        blocks = [family * 100 + k for k in range(rng.randint(1, 5))] + [10_000 + rng.randrange(10**6)]
        tokens = prompt(*blocks, length=rng.randint(40, 64 * len(blocks)), block=64)
        arrivals.append((now, tokens, rng.randint(1, output)))
        now += rng.expovariate(1 / gap_ms)
    return arrivals


@pytest.mark.parametrize("seed", range(4))
def test_events_replay_into_the_pool_contents_under_pressure(seed: int) -> None:
    engine = MockEngine(EngineConfig(num_gpu_blocks=48, block_size=16, max_num_seqs=6, max_num_batched_tokens=96))
    tree = RadixTree()
    event_id = 1
    _, passes = run(engine, random_workload(seed, 60))
    for result in passes:
        index_of(result.ops, tree, event_id)
        event_id += len(result.ops)
    assert indexed_blocks(tree) == engine.pool.full_blocks()
    assert engine.stats.preemptions > 0  # the pool was under pressure
    assert {(WORKER, 0)} == set(tree.stats().blocks) or not engine.pool.full_blocks()


def test_skipping_quiet_passes_changes_nothing() -> None:
    config = EngineConfig(num_gpu_blocks=400, block_size=64, max_num_batched_tokens=256)
    arrivals = random_workload(7, 80, gap_ms=300.0, output=300)
    stepped, stepped_passes = run(MockEngine(config, seed=1), arrivals)
    skipping, skipping_passes = run(MockEngine(config, seed=1), arrivals, skip_quiet=True)
    assert len(skipping_passes) < len(stepped_passes) / 2

    def outcome(seqs: list[Sequence]) -> list[float]:
        return [value for s in seqs for value in (s.first_token_ms, s.finished_ms, s.cached_tokens)]

    # Equal up to float summation order: a quiet run adds its pass durations up before the clock.
    assert outcome(skipping) == pytest.approx(outcome(stepped), rel=1e-12)
    ops = [op for p in stepped_passes for op in p.ops]
    assert ops == [op for p in skipping_passes for op in p.ops]


def test_generated_tokens_are_deterministic_per_seed() -> None:
    arrivals = [(0.0, prompt(1, 2, length=100, block=64), 200)]

    def output_blocks(seed: int) -> list[int]:
        engine = MockEngine(EngineConfig(block_size=16), seed=seed)
        (seq,), _ = run(engine, arrivals)
        return seq.hashes[100 // 16 :]

    assert output_blocks(3) == output_blocks(3)
    assert output_blocks(3) != output_blocks(4)


def test_metrics_report_queue_and_kv_usage() -> None:
    engine = MockEngine(EngineConfig(num_gpu_blocks=100, block_size=16, max_num_seqs=1))
    engine.submit("a", prompt(10, 11, 12, 13, block=16), 10, 0.0)
    engine.submit("b", prompt(20, 21, 22, 23, block=16), 10, 0.0)
    engine.step(0.0)
    metrics = engine.metrics()
    assert (metrics.waiting, metrics.running) == (1, 1)
    assert metrics.active_blocks == 5  # four prompt blocks and the first generated token's block
    assert metrics.kv_usage == pytest.approx(0.05)
    assert msgspec.structs.asdict(EngineConfig()) == msgspec.structs.asdict(
        msgspec.json.decode(b"{}", type=EngineConfig)
    )


def test_a_prefix_cache_reset_clears_everything_once_idle() -> None:
    engine = MockEngine(EngineConfig(block_size=16))
    engine.submit("a", prompt(1, 2, block=16), 3, 0.0)
    engine.step(0.0)
    assert engine.reset_prefix_cache() is None  # a request is in flight
    run(engine, [])
    assert engine.pool.full_blocks()
    assert engine.reset_prefix_cache() == [Cleared()]
    assert engine.pool.full_blocks() == set()
