"""The row kernels (AMX-BF16, AVX512-BF16 and AVX2) for products of a few rows: right products, rows independent,
used where they should be. Each kernel test runs once per instruction set this CPU has (a Zen 4 runs the AVX512-BF16
and AVX2 ones, a Sapphire Rapids all three)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflashkit.kernels import row_kernels
from dflashkit.kernels.linear import PackedLinear
from dflashkit.kernels.ops import Matmul

SUPPORTED = [name for name, isa in row_kernels.ISAS.items() if isa.supported()]


@pytest.fixture(params=SUPPORTED or [pytest.param(None, marks=pytest.mark.skip(reason="no AVX2 or AVX512-BF16 here"))])
def isa(request, monkeypatch):
    """Runs the test with DFLASHKIT_CPU_GEMM set to one instruction set this CPU has (skips where its kernel
    cannot be built)."""
    monkeypatch.setenv("DFLASHKIT_CPU_GEMM", request.param)
    if row_kernels.kernel() is None:
        pytest.skip(f"the {request.param} kernel could not be built here")
    return request.param


def bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def close_to_fp32(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """got = x @ w.T + b in fp32, rounded once to bf16 (the sum order differs: allow a bf16 ulp or two)."""
    ref = x.float() @ w.float().T + (b.float() if b is not None else 0)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    assert ((got.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-3).all()


def test_the_kernels_parallel_loops_use_torchs_threads(isa):
    """at::parallel_for is compiled into the kernel: without -fopenmp there it ran on one thread (found in session
    12: every product and attention of a decoding step had used one of the two cores)."""
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert row_kernels.kernel().parallel_threads() == threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("n,k", [(200, 96), (64, 64), (1, 8), (130, 34), (1000, 576)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 16])
def test_product_matches_fp32_with_bias_and_ragged_columns(isa, n, k, rows):
    w, b, x = bf16(n, k, seed=n), bf16(n, seed=k), bf16(rows, k, seed=rows)
    with torch.inference_mode():
        got = row_kernels.linear(x, row_kernels.pack(w), n, b.float())
        plain = row_kernels.linear(x, row_kernels.pack(w), n)
    close_to_fp32(got, x, w, b)
    close_to_fp32(plain, x, w, None)


@pytest.mark.parametrize("vocab", [16, 17, 31, 300, 49152])
def test_argmax_is_torchs_argmax_with_ties_infinities_and_nans(isa, vocab):
    """Logits rounded to whole numbers tie often: the first largest wins, as torch's; +inf beats everything, a row of
    -inf gives 0, a NaN anywhere (in the 16-wide body or the tail) gives the first NaN's index."""
    g = torch.Generator().manual_seed(vocab)
    for trial in range(40):
        x = (torch.randn(5, vocab, generator=g) * 2).round().to(torch.bfloat16)
        x[1] = float("-inf")
        x[2, vocab // 3] = x[2, vocab - 1] = float("inf")
        if trial % 2:
            x[3, int(torch.randint(0, vocab, (1,), generator=g))] = float("nan")
            x[3, vocab - 1] = float("nan")
        with torch.inference_mode():
            got = row_kernels.argmax(x)
        assert got is not None and torch.equal(got, x.float().argmax(-1))
    assert torch.equal(row_kernels.argmax(x.view(5, 1, vocab)), x.float().argmax(-1).view(5, 1))
    assert torch.equal(row_kernels.argmax(x[0]), x[0].float().argmax())


def test_argmax_declines_what_it_does_not_take(isa):
    assert row_kernels.argmax(torch.zeros(2, 64)) is None  # fp32: torch's own
    assert row_kernels.argmax(torch.zeros(2, 8, dtype=torch.bfloat16)) is None  # fewer than 16 entries


@pytest.mark.parametrize("vocab", [16, 45, 8203])
def test_top_probs_are_softmax_and_topk_with_ties_first_by_index(isa, vocab):
    """The k largest scores per row as softmax probabilities, within fp32 rounding of torch's softmax: the values
    torch's topk picks, equal scores by ascending index (rounded scores tie often, inside the vector body and in
    the tail); -inf scores weigh 0; a row with a NaN, or of -inf only, or holding +inf, gets NaN probabilities."""
    g = torch.Generator().manual_seed(vocab)
    for trial in range(20):
        x = (torch.randn(6, vocab, generator=g) * 3).round().to(torch.bfloat16)
        x[1, : vocab // 2] = float("-inf")
        x[2, int(torch.randint(0, vocab, (1,), generator=g))] = float("nan")
        x[3] = float("-inf")
        x[4, vocab - 1] = float("inf")
        for k in (1, 4, min(16, vocab)):
            with torch.inference_mode():
                probs, index = row_kernels.top_probs(x, k)
            want, _ = x.float().softmax(-1).topk(k, dim=-1)
            for r in (0, 1, 5):
                picked = x[r, index[r]].float()
                assert torch.equal(picked, x[r].float().topk(k).values)  # the k largest, largest first
                for a, b, va, vb in zip(index[r], index[r, 1:], picked, picked[1:]):
                    assert va > vb or a < b  # equal scores: the smaller index first
                torch.testing.assert_close(probs[r], want[r], rtol=1e-5, atol=1e-9)  # sums in another order
            assert probs[2:5].isnan().all()


def test_top_probs_declines_what_it_does_not_take(isa):
    assert row_kernels.top_probs(torch.zeros(2, 64), 4) is None  # fp32: torch's own
    assert row_kernels.top_probs(torch.zeros(2, 8, dtype=torch.bfloat16), 4) is None  # fewer than 16 entries
    assert row_kernels.top_probs(torch.zeros(2, 64, dtype=torch.bfloat16), 17) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_chain_decides_as_verify_sampled_with_the_same_uniforms(isa, dtype):
    """The kernels' speculative sampling is sampling.verify_sampled in one call: on the same logits, drafts and
    uniforms it keeps the same drafts and emits the same token, for sampled drafts (block verification) and one-hot
    ones (token by token), at several temperatures, with masked (-inf) entries and drafts among them, over
    vocabularies around its chunks of 256 and its vector widths."""
    from dflashkit.decoding.sampling import SamplingParams, over_vocabulary, warp
    from dflashkit.decoding.verify import verify_sampled

    g = torch.Generator().manual_seed(7)
    kept_counts = set()
    for trial in range(300):
        vocab = (
            int(torch.randint(1, 1100, (1,), generator=g))
            if trial % 3
            else int(torch.randint(250, 520, (1,), generator=g))
        )
        k, temperature = trial % 5, (0.6, 1.0, 1.7)[trial % 3]
        logits = (torch.randn(k + 1, vocab, generator=g) * 3).to(dtype)
        if trial % 4 == 3:
            logits[:, : vocab // 2] = float("-inf")  # a masked half (a grammar's mask, a penalty)
        params = SamplingParams(temperature)
        if trial % 2 and k:  # sampled drafts and their proposal rows
            q = warp(logits[:k].float() + torch.randn(k, vocab, generator=g), params)
            drafts = torch.multinomial(q, 1, generator=g)[:, 0]
        else:  # one-hot drafts, some of them masked tokens
            q, drafts = None, torch.randint(0, vocab, (k,), generator=g)
        uniforms = torch.rand(k + 1, generator=g, dtype=torch.float64)
        got = row_kernels.verify_chain(logits, temperature, drafts, q, uniforms)
        assert got == verify_sampled(warp(logits, params), drafts, q, None, uniforms.tolist()), trial
        if q is not None:  # q over a draft vocabulary that holds the drafts: the same decisions
            columns = torch.unique(torch.cat((drafts, torch.randperm(vocab, generator=g)[: vocab // 3])))
            q_columns = q[:, columns] / q[:, columns].sum(-1, keepdim=True)
            want = verify_sampled(
                warp(logits, params), drafts, over_vocabulary(q_columns, columns, vocab), None, uniforms.tolist()
            )
            assert row_kernels.verify_chain(logits, temperature, drafts, q_columns, uniforms, columns) == want, trial
        assert logits[got[0], got[1]] > float("-inf")  # never a token of probability 0
        kept_counts.add(got[0])
    assert kept_counts == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_rows_is_warp_and_sample_with_the_same_uniforms(isa, dtype):
    """The drafter's proposals in one call: each row's softmax at the temperature (fp32 rounding of torch's) and the
    index sampling.sample draws from it with the same uniform, never one of probability 0."""
    from dflashkit.decoding.sampling import SamplingParams, _invert, warp

    g = torch.Generator().manual_seed(3)
    for trial in range(100):
        k, vocab, temperature = (
            1 + trial % 4,
            int(torch.randint(1, 9000, (1,), generator=g)),
            (0.5, 1.0, 1.5)[trial % 3],
        )
        scores = (torch.randn(k, vocab, generator=g) * 3).to(dtype)
        if trial % 4 == 1:
            scores[:, ::2] = float("-inf")
        uniforms = torch.rand(k, generator=g, dtype=torch.float64)
        index, probs = row_kernels.sample_rows(scores, temperature, uniforms)
        want = warp(scores, SamplingParams(temperature))
        torch.testing.assert_close(probs, want, rtol=1e-5, atol=1e-9)
        assert torch.equal(index, _invert(want, 1 - uniforms[:, None])), trial
        assert (scores[torch.arange(k), index] > float("-inf")).all()
    nan = torch.zeros(2, 64)
    nan[1, 3] = float("nan")
    assert row_kernels.sample_rows(nan, 1.0, torch.rand(2, dtype=torch.float64)) is None


def test_verify_chain_draws_at_its_point_of_the_running_sum(isa):
    """The emitted token is the first whose running sum reaches 1 - u of the row's total, across chunk boundaries
    and never on an entry of probability 0; a refused one-hot draft leaves the rest of the row."""
    logits = torch.full((2, 700), float("-inf"))
    live = [3, 255, 256, 511, 699]  # equal logits: 0.2 each; around the chunks of 256 and the end
    logits[:, live] = 0.0
    for at, want in [(0.1, 3), (0.3, 255), (0.5, 256), (0.7, 511), (0.9, 699), (1.0, 699)]:
        uniforms = torch.tensor([1 - at], dtype=torch.float64)
        assert row_kernels.verify_chain(logits[:1], 1.0, torch.empty(0, dtype=torch.long), None, uniforms) == (0, want)
    refused = torch.tensor([256])  # p(256) = 0.2: a coin of 0.5 refuses it; the rest: 3, 255, 511, 699 at 0.25 each
    for at, want in [(0.2, 3), (0.4, 255), (0.6, 511), (0.99, 699)]:
        uniforms = torch.tensor([0.5, 1 - at], dtype=torch.float64)
        assert row_kernels.verify_chain(logits, 1.0, refused, None, uniforms) == (0, want)
    assert row_kernels.verify_chain(logits, 1.0, refused, None, torch.tensor([0.1, 0.5], dtype=torch.float64))[0] == 1


def test_verify_chain_declines_what_it_does_not_take(isa):
    no_drafts, u = torch.empty(0, dtype=torch.long), torch.tensor([0.5], dtype=torch.float64)
    assert row_kernels.verify_chain(torch.zeros(1, 64, dtype=torch.float64), 1.0, no_drafts, None, u) is None
    nan = torch.zeros(1, 64)
    nan[0, 5] = float("nan")
    assert row_kernels.verify_chain(nan, 1.0, no_drafts, None, u) is None  # torch's version decides such rows
    assert row_kernels.verify_chain(torch.full((1, 64), float("-inf")), 1.0, no_drafts, None, u) is None


def assert_rows_independent(packed: torch.Tensor, x: torch.Tensor, n: int) -> None:
    """Each of x's rows gives bitwise the same product in calls of 1, 3, 7 or all of its rows."""
    with torch.inference_mode():
        together = row_kernels.linear(x, packed, n)
        for rows in (1, 3, 7, x.shape[0]):
            for start in range(0, x.shape[0] - rows + 1, rows):
                assert torch.equal(
                    row_kernels.linear(x[start : start + rows], packed, n), together[start : start + rows]
                )


@pytest.mark.parametrize("k,rows", [(128, 16), (266, 16), (1536, 16), (266, 70)])
def test_each_row_is_bitwise_the_same_whatever_rows_run_with_it(isa, k, rows):
    """A verify pass of 16 rows and 16 one-row steps compute the same products, bit for bit: also when a product of
    several row chunks walks K in chunks (K of 133 and 768 pairs: chunks of 32 pairs and a ragged last one), and for
    70 rows, which run each row chunk over the whole K as a long prefill does."""
    assert_rows_independent(row_kernels.pack(bf16(300, k, seed=1)), bf16(rows, k, seed=2), 300)


def test_leading_dims_and_non_contiguous_input(isa):
    w = bf16(70, 32, seed=3)
    x = bf16(1, 5, 64, seed=4)[..., ::2]  # [1, 5, 32], strided
    with torch.inference_mode():
        got = row_kernels.linear(x, row_kernels.pack(w), 70)
    assert got.shape == (1, 5, 70)
    close_to_fp32(got[0], x[0], w, None)


@pytest.mark.parametrize("rows", [1, 16, 17, 40])
def test_matmul_and_packed_linear_use_the_kernel_up_to_max_rows(isa, rows):
    w, b, x = bf16(96, 64, seed=5), bf16(96, seed=6), bf16(rows, 64, seed=7)
    with torch.inference_mode():
        kernel = row_kernels.linear(x, row_kernels.pack(w), 96, b.float())
        onednn = F.linear(x, w, b)
        for layer in (Matmul(w, b), PackedLinear(w.clone(), b.clone())):
            got = layer(x)
            close_to_fp32(got, x, w, b)
            if rows <= row_kernels.max_rows():
                assert torch.equal(got, kernel)
            else:
                assert torch.equal(got, onednn)


def test_packed_linear_repacks_after_the_weight_changes(isa):
    layer = PackedLinear(bf16(32, 16, seed=8))
    x = bf16(2, 16, seed=9)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2)
        after = layer(x)
    close_to_fp32(after, x, layer.weight, None)
    assert not torch.equal(before, after)


def test_the_setting_turns_the_kernel_off_and_refuses_unknown_values(monkeypatch):
    monkeypatch.setenv("DFLASHKIT_CPU_GEMM", "onednn")
    assert row_kernels.kernel() is None
    assert not row_kernels.usable(bf16(4, 4, seed=0))
    w, x = bf16(24, 40, seed=10), bf16(3, 40, seed=11)
    with torch.inference_mode():
        assert torch.equal(Matmul(w)(x), F.linear(x, w))  # oneDNN, bitwise
    monkeypatch.setenv("DFLASHKIT_CPU_GEMM", "fastest")
    with pytest.raises(ValueError, match="DFLASHKIT_CPU_GEMM"):
        row_kernels.kernel()


@pytest.mark.parametrize(
    "capability,bf16,amx,setting,expected",
    [
        ("AVX512", True, False, "auto", "avx512"),  # Zen 4: AVX512-BF16, no AMX
        ("AVX512", True, True, "auto", "amx"),  # Sapphire Rapids: the AVX512-BF16 source with AMX tile products
        ("AVX512", True, False, "amx", None),  # forced, but the CPU has no AMX
        ("AVX512", False, False, "auto", None),  # AVX512 without BF16: oneDNN (the AVX2 kernel was not measured there)
        ("AVX2", False, False, "auto", "avx2"),  # most laptops, AMD Zen 1
        ("DEFAULT", False, False, "auto", None),
        ("AVX512", True, True, "avx512", "avx512"),  # forced
        ("AVX512", False, False, "avx2", "avx2"),
        ("AVX2", False, False, "avx512", None),  # forced, but the CPU lacks it
        ("AVX2", False, False, "onednn", None),
    ],
)
def test_auto_picks_the_kernel_for_the_cpus_instruction_set(monkeypatch, capability, bf16, amx, setting, expected):
    monkeypatch.setattr(row_kernels, "_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    picked = row_kernels._pick(setting)
    assert (picked.name if picked else None) == expected


def test_weights_the_kernel_cannot_take_stay_with_onednn():
    assert not row_kernels.usable(bf16(8, 7, seed=0))  # odd inner size
    assert not row_kernels.usable(torch.randn(8, 8))  # fp32


def attention_reference(q, keys, values, hidden, scale):
    """fp32 attention of q [H, R, d] (row r is query row r % n) over keys/values [H, m, d]."""
    scores = q.float() @ keys.float().transpose(1, 2) * scale  # [H, R, m]
    if hidden is not None:
        scores = scores.masked_fill(hidden.repeat(q.shape[1] // hidden.shape[0], 1)[None], float("-inf"))
    return scores.softmax(-1) @ values.float()


def chain_hidden(n: int, m: int) -> torch.Tensor:
    return torch.ones(n, m, dtype=torch.bool).triu(m - n + 1)  # row i sees keys 0..m-n+i


@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("mask", ["none", "chain", "tree"])
def test_attention_matches_fp32_softmax_attention(isa, d, mask):
    heads, group, n, m = 3, 3, 5, 37
    q, keys, values = bf16(heads, group * n, d, seed=d), bf16(heads, m, d, seed=1), bf16(heads, m, d, seed=2)
    hidden = None
    if mask == "chain":
        hidden = chain_hidden(n, m)
    elif mask == "tree":  # the cache, then each row sees itself and some earlier rows
        hidden = torch.zeros(n, m, dtype=torch.bool)
        hidden[:, m - n :] = ~torch.tensor(
            [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool
        )
    with torch.inference_mode():
        got = row_kernels.attention(q, keys, values, hidden, d**-0.5)
    ref = attention_reference(q, keys, values, hidden, d**-0.5)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    assert ((got.float() - ref).abs() <= ref.abs() * 2**-7 + 2e-3).all()


@pytest.mark.parametrize("d", [16, 32, 64, 128])
def test_attention_row_with_a_mask_is_bitwise_attention_over_its_visible_keys(isa, d):
    """A masked row (a tree node's: the context, then some of the block) is bitwise the unmasked attention over only
    the keys it sees, in their order, whatever the leading run of visible keys (0, within and past 16-key chunks)."""
    heads, group, m = 3, 3, 53
    leads = [0, 1, 5, 16, 17, 31, 40, 52]  # keys 0..lead-1 visible, then a scattered pattern
    n = len(leads)
    q, keys, values = bf16(heads, group * n, d, seed=d), bf16(heads, m, d, seed=3), bf16(heads, m, d, seed=4)
    scattered = torch.Generator().manual_seed(5)
    hidden = torch.zeros(n, m, dtype=torch.bool)
    for i, lead in enumerate(leads):
        hidden[i, lead:] = torch.rand(m - lead, generator=scattered) < 0.5
        hidden[i, lead] = True  # the run ends at lead
        hidden[i, m - 1 - i] = False  # and some key past it is seen
    with torch.inference_mode():
        got = row_kernels.attention(q, keys, values, hidden, d**-0.5)
        for i in range(n):
            seen = (~hidden[i]).nonzero().flatten()
            rows = q.view(heads, group, n, d)[:, :, i].contiguous()  # [heads, group, d]: row i of each query head
            alone = row_kernels.attention(rows, keys[:, seen].contiguous(), values[:, seen].contiguous(), None, d**-0.5)
            assert torch.equal(got.view(heads, group, n, d)[:, :, i], alone), (i, leads[i])


@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("start", [40, 60])  # 60: the verify pass's keys cross a 64-key block, its first rows' not
def test_attention_row_of_a_chain_is_bitwise_the_one_row_step(isa, d, start):
    """Row i of a verify pass over n rows = the one-token step at its position, which sees keys 0..start+i."""
    heads, group, n = 3, 3, 7
    m = start + n
    q = bf16(heads, group, n, d, seed=3)  # [H, group, n, d]
    cache = bf16(2, heads, 80, d, seed=4)  # a cache with capacity 80: keys and values are views of it
    keys, values = cache[0, :, :m], cache[1, :, :m]
    with torch.inference_mode():
        together = row_kernels.attention(q.reshape(heads, group * n, d), keys, values, chain_hidden(n, m), 0.125)
        together = together.view(heads, group, n, d)
        for i in range(n):
            alone = row_kernels.attention(q[:, :, i], keys[:, : start + i + 1], values[:, : start + i + 1], None, 0.125)
            assert torch.equal(alone, together[:, :, i])


@pytest.mark.parametrize("fused", [True, False], ids=["one-call-layers", "python-layers"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fast_target_verify_rows_are_bitwise_one_token_steps(isa, arch, fused):
    """bf16: a 9-row verify pass gives exactly the logits and features of 9 one-token steps, through the one-call
    C++ layers (decoder_layers) or the Python layer loop with the kernels' products and attention."""
    from dflashkit.target.fast import FastTargetForward
    from tests.conftest import tiny_target

    fast = FastTargetForward(tiny_target(arch, dtype=torch.bfloat16))
    assert fast.row_exact and fast.fused_weights is not None
    if not fused:
        fast.fused_weights = None
    assert_verify_rows_are_one_token_steps(fast, [1, 4])


def assert_verify_rows_are_one_token_steps(fast, feature_layers: list[int]) -> None:
    """After an 11-token prompt, a 9-row verify pass gives exactly the logits, features and cache rows of 9
    one-token steps."""
    from tests.conftest import VOCAB

    prompt, block = torch.randint(3, VOCAB, (1, 11)), torch.randint(3, VOCAB, (1, 9))
    caches = [fast.new_cache(64), fast.new_cache(64)]
    for cache in caches:
        fast(prompt, 0, cache, 1, [])
    logits, features = fast(block, 11, caches[0], 9, feature_layers)
    for i in range(9):
        step_logits, step_features = fast(block[:, i : i + 1], 11 + i, caches[1], 1, feature_layers)
        assert torch.equal(step_logits[0], logits[i]) and torch.equal(step_features[0, 0], features[0, i])
    assert torch.equal(caches[0].keys[:, :, :20], caches[1].keys[:, :, :20])
    assert torch.equal(caches[0].values[:, :, :20], caches[1].values[:, :, :20])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_one_call_layers_compute_what_the_python_layers_compute(isa, arch):
    """The C++ layer loop is the same maths as the Python one (rounded at other points: bf16 tolerance)."""
    from dflashkit.target.fast import FastTargetForward
    from tests.conftest import VOCAB, tiny_target

    fast = FastTargetForward(tiny_target(arch, dtype=torch.bfloat16))
    weights = fast.fused_weights
    ids = torch.randint(3, VOCAB, (1, 14))
    out = {}
    for name, fused in (("fused", weights), ("python", None)):
        fast.fused_weights = fused
        cache = fast.new_cache(64)
        fast(ids[:, :8], 0, cache, 1, [])
        out[name] = fast(ids[:, 8:], 8, cache, 6, [2, 5]), cache
    (logits, features), cache = out["fused"]
    (ref_logits, ref_features), ref_cache = out["python"]
    assert torch.allclose(logits.float(), ref_logits.float(), atol=0.01 * ref_logits.float().abs().max().item())
    assert torch.allclose(features.float(), ref_features.float(), atol=0.03 * ref_features.float().abs().max().item())
    for mine, theirs in ((cache.keys, ref_cache.keys), (cache.values, ref_cache.values)):
        assert torch.allclose(mine[:, :, :14].float(), theirs[:, :, :14].float(), atol=0.05)


@pytest.fixture
def kernels_refused(monkeypatch):
    """The kernel lookup made to fail: whatever asks for the CPU kernels fails the test."""

    def no_build():
        raise AssertionError("the CPU kernels were asked for")

    monkeypatch.setattr(row_kernels, "kernel", no_build)


def test_row_limits_for_another_device_never_build_the_kernels(kernels_refused):
    """A GPU's forward asks for its row limits too: answering must not compile the CPU kernels (30-60 s on a GPU
    machine, for kernels that never run there)."""
    assert row_kernels.max_rows("cuda") == row_kernels.MAX_ROWS
    assert row_kernels.max_batch_rows(torch.device("cuda", 0)) == row_kernels.MAX_BATCH_ROWS
    with pytest.raises(AssertionError, match="asked for"):
        row_kernels.max_rows(torch.device("cpu"))
    with pytest.raises(AssertionError, match="asked for"):
        row_kernels.max_batch_rows()


def test_fast_forwards_on_another_device_never_build_the_kernels(kernels_refused):
    """The target's and the drafter's fast forwards built on a device other than the CPU (``meta`` stands in for a
    GPU here) take their row limits without the CPU kernels."""
    from dflashkit.drafter.fast import FastDrafterForward
    from dflashkit.target.fast import FastTargetForward
    from tests.conftest import tiny_drafter, tiny_target

    target = tiny_target("llama", dtype=torch.bfloat16)
    drafter = tiny_drafter(target).to(torch.bfloat16).to("meta")
    forward = FastTargetForward(target.to("meta"))
    assert (forward.row_limit, forward.batch_row_limit) == (row_kernels.MAX_ROWS, row_kernels.MAX_BATCH_ROWS)
    assert not forward.row_exact and forward.fused_weights is None
    assert FastDrafterForward(drafter).row_limit == row_kernels.MAX_ROWS


def test_a_kernel_that_cannot_be_built_falls_back_to_onednn_with_a_warning(monkeypatch, tmp_path):
    import torch.utils.cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("error: command 'c++' failed: No such file or directory")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setenv("DFLASHKIT_CPU_GEMM", "avx512")
    monkeypatch.setenv("DFLASHKIT_KERNEL_DIR", str(tmp_path / "unbuilt"))
    row_kernels._load.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="could not be built .*No such file"):
            assert row_kernels.kernel() is None
        w, x = bf16(24, 40, seed=12), bf16(3, 40, seed=13)
        with torch.inference_mode():
            assert torch.equal(Matmul(w)(x), F.linear(x, w))
    finally:
        row_kernels._load.cache_clear()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tree_rows_are_bitwise_fresh_forwards_of_their_paths(isa, arch):
    """bf16: a node's row of a token-tree pass sees exactly its path's keys in the same order, so it is bitwise the
    last row of a fresh forward of the path."""
    from dflashkit.decoding.tree import DraftTree
    from dflashkit.target.adapter import TargetAdapter
    from tests.conftest import tiny_target

    target = TargetAdapter(tiny_target(arch, dtype=torch.bfloat16), [1, 4])
    assert target.fast_forward.fused_weights is not None
    prefix = [5, 9, 14, 3, 22, 7]
    tree = DraftTree(tokens=[30, 31, 32, 33, 34, 35], parents=[0, 0, 1, 1, 3, 2], depths=[1, 1, 2, 2, 3, 2])
    cache = target.new_cache()
    target.forward(torch.tensor([prefix[:-1]]), 0, cache, logits_rows=1)
    shape = (tree.position_offsets(), tree.attention_mask())
    ids = torch.tensor([[prefix[-1]] + tree.tokens])
    logits, features = target.forward(ids, len(prefix) - 1, cache, logits_rows=len(tree) + 1, tree=shape)
    for row in range(len(tree) + 1):
        path, node = [], row
        while node:
            path.append(tree.tokens[node - 1])
            node = tree.parents[node - 1]
        fresh = target.new_cache()
        target.forward(torch.tensor([prefix[:-1]]), 0, fresh, logits_rows=1)  # the same prefill as the tree's
        expected, expected_features = target.forward(
            torch.tensor([[prefix[-1]] + path[::-1]]), len(prefix) - 1, fresh, logits_rows=1
        )
        assert torch.equal(logits[row], expected[0]) and torch.equal(features[0, row], expected_features[0, -1])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_one_call_drafter_layers_compute_what_the_python_layers_compute(isa, arch):
    """The drafter's block forward in one C++ call (its keys and values in the context's scratch rows): the same
    maths as its Python layers within bf16 rounding; the verified context rows are left as they were."""
    from dflashkit.target.adapter import TargetAdapter
    from tests.conftest import VOCAB, tiny_drafter, tiny_target

    model = tiny_target(arch, dtype=torch.bfloat16)
    drafter = tiny_drafter(model, block_size=8)
    drafter.use_fast_path()
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    fast = drafter._fast_forward()
    assert fast.fused_weights is not None
    prompt = torch.randint(3, VOCAB, (1, 12))
    _, features = target.forward(prompt, 0, target.new_cache(), logits_rows=1)
    scores = {}
    for name, weights in (("fused", fast.fused_weights), ("python", None)):
        fast.fused_weights = weights
        context = drafter.new_context(capacity=12)  # full after the prompt: the block's rows need a reserve
        scores[name] = drafter.draft_scores(context, features, 0, 7, 12, 7, target.embed_tokens, target.lm_head)[0]
        kept = context.keys[:, :, :12].clone(), context.values[:, :, :12].clone()
        again = drafter.draft_scores(context, None, 0, 7, 12, 7, target.embed_tokens, target.lm_head)[0]
        assert torch.equal(again, scores[name])  # scratch rows rewritten, context intact
        assert torch.equal(context.keys[:, :, :12], kept[0]) and torch.equal(context.values[:, :, :12], kept[1])
    got, ref = scores["fused"].float(), scores["python"].float()
    assert torch.allclose(got, ref, atol=0.03 * ref.abs().max().item())  # measured: 1.0-1.1%


def test_one_call_drafter_layers_attend_to_the_context_window_only(isa):
    """With a window, the one-call drafter layers read the last rows only: bitwise the scores over a context that
    holds just those rows, and the Python layers' scores within bf16 rounding."""
    from dflashkit.target.adapter import TargetAdapter
    from tests.conftest import VOCAB, tiny_drafter, tiny_target

    model = tiny_target("qwen3", dtype=torch.bfloat16)
    drafter = tiny_drafter(model, block_size=8)
    drafter.use_fast_path()
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    fast = drafter._fast_forward()
    fused = fast.fused_weights
    assert fused is not None
    prompt = torch.randint(3, VOCAB, (1, 20))
    _, features = target.forward(prompt, 0, target.new_cache(), logits_rows=1)

    def scores(window: int | None, first: int = 0) -> torch.Tensor:
        context = drafter.new_context(capacity=24, window=window)
        return drafter.draft_scores(context, features[:, first:], first, 7, 20, 5, target.embed_tokens, target.lm_head)[
            0
        ]

    windowed = scores(6)
    assert torch.equal(windowed, scores(None, first=14))
    assert not torch.equal(windowed, scores(None))
    fast.fused_weights = None  # the Python layers
    ref = scores(6).float()
    fast.fused_weights = fused
    assert torch.allclose(windowed.float(), ref, atol=0.03 * ref.abs().max().item())


def _drafter_setup(block_size: int = 8):
    from dflashkit.target.adapter import TargetAdapter
    from tests.conftest import tiny_drafter, tiny_target

    model = tiny_target("qwen3", dtype=torch.bfloat16)
    drafter = tiny_drafter(model, block_size=block_size)
    drafter.use_fast_path()
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    return drafter, target


def test_one_call_drafter_steps_of_several_sequences_are_each_sequences_own(isa):
    """Several sequences' drafting steps in one call (their context rows and blocks batched, different lengths,
    windows and k): every sequence's drafts and context rows are bitwise those of its step alone."""
    from dflashkit.drafter.fast import DraftStep
    from tests.conftest import VOCAB

    drafter, target = _drafter_setup()
    fast = drafter._fast_forward()
    embed = target.embed_tokens.weight
    setups = [(12, None, 7, 3), (20, 6, 5, 7), (9, None, 0, 1)]  # prompt length, window, new rows at the step, k
    features = {}
    for length, _, _, _ in setups:
        ids = torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
        features[length] = target.forward(ids, 0, target.new_cache(), logits_rows=1)[1]

    def start(length, window, new):  # a context holding the prompt but its last `new` rows
        context = drafter.new_context(capacity=8, window=window)
        fast.step([DraftStep(context, features[length][:, : length - new], 0, 0, 0, 0)], embed)
        return context

    def step(length, window, new, k, context):
        return DraftStep(context, features[length][:, length - new :] if new else None, length - new, 11, length, k)

    alone, contexts = [], []
    for setup in setups:
        context = start(*setup[:3])
        alone.append(fast.step([step(*setup, context)], embed))
        contexts.append(context)
    together_contexts = [start(*setup[:3]) for setup in setups]
    together = fast.step([step(*setup, c) for setup, c in zip(setups, together_contexts)], embed)
    assert torch.equal(together, torch.cat(alone))
    for a, b in zip(contexts, together_contexts):
        assert a.length == b.length and a.first == b.first
        assert torch.equal(a.keys[:, :, a.stored_from : a.length], b.keys[:, :, b.stored_from : b.length])
        assert torch.equal(a.values[:, :, a.stored_from : a.length], b.values[:, :, b.stored_from : b.length])


def test_one_call_context_rows_do_not_depend_on_how_they_arrive(isa):
    """A context row's keys and values are the same whether it arrived with the prompt or in a later step, and
    whether the step's block fitted the one-call layers or ran the Python layers (blocks over ``row_limit``)."""
    from tests.conftest import VOCAB

    drafter, target = _drafter_setup(block_size=8)
    ids = torch.randint(3, VOCAB, (1, 14))
    features = target.forward(ids, 0, target.new_cache(), logits_rows=1)[1]
    args = (target.embed_tokens, target.lm_head)
    whole = drafter.new_context(capacity=4)
    drafter.draft_scores(whole, features, 0, 5, 14, 3, *args)
    parts = drafter.new_context(capacity=4)
    drafter.draft_scores(parts, features[:, :6], 0, 5, 6, 3, *args)
    fast = drafter._fast_forward()
    fast.row_limit = 2  # this step's block (k = 3: 4 rows) runs the Python layers
    drafter.draft_scores(parts, features[:, 6:], 6, 5, 14, 3, *args)
    assert parts.length == whole.length == 14
    assert torch.equal(parts.keys[:, :, :14], whole.keys[:, :, :14])
    assert torch.equal(parts.values[:, :, :14], whole.values[:, :, :14])


def test_draft_scores_batch_is_each_calls_own_and_undoes_a_failed_round(isa, monkeypatch):
    """DFlashDrafter.draft_scores_batch: each sequence's scores bitwise its call alone; a round that fails after
    its context rows went in leaves every context as it was, so that its calls can run again one by one."""
    from dflashkit.drafter.fast import FastDrafterForward
    from tests.conftest import VOCAB

    drafter, target = _drafter_setup()
    args = (target.embed_tokens, target.lm_head)
    prompts = [torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in (10, 17)]
    features = [target.forward(p, 0, target.new_cache(), logits_rows=1)[1] for p in prompts]

    def calls():
        return [(drafter.new_context(capacity=8), f, 0, 9, f.shape[1], k, *args) for f, k in zip(features, (3, 6))]

    alone = [drafter.draft_scores(*c)[0] for c in calls()]
    pending = calls()
    step = FastDrafterForward.step

    def failing(self, drafts, embed):
        step(self, drafts, embed)  # the context rows are in ...
        raise RuntimeError("after the rows went in")  # ... and then the round fails

    monkeypatch.setattr(FastDrafterForward, "step", failing)
    with pytest.raises(RuntimeError, match="after the rows went in"):
        drafter.draft_scores_batch(pending)
    assert [c[0].length for c in pending] == [0, 0]
    monkeypatch.setattr(FastDrafterForward, "step", step)
    together = drafter.draft_scores_batch(pending)
    assert all(torch.equal(a, t) for a, (t, _) in zip(alone, together))
    assert [c[0].length for c in pending] == [10, 17]


def test_the_engine_line_names_the_row_kernels(isa, monkeypatch):
    from dflashkit.target.adapter import TargetAdapter
    from tests.conftest import tiny_target

    assert (
        f"{row_kernels.label()} row kernels, one call per step"
        in TargetAdapter(tiny_target(dtype=torch.bfloat16)).engine
    )
    assert "row kernels" not in TargetAdapter(tiny_target()).engine  # fp32: oneDNN
    monkeypatch.setenv("DFLASHKIT_CPU_GEMM", "onednn")
    assert "row kernels" not in TargetAdapter(tiny_target(dtype=torch.bfloat16)).engine


# ---- weight-only int8 (every kernel) -----------------------------------------------------------------------


@pytest.fixture
def int8_isa(isa):
    """An instruction set whose kernel takes int8-packed weights (all of them do)."""
    if not row_kernels.kernel().int8:
        pytest.skip(f"the {isa} kernel has no int8 product")
    return isa


def int8_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from dflashkit.kernels.int8 import quantize_weight

    return quantize_weight(bf16(n, k, seed=seed).float(), torch.bfloat16)  # int8 [n, k], bf16 scales [n]


@pytest.mark.parametrize("n,k", [(200, 96), (64, 64), (1, 8), (130, 34), (1000, 576), (70, 33)])
@pytest.mark.parametrize("rows", [1, 5, 16, 70])
def test_int8_product_matches_fp32_with_scales_bias_and_ragged_columns(int8_isa, n, k, rows):
    q, scale = int8_weight(n, k, seed=n)
    b, x = bf16(n, seed=k), bf16(rows, k, seed=rows)
    packed = row_kernels.pack_int8(q, scale)
    assert packed.dtype == torch.int8 and packed.shape == (-(-n // 16), 16 * k + 64)
    dequantized = q.float() * scale.float()[:, None]
    with torch.inference_mode():
        close_to_fp32(row_kernels.linear(x, packed, n, b.float()), x, dequantized, b)
        close_to_fp32(row_kernels.linear(x, packed, n), x, dequantized, None)


@pytest.mark.parametrize("n,k", [(70, 33), (130, 8)])
def test_int8_packing_follows_the_documented_layout(n, k):
    """Element by element (every kernel reads this layout, AMX's included, which this machine may not run): group g
    holds [16 k + c] = Q[16 g + c][k], zero weights past N, then its 16 scales as fp32 (1 for padded columns)."""
    q, scale = int8_weight(n, k, seed=3)
    packed = row_kernels.pack_int8(q, scale)
    assert packed.dtype == torch.int8 and packed.shape == (-(-n // 16), 16 * k + 64)
    for g in range(packed.shape[0]):
        for c in range(16):
            column = 16 * g + c
            for kk in range(k):
                assert packed[g, 16 * kk + c] == (q[column, kk] if column < n else 0)
        expected = [float(scale[col]) if col < n else 1.0 for col in range(16 * g, 16 * g + 16)]
        assert packed[g, 16 * k :].view(torch.float32).tolist() == expected


@pytest.mark.parametrize("rows,k", [(16, 128), (40, 128), (9, 35)])
def test_int8_rows_are_bitwise_the_same_whatever_rows_run_with_them(int8_isa, rows, k):
    """Also past 6 and 16 rows, where the AVX512-BF16 and AMX kernels convert a group's weights once for several row
    chunks, and with an odd K (the AVX512-BF16 kernel adds its last weight row apart)."""
    assert_rows_independent(row_kernels.pack_int8(*int8_weight(300, k, seed=1)), bf16(rows, k, seed=2), 300)


def test_int8_layers_run_on_the_kernel_and_repack_after_a_change(int8_isa):
    from dflashkit.kernels.int8 import Int8Linear, Int8Matmul

    q, scale = int8_weight(96, 64, seed=5)
    b, x = bf16(96, seed=6), bf16(3, 64, seed=7)
    layer = Int8Linear(q.clone(), scale.clone(), b.clone())
    with torch.no_grad():  # (weights made under inference_mode carry no version counter to follow)
        kernel = row_kernels.linear(x, row_kernels.pack_int8(q, scale), 96, b.float())
        assert torch.equal(Int8Matmul(q, scale, b)(x), kernel) and torch.equal(layer(x), kernel)
        layer.scale.mul_(2)  # the packed copy follows the layer's weights
        assert not torch.equal(layer(x), kernel)
        close_to_fp32(layer(x), x, q.float() * layer.scale.float()[:, None], b)
    with pytest.raises(RuntimeError, match="int8 packed"):
        row_kernels.linear(bf16(2, 32, seed=8), row_kernels.pack_int8(q, scale), 96)  # K 32, packed for 64


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_target_verify_rows_are_bitwise_one_token_steps(int8_isa, arch):
    """The int8 target's fast forward runs every layer and its head on the kernel: a verify pass's rows are its
    one-token steps, bit for bit, so bf16 speculative greedy decoding of the int8 target is its plain decoding."""
    from dflashkit.kernels.quantize import quantize_model
    from dflashkit.target.adapter import TargetAdapter
    from dflashkit.target.fast import FastTargetForward
    from tests.conftest import tiny_drafter, tiny_target
    from tests.decoding.test_loop import run

    model = quantize_model(tiny_target(arch, dtype=torch.bfloat16), "int8")
    fast = FastTargetForward(model)
    assert fast.row_exact and fast.fused_weights is not None and fast.layers[0].qkv.small.dtype == torch.int8
    assert_verify_rows_are_one_token_steps(fast, [1])
    drafter = tiny_drafter(model, block_size=8)
    spec, plain = TargetAdapter(model, drafter.config.target_layer_ids), TargetAdapter(model)
    for ids in ([5, 9, 11, 3], [7] * 6, [12, 40, 3]):
        assert run(spec, drafter, ids) == run(plain, None, ids)  # identical: no ties to excuse


def test_auto_falls_back_to_the_avx512_kernel_where_the_amx_one_cannot_be_built(monkeypatch):
    """A compiler without -mamx-tile still gives an AMX CPU the AVX512-BF16 kernel under auto (not oneDNN)."""
    monkeypatch.setattr(row_kernels, "_pick", lambda setting: row_kernels.ISAS["amx"])
    built = {"amx": None, "avx512": object()}
    monkeypatch.setattr(row_kernels, "_build", lambda isa, otherwise="oneDNN": built[isa.name])
    row_kernels._load.cache_clear()
    try:
        assert row_kernels._load("auto") is built["avx512"]
        assert row_kernels._load("amx") is None  # forced: no fallback
    finally:
        row_kernels._load.cache_clear()


def test_a_kernel_the_os_will_not_run_is_refused_with_a_warning(monkeypatch, tmp_path):
    """An AMX kernel built where the OS refuses the tile state (ready() False) is not used: a warning, then the
    fallback (oneDNN when forced; auto on an AMX CPU then tries the AVX512-BF16 kernel)."""
    import types

    import torch.utils.cpp_extension

    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: types.SimpleNamespace(ready=lambda: False))
    monkeypatch.setenv("DFLASHKIT_KERNEL_DIR", str(tmp_path / "unbuilt"))
    with pytest.warns(RuntimeWarning, match="AMX bf16 CPU kernel could not be built .*refused the AMX tile state"):
        assert row_kernels._build(row_kernels.ISAS["amx"]) is None


def test_a_batched_pass_of_many_sequences_is_bitwise_each_alone(isa):
    """decoder_layers_batch runs every sequence's attention of a layer in one parallel region (attention_calls):
    9 sequences with contexts of 1-40 positions, 1-2 rows each (13 in all: one pass on every instruction set), give
    the logits and cache rows each gives alone."""
    from dflashkit.target.fast import FastTargetForward, ForwardCall
    from tests.conftest import VOCAB, tiny_target

    forward = FastTargetForward(tiny_target("qwen3", dtype=torch.bfloat16))
    counts = [1 + i % 2 for i in range(9)]
    assert forward.fused_weights is not None and forward.batches(counts)
    g = torch.Generator().manual_seed(4)
    contexts = [1, 40, 7, 23, 2, 31, 16, 5, 11]
    prompts = [torch.randint(4, VOCAB, (1, n), generator=g) for n in contexts]
    steps = [torch.randint(4, VOCAB, (1, n), generator=g) for n in counts]

    def prefilled():
        caches = [forward.new_cache(64) for _ in prompts]
        for p, c in zip(prompts, caches):
            forward(p, 0, c, 1, [])
        return caches

    alone, together = prefilled(), prefilled()
    expected = [forward(s, n, c, s.shape[1], [])[0] for s, n, c in zip(steps, contexts, alone)]
    got = forward.batch([ForwardCall(s, n, c, s.shape[1]) for s, n, c in zip(steps, contexts, together)], [])
    for e, (logits, _), c1, c2 in zip(expected, got, alone, together):
        assert torch.equal(e, logits) and c1.length == c2.length
        assert torch.equal(c1.keys[:, :, : c1.length], c2.keys[:, :, : c2.length])
        assert torch.equal(c1.values[:, :, : c1.length], c2.values[:, :, : c2.length])
