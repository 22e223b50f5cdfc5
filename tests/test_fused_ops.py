"""The lean forward's fused C++ ops against their PyTorch references (tornchat/engine/fused.py)."""
import pytest
import torch

from tornchat.engine import blocks, fused

from runners import lean

DTYPES = [torch.float32, torch.bfloat16]


def test_the_extension_is_built():
    # The README's install builds it; without it the references run and decode is slower, not wrong.
    assert fused.NATIVE is not None, "tornchat/engine/_fused is not built: pip install --no-build-isolation -e ."
    assert fused.ops_for(torch.device("cpu"), torch.float32) is fused.NATIVE
    assert fused.ops_for(torch.device("cpu"), torch.bfloat16) is fused.REFERENCE  # C++ ops take fp32 residuals
    assert fused.ops_for(torch.device("meta"), torch.float32) is fused.REFERENCE


@pytest.fixture
def two_threads():
    """At least two threads for the C++ loops, so that a team (csrc/team.h) has a helper on any machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("n,grain", [(1, 1), (2, 1), (3, 1), (7, 2), (10, 16), (100, 16), (1000, 1)])
def test_a_team_hands_out_the_parts_at_parallel_for_does(two_threads, n, grain):
    # Each loop's parts, and so what every part computes, are the same inside a forward's team as outside it;
    # successive loops in one team each cover the range once, and a loop nested in a part visits all of it.
    teamed = fused._native._team_parts(n, grain, 3, True)
    assert teamed == fused._native._team_parts(n, grain, 3, False)
    assert sorted(i for first, last, _ in teamed for i in range(first, last)) == sorted(list(range(n)) * 3)
    assert all(visited == last - first for first, last, visited in teamed)


@pytest.mark.parametrize("fail_at", [3, 40])  # in the calling thread's part, in the helper's
def test_an_error_in_a_teams_loop_reaches_the_caller(two_threads, fail_at):
    with pytest.raises(RuntimeError, match="failed"):
        fused._native._team_parts(50, 1, 4, True, fail_at)
    assert len(fused._native._team_parts(50, 1, 2, True)) == 4  # the threads are free again


@pytest.mark.parametrize("team", [True, False])
def test_shared_items_are_each_taken_once_and_a_thread_done_early_takes_from_another(two_threads, team):
    # team::share (a product's chunks of columns): each thread starts on its own run, parallel_for's part; the
    # calling thread's run is made slow, so that the others, done with theirs, take its last items.
    n = 12 * torch.get_num_threads()
    mine = n // torch.get_num_threads()
    done = fused._native._team_shared(n, mine, 5000, team)
    assert [item for item, _ in done] == list(range(n))
    taken = [item for item, by_caller in done if item < mine and not by_caller]
    assert mine - 1 in taken and 0 not in taken  # from the back of the run, never its first (the caller's)
    assert not any(by_caller for item, by_caller in done if item >= mine)  # the caller busy with its own


@pytest.mark.parametrize("hidden", [576, 100])  # the squares' 8 lanes whole, and with 4 values over
@pytest.mark.parametrize("bf16_out", [False, True])
def test_rms_norm(bf16_out, hidden):
    x, weight = torch.randn(3, hidden) * 4, torch.rand(hidden) + 0.5
    got, expected = fused.NATIVE.rms_norm(x, weight, 1e-5, bf16_out), fused.rms_norm_ref(x, weight, 1e-5, bf16_out)
    assert got.dtype == expected.dtype == (torch.bfloat16 if bf16_out else torch.float32)
    # fp32 sums in another order; bf16 rounds once, so at most one unit in the last place apart.
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-5, rtol=1e-5 if not bf16_out else 2**-7)
    # Semantics, independent of both: unit root-mean-square before the weight.
    plain = fused.rms_norm_ref(x, torch.ones(hidden), 1e-5, False)
    torch.testing.assert_close(plain.pow(2).mean(-1), torch.ones(3), atol=1e-4, rtol=0)
    # Each row by itself: a row alone gets the bits it gets among others.
    assert torch.equal(fused.NATIVE.rms_norm(x[1:2], weight, 1e-5, bf16_out), got[1:2])


@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("in_dtype", DTYPES)
def test_rope_store(in_dtype, kv_dtype, normed):
    heads, kv_heads, head_dim, rows, start = 9, 3, 64, 5, 7
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim).to(in_dtype)
    angles = torch.rand(rows, head_dim // 2) * 6
    freqs = torch.view_as_real(torch.polar(torch.full_like(angles, 1.1), angles)).contiguous()
    qk_norm = torch.ones(2, head_dim) if normed else None  # Qwen3's per-head norms (their weights: test_llama_runner)
    results = []
    for rope_store in (fused.NATIVE.rope_store, fused.rope_store_ref):
        cache = torch.zeros(2, 16, kv_heads, head_dim, dtype=kv_dtype)
        queries = rope_store(qkv, freqs, cache[0, start : start + rows], cache[1, start : start + rows], heads, kv_heads,
                             qk_norm, 1e-6)
        results.append((queries, cache))
    (got_q, got_cache), (ref_q, ref_cache) = results
    assert got_q.shape == (rows, heads, head_dim) and got_q.dtype == ref_q.dtype == kv_dtype
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if kv_dtype == torch.float32 else {"atol": 1e-2, "rtol": 2**-7}
    torch.testing.assert_close(got_q.float(), ref_q.float(), **tolerance)
    torch.testing.assert_close(got_cache.float(), ref_cache.float(), **tolerance)
    assert got_cache[:, :start].eq(0).all() and got_cache[:, start + rows :].eq(0).all()  # only its rows written
    # Values are copied, not rotated; a rotation keeps each pair's length, times the magnitude 1.1.
    torch.testing.assert_close(got_cache[1, start : start + rows].float(), qkv[:, -kv_heads * head_dim :].float().to(kv_dtype).float().view(rows, kv_heads, head_dim))
    pairs = qkv[:, : heads * head_dim].float().view(rows, heads, -1, 2)
    if normed:  # unit root-mean-square per head, then rotated: each head's norm is sqrt(head_dim) times 1.1
        torch.testing.assert_close(got_q.float().norm(dim=-1), torch.full((rows, heads), 1.1 * head_dim ** 0.5), **tolerance)
    else:
        torch.testing.assert_close(got_q.float().view(rows, heads, -1, 2).norm(dim=-1), 1.1 * pairs.norm(dim=-1), **tolerance)


@pytest.mark.parametrize("head_dim", [64, 6])  # 6: not a multiple of 8, the scalar loop on every CPU
def test_rope_rotation_rounds_each_product(head_dim):
    """The rotation is a c - b s and a s + b c with each product rounded to fp32 before the sum (no fused
    multiply-add), in the vector loop as in the scalar one: exactly what torch's separate products and sums give."""
    heads, kv_heads, rows = 3, 1, 4
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim)
    freqs = torch.randn(rows, head_dim // 2, 2)
    cache = torch.zeros(2, rows, kv_heads, head_dim)
    queries = fused.NATIVE.rope_store(qkv, freqs, cache[0], cache[1], heads, kv_heads)
    pairs = qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, -1, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = freqs[:, None, :, 0], freqs[:, None, :, 1]
    expected = torch.stack([a * c - b * s, a * s + b * c], dim=-1).view(rows, heads + kv_heads, head_dim)
    assert torch.equal(queries, expected[:, :heads])
    assert torch.equal(cache[0], expected[:, heads:])


@pytest.mark.parametrize("gate", ["silu_mul", "gelu_mul"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activations(dtype, gate):
    gate_up = (torch.randn(4, 2 * 1536) * 3).to(dtype)
    got, expected = getattr(fused.NATIVE, gate)(gate_up), getattr(fused.REFERENCE, gate)(gate_up)
    assert got.shape == (4, 1536) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 2**-7)


@pytest.mark.parametrize("gate", ["silu_mul", "gelu_mul"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activations_give_the_same_bits_on_every_path_and_alone(dtype, gate):
    """The gate runs in 16-lane vectors on the attention's path: AVX2, AVX-512 and the baseline (x86-64 without
    AVX2, aarch64) make the same operations and the same fused multiply-adds (vec.h), so the same bits; a row's
    bits do not depend on the rows beside it; a width that is no multiple of 16 is padded, not computed
    otherwise."""
    paths = blocks.isas()
    gate_up = (torch.randn(5, 2 * 1000) * 4).to(dtype)
    op = getattr(fused._native, gate)
    outs = {isa: op(gate_up, isa=isa) for isa in paths}
    for isa in paths:
        assert torch.equal(outs[isa], outs[paths[0]]), isa
    assert torch.equal(torch.cat([op(gate_up[i : i + 1], isa=paths[0]) for i in range(5)]), outs[paths[0]])
    torch.testing.assert_close(outs[paths[0]].float(), getattr(fused.REFERENCE, gate)(gate_up).float(),
                               atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 2**-7)


def rounding_slack(q, keys, values, start, scale, window=0, reference=None, near=256):
    """How far attend's output may lie from attend_ref's because a bf16 cache's weights are rounded to bf16: a
    weight whose fp32 value lies within ``near`` fp32 ulps of a midpoint between two bf16 may round either way
    where the scores and the exponential differ in their last bits (the kernels' from the reference's). Each such
    weight moves an output by at most a bf16 ulp of the weight times |v - out| / total; zero for an fp32 cache,
    whose weights are not rounded. reference: attend_ref's output where the caller has it.
    [n, heads * head_dim]."""
    n, heads, head_dim = q.shape
    if keys.dtype != torch.bfloat16:
        return torch.zeros(n, heads * head_dim)
    groups = heads // keys.shape[1]
    if reference is None:
        reference = fused.attend_ref(q, keys, values, start, scale, window)
    out = reference.reshape(n, heads, head_dim)
    slack = torch.zeros(n, heads, head_dim)
    for r in range(n):
        seen = start + r + 1
        first = max(0, seen - window) if window else 0
        k = keys[first:seen].float().transpose(0, 1).repeat_interleave(groups, dim=0)
        v = values[first:seen].float().transpose(0, 1).repeat_interleave(groups, dim=0)
        scores = scale * (k @ q[r].to(keys.dtype).float()[:, :, None])[..., 0]
        weights = (scores - scores.amax(-1, keepdim=True)).exp()  # [heads, seen]
        bits = weights.view(torch.int32)
        either_way = ((bits & 0xFFFF) - 0x8000).abs() <= near
        bf16_ulp = (bits & 0x7F800000).view(torch.float32) * 2.0**-7
        step = torch.where(either_way, bf16_ulp, 0.0) / weights.to(torch.bfloat16).float().sum(-1, keepdim=True)
        slack[r] = (step[:, :, None] * (v - out[r][:, None, :]).abs()).sum(1)
    return slack.reshape(n, heads * head_dim)


def assert_attends_as_the_reference(got, q, keys, values, start, scale, window, atol, rtol):
    reference = fused.attend_ref(q, keys, values, start, scale, window)
    allowed = atol + rtol * reference.abs() + rounding_slack(q, keys, values, start, scale, window, reference)
    worst = ((got - reference).abs() - allowed).max()
    assert worst <= 0, f"{worst:.3g} past the tolerance"


@pytest.mark.parametrize("window", [0, 5, 20])  # Gemma 3's sliding windows: inside a key block, across blocks
@pytest.mark.parametrize("kv_dtype", DTYPES)
# A step's tiles of up to 4 queries sum two chunks of 16 dims per pass on AVX-512, a prefill's of 8 one: 80 dims
# are two such passes and one single chunk.
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (4, 1, 256), (6, 2, 80)])
def test_attend_is_the_reference_and_each_row_is_as_if_alone(kv_dtype, heads, kv_heads, head_dim, window):
    start, n, capacity = 37, 6, 64
    cache = torch.randn(2, capacity, kv_heads, head_dim).to(kv_dtype)
    q = torch.randn(n, heads, head_dim).to(kv_dtype)
    scale = head_dim ** -0.5

    def attend(q, cache, start):
        keys, values = fused.forward_layout(cache)
        return fused.attend(q, keys, values, start, scale, window)

    got = attend(q, cache, start)
    assert got.shape == (n, heads * head_dim) and got.dtype == torch.float32
    assert_attends_as_the_reference(got, q, cache[0], cache[1], start, scale, window, atol=2e-6, rtol=1e-5)
    if window:  # positions before a row's window change none of its bits
        cache[:, : start - window + 1] = torch.randn_like(cache[:, : start - window + 1])
        assert torch.equal(attend(q, cache, start), got)
    for r in range(n):  # the bits a one-row step at position start + r gets, whatever rows come with it
        assert torch.equal(got[r], attend(q[r : r + 1], cache, start + r)[0])
    # Positions past a row's own are never read: changing them (to anything, NaN included) changes only the rows
    # that see them.
    cache[:, start + 3 :] = float("nan")
    changed = attend(q, cache, start)
    assert torch.equal(changed[:3], got[:3]) and changed[3:].isnan().all()


def attention_paths() -> list[str]:
    """The attention paths a test can name on this CPU: the block kernels' (generic: the baseline loops), and
    "avx512f" where the CPU has AVX-512: on a CPU with AVX-512 BF16 the AVX-512 paths take VDPBF16PS for a bf16
    cache's scores, and "avx512f" the AVX-512 loops without it, so that those are compared too."""
    paths = blocks.isas()
    if {"avx512vnni", "amx"} & set(paths):
        paths.append("avx512f")
    return paths


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (32, 8, 64), (16, 8, 128), (4, 1, 256), (6, 2, 80)])
def test_attention_gives_the_same_bits_on_every_path(kv_dtype, heads, kv_heads, head_dim):
    """The AVX2 loops (16 lanes as two vectors of 8, their own tile) and the baseline's (x86-64 without AVX2,
    aarch64: 16 lanes as vectors of 4, a tile of one query) make the fused multiply-adds of the AVX-512 ones (vec.h's
    fmadd) in the same order, and VDPBF16PS the same two per pair of dims, so an AVX2-only machine, or an ARM one,
    gets the bits an AVX-512 one gets. Decode steps, a verify, a prefill chunk, windows; fp32 queries over a bf16
    cache are rounded to bf16 first, on every path."""
    paths = attention_paths()
    torch.manual_seed(head_dim + heads)
    scale = head_dim ** -0.5
    for start, n, window in [(0, 9, 0), (37, 6, 20), (300, 1, 0), (1000, 3, 0), (400, 130, 0), (400, 130, 100)]:
        cache = (torch.randn(2, (start + n + 15) // 16 * 16, kv_heads, head_dim) * 3).to(kv_dtype)
        q = torch.randn(n, heads, head_dim) * 2
        keys, values = fused.forward_layout(cache)
        outs = {isa: fused.attend(q, keys, values, start, scale, window, isa) for isa in paths}
        for isa in paths:
            assert torch.equal(outs[isa], outs[paths[0]]), (isa, start, n, window)
            rounded = fused.attend(q.to(kv_dtype), keys, values, start, scale, window, isa)
            assert torch.equal(rounded, outs[paths[0]]), (isa, start, n, window)


DENORMAL_SHAPE = (40, 3, 8, 2, 64)  # start, rows, heads, KV heads, head_dim


def denormal_case(seed: int) -> tuple[list[str], torch.Tensor]:
    """The attention paths and a random fp32 cache of DENORMAL_SHAPE, keys then values, for a test to make tiny."""
    paths = attention_paths()
    torch.manual_seed(seed)
    start, n, heads, kv_heads, head_dim = DENORMAL_SHAPE
    return paths, torch.randn(2, (start + n + 15) // 16 * 16, kv_heads, head_dim)


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_scores_whose_products_are_denormal_are_flushed_on_every_path(kv_dtype):
    """VDPBF16PS flushes a denormal sum to zero whatever MXCSR says, so the other paths' multiply-adds flush
    theirs: queries and keys of 2^-66 (normal numbers) have products of 2^-132 (denormal), every score is 0 and
    each row's output is the plain mean of the values it sees, at a scale (2^120) that would have made the
    unflushed scores differ."""
    paths, cache = denormal_case(seed=3)
    start, n, heads, kv_heads, head_dim = DENORMAL_SHAPE
    cache[0] = cache[0].sign() * 2.0 ** -66
    cache = cache.to(kv_dtype)
    q = (torch.randn(n, heads, head_dim).sign() * 2.0 ** -66).to(kv_dtype)
    keys, values = fused.forward_layout(cache)
    for isa in paths:
        got = fused.attend(q, keys, values, start, 2.0 ** 120, 0, isa).reshape(n, heads, head_dim)
        for r in range(n):
            mean = cache[1, : start + r + 1].float().mean(0).repeat_interleave(heads // kv_heads, dim=0)
            torch.testing.assert_close(got[r], mean, atol=1e-6, rtol=1e-5)


def test_weighted_values_whose_products_are_denormal_are_flushed_on_every_path():
    """With AVX-512 BF16 a bf16 cache's weighted values take VDPBF16PS, which flushes a denormal product or sum to
    zero, so the other paths' multiply-adds flush theirs: values of about 2^-125 (normal) times weights below one
    make denormal products, and every path gives the same bits; the flush leaves less than the unflushed sum (a
    product below 2^-126 adds nothing)."""
    paths, cache = denormal_case(seed=4)
    start, n, heads, kv_heads, head_dim = DENORMAL_SHAPE
    cache[1] = 2.0**-125 * (1 + cache[1].abs())
    cache = cache.to(torch.bfloat16)
    q = torch.randn(n, heads, head_dim).to(torch.bfloat16)
    keys, values = fused.forward_layout(cache)
    outs = {isa: fused.attend(q, keys, values, start, head_dim ** -0.5, 0, isa) for isa in paths}
    for isa in paths:
        assert torch.equal(outs[isa], outs[paths[0]]), isa
    unflushed = fused.attend_ref(q.double(), cache[0].double(), cache[1].double(), start, head_dim ** -0.5)
    assert (outs[paths[0]].double() < unflushed).float().mean() > 0.9


@pytest.mark.parametrize("window", [0, 512])
@pytest.mark.parametrize("kv_dtype", DTYPES)
# One KV head's tile of 4 (Gemma 3 1B), 3 tiles of 3 (the 135M), 3 tiles of 8, 8 and 4 queries (on AVX2 4 tiles
# of up to 6, which the threads share evenly), 3 tiles of one query.
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 1, 256), (9, 3, 64), (20, 1, 64), (3, 3, 64)])
def test_a_long_cache_shared_between_threads_gives_each_row_its_bits(kv_dtype, heads, kv_heads, head_dim, window):
    """From 1,024 positions, a step whose few tiles the threads cannot share evenly has each tile's scores,
    softmax and weighted values shared out apart (attend_many's split); a prefill chunk's many tiles are not.
    A row gets the same bits either way, and the reference's values."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(heads + head_dim)
        start, n = 1100, 6
        cache = (torch.randn(2, (start + n + 15) // 16 * 16, kv_heads, head_dim) * 2).to(kv_dtype)
        q = (torch.randn(n, heads, head_dim) * 2).to(kv_dtype)
        keys, values = fused.forward_layout(cache)
        scale = head_dim ** -0.5
        # Each vector path's tiles and passes (generic's tiles of one query are too many to split here).
        for isa in [isa for isa in blocks.isas() if isa != "generic"] or ["generic"]:
            together = fused.attend(q, keys, values, start, scale, window, isa)
            # Averages of values of size ~2 over up to 1,100 positions: the sums' order moves the last bits.
            assert_attends_as_the_reference(together, q, cache[0], cache[1], start, scale, window, atol=2e-5, rtol=1e-4)
            for r in range(n):
                alone = fused.attend(q[r : r + 1], keys, values, start + r, scale, window, isa)[0]
                assert torch.equal(alone, together[r]), (isa, r)
    finally:
        torch.set_num_threads(threads)


def test_attention_refuses_a_path_this_cpu_does_not_run():
    keys, values = fused.forward_layout(torch.zeros(2, 16, 1, 64))
    with pytest.raises(RuntimeError, match="isa='vliw' is not an instruction-set path this CPU runs"):
        fused.attend(torch.zeros(1, 1, 64), keys, values, 0, 1.0, 0, "vliw")


@pytest.mark.parametrize("kv_dtype", DTYPES)
def test_the_forward_layout_is_a_permutation(kv_dtype):
    cache = torch.randn(3, 2, 48, 2, 32).to(kv_dtype)
    laid = fused.forward_layout(cache)
    assert laid.shape == cache.shape and not torch.equal(laid, cache)
    assert torch.equal(fused.standard_layout(laid), cache)
    # A prefix of whole key blocks is a prefix of the memory: what growing and forking a cache copy.
    assert torch.equal(fused.forward_layout(cache[:, :, :16].contiguous()), laid[:, :, :16])


def test_bad_inputs_raise_instead_of_crashing():
    with pytest.raises(RuntimeError, match="contiguous"):
        fused.NATIVE.rms_norm(torch.randn(576, 3).T, torch.ones(576), 1e-5, False)
    with pytest.raises(RuntimeError, match="fp32"):
        fused.NATIVE.rms_norm(torch.randn(3, 576).double(), torch.ones(576), 1e-5, False)
    with pytest.raises(RuntimeError, match="qkv width"):
        fused.NATIVE.rope_store(torch.randn(1, 100), torch.randn(1, 32, 2), torch.zeros(1, 3, 64), torch.zeros(1, 3, 64), 9, 3)


def test_the_cpp_forward_keeps_its_input_and_checks_the_caches(tiny_model):
    """The forward updates the residual stream in place, in its own copy: the embeddings it is given stay as they
    were. It reads and writes the caches through pointers, so a cache of another shape or dtype is refused."""
    runner = lean(tiny_model, "int8")
    cache = runner.new_cache()
    runner.reserve(cache, 5)
    x = runner._embed(torch.tensor([3, 1, 4, 1, 5]))
    given = x.clone()
    out = runner.step.forward(x, [cache.kv], runner.rope.rows(0, 5), [0], [5], None, [], [])
    assert torch.equal(x, given) and out.shape == x.shape and not torch.equal(out, x)
    for bad in (cache.kv.double(), cache.kv[:, :, :, :1].contiguous(), cache.kv.transpose(3, 4)):
        with pytest.raises(RuntimeError, match="cache"):
            runner.step.forward(x, [bad], runner.rope.rows(0, 5), [0], [5], None, [], [])


@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("quantize", ["none", "int8", "int4", "bf16"])
@pytest.mark.parametrize("model_name", ["tiny_model", "tiny_qwen2", "tiny_qwen3", "tiny_gemma3"])
def test_the_cpp_forward_is_the_python_loop(model_name, quantize, kv_dtype, request):
    """Forward runs _layers' loop in C++ (biases included): the same caches and logits, prefill and steps, but
    for the last bits of its own norms and attention (fused.attend, which computes each row as if alone)."""
    model = request.getfixturevalue(model_name)
    cpp, loop = lean(model, quantize, kv_dtype=kv_dtype), lean(model, quantize, kv_dtype=kv_dtype)
    loop.step = None
    assert cpp.step is not None and cpp.ops is fused.NATIVE
    caches = cpp.new_cache(), loop.new_cache()
    # Gemma 3's post-norms scale each attention and MLP output up to unit size, and with them a bf16 cache's or an
    # int8 activation's rounding (the two paths round alike but for the last bits, which can pick the next level):
    # 0.03 on logits up to about 0.6 (in fp32 without int8 activations the two agree to 1e-6), 5% of the cache.
    gemma = model_name == "tiny_gemma3"
    atol = 3e-2 if gemma else 1e-2
    prefilled = [runner.forward(list(range(20, 45)), cache) for runner, cache in zip((cpp, loop), caches)]
    torch.testing.assert_close(prefilled[0], prefilled[1], atol=atol, rtol=1e-2)
    for token in (7, 8, 9, 10):
        got, expected = (runner.forward([token], cache, decode=True) for runner, cache in zip((cpp, loop), caches))
        torch.testing.assert_close(got, expected, atol=atol, rtol=1e-2)
    assert caches[0].length == caches[1].length == 29
    # Within 1% of the cache's largest value: int8 activations round to 1/127 of their block's largest, and
    # Qwen3's per-head norms scale that up for heads whose keys are small.
    expected = loop.positions(caches[1]).float()
    torch.testing.assert_close(cpp.positions(caches[0]).float(), expected, atol=(5e-2 if gemma else 1e-2) * float(expected.abs().max()),
                               rtol=1e-2)
