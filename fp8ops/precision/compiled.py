"""The FP8 casts as compiled kernels on GPUs, checked bit for bit against the eager code.

Eager, one cast and its amax are about eight kernels, each a full pass over the tensor in
float32: about 60 bytes moved per element on an H200, which costs more than the FP8 GEMM saves.
``torch.compile`` (Inductor, which writes Triton kernels on a GPU) fuses the same function into
one or two passes (11 to 16 bytes per element there), as Transformer Engine's fused
cast-and-amax kernels do.

The compiled function is the eager one, not a rewrite (``quantize.py`` and ``linear.py``
define each once), and that it computes the same bits is checked, not assumed: the first call
of each specialisation (:func:`_key`) compares compiled against eager on probe inputs (every
bfloat16 bit pattern, or random float32 bit patterns, plus zeros, infinities, NaN, denormals
and the formats' maxima) at several scales, byte for byte for the FP8 data and bit for bit for
the other outputs and for what the function writes into its inputs (NaN only needs to be NaN
on both sides). A mismatch, or a compiler that fails, leaves that specialisation on the eager
code with a warning saying why: slower, never different. Nothing that rounds differently in
Triton is compiled: ``scale_inv`` (a division) stays eager.

The casts also write the transposed FP8 copies the backward GEMMs need (``transposed``), as
TE's cast-transpose kernels do: eager, a transpose of one-byte elements reads with a stride and
runs far below the memory's speed; compiled, it comes with the cast.

Where it applies, ``FP8OPS_COMPILED_CASTS`` (read at import; :func:`set_compiled_casts` changes
it): ``auto`` (the default) compiles for CUDA tensors only, ``all`` for every device (the CPU
tests use it, so the compiled path is exercised where CI runs), ``off`` never.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch

ENV = "FP8OPS_COMPILED_CASTS"
RECOMPILE_LIMIT = 64  # specialisations of one compiled function, each verified (Compiled)
MODES = {"auto": frozenset({"cuda"}), "all": None, "off": frozenset()}  # None: every device


def env_choice(name: str, choices, default: str) -> str:
    """The environment variable ``name``, lower-cased, if it is one of ``choices``; else
    ``default``, with a warning that names the variable, its value and the choices."""
    value = os.environ.get(name, default).strip().lower() or default
    if value not in choices:
        warnings.warn(
            f"{name}={value!r} is not one of {sorted(choices)}; using {default!r}", stacklevel=2
        )
        return default
    return value


_mode = env_choice(ENV, MODES, "auto")


def set_compiled_casts(mode: str) -> str:
    """Switch where casts are compiled (``auto``, ``all``, ``off``); returns the old mode."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"compiled casts mode {mode!r}: use one of {sorted(MODES)}")
    old, _mode = _mode, mode
    return old


def compiles_for(device: torch.device | str) -> bool:
    """Whether casts of tensors on ``device`` run compiled (``FP8OPS_COMPILED_CASTS``)."""
    return _applies(torch.device(device))


def _applies(device: torch.device) -> bool:
    devices = MODES[_mode]
    return devices is None or device.type in devices


class Compiled:
    """``fn(x, *args) -> tuple of tensors``, compiled where it applies, eager elsewhere.

    Each specialisation (:func:`_key`: devices, dtypes, flags, size-1 dimensions) is verified
    once, at its first call: ``probes(x, *args)`` gives the argument tuples to run both ways (by
    default the call's own). ``status`` maps each key to ``"compiled"`` or the reason it runs
    eager; the GPU check reports it.
    """

    def __init__(
        self,
        fn: Callable[..., tuple[torch.Tensor, ...]],
        probes: Callable | None = None,
        build: Callable[[Callable], Callable] | None = None,
        key: Callable[..., tuple[str, ...]] | None = None,
    ):
        self.fn = fn
        self.probes = probes or (lambda *args: [args])
        # What makes the fast version of ``fn``: torch.compile by default; a hand-written
        # kernel of the same function (cast_kernel.py) is checked the same way.
        self.build = build or _inductor
        # What else the fast version is specialised on (``key(x, *args)``), beyond :func:`_key`.
        self.key = key
        self.status: dict[tuple[str, ...], str] = {}
        self._compiled: Callable | None = None

    def __call__(self, x: torch.Tensor, *args):
        if x.numel() == 0 or not _applies(x.device):
            return self.fn(x, *args)
        x = x.contiguous()  # strides are one thing fewer that could tell two graphs apart
        key = _key(x, args) + (self.key(x, *args) if self.key else ())
        if key not in self.status:
            self.status[key] = self._verify(x, *args)
            if self.status[key] != "compiled":
                warnings.warn(
                    f"fp8ops: the compiled {self.fn.__name__} is not used for {key}: "
                    f"{self.status[key]}; it runs eager there (slower, same bits)",
                    stacklevel=3,
                )
        if self.status[key] != "compiled":
            return self.fn(x, *args)
        try:
            with torch.no_grad():  # one graph whatever the caller's grad mode; inputs detached
                return self._compiled(x, *args)
        except Exception as exc:
            if not _from_the_compiler(exc):
                raise  # out of memory, a CUDA error: not the compiled code's fault
            # Dynamo compiling a graph the key did not foresee (past the recompile limit,
            # which only verification raises): never run an unverified graph, stay eager.
            self.status[key] = f"failed after verification: {type(exc).__name__}: {exc}"[:300]
            warnings.warn(f"fp8ops: {self.status[key]}; {key} runs eager from now", stacklevel=3)
            return self.fn(x, *args)

    def statuses(self, *parts: str) -> set[str]:
        """The statuses of the specialisations whose key holds every one of ``parts``."""
        return {status for key, status in self.status.items() if all(p in key for p in parts)}

    def _verify(self, x: torch.Tensor, *args) -> str:
        try:
            if self._compiled is None:
                self._compiled = self.build(self.fn)
            for probe in self.probes(x, *args):
                # Each run gets its own copies: the function may write into its inputs (the
                # amax history), and those writes are compared too.
                mine, theirs = _copies(probe), _copies(probe)
                # Each key is one more specialisation of the same function (input dtype, FP8
                # format, flags, size-1 dimensions): more than Dynamo's default of 8, which would
                # refuse the ninth. Outside verification the default stands, so a graph no key
                # foresaw fails (and that key runs eager) instead of running unverified.
                with torch.no_grad(), _recompile_limit(RECOMPILE_LIMIT):
                    got = self._compiled(*mine)
                want = self.fn(*theirs)
                pairs = list(zip(got, want, strict=True)) + [
                    (a, b) for a, b in zip(mine, theirs, strict=True) if isinstance(a, torch.Tensor)
                ]
                for index, (g, w) in enumerate(pairs):
                    if not same_bits(g, w):
                        what = f"output {index}" if index < len(got) else "an input it writes"
                        return (
                            f"{what} differs from the eager result (compiler bug or changed "
                            "rounding)"
                        )
        except Exception as exc:  # noqa: BLE001 - any compiler failure means: stay eager
            return f"compilation failed: {type(exc).__name__}: {exc}"[:300]
        return "compiled"


def _inductor(fn: Callable) -> Callable:
    # dynamic=True: one kernel per dtype serves every tensor size (each linear's weight,
    # activations, gradients) instead of one compilation per shape.
    return torch.compile(fn, dynamic=True, fullgraph=True)


def cast_probes(x: torch.Tensor, scale: torch.Tensor, fp8_max: float, *flags):
    """For a cast ``fn(x, scale, fp8_max, fp8_dtype, ...)``: the probe tensor, shaped like
    ``x`` where it matters (size-1 dimensions), at several scales on ``scale``'s device."""
    probe = shaped_like(probe_tensor(x.dtype, x.device), x)
    return [
        (probe, torch.tensor(s, dtype=torch.float32, device=scale.device), fp8_max, *flags)
        for s in _probe_scales(fp8_max)
    ]


def record_probes(x, history, scales, slot, fp8_max, dtype, transposed):
    """For a cast that records its amax, ``fn(x, history, scales, slot, fp8_max, fp8_dtype,
    transposed)`` (the FP8 linear's, ``linear.py``, and its kernels, ``cast_kernel.py``):
    :func:`cast_probes` at ``scales[slot]``, with a history holding zeros, NaN and values on
    both sides of the probe's amax, so the fold into row 0 is checked too."""
    rows = []
    for probe, scale, *_ in cast_probes(x, scales[slot], fp8_max, dtype, transposed):
        probe_scales = scales.detach().clone()
        probe_scales[slot] = scale
        probe_history = (
            torch.tensor([0.0, float("nan"), 1e-30, 5.0, 3e38])[torch.arange(history.numel()) % 5]
            .reshape(history.shape)
            .to(history)
        )
        rows.append((probe, probe_history, probe_scales, slot, fp8_max, dtype, transposed))
    return rows


def shaped_like(probe: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``probe`` (2-D) reshaped so that the dimensions of size 1 in ``x`` (2-D) are size 1 in it
    too: Dynamo compiles those as constants, a graph of their own."""
    rows, cols = (dim == 1 for dim in x.shape)
    if rows and cols:
        return probe.reshape(-1)[:1].reshape(1, 1)
    if rows or cols:
        return probe.reshape((1, -1) if rows else (-1, 1))
    return probe


def _key(x: torch.Tensor, args: tuple) -> tuple[str, ...]:
    """What a compiled graph is specialised on, so what one verification holds for: ``x``'s
    device, dtype and size-1 dimensions, the other tensors' devices and size-1 dimensions (an
    amax history of one entry is a graph of its own too), and the dtypes, booleans and
    integers (a slot index) among the arguments. Sizes are symbolic (``dynamic=True``); the
    float fp8_max follows from the FP8 dtype."""
    key = [str(x.device), _name(x.dtype), "size1:" + _size1(x)]
    for index, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            key.append(str(a.device))
            if a.dim():
                key.append(f"arg{index}:" + _size1(a))
        elif isinstance(a, torch.dtype):
            key.append(_name(a))
        elif isinstance(a, (bool, int)):
            key.append(f"{a}")
    return tuple(key)


def _size1(t: torch.Tensor) -> str:
    return "".join("1" if d == 1 else "n" for d in t.shape)


def _recompile_limit(limit: int):
    config = torch._dynamo.config
    # Named cache_size_limit before torch 2.7.
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: limit})


def _from_the_compiler(exc: Exception) -> bool:
    module = type(exc).__module__ or ""
    return module.startswith(("torch._dynamo", "torch._inductor", "triton"))


def _copies(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _probe_scales(fp8_max: float) -> tuple[float, ...]:
    # 1 and powers of two are exact; fp8_max / 1e3 and 0.7 are not, so every product rounds;
    # 3e5 overflows most of the probe (saturation); 2**-20 underflows most of it.
    return (1.0, 0.7, fp8_max / 1e3, 2.0**-20, 3.0e5)


def probe_tensor(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every bfloat16/float16 bit pattern, or 2**16 random float32 ones, plus special values,
    as rows of 256 (the casts take 2-D tensors)."""
    specials = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            float("-inf"),
            float("nan"),
            448.0,
            -448.0,
            57344.0,
            464.0,
            61440.0,
            1e-45,
            -1e-40,
            2.0**-9,
            2.0**-16,
            2.0**-17,
            1.5 * 2.0**-17,
            3.0e38,
        ]
    )
    if dtype in (torch.bfloat16, torch.float16):
        patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    else:
        generator = torch.Generator().manual_seed(0)
        bits = torch.randint(-(2**31), 2**31 - 1, (2**16,), generator=generator, dtype=torch.int64)
        patterns = bits.to(torch.int32).view(torch.float32).to(dtype)
    padding = torch.zeros(256 - specials.numel())
    return torch.cat([patterns, specials.to(dtype), padding.to(dtype)]).reshape(-1, 256).to(device)


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes, where a NaN needs only be a NaN on both sides."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.dtype.is_floating_point:
        both_nan = torch.isnan(x.float()) & torch.isnan(y.float())
        x, y = _bytes(x), _bytes(y)
        return bool(((x == y) | both_nan).all())
    return torch.equal(x, y)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    views = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return x.contiguous().view(views[x.element_size()])
