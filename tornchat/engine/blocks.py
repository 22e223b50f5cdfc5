"""Matrix products on GGUF blocks as the file stores them (csrc/blocks.h, csrc/blocks/), with their references.

``mm(x, parts, types)`` multiplies activations x [rows, K] by a weight matrix given as parts stacked by rows,
each part uint8 [N_i, row_bytes] in a GGML type, exactly as a GGUF file stores the tensor: fp32 [rows, sum N_i].
The quantized types never become floats in memory: the activations are quantized per block of 32 features to
int8 (as llama.cpp's Q8 blocks), each weight block's dot product with them is an exact int32, and the fp32
sums over blocks run in a fixed order per output. So every row's result has the same bits whatever the other
rows of the call, their number, the thread count, the split into parts, and (by construction) the
instruction-set path: a verify's or prefill's rows equal one-row decode steps.

Every kernel here has a float64 reference (``quantize_activations_reference``, ``reference_mm``) that states
its semantics; the tests hold the kernels to them within rounding.
"""
import functools
import importlib

import torch

from tornchat.engine import ggml

try:
    from gguf import GGMLQuantizationType as _GGML

    TYPE_IDS = {name: int(_GGML[name]) for name in ggml.TYPES if name not in ggml.GROUPED}
except ImportError:  # gguf is optional at run time; the ids are GGML's own (ggml.h's enum ggml_type)
    TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12,
                "Q5_K": 13, "Q6_K": 14, "BF16": 30}
GROUPED_ID, PANELED_ID = 1000, 2000  # csrc/blocks.h: a grouped (paneled) layout's id is this plus its file type's
TYPE_IDS |= {name: (PANELED_ID if name in ggml.PANELED else GROUPED_ID) + TYPE_IDS[base]
             for name, base in ggml.GROUPED.items()}
TYPE_NAMES = {v: k for k, v in TYPE_IDS.items()}
# The types each path reads faster in the grouped layout (ggml.group), the steps its kernels dot already in place.
# avx2, avxvnni: all five; the 135M's products at one row 1.16x (Q4_1 layers) and 1.46x (Q8_0 head) (2026-11-28,
# AMD Zen 3). AVX-512: the Q4 types, whose tiles otherwise transpose each group's nibbles (Q4_K's 1B products at
# 2 and 4 rows 0.83x and 0.86x the time, the same at one row; 4-row steps 0.89x the time at 135M, 0.90-0.96x at 1B;
# 2026-11-29, AMD Zen 4), and Q6_K since its grouped tiles unpack two columns' steps in one 512-bit vector
# (unpack_steps2: the 1B's Q6_K products from memory at 1, 2 and 4 rows 0.78-0.98x, 0.78-0.95x and 0.83-0.92x
# the time of the file's layout, 512 rows the same; 2026-12-06, AMD Zen 4); not Q8_0, which one row reads faster
# in the file's layout (docs/performance.md).
_ALL, _AVX512 = tuple(ggml.GROUPED.values()), ("Q4_0", "Q4_1", "Q4_K", "Q6_K")
GROUPING = {"avx2": _ALL, "avxvnni": _ALL, "avx512vnni": _AVX512, "amx": _AVX512}
# The types each path reads in the panel layout (ggml.panel) where a part allows it (grouped_type's panels):
# avx512vnni's 32-value types, whose tiles of 4 columns spent at K = 576 about 40% of their time outside the dot
# products (2026-12-06, AMD Zen 4: the 135M's Q4_1 products 0.51-0.57x the time at 1 to 16 rows).
PANELING = {"avx512vnni": ("Q4_0", "Q4_1", "Q8_0")}
QK = 32  # features per activation block


@functools.cache
def _import():
    """The compiled module (csrc/fused.cpp with csrc/blocks/) where built, else None; and why not."""
    try:
        return importlib.import_module("tornchat.engine._fused"), ""
    except ImportError as exc:
        return None, str(exc)


def _native():
    return _import()[0]


def available() -> bool:
    """Whether the block kernels are built."""
    return _native() is not None and hasattr(_native(), "block_mm")


def missing() -> str:
    """Why ``available()`` is False: the import's error (a module not built, or built against another torch)."""
    return _import()[1] or "tornchat.engine._fused has no block kernels"


def isas() -> list[str]:
    """The instruction-set paths this CPU runs, best first: some of "amx" (avx512vnni with AMX tiles for
    every 16 rows), "avx512vnni", "avxvnni", "avx2" (x86-64), "dotprod" (aarch64 with the Armv8.2 dot product),
    "neon" (every aarch64 CPU), and always "generic" (plain C++). All give the same bits."""
    return list(_native().block_isas())


def isa() -> str:
    """The path ``mm`` takes by default: the best of ``isas()``, or the one the environment variable
    TORNCHAT_ISA names (an error where this CPU lacks it)."""
    return _native().block_isa()


def _type_id(t) -> int:
    return TYPE_IDS[t] if isinstance(t, str) else int(t)


def grouped_type(type_name: str, isa: str = "", rows: int = 0, panels: bool = False) -> str:
    """The type path ``isa`` (default ``isa()``) reads type_name's rows in: with ``panels`` (a part whose rows
    are not reordered after) of ``rows`` rows, its panel layout (``ggml.panel``) where the path reads the type so
    (``PANELING``) and the rows are whole slabs of 16; else its grouped layout (``ggml.group``) where that path
    reads it faster; else type_name itself."""
    grouped = type_name + "_G8"
    if grouped not in ggml.GROUPED or not available():
        return type_name
    isa = isa or _native().block_isa()
    if panels and rows % 16 == 0 and type_name in PANELING.get(isa, ()):
        return type_name + "_P16"
    return grouped if type_name in GROUPING.get(isa, ()) else type_name


def group(part: torch.Tensor, type_name: str, isa: str = "", panels: bool = False) -> str:
    """part (uint8 [N, row_bytes], contiguous) rearranged in place into ``grouped_type`` (in C++): returns the type
    part now holds (``panels``: see ``grouped_type``)."""
    grouped = grouped_type(type_name, isa, part.shape[0], panels)
    if grouped in ggml.PANELED:
        _native().panel_blocks(part, TYPE_IDS[type_name])
    elif grouped != type_name:
        _native().group_blocks(part, TYPE_IDS[type_name])
    return grouped


def ungroup(part: torch.Tensor, type_name: str) -> tuple[torch.Tensor, str]:
    """A grouped part's bytes as the file stores them, and their type (``ggml.ungroup``, in C++ where built);
    any other part as it is."""
    if type_name not in ggml.GROUPED:
        return part, type_name
    base = ggml.GROUPED[type_name]
    if not available():
        return ggml.ungroup(part, type_name), base
    if type_name in ggml.PANELED:
        return _native().unpanel_blocks(part.contiguous(), TYPE_IDS[base]), base
    return _native().ungroup_blocks(part.contiguous(), TYPE_IDS[base]), base


def mm(x: torch.Tensor, parts, types, isa: str = "") -> torch.Tensor:
    """x [rows, K] (fp32 or bf16) times the parts' [sum N_i, K] transposed -> fp32 [rows, sum N_i].

    parts: uint8 [N_i, row_bytes] tensors of GGUF blocks; types: their GGML type names or ids. isa: one of
    ``isas()``, or "" for ``isa()``. Semantics: ``reference_mm``. Threads split the output columns."""
    return _native().block_mm(x, [p.contiguous() for p in parts], [_type_id(t) for t in types], isa)


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' activation quantization: x [rows, K] -> (q int8 [rows, K], d fp32 [rows, K / 32],
    s int32 [rows, K / 32]).

    Per row and block of 32 features: d = max |x| / 127 in fp32; q = round-half-even(x * (127 / max |x|))
    with the factor and the product in fp32, clamped to [-127, 127] (0 where max |x| is 0); s = sum of q."""
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // QK, QK)
    largest = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(largest > 0, torch.tensor(127.0) / largest, torch.zeros(()))
    q = torch.round(blocks * inverse).clamp(-127, 127)
    d = (largest / 127.0)[..., 0]
    return q.to(torch.int8).reshape(rows, k), d, q.sum(dim=-1).to(torch.int32)


def reference_mm(x: torch.Tensor, parts, types) -> torch.Tensor:
    """``mm``'s semantics in float64 -> float64 [rows, sum N_i].

    Float types (F32, F16, BF16): out = x @ W^T with x as given (not quantized).
    Quantized types: out[r, n] = sum over blocks b of d[r, b] * sum over the block's 32 features of
    W[n, k] * q[r, k], with W the dequantized weights (``tornchat.engine.ggml.dequantize``) and (q, d) from
    ``quantize_activations_reference``. The kernels compute each block's integer dot of weight levels and q
    exactly and differ from this only by fp32 rounding of the scales and of the sums, which they do in a
    fixed order per output whatever the batch: 8 fp32 lanes, block 8g + j into lane j with a fused
    multiply-add of the dot times (weight scale * d), then for types with minimums one of the minimum times
    (d * s); the lanes summed as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). Float types: feature k
    into lane k % 8. See csrc/blocks.h."""
    return _reference_products(x, parts, types, absolute=False)


def reference_terms(x: torch.Tensor, parts, types) -> torch.Tensor:
    """The sum of the absolute values of ``reference_mm``'s products per output, float64 [rows, sum N_i]:
    the scale of each output's rounding error."""
    return _reference_products(x, parts, types, absolute=True)


def _reference_products(x: torch.Tensor, parts, types, absolute: bool) -> torch.Tensor:
    """x (quantized as the kernels do, the float types' x as it is) times the dequantized weights, in float64;
    with ``absolute``, of both's absolute values."""
    outs = []
    rows, k = x.shape
    q, d, _ = quantize_activations_reference(x)
    xq = (q.double().reshape(rows, k // QK, QK) * d.double()[..., None]).reshape(rows, k)
    for raw, t in zip(parts, types):
        name = TYPE_NAMES[_type_id(t)]
        w = ggml.dequantize(raw, name).double()
        inputs = x.double() if name in ggml.FLOATS else xq
        outs.append(inputs.abs() @ w.abs().T if absolute else inputs @ w.T)
    return torch.cat(outs, dim=1)
