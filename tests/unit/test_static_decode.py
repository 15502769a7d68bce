"""The native engine's static decode (`rollout/static_decode.py`), the step a CUDA graph captures:
the eager decode's tokens and log-probs, buckets of rows, rows leaving; and the graph runner
(`kernels/cuda/graph_step.py`) with its capture replaced by a trace of the step that each replay
reruns, which is as close to a CUDA graph as a CPU gets (a capture itself needs a GPU:
`benchmarks/gpu_equivalence.py`)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from transformers import AutoTokenizer

from mogrpo import kernels
from mogrpo.kernels.cuda import graph_step
from mogrpo.modeling.tiny import NATIVE_FAMILIES, random_family_model
from mogrpo.rollout import native, static_decode
from mogrpo.rollout.native import NativeDecoder, native_decode
from mogrpo.rollout.sampling import SamplingSettings
from mogrpo.rollout.static_decode import StaticDecoder, bucket_for, bucket_sizes

PROMPTS = ["the cat sat on", "答案 因为 the question", "a", "option A B because the context says",
           "the question says", "B"]
K = 2  # 12 rows: buckets 12, 8, 4, 2, 1 with the smallest at 1
PAD = -1  # after a row's stop: no token id


@pytest.fixture(autouse=True)
def _graphs_trusted(monkeypatch):
    """Each test starts in a process whose graphs were never turned off (a failed capture or
    a replay that differed turns them off for the process)."""
    monkeypatch.setattr(graph_step, "DISTRUSTED", None)
    monkeypatch.setattr(graph_step, "UNCAPTURABLE", None)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(tok):
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    return (enc["input_ids"].repeat_interleave(K, dim=0),
            enc["attention_mask"].repeat_interleave(K, dim=0))  # [12, P]


def traced_capture(step, pool):
    """`graph_step.capture` as far as a CPU goes: the step traced once (make_fx: its operations
    on the very tensors it read, the Python around them run once) and each replay reruns the
    trace, as a CUDA graph replays its kernels. A step whose work hung on Python state that
    changes between steps (a column as an int, a tensor replaced) replays stale work here too."""
    trace = make_fx(lambda: step())()
    out = trace().clone()
    return (lambda: out.copy_(trace())), out, pool


def traced(step):
    """A `GraphedStep` whose capture is `traced_capture`."""
    return graph_step.GraphedStep(step, capture=traced_capture)


def family_model(family, tok):
    return random_family_model(family, len(tok), pad_token_id=tok.pad_token_id,
                               eos_token_id=tok.eos_token_id)


def decode(model, prompts, settings, *, stop_ids, static, seed=0, smallest=1, runner_for=traced):
    """(Decoded, the StaticDecoder or None): the eager decode, or the static one on buckets down
    to `smallest` rows, each bucket's step traced once and replayed (`traced`)."""
    ids, mask = prompts
    decoder = NativeDecoder(model)
    if static:
        decoder = StaticDecoder(decoder, runner_for, smallest=smallest)
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = native._decode(decoder, ids, mask, settings, stop_ids=stop_ids, pad_id=PAD,
                             record_logprobs=True)
    return out, decoder if static else None


def staggered_stops(model, prompts, settings) -> list[int]:
    """Stop ids that the eager decode emits at different steps of different rows: a token of
    each of several rows, at step 1, 2, 3, ..."""
    out, _ = decode(model, prompts, settings, stop_ids=[1], static=False)
    return sorted({int(out.tokens[row, 1 + row // 3]) for row in range(0, 12, 2)})


def assert_same_decode(eager, static):
    assert torch.equal(static.tokens, eager.tokens)
    torch.testing.assert_close(static.logp, eager.logp, atol=1e-5, rtol=0)
    assert (static.nonfinite_logits, static.rows_reset) == (eager.nonfinite_logits,
                                                            eager.rows_reset)


@pytest.mark.parametrize("family", sorted(NATIVE_FAMILIES))
def test_static_decode_equals_the_eager_decode_as_rows_finish(family, tok, prompts):
    model = family_model(family, tok)
    settings = SamplingSettings(max_new_tokens=10, greedy=True)
    stops = staggered_stops(model, prompts, settings)
    eager, _ = decode(model, prompts, settings, stop_ids=stops, static=False)
    static, decoder = decode(model, prompts, settings, stop_ids=stops, static=True)
    assert_same_decode(eager, static)
    lengths = (eager.tokens != PAD).sum(1)
    assert len(set(lengths.tolist())) >= 3  # rows finished at several different steps
    captured = decoder.runner.captured
    assert captured[0] == 12 and len(captured) >= 2  # and moved to smaller buckets
    assert captured == sorted(captured, reverse=True)
    assert set(captured) <= set(bucket_sizes(12, 1))
    assert decoder.runner.failed is None


def test_a_replayed_step_follows_the_columns_and_a_step_frozen_at_its_capture_would_not(
        tok, prompts, monkeypatch):
    """Nine steps on one bucket, replayed from one trace: the eager decode's tokens. The same
    trace of a step that picks its column as a Python int (as the eager step's slices do)
    writes every step's keys to the capture's column: other tokens. This is what the traced
    replay of these tests catches, and what a CUDA graph would do."""
    model = family_model("llama", tok)
    settings = SamplingSettings(max_new_tokens=10, greedy=True)
    eager, _ = decode(model, prompts, settings, stop_ids=[1], static=False)
    assert (eager.tokens != PAD).all()  # no row stops: every step on the 12-row bucket
    static, decoder = decode(model, prompts, settings, stop_ids=[1], static=True)
    assert_same_decode(eager, static)
    assert decoder.runner.captured == [12]
    static_step = NativeDecoder.static_step

    def python_column(self, tokens, column, columns):
        return static_step(self, tokens, torch.tensor([self.length]), columns)

    monkeypatch.setattr(NativeDecoder, "static_step", python_column)
    direct, _ = decode(model, prompts, settings, stop_ids=[1], static=True, runner_for=None)
    frozen, _ = decode(model, prompts, settings, stop_ids=[1], static=True)
    assert torch.equal(direct.tokens, eager.tokens)
    assert not torch.equal(frozen.tokens, eager.tokens)


@pytest.mark.parametrize("options", [
    {"temperature": 0.8, "top_k": 20, "top_p": 0.9},
    {"temperature": 1.2, "repetition_penalty": 1.3, "presence_penalty": 0.5,
     "frequency_penalty": 0.3, "min_p": 0.05},
])
def test_static_decode_samples_the_eager_decodes_tokens_from_one_seed(options, tok, prompts):
    """Sampling runs after the step on the live rows only, so each draw takes the same random
    numbers as the eager decode's, with the penalties' per-row state kept alike."""
    model = family_model("qwen2", tok)
    settings = SamplingSettings(max_new_tokens=12, **options)
    stops = list(range(40, 80))  # a tenth of the vocabulary: rows stop at random steps
    for seed in (3, 4):
        eager, _ = decode(model, prompts, settings, stop_ids=stops, static=False, seed=seed)
        static, decoder = decode(model, prompts, settings, stop_ids=stops, static=True,
                                 seed=seed, runner_for=None)  # (the replays: tested above)
        assert_same_decode(eager, static)
        assert len(set((eager.tokens != PAD).sum(1).tolist())) >= 3
        assert len(decoder.runner.captured) >= 2


def test_buckets_are_the_batch_then_powers_of_two():
    assert bucket_sizes(12, 1) == [12, 8, 4, 2, 1]
    assert bucket_sizes(16, 1) == [16, 8, 4, 2, 1]
    assert bucket_sizes(128) == [128, 64, 32, 16]  # down to SMALLEST_BUCKET
    assert bucket_sizes(17) == [17, 16]
    assert bucket_sizes(10) == [10] and bucket_sizes(1, 1) == [1]
    sizes = bucket_sizes(12, 1)
    assert [bucket_for(n, sizes) for n in (12, 9, 8, 5, 4, 3, 2, 1)] == [12, 12, 8, 8, 4, 4, 2, 1]


def _stepped(model, prompts, keep=None, poison=False):
    """Logits of three static steps on fixed tokens; before the second, only the rows `keep`
    stay (and, with `poison`, the others' cache rows and tokens are overwritten with junk)."""
    ids, mask = prompts
    decoder = StaticDecoder(NativeDecoder(model), smallest=1)
    tokens = torch.arange(12) % 7 + 5
    out = []
    with torch.inference_mode():
        decoder.prefill(ids, mask, max_new_tokens=4)
        out.append(decoder.step(tokens))
        rows = torch.arange(12)
        if keep is not None:
            rows = torch.tensor(keep)
            decoder.keep_unfinished(rows)
            if poison:
                gone = torch.tensor([r for r in range(12) if r not in keep])
                for cache in decoder.keys + decoder.values:
                    cache[gone[gone < cache.shape[0]]] = float("nan")
                decoder.tokens[gone] = 3
        for _ in range(2):
            out.append(decoder.step(tokens[rows] + len(out)))
    return out, decoder


@pytest.mark.parametrize("keep", [[0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11], [1, 4, 6, 7, 11], [3, 9],
                                  [10]])
def test_rows_leaving_move_to_a_smaller_bucket_without_changing_the_others(keep, tok, prompts):
    model = family_model("llama", tok)
    full, _ = _stepped(model, prompts)
    kept, decoder = _stepped(model, prompts, keep)
    torch.testing.assert_close(kept[0], full[0], atol=0, rtol=0)
    for a, b in zip(kept[1:], full[1:], strict=True):
        torch.testing.assert_close(a, b[keep], atol=1e-5, rtol=0)
    bucket = bucket_for(len(keep), bucket_sizes(12, 1))
    assert decoder.bucket == bucket and decoder.runner.captured == sorted({12, bucket},
                                                                          reverse=True)
    # every bucket steps on the same memory (what a graph replays): the first rows of the cache
    stepped = decoder.decoder.keys[0]
    assert stepped.shape[0] == bucket and stepped.data_ptr() == decoder.keys[0].data_ptr()


def test_finished_rows_left_in_their_bucket_cannot_change_the_live_rows(tok, prompts):
    """Rows that finish stay in place until the live rows fit a smaller bucket; whatever they
    hold (NaN here), the live rows' logits are the same to the bit."""
    model = family_model("qwen3", tok)
    keep = [0, 1, 2, 3, 4, 6, 7, 8, 10, 11]  # 10 live rows: still the 12-row bucket
    clean, decoder = _stepped(model, prompts, keep)
    poisoned, _ = _stepped(model, prompts, keep, poison=True)
    assert decoder.bucket == 12 and decoder.slots.tolist() == keep
    for a, b in zip(clean, poisoned, strict=True):
        assert torch.equal(a, b) and torch.isfinite(b).all()


def test_native_decode_runs_static_where_kernels_offer_a_graph_runner(tok, prompts,
                                                                      monkeypatch):
    """Where `mogrpo.kernels.graph_runner` gives a runner (CUDA), `native_decode` takes the static
    path on its own; here a `GraphedStep` whose capture is a trace (`traced`) stands in for
    CUDA's (its replay refreshes one output tensor, as a graph's does)."""
    made: list[graph_step.GraphedStep] = []

    def runner(step):
        made.append(traced(step))
        return made[-1]

    model = family_model("phi3", tok)
    settings = SamplingSettings(max_new_tokens=10, greedy=True)
    stops = staggered_stops(model, prompts, settings)
    ids, mask = prompts
    eager = native_decode(model, ids, mask, settings, stop_ids=stops, pad_id=0,
                          record_logprobs=True)
    monkeypatch.setattr(kernels, "graph_runner", lambda device: runner)
    monkeypatch.setattr(static_decode, "SMALLEST_BUCKET", 2)
    graphed = native_decode(model, ids, mask, settings, stop_ids=stops, pad_id=0,
                            record_logprobs=True)
    assert_same_decode(eager, graphed)
    assert len(made) == 1 and made[0].failed is None
    assert made[0].captured[0] == 12 and len(made[0].captured) >= 2
    assert min(made[0].captured) >= 2  # no bucket below the smallest
    forced_off = native_decode(model, ids, mask, settings, stop_ids=stops, pad_id=0,
                               record_logprobs=True, static=False)
    assert len(made) == 1 and torch.equal(forced_off.tokens, eager.tokens)


def test_the_graph_runner_captures_each_bucket_once_and_falls_back_when_it_cannot():
    calls, captures = [], []
    value = torch.zeros(3)

    def step():
        calls.append(1)
        return value * 2

    def capture(step, pool):
        captures.append(pool)
        out = torch.empty(3)
        return (lambda: out.copy_(step())), out, f"pool{len(captures)}"

    runner = graph_step.GraphedStep(step, capture=capture)
    for bucket, v in [(8, 1.0), (8, 2.0), (4, 3.0), (4, 4.0), (4, 5.0)]:
        value.fill_(v)
        assert runner(bucket).tolist() == [2 * v] * 3
    assert runner.captured == [8, 4]
    assert captures == [None, "pool1"]  # the second graph shares the first one's pool

    def failing(step, pool):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    broken = graph_step.GraphedStep(step, capture=failing)
    value.fill_(6.0)
    assert broken(8).tolist() == [12.0] * 3 and broken(4).tolist() == [12.0] * 3
    assert broken.captured == [] and broken.failed == \
        "operation not permitted when stream is capturing"


def test_the_graph_runner_is_offered_on_cuda_only_and_can_be_switched_off(monkeypatch, caplog):
    assert kernels.graph_runner(torch.device("cpu")) is None
    monkeypatch.delenv(graph_step.ENV, raising=False)
    assert kernels.graph_runner(torch.device("cuda")) is graph_step.GraphedStep
    assert kernels.describe()["decode_graph"].startswith("CUDA graphs")
    monkeypatch.setenv(graph_step.ENV, "0")
    assert kernels.graph_runner(torch.device("cuda")) is None
    assert kernels.describe()["decode_graph"] == "eager (MOGRPO_DECODE_GRAPH=0)"


def test_a_failed_capture_says_so_once(caplog):
    def failing(step, pool):
        raise RuntimeError("capture failed")

    runner = graph_step.GraphedStep(lambda: torch.ones(1), capture=failing)
    with caplog.at_level(logging.WARNING, logger=graph_step.__name__):
        for bucket in (8, 8, 4):
            assert runner(bucket).tolist() == [1.0]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "capture failed" in lines[0] and "eagerly" in lines[0]


def test_a_failed_capture_turns_the_graphs_off_for_the_process(monkeypatch):
    """A step that cannot be captured fails again at every rollout, and each failed capture
    keeps its memory pool: the next rollouts run the eager step without trying."""
    monkeypatch.delenv(graph_step.ENV, raising=False)
    tried = []

    def failing(step, pool):
        tried.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    graph_step.GraphedStep(lambda: torch.ones(1), capture=failing)(8)
    assert kernels.graph_runner(torch.device("cuda")) is None
    assert kernels.describe()["decode_graph"] == (
        "eager (the step could not be captured: operation not permitted when stream is "
        "capturing)")
    later = graph_step.GraphedStep(lambda: torch.ones(1), capture=failing)
    assert later(8).tolist() == [1.0] and later(4).tolist() == [1.0]
    assert len(tried) == 1


def test_out_of_memory_in_a_capture_reaches_the_trainer(monkeypatch):
    """Not a failure to capture: `memory.on_oom` halves the batch and the graphs stay on."""
    monkeypatch.delenv(graph_step.ENV, raising=False)

    def oom(step, pool):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(torch.OutOfMemoryError):
        graph_step.GraphedStep(lambda: torch.ones(1), capture=oom)(8)
    assert kernels.graph_runner(torch.device("cuda")) is graph_step.GraphedStep


class _Stream:
    def __init__(self, name):
        self.name = name

    def wait_stream(self, other):
        pass


class _FakeCuda:
    """The torch.cuda calls `graph_step.capture` makes, recorded: streams switched and
    restored, a CUDAGraph whose capture_end raises when the captured step failed (as a broken
    capture's does), and the allocator's cache emptied or not."""

    def __init__(self, monkeypatch):
        self.current = _Stream("default")
        self.calls: list = []
        fake = self

        class Switch:  # torch.cuda.stream(s)
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                self.before, fake.current = fake.current, self.stream

            def __exit__(self, *exc):
                fake.current = self.before

        class Graph:  # torch.cuda.CUDAGraph()
            broken = False

            def capture_begin(self, pool=None, capture_error_mode="global"):
                fake.calls.append(("capture_begin", pool, capture_error_mode, fake.current.name))

            def capture_end(self):
                fake.calls.append(("capture_end",))
                if Graph.broken:
                    raise RuntimeError("CUDA error: operation failed due to a previous error "
                                       "during capture")

            def replay(self):
                pass

            def pool(self):
                return "pool"

        self.Graph = Graph
        self.streams = 0

        def new_stream():
            self.streams += 1
            return _Stream("side")

        monkeypatch.setattr(graph_step, "_SHARED", None)  # the process's first capture
        for name, value in (("Stream", new_stream), ("stream", Switch),
                            ("graph_pool_handle", lambda: "process pool"),
                            ("CUDAGraph", Graph), ("current_stream", lambda: fake.current),
                            ("synchronize", lambda: fake.calls.append(("synchronize",))),
                            ("empty_cache", lambda: fake.calls.append(("empty_cache",)))):
            monkeypatch.setattr(torch.cuda, name, value)


def test_a_capture_keeps_the_allocators_cache_and_the_threads_stream(monkeypatch):
    """torch.cuda.graph would empty the cache at every capture (each bucket of each rollout:
    the update after it then allocates from the driver again)."""
    fake = _FakeCuda(monkeypatch)
    default = fake.current
    replay, out, pool = graph_step.capture(lambda: torch.ones(2), "shared pool")
    assert out.tolist() == [1.0, 1.0] and pool == "pool"
    assert fake.calls == [("synchronize",), ("capture_begin", "shared pool", "thread_local",
                                             "side"), ("capture_end",)]
    assert fake.current is default


def test_every_capture_of_the_process_shares_one_pool_and_one_stream(monkeypatch):
    """A dropped graph's pool goes back to the driver only when the allocator is emptied: a
    pool per decode would pile up; and pool blocks are reused only on their own stream."""
    fake = _FakeCuda(monkeypatch)
    for _ in range(3):  # three decodes' first captures
        graph_step.capture(lambda: torch.ones(1), None)
    begins = [c for c in fake.calls if c[0] == "capture_begin"]
    assert [c[1] for c in begins] == ["process pool"] * 3
    assert fake.streams == 1


def test_a_failed_capture_puts_the_thread_back_on_its_stream(monkeypatch):
    """Else the training after the rollout would run on the capture's side stream."""
    fake = _FakeCuda(monkeypatch)
    fake.Graph.broken = True
    default = fake.current
    seen = []

    def step():
        seen.append(fake.current.name)
        if any(c[0] == "capture_begin" for c in fake.calls):
            raise RuntimeError("operation not permitted when stream is capturing")
        return torch.ones(1)

    with pytest.raises(RuntimeError, match="previous error during capture"):
        graph_step.capture(step, None)
    assert seen == ["side"] * (graph_step.WARMUP_STEPS + 1)
    assert fake.calls[-1] == ("capture_end",)
    assert fake.current is default


def test_a_replay_that_differs_from_the_eager_step_turns_the_graphs_off(monkeypatch, caplog):
    """A graph that replays something else than the step (a wrong capture) would sample from
    another distribution without a sound: its first replay is checked against the eager step."""
    monkeypatch.setattr(graph_step, "DISTRUSTED", None)
    monkeypatch.delenv(graph_step.ENV, raising=False)
    value = torch.tensor([1.0, 2.0, 3.0])

    def wrong(step, pool):
        out = torch.empty(3)
        return (lambda: out.copy_(step() + 0.5)), out, pool

    runner = graph_step.GraphedStep(lambda: value * 2, capture=wrong)
    with caplog.at_level(logging.WARNING, logger=graph_step.__name__):
        assert runner(8).tolist() == [2.0, 4.0, 6.0]  # the eager step's logits
        assert runner(8).tolist() == [2.0, 4.0, 6.0] and runner.captured == []
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "differed from the eager step" in lines[0]
    assert "largest difference 0.5" in lines[0]
    assert kernels.graph_runner(torch.device("cuda")) is None  # off for the process
    assert kernels.describe()["decode_graph"].startswith("eager (a replay of bucket 8")
    # a replay within float32's rounding of the eager step is kept
    monkeypatch.setattr(graph_step, "DISTRUSTED", None)
    assert graph_step.disagreement(value * (1 + 1e-7), value) is None
    assert graph_step.disagreement(value.bfloat16() + 0.001, value.bfloat16()) is None
