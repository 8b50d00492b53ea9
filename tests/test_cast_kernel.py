"""The hand-written Triton cast (fp8ops/precision/cast_kernel.py), run on the CPU by Triton's
interpreter (and, on a GPU, compiled: the last test).

The interpreter's float-to-FP8 conversion is not the GPU's: it truncates instead of rounding
to nearest even, and turns NaN into a number (E4M3 0xF8). So these tests use inputs whose scaled
values are FP8 values exactly (every finite FP8 value, both signs, subnormals included) plus
zeros, infinities and values past the format's maximum, and compare the FP8 bytes everywhere
but at NaN inputs: everything the kernel does but the conversion instruction itself. NaN still
runs through the amax and the history fold, which are checked. The conversion is the GPU's, and
there the kernel is checked bit for bit against the eager cast at its first call
(``Compiled``), NaN and every rounding included, like the compiled casts (``ci/gpu_check.py``,
part b).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from fp8ops.precision import cast_kernel
from fp8ops.precision.compiled import same_bits
from fp8ops.precision.formats import E4M3, E5M2
from fp8ops.precision.linear import _cast_and_record, _cast_record_and_count

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter)"
)
SLOW = pytest.mark.slow  # the interpreter's seconds per call: the full suite's, not the fast tier's


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # Triton reads the setting when a kernel is defined: the kernels' module is imported anew,
    # and dropped again afterwards, a skip included: left behind, it would interpret the GPU
    # tests' kernels too (slowly, and with the same failure).
    sys.modules.pop(cast_kernel.KERNELS_MODULE, None)
    try:
        reason = _interpreter_broken()
        if reason:
            pytest.skip(reason)
        yield
    finally:
        sys.modules.pop(cast_kernel.KERNELS_MODULE, None)


def _interpreter_broken() -> str | None:
    """Why this Triton's interpreter cannot run the fold kernel, or None. Triton 3.6's
    interpreter turns a scalar argument into a one-element array and bounds a loop with
    ``int()`` of it, which numpy 2.5 refuses (the H200 image: triton 3.6.0, numpy 2.5.2);
    later Triton squeezes it first. There the GPU test below runs the kernel itself."""
    import numpy as np
    import triton

    _, fold = cast_kernel._kernels()
    try:
        unused = torch.ones(3)  # the count buffers, which COUNT=False leaves alone
        fold[(1,)](
            torch.ones(3),
            3,
            torch.zeros(2),
            0,
            unused,
            unused,
            unused,
            BLOCK=4,
            COUNT=False,
            COUNT_BITS=16,
        )
    except triton.runtime.errors.InterpreterError as exc:
        # Only that known failure skips; any other error is the kernel's, for the tests to show.
        if not (isinstance(exc.__cause__, TypeError) and "0-dimensional" in str(exc)):
            raise
        return (
            f"Triton {triton.__version__}'s interpreter cannot run the kernels with numpy "
            f"{np.__version__}: {exc}"[:300]
        )
    return None


def exact_inputs(fp8, scale: float, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
    """Every finite FP8 value of ``fp8`` divided by ``scale`` (a power of two, so the kernel's
    product is that FP8 value again), then the special values, tiled to ``shape``: zeros,
    infinities, NaN, values past the maximum, and values too small for the format (they
    underflow to zero however the conversion rounds)."""
    values = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(fp8.torch_dtype).float()
    values = values[torch.isfinite(values)]
    tiny = values[values > 0].min() / 4  # a quarter of the smallest subnormal: casts to zero
    values = values / scale
    specials = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            -float("inf"),
            float("nan"),
            2 * fp8.max / scale,
            -3 * fp8.max / scale,
            3e38,
            tiny / scale,
            -tiny / scale,
            tiny / 2 / scale,
        ]
    )
    pattern = torch.cat([values, specials])
    count = shape[0] * shape[1]
    tiled = pattern.repeat(-(-count // pattern.numel()))[:count]
    return tiled.reshape(shape).to(dtype)


def both(x, history, scales, slot, fp8, transposed, count=False):
    """The kernel's and the eager function's results, each on its own copies of the state;
    ``count``: the measuring step's cast (data, amax, counts[, data_t])."""
    kernel, eager = (
        (cast_kernel.cast_record_and_count, _cast_record_and_count)
        if count
        else (cast_kernel.cast_and_record, _cast_and_record)
    )
    kernel_state, eager_state = (history.clone(), scales.clone()), (history.clone(), scales.clone())
    got = kernel(x, *kernel_state, slot, fp8.max, fp8.torch_dtype, transposed)
    want = eager(x, *eager_state, slot, fp8.max, fp8.torch_dtype, transposed)
    return got, want, kernel_state[0], eager_state[0]


def same_bytes_but_at_nan(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> bool:
    """The FP8 bytes are equal wherever the input (laid out as ``got``) is not NaN."""
    differ = got.view(torch.uint8) != want.view(torch.uint8)
    return got.shape == want.shape and not (differ & ~torch.isnan(x)).any()


# The interpreter takes seconds per call: the fast tier runs E4M3 from bf16 at scale 1, the full
# suite every combination.
@pytest.mark.parametrize("fp8", [E4M3, pytest.param(E5M2, marks=SLOW)], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, pytest.param(torch.float32, marks=SLOW)], ids=["bf16", "fp32"]
)
@pytest.mark.parametrize("scale", [1.0, *(pytest.param(s, marks=SLOW) for s in (2.0**-6, 16.0))])
def test_the_kernel_casts_transposes_and_records_as_the_eager_cast(interpreted, fp8, dtype, scale):
    # 70 x 150: neither side a multiple of the 64 x 64 tile, so the edge masks are exercised.
    x = exact_inputs(fp8, scale, dtype, (70, 150))
    history = torch.tensor([[0.0, float("nan"), 5.0], [1.0, 2.0, 3.0]])
    scales = torch.tensor([0.5, scale, 2.0])
    got, want, got_history, want_history = both(x, history, scales, 1, fp8, transposed=True)
    assert got[0].shape == (70, 150) and got[1].shape == (150, 70)
    assert same_bytes_but_at_nan(got[0], want[0], x)  # saturation, signed zeros, inf
    assert same_bytes_but_at_nan(got[1], want[1], x.t())
    assert torch.equal(got[1].view(torch.uint8), got[0].view(torch.uint8).t())
    assert same_bits(got_history, want_history)  # NaN in row 0 replaced by an inf amax (fmax)
    assert got_history[0, 1] == float("inf") and torch.equal(got_history[1], history[1])


@pytest.mark.parametrize(
    ("fp8", "dtype", "scale", "transposed"),
    [  # the fast tier runs the first
        pytest.param(E4M3, torch.bfloat16, 1.0, True, id="e4m3-bf16-transposed"),
        pytest.param(E4M3, torch.float32, 2.0**-6, False, id="e4m3-fp32-plain", marks=SLOW),
        pytest.param(E5M2, torch.bfloat16, 16.0, False, id="e5m2-bf16-plain", marks=SLOW),
        pytest.param(E5M2, torch.float32, 1.0, True, id="e5m2-fp32-transposed", marks=SLOW),
    ],
)
def test_the_counting_kernel_counts_what_the_eager_cast_counts(
    interpreted, fp8, dtype, scale, transposed
):
    """The measuring step's cast: the same FP8 bytes and history, plus the cast's own amax and
    its saturated, underflowed, NaN and Inf counts, each of which the inputs make non-zero.
    (Four cases, not every combination: the interpreter takes seconds per counting call.)"""
    x = exact_inputs(fp8, scale, dtype, (70, 150))
    history = torch.tensor([[0.0, float("nan"), 5.0], [1.0, 2.0, 3.0]])
    scales = torch.tensor([0.5, scale, 2.0])
    got, want, got_history, want_history = both(x, history, scales, 1, fp8, transposed, True)
    assert len(got) == len(want) == (4 if transposed else 3)
    assert same_bytes_but_at_nan(got[0], want[0], x)
    if transposed:
        assert same_bytes_but_at_nan(got[3], want[3], x.t())
    assert same_bits(got[1], want[1]) and got[1] == float("inf")  # the cast's amax
    assert got[2].dtype == torch.int64 and torch.equal(got[2], want[2])
    # Saturated, underflow, NaN and Inf all occur, each a different number of times, so a
    # count in the wrong place fails too.
    assert (got[2] > 0).all() and len(set(got[2].tolist())) == 4, got[2]
    assert same_bits(got_history, want_history)


@pytest.mark.slow
def test_the_fold_adds_up_counts_over_several_loops(interpreted, monkeypatch):
    """With a fold block of 8 tiles, 12 tiles take two loops, the second part-masked; the
    largest value and every counted element sit in the last tile."""
    monkeypatch.setattr(cast_kernel, "FOLD_BLOCK", 8)
    x = torch.ones(130, 200)  # 3 x 4 tiles of 64 x 64
    x[129, 199], x[128, 198], x[129, 198], x[128, 197] = -900.0, float("nan"), 1e-12, -float("inf")
    got, want, got_history, want_history = both(
        x, torch.zeros(2, 3), torch.ones(3), 0, E4M3, False, True
    )
    assert got[1] == float("inf") and same_bits(got_history, want_history)
    assert got[2].tolist() == want[2].tolist() == [2, 1, 1, 1]  # -900 and -inf saturate


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.slow
def test_the_amax_ignores_nan_keeps_the_largest_tile_and_folds_into_row_zero(interpreted, fp8):
    x = torch.zeros(130, 200)
    x[3, 5], x[129, 199], x[64, 64] = float("nan"), -7.0, 3.0  # the largest is in an edge tile
    for row0, expected in ((0.0, 7.0), (9.0, 9.0), (float("nan"), 7.0)):
        history = torch.tensor([[row0, 1.0, 1.0]])
        got, want, got_history, want_history = both(x, history, torch.ones(3), 0, fp8, False)
        assert len(got) == 1 and same_bytes_but_at_nan(got[0], want[0], x)
        assert same_bits(got_history, want_history) and got_history[0, 0] == expected


def test_an_input_that_is_all_zeros_records_a_positive_zero(interpreted):
    x = -torch.zeros(64, 64)
    history = torch.zeros(1, 3)
    got, want, got_history, want_history = both(x, history, torch.ones(3), 2, E4M3, True)
    assert same_bits(got[0], want[0]) and same_bits(got_history, want_history)
    assert got_history[0, 2].item() == 0.0 and not torch.signbit(got_history[0, 2])


@pytest.mark.parametrize(
    "shape", [(1, 150), *(pytest.param(s, marks=SLOW) for s in [(70, 1), (1, 1)])]
)
def test_rows_and_columns_of_one_element(interpreted, shape):
    x = exact_inputs(E5M2, 1.0, torch.bfloat16, shape)
    got, want, got_history, want_history = both(x, torch.zeros(3, 3), torch.ones(3), 0, E5M2, True)
    assert same_bytes_but_at_nan(got[0], want[0], x)
    assert same_bytes_but_at_nan(got[1], want[1], x.t())
    assert same_bits(got_history, want_history)


def test_an_input_not_aligned_to_16_bytes_is_copied_first(interpreted, monkeypatch):
    """Triton specialises on 16-byte alignment, and the probes are aligned: an input that is not
    reaches the kernel as an aligned copy. (The interpreter ignores alignment, so the pointer the
    kernel receives is what is checked.)"""
    cast, fold = cast_kernel._kernels()
    pointers = []

    class Spy:
        def __getitem__(self, grid):
            def launch(x, *args, **kwargs):
                pointers.append(x.data_ptr())
                return cast[grid](x, *args, **kwargs)

            return launch

    monkeypatch.setattr(cast_kernel, "_kernels", lambda: (Spy(), fold))
    storage = exact_inputs(E4M3, 1.0, torch.bfloat16, (1, 64 * 65 + 1)).reshape(-1)
    x = storage[1:].reshape(64, 65)  # a contiguous view 2 bytes into its storage
    assert x.data_ptr() % 16 and x.is_contiguous()
    got, want, got_history, want_history = both(x, torch.zeros(2, 3), torch.ones(3), 0, E4M3, True)
    assert len(pointers) == 1 and pointers[0] % 16 == 0
    assert same_bytes_but_at_nan(got[0], want[0], x)
    assert same_bytes_but_at_nan(got[1], want[1], x.t())
    assert same_bits(got_history, want_history)


@pytest.mark.slow
def test_a_history_not_aligned_to_16_bytes_is_folded_by_torch(interpreted, monkeypatch):
    """The fold kernel was verified on aligned histories; a history that is a view into a
    larger buffer gets the same fold from torch, in place."""
    cast, fold = cast_kernel._kernels()
    folds = []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                folds.append(args[2].data_ptr())
                return fold[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(cast_kernel, "_kernels", lambda: (cast, Spy()))
    x = torch.linspace(-600.0, 200.0, 64 * 64).reshape(64, 64)  # amax 600
    args = (torch.ones(3), 1, E4M3.max, E4M3.torch_dtype, False)
    for kernel, eager in (
        (cast_kernel.cast_and_record, _cast_and_record),
        (cast_kernel.cast_record_and_count, _cast_record_and_count),
    ):
        buffer = torch.zeros(1 + 2 * 3)
        history = buffer[1:].view(2, 3)  # 4 bytes into its storage
        history[0] = torch.tensor([1.0, float("nan"), 1e30])
        assert history.data_ptr() % 16
        want_history = history.clone()
        want = eager(x, want_history, *args)
        got = kernel(x, history, *args)
        assert same_bits(history, want_history) and history[0, 1] == 600.0  # NaN replaced
        assert all(same_bits(g, w) for g, w in zip(got[1:], want[1:], strict=True))
        assert not folds
        aligned = torch.zeros(2, 3)
        kernel(x, aligned, *args)
        assert len(folds) == 1 and aligned[0, 1] == 600.0
        folds.clear()


@pytest.mark.parametrize("shape", [(4096, 14336), (4095, 14336), (4096, 100), (1, 4096), (17, 1)])
def test_the_probes_run_the_variant_the_input_runs(shape):
    """Triton compiles apart sizes that divide by 16; the verification key says which, and the
    probes are of the same kind, holding every pattern of the plain probe."""
    from fp8ops.precision.compiled import record_probes

    x = torch.empty(shape, dtype=torch.bfloat16)
    history, scales = torch.zeros(4, 3), torch.ones(3)
    key = cast_kernel.key(x)
    plain = record_probes(x, history, scales, 0, E4M3.max, E4M3.torch_dtype, True)
    shaped = cast_kernel.probes(x, history, scales, 0, E4M3.max, E4M3.torch_dtype, True)
    assert len(shaped) == len(plain) == 5
    for (probe, *rest), (original, *original_rest) in zip(shaped, plain, strict=True):
        assert cast_kernel.key(probe) == key
        assert [d == 1 for d in probe.shape] == [d == 1 for d in shape]
        rows, cols = original.shape
        assert same_bits(probe[:rows, :cols], original)
        for a, b in zip(rest, original_rest, strict=True):
            assert same_bits(a, b) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.slow
def test_the_kernel_is_verified_before_use_and_its_result_is_the_eager_one(interpreted):
    """Through ``linear.cast_and_record`` with the Triton choice: the call is verified (here,
    under the interpreter, whose conversion is not the GPU's, it may be refused, and then runs
    eager) and its result is the eager cast's either way."""
    import warnings

    from fp8ops.precision import linear
    from fp8ops.precision.compiled import set_compiled_casts
    from fp8ops.precision.state import ScalingState

    x = exact_inputs(E4M3, 0.5, torch.bfloat16, (96, 80)) * 0.37  # rounds
    states = [ScalingState.fresh(4, 3, E4M3) for _ in range(2)]
    for state in states:
        state.scale[:] = torch.tensor([0.5, 2.0, 3.0])
    old_mode, old_kernel = set_compiled_casts("all"), linear.set_cast_kernel("triton")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = linear.cast_and_record(x, states[0], 0, None, "input", transposed=True)
    finally:
        set_compiled_casts(old_mode)
        linear.set_cast_kernel(old_kernel)
    want = linear.cast_and_record(x, states[1], 0, None, "input", transposed=True)
    assert same_bits(got.data, want.data) and same_bits(got.data_t, want.data_t)
    assert same_bits(states[0].amax_history, states[1].amax_history)
    statuses = linear.cast_and_record_status()["triton"]
    assert [key for key in statuses if "div16:yy" in key and "cpu" in key], statuses


def test_an_unknown_cast_kernel_is_refused_by_name():
    from fp8ops.precision.linear import set_cast_kernel

    with pytest.raises(ValueError, match="'cutlass'.*inductor.*triton"):
        set_cast_kernel("cutlass")


@pytest.mark.parametrize("fp8", ["fp8e4nv", "fp8e5"])
@pytest.mark.parametrize("count", [False, True], ids=["ordinary", "counting"])
def test_for_hopper_the_kernel_compiles_to_one_conversion_vector_access_and_no_flush(fp8, count):
    """What the interpreter cannot show, read from the PTX Triton generates for sm_90 (no GPU
    needed): the conversion is one round-to-nearest-even, saturating instruction from float32
    (no double rounding through float16), subnormals are not flushed, and with sizes that
    divide by 16 the loads and both stores are 16-byte vectors (the transposed store too),
    counting or not."""
    import re

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cast, _ = cast_kernel._kernels()
    aligned = [["tt.divisibility", 16]]
    source = ASTSource(
        fn=cast,
        signature={
            "x_ptr": "*bf16",
            "scale_ptr": "*fp32",
            "slot": "i32",
            "data_ptr": f"*{fp8}",
            "data_t_ptr": f"*{fp8}",
            "partial_ptr": "*fp32",
            "counts_ptr": "*i64",
            "rows": "i32",
            "cols": "i32",
            "fp8_max": "fp32",
            "FP8": "constexpr",
            "TRANSPOSED": "constexpr",
            "COUNT": "constexpr",
            "COUNT_BITS": "constexpr",
            "BLOCK_R": "constexpr",
            "BLOCK_C": "constexpr",
        },
        constexprs={
            "FP8": getattr(tl, "float8e4nv" if fp8 == "fp8e4nv" else "float8e5"),
            "TRANSPOSED": True,
            "COUNT": count,
            "COUNT_BITS": cast_kernel.COUNT_BITS,
            "BLOCK_R": 64,
            "BLOCK_C": 64,
        },
        attrs={(i,): aligned for i in (0, 1, 3, 4, 5, 6, 7, 8)},
    )
    try:
        ptx = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": cast_kernel.NUM_WARPS}
        ).asm["ptx"]
    except Exception as exc:  # noqa: BLE001 - a Triton without its NVIDIA toolchain
        pytest.skip(f"Triton cannot compile for sm_90 here: {type(exc).__name__}: {exc}"[:200])
    name = "e4m3" if fp8 == "fp8e4nv" else "e5m2"
    assert set(re.findall(r"cvt\.\S+", ptx)) >= {f"cvt.rn.satfinite.{name}x2.f32"}
    assert not re.findall(rf"cvt\.\S*{name}\S*f16", ptx)  # no conversion through float16
    assert ".ftz" not in ptx
    # The input in 16-byte loads (without the sizes' divisibility: 32 two-byte loads), both
    # tiles in 16-byte stores (else 64 one-byte stores); the other stores are scalars: the
    # tile's amax and, counting, its four counts packed in one int64.
    assert re.findall(r"ld\.global\S*", ptx).count("ld.global.v4.b32") == 4
    stores = re.findall(r"st\.global\S*", ptx)
    assert stores.count("st.global.v4.b32") == 4 and not [s for s in stores if ".b8" in s]
    assert len(stores) == 4 + (2 if count else 1), stores
    assert ("st.global.b64" in stores) == count  # the packed counts, one int64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "shape",
    [(70, 150), (4100, 1100), (4096, 1152)],
    ids=["edges", "1170-tiles", "1152-tiles-div16"],
)
def test_on_a_gpu_the_kernel_equals_the_eager_cast_bit_for_bit(fp8, dtype, shape):
    """Compiled for the GPU, the conversion is the GPU's: every byte equals torch's eager cast
    on the same GPU (a NaN's byte only needs to be a NaN), rounding, saturation, subnormals,
    signed zeros and the amax folded into the history included, and the measuring step's
    counts. Over 1,024 tiles the fold loops more than once; 4096 x 1152 is the variant whose
    sizes divide by 16, as the 8B shapes'. Two inputs: one with NaN and infinities, and a finite one whose largest value
    sits in the last tile, so a fold that missed a tile would record a smaller amax."""
    generator = torch.Generator().manual_seed(3)
    magnitudes = torch.exp(torch.randn(shape, generator=generator) * 4)  # about 1e-7 .. 1e7
    finite = magnitudes.clamp(max=1e4) * torch.randn(shape, generator=generator).sign()  # <= 1e4
    finite[-1, -1] = -(2.0**15)  # the largest magnitude, in the last tile (exact in bf16)
    special = finite.clone()
    flat = special.view(-1)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3e38, -1e-40])
    flat[torch.randperm(flat.numel(), generator=generator)[: 7 * 20]] = specials.repeat(20)
    history = torch.tensor([[0.5, float("nan"), 2e30], [1.0, 2.0, 3.0]]).cuda()
    scales = torch.tensor([fp8.max / 1e3, 0.7, 3e5]).cuda()
    for x, amax in ((finite, 2.0**15), (special, float("inf"))):
        x = x.to(dtype).cuda()
        for slot in range(3):
            got, want, got_history, want_history = both(x, history, scales, slot, fp8, True)
            assert same_bits(got[0], want[0]) and same_bits(got[1], want[1]), slot
            assert same_bits(got_history, want_history), slot
            # Over 0.5 and NaN the tensor's amax is recorded; 2e30 stays.
            assert got_history[0, slot] == (amax if slot < 2 else max(amax, 2e30)), slot
            # The measuring step's cast: the same, plus the amax and the counts.
            got, want, got_history, want_history = both(x, history, scales, slot, fp8, True, True)
            assert len(got) == 4 and all(same_bits(g, w) for g, w in zip(got, want, strict=True))
            assert same_bits(got_history, want_history) and got[1] == amax, slot
