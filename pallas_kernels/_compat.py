"""The one place that touches the version-dependent Pallas Mosaic GPU (``plgpu``) API.

Kernel files import ``pl``/``plgpu`` and the helpers below from here, so a JAX upgrade that moves or
renames something is fixed in this file alone. Written against jax 0.11.2.

Execution mode: kernels run on a Hopper GPU, or under the Mosaic GPU CPU interpreter
(``plgpu.InterpretGPUParams``) when :func:`execution_mode` says ``"interpret"``. The mode is read
when a kernel is traced, so tests switch it with the :func:`use_mode` context manager.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import core as _mgpu_core
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.interpreters import mlir

__all__ = [
    "pl",
    "plgpu",
    "Mode",
    "WG_AXIS",
    "execution_mode",
    "use_mode",
    "interpret_params",
    "reset_interpreter",
    "kernel",
    "transforms_for",
    "smem",
    "block_spec",
    "matmul",
    "matmul_sum",
    "acc_values",
    "row_vec",
    "col_vec",
    "iota",
    "load_tile",
    "to_wgmma",
    "bcast_rows",
    "bcast_cols",
    "cuda_lowering_mesh",
    "is_hopper",
    "KernelLaunch",
    "record_kernel_launches",
    "profile_regions",
]

Mode = Literal["auto", "gpu", "interpret"]
# the axis name of the warpgroup index in kernels with several warpgroups per CTA
WG_AXIS = "wg"
_MODE: contextvars.ContextVar[Mode] = contextvars.ContextVar("pallas_kernels_mode", default="auto")
# (trace directory, events per warpgroup) while :func:`profile_regions` is active
_PROFILE: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "pallas_kernels_profile", default=None
)


def execution_mode() -> Mode:
    """``"auto"`` (GPU when a Hopper GPU is the default backend), ``"gpu"`` or ``"interpret"``."""
    return _MODE.get()


@contextlib.contextmanager
def use_mode(mode: Mode) -> Iterator[None]:
    """Context manager selecting how kernels traced inside it execute.

    ``"interpret"`` runs them under the CPU Mosaic GPU interpreter (slow: tiny shapes only);
    ``"gpu"`` forces the real lowering even off-GPU (used to lower for CUDA on a CPU machine).
    """
    if mode not in ("auto", "gpu", "interpret"):
        raise ValueError(f"{mode=} must be 'auto', 'gpu' or 'interpret'")
    token = _MODE.set(mode)
    try:
        yield
    finally:
        _MODE.reset(token)


def is_hopper() -> bool:
    """True when the default backend is a compute-capability 9.x NVIDIA GPU."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    cc = getattr(dev, "compute_capability", None)
    return dev.platform == "gpu" and isinstance(cc, str) and cc.split(".")[0] == "9"


def interpret_params():
    """The interpreter parameters for ``plgpu.kernel(interpret=...)``."""
    return plgpu.InterpretGPUParams()


def reset_interpreter() -> None:
    """Resets the GPU interpreter after an exception inside it (its docstring asks for this).

    Waits for the interpreted kernels still in flight first: dispatch is asynchronous, and the
    interpreter's state is one module global, so a reset under a running kernel fails that kernel
    (an AssertionError in its callbacks) or leaves it waiting on a barrier that no longer exists.
    """
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    try:
        jax.effects_barrier()  # the kernels end on an ordered callback: this waits for them
    except jax.errors.JaxRuntimeError:
        pass  # a kernel that failed; its error comes back where its outputs are read
    interpret_pallas_call.reset_gpu_interpret_mode_state()


def kernel(
    body: Callable,
    *,
    out_type,
    grid: tuple[int, ...],
    grid_names: tuple[str, ...],
    name: str,
    input_output_aliases: dict[int, int] | None = None,
    warpgroups: int = 1,
):
    """``plgpu.kernel`` with ``warpgroups`` warpgroups per CTA (one by default; more: the
    warpgroup index is the axis :data:`WG_AXIS`), interpreted when the mode says so.

    ``name`` becomes the kernel's symbol (it shows up in profiles and in the lowered module).
    ``input_output_aliases`` ({input index: output index}, as for ``pallas_call``): that output
    is written into the input's buffer. ``out_type`` still lists it and the body still gets an
    output ref for it (the same ref as the input), so kernels are written as without aliasing.
    ``plgpu.kernel`` has no such argument on jax 0.11.2: the input travels as a mutable
    ``jax.Ref``, whose discharge aliases it to a kernel output (a donated argument then updates
    in place, with no copy).
    """
    interpret = interpret_params() if execution_mode() == "interpret" else None
    profile = _PROFILE.get()
    params = None
    if profile is not None and interpret is None:
        params = plgpu.CompilerParams(
            profile_space=profile[1], profile_dir=profile[0], profile_bounds_check=True
        )
    if not input_output_aliases:
        return plgpu.kernel(
            body,
            out_type=out_type,
            grid=grid,
            grid_names=grid_names,
            interpret=interpret,
            compiler_params=params,
            kernel_name=name,
            num_threads=warpgroups if warpgroups > 1 else None,
            thread_name=WG_AXIS if warpgroups > 1 else None,
        )
    if warpgroups > 1:
        raise NotImplementedError("input_output_aliases with several warpgroups per CTA")
    single = not isinstance(out_type, (tuple, list))
    out_types = (out_type,) if single else tuple(out_type)
    aliases = dict(input_output_aliases)
    if len(set(aliases.values())) != len(aliases):
        raise ValueError(f"{input_output_aliases=}: an output can alias one input only")
    kept = [j for j in range(len(out_types)) if j not in aliases.values()]

    def call(*args):
        n_in = len(args)
        refs = {i: jax.new_ref(args[i]) for i in aliases}
        args = [refs.get(i, a) for i, a in enumerate(args)]

        def wrapped(*all_refs):
            ins = all_refs[:n_in]
            outs = dict(zip(kept, all_refs[n_in:], strict=True))
            outs.update({j: ins[i] for i, j in aliases.items()})
            body(*ins, *(outs[j] for j in range(len(out_types))))

        res = plgpu.kernel(
            wrapped,
            out_type=tuple(out_types[j] for j in kept),
            grid=grid,
            grid_names=grid_names,
            interpret=interpret,
            compiler_params=params,
            kernel_name=name,
        )(*args)
        res = dict(zip(kept, res, strict=True))
        res.update({j: refs[i][...] for i, j in aliases.items()})
        outs = tuple(res[j] for j in range(len(out_types)))
        return outs[0] if single else outs

    return call


_DUMP_BASENAME = "mosaic_gpu.dump_basename"


def _install_stable_kernel_modules() -> None:
    """Makes identical kernels lower to byte-identical modules, so Mosaic GPU compiles each once.

    Mosaic GPU compiles a kernel when XLA instantiates its custom call and caches the result per
    process, keyed by the SHA-256 of the serialized module. jax 0.11.2 stamps every lowered module
    with ``mosaic_gpu.dump_basename = "<kernel>_<n>"``, ``n`` a per-process lowering counter that
    only names debug dump files. So every call site hashed differently and was compiled again:
    on the H200 a model step compiled each GDN layer's 7 kernels anew (~10 s per layer, see
    benchmarks/RESULTS.md). Before the module is hashed, the attribute is reset to the kernel's
    symbol name; nothing else reads it.
    """
    original = _mgpu_core._mosaic_gpu_lowering_rule
    if getattr(original, "stable_kernel_modules", False):
        return

    def rule(ctx, *args, module, **kwargs):
        attrs = module.operation.attributes
        if _DUMP_BASENAME in attrs and "sym_name" in attrs:
            attrs[_DUMP_BASENAME] = attrs["sym_name"]
        return original(ctx, *args, module=module, **kwargs)

    rule.stable_kernel_modules = True
    # Pallas calls the rule through the module attribute; plain Mosaic GPU through the registry.
    _mgpu_core._mosaic_gpu_lowering_rule = rule
    mlir.register_lowering(_mgpu_core.mosaic_gpu_p, rule, "cuda")


_install_stable_kernel_modules()

# the Mosaic GPU interpreter's modules (its callbacks; thread_map is shared with Mosaic TPU's)
_INTERPRETER_MODULES = (
    "jax._src.pallas.mosaic_gpu.interpret.",
    "jax._src.pallas.mosaic.interpret.",
)


def _install_host_operand_interpreter_callbacks() -> None:
    """Hands the Mosaic GPU interpreter's callbacks NumPy operands, so they dispatch no JAX op.

    ``io_callback`` ``device_put``s its operands onto the CPU before calling the Python function,
    and the interpreter's callbacks then compute with those ``jax.Array``s (e.g.
    ``shared_memory.wait_smem_to_gmem`` compares one with a count while holding the interpreter's
    lock, ``_deallocate_barrier`` reshapes one). Each such op is a nested CPU computation started
    from inside a running one, and on jax 0.11.2 under CPU contention (two interpreter processes
    on two cores) it sometimes never returns: the kernel, and its test, hang. With NumPy operands
    the callbacks run plain NumPy; the interpreter's only ``jax.Array`` check on them
    (``shared_memory._to_int``) is taught NumPy integers. Other ``io_callback``s are unchanged.
    """
    from jax._src import callback
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory

    original = callback.io_callback_impl
    if getattr(original, "host_operands", False):
        return

    def interpreter_callback(flat_callback) -> bool:
        f = flat_callback.callback_func
        f = getattr(f, "func", f)  # functools.partial
        return getattr(f, "__module__", "").startswith(_INTERPRETER_MODULES)

    def impl(*args, result_avals, callback, sharding, ordered):
        if not interpreter_callback(callback):
            return original(
                *args, result_avals=result_avals, callback=callback, sharding=sharding,
                ordered=ordered,
            )  # fmt: skip
        return jax.tree.map(np.asarray, callback(*jax.tree.map(np.asarray, args)))

    to_int = shared_memory._to_int

    def to_int_or_numpy(x):
        return int(x) if isinstance(x, np.ndarray | np.integer) else to_int(x)

    impl.host_operands = True
    callback.io_callback_impl = impl  # io_callback's lowering looks it up at each call
    shared_memory._to_int = to_int_or_numpy


_install_host_operand_interpreter_callbacks()


def transforms_for(cols: int, dtype, swizzle: int = 128) -> tuple:
    """TMA/wgmma-friendly tiling + swizzle for a 2-D SMEM tile with ``cols`` columns: a swizzle
    of ``swizzle`` bytes (at most a row's bytes) and tiles of 8 rows × one swizzle width."""
    itemsize = jnp.dtype(dtype).itemsize
    row_bytes = cols * itemsize
    swizzle = min(swizzle, row_bytes)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def smem(shape: Sequence[int], dtype, *, swizzled: bool = True, swizzle: int = 128):
    """An SMEM allocation; 2-D (or stacked 2-D) tiles are tiled and swizzled for wgmma/TMA.

    ``swizzle``: the swizzle in bytes (128 by default). wgmma contracts in steps of one swizzle
    width, so a product over 16 rows or columns of 16-bit tiles needs ``swizzle=32`` on both
    operands (wgmma takes one swizzle for A and B)."""
    if swizzled and len(shape) >= 2:
        transforms = transforms_for(shape[-1], dtype, swizzle)
        return plgpu.SMEM(tuple(shape), dtype, transforms=transforms)
    return plgpu.SMEM(tuple(shape), dtype)


def block_spec(block_shape, index_map, *, dtype=None, cols: int | None = None):
    """A pipeline ``BlockSpec``; tiles with a 16-bit ``dtype`` get the swizzled transforms."""
    transforms = () if dtype is None else transforms_for(cols, dtype)
    return plgpu.BlockSpec(block_shape, index_map, transforms=transforms)


def matmul(a, b, shape: tuple[int, int]) -> jax.Array:
    """``a @ b`` on the tensor cores with an f32 result in registers (WGMMA layout).

    ``a`` is an SMEM ref (or a register value), ``b`` an SMEM ref; either may be a transposed
    16-bit ref view. The accumulator lives in its own scope (REGS cannot share a scope).
    """
    return matmul_sum(((a, b),), shape)


def matmul_sum(pairs, shape: tuple[int, int]) -> jax.Array:
    """``Σ a @ b`` over the ``(a, b)`` operand pairs (as for :func:`matmul`) in one f32
    accumulator, e.g. a product with an f32 operand staged as two 16-bit terms hi + lo."""

    def body(acc):
        for a, b in pairs:
            plgpu.wgmma(acc, a, b)
        return acc_values(acc)

    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def acc_values(*accs):
    """The values of wgmma accumulators once every wgmma in flight is done: one value for one
    accumulator, else a list.

    The wait and the reads are inline assembly that LLVM only orders among themselves: the
    registers come from the wgmmas' own instructions, so LLVM may move pure arithmetic on them
    (a negation, a scaling) above the wait, between a wgmma and its completion. ptxas then
    serialises every wgmma of the kernel (its note C7514; ``kernel_resources.py`` reports it as
    ``wgmma_serialized``). The values leave through an optimisation barrier, an assembly
    statement after the wait that their users depend on.
    """
    plgpu.wgmma_wait(0)
    vals = jax.lax.optimization_barrier([a[...] for a in accs])
    return vals[0] if len(accs) == 1 else list(vals)


def row_vec(ref) -> jax.Array:
    """Loads a 1-D f32 SMEM vector laid out to broadcast along rows (``v[:, None]``)."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1))


def col_vec(ref, n: int) -> jax.Array:
    """Loads the same kind of vector laid out to broadcast along columns (``v[None, :]``).

    Uses a distinct view (``ref.at[pl.ds(0, n)]``): identical loads get CSE'd and a single load
    cannot carry both layouts (pitfall P5 in the Mosaic GPU notes).
    """
    return plgpu.load(ref.at[pl.ds(0, n)], layout=plgpu.Layout.WGMMA.reduce(0))


def load_tile(ref) -> jax.Array:
    """Loads a 2-D SMEM tile into registers in the WGMMA layout (an explicit layout anchor)."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA)


def iota(shape: tuple[int, int], dim: int) -> jax.Array:
    """int32 iota in the WGMMA register layout (masks for wgmma results)."""
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def to_wgmma(x: jax.Array) -> jax.Array:
    """Pins a register value to the WGMMA layout (e.g. a zero-initialised carry)."""
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def bcast_rows(vec: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """``vec[:, None]`` broadcast to ``shape`` (vec laid out by :func:`row_vec`)."""
    return lax.broadcast_in_dim(vec, shape, [0])


def bcast_cols(vec: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """``vec[None, :]`` broadcast to ``shape`` (vec laid out by :func:`col_vec`)."""
    return lax.broadcast_in_dim(vec, shape, [1])


@functools.cache
def _abstract_h200_mesh():
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    return AbstractMesh(
        (1,),
        ("x",),
        (AxisType.Explicit,),
        abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"),
    )


@contextlib.contextmanager
def cuda_lowering_mesh() -> Iterator[None]:
    """Context for ``jit(f).trace(...).lower(lowering_platforms=("cuda",))`` on a CPU machine.

    Sets an abstract H200 mesh (so Mosaic GPU knows its target) and forces the GPU kernel path.
    """
    with jax.sharding.use_abstract_mesh(_abstract_h200_mesh()), use_mode("gpu"):
        yield


@dataclasses.dataclass
class KernelLaunch:
    """What Mosaic GPU lowered for one kernel (the largest over its lowerings).

    Attributes:
      smem: shared memory bytes per CTA, Mosaic GPU's own count (the one its "exceeds available
        shared memory" check compares).
      threads: threads per CTA.
    """

    smem: int
    threads: int


@contextlib.contextmanager
def profile_regions(directory: str, events: int = 64) -> Iterator[None]:
    """A context in which every Mosaic GPU kernel traced is built with Mosaic GPU's on-device
    profiler: each warpgroup records the clock at the entry and exit of every ``jax.named_scope``
    region of the kernel body (the first ``events`` entries and exits of a warpgroup: a loop
    kernel's later steps are dropped, not written past the buffer), and each run
    writes a Perfetto trace ``<name>-<time>-trace.json`` into ``directory``
    (``benchmarks/kernel_regions.py`` reads them). Off under the interpreter. The profiler's
    buffer takes ``16 · events`` bytes of shared memory per warpgroup."""
    if events < 1:
        raise ValueError(f"{events=} must be positive")
    token = _PROFILE.set((str(directory), int(events)))
    try:
        yield
    finally:
        _PROFILE.reset(token)


def record_kernel_launches() -> contextlib.AbstractContextManager[dict[str, KernelLaunch]]:
    """A context that records ``{kernel name: KernelLaunch}`` of every Mosaic GPU kernel lowered
    inside it (jax 0.11.2: the ``block`` and ``smem_buffers`` of ``core._launch``, sized by
    ``core._smem_tree_size``).

    Raises:
      NotImplementedError: this JAX's Mosaic GPU has no ``_launch`` / ``_smem_tree_size``.
    """
    launch = getattr(_mgpu_core, "_launch", None)
    size = getattr(_mgpu_core, "_smem_tree_size", None)
    if launch is None or size is None:
        raise NotImplementedError("this JAX's Mosaic GPU has no _launch / _smem_tree_size to read")
    return _recording_launches(launch, size)


@contextlib.contextmanager
def _recording_launches(launch, size) -> Iterator[dict[str, KernelLaunch]]:
    found: dict[str, KernelLaunch] = {}

    @contextlib.contextmanager
    def recording(token, grid, cluster, block, smem_buffers, semantics, module, *a, **kw):
        name = str(module.operation.attributes["sym_name"]).strip('"')  # a quoted MLIR string
        seen = found.get(name, KernelLaunch(0, 0))
        found[name] = KernelLaunch(
            max(seen.smem, size(smem_buffers)), max(seen.threads, int(np.prod(block)))
        )
        with launch(token, grid, cluster, block, smem_buffers, semantics, module, *a, **kw) as r:
            yield r

    _mgpu_core._launch = recording
    try:
        yield found
    finally:
        _mgpu_core._launch = launch
