"""The PyTorch reference of every rgc primitive: the CPU path, and the oracle of the kernels.

One function per primitive, with the signature of its operator in :mod:`rgc.ops` and the
formula in its docstring. They run on any device. On the CPU the elementwise loops are
``torch.compile``d (:func:`_compiled`): the hash and rounding (integer operations only), the
Box-Muller Gaussians and the update's multiply-subtract-round pass with the float64 sum of the
squares it stores (the eager float operations one by one: inductor neither reassociates nor
contracts them), so compiling changes no bit (the tests compare the two), and the FP32
reduction in a fixed order of :func:`pairwise_sums`. Everything else, the GEMMs, the
factorisations and the weight norm read apart from an update (float64, which needs no fixed
order: :func:`square_sum`), is eager torch.

Stacks: a sketched weight is handled as ``[E, d, k]`` (``E = 1`` for a 2-D weight), its
sketch ``[E, d, r]`` FP32, its projection ``P`` ``[k, r]``; element ``(e, i, j)`` of stack
``m`` takes the rounding bits of flat index ``offsets[m] + (e d + i) row_lengths[m] + j``
(:mod:`rgc.bits` states the bit convention).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
import os
import types
import warnings

import torch
from torch.utils import _python_dispatch

from rgc.bits import MIX32_MUL1, MIX32_MUL2, seed_words

_M32 = 0xFFFFFFFF
# Elements per hash call: the low index word wraps at most once inside one call.
_SEGMENT = 1 << 30


def as_int32(v: int) -> int:
    """The int32 whose two's-complement pattern is ``v mod 2**32``."""
    v &= _M32
    return v - (1 << 32) if v >= 1 << 31 else v


_MUL1, _MUL2 = as_int32(MIX32_MUL1), as_int32(MIX32_MUL2)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # lowbias32 on int32 patterns: products wrap mod 2**32, masks make the shifts logical.
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _MUL1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _MUL2
    return x ^ ((x >> 16) & 0xFFFF)


def _hash_words(out: torch.Tensor, keys: torch.Tensor) -> None:
    """``out[i] = mix32(mix32((keys[0] + i) ^ keys[1]) ^ keys[2])`` (int32 patterns)."""
    n = torch.arange(out.numel(), dtype=torch.int32, device=out.device) + keys[0]
    out.copy_(_mix32(_mix32(n ^ keys[1]) ^ keys[2]))


def _round_words(out: torch.Tensor, x_bits: torch.Tensor, keys: torch.Tensor) -> None:
    """BF16 pattern (low 16 bits of ``out``) of FP32 patterns ``x_bits`` rounded with the hash
    of indices ``keys[0] + i``: the low 16 hash bits are added, then the upper half is kept;
    a NaN becomes the quiet NaN of its sign."""
    n = torch.arange(x_bits.numel(), dtype=torch.int32, device=x_bits.device) + keys[0]
    h = _mix32(_mix32(n ^ keys[1]) ^ keys[2])
    rounded = ((h & 0xFFFF) + x_bits) >> 16  # int32 addition: the carry reaches the exponent
    nan = (x_bits & 0x7FFFFFFF) > 0x7F800000
    out.copy_(torch.where(nan, (x_bits >> 16) | 0x40, rounded))


def _updated_patterns(w: torch.Tensor, h: torch.Tensor, factor: torch.Tensor,
                      keys: torch.Tensor) -> torch.Tensor:
    """The BF16 patterns (int32) of ``float32(w) factor - h`` rounded as :func:`_round_words`
    does, with the hash of indices ``keys[0] + i``.

    w: BF16 ``[n]``; h: FP32 ``[n]``; factor: 0-dim FP32 (``1 - decay``, or 1, which changes
    no bit). One multiply and one subtract per element, as the eager ``w.float() * factor -
    h``: the update of one run of weights in a single pass."""
    bits = (w.to(torch.float32) * factor - h).view(torch.int32)
    n = torch.arange(bits.numel(), dtype=torch.int32, device=bits.device) + keys[0]
    noise = _mix32(_mix32(n ^ keys[1]) ^ keys[2]) & 0xFFFF
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return torch.where(nan, (bits >> 16) | 0x40, (noise + bits) >> 16)


def _update_words(w: torch.Tensor, h: torch.Tensor, factor: torch.Tensor,
                  keys: torch.Tensor) -> None:
    """``h <-`` :func:`_updated_patterns` (int32, in ``h``'s storage, which it consumes)."""
    h.view(torch.int32).copy_(_updated_patterns(w, h, factor, keys))


def _update_words_norm(w: torch.Tensor, h: torch.Tensor, factor: torch.Tensor,
                       keys: torch.Tensor) -> torch.Tensor:
    """:func:`_update_words`, returning the sum of the squares of the stored BF16 values: a
    0-dim float64 tensor (every square exact; the sum in the loop's order, see
    :func:`square_sum`)."""
    patterns = _updated_patterns(w, h, factor, keys)
    h.view(torch.int32).copy_(patterns)
    stored = (patterns << 16).view(torch.float32).to(torch.float64)
    return (stored * stored).sum()


def _update_words_norm_blocked(w: torch.Tensor, h: torch.Tensor, factor: torch.Tensor,
                               keys: torch.Tensor) -> torch.Tensor:
    """:func:`_update_words_norm` in eager torch, the squares summed
    :data:`SQUARE_SUM_BLOCK` values at a time (no float64 copy of the run): where the loop is
    not compiled."""
    _update_words(w, h, factor, keys)
    words = h.view(torch.int32)
    total = torch.zeros((), dtype=torch.float64, device=h.device)
    for start in range(0, words.numel(), SQUARE_SUM_BLOCK):
        stored = (words[start:start + SQUARE_SUM_BLOCK] << 16).view(torch.float32).double()
        total += torch.dot(stored, stored)
    return total


# -- sums in a fixed order -------------------------------------------------------------------

def pairwise_width(n: int) -> int:
    """The power of two (>= 1) a row of ``n`` elements is padded to for :func:`pairwise_sums`."""
    return 1 << max(0, n - 1).bit_length()


def _halving_sums(x: torch.Tensor, width: int, square: bool) -> torch.Tensor:
    """Row sums of ``x`` ``[R, n]`` (``n <= width``) in the fixed order of
    :func:`pairwise_sums`: ``v = x`` (``square``: ``v = x * x``) in the accumulation dtype,
    padded with +0 to ``width`` columns, then ``v <- v[:, :w/2] + v[:, w/2:]`` until one column
    is left. Elementwise operations only, so compiled and eager, and every vector width, give
    the same bits."""
    v = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    if square:
        v = v * v
    v = torch.constant_pad_nd(v, (0, width - x.shape[1]))
    while v.shape[1] > 1:
        half = v.shape[1] // 2
        v = v[:, :half] + v[:, half:]
    return v[:, 0]


#: Padded elements one call of the compiled :func:`_halving_sums` reduces: its temporaries
#: (FP32, at most the chunk and its halves) stay within about one chunk of the update's rows.
PAIRWISE_CHUNK = 1 << 18
#: Rows of fewer padded elements in all run eagerly: each width is a graph of its own, worth
#: compiling only where the data, not the per-operation overhead, costs the time.
PAIRWISE_COMPILED_MIN = 1 << 15
#: Padded elements one eager call reduces (at most three such FP32 temporaries at a time).
PAIRWISE_EAGER_CHUNK = 1 << 12


def _rows_view(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` ``[..., n]`` as one 2-D view ``[rows, n]`` (no copy), or ``None`` where its
    leading dimensions do not collapse into one stride."""
    n = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    try:
        return x.view(rows, n)
    except RuntimeError:
        return None


def pairwise_sums(x: torch.Tensor, *, square: bool = False) -> torch.Tensor:
    """Sums over the last dimension of ``x`` ``[..., n]`` (any strides, any float dtype) in a
    fixed order: each row is padded with +0 to a power of two, then halved, ``v[j] <- v[j] +
    v[j + w/2]``, until one value is left. ``square``: the sums of ``x * x``. Returns
    ``[...]``, FP64 for FP64 ``x``, else FP32 (each element converted exactly, then squared
    and added in that dtype).

    Every step is one IEEE operation on two values, so the result does not depend on the
    machine's vector width, on torch.compile or on how rows are batched: the FP32 reduction
    of the sums that feed a coefficient (:func:`row_adam_`'s ``v``, the optimizers' sums of
    per-matrix norms). On the CPU, for large inputs, the loop is compiled
    (:func:`_compiled`), a chunk of :data:`PAIRWISE_CHUNK` padded elements per call; otherwise
    it runs eagerly, :data:`PAIRWISE_EAGER_CHUNK` at a time."""
    n = x.shape[-1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.empty(x.shape[:-1], dtype=acc, device=x.device)
    if out.numel() == 0:
        return out
    if n == 0:
        return out.zero_()
    width = pairwise_width(n)
    if x.device.type == "cpu" and out.numel() * width >= PAIRWISE_COMPILED_MIN:
        run, step = _compiled(_halving_sums), max(1, PAIRWISE_CHUNK // width)
    else:  # and at most a quarter of a matrix's rows: FP32 temporaries below its BF16 size
        quarter = x.shape[-2] // 4 if x.dim() > 1 else 1
        run, step = _halving_sums, max(1, min(PAIRWISE_EAGER_CHUNK // width, quarter))
    rows = _rows_view(x.detach())
    blocks = [(rows, out.view(-1))] if rows is not None else [
        (x.detach()[index], out[index]) for index in itertools.product(
            *(range(size) for size in x.shape[:-2]))]
    for block, target in blocks:
        for start in range(0, block.shape[0], step):
            target[start:start + step] = run(block[start:start + step], width, square)
    return out


class _StateGuard:
    """The global state dynamo guards every graph on (grad mode, autocast, threads, default
    dtype, deterministic algorithms...), as it is now: ``check()`` says whether it still is
    (dynamo's own guard, a comparison in C++; on an older torch, the parts a caller is
    likeliest to change)."""

    def __init__(self):
        try:
            self._guard = torch._C._dynamo.guards.GlobalStateGuard()
        except AttributeError:
            self._guard, self._state = None, self._read()

    @staticmethod
    def _read() -> tuple:
        return (torch.is_grad_enabled(), torch.is_autocast_enabled(), torch.get_num_threads(),
                torch.get_default_dtype())

    def check(self) -> bool:
        return self._guard.check() if self._guard is not None else self._read() == self._state


def _variant(graph_key: tuple) -> tuple:
    """What a loop traced through dynamo is specialised on besides sizes and the global state
    (:class:`_StateGuard`): the thread's dispatch keys (an operator's kernel runs below
    autograd, a direct call does not) and the :func:`_graph_key` of its arguments (the values
    of ints and bools among them are traced in)."""
    return (torch._C._dispatch_tls_local_include_set().raw_repr(),
            torch._C._dispatch_tls_local_exclude_set().raw_repr(), graph_key)


def _graph_key(args) -> tuple:
    """What a captured graph, called directly (:func:`_direct_call`), depends on: per tensor
    argument its dtype, rank, sizes of 1, contiguity, inference-mode creation and the first
    argument that is the same tensor (one passed twice is one graph input); the values of the
    other arguments; the default dtype. Not the grad mode, the thread count or the dispatch
    keys of :func:`_variant`: the compiled code reads none of them, and its inputs are
    detached."""
    ids = [id(a) for a in args]
    return (torch.get_default_dtype(),
            *((a.dtype, a.dim(), tuple(n == 1 for n in a.shape), a.is_contiguous(),
               a.is_inference(), ids.index(id(a))) if isinstance(a, torch.Tensor)
              else (type(a), a) for a in args))


def _isolated_dynamo():
    """The dynamo settings a loop's variant is traced under (its first call), whatever the
    user set: no duck sizing (two sizes equal at the first call must not become one symbol,
    which a later call would fail as a guard) and no error on a recompile (there is none to
    expect: every variant has its own code object)."""
    import torch.fx.experimental._config as fx_config

    stack = contextlib.ExitStack()
    stack.enter_context(torch._dynamo.config.patch(error_on_recompile=False))
    stack.enter_context(fx_config.patch(use_duck_shape=False))
    return stack


try:
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
except ImportError:  # an older torch
    _debug_get_cache_entry_list = None


def _traced(code: types.CodeType) -> bool:
    """Whether dynamo holds a compiled graph of ``code`` (``torch._dynamo.reset()`` drops them
    all; ~1 us). True where this torch does not say."""
    return _debug_get_cache_entry_list is None or bool(_debug_get_cache_entry_list(code))


def _dynamo_disabled() -> bool:
    """Dynamo switched off: by its config, or by ``TORCHDYNAMO_DISABLE=1``, under which
    torch.compile returns the function unchanged (torch 2.13 reads it there)."""
    return torch._dynamo.config.disable or os.environ.get("TORCHDYNAMO_DISABLE") == "1"


@functools.cache
def _inductor_options() -> dict:
    """Inductor options of every loop. One thread: a loop is short (a chunk of rows), and an
    OpenMP pool of its own beside torch's made the next LAPACK call wait ~10 ms for its
    spinning threads. The vector width stated (``cpp.simdlen``, in bits): inductor's cache
    does not otherwise tell code built for one ``ATEN_CPU_CAPABILITY`` from another's (torch
    2.13 ran AVX-512 loops as AVX2 ones, with wrong results), and where it finds no vector
    ISA (``default``) scalar code, as the vector code it emits there does not compile."""
    options: dict = {"cpp.threads": 1}
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = pick_vec_isa()
        options["cpp.simdlen"] = isa.bit_width() if isa else 1
    except (ImportError, AttributeError):
        pass
    return options


def _capturing_inductor(graphs: list):
    """A torch.compile backend: inductor with :func:`_inductor_options`, as
    ``backend="inductor"`` compiles, that appends to ``graphs`` each graph's compiled callable,
    its example inputs, the dynamo source of each symbolic size among them and its number of
    outputs (:func:`_direct_call` reads them)."""
    from torch._guards import TracingContext
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        compiled = compile_fx(gm, example_inputs, config_patches=_inductor_options())
        context = TracingContext.try_get()
        shape_env = getattr(getattr(context, "fake_mode", None), "shape_env", None)
        sources = []
        for example in example_inputs:
            found = None
            if isinstance(example, torch.SymInt) and shape_env is not None:
                found = (shape_env.var_to_sources.get(example.node.expr) or [None])[0]
            sources.append(found)
        outputs = gm.graph.find_nodes(op="output")[0].args[0]
        graphs.append((compiled, list(example_inputs), sources, len(outputs)))
        return compiled
    return backend


def _constant(value):
    return lambda args: value


def _source_reader(source, names: tuple, fn_globals: dict):
    """``args -> value`` for a dynamo source: an argument named in ``names``, a module global
    of the loop, or a size, stride or storage offset of either; ``None`` for any other."""
    try:
        from torch._dynamo.source import (
            GlobalSource,
            LocalSource,
            TensorProperty,
            TensorPropertySource,
        )
    except ImportError:
        return None
    if isinstance(source, LocalSource) and source.local_name in names:
        return operator.itemgetter(names.index(source.local_name))
    if isinstance(source, GlobalSource) and source.global_name in fn_globals:
        return _constant(fn_globals[source.global_name])
    if isinstance(source, TensorPropertySource):
        base = _source_reader(source.base, names, fn_globals)
        if base is None:
            return None
        idx = source.idx
        if source.prop is TensorProperty.SIZE:
            return lambda args: base(args).size(idx)
        if source.prop is TensorProperty.STRIDE:
            return lambda args: base(args).stride(idx)
        if source.prop is TensorProperty.STORAGE_OFFSET:
            return lambda args: base(args).storage_offset()
    return None


def _direct_call(graphs: list, fn, args: tuple, result):
    """``args -> result`` running the graph that :func:`_capturing_inductor` captured while
    ``fn(*args)`` was traced, without dynamo: each graph input read off the arguments (a
    tensor argument, a size or stride of one, a module global such as :data:`_BM_VALUES`),
    ~10 us a call against ~55 us through dynamo's frame, guards and wrappers. What dynamo's
    guards check is this variant's key already (:func:`_variant`, :class:`_StateGuard`), and
    the compiled code asserts each tensor's sizes and strides against the sizes it is given.
    ``None`` where the capture is not one graph whose inputs and outputs are recognised
    (another torch version's internals): the loop is then called through dynamo."""
    captured, graphs[:] = list(graphs), []
    if len(captured) != 1 or not (result is None or isinstance(result, torch.Tensor)):
        return None
    compiled, examples, sources, outputs = captured[0]
    if outputs != (result is not None):
        return None
    names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    module_tensors = {id(v) for v in fn.__globals__.values() if isinstance(v, torch.Tensor)}
    readers = []
    for example, source in zip(examples, sources, strict=True):
        if isinstance(example, torch.Tensor):
            position = next((i for i, a in enumerate(args) if a is example), None)
            if position is not None:
                reader = operator.itemgetter(position)
            else:  # a module global (a constant of the loop), or unknown
                reader = _constant(example) if id(example) in module_tensors else None
        else:
            reader = _source_reader(source, names, fn.__globals__)
        if reader is None:
            return None
        readers.append(reader)

    def direct(call_args):
        out = compiled(*[read(call_args) for read in readers])
        return out[0] if outputs else None
    return direct


#: What a compiled loop returns where dynamo is disabled and its variant was never traced.
_EAGER = object()


class _Variant:
    """One variant of a loop (:func:`_compiled`): the global ``state`` it was traced under,
    its own ``code`` object, ``loop`` (that code through torch.compile, which appends what it
    compiles to ``graphs``) and ``direct`` (the compiled graph called without dynamo, once
    traced; ``None`` before, or where not recognised)."""

    def __init__(self, fn):
        self.state, self.code = _StateGuard(), fn.__code__.replace()
        self.graphs, self.direct = [], None
        self.loop = torch.compile(types.FunctionType(self.code, fn.__globals__, fn.__name__,
                                                     fn.__defaults__, fn.__closure__),
                                  backend=_capturing_inductor(self.graphs), dynamic=True,
                                  fullgraph=True)


@functools.cache
def _compiled(fn, eager=None):
    """``fn`` compiled for the CPU (one vectorised loop), or where torch.compile cannot run
    here ``eager`` (default ``fn`` itself) run eagerly (~15x slower): every loop is
    elementwise torch code whose float operations inductor neither reassociates nor
    contracts, so both give the same bits (the tests compare them), whatever the user's dynamo
    settings.

    Each :func:`_variant` of the arguments under each global state is compiled from a code
    object of its own, with sizes symbolic within it, traced under :func:`_isolated_dynamo`:
    no call recompiles a graph, so a user's ``error_on_recompile``, a low ``recompile_limit``
    or many shapes never show rgc in their dynamo logs; should a call fail anyway, the eager
    loop takes over with the same bits. Later calls run the compiled graph without dynamo
    (:func:`_direct_call`), where it is recognised, and so does every call with the same
    :func:`_graph_key` under another grad mode, thread count or dispatch keys (no new trace);
    otherwise through dynamo, traced again, isolated, after a ``torch._dynamo.reset()``.

    Under a dispatch mode (rgc's memory tracker, the tests' counters), which torch.compile
    does not trace, the loop runs with the modes switched off: one opaque computation that
    writes its output and allocates nothing seen, with the bits it has outside the mode. With
    dynamo disabled (its config, or ``TORCHDYNAMO_DISABLE=1``, under which torch.compile
    returns ``fn`` unchanged) a variant not yet compiled runs ``eager``, not ``fn`` on a whole
    chunk; one compiled before keeps its graph (the same bits).
    """
    eager = fn if eager is None else eager
    variants: dict[tuple, list[_Variant]] = {}
    graphs: dict[tuple, object] = {}  # the direct calls, by _graph_key
    failed = False

    def compiled(args):
        # detached: no view keeps its base, whose sizes dynamo would guard on too, and a view of
        # a trainable weight made under no_grad is no input torch.compile takes once the
        # weight has been modified in place with grad mode on. A tensor passed twice stays one
        # (two aliasing inputs would take dynamo's slower, and on some versions failing, path).
        detached = {id(a): a.detach() for a in args if isinstance(a, torch.Tensor)}
        args = tuple(detached.get(id(a), a) for a in args)
        key = _graph_key(args)
        direct = graphs.get(key)
        if direct is not None:
            return direct(args)
        states = variants.setdefault(_variant(key), [])
        variant = next((v for v in states if v.state.check()), None)
        if _dynamo_disabled():
            return _EAGER
        if variant is None:
            variant = _Variant(fn)
            states.append(variant)
        elif _traced(variant.code):
            return variant.loop(*args)
        # first call, or torch._dynamo.reset() dropped its graph: traced, isolated
        with _isolated_dynamo():  # a call that traces: the settings of its guards
            result = variant.loop(*args)
        variant.direct = _direct_call(variant.graphs, fn, args, result)
        if variant.direct is not None:
            graphs[key] = variant.direct
        return result

    def run(*args):
        nonlocal failed
        if _python_dispatch._get_current_dispatch_mode() is not None:
            with _python_dispatch._disable_current_modes():
                return run(*args)
        if not failed:
            try:
                result = compiled(args)
            except Exception as exc:  # no C++ compiler, unsupported platform
                warnings.warn(f"rgc: torch.compile of a CPU loop failed ({exc!s:.200}); using "
                              "eager torch ops (slower, the same bits)", RuntimeWarning,
                              stacklevel=2)
                failed = True
            else:
                if result is not _EAGER:
                    return result
        return eager(*args)
    run.variants = variants  # for inspection
    return run


def _int32_loop(fn, device: torch.device, eager=None):
    """``fn`` compiled on the CPU (:func:`_compiled`, with ``eager`` where it cannot be),
    ``eager`` (default ``fn``) elsewhere."""
    return _compiled(fn, eager) if device.type == "cpu" else (eager or fn)


def _segments(numel: int, offset: int, words: tuple[int, int]):
    """``(start, length, keys)`` per run of at most ``_SEGMENT`` indices over which the high
    index word is constant; ``keys`` = (low word of the first index, s_lo, high word + s_hi)
    as int32 patterns."""
    s_lo, s_hi = words
    start = 0
    while start < numel:
        n = offset + start
        lo, hi = n & _M32, n >> 32
        length = min(numel - start, _SEGMENT, (1 << 32) - lo)
        yield start, length, (as_int32(lo), as_int32(s_lo), as_int32(hi + s_hi))
        start += length


def random_words(numel: int, seed: int, label: str, offset: int = 0,
                 device=None) -> torch.Tensor:
    """The hash words of :func:`rgc.bits.random_bits` as int32 patterns, ``[numel]``."""
    device = torch.device("cpu") if device is None else torch.device(device)
    out = torch.empty(numel, dtype=torch.int32, device=device)
    run = _int32_loop(_hash_words, device)
    for start, length, keys in _segments(numel, offset, seed_words(seed, label)):
        run(out[start:start + length], torch.tensor(keys, dtype=torch.int32, device=device))
    return out


def stochastic_round_(out: torch.Tensor, x: torch.Tensor, seed: int, offset: int) -> None:
    """``out <- BF16(x)`` rounded stochastically: element ``i`` of ``x.flatten()`` with the
    hash bits of flat index ``offset + i`` (the convention of :mod:`rgc.bits`).

    out: BF16 of ``x``'s shape and device (any strides); x: floating point (made FP32 first).
    """
    x32 = x.detach().to(torch.float32).contiguous()
    _round_owned_(out, x32.clone() if x32.data_ptr() == x.data_ptr() else x32, seed, offset)


def _round_owned_(out: torch.Tensor, x32: torch.Tensor, seed: int, offset: int) -> None:
    """:func:`stochastic_round_` of a contiguous FP32 ``x32`` the caller gives up: its storage
    receives the rounded patterns before they are copied into ``out`` (no other buffer)."""
    bits = x32.contiguous().view(-1).view(torch.int32)
    run = _int32_loop(_round_words, bits.device)
    for start, length, keys in _segments(bits.numel(), offset, seed_words(seed)):
        part = bits[start:start + length]
        run(part, part, torch.tensor(keys, dtype=torch.int32, device=bits.device))
    out.view(torch.int16).copy_(bits.view(out.shape))  # keeps the low 16 bits: the pattern


# -- projections ----------------------------------------------------------------------------

GAUSSIAN_LABEL = "projection-gaussian"
# The float32 constants of the Box-Muller polynomials. Series: ln f = 2 s (1 + s^2/3 + ... +
# s^8/9) with s = (f-1)/(f+1), |s| <= 0.172 (error < 1e-9); Taylor series of sin to x^13 and
# cos to x^14 on [0, pi/2) (error < 1e-9). XSTEP = fl32(pi/2) / 2^22, exact.
BOX_MULLER_CONSTANTS: dict[str, float] = {
    "SQRT2": math.sqrt(2.0), "LN2": math.log(2.0),
    **{f"L{j}": 1.0 / (2 * j + 1) for j in range(1, 5)},
    "XSTEP": float(torch.tensor(math.pi / 2, dtype=torch.float32)) * 2.0**-22,
    **{f"S{j}": (-1.0) ** j / math.factorial(2 * j + 1) for j in range(1, 7)},
    **{f"C{j}": (-1.0) ** j / math.factorial(2 * j) for j in range(1, 8)},
}
#: Each constant rounded to float32, as every path uses it.
BM = {name: float(torch.tensor(v, dtype=torch.float32)) for name, v in
      BOX_MULLER_CONSTANTS.items()}
SQRT2_BITS = int(torch.tensor(BM["SQRT2"], dtype=torch.float32).view(torch.int32))
# The same constants in one FP32 tensor, as the loops read them: a compiled loop takes each
# Python float as an input of its own, converted to a tensor at every call (~4 us each).
_BM_NAMES = list(BM)
_BM_VALUES = torch.tensor([BM[name] for name in _BM_NAMES], dtype=torch.float32)


def _bm(name: str) -> torch.Tensor:
    """Box-Muller constant ``name`` as a 0-dim FP32 tensor (the float32 value of :data:`BM`)."""
    return _BM_VALUES[_BM_NAMES.index(name)]


def _polynomial(x: torch.Tensor, names: list[str]) -> torch.Tensor:
    """``((c0 x + c1) x + ...) x + 1`` in float32, one rounding per operation."""
    p = x * _bm(names[0])
    for name in names[1:]:
        p = (p + _bm(name)) * x
    return p + 1.0


def _rho(w0: torch.Tensor) -> torch.Tensor:
    """``sqrt(-2 ln u)`` for ``u = (w0 + 1) 2^-24`` (w0: 24-bit int32).

    ``u = 2^(e - 24) f`` with ``f`` in ``[sqrt(1/2), sqrt(2))`` is read off the bits of the
    float32 ``w0 + 1`` (exact, as ``w0 + 1 <= 2^24``), and ``f / 2`` is an exponent decrement:
    integer steps, as the Triton kernel takes them (a binary search on the bits took longer to
    compile: inductor inlines an elementwise node into each of its uses, so every read of
    ``w0`` repeats the hash that made it).

    The square root is correctly rounded: the float64 one rounded to float32 (53 >= 2 * 24 + 2
    bits). Not torch's float32 one, which is not correctly rounded in eager CPU code (15% of
    values one unit off), so its bits would differ between a compiled and an eager loop."""
    nb = (w0 + 1).to(torch.float32).view(torch.int32)
    fb = (nb & 0x7FFFFF) | 0x3F800000  # the mantissa of w0 + 1, exponent 0: f in [1, 2)
    big = fb > SQRT2_BITS
    f = torch.where(big, fb - 0x800000, fb).view(torch.float32)
    e = ((nb >> 23) + (big.to(torch.int32) - 151)).to(torch.float32)  # 151 = 127 + 24
    s = (f - 1.0) / (f + 1.0)
    ln_u = e * _bm("LN2") + (s * 2.0) * _polynomial(s * s, ["L4", "L3", "L2", "L1"])
    return (ln_u * -2.0).double().sqrt().to(torch.float32)


def _polar(rho: torch.Tensor, w1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rho cos(theta), rho sin(theta))`` for ``theta = 2 pi w1 2^-24`` (w1: 24-bit int32).

    The quadrant ``q = w1 >> 22`` picks ``cos = (cs, -sn, -cs, sn)[q]``,
    ``sin = (sn, cs, -sn, -cs)[q]`` of the polynomials on ``[0, pi/2)``: selects and
    negations, both exact.
    """
    x = (w1 & 0x3FFFFF).to(torch.float32) * _bm("XSTEP")
    y = x * x
    sn = _polynomial(y, ["S6", "S5", "S4", "S3", "S2", "S1"]) * x
    cs = _polynomial(y, ["C7", "C6", "C5", "C4", "C3", "C2", "C1"])
    q = w1 >> 22
    odd = (q & 1) == 1  # odd quadrants swap the two
    cos, sin = torch.where(odd, sn, cs), torch.where(odd, cs, sn)
    cos = torch.where(((q ^ (q >> 1)) & 1) == 1, -cos, cos)  # - for q = 1, 2
    sin = torch.where(q >= 2, -sin, sin)  # - for q = 2, 3
    return cos * rho, sin * rho


def _gaussian_pairs(cos_out: torch.Tensor, sin_out: torch.Tensor, keys: torch.Tensor) -> None:
    """``cos_out[m, i], sin_out[m, i] = _polar(_rho(w0), w1)`` (``[M, n]`` FP32, contiguous)
    of the words of indices ``keys[m, 0, 0] + i`` and ``keys[m, 1, 0] + i`` keyed by
    ``keys[m, :, 1:]`` (the seed words; ``keys``: ``[M, 2, 3]`` int32, additions wrap mod
    2**32). Elementwise: a seed's pairs do not depend on the other seeds. On the CPU one
    compiled loop for the whole pipeline and every seed of a chunk (:func:`_gaussian_loop`),
    whose float operations are the eager ones one by one (inductor neither reassociates nor
    fuses multiply-adds: ``-ffp-contract=off``, no unsafe math), so the bits are the same
    whether it runs compiled or eagerly; the tests compare the two."""
    n = torch.arange(cos_out.shape[1], dtype=torch.int32, device=cos_out.device)
    w0 = _mix32(_mix32((n + keys[:, 0, :1]) ^ keys[:, 0, 1:2]) ^ keys[:, 0, 2:])
    w1 = _mix32(_mix32((n + keys[:, 1, :1]) ^ keys[:, 1, 1:2]) ^ keys[:, 1, 2:])
    cos, sin = _polar(_rho((w0 >> 8) & 0xFFFFFF), (w1 >> 8) & 0xFFFFFF)
    cos_out.copy_(cos)
    sin_out.copy_(sin)


def _gaussian_pairs_blocked(cos_out: torch.Tensor, sin_out: torch.Tensor,
                            keys: torch.Tensor) -> None:
    """:func:`_gaussian_pairs` in eager torch, :data:`GAUSSIAN_BLOCK` pairs of one seed at a
    time (its temporaries stay about 2 MiB): where the loop is not compiled (other devices,
    no compiler)."""
    count, n = cos_out.shape
    for m in range(count):
        for start in range(0, n, GAUSSIAN_BLOCK):
            part = slice(start, start + GAUSSIAN_BLOCK)
            shift = torch.tensor([start, 0, 0], dtype=torch.int32, device=keys.device)
            _gaussian_pairs(cos_out[m:m + 1, part], sin_out[m:m + 1, part],
                            keys[m:m + 1] + shift)


def _gaussian_loop(device: torch.device):
    """The pair loop of ``device``: compiled on the CPU (eager blocks where torch.compile
    cannot run), eager blocks elsewhere."""
    if device.type == "cpu":
        return _compiled(_gaussian_pairs, _gaussian_pairs_blocked)
    return _gaussian_pairs_blocked


#: Box-Muller pairs computed at once: the temporaries of the eager path (62 bytes per pair,
#: measured) stay about 2 MiB whatever k and r; the compiled loop has none.
GAUSSIAN_BLOCK = 1 << 15


def gaussian_matrices(k: int, r: int, seeds: list[int], device) -> torch.Tensor:
    """``G`` for each seed: ``[M, k, r]`` FP32 Box-Muller Gaussians (a view of ``[M, k, 2h]``).

    With ``h = ceil(r/2)``, pair ``c`` of row ``i`` (``m = i h + c``) takes the words of indices
    ``m`` and ``k h + m`` (label ``"projection-gaussian"``) shifted right by 8:
    ``G[i, c], G[i, h + c] = (rho cos(theta), rho sin(theta))`` with ``rho = sqrt(-2 ln u)``,
    ``u = (w0 + 1) 2^-24``, ``theta = 2 pi w1 2^-24``, by the float32 polynomials of :data:`BM`
    evaluated one IEEE operation at a time. Elementwise, so a seed's ``G`` does not
    depend on the other seeds of the batch (on the CPU one compiled loop writes every seed's);
    the Triton kernel performs the same operations.
    """
    return _gaussians(k, r, seeds, torch.device(device))[:, :, :r]


def _pair_rows(count: int, pairs: int) -> tuple[int, int]:
    """``(rows, n)``: the pair loop computes each of ``count`` seeds' ``pairs`` pairs as
    ``rows`` rows of ``n``, row ``j`` from pair ``j n`` on, the spare ones discarded. Never a
    size of 1, which dynamo specialises (a variant of the loop compiled again, ~1 min): a lone
    seed's pairs take two rows, a row at least two pairs."""
    rows = 2 if count == 1 else 1
    return rows, max(2, -(-pairs // rows))


def _gaussians(k: int, r: int, seeds: list[int], device: torch.device) -> torch.Tensor:
    """:func:`gaussian_matrices` as ``[M, k, 2 ceil(r/2)]`` (contiguous)."""
    h = (r + 1) // 2
    pairs = k * h
    if 2 * pairs >= 1 << 32:
        raise ValueError(f"a {k} x {r} projection is too large (2 k ceil(r/2) >= 2**32)")
    g = torch.empty(len(seeds), k, 2 * h, dtype=torch.float32, device=device)
    if not g.numel():
        return g
    # 2 k h < 2**32: an index has no high word, the key is s_hi alone
    rows, n = _pair_rows(len(seeds), pairs)
    words = [[as_int32(w) for w in seed_words(seed, GAUSSIAN_LABEL)] for seed in seeds]
    keys = torch.tensor([[[j * n, *w], [as_int32(pairs + j * n), *w]]
                         for w in words for j in range(rows)], dtype=torch.int32, device=device)
    # the loop writes two contiguous buffers (one graph for every k and r), then one copy
    # interleaves them into G's rows: an in-graph concatenation took two more passes
    pairs_out = torch.empty(2, len(seeds) * rows, n, dtype=torch.float32, device=device)
    _gaussian_loop(device)(pairs_out[0], pairs_out[1], keys)
    cos, sin = (p.view(len(seeds), rows * n)[:, :pairs].view(-1, k, h) for p in pairs_out)
    torch.stack([cos, sin], dim=2, out=g.view(-1, k, 2, h))
    return g


def one_pass(k: int, r: int) -> bool:
    """Whether a k x r ``G`` is orthonormalised by one CholeskyQR pass (``k >= 4 r``), rather
    than by shifted CholeskyQR3 in float64 (``G`` can be ill conditioned below)."""
    return k >= 4 * r


def orthonormalize(g: torch.Tensor, scale: float, gram_fp64: bool) -> torch.Tensor:
    """``scale * Q`` for the thin QR ``g = Q R`` (``R`` with a positive diagonal), per matrix.

    g: ``[M, k, r]`` FP32, k >= r, full column rank. For ``k >= 4 r`` one CholeskyQR pass:
    ``R`` from the Gram ``g^T g`` (float64 if ``gram_fp64``, else FP32), ``g (scale R^-1)`` in
    FP32; returns FP32. Otherwise shifted CholeskyQR3 in float64 (returns float64). Matrix by
    matrix with 2-D products, so a matrix's bits do not depend on the batch it is in.
    """
    k, r = g.shape[1:]
    return torch.stack([_orthonormalize_one(x, scale, gram_fp64) for x in g]) if len(g) else (
        torch.empty(g.shape, dtype=torch.float32 if one_pass(k, r) else torch.float64,
                    device=g.device))


def _orthonormalize_one(g: torch.Tensor, scale: float, gram_fp64: bool) -> torch.Tensor:
    k, r = g.shape
    if one_pass(k, r):
        gw = g.double() if gram_fp64 else g
        inverse = _scaled_inverse_cholesky(gw.t() @ gw, scale)
        return g @ inverse.to(g.dtype)
    q = g.double()
    for i in range(3):
        gram = q.t() @ q
        if i == 0:
            # Fukaya et al. (2020): shift 11 (k r + r (r + 1)) u ||G||_F^2, which keeps the
            # Cholesky factorisation of a nearly singular Gram defined.
            unit = torch.finfo(torch.float64).eps / 2
            gram.diagonal().add_(gram.diagonal().sum() * (11 * (k * r + r * (r + 1)) * unit))
        q = q @ _scaled_inverse_cholesky(gram, scale if i == 2 else 1.0)
    return q


RADEMACHER_LABEL = "projection-rademacher"


#: Bytes of ``G`` (FP32, ``[M, k, 2 ceil(r/2)]``) that :func:`make_projections_` generates
#: and orthonormalises at once: the projections of one shape are taken in chunks of
#: :func:`projection_chunk` seeds (at least one).
PROJECTION_CHUNK_BYTES = 1 << 21


def projection_chunk(k: int, r: int) -> int:
    """Projections of one k x r shape that :func:`make_projections_` refreshes together."""
    return max(1, PROJECTION_CHUNK_BYTES // max(1, 8 * k * ((r + 1) // 2)))


def make_projections_bytes(k: int, r: int, gram_fp64: bool, count: int = 1) -> int:
    """Peak temporary bytes of :func:`make_projections_` refreshing ``count`` orthonormal
    k x r projections of one shape (``gram_fp64``: the output is not BF16).

    A chunk of c = :func:`projection_chunk` of them: c G at once (``8 k ceil(r/2)`` each),
    written by the compiled loop through two buffers of pairs as large (:func:`_pair_rows`:
    a few spare pairs); then, beside the c G, float64 CholeskyQR3 matrix by matrix
    (``k < 4 r``: ``16 k r + 16 r^2``); or the c Grams (FP32, or float64 with a float64 copy
    of one G), four c r^2 factors while they are inverted, and the FP32 inverses with one FP32
    product ``G R^-1`` at a time (none for an FP32 output, written in place)."""
    pairs = k * ((r + 1) // 2)
    g = 8 * pairs
    c = min(max(1, count), projection_chunk(k, r))
    rows, n = _pair_rows(c, pairs)
    buffers = 8 * c * rows * n  # the two buffers of pairs
    if not one_pass(k, r):
        return max(c * g + buffers, c * g + 16 * k * r + 16 * r * r + 8)
    size = 8 if gram_fp64 else 4
    rr = c * r * r
    grams = size * rr + (8 * k * r if gram_fp64 else 0)
    factors = 4 * size * rr
    products = 4 * rr + (0 if gram_fp64 else 4 * k * r)
    return max(c * g + buffers, c * g + max(grams, factors, products))


@torch.no_grad()
def make_projections_(outs: list[torch.Tensor], kind: str, seeds: list[int]) -> None:
    """Write the projection of ``seeds[m]`` into ``outs[m]`` (k x r, any float dtype).

    ``orthonormal``: ``sqrt(k/r)`` times the CholeskyQR ``Q`` of ``G`` (Gram in float64 unless
    the output is BF16); ``gaussian``: ``G / sqrt(r)``; ``rademacher``: ``+-1/sqrt(r)`` by the
    top bit of word ``i r + j`` (label ``"projection-rademacher"``). Rounded once to the
    output's dtype. Outputs of one shape and dtype are taken in chunks of
    :func:`projection_chunk` seeds: one call of the Gaussian loop for the chunk, the factors
    of all its Grams by batched ``cholesky_ex``/``solve_triangular`` (LAPACK and BLAS matrix
    by matrix), and the two products of each matrix as 2-D products of its own, so a
    projection has the bits it has alone, in any batch and at any position.
    """
    if kind == "rademacher":
        for out, seed in zip(outs, seeds, strict=True):
            k, r = out.shape
            words = random_words(k * r, seed, RADEMACHER_LABEL, 0, out.device).view(k, r)
            magnitude = torch.tensor(1.0 / math.sqrt(r), dtype=out.dtype, device=out.device)
            torch.where(words < 0, -magnitude, magnitude, out=out)
        return
    groups: dict[tuple, list[int]] = {}
    for m, out in enumerate(outs):
        groups.setdefault((tuple(out.shape), out.dtype, out.device), []).append(m)
    if len(seeds) != len(outs):
        raise ValueError(f"one seed per projection: {len(outs)} outputs, {len(seeds)} seeds")
    for ((k, r), dtype, device), members in groups.items():
        step = projection_chunk(k, r)
        for start in range(0, len(members), step):
            chunk = members[start:start + step]
            g = _gaussians(k, r, [seeds[m] for m in chunk], device)[:, :, :r]
            targets = [outs[m] for m in chunk]
            if kind == "gaussian":
                for out, x in zip(targets, g, strict=True):
                    torch.div(x, math.sqrt(r), out=out)
            else:
                # Rounding to BF16 (relative 2**-9) swamps the ~1e-5 error of an FP32 Gram.
                _orthonormal_into(targets, g, math.sqrt(k / r), dtype != torch.bfloat16)
            del g  # before the next chunk's


def _orthonormal_into(outs: list[torch.Tensor], g: torch.Tensor, scale: float,
                      gram_fp64: bool) -> None:
    """``outs[m] <- `` :func:`_orthonormalize_one` ``(g[m], scale, gram_fp64)``, rounded to
    ``outs[m]``'s dtype, with its bits: for ``k >= 4 r`` each Gram and each product ``g R^-1``
    is the 2-D product of that function, the Cholesky factors and their inverses are batched
    (one LAPACK / BLAS call per matrix inside torch's loop); for ``k < 4 r``, matrix by
    matrix. Temporaries: the ``[M, r, r]`` Grams and inverses, and one k x r product (FP32)
    or float64 copy of one ``g[m]`` at a time."""
    count, k, r = g.shape
    if not one_pass(k, r):
        for out, x in zip(outs, g, strict=True):
            out.copy_(_orthonormalize_one(x, scale, gram_fp64))
        return
    gram = torch.empty(count, r, r, dtype=torch.float64 if gram_fp64 else torch.float32,
                       device=g.device)
    for x, target in zip(g, gram, strict=True):
        xw = x.double() if gram_fp64 else x
        torch.mm(xw.t(), xw, out=target)
    inverse = _scaled_inverse_cholesky(gram, scale).to(torch.float32)
    del gram
    product = None
    for out, x, inv in zip(outs, g, inverse, strict=True):
        if out.dtype == torch.float32 and out.is_contiguous():
            torch.mm(x, inv, out=out)
            continue
        product = torch.mm(x, inv, out=product)
        out.copy_(product)


def _scaled_inverse_cholesky(gram: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale R^-1`` for the upper Cholesky factor ``R`` of each ``gram = R^T R``.

    ``cholesky_ex`` does not check its result (nothing synchronises with the device). An
    explicit inverse and a product, not a triangular solve with g: for k in the thousands the
    solve was 10x slower than the product on the CPU. The inverse solves ``X R = scale I``
    (``left=False``): 2.5x faster than ``R X = scale I`` in FP32 on the CPU for r = 64."""
    upper, _ = torch.linalg.cholesky_ex(gram, upper=True)
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device).mul_(scale)
    return torch.linalg.solve_triangular(upper, eye, upper=True, left=False)


# -- the update and the norms ---------------------------------------------------------------

#: Elements of W converted to float64 at once by the norm (:func:`square_sum`): 512 KiB.
SQUARE_SUM_BLOCK = 1 << 16


def square_sum(x: torch.Tensor, buffer: torch.Tensor | None = None) -> torch.Tensor:
    """``sum(float64(x)^2)`` over every element of the matrix ``x`` (``[d, k]``, any strides,
    BF16, FP32 or FP64 values): a 0-dim float64 tensor, the norm of every weight
    (:func:`sum_squares`, :func:`lowrank_update_`).

    Every square is exact in float64 (a BF16 or FP32 significand squared fits its 53 bits,
    and neither overflows nor underflows), and the sums are added in whatever order torch's
    kernels choose. Rounded once to FP32, the result is the exact sum's, except where the
    exact sum lies within the float64 error (below ``n 2**-53`` of it for n elements) of an
    FP32 rounding boundary: no machine, vector width, compiler or tile order moves it
    otherwise (the Triton kernel sums in float64 too). ``x`` is converted at most
    :data:`SQUARE_SUM_BLOCK` elements at a time (a contiguous ``x`` as one run of elements,
    another one whole rows where they fit) into ``buffer`` (float64, at least one element;
    default a new one of at most that size), so no copy of ``x`` is ever made."""
    rows = x.detach()
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    if rows.numel() == 0:
        return total
    if buffer is None:
        buffer = torch.empty(min(rows.numel(), SQUARE_SUM_BLOCK), dtype=torch.float64,
                             device=x.device)
    for part in _square_sum_blocks(rows, min(buffer.numel(), SQUARE_SUM_BLOCK)):
        block = buffer[:part.numel()]
        (block if part.dim() == 1 else block.view(part.shape)).copy_(part)
        total += torch.dot(block, block)
    return total


def _square_sum_blocks(rows: torch.Tensor, size: int):
    """The pieces of the matrix ``rows`` (``[d, n]``) that :func:`square_sum` converts, at
    most ``size`` elements each: runs of a contiguous matrix, whatever its rows; otherwise
    pieces of one row where rows are longer than ``size``, else blocks of whole rows."""
    n = rows.shape[1]
    if rows.is_contiguous():
        flat = rows.view(-1)
        yield from (flat[start:start + size] for start in range(0, flat.numel(), size))
    elif n > size:
        yield from (row[start:start + size] for row in rows for start in range(0, n, size))
    else:
        step = size // n
        yield from (rows[start:start + step] for start in range(0, rows.shape[0], step))


def _write_rows(rows: torch.Tensor, h: torch.Tensor, factor: torch.Tensor | None,
                norm: torch.Tensor | None, *, seed: int, offset: int, row_length: int,
                stochastic_rounding: bool) -> None:
    """``rows <- rows * factor - h`` in FP32 (``factor=None``: 1), then stored: BF16 rows
    stochastically, row ``i`` element ``j`` with the bits of ``offset + i row_length + j``,
    others as ``copy_`` rounds. ``h`` (FP32, rows' shape, contiguous) is consumed. ``norm``
    (0-dim float64, or ``None``): the sum of the squares of the stored rows is added to it
    (see :func:`square_sum`), by the update's own loop where it runs in one pass, otherwise
    converted in ``h``'s storage."""
    if rows.dtype == torch.bfloat16 and stochastic_rounding and rows.is_contiguous() \
            and row_length == rows.shape[1]:  # one pass: its patterns in h, then stored
        flat, words = rows.view(-1), h.view(-1)
        factor = torch.ones((), device=rows.device) if factor is None else factor
        run = _int32_loop(_update_words, rows.device) if norm is None else _int32_loop(
            _update_words_norm, rows.device, _update_words_norm_blocked)
        for start, length, keys in _segments(flat.numel(), offset, seed_words(seed)):
            part = slice(start, start + length)
            squares = run(flat[part], words[part], factor,
                          torch.tensor(keys, dtype=torch.int32, device=rows.device))
            if norm is not None:
                norm += squares
        flat.view(torch.int16).copy_(words.view(torch.int32))  # the low 16 bits: the pattern
        return
    if factor is None:  # in FP32 (type promotion), without an FP32 copy of rows
        new = torch.sub(rows, h, out=h)
    else:
        new = rows.to(torch.float32).mul_(factor).sub_(h)
    if rows.dtype != torch.bfloat16 or not stochastic_rounding:
        rows.copy_(new)
    else:
        for i in range(rows.shape[0]):  # a column slice of a wider matrix: its own index per row
            stochastic_round_(rows[i], new[i], seed, offset + i * row_length)
    if norm is not None:  # the rows just stored, converted in h's storage
        free = h.view(-1)[:h.numel() // 2 * 2].view(torch.float64)
        norm += square_sum(rows, free if free.numel() else None)


@torch.no_grad()
def lowrank_update_(weights: list[torch.Tensor], factors: list[torch.Tensor],
                    projections: list[torch.Tensor], coefs: torch.Tensor,
                    decays: torch.Tensor | None,
                    seeds: list[int], offsets: list[int], row_lengths: list[int],
                    stochastic_rounding: bool, chunk_rows: int,
                    sq_norms: torch.Tensor | None) -> None:
    """In place, for every matrix ``(m, e)``: ``W <- W (1 - decay) - coef U P^T`` in FP32,
    then one write (stochastic rounding for BF16 W unless disabled), rebuilding ``U P^T``
    ``chunk_rows`` rows at a time (the largest temporaries are chunk_rows x k FP32).

    weights[m]: ``[E, d, k]`` BF16/FP32 (rows contiguous or not); factors[m]: ``[E, d, r]`` FP32;
    projections[m]: ``[k, r]``; coefs, decays: ``[M, E]`` FP32 on W's device, never read on the
    host (``decays=None``: no decay, and no FP32 copy of the rows). Where ``coef == 0`` the
    factor and P are replaced by zeros (a select), so ``U P^T`` is exactly +0 and, with
    ``decay == 0``, W is stored back bit-identical (signed zeros included) even when U or P
    hold inf/NaN. ``sq_norms`` (``[M, E]`` FP32 or ``None``) is
    overwritten with ``||stored W||_F^2`` per matrix, the float64 sum of the squares of its
    chunks as they are stored (in the update's loop, or converted in the consumed chunk's
    storage), rounded once to FP32: the value :func:`sum_squares` gives (see
    :func:`square_sum`).
    """
    for m, (w3, u3, p) in enumerate(zip(weights, factors, projections, strict=True)):
        e_count, d, k = w3.shape
        for e in range(e_count):
            c = coefs[m, e]
            keep = c != 0
            # one FP32 copy of P, zeroed in place where coef == 0 (a select, NaN and inf too)
            p_t = p.to(torch.float32, copy=True).masked_fill_(~keep, 0.0).t()
            factor = None if decays is None else 1.0 - decays[m, e]
            norm = torch.zeros((), dtype=torch.float64, device=w3.device)
            for start in range(0, d, chunk_rows):
                rows = w3[e, start:start + chunk_rows]
                h = torch.where(keep, u3[e, start:start + chunk_rows] * c, 0.0) @ p_t
                _write_rows(rows, h, factor, None if sq_norms is None else norm, seed=seeds[m],
                            offset=offsets[m] + (e * d + start) * row_lengths[m],
                            row_length=row_lengths[m], stochastic_rounding=stochastic_rounding)
                del h  # before the next chunk's: one chunk of FP32 at a time
            if sq_norms is not None:
                sq_norms[m, e] = norm.to(torch.float32)


@torch.no_grad()
def sum_squares(weights: list[torch.Tensor], chunk_rows: int) -> torch.Tensor:
    """``||W_e||_F^2`` of every matrix of every stack, ``[M, E]`` FP32: the :func:`square_sum`
    of each matrix rounded once, converted through one float64 buffer of at most
    :data:`SQUARE_SUM_BLOCK` elements and at most the bytes of a ``chunk_rows``-row FP32 chunk
    of H of the widest matrix.

    weights[m]: ``[E, d, k]`` (same E for all m, any strides)."""
    if not weights:
        return torch.zeros(0, 0, dtype=torch.float32)
    out = torch.zeros(len(weights), weights[0].shape[0], dtype=torch.float32,
                      device=weights[0].device)
    largest = max(w.shape[1] * w.shape[2] for w in weights)
    k = max(w.shape[2] for w in weights)
    size = max(1, min(SQUARE_SUM_BLOCK, chunk_rows * k // 2, largest))
    buffer = torch.empty(size, dtype=torch.float64, device=weights[0].device)
    for m, w3 in enumerate(weights):
        for e, w in enumerate(w3):
            out[m, e] = square_sum(w, buffer).to(torch.float32)
    return out


#: Elements of C that :func:`sketch_stats` converts to float64 at once.
SKETCH_STATS_CHUNK = 1 << 16


def sketch_stats_rows(r: int) -> int:
    """Rows of C per float64 chunk of :func:`sketch_stats`."""
    return max(1, SKETCH_STATS_CHUNK // max(1, r))


def sketch_stats_bytes(e: int, d: int, k: int, r: int) -> int:
    """Peak temporary bytes of :func:`sketch_stats` on one stack of ``e`` sketches d x r with a
    k x r projection: P, its Gram and ``C^T C`` in float64, a float64 chunk of C's rows, and
    the matrices' sums."""
    return 8 * k * r + 16 * r * r + 8 * min(d, sketch_stats_rows(r)) * r + 8 * e


@torch.no_grad()
def sketch_stats(sketches: list[torch.Tensor], projections: list[torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(||C_e P^T||_F^2, all(isfinite(C_e)))`` per matrix, ``[M, E]`` FP32 and bool.

    ``||C P^T||_F^2 = trace((P^T P) (C^T C))`` from two r x r Grams (no k- or d-sized
    product), in float64: products of FP32 values are exact there, and the result is rounded
    once to FP32 and clamped at 0. Its FP32 bits therefore do not depend on the order in which
    the platform's GEMMs and sums add (their float64 rounding is ~2**29 times finer than the
    FP32 result's). Finite exactly where C is: a finite C cannot overflow float64 here, and an
    inf or NaN in C reaches the diagonal of ``C^T C``. sketches[m]: ``[E, d, r]`` FP32,
    projections[m]: ``[k, r]``; C is converted :func:`sketch_stats_rows` rows at a time.
    Both Grams are products ``X X^T`` of a transposed float64 copy ``X``: on an AVX2 CPU MKL's
    float64 GEMM ran 25% faster on them than on ``X^T X``.
    """
    if not sketches:
        empty = torch.zeros(0, 0)
        return empty, empty.bool()
    h2 = []
    for c3, p in zip(sketches, projections, strict=True):
        p_t = torch.empty(p.shape[::-1], dtype=torch.float64, device=p.device).copy_(p.t())
        gram = p_t @ p_t.t()
        del p_t
        e, d, r = c3.shape
        step = sketch_stats_rows(r)
        buffer = torch.empty(r, min(d, step), dtype=torch.float64, device=c3.device)
        totals = []
        for c2 in c3:
            ctc = torch.zeros(r, r, dtype=torch.float64, device=c3.device)
            for start in range(0, d, step):
                part = c2[start:start + step]
                c_t = buffer[:, :part.shape[0]].copy_(part.t())
                ctc.addmm_(c_t, c_t.t())
            totals.append(ctc.mul_(gram).sum())
        del buffer
        h2.append(torch.stack(totals) if totals else c3.new_zeros(0, dtype=torch.float64))
    h2 = torch.stack(h2)
    return h2.to(torch.float32).clamp_min_(0), torch.isfinite(h2)


# -- RowAdam's moments ----------------------------------------------------------------------

@torch.no_grad()
def row_adam_(sketches: list[torch.Tensor], exp_avgs: list[torch.Tensor],
              exp_avg_sqs: list[torch.Tensor], active: torch.Tensor, steps: torch.Tensor,
              beta1: float, beta2: float, eps: float, maximize: bool) -> None:
    """RowAdam's moment update and direction, in place, for every matrix ``(m, e)``::

        g = -S if maximize else S                                        (d x r)
        m <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) mean_j g[:, j]^2    where active[m, e]
        S <- U = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)           t = steps[m, e]

    sketches[m], exp_avgs[m]: ``[E, d, r]`` FP32 (S, m); exp_avg_sqs[m]: ``[E, d]`` FP32 (v);
    active: ``[M, E]`` bool; steps: ``[M, E]`` int64, the applied-update count t. Elsewhere m
    and v keep their bits (a select); U is written everywhere (where inactive it may not be
    finite: the caller gives it coefficient 0). FP32 arithmetic, each product, sum and
    quotient rounded once (no fused multiply-add), ``mean_j`` the :func:`pairwise_sums` of the
    row divided by r, the square root through float64 (correctly rounded), the bias
    corrections ``1 - b^t`` formed in float64 and rounded to FP32: the same bits on every CPU.
    U takes the sketch's storage.
    """
    for s, m, v, ok, t in zip(sketches, exp_avgs, exp_avg_sqs, active, steps, strict=True):
        g = -s if maximize else s
        ok_rows = ok.view(-1, 1)
        m.copy_(torch.where(ok_rows[..., None], m.mul(beta1).add_(g.mul(1.0 - beta1)), m))
        v.copy_(torch.where(ok_rows, v.mul(beta2).add_(pairwise_sums(g, square=True)
                                                        .div_(g.shape[-1])
                                                        .mul_(1.0 - beta2)), v))
        t = t.to(torch.float64)
        correction1 = (1.0 - beta1 ** t).to(torch.float32).view(-1, 1, 1)
        correction2 = (1.0 - beta2 ** t).to(torch.float32).view(-1, 1)
        denom = (v / correction2).double().sqrt_().to(torch.float32).add_(eps)
        torch.div(m, correction1, out=s).div_(denom[..., None])
