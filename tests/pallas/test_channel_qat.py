"""QAT (FP8 fake quantisation, :class:`gdn_jax.qat.QATConfig`) fused into the channel-decay (KDA /
GDN2) Pallas kernels: w quantised in the intra kernel, the chunk-entering state in the state loop
(forward and the backward's recomputation of h); the gradient is straight-through, so the backward
kernels read the quantised w and h.

The reference is the xla path with the same ``qat`` (``gdn_jax.reference.chunked``). FP8 rounding
amplifies tiny operand differences (a bf16-level change can flip an e4m3 rounding), so the paths
are compared by the 2x rule (docs/design.md) against the xla path in f32: error(pallas) <= 2 *
error(xla in the io dtype), both with QAT on, as for GDN (tests/pallas/test_qat_pallas.py).

CPU: the Mosaic GPU interpreter (tiny shapes), the kernels' outputs on the e4m3 grid of exactly
the configured groups, the real CUDA lowering at K, V in {64, 128}, the selector. GPU (``-m gpu``,
H200): realistic shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from channel_cases import NAMES, channel_case, loss_and_grads, pallas_op
from gdn_cases import OPS, RECURRENT, lowered_kernels, positional, run_interpreted
from test_channel_pallas_bwd import core_case
from test_qat_pallas import CONFIGS, GROUP_AXES, _fq_exact, _fq_input, _off_e4m3_grid

from gdn_jax import qat
from gdn_jax.ops._channel_pallas import kernel_beta
from gdn_jax.testing import check_2x, random_inputs
from pallas_kernels import _compat as pk
from pallas_kernels._compat import pl, plgpu
from pallas_kernels.channel.intra import ChannelIntraConfig, channel_intra
from pallas_kernels.gdn.fake_quant import fake_quant_e4m3_tiles
from pallas_kernels.recurrence.chunk_fwd import ChunkFwdConfig, channel_chunk_fwd

f32, bf16, f16 = jnp.float32, jnp.bfloat16, jnp.float16
# lengths 0, 1, 79, 0, 20, 0: empty sequences first, inside and last, a one-token sequence
CU = [0, 0, 1, 80, 80, 100, 100]


@functools.cache
def xla_op(variant):
    """The public op with ``implementation="xla"`` (one function per variant: cached programs)."""

    def fn(*args, **kw):
        return OPS[variant](*args, implementation="xla", **kw)

    return fn


def check_qat_2x(variant, x, cu, cts, cfg, dtype=bf16, *, ref=None, jit=False, floor=1e-5):
    """The 2x rule on every output and gradient of the Pallas op with ``qat=cfg`` against
    ``ref`` (default: the xla op with the same ``qat``) in f32, budget ``ref`` in ``dtype``."""
    ref = xla_op(variant) if ref is None else ref
    run_ref = functools.partial(loss_and_grads, ref, variant, x, cu, reference=True, qat=cfg)
    ref32 = run_ref(f32, cts)
    ref_lo = run_ref(dtype, cts)
    got = loss_and_grads(pallas_op(variant), variant, x, cu, dtype, cts, jit=jit, qat=cfg)
    print(variant, check_2x(NAMES[variant], got, ref_lo, ref32, floor=floor))
    return got


# ------------------------------------------------------------------------------------------------
# CPU: Mosaic GPU interpreter (tiny shapes)


def _fq_tiles_kernel(x, groups):
    """A one-CTA kernel: load an f32 [R, 2N] tensor as two [R, N] tiles, fake-quantise them as
    one tensor in registers, store them."""
    R, N2 = x.shape
    N = N2 // 2

    def body(x_g, o_g):
        def scoped(x_s, bar):
            plgpu.copy_gmem_to_smem(x_g, x_s, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
            tiles = tuple(pk.load_tile(x_s.at[p]) for p in range(2))
            for p, t in enumerate(fake_quant_e4m3_tiles(tiles, groups)):
                x_s.at[p][...] = t
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(x_s, o_g)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, pk.smem((2, R, N), f32), plgpu.Barrier(num_barriers=1))

    xt = x.reshape(R, 2, N).transpose(1, 0, 2)
    out = jax.ShapeDtypeStruct(xt.shape, f32)
    k = pk.kernel(body, out_type=out, grid=(1,), grid_names=("x",), name="chan_fq_probe")
    return k(xt).transpose(1, 0, 2).reshape(R, N2)


def test_interpret_tiled_fake_quant_is_bitwise_the_qat_definition():
    """Two column tiles quantised as one tensor (w at K = 128) are bitwise the definition on the
    whole tensor, for every group kind."""
    x = _fq_input(128)
    for groups, axes in GROUP_AXES.items():
        got = np.asarray(run_interpreted(jax.jit(_fq_tiles_kernel, static_argnums=1), x, groups))
        assert np.array_equal(got, _fq_exact(x, axes)), groups


def _quantised_products(variant, K, sq, wq):
    """w from the intra kernel with ``w_quant=wq`` and h from the state loop's recomputation
    (``store_h``) with ``state_quant=sq`` (None: off), on a two-chunk core case with V = K."""
    cfg, (q, k, v, G, b, w, h0), _ = core_case(3, variant, 1, 128, 1, 2, K, gate_scale=0.05)
    bk = kernel_beta(b) if w is None else b
    icfg = ChannelIntraConfig(scalar_beta=w is None, w_quant=wq)
    _, kg, wk, u, _ = channel_intra(q, k, v, G, bk, w, icfg)
    egl = jnp.exp(G.reshape(1, 2, 64, 2, K)[:, :, -1]).transpose(0, 2, 1, 3)
    block_v = K if sq == "matrix" else 64
    fcfg = ChunkFwdConfig(scale=cfg.scale, block_v=block_v, store_h=True, state_quant=sq)
    h, _ = channel_chunk_fwd(None, kg, wk, u, None, egl, h0, fcfg)
    return wk.reshape(1, 2, 64, 2, K), h


@pytest.mark.parametrize("variant,K", [("kda", 128), ("gdn2", 64)])
def test_interpret_kernels_quantise_w_and_the_state_per_group(variant, K):
    """The intra kernel stores w and the recomputation kernel the chunk-entering states h on the
    e4m3 grid of exactly the configured groups (not on that of the other granularity), and
    without QAT on neither. K = 128: a row's and the tile's amax span both K-halves of w."""
    w_axes = {"row": (-1,), "tile": (2, 4)}  # w as [B, T/64, 64, HV, K]
    s_axes = {"column": (-2,), "matrix": (-2, -1)}  # h [B, T/64, HV, K, V]
    other_w = {"row": "tile", "tile": "row"}
    other_s = {"column": "matrix", "matrix": "column"}
    for sq, wq in (("column", "row"), ("matrix", "tile")):
        w, h = run_interpreted(_quantised_products, variant, K, sq, wq)
        assert _off_e4m3_grid(w, w_axes[wq]) <= 1, wq
        assert _off_e4m3_grid(w, w_axes[other_w[wq]]) > 4, wq
        assert _off_e4m3_grid(h, s_axes[sq]) <= 1, sq
        assert _off_e4m3_grid(h, s_axes[other_s[sq]]) > 4, sq
    w, h = run_interpreted(_quantised_products, variant, K, None, None)
    assert _off_e4m3_grid(w, w_axes["row"]) > 4
    assert _off_e4m3_grid(h, s_axes["column"]) > 4


@pytest.mark.parametrize(
    "variant,name,HV,dtype",
    [("kda", "column_row", 1, bf16), ("gdn2", "matrix_tile", 2, bf16)],
    ids=["kda-column_row", "gdn2-matrix_tile"],
)
def test_interpret_packed_states_with_qat(variant, name, HV, dtype):
    """Packed sequences with nonzero initial states and final states on one lane (the chunk
    loops' per-sequence table): the state is quantised after a sequence's h0 is loaded, and a
    sequence's final state is its unquantised end state."""
    x, cu, cts = channel_case(0, variant, 1, 100, 1, HV, 64, 64, CU, gate_scale=0.05)
    run_interpreted(lambda: check_qat_2x(variant, x, cu, cts, CONFIGS[name]))


@pytest.mark.parametrize(
    "variant,name,K,V",
    [("gdn2", "matrix_tile", 128, 128), ("kda", "column_row", 128, 64)],
    ids=["gdn2-matrix_tile-128x128", "kda-column_row-128x64"],
)
def test_interpret_k128_with_qat(variant, name, K, V):
    """K = 128: w quantised over both K-halves (row and tile scales); with 'matrix' at V = 128
    the state loops run one CTA per whole state (block_v = 128), forward and recomputation."""
    x, cu, cts = channel_case(1, variant, 1, 128, 1, 1, K, V, gate_scale=0.05)
    run_interpreted(lambda: check_qat_2x(variant, x, cu, cts, CONFIGS[name]))


@pytest.mark.parametrize("variant,name", [("gdn2", "column_row"), ("kda", "matrix_tile")])
def test_interpret_f16_with_qat(variant, name):
    """f16 io: the quantised state staged with per-column scales, h stored in f32; budget the xla
    path in f16 (V = 64: 'matrix' is served). Forward, final state and every gradient on dense
    lanes with GVA, a partial last chunk and an initial state, for the two (variant, config)
    pairs that the packed and K = 128 tests above do not run."""
    x, cu, cts = channel_case(2, variant, 1, 100, 1, 2, 64, 64, gate_scale=0.05)
    run_interpreted(lambda: check_qat_2x(variant, x, cu, cts, CONFIGS[name], f16))


def test_interpret_qat_none_is_bitwise_the_plain_kernels():
    x, _, _ = channel_case(1, "kda", 1, 64, 1, 1, 64, 64)
    args = [x[n].astype(bf16) for n in ("q", "k", "v")] + [x["g"], x["beta"]]
    kw = dict(initial_state=x["initial_state"], output_final_state=True)
    plain = run_interpreted(lambda: pallas_op("kda")(*args, **kw))
    off = run_interpreted(lambda: pallas_op("kda")(*args, qat=None, **kw))
    for a, b in zip(plain, off, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------------------------
# CPU: plumbing, the selector and what stays refused


def _op_args(variant, B, T, H, HV, K, V, dtype=bf16, n_states=None):
    S = jax.ShapeDtypeStruct
    gates = (S((B, T, HV, K), f32), S((B, T, HV, K), f32), S((B, T, HV, V), f32))
    if variant == "kda":
        gates = (S((B, T, HV, K), f32), S((B, T, HV), f32))
    xs = (S((B, T, H, K), dtype), S((B, T, H, K), dtype), S((B, T, HV, V), dtype), *gates)
    return xs, S((n_states or B, HV, K, V), f32)


def _fwd_bwd(op, cu=None, **kw):
    """Σ o + Σ final and its gradients w.r.t. the inputs and h0 of ``op`` (initial and final
    states; ``cu`` packed sequences)."""

    def f(xs, h0, *cu_):
        def loss(xs, h0):
            o, s = op(
                *xs, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
                cu_seqlens=cu_[0] if cu_ else None, **kw,
            )  # fmt: skip
            return jnp.sum(o.astype(f32)) + jnp.sum(s)

        return jax.value_and_grad(loss, argnums=(0, 1))(xs, h0)

    return f


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_forward_and_backward_kernels_get_the_qat_config(variant, name, monkeypatch):
    """Traced fwd+bwd: the intra kernel gets the w granularity and every state loop (the
    forward's and the backward's recomputation of h) the state granularity, with the whole state
    in one CTA for 'matrix'."""
    from gdn_jax.ops import _channel_pallas as cpm
    from gdn_jax.ops import _channel_pallas_bwd as cpb

    seen = {"intra": [], "loop": []}

    def spy(name, fn):
        def wrapped(*a):
            seen[name].append(a[-1] if name == "intra" else a[7])
            return fn(*a)

        return wrapped

    monkeypatch.setattr(cpm, "channel_intra", spy("intra", cpm.channel_intra))
    monkeypatch.setattr(cpm, "channel_chunk_fwd", spy("loop", cpm.channel_chunk_fwd))
    monkeypatch.setattr(cpb, "channel_chunk_fwd", spy("loop", cpb.channel_chunk_fwd))
    cfg = CONFIGS[name]
    xs, h0 = _op_args(variant, 1, 100, 1, 2, 64, 128)
    with pk.use_mode("gpu"):  # traced only, never run
        jax.eval_shape(_fwd_bwd(pallas_op(variant), qat=cfg), xs, h0)
    assert [c.w_quant for c in seen["intra"]] == [cfg.w_granularity]
    assert [(c.store_h, c.state_quant) for c in seen["loop"]] == [
        (False, cfg.state_granularity),
        (True, cfg.state_granularity),
    ]
    assert {c.block_v for c in seen["loop"]} == {128 if name == "matrix_tile" else 64}


def _ran(variant, args, monkeypatch, **kw):
    """Which implementation the default selection on a Hopper GPU runs (traced only)."""
    from gdn_jax import ops

    monkeypatch.setattr(ops, "_on_hopper", lambda: True)
    with pk.use_mode("gpu"):
        jaxpr = str(jax.make_jaxpr(lambda *a: OPS[variant](*a, **kw)[0])(*args))
    return "pallas" if "chan_chunk_fwd" in jaxpr else "xla"  # the state loop kernel's name


def _concrete(variant, K, V, dtype=bf16, T=64, n=1):
    """The op's positional arguments (q, k, v in ``dtype``) and n initial states."""
    x = random_inputs(0, B=1, T=T, H=1, HV=1, K=K, V=V, variant=variant, n_states=n)
    args = positional(x, variant)
    return [a.astype(dtype) for a in args[:3]] + list(args[3:]), x["initial_state"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_selector_picks_pallas_with_qat(variant, name, monkeypatch):
    args, _ = _concrete(variant, 64, 64)
    assert _ran(variant, args, monkeypatch, qat=CONFIGS[name]) == "pallas"
    args, _ = _concrete(variant, 128, 128)
    assert _ran(variant, args, monkeypatch, qat=CONFIGS[name]) == "pallas"


MATRIX = qat.QATConfig(state_granularity="matrix")


@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_unsupported_qat_falls_back_to_xla(variant, monkeypatch):
    """The state granularity 'matrix' at V = 128 with f16, or with packed sequences with states:
    the Pallas path raises NotImplementedError naming the reason, the selector runs xla."""
    args, h0 = _concrete(variant, 64, 128, dtype=f16)
    assert _ran(variant, args, monkeypatch, qat=MATRIX) == "xla"
    with pk.use_mode("gpu"), pytest.raises(ExceptionGroup) as e:
        OPS[variant](*args, implementation="pallas", qat=MATRIX)
    assert all(isinstance(err, NotImplementedError) for err in e.value.exceptions)
    assert "f16 with the QAT state granularity 'matrix'" in str(e.value.exceptions[0])

    args, h0 = _concrete(variant, 64, 128, T=100, n=2)
    cu = jnp.asarray([0, 30, 100], jnp.int32)
    kw = dict(qat=MATRIX, cu_seqlens=cu, initial_state=h0)
    assert _ran(variant, args, monkeypatch, **kw) == "xla"
    with pk.use_mode("gpu"), pytest.raises(ExceptionGroup) as e:
        OPS[variant](*args, implementation="pallas", **kw)
    assert "packed sequences with states" in str(e.value.exceptions[0])
    # 'column' serves both, and 'matrix' serves packed sequences without states
    assert _ran(variant, args, monkeypatch, **dict(kw, qat=CONFIGS["column_row"])) == "pallas"
    assert _ran(variant, args, monkeypatch, qat=MATRIX, cu_seqlens=cu) == "pallas"
    args, _ = _concrete(variant, 64, 128, dtype=f16)
    assert _ran(variant, args, monkeypatch, qat=CONFIGS["column_row"]) == "pallas"


# ------------------------------------------------------------------------------------------------
# CPU: the real GPU lowering with QAT (layouts of the reductions, fp8 casts, SMEM, block_v = 128)


# Every pair of (variant, QAT config, K, V, dtype) values that the plan serves, in six cases (a
# pairwise covering array); 'matrix' at V = 128 stays bf16 (the plan refuses it with f16) and
# lowers with dense lanes for both variants.
LOWERING = [
    ("kda", "column_row", 64, 64, "bfloat16"),
    ("gdn2", "column_row", 128, 64, "bfloat16"),
    ("kda", "column_row", 128, 128, "float16"),
    ("gdn2", "matrix_tile", 64, 64, "float16"),
    ("kda", "matrix_tile", 64, 128, "bfloat16"),
    ("gdn2", "matrix_tile", 128, 128, "bfloat16"),
]
QAT_KERNELS = ("chan_intra_wy", "chan_intra_qk", "chan_chunk_fwd", "chan_chunk_h")


@pytest.mark.parametrize("variant,name,K,V,dtype", LOWERING)
def test_lowers_for_cuda_with_qat(variant, name, K, V, dtype):
    """The kernels QAT changes lower for the GPU (Mosaic GPU checks layouts, the fp8 casts and the
    shared-memory budget while lowering): the op's forward (the intra kernel with w's fake quant,
    the state loop with the state's) and the backward's recomputation of h with the same plan;
    packed sequences with states (the per-sequence table) wherever the plan serves them, dense
    lanes otherwise. The other backward kernels do not change with QAT
    (test_forward_and_backward_kernels_get_the_qat_config); test_channel_pallas.py lowers them."""
    from gdn_jax.ops._channel_pallas import ChannelConfig, core_plan
    from pallas_kernels._tiles import META_COLS

    packed = not (name == "matrix_tile" and V == 128)
    n, dt = (3 if packed else 2), jnp.dtype(dtype)
    xs, h0 = _op_args(variant, 1 if packed else 2, 200, 2, 4, K, V, dt, n)
    extra = (jax.ShapeDtypeStruct((n + 1,), jnp.int32),) if packed else ()
    cfg = CONFIGS[name]

    def forward(xs, h0, *cu):
        return pallas_op(variant)(
            *xs, initial_state=h0, output_final_state=True, use_qk_l2norm=True,
            cu_seqlens=cu[0] if cu else None, qat=cfg,
        )  # fmt: skip

    # the backward's recomputation of h on the core's lanes: 6 chunks (200 rows, 3 sequences)
    S = jax.ShapeDtypeStruct
    N, nt = (1, 6) if packed else (2, 4)
    x = lambda d: S((N, nt * 64, 4, d), dt)  # noqa: E731
    ccfg = ChannelConfig(scale=1.0, mode="gpu", qat=cfg, scalar_beta=variant == "kda")
    fcfg = core_plan(ccfg, x(K), x(V), store_a=True).fwd_config(1.0, store_h=True)
    meta = (S((nt, META_COLS), jnp.int32),) if packed else ()

    def recompute_h(kg, w, u, egl, h0, *meta):
        return channel_chunk_fwd(None, kg, w, u, None, egl, h0, fcfg, *meta)

    with pk.cuda_lowering_mesh():
        txt = jax.jit(forward).trace(xs, h0, *extra).lower(lowering_platforms=("cuda",)).as_text()
        args = (x(K), x(K), x(V), S((N, 4, nt, K), f32), S((n, 4, K, V), f32), *meta)
        txt += jax.jit(recompute_h).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert lowered_kernels(txt, QAT_KERNELS) == set(QAT_KERNELS)


def test_matrix_state_scale_needs_the_whole_state_in_one_cta():
    S, bf = jax.ShapeDtypeStruct, bf16
    cfg = ChunkFwdConfig(scale=1.0, block_v=64, state_quant="matrix")
    qk, u = S((1, 64, 1, 128), bf), S((1, 64, 1, 128), bf)
    args = (qk, qk, qk, u, S((1, 64, 1, 64), bf), S((1, 1, 1, 128), f32), S((1, 1, 128, 128), f32))
    with pk.cuda_lowering_mesh(), pytest.raises(NotImplementedError, match="matrix"):
        jax.eval_shape(lambda *a: channel_chunk_fwd(*a, cfg), *args)


# ------------------------------------------------------------------------------------------------
# GPU (H200): realistic shapes, as tests/pallas/test_qat_pallas.py's GDN GPU tests


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_gpu_pallas_matches_xla_with_qat(variant, name):
    x, cu, cts = channel_case(7, variant, 1, 2048, 16, 16, 128, 128, gate_scale=0.05)
    check_qat_2x(variant, x, cu, cts, CONFIGS[name], jit=True)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_gpu_pallas_matches_xla_with_qat_f16(variant):
    x, cu, cts = channel_case(10, variant, 2, 1000, 4, 8, 128, 128, gate_scale=0.05)
    check_qat_2x(variant, x, cu, cts, CONFIGS["column_row"], f16, jit=True)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_gpu_packed_states_with_qat(variant):
    cu = [0, 1000, 1000, 2500, 2501, 4096]
    x, cu, cts = channel_case(11, variant, 1, 4096, 8, 16, 128, 128, cu, gate_scale=0.05)
    check_qat_2x(variant, x, cu, cts, CONFIGS["column_row"], jit=True)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "granularity",
    # matrix: the kernels' matrix state scales are checked (both sites) by
    # test_gpu_pallas_matches_xla_with_qat[matrix_tile]; here in the slow set
    ["column", pytest.param("matrix", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("variant", ["kda", "gdn2"])
def test_gpu_state_qat_matches_quantised_recurrence(variant, granularity):
    """State site alone: the 2x rule against the token recurrence quantised every 64 tokens."""
    cfg = qat.QATConfig(sites=("state",), state_granularity=granularity)
    x, cu, cts = channel_case(8, variant, 1, 4096, 16, 16, 128, 128, gate_scale=0.05)
    check_qat_2x(variant, x, cu, cts, cfg, ref=RECURRENT[variant], jit=True)
