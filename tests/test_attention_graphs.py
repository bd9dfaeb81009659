"""Graph static buffers for any number of query tokens per sequence (speculative decoding
verifies k + 1 per sequence in one replay), run eagerly (`capture=False`) on the CPU with
the Triton backend in the interpreter: the same hidden states as the ordinary path, and
padding rows write nothing to the cache. `INFER_TEST_DEVICE=cuda` captures the graphs."""

from __future__ import annotations

import os

import pytest
import torch
from checkpoints import save_random_checkpoint

from infer.attention import GraphMetadata, make_attention_backend
from infer.attention.varlen_graph_metadata import VarlenGraphMetadata
from infer.kernels import triton_available

if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)
transformers = pytest.importorskip("transformers")

DEVICE = torch.device(os.environ.get("INFER_TEST_DEVICE", "cpu"))
# Where the staged inputs are written: on CUDA through the driver's copies (cuda_driver.py)
STAGING_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BLOCK, NUM_BLOCKS, MAX_LEN = 4, 24, 32
BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            max_position_embeddings=64)


@pytest.mark.parametrize("device", STAGING_DEVICES)
def test_prepare_replay_fills_slots_lengths_and_padding(device: str) -> None:
    meta = GraphMetadata(max_batch=4, query_len=2, max_blocks_per_seq=3, block_size=BLOCK,
                         device=torch.device(device))
    tables = [[5, 2], [7, 1, 3]]
    meta.prepare_replay(4, [6, 9], tables, [[11] * 8, [12] * 8])
    assert meta.token_rows.tolist() == [[11] * 8, [12] * 8]
    # positions 4, 5 of the first sequence (block 2), 7, 8 of the second (blocks 1, 3)
    assert meta.slot_mapping.tolist() == [8, 9, 7, 12, -1, -1, -1, -1]
    assert meta.seq_lens.tolist() == [6, 9, 2, 2]
    assert meta.block_tables.tolist() == [[5, 2, 0], [7, 1, 3], [0, 0, 0], [0, 0, 0]]
    view = meta.metadata(2)
    assert view.query_start_loc.tolist() == [0, 2, 4]
    assert view.query_lens_host == [2, 2] and view.num_tokens == 4
    assert view.decode_splits is None


@pytest.mark.parametrize("device", STAGING_DEVICES)
def test_a_smaller_step_after_a_larger_one_leaves_nothing_of_it_read(device: str) -> None:
    meta = GraphMetadata(max_batch=4, query_len=1, max_blocks_per_seq=3, block_size=BLOCK,
                         device=torch.device(device))
    meta.prepare_replay(4, [9, 5, 12, 3], [[4, 6, 8], [1, 2], [3, 5, 7], [9]],
                        [[1, 2, 3, 4], [8, 4, 11, 2]])
    meta.prepare_replay(2, [2], [[6]], [None, [1, 0]])
    # what a graph of two rows reads: the new step, its padding row, no row of the old one
    assert meta.token_rows[:, :2].tolist() == [[0, 0], [1, 0]]
    assert meta.slot_mapping[:2].tolist() == [25, -1]
    assert meta.seq_lens[:2].tolist() == [2, 1]
    assert meta.block_tables[:2, :1].tolist() == [[6], [0]]


@pytest.mark.parametrize("device", STAGING_DEVICES)
def test_varlen_prepare_replay_fills_starts_tiles_lengths_and_padding(device: str) -> None:
    meta = VarlenGraphMetadata(max_tokens=8, max_seqs=3, max_blocks_per_seq=3,
                               block_size=BLOCK, block_q=2, max_query_len=8,
                               device=torch.device(device))
    meta.prepare_replay(8, [3, 1], [5, 9], [[2, 6], [7, 1, 3]],
                        [[5, 6, 7, 8, 0, 0, 0, 0], [2, 3, 4, 8, 0, 0, 0, 0]])
    assert meta.token_rows.tolist() == [[5, 6, 7, 8, 0, 0, 0, 0], [2, 3, 4, 8, 0, 0, 0, 0]]
    # the first sequence's positions 2-4 (blocks 2, 2, 6), the second's position 8 (block 3)
    assert meta.slot_mapping.tolist() == [10, 11, 24, 12, -1, -1, -1, -1]
    assert meta.query_start_loc.tolist() == [0, 3, 4, 4]
    assert meta.tile_start.tolist() == [0, 2, 3, 3]
    assert meta.seq_lens.tolist() == [5, 9, 0]
    assert meta.block_tables[:2].tolist() == [[2, 6, 0], [7, 1, 3]]


def test_torch_backend_refuses_graphs() -> None:
    with pytest.raises(ValueError, match="attention_backend='triton'"):
        make_attention_backend("torch").init_graph_metadata(4, 1, MAX_LEN, BLOCK, 2, "cpu")


@pytest.fixture(scope="module", params=["llama-gqa", "mistral-window"])
def model(request, tmp_path_factory):
    from infer.loader import load_hf_dir

    t = transformers
    config = {
        "llama-gqa": lambda: t.LlamaConfig(**BASE, num_attention_heads=4,
                                           num_key_value_heads=2),
        "mistral-window": lambda: t.MistralConfig(**BASE, num_attention_heads=4,
                                                  num_key_value_heads=2, sliding_window=5),
    }[request.param]()
    path = tmp_path_factory.mktemp(request.param)
    save_random_checkpoint(config, path, seed=1)
    return load_hf_dir(path, dtype=torch.float32, device=DEVICE)


@pytest.mark.parametrize(("query_len", "split_keys"),
                         [(1, False), (2, False), (3, False), (2, True), (3, True)])
def test_static_buffers_match_ordinary_path(model, query_len: int, split_keys: bool,
                                            monkeypatch) -> None:
    """`split_keys` (`verify_decode_attention`): steps of several tokens a sequence take
    the split-K decode kernel, which must run (counted) and give the same states."""
    from infer.attention import triton_backend
    from infer.engine.model_runner import ModelRunner

    decode_launches = []
    decode = triton_backend.paged_decode

    def counted_decode(*args, **kwargs):
        decode_launches.append(kwargs.get("query_len", 1))
        return decode(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "paged_decode", counted_decode)

    net, config = model
    runner = ModelRunner(net, config, NUM_BLOCKS, BLOCK, DEVICE, torch.float32,
                         attention_backend="triton", kernel_backend="torch")
    # Block 0 is left to padding rows; unused blocks hold NaN, so a stray write shows.
    tables = [[3, 9, 4], [6, 1], [8, 11, 2, 5], [7, 10]]
    context = [5, 1, 9, 6]
    runner.kv_pool.fill_(float("nan"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (c + query_len,), generator=gen).tolist() for c in context]
    backend = runner.backend
    with torch.inference_mode():
        meta = backend.build_metadata(context, context, tables, BLOCK, DEVICE)
        net(torch.tensor([t for p, c in zip(prompts, context) for t in p[:c]], device=DEVICE),
            torch.tensor([i for c in context for i in range(c)], device=DEVICE), meta)
    seqs = [0, 1, 2]  # three sequences: graph size 4 with one padding row
    ids = [t for s in seqs for t in prompts[s][context[s]:]]
    positions = [p for s in seqs for p in range(context[s], context[s] + query_len)]
    seq_lens = [context[s] + query_len for s in seqs]
    step_tables = [tables[s] for s in seqs]
    before = runner.kv_pool.clone()
    with torch.inference_mode():
        meta = backend.build_metadata([query_len] * 3, seq_lens, step_tables, BLOCK, DEVICE)
        expected = net(torch.tensor(ids, device=DEVICE),
                       torch.tensor(positions, device=DEVICE), meta)
    expected_pool = runner.kv_pool.clone()
    runner.kv_pool.copy_(before)

    graphs = runner.enable_decode_graphs(4, MAX_LEN, capture=DEVICE.type == "cuda",
                                         tokens_per_seq=query_len, split_keys=split_keys)
    assert graphs.sizes == [1, 2, 4] and graphs.input_ids.shape == (4 * query_len,)
    assert graphs.fits([query_len] * 3) and not graphs.fits([query_len] * 2 + [query_len + 1])
    decode_launches.clear()
    hidden = graphs.run(ids, positions, seq_lens, step_tables)
    if DEVICE.type == "cpu":  # (a captured graph replays without calling Python)
        took_decode = query_len == 1 or split_keys
        assert decode_launches == ([query_len] * config.num_layers if took_decode
                                   else []), decode_launches
    assert hidden.shape == expected.shape
    # GEMMs of another row count may differ in the last bits (cuBLAS picks by shape).
    tol = 1e-5 if DEVICE.type == "cpu" else 1e-4
    torch.testing.assert_close(hidden, expected, rtol=tol, atol=tol)
    # Padding wrote nothing: the pool equals the ordinary path's, NaNs and block 0 included.
    torch.testing.assert_close(runner.kv_pool, expected_pool, rtol=tol, atol=tol,
                               equal_nan=True)
    assert runner.kv_pool[:, :, 0].isnan().all()


def test_a_step_that_follows_the_last_moves_its_buffers_on_the_device(model) -> None:
    """`DecodeGraphs.run(follows=True)` (a proposal round's next one-token forward): the
    buffers of the step just run, moved one token on on the device, hold what preparing the
    next step from the host writes, and give the same hidden states."""
    from infer.engine.model_runner import ModelRunner

    net, config = model
    runner = ModelRunner(net, config, NUM_BLOCKS, BLOCK, DEVICE, torch.float32,
                         attention_backend="triton", kernel_backend="torch")
    graphs = runner.enable_decode_graphs(4, MAX_LEN, capture=DEVICE.type == "cuda")
    tables = [[3, 9, 4], [6, 1], [8, 11, 2, 5]]
    context = [3, 7, 8]  # the second sequence's next token starts a block
    first = torch.tensor([11, 12, 13], device=DEVICE)
    second = torch.tensor([21, 22, 23], device=DEVICE)
    runner.kv_pool.normal_(generator=torch.Generator(DEVICE).manual_seed(0))
    start = runner.kv_pool.clone()

    def buffers() -> list[torch.Tensor]:
        attn = graphs.attn
        return [t.clone() for t in (attn.seq_lens, attn.slot_mapping, graphs.positions,
                                    graphs.input_ids)]

    results = {}
    for follows in (False, True):
        runner.kv_pool.copy_(start)
        with torch.inference_mode():
            graphs.run(first, context, [c + 1 for c in context], tables)
            hidden = graphs.run(second, [c + 1 for c in context],
                                [c + 2 for c in context], tables, follows=follows).clone()
        results[follows] = hidden, buffers(), runner.kv_pool.clone()
    (want, want_buffers, want_pool), (got, got_buffers, got_pool) = results.values()
    assert torch.equal(got, want) and torch.equal(got_pool, want_pool)
    assert all(torch.equal(a, b) for a, b in zip(got_buffers, want_buffers))


def test_token_buckets() -> None:
    from infer.engine.cuda_graphs import token_buckets

    assert token_buckets(16) == [16]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(1000) == [16, 32, 64, 128, 256, 320, 384, 448, 512, 640, 768, 896,
                                   1000]
    assert token_buckets(2048)[-5:] == [1024, 1280, 1536, 1792, 2048]


@pytest.mark.parametrize("kind", ["mixed", "piecewise"])
@pytest.mark.parametrize("max_tokens", [16, 64])
def test_mixed_step_graphs_match_ordinary_path(model, kind: str, max_tokens: int) -> None:
    """A mixed step (a prefill chunk over a cached prefix, a whole prompt, two decodes) of
    13 tokens through whole-step graphs or graphs cut at attention, padded to a bucket of
    16 (and 6 sequences): the same hidden states and cache as the ordinary path, and the
    padding writes nothing."""
    from infer.engine.model_runner import ModelRunner

    net, config = model
    runner = ModelRunner(net, config, NUM_BLOCKS, BLOCK, DEVICE, torch.float32,
                         attention_backend="triton", kernel_backend="torch")
    tables = [[3, 9, 4], [6, 1], [8, 11, 2, 5], [7, 10]]
    context = [5, 0, 9, 6]  # tokens already cached per sequence
    new = [4, 7, 1, 1]  # tokens this step brings
    runner.kv_pool.fill_(float("nan"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (c + q,), generator=gen).tolist()
               for c, q in zip(context, new)]
    backend = runner.backend
    cached = [i for i, c in enumerate(context) if c]
    with torch.inference_mode():
        meta = backend.build_metadata([context[i] for i in cached], [context[i] for i in cached],
                                      [tables[i] for i in cached], BLOCK, DEVICE)
        net(torch.tensor([t for i in cached for t in prompts[i][:context[i]]], device=DEVICE),
            torch.tensor([p for i in cached for p in range(context[i])], device=DEVICE), meta)
    ids = [t for p, c in zip(prompts, context) for t in p[c:]]
    positions = [p for c, q in zip(context, new) for p in range(c, c + q)]
    seq_lens = [c + q for c, q in zip(context, new)]
    before = runner.kv_pool.clone()
    with torch.inference_mode():
        meta = backend.build_metadata(new, seq_lens, tables, BLOCK, DEVICE)
        expected = net(torch.tensor(ids, device=DEVICE), torch.tensor(positions, device=DEVICE),
                       meta)
    expected_pool = runner.kv_pool.clone()
    runner.kv_pool.copy_(before)

    capture = DEVICE.type == "cuda"
    if kind == "mixed":
        graphs = runner.enable_mixed_graphs(max_tokens, 6, MAX_LEN, capture=capture)
        assert graphs.fits(new) and not graphs.fits([1] * 7)
        assert not graphs.fits([max_tokens - 3, 4])

        def run():
            return graphs.run(ids, positions, new, seq_lens, tables)
    else:
        graphs = runner.enable_piecewise_graphs(max_tokens, capture=capture)
        assert graphs.fits(13) and not graphs.fits(max_tokens + 1)

        def run():
            return graphs.run(ids, positions, meta)
    with torch.inference_mode():
        hidden = run()
        again = run()  # replays read the buffers afresh
    assert hidden.shape == expected.shape
    tol = 1e-5 if DEVICE.type == "cpu" else 1e-4
    torch.testing.assert_close(hidden, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(again, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(runner.kv_pool, expected_pool, rtol=tol, atol=tol,
                               equal_nan=True)
    assert runner.kv_pool[:, :, 0].isnan().all()
    assert graphs.steps == 2


@pytest.mark.parametrize("in_graph", [True, False])
def test_decode_graphs_give_the_lm_heads_logits(model, in_graph: bool) -> None:
    from infer.engine.model_runner import ModelRunner, StepInputs

    net, config = model
    runner = ModelRunner(net, config, NUM_BLOCKS, BLOCK, DEVICE, torch.float32,
                         attention_backend="triton", kernel_backend="torch")
    graphs = runner.enable_decode_graphs(4, MAX_LEN, capture=DEVICE.type == "cuda",
                                         logits=in_graph)
    seq_lens, tables = [3, 6, 2], [[3, 9], [6, 1], [8]]
    inputs = StepInputs([5, 17, 40], [n - 1 for n in seq_lens], [1, 1, 1], seq_lens, tables,
                        [0, 1, 2], ["a", "b", "c"], [1, 1, 1])
    hidden = runner.forward(inputs)
    logits = runner.sample_logits(hidden, inputs)
    assert (graphs.last_logits is logits) == in_graph
    assert (4 in graphs.logits) == in_graph
    with torch.inference_mode():
        expected = net.compute_logits(hidden.clone())
    torch.testing.assert_close(logits, expected)
    # Rows that are not the graph's output, or only some rows: the head runs on them.
    two = StepInputs(*([] for _ in range(5)), [0, 2], ["a", "c"], [1, 1])
    torch.testing.assert_close(runner.sample_logits(hidden, two), expected[[0, 2]])
    copy = hidden.clone()
    assert runner.sample_logits(copy, inputs).data_ptr() != logits.data_ptr()


def test_two_token_graphs_give_the_logits_of_each_last_token(model) -> None:
    """`last_token_logits` (a draft's two-token forward): the graphs compute the LM head
    of each sequence's last token only, which a step sampling those rows reads; a step
    sampling other rows runs the head on them."""
    from infer.engine.model_runner import ModelRunner, StepInputs

    net, config = model
    runner = ModelRunner(net, config, NUM_BLOCKS, BLOCK, DEVICE, torch.float32,
                         attention_backend="triton", kernel_backend="torch")
    graphs = runner.enable_decode_graphs(4, MAX_LEN, capture=DEVICE.type == "cuda",
                                         tokens_per_seq=2, logits=True, catch_up=True,
                                         last_token_logits=True)
    seq_lens, tables = [3, 6], [[3, 9], [6, 1]]
    positions = [p for n in seq_lens for p in (n - 2, n - 1)]
    inputs = StepInputs([5, 17, 40, 8], positions, [2, 2], seq_lens, tables, [1, 3],
                        ["a", "b"], [1, 1])
    hidden = runner.forward(inputs)
    logits = runner.sample_logits(hidden, inputs)
    assert graphs.last_logits is logits and logits.shape[0] == 2
    with torch.inference_mode():
        expected = net.compute_logits(hidden.clone())
    torch.testing.assert_close(logits, expected[[1, 3]])
    every = StepInputs(*([] for _ in range(5)), [0, 1, 2, 3], ["a", "b"], [2, 2])
    torch.testing.assert_close(runner.sample_logits(hidden, every), expected)


def test_logits_in_the_lm_heads_dtype_hold_the_float32_ones(tmp_path, monkeypatch) -> None:
    """`compute_logits(as_float=False)` (a draft's, whose rounds take only the argmax): the
    LM head's bfloat16 output, which float32 holds exactly, so the same values and the
    same argmax; with a final softcap the logits are float32 either way."""
    import dataclasses

    from infer.loader import load_hf_dir

    save_random_checkpoint(transformers.LlamaConfig(**BASE, num_attention_heads=4,
                                                    num_key_value_heads=2), tmp_path, seed=2)
    net, _ = load_hf_dir(tmp_path, dtype=torch.bfloat16, device=DEVICE)
    hidden = torch.randn(3, BASE["hidden_size"], generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(DEVICE, torch.bfloat16)
    with torch.inference_mode():
        as_float = net.compute_logits(hidden)
        raw = net.compute_logits(hidden, as_float=False)
        assert as_float.dtype == torch.float32 and raw.dtype == torch.bfloat16
        assert torch.equal(raw.float(), as_float)
        assert torch.equal(raw.argmax(-1), as_float.argmax(-1))
        monkeypatch.setattr(net, "config",
                            dataclasses.replace(net.config, final_logit_softcapping=30.0))
        capped = net.compute_logits(hidden, as_float=False)
        assert capped.dtype == torch.float32
        torch.testing.assert_close(capped, torch.tanh(as_float / 30.0) * 30.0)
