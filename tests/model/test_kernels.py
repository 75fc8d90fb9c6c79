"""The fused CPU kernels give the plain torch path's results."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ember.kernels import cpu

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def k():
    module = cpu.load()
    assert module is not None, "the CPU kernels failed to build (see the log); the fast path would be missing"
    return module


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_and_fused_residual(k, out_dtype):
    x = torch.randn(7, 576) * 3
    w = torch.rand(576) + 0.5
    out = torch.empty(7, 576, dtype=out_dtype)
    k.rmsnorm(out, x, w, 1e-5)
    torch.testing.assert_close(out.float(), F.rms_norm(x, (576,), w, 1e-5).to(out_dtype).float(), rtol=1e-2 if out_dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    delta = torch.randn(7, 576).to(out_dtype)
    residual = x.clone()
    k.add_rmsnorm(out, residual, delta, w, 1e-5)
    torch.testing.assert_close(residual, x + delta.float())
    torch.testing.assert_close(out.float(), F.rms_norm(x + delta.float(), (576,), w, 1e-5).to(out_dtype).float(), rtol=1e-2 if out_dtype == torch.bfloat16 else 1e-5, atol=1e-5)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("qkv_dtype", [torch.float32, torch.bfloat16])
def test_rope_store_matches_complex_rotation(k, with_bias, qkv_dtype):
    from ember.config import ModelConfig
    from ember.model.llama import apply_rope, rope_frequencies

    h, kv, hd, t = 4, 2, 16, 5
    config = ModelConfig(100, 64, 128, 1, h, kv, hd, 10000.0, 1e-5, 64, True)
    freqs = rope_frequencies(config, 64)
    qkv = torch.randn(t, (h + 2 * kv) * hd).to(qkv_dtype)
    bias = torch.randn((h + 2 * kv) * hd) if with_bias else None
    positions = torch.tensor([0, 3, 17, 40, 63])
    slots = torch.tensor([9, 2, 5, 0, 11])
    k_cache, v_cache = torch.zeros(12, kv, hd), torch.zeros(12, kv, hd)
    q = k.rope_store(qkv, freqs.real.contiguous(), freqs.imag.contiguous(), positions, slots, k_cache, v_cache, h, kv, hd, bias)

    full = qkv.float() + (bias if bias is not None else 0)
    rotated = apply_rope(full[:, : (h + kv) * hd].reshape(t, h + kv, hd), freqs[positions].unsqueeze(1))
    torch.testing.assert_close(q, rotated[:, :h], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache[slots], rotated[:, h:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_cache[slots], full[:, (h + kv) * hd :].reshape(t, kv, hd))


SHAPES = {  # heads, kv heads, head_dim, block size
    "smollm": (9, 3, 64, 16),
    "wide-group": (16, 2, 128, 16),  # head_dim 128, 8 query heads per kv head
    "generic": (4, 2, 48, 32),  # no register-blocked kernel for head_dim 48: the plain loops
    "head-dim-128": (6, 2, 128, 48),  # 3 query heads per kv head; 96-token spans (whole 48-token blocks)
}


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_lens", [[1, 17, 100, 33], [613]], ids=["batch", "one-long"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_paged_decode_attention_matches_sdpa(k, out_dtype, context_lens, shape):
    """Contexts are cut into 64-token spans, computed over the threads and merged; a span may end mid-block."""
    torch.manual_seed(0)
    h, kv, hd, bs = SHAPES[shape]
    num_blocks = 60
    k_cache, v_cache = torch.randn(num_blocks * bs, kv, hd), torch.randn(num_blocks * bs, kv, hd)
    lens = torch.tensor(context_lens)
    batch = len(context_lens)
    tables = torch.zeros(batch, 40, dtype=torch.long)
    perm = torch.randperm(num_blocks - 1) + 1
    used = 0
    for b, n in enumerate(lens.tolist()):
        nb = math.ceil(n / bs)
        tables[b, :nb] = perm[used : used + nb]
        used += nb
    q = torch.randn(batch, h, hd)
    out = torch.empty(batch, h * hd, dtype=out_dtype)
    scale = hd**-0.5
    k.paged_attention(out, q, k_cache, v_cache, tables, None, lens, bs, scale)
    for b, n in enumerate(lens.tolist()):
        slots = (tables[b].unsqueeze(-1) * bs + torch.arange(bs)).flatten()[:n]
        ref = F.scaled_dot_product_attention(q[b].unsqueeze(1), k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1), scale=scale, enable_gqa=True)
        torch.testing.assert_close(out[b].float(), ref.reshape(-1).to(out_dtype).float(), rtol=2e-2 if out_dtype == torch.bfloat16 else 1e-5, atol=1e-4)


def test_paged_decode_attention_does_not_depend_on_the_batch(k):
    """A sequence's output is the same alone and beside others (fixed spans, no batch-sized split)."""
    torch.manual_seed(1)
    h, kv, hd, bs = SHAPES["smollm"]
    k_cache, v_cache = torch.randn(64 * bs, kv, hd), torch.randn(64 * bs, kv, hd)
    tables = torch.arange(1, 61).reshape(3, 20)
    lens = torch.tensor([300, 41, 250])
    q = torch.randn(3, h, hd)
    together = torch.empty(3, h * hd)
    k.paged_attention(together, q, k_cache, v_cache, tables, None, lens, bs, 0.125)
    alone = torch.empty(1, h * hd)
    k.paged_attention(alone, q[:1], k_cache, v_cache, tables[:1], None, lens[:1], bs, 0.125)
    assert torch.equal(alone[0], together[0])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_prompt_rows_attend_causally_and_equal_their_decode(k, shape):
    """A prompt chunk: one row per token on the sequence's table, context = position + 1.

    Matches causal SDPA, and each row is bit for bit the row that decoding that
    token alone gives, whether the rows run as many (row, kv head) tasks or as
    spread spans, and wherever a chunk starts.
    """
    torch.manual_seed(2)
    h, kv, hd, bs = SHAPES[shape]
    n = 300
    k_cache, v_cache = torch.randn(40 * bs, kv, hd), torch.randn(40 * bs, kv, hd)
    table = (torch.randperm(39) + 1)[: math.ceil(n / bs)].unsqueeze(0)
    q = torch.randn(n, h, hd)
    scale = hd**-0.5
    lens = torch.arange(1, n + 1)
    prompt = torch.empty(n, h * hd)
    k.paged_attention(prompt, q, k_cache, v_cache, table, torch.zeros(n, dtype=torch.long), lens, bs, scale)
    slots = (table[0].unsqueeze(-1) * bs + torch.arange(bs)).flatten()[:n]
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True
    )
    torch.testing.assert_close(prompt, ref.transpose(0, 1).reshape(n, -1), rtol=1e-4, atol=1e-4)
    for i in range(n):  # every row: a prompt tile's rows take other code than a decode row (tile_scores)
        alone = torch.empty(1, h * hd)
        k.paged_attention(alone, q[i : i + 1], k_cache, v_cache, table, None, lens[i : i + 1], bs, scale)
        assert torch.equal(alone[0], prompt[i]), f"row {i}"
    chunk = torch.empty(37, h * hd)  # a chunk starting mid-prompt, mid-block
    k.paged_attention(chunk, q[101:138], k_cache, v_cache, table, torch.zeros(37, dtype=torch.long), lens[101:138], bs, scale)
    assert torch.equal(chunk, prompt[101:138])


def test_prompt_rows_of_several_sequences_in_one_call_equal_each_alone(k):
    """One call holding prompt chunks on different tables (rows of a sequence walk
    their spans together in tiles, which end where a sequence does; two of the
    sequences have enough rows for their keys to be transposed) and decode rows:
    every row has the bits it has alone, and the call spreads as many tasks as it has."""
    torch.manual_seed(3)
    h, kv, hd, bs = SHAPES["smollm"]
    k_cache, v_cache = torch.randn(80 * bs, kv, hd), torch.randn(80 * bs, kv, hd)
    tables = torch.arange(1, 81).reshape(4, 20)
    # 141 rows of sequence 0 (positions 160..300), 3 decode rows (sequence 2, 1, 2),
    # 130 rows of sequence 1 (positions 0..129), 21 rows of sequence 3 (positions 180..200).
    table_rows = torch.tensor([0] * 141 + [2, 1, 2] + [1] * 130 + [3] * 21)
    lens = torch.cat([torch.arange(161, 302), torch.tensor([77, 5, 300]), torch.arange(1, 131), torch.arange(181, 202)])
    q = torch.randn(len(lens), h, hd)
    together = torch.empty(len(lens), h * hd)
    k.paged_attention(together, q, k_cache, v_cache, tables, table_rows, lens, bs, 0.125)
    for i in range(len(lens)):
        alone = torch.empty(1, h * hd)
        k.paged_attention(alone, q[i : i + 1], k_cache, v_cache, tables[table_rows[i] : table_rows[i] + 1], None, lens[i : i + 1], bs, 0.125)
        assert torch.equal(alone[0], together[i]), f"row {i}"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_float16_cache_attends_as_a_float32_cache_holding_its_values(k, shape):
    """A float16 KV cache (EngineConfig.kv_cache_dtype) changes what is stored, not
    how it is read: decode spans, prompt tiles (transposed keys on AVX-512 for the
    130- and 141-row sequences), pair kernels and the plain loops of a shape without
    register-blocked kernels all give the bits of a float32 cache holding the
    float16 values."""
    torch.manual_seed(4)
    h, kv, hd, bs = SHAPES[shape]
    k16, v16 = torch.randn(80 * bs, kv, hd).half(), torch.randn(80 * bs, kv, hd).half()
    tables = torch.arange(1, 81).reshape(4, 20)
    table_rows = torch.tensor([0] * 141 + [2, 1, 2] + [1] * 130 + [3] * 21)
    lens = torch.cat([torch.arange(161, 302), torch.tensor([77, 5, 300]), torch.arange(1, 131), torch.arange(181, 202)])
    q = torch.randn(len(lens), h, hd)
    for rows, table_rows_or_none in ((slice(None), table_rows), (slice(141, 144), None)):  # many rows, then decode rows
        tables_used = tables if table_rows_or_none is not None else tables[table_rows[rows]]
        out16, out32 = (torch.empty(len(lens[rows]), h * hd) for _ in range(2))
        k.paged_attention(out16, q[rows], k16, v16, tables_used, table_rows_or_none, lens[rows], bs, hd**-0.5)
        k.paged_attention(out32, q[rows], k16.float(), v16.float(), tables_used, table_rows_or_none, lens[rows], bs, hd**-0.5)
        assert torch.equal(out16, out32)
    with pytest.raises(RuntimeError, match="one dtype"):
        k.paged_attention(out16, q[rows], k16, v16.float(), tables_used, None, lens[rows], bs, 0.125)


def test_rope_store_rounds_once_into_a_float16_cache(k):
    """Keys and values are computed in float32 and rounded once to float16: the
    float32 cache's contents, converted (round to nearest even); q is unchanged."""
    from ember.config import ModelConfig
    from ember.model.llama import rope_frequencies

    h, kv, hd, t = 9, 3, 64, 40
    freqs = rope_frequencies(ModelConfig(100, 576, 128, 1, h, kv, hd, 10000.0, 1e-5, 64, True), 64)
    qkv = torch.randn(t, (h + 2 * kv) * hd) * 4
    positions, slots = torch.arange(t) + 7, torch.randperm(t + 5)[:t]
    caches = {dtype: (torch.zeros(t + 5, kv, hd, dtype=dtype), torch.zeros(t + 5, kv, hd, dtype=dtype)) for dtype in (torch.float32, torch.float16)}
    q = {dtype: k.rope_store(qkv, freqs.real.contiguous(), freqs.imag.contiguous(), positions, slots, *caches[dtype], h, kv, hd, None) for dtype in caches}
    assert torch.equal(q[torch.float16], q[torch.float32])
    for c16, c32 in zip(caches[torch.float16], caches[torch.float32]):
        assert torch.equal(c16, c32.half())


def test_a_float16_cache_saturates_where_a_conversion_would_overflow(k):
    """Beyond float16's ±65,504 a key or value is stored as ±65,504, not infinity (one
    infinite key would make its sequence's attention NaN), by the kernel and by the torch
    path alike; every value in range keeps the bits of a plain conversion."""
    from ember.config import ModelConfig
    from ember.model.kv_values import FLOAT16_MAX, as_kv_values
    from ember.model.llama import AttentionMetadata, Attention, rope_frequencies
    from ember.model.quant import Numerics

    h, kv, hd, t = 2, 1, 16, 6
    config = ModelConfig(100, 32, 64, 1, h, kv, hd, 10000.0, 1e-5, 64, True)
    freqs = rope_frequencies(config, 64)
    qkv = torch.randn(t, (h + 2 * kv) * hd) * 4
    qkv[0, h * hd : (h + 1) * hd] = 1e6  # a key far out of range (both halves of each pair)
    qkv[1, (h + kv) * hd :] = -7e4  # values just out of range
    qkv[2, (h + kv) * hd] = 65500.0  # in range: rounds as a plain conversion does
    positions, slots = torch.arange(t) + 3, torch.tensor([4, 0, 7, 2, 5, 1])
    assert torch.equal(as_kv_values(qkv, torch.float16), qkv.half().clamp(-FLOAT16_MAX, FLOAT16_MAX))  # no inf
    assert not torch.isinf(as_kv_values(qkv, torch.float16)).any()
    assert torch.isnan(as_kv_values(torch.tensor([float("nan")]), torch.float16)).all()
    assert torch.equal(as_kv_values(qkv, torch.float32), qkv)
    # From bfloat16 activations (the torch path with --dtype bfloat16), whose type cannot hold 65,504.
    from_bf16 = as_kv_values(torch.tensor([65536.0, -1e6, 3.0], dtype=torch.bfloat16), torch.float16)
    assert from_bf16.tolist() == [FLOAT16_MAX, -FLOAT16_MAX, 3.0]

    def caches(dtype):
        return torch.zeros(8, kv, hd, dtype=dtype), torch.zeros(8, kv, hd, dtype=dtype)

    kernel32, kernel16 = caches(torch.float32), caches(torch.float16)
    for cache in (kernel32, kernel16):
        k.rope_store(qkv, freqs.real.contiguous(), freqs.imag.contiguous(), positions, slots, *cache, h, kv, hd, None)
    weights = {name: torch.zeros(rows, 32) for name, rows in (("q", h * hd), ("k", kv * hd), ("v", kv * hd))}
    weights["o"] = torch.zeros(32, h * hd)
    attention = Attention(config, weights, Numerics("none", torch.float32, torch.device("cpu")))
    torch16 = caches(torch.float16)
    attention._rope_store(qkv, AttentionMetadata(slot_mapping=slots, rope_freqs=freqs[positions].unsqueeze(1)), *torch16)
    for c16, c32, t16 in zip(kernel16, kernel32, torch16, strict=True):
        assert torch.equal(c16, as_kv_values(c32, torch.float16))
        assert torch.isfinite(c16).all() and torch.isfinite(t16).all()
        saturated = c32.abs() > FLOAT16_MAX
        assert saturated.any()
        assert torch.equal(t16[saturated], c16[saturated])  # ±65,504 on both paths
    assert torch.equal(torch16[1], kernel16[1])  # values are not rotated: the same bits


def _lane_weights(n, k_in, seed):
    from ember.model.quant import pack_lanes, quantize_per_channel_int8

    torch.manual_seed(seed)
    weight = torch.randn(n, k_in) * 0.05
    weight[3, 5] = 2.0  # an outlier channel
    q, scale = quantize_per_channel_int8(weight)
    return weight, q, scale, pack_lanes(q, pair=True), pack_lanes(weight, pair=False)


@pytest.mark.parametrize("in_features", [576, 600])  # 600: a last activation group of 24 inputs
def test_lane_linears_match_the_dequantized_matmul(k, in_features):
    """W8A16 (int16 activations in groups of 256) is within 1e-4 of float32 activations; float32 lanes within rounding."""
    weight, q, scale, lanes8, lanes32 = _lane_weights(64, in_features, 0)
    x = torch.randn(21, in_features) * 3
    x[2, 7] = 80.0  # an activation outlier: only its group's scale grows
    ref = x @ (q.float() * scale[:, None]).t()
    y = k.linear_w8a16(x, lanes8, scale)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-4
    torch.testing.assert_close(k.linear_f32_lanes(x, lanes32), x @ weight.t(), rtol=1e-5, atol=1e-5)
    zeros = k.linear_w8a16(torch.zeros(2, in_features), lanes8, scale)
    assert torch.equal(zeros, torch.zeros_like(zeros))


@pytest.mark.parametrize("count", [1, 16, 200])  # 200: rows over several threads' tasks
def test_lanes_rows_are_the_weight_rows_times_their_scales(k, count):
    """The embedding lookup of a tied table: row ``id`` of the lanes layout, dequantized, to the bit."""
    _, q, scale, lanes8, _ = _lane_weights(64, 600, 3)
    ids = torch.randint(0, 64, (count,))
    ids[0] = 63  # the last lane of the last block
    got = k.lanes_rows(lanes8, scale, ids)
    assert torch.equal(got.view(torch.int32), (q[ids].float() * scale[ids, None]).view(torch.int32))
    with pytest.raises(RuntimeError, match="out of range"):
        k.lanes_rows(lanes8, scale, torch.tensor([64]))
    with pytest.raises(RuntimeError, match="lanes_rows"):
        k.lanes_rows(q, scale, ids)  # rows layout, not lanes


# Inputs per activation scale in linear_lanes.cpp's W8A16.
W8A16_GROUP = 256


def _w8a16_by_definition(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """linear_lanes.cpp's W8A16 arithmetic written out in torch: int16 codes per group of 256 inputs,
    exact integer dots per group, then acc = fma(float(dot), group_scale, acc) in order and acc * scale.
    float32 fma is emulated in float64 (the product of two float32 is exact there)."""
    m, k_in = x.shape
    acc = torch.zeros(m, q.shape[0], dtype=torch.float32)
    for g0 in range(0, k_in, W8A16_GROUP):
        xg = x[:, g0 : g0 + W8A16_GROUP]
        amax = xg.abs().amax(dim=1, keepdim=True)
        inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros_like(amax))
        codes = torch.round(xg * inv).clamp(-32767, 32767).to(torch.int64)
        dot = (codes @ q[:, g0 : g0 + W8A16_GROUP].to(torch.int64).t()).to(torch.float32)
        group_scale = (amax / 32767.0).to(torch.float64)
        acc = (dot.to(torch.float64) * group_scale + acc.to(torch.float64)).to(torch.float32)
    return acc * scale


@pytest.mark.parametrize("isa", ["avx2", "avx2-pairs", "vnni", "amx"])
@pytest.mark.parametrize("in_features", [576, 600, 1536])
def test_w8a16_gives_the_bits_of_its_definition_on_this_cpu(k, in_features, isa):
    """Every instruction set (AMX tiles, AVX-512 VNNI, AVX2 two blocks or one at a time, plain loops)
    computes the same integer dots and the same float epilogue, with the weight prefetch or
    without, and on AMX with a decode call's weight tiles streamed pair by pair or all gathered
    first: the bits equal the arithmetic written out in torch. 48 outputs: a pair of 16-output
    tiles and a lone one (three pairs of 8-output blocks for VNNI and the paired AVX2 kernel); 112
    outputs: three pairs and a lone tile, so a thread streams several pairs; 40 outputs: an odd
    block count, which both leave to the one-block kernel; 1-70 rows: under and over each kernel's
    row threshold, one row tile and two, and 8/4/3/1-row blocks."""
    if isa == "amx" and not k.amx_available():
        pytest.skip("this CPU (or kernel) has no AMX tiles: the vector paths are the ones that run")
    if isa == "vnni" and not k.vnni_available():
        pytest.skip("this CPU has no AVX-512 VNNI: the AVX2 paths are the ones that run")
    torch.manual_seed(5)
    x = torch.randn(70, in_features) * 2
    x[1, 3] = 60.0
    x[7, :] = 0.0
    previous, previous_prefetch, previous_streaming = k.set_w8a16_ceiling(isa), k.set_w8a16_prefetch(True), k.set_amx_streaming(True)
    try:
        for outputs in (48, 112, 40):
            _, q, scale, lanes8, _ = _lane_weights(outputs, in_features, 4)
            for rows in (1, 2, 3, 4, 5, 7, 9, 13, 16, 33, 40, 70):
                expected = _w8a16_by_definition(x[:rows], q, scale)
                for prefetch, streaming in ((True, True), (False, True), (True, False)):
                    k.set_w8a16_prefetch(prefetch)
                    k.set_amx_streaming(streaming)
                    assert torch.equal(k.linear_w8a16(x[:rows], lanes8, scale), expected), (outputs, rows, prefetch, streaming)
    finally:
        k.set_w8a16_ceiling(previous)
        k.set_w8a16_prefetch(previous_prefetch)
        k.set_amx_streaming(previous_streaming)


def test_lane_linears_do_not_depend_on_the_rows_in_the_call(k):
    """Row r's bits are the same alone, in any batch size, and wherever it sits in the batch (4-row and 1-row blocks, row tiles)."""
    _, _, scale, lanes8, lanes32 = _lane_weights(96, 576, 1)
    torch.manual_seed(3)
    x = torch.randn(150, 576)
    for name, run in (("w8a16", lambda t: k.linear_w8a16(t, lanes8, scale)), ("f32", lambda t: k.linear_f32_lanes(t, lanes32))):
        full = run(x)
        for m in (1, 2, 5, 16, 40, 65, 150):
            assert torch.equal(run(x[:m].contiguous()), full[:m]), (name, m)
        for r in (0, 3, 4, 63, 64, 149):
            assert torch.equal(run(x[r : r + 1].contiguous()), full[r : r + 1]), (name, r)
        shuffled = torch.randperm(150)
        assert torch.equal(run(x[shuffled].contiguous()), full[shuffled]), name


def test_linear_contract_refuses_mismatched_weights(k):
    """The typed contract: a wrong layout or a missing field is an error, never a silent wrong answer."""
    _, q, scale, lanes8, _ = _lane_weights(64, 576, 2)
    empty = torch.empty(0)
    rows_major = k.LinearWeights(kind=k.LinearKind.INT8_LANES, weight=q, scale=scale, dense=empty, packed=empty, bias=empty, input_bf16=False)
    with pytest.raises(RuntimeError, match="linear_w8a16"):
        k.linear(torch.randn(2, 576), rows_major)
    good = k.LinearWeights(kind=k.LinearKind.INT8_LANES, weight=lanes8, scale=scale, dense=empty, packed=empty, bias=empty, input_bf16=False)
    with pytest.raises(RuntimeError, match="linear_w8a16"):
        k.linear(torch.randn(2, 512), good)
    with pytest.raises(TypeError):
        k.LinearWeights(kind=k.LinearKind.INT8_LANES, weight=lanes8)
    assert torch.equal(k.linear(torch.ones(1, 576), good), k.linear_w8a16(torch.ones(1, 576), lanes8, scale))


@pytest.mark.parametrize("isa", ["vnni", "amx"])
def test_swiglu_gives_the_bits_of_linear_then_silu_mul(k, isa):
    """swiglu (the MLP's activation) fused into the AMX matmul's epilogue, gate block j paired with
    up block j, gives bit for bit linear_w8a16's [gate | up] and then silu_mul, for 1-70 rows (the
    fused path from AMX_MIN_ROWS on, the two calls under it and on other instruction sets); 2F =
    96 and 64 outputs: an odd and an even number of 16-output pairs."""
    if isa == "amx" and not k.amx_available():
        pytest.skip("this CPU (or kernel) has no AMX tiles: swiglu runs linear, then silu_mul")
    torch.manual_seed(8)
    x = torch.randn(70, 576) * 2
    x[2, 9] = 50.0
    empty = torch.empty(0)
    previous = k.set_w8a16_ceiling(isa)
    try:
        for outputs in (96, 64):
            _, _, scale, lanes8, _ = _lane_weights(outputs, 576, 6)
            weights = k.LinearWeights(kind=k.LinearKind.INT8_LANES, weight=lanes8, scale=scale, dense=empty, packed=empty, bias=empty, input_bf16=False)
            for rows in (1, 6, 7, 16, 17, 70):
                gate_up = k.linear_w8a16(x[:rows], lanes8, scale)
                expected = torch.empty(rows, outputs // 2)
                k.silu_mul(expected, gate_up)
                assert torch.equal(k.swiglu(x[:rows], weights, torch.float32), expected), (outputs, rows)
    finally:
        k.set_w8a16_ceiling(previous)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(k, out_dtype):
    """Vectorised exp in float32 (17 rows, 1,540 features: several pieces and a tail), a scalar one for bfloat16."""
    torch.manual_seed(0)
    f = 1540
    gu = torch.randn(17, 2 * f) * 6
    gu[0, :3] = torch.tensor([-100.0, 100.0, float("nan")])
    out = torch.empty(17, f, dtype=out_dtype)
    k.silu_mul(out, gu)
    ref = (F.silu(gu[:, :f]) * gu[:, f:]).to(out_dtype).float()
    tolerance = dict(rtol=1e-5, atol=1e-6) if out_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(out.float(), ref, equal_nan=True, **tolerance)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_model_with_and_without_kernels_agree(loaded_model, kv_cache_dtype):
    from helpers import greedy, prefill_forward
    from ember.config import EngineConfig
    from ember.engine.engine import LLMEngine

    config = EngineConfig(dtype="float32", quantization="none", kv_cache_bytes=64 * 1024 * 1024, kv_cache_dtype=kv_cache_dtype)
    fused = LLMEngine(config=config, loaded=loaded_model)
    plain = LLMEngine(config=config, loaded=loaded_model)
    plain.model = type(plain.model)(loaded_model.config, loaded_model.weights, torch.float32, "none", torch.device("cpu"), plain.max_model_len, use_kernels=False)
    plain.runner.model = plain.model
    assert fused.model.kernels is not None and plain.model.kernels is None
    ids = fused.tokenizer.encode("The fused kernels must not change the answer.")
    # With a float16 cache a float32 rounding difference in the rotary (torch's and the
    # kernel's) can round a key to the neighbouring float16: measured up to 0.006 in a logit.
    atol = 1e-3 if kv_cache_dtype == "auto" else 1e-2
    torch.testing.assert_close(prefill_forward(fused, ids), prefill_forward(plain, ids), rtol=1e-4, atol=atol)
    for engine in (fused, plain):
        engine.add_request("g", ids, greedy(12, ignore_eos=True))
    from helpers import final_tokens, run_all

    assert final_tokens(run_all(fused)["g"]) == final_tokens(run_all(plain)["g"])


@pytest.mark.parametrize(
    ("quantization", "batch_invariant"), [("none", True), ("int8", True), ("none", False), ("int8", False), ("int4", False)]
)
def test_compiled_decode_loop_matches_per_layer_path(loaded_model, quantization, batch_invariant):
    """decode_layers (the whole stack in C++) against the same model layer by layer in Python."""
    from helpers import final_tokens, greedy, run_all
    from ember.config import EngineConfig
    from ember.engine.engine import LLMEngine

    config = EngineConfig(dtype="float32", quantization=quantization, kv_cache_bytes=64 * 1024 * 1024, batch_invariant=batch_invariant)
    compiled = LLMEngine(config=config, loaded=loaded_model)
    layered = LLMEngine(config=config, loaded=loaded_model)
    assert compiled.model._decode_plan is not None
    layered.model._decode_plan = None
    prompts = [compiled.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in ("Name three fruits.", "Count to five.", "Say hi.")]
    for engine in (compiled, layered):
        for i, ids in enumerate(prompts):
            engine.add_request(f"p{i}", ids, greedy(20, ignore_eos=True))
    a, b = run_all(compiled), run_all(layered)
    for i in range(len(prompts)):
        assert final_tokens(a[f"p{i}"]) == final_tokens(b[f"p{i}"])


@pytest.mark.parametrize("in_features", [576, 600])  # 600: the 16-wide and scalar tails, and no bfloat16 path
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 21])
def test_int8_gemv_matches_dequantized_matmul(k, rows, in_features):
    """One row (four accumulator chains), then blocks of 8, 4 and 1 rows, all in float32."""
    from ember.model.quant import quantize_per_channel_int8

    torch.manual_seed(rows)
    weight = torch.randn(200, in_features) * 0.05
    q, scale = quantize_per_channel_int8(weight)
    x = torch.randn(rows, in_features)
    ref = x @ (q.float() * scale[:, None]).t()
    y = k.gemv_int8(x, q, scale)
    tolerance = 1e-5
    assert ((y - ref).norm() / ref.norm()).item() < tolerance
    torch.testing.assert_close(y, ref, rtol=0, atol=tolerance * ref.abs().max().item() * 4)


@pytest.mark.parametrize("rows", [1, 9, 16, 21, 64])
def test_packed_bf16_gemm_matches_the_dense_copy(k, rows):
    """The packed layout (N/16, K/2, 16, 2) gives the row-major bfloat16 copy's products, in float32."""
    from ember.model.quant import pack_bf16_for_kernels

    if k.packed_max_rows == 0:
        pytest.skip("this CPU build has no AVX512-BF16: the packed kernel is never used here")
    torch.manual_seed(rows)
    dense = (torch.randn(96, 576) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, 576)
    y = k.gemm_bf16_packed(x, pack_bf16_for_kernels(dense))
    ref = x.to(torch.bfloat16).float() @ dense.float().t()  # the kernel rounds x to bfloat16 too
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 20])  # 20: the scalar tail after one vector
def test_pack_kv_int8_gathers_and_quantizes_to_the_same_bits_as_torch(k, head_dim, pool_dtype) -> None:
    from ember.engine import warm_storage as ws

    torch.manual_seed(0)
    layers, blocks, block_size, heads = 3, 7, 4, 2
    kv = torch.randn(layers, 2, blocks, block_size, heads, head_dim) * 3
    kv[0, 0, 2] = 0.0  # an all-zero row: the scale floor
    kv[1, 1, 4, 0, 0, 0] = 1e4  # one outlier dominates its row
    kv[2, 0, 5, 1, 1, :] = torch.linspace(-127, 127, head_dim) / 127 * 0.5  # a row over the whole int8 range
    kv = kv.to(pool_dtype)
    ids = [5, 0, 2, 4]
    data, scales = k.pack_kv_int8(kv.view(layers, 2, blocks, -1), torch.tensor(ids), head_dim)
    expected = ws.pack(kv[:, :, ids], "int8")
    assert torch.equal(data.view_as(expected.data), expected.data)
    assert torch.equal(scales.view_as(expected.scales), expected.scales)
    with pytest.raises(RuntimeError, match="out of range"):
        k.pack_kv_int8(kv.view(layers, 2, blocks, -1), torch.tensor([blocks]), head_dim)


def _kept_by_definition(row: torch.Tensor, temperature: float, top_p: float, min_p: float) -> tuple[list[int], list[float]]:
    """sample_rows' contract written out in float64, up to the draw: the nucleus in descending order
    (ties: lower id first), then min-p. Returns the kept ids in that order and their weights."""
    x = torch.nan_to_num(row.double() / temperature, nan=-3e38, posinf=3e38, neginf=-3e38)
    e = torch.exp(x - x.max()).tolist()
    order = sorted(range(len(e)), key=lambda i: (-e[i], i))
    total, kept, before = sum(e), [], 0.0
    for i in order:
        if kept and top_p < 1.0 and before >= top_p * total:
            break
        kept.append(i)
        before += e[i]
    kept = [i for i in kept if e[i] >= min_p]
    return kept, [e[i] for i in kept]


def _inverse_cdf(kept: tuple[list[int], list[float]], u: float) -> int:
    """The first kept token whose cumulative weight exceeds u times the kept total."""
    ids, weights = kept
    total, cumulative = sum(weights), 0.0
    for i, w in zip(ids, weights, strict=True):
        cumulative += w
        if cumulative > u * total:
            return i
    return ids[-1]


@pytest.mark.parametrize(
    ("tail", "temperature", "top_p", "min_p"),
    [
        (None, 0.7, 0.9, 0.0),  # a peaked row: the nucleus is a few tokens above the first cutoff (1e-2)
        (None, 1.0, 1.0, 0.05),  # no top-p: min-p over the whole row, in id order
        (-6.0, 1.0, 0.9, 0.0),  # tail tokens of e ~ 2.5e-3 hold most of the mass: the 1e-4 cutoff
        (-11.0, 1.0, 0.97, 0.0),  # tail tokens of e ~ 1.7e-5 are needed: the 1e-6 cutoff
        (-14.5, 1.0, 0.9995, 0.0),  # tail tokens of e ~ 5e-7 are needed: every token is sorted
    ],
)
def test_sample_rows_draws_the_inverse_cdf_of_the_kept_tokens(k, tail, temperature, top_p, min_p):
    """Away from the boundaries between tokens (where float32 and float64 sums may disagree), the
    token for each uniform is exactly the definition's: nucleus, min-p and inverse CDF; at u near 1
    the draw lands in the nucleus's last tokens, so the cutoff chosen kept every token it needed."""
    torch.manual_seed(11)
    v = 4000
    if tail is None:
        row = torch.randn(v) * 2.0
        row[:5] += 9.0
    else:  # one token of e = 1, then tail tokens on 100 levels 1e-3 apart (ties broken by id, as specified)
        row = torch.full((v,), tail) + torch.randint(0, 100, (v,)) * 1e-3
        row[7] = 0.0
    row[3] = float("nan")
    row[4] = float("-inf")
    logits = row[None].contiguous()
    params = [torch.tensor([value], dtype=torch.float32) for value in (temperature, top_p, min_p)]
    draw = lambda u: int(k.sample_rows(logits, *params, torch.tensor([u], dtype=torch.float32)))  # noqa: E731
    kept = _kept_by_definition(row, temperature, top_p, min_p)
    checked = 0
    for u in torch.linspace(0.003, 0.997, 60).tolist() + torch.linspace(0.9, 0.999, 40).tolist():
        expected = _inverse_cdf(kept, u)
        neighbours = {_inverse_cdf(kept, u + d) for d in (-3e-6, 3e-6)}
        if neighbours != {expected}:
            continue  # u sits on a boundary between two tokens
        assert draw(u) == expected, u
        checked += 1
    assert checked >= 30
    last = _inverse_cdf(kept, 0.9999999)
    if tail is not None:
        assert last != 7 and draw(0.9999999) != 7, "the nucleus reaches into the tail"


def test_w8a16_prefetch_switch_returns_its_previous_state(k):
    """The bench's switch for the weight prefetch is on by default and says what it was."""
    assert k.set_w8a16_prefetch(False) is True
    try:
        assert k.set_w8a16_prefetch(False) is False
    finally:
        assert k.set_w8a16_prefetch(True) is False


def test_w8a16_ceiling_names_its_paths_and_rejects_others(k):
    """The one switch over the W8A16 paths returns the previous ceiling and refuses a name it does not know, unchanged."""
    previous = k.set_w8a16_ceiling("avx2")
    try:
        assert k.set_w8a16_ceiling("avx2-pairs") == "avx2"
        with pytest.raises(RuntimeError, match="unknown path 'sse'"):
            k.set_w8a16_ceiling("sse")
        assert k.set_w8a16_ceiling("vnni") == "avx2-pairs"
    finally:
        k.set_w8a16_ceiling(previous)
    assert previous == "amx"


@pytest.mark.parametrize("vocab", [1, 5, 16, 37, 49152])
def test_argmax_rows_gives_torch_argmax(k, vocab):
    """The greedy sampler's pass: torch's index on every row, including ties (the first wins), rows
    with one NaN or several (the first NaN wins), infinities, signed zeros and rows of -inf, for
    lengths under, at and over a vector's 16 lanes."""
    torch.manual_seed(vocab)
    rows = [torch.randn(vocab), torch.randn(vocab).round(), torch.full((vocab,), float("-inf")), torch.zeros(vocab)]
    tied = torch.randn(vocab)
    tied[vocab // 3] = tied[(2 * vocab) // 3] = tied.max() + 1
    signed = torch.full((vocab,), -1.0)
    signed[vocab // 2 :] = 0.0
    signed[vocab // 4] = -0.0
    rows += [tied, signed]
    for spots in ([vocab - 1], [vocab // 2, vocab // 5], [0]):
        nan = torch.randn(vocab)
        nan[spots] = float("nan")
        rows.append(nan)
    inf = torch.randn(vocab)
    inf[vocab // 3] = float("inf")
    inf[vocab - 1] = float("inf")
    rows.append(inf)
    logits = torch.stack(rows)
    assert torch.equal(k.argmax_rows(logits), logits.argmax(dim=-1))
