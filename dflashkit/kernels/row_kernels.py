"""Row kernels for the 1 to 16 rows of a decoding step on x86 CPUs: AMX-BF16, AVX512-BF16 or AVX2 + FMA.

A decoding step is bound by reading the weights, and oneDNN's bf16 products for a few rows read them well below that
floor: on an AMD EPYC Zen 4 (AVX512-BF16) they stream SmolLM2-135M's 269 MB at 10-16 GB/s where a plain read reaches
~42 GB/s, and on AVX2-only CPUs (e.g. AMD Zen 1; most laptops) torch has no fast bf16 path for them at all
(``scripts/bench_row_kernels.py`` measures both sides). ``csrc/`` holds one source per instruction set, the same
kernels in each:

* :func:`linear`: a bf16 product over a weight packed once (:func:`pack`), fp32 sums. AVX512-BF16 (``csrc/
  row_kernels_avx512.cpp``): ``vdpbf16ps`` in groups of 64 columns; more than 6 rows walk K together in chunks of 32
  pairs, prefetching the next chunk while they compute, so that the weights stream during the compute instead of
  before it (on Zen 4 the kernel ran at 1.4-1.9x oneDNN's speed for 1-16 rows even before that). AVX2 (``csrc/
  row_kernels_avx2.cpp``): the weight pairs unpacked to fp32 with a shift and an AND, FMA, in groups of 16 columns.
  AMX-BF16 (the AVX512-BF16 source built with ``-DDFLASHKIT_AMX``): the same packed layout
  read as AMX tiles, up to 16 rows per tile, the whole K summed in tiles: on an Intel Xeon with AMX 1 to 16 rows
  then take the same time, about three quarters of oneDNN's, where the ``vdpbf16ps`` kernel is compute-bound beyond
  one row. Attention and the rest are the AVX512-BF16 code.
* :func:`attention`: grouped-query attention one query row at a time, fp32 sums (scores from bf16 pairs by
  ``vdpbf16ps``): on Zen 4 1.7-3.4x faster than SDPA for 1-16 rows at 400 cached positions.
* :func:`argmax`: the first largest logit per row of a step's bf16 logits, as torch's argmax but without its fp32
  conversion (~7x faster per row).
* :func:`verify_chain` and :func:`sample_rows`: a sampled step's math (exact speculative sampling of a chain on the
  target's logits; the drafter's proposals and their softmax) in one call each instead of some 40 small torch ops,
  each of which pays tens of µs for the caches the target's pass has just swept.
* :func:`gumbel` and :func:`coupled`: coupled sampling's counter-based Gumbel noise (``sampling.PositionNoise``), the
  noisy scores and their argmax in one call per decision, the noise computed for the columns read (several times
  faster than numpy's draw, torch's logs and the scores' small ops).
* :func:`decoder_layers`: every decoder layer of a Llama / Qwen2 / Qwen3 target in one call (norms, products,
  rotary, cache write, attention, SiLU, residuals; ``csrc/row_layers.h``, shared by both, as are the argument
  checks in ``csrc/row_common.h``): no Python or dispatcher time per op (on Zen 4 a fifth to a
  quarter off a SmolLM2 step of 1-8 rows). The drafter's block forward uses it too, and :func:`drafter_step_batch`
  runs a drafter's whole step around it (new context rows, block, final norm; one or several sequences).

Each computes a row the same way, in the same order, whatever rows run beside it, so a verify pass and a
one-token step give bitwise the same results: bf16 speculative greedy output is then plain greedy output, with
no numerical ties. (The two instruction sets round differently from each other: a machine agrees with itself.)
With the AVX512-BF16 kernels, larger steps (prefill beyond 16 rows, batched generation) stay with oneDNN and
SDPA; with the AVX2 kernels every step runs on them (:func:`max_rows`), torch having no fast bf16 path there.

The kernels are compiled on first use with torch's C++ extension builder (a C++ compiler and ninja; about 30
s, once per machine, cached under ``~/.cache/dflashkit/kernels``), with ``-fopenmp``: ``at::parallel_for`` is a
header template whose OpenMP region is compiled into the kernel, which ran on one thread without it. Which runs
(``DFLASHKIT_CPU_GEMM``): ``auto`` (default) takes the AMX kernels on CPUs with AMX and AVX512-BF16, the
AVX512-BF16 kernels on CPUs with AVX512-BF16 and no AMX, the AVX2 kernels on CPUs whose best instruction set is
AVX2 (torch's ``get_cpu_capability()``), and oneDNN / SDPA elsewhere or where they cannot be built; ``amx``,
``avx512`` or ``avx2`` forces one on any CPU that has it; ``onednn`` turns them off.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

# AMX / AVX512-BF16: steps of more rows go to oneDNN and SDPA (Zen 4: the product's lead shrinks to ~1.1x at 16 rows;
# Intel Xeon with AMX: the AMX product still leads at 64 rows, but the row-by-row attention trails SDPA past ~8 rows)
MAX_ROWS = 16
# AMX: a batched step's rows, over all its sequences (each within MAX_ROWS, so attention stays short per sequence):
# the AMX product stays ahead of oneDNN up to 64 rows (about 0.8x oneDNN's time there, at under twice its one-row time)
MAX_BATCH_ROWS = 64
ANY_ROWS = 1 << 30  # no row limit (AVX2 steps; int8 products on every kernel)
CSRC = Path(__file__).with_name("csrc")
HEADERS = (CSRC / "row_common.h", CSRC / "row_layers.h", CSRC / "row_int4.h")  # included by both sources
CHOICES = ("auto", "amx", "avx512", "avx2", "onednn")
# -fopenmp: at::parallel_for is a header template whose `omp parallel` is compiled into the kernel itself; without
# the flag it runs on one thread. No -lgomp: the calls bind to the libgomp torch itself loads.


@dataclass(frozen=True)
class Isa:
    """One instruction set's kernel source, compiler flags and the CPU probe that says it runs here."""

    name: str
    source: Path
    cflags: tuple[str, ...]

    def supported(self) -> bool:
        vnni = _cpu_has("_is_vnni_supported")  # AVX512-VNNI: every AVX512-BF16 CPU has it (the 4-bit product uses it)
        if self.name == "amx":
            return vnni and _cpu_has("_is_avx512_bf16_supported") and _cpu_has("_is_amx_tile_supported")
        if self.name == "avx512":
            return vnni and _cpu_has("_is_avx512_bf16_supported")
        return _capability() in ("AVX2", "AVX512")  # AVX2 + FMA (torch's AVX2 level requires both)


_AVX512_FLAGS = (
    "-O3",
    "-fopenmp",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
    "-mavx512vnni",
    "-mfma",
    "-mf16c",
)
ISAS = {
    # the AVX512-BF16 source with its product on AMX tiles (attention and the rest as on AVX512-BF16)
    "amx": Isa("amx", CSRC / "row_kernels_avx512.cpp", (*_AVX512_FLAGS, "-mamx-tile", "-mamx-bf16", "-DDFLASHKIT_AMX")),
    "avx512": Isa("avx512", CSRC / "row_kernels_avx512.cpp", _AVX512_FLAGS),
    "avx2": Isa("avx2", CSRC / "row_kernels_avx2.cpp", ("-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c")),
}


def choice() -> str:
    """The DFLASHKIT_CPU_GEMM setting: auto (default), amx, avx512, avx2 or onednn."""
    value = os.environ.get("DFLASHKIT_CPU_GEMM", "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"DFLASHKIT_CPU_GEMM must be one of {', '.join(CHOICES)}, got {value!r}")
    return value


def kernel() -> ModuleType | None:
    """The compiled kernel where it should run here (see the module docstring), else None."""
    return _load(choice())


def label() -> str | None:
    """The running kernel's instruction set as people write it ("AMX-BF16", "AVX512-BF16", "AVX2"), or None."""
    k = kernel()
    return k.isa if k is not None else None


def max_rows(device: torch.device | str | None = None) -> int:
    """The most rows a step runs on the kernels (more go to oneDNN / SDPA): :data:`MAX_ROWS` for AMX and
    AVX512-BF16; any number for AVX2, where torch has no fast bf16 product for them to go to (a prefill's rows run
    the kernels in row blocks). For tensors on another ``device`` (a GPU) :data:`MAX_ROWS`, without building the
    kernels: they never run there, and building them takes 30-60 s."""
    if _elsewhere(device):
        return MAX_ROWS
    k = kernel()
    return MAX_ROWS if k is None or k.isa != "AVX2" else ANY_ROWS


def max_batch_rows(device: torch.device | str | None = None) -> int:
    """The most rows, over all its sequences, that a batched step runs as one pass on the kernels (each sequence's
    own rows within :func:`max_rows`): :data:`MAX_BATCH_ROWS` on AMX, whose product reads the weights once for up to
    64 rows at well under twice the time of one; elsewhere :func:`max_rows`. For tensors on another ``device`` (a
    GPU: how many sequences a batched step of the batches engine takes at once) :data:`MAX_BATCH_ROWS`, without
    building the kernels."""
    if _elsewhere(device):
        return MAX_BATCH_ROWS
    k = kernel()
    return MAX_BATCH_ROWS if k is not None and k.isa == "AMX-BF16" else max_rows()


def _elsewhere(device: torch.device | str | None) -> bool:
    """Whether ``device`` names a device other than the CPU (None: the CPU)."""
    return device is not None and torch.device(device).type != "cpu"


def _pick(setting: str) -> Isa | None:
    if setting == "onednn":
        return None
    if setting in ISAS:
        return ISAS[setting] if ISAS[setting].supported() else None
    if ISAS["amx"].supported():
        return ISAS["amx"]
    if ISAS["avx512"].supported():
        return ISAS["avx512"]
    return ISAS["avx2"] if _capability() == "AVX2" else None


@lru_cache
def _load(setting: str) -> ModuleType | None:
    isa = _pick(setting)
    if isa is None:
        return None
    if setting == "auto" and isa.name == "amx":  # a compiler without -mamx-tile still builds the AVX512-BF16 one
        return _build(isa, otherwise="the AVX512 kernel") or _build(ISAS["avx512"])
    return _build(isa)


def _build(isa: Isa, otherwise: str = "oneDNN") -> ModuleType | None:
    """The compiled kernel of this instruction set (built once per machine, then loaded), or None with a warning."""
    digest = hashlib.sha256(b"".join(f.read_bytes() for f in (isa.source, *HEADERS)) + " ".join(isa.cflags).encode())
    name = f"dflashkit_rows_{isa.name}_{digest.hexdigest()[:12]}"
    build = Path(os.environ.get("DFLASHKIT_KERNEL_DIR", Path.home() / ".cache" / "dflashkit" / "kernels")) / name
    try:
        build.mkdir(parents=True, exist_ok=True)
        if not (build / f"{name}.so").exists():
            print(
                f"dflashkit: compiling its {isa.name.upper()} CPU kernels (once per machine, 30-60 s)...",
                file=sys.stderr,
            )
        from torch.utils.cpp_extension import load

        if shutil.which("ninja") is None:  # the pip package's ninja lies beside this Python, maybe not on PATH
            os.environ["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", "")))

        module = load(
            name=name,
            sources=[str(isa.source)],
            build_directory=str(build),
            verbose=False,
            extra_cflags=list(isa.cflags),
            extra_include_paths=[str(CSRC)],
        )
        if not module.ready():  # e.g. a kernel or VM that does not hand out the AMX tile state
            raise RuntimeError("the operating system refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")
        return module
    except Exception as exc:  # noqa: BLE001 (no compiler, no ninja, a read-only home...: oneDNN it is)
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else exc
        warnings.warn(
            f"dflashkit: the {isa.name.upper()} bf16 CPU kernel could not be built or run here "
            f"({type(exc).__name__}: {reason}); using {otherwise}",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def _cpu_has(probe: str) -> bool:
    """torch's CPU feature probe by name (private helpers of torch.cpu; False where this torch lacks one)."""
    check = getattr(torch.cpu, probe, None)
    return bool(check()) if check is not None else False


def _capability() -> str:
    """The instruction set torch's own CPU kernels were dispatched to here ("AVX2", "AVX512", "DEFAULT"...)."""
    return torch.backends.cpu.get_cpu_capability()


def usable(weight: Tensor) -> bool:
    """Whether products with this weight [out, in] can run on the kernel here."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.shape[1] % 2 == 0
        and kernel() is not None
    )


def attention_usable(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether :func:`attention` runs here for heads of this size."""
    return dtype == torch.bfloat16 and device.type == "cpu" and head_dim in (16, 32, 64, 128) and kernel() is not None


def pack(weight: Tensor) -> Tensor:
    """The running kernel's layout of weight [N, K] (K even): [ceil(N/G), K/2, B, 16, 2] with B blocks of 16
    columns per group of G = 16 B (B = 4 for AVX512-BF16, 1 for AVX2), zero-padded columns."""
    n, k = weight.shape
    blocks = kernel().blocks
    group = 16 * blocks
    groups = -(-n // group)
    padded = weight.detach().new_zeros(groups * group, k)
    padded[:n] = weight.detach()
    return padded.view(groups, blocks, 16, k // 2, 2).permute(0, 3, 1, 2, 4).contiguous()  # [G, K/2, B, 16, 2]


def int8_usable(qweight: Tensor) -> bool:
    """Whether products with this weight-only int8 weight [out, in] can run on the kernel here (every instruction
    set's kernel takes them: AVX2, AVX512-BF16, AMX)."""
    if not (qweight.dtype == torch.int8 and qweight.device.type == "cpu" and qweight.dim() == 2):
        return False
    k = kernel()
    return k is not None and k.int8


def pack_int8(qweight: Tensor, scale: Tensor) -> Tensor:
    """Every kernel's layout of an int8 weight [N, K] with per-row scales [N]: [ceil(N/16), 16 K + 64] int8, each
    group's K rows of its 16 columns' weights (``[g, 16 k + c] = qweight[16 g + c, k]``) followed by its 16 scales as
    fp32 bytes; padded columns have weight 0."""
    n, k = qweight.shape
    groups = -(-n // 16)
    q = qweight.detach().new_zeros(groups * 16, k)
    q[:n] = qweight.detach()
    scales = torch.ones(groups * 16, dtype=torch.float32, device=qweight.device)
    scales[:n] = scale.detach().float()
    panels = q.view(groups, 16, k).transpose(1, 2).reshape(groups, 16 * k)  # [G, 16 K]
    return torch.cat((panels, scales.view(groups, 16).view(torch.int8)), dim=1).contiguous()  # [G, 16 K + 64]


def int4_usable(codes: Tensor) -> bool:
    """Whether products with 4-bit codes [out, in] (uint8, one code per byte, ``in`` a multiple of 32) can run on the
    kernel here (every instruction set's kernel takes them)."""
    if not (codes.dtype == torch.uint8 and codes.device.type == "cpu" and codes.dim() == 2):
        return False
    if codes.shape[1] % 32:
        return False
    k = kernel()
    return k is not None and getattr(k, "int4", False)


def pack_int4(codes: Tensor, scale: Tensor, low: Tensor) -> Tensor:
    """Every kernel's layout of a 4-bit weight (``csrc/row_int4.h``): codes [N, K] uint8 in 0..15, scale and low
    [N, K/32] fp16 (w ~ scale * code + low per block of 32 inputs) -> [ceil(N/16), K/32 * 320] uint8: per group of 16
    columns and block of 32 inputs, 4 steps of 64 bytes (byte 64 j + 4 c + t: the code of input 4 j + t in its low
    nibble, of input 16 + 4 j + t in its high one), then the 16 scales, then the 16 lows; padded columns are 0."""
    n, k = codes.shape
    groups, blocks = -(-n // 16), k // 32
    q = codes.new_zeros(groups * 16, k)
    q[:n] = codes
    d = scale.new_zeros(groups * 16, blocks)
    d[:n] = scale
    m = low.new_zeros(groups * 16, blocks)
    m[:n] = low
    q = q.view(groups, 16, blocks, 2, 4, 4)  # [G, c, b, half, j, t]: input 32 b + 16 half + 4 j + t
    nibbles = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [G, c, b, j, t]
    codes_bytes = nibbles.permute(0, 2, 3, 1, 4).reshape(groups, blocks, 256)  # [G, b, (j, c, t)]
    d = d.view(groups, 16, blocks).transpose(1, 2).contiguous().view(torch.uint8)  # [G, b, 32]
    m = m.view(groups, 16, blocks).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat((codes_bytes, d, m), dim=2).reshape(groups, blocks * 320).contiguous()


def rows_of(x: Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def linear(x: Tensor, packed: Tensor, out_features: int, bias: Tensor | None = None) -> Tensor:
    """``x @ W.T + bias`` for x [..., K] bf16, W packed by :func:`pack` (or ``x @ (Q * scale).T + bias`` with an int8
    weight packed by :func:`pack_int8`, or the 4-bit product of a weight packed by :func:`pack_int4`); bias in fp32
    (added before rounding)."""
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    y = kernel().linear(flat, packed, out_features, bias)  # [rows, N]
    return y.view(*x.shape[:-1], out_features)


def argmax(logits: Tensor) -> Tensor | None:
    """Index of the largest logit per row of bf16 CPU logits [..., V] -> [...] (long), exactly as torch's argmax
    (first index on ties, a NaN counts as the largest), or None where the kernel does not run here (other dtypes or
    devices, V < 16, ``DFLASHKIT_CPU_GEMM=onednn``). ~8 µs per 49,152-entry row on Zen 4 against ~55 µs for
    torch's fp32 argmax after a conversion: what greedy verification spends per row of a verify pass."""
    if logits.dtype != torch.bfloat16 or logits.device.type != "cpu" or not 16 <= logits.shape[-1] < 2**31:
        return None
    k = kernel()
    if k is None:
        return None
    flat = logits.reshape(-1, logits.shape[-1])
    return k.argmax_rows(flat if flat.is_contiguous() else flat.contiguous()).view(logits.shape[:-1])


def top_probs(scores: Tensor, k: int) -> tuple[Tensor, Tensor] | None:
    """The k largest scores of each row of bf16 CPU scores [R, V] as softmax probabilities (fp32 [R, k], largest
    first) and their indices (long [R, k]): ``scores.float().softmax(-1).topk(k)`` in one pass per row, the smaller
    index first among equal scores. None where the kernel does not run here (other dtypes or devices, V < 16, k > 16,
    ``DFLASHKIT_CPU_GEMM=onednn``)."""
    if (
        scores.dtype != torch.bfloat16
        or scores.device.type != "cpu"
        or scores.dim() != 2
        or not 16 <= scores.shape[-1] < 2**31
        or not 1 <= k <= 16
    ):
        return None
    kern = kernel()
    if kern is None:
        return None
    return kern.top_probs_rows(scores if scores.is_contiguous() else scores.contiguous(), k)


_NO_PROBS, _NO_COLUMNS = (
    torch.empty(0, dtype=torch.float32),
    torch.empty(0, dtype=torch.long),
)  # one-hot drafts; q over V


def verify_chain(
    logits: Tensor,
    temperature: float,
    drafts: Tensor,
    draft_probs: Tensor | None,
    uniforms: Tensor,
    columns: Tensor | None = None,
) -> tuple[int, int] | None:
    """Exact speculative sampling over a chain of k drafts in one call:
    :func:`dflashkit.decoding.sampling.verify_sampled` on
    CPU logits [k+1, V] (fp32 or bf16) warped by ``temperature`` alone, deciding with ``uniforms`` [k+1] (fp64) as it
    does; draft_probs [k, V] (or [k, V'] over the tokens ``columns`` [V'], a draft vocabulary) or None (one-hot
    drafts). Returns (kept drafts, the token after them), or None where the kernel does not run here or a row it
    reads holds a NaN or an infinite largest logit (then torch's version runs)."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.bfloat16, torch.float32) or logits.dim() != 2:
        return None
    kern = kernel()
    if kern is None:
        return None
    probs = _NO_PROBS if draft_probs is None else draft_probs.to(torch.float32).contiguous()
    cols = _NO_COLUMNS if columns is None or draft_probs is None else columns.contiguous()
    kept, token = kern.verify_chain(
        logits.contiguous(), 1.0 / temperature, drafts.contiguous(), probs, cols, uniforms.contiguous()
    )
    return None if token < 0 else (kept, token)


def sample_rows(scores: Tensor, temperature: float, uniforms: Tensor) -> tuple[Tensor, Tensor] | None:
    """A drafter's sampled proposals in one call: per row of CPU scores [k, V'] (fp32 or bf16), the softmax of
    scores / temperature (fp32 [k, V']) and the index drawn from it at 1 - uniforms[i] (fp64 [k]), as
    ``sampling.sample(warp(scores))`` draws with the same uniforms. Returns (indices [k], probs), or None where the
    kernel does not run here or a row holds a NaN or an infinite largest score."""
    if scores.device.type != "cpu" or scores.dtype not in (torch.bfloat16, torch.float32) or scores.dim() != 2:
        return None
    kern = kernel()
    if kern is None:
        return None
    index, probs = kern.sample_rows(scores.contiguous(), 1.0 / temperature, uniforms.contiguous())
    return None if index.numel() != scores.shape[0] else (index, probs)


def gumbel(keys: Tensor, width: int, columns: Tensor | None = None) -> Tensor:
    """Coupled sampling's Gumbel noise (:class:`dflashkit.decoding.sampling.PositionNoise`) of the positions whose
    64-bit keys
    ``keys`` (int64 [R], the keys' bits) holds, over tokens 0..width-1 or the tokens ``columns`` [width]: fp32
    [R, width]. The kernel must run here (PositionNoise checks)."""
    return kernel().gumbel_rows(keys, width, _NO_COLUMNS if columns is None else columns.contiguous())


def coupled(
    rows: Tensor,
    temperature: float,
    keys: Tensor,
    columns: Tensor | None = None,
    scores: bool = False,
    argmax: bool = False,
) -> tuple[Tensor | None, Tensor | None]:
    """Coupled sampling's decisions on CPU rows [R, W] (bf16 or fp32, contiguous; over the tokens ``columns`` [W]
    where given) in one call: the noisy scores rows x (1 / temperature) + G (fp32 [R, W], if ``scores``) and / or
    each row's first largest one's column (long [R], if ``argmax``: torch's argmax of those scores, a NaN counting
    as the largest), with G the noise of the positions whose keys ``keys`` holds. The kernel must run here."""
    out, index = kernel().coupled_rows(
        rows, 1.0 / temperature, keys, _NO_COLUMNS if columns is None else columns.contiguous(), scores, argmax
    )
    return (out if scores else None), (index if argmax else None)


def attention(q: Tensor, keys: Tensor, values: Tensor, hidden: Tensor | None, scale: float) -> Tensor:
    """Grouped-query attention over one sequence's cache, one query row at a time, fp32 inside.

    q [kv_heads, group*n, head_dim] (the query heads that share a key/value head, stacked: row r is query row
    r % n); keys, values [kv_heads, m, head_dim] (views of a cache are fine: rows must be contiguous); hidden
    [n, m] bool (True: the row does not see that key) or None (every row sees every key). Returns
    [kv_heads, group*n, head_dim]. A row's result depends only on its query and the keys it sees, so row i of
    a verify pass is bitwise the one-token step at its position.
    """
    n = hidden.shape[0] if hidden is not None else q.shape[1]
    return kernel().attention(q.contiguous(), keys, values, hidden, n, scale)


def layer_weights(
    input_norm: Tensor,
    qkv: Tensor,
    qkv_bias: Tensor | None,
    o: Tensor,
    post_norm: Tensor,
    gate_up: Tensor,
    down: Tensor,
    q_norm: Tensor | None,
    k_norm: Tensor | None,
) -> list[Tensor]:
    """One layer's 8 tensors for :func:`decoder_layers` (products packed by :func:`pack`, the q/k/v bias in fp32;
    absent ones as empty tensors)."""
    empty = input_norm.new_empty(0)
    norms = torch.stack((q_norm, k_norm)).detach().contiguous() if q_norm is not None else empty
    return [
        input_norm.detach(),
        qkv,
        qkv_bias if qkv_bias is not None else empty.float(),
        o,
        post_norm.detach(),
        gate_up,
        down,
        norms,
    ]


def decoder_layers(
    x: Tensor,
    weights: list[Tensor],
    cos: Tensor,
    sin_signed: Tensor,
    keys: Tensor,
    values: Tensor,
    start: int,
    hidden: Tensor | None,
    heads: int,
    kv_heads: int,
    intermediate: int,
    eps: float,
    scaling: float,
    feature_layers: list[int],
    context_start: int = 0,
) -> tuple[Tensor, Tensor | None]:
    """Every decoder layer for the rows x [n, hidden] at positions start..start+n-1, in one call (a Llama / Qwen2 /
    Qwen3 target's, or the drafter's, whose block rows see each other and the whole context: hidden None).

    ``weights``: 8 per layer (input norm, q/k/v packed, q/k/v fp32 bias or an empty tensor, o packed, post norm,
    gate/up packed, down packed, [q_norm, k_norm] stacked or an empty tensor); cos, sin_signed [n, head_dim];
    keys, values [layers, kv_heads, capacity, head_dim]: the rows' keys and values are written at start..; hidden
    [n, start+n] bool or None; ``context_start``: the rows attend to cache rows context_start.. only (a drafter's
    context window; 0 with ``hidden``). Each row is computed on its own (bitwise a one-token step). Returns x after the
    last layer [n, hidden] and the feature layers' outputs [1, n, len(feature_layers) * hidden] (None without).
    """
    out, features = kernel().decoder_layers(
        x.contiguous(),
        weights,
        cos.contiguous(),
        sin_signed.contiguous(),
        keys,
        values,
        start,
        hidden,
        heads,
        kv_heads,
        intermediate,
        eps,
        scaling,
        list(feature_layers),
        context_start,
    )
    return out, features[None] if feature_layers else None


def decoder_layers_batch(
    x: Tensor,
    weights: list[Tensor],
    cos: Tensor,
    sin_signed: Tensor,
    caches: list[tuple[Tensor, Tensor]],
    starts: list[int],
    counts: list[int],
    hiddens: list[Tensor | None],
    heads: int,
    kv_heads: int,
    intermediate: int,
    eps: float,
    scaling: float,
    feature_layers: list[int],
) -> tuple[Tensor, Tensor | None]:
    """:func:`decoder_layers` for the rows of several sequences at once: x [N, hidden] holds sequence s's
    ``counts[s]`` rows (positions ``starts[s]``..) after those of the sequences before it; each writes and attends
    over its own cache ``caches[s]`` = (keys, values) with its own hidden mask (None: every row sees every key).
    The products run once over all N rows, so the weights are read once for every sequence; each row is bitwise
    what a one-token step of its own sequence computes. Returns x [N, hidden] and the features [N, F] (or None).
    """
    empty = torch.empty(0, dtype=torch.bool, device=x.device)
    out, features = kernel().decoder_layers_batch(
        x.contiguous(),
        weights,
        cos.contiguous(),
        sin_signed.contiguous(),
        [k for k, _ in caches],
        [v for _, v in caches],
        list(starts),
        list(counts),
        [h.contiguous() if h is not None else empty for h in hiddens],
        heads,
        kv_heads,
        intermediate,
        eps,
        scaling,
        list(feature_layers),
        [0] * len(counts),
    )
    return out, features if feature_layers else None


def drafter_step_batch(
    features: list[Tensor],
    step_weights: tuple,
    write_rows: list[int],
    feature_positions: list[int],
    embed: Tensor,
    mask_row: Tensor,
    anchors: list[int],
    block_counts: list[int],
    block_positions: list[int],
    tail_gaps: list[int],
    rotary: tuple[Tensor, Tensor],
    weights: list[Tensor],
    caches: list[tuple[Tensor, Tensor]],
    starts: list[int],
    context_starts: list[int],
    heads: int,
    kv_heads: int,
    intermediate: int,
    eps: float,
    scaling: float,
) -> Tensor:
    """A DFlash drafter's inference step for several sequences in one call (``csrc/row_layers.h``): sequence s's
    new target-feature rows ``features[s]`` [n_s, F] (n_s may be 0) enter its context cache (fc product, hidden
    norm, every layer's context K/V product, k norms, rotary: rows ``write_rows[s]``.., positions
    ``feature_positions[s]``..); its block (the anchor's embedding row, ``anchors[s]`` < 0: the mask row, then mask
    rows; ``block_counts[s]`` rows at positions ``block_positions[s]``.., the last one ``tail_gaps[s]`` further) runs
    through every layer over its cache
    (``weights``: 8 per layer, as :func:`decoder_layers`; the block's keys and values written as scratch from
    ``starts[s]``, attending to rows ``context_starts[s]``..). ``step_weights`` = (fc packed, hidden norm weight,
    its eps, context K/V packed, final norm weight, its eps); ``rotary`` = (cos, signed sin) tables [P, head_dim]
    (row p: position p). Returns the final-normed rows after each block's first, [sum(block_counts) - S, hidden]."""
    fc, hidden_norm, hidden_eps, context_kv, final_norm, final_eps = step_weights
    return kernel().drafter_step_batch(
        features,
        fc,
        hidden_norm,
        hidden_eps,
        context_kv,
        list(write_rows),
        list(feature_positions),
        embed,
        mask_row,
        list(anchors),
        list(block_counts),
        list(block_positions),
        list(tail_gaps),
        rotary[0],
        rotary[1],
        weights,
        final_norm,
        final_eps,
        [k for k, _ in caches],
        [v for _, v in caches],
        list(starts),
        list(context_starts),
        heads,
        kv_heads,
        intermediate,
        eps,
        scaling,
    )


def cached_product(owner: object, tensors: tuple[Tensor, ...], build: Callable[[], RowKernelProduct]) -> Any:
    """``owner``'s product of ``tensors``, built by ``build`` on first use and again only when one of them changes
    (its storage or, outside inference mode, its version): what a weight-only layer's forward calls each time."""
    key = tuple((t.data_ptr(), -1 if t.is_inference() else t._version) for t in tensors)
    cached = owner.__dict__.get("_cached_product")
    if cached is None or cached[0] != key:
        cached = (key, build())
        owner.__dict__["_cached_product"] = cached
    return cached[1]


class RowKernelProduct:
    """What :class:`Matmul` and :class:`Int8Matmul` share: the weight packed for :mod:`dflashkit.kernels.row_kernels`'s
    kernel
    (``small``, None where it does not run), the most rows that kernel takes (read once, when packed) and the bias
    in fp32. Products of up to that many bf16 rows run on it; the others on ``_fallback``."""

    __slots__ = ("bias", "bias32", "out_features", "small", "small_rows")

    def _rows_kernel(self, small: Tensor | None, rows: int | None = None) -> None:
        self.small = small
        self.small_rows = (rows if rows is not None else max_rows()) if small is not None else 0
        self.bias32 = self.bias.float().contiguous() if small is not None and self.bias is not None else None

    def __call__(self, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
        if self.small is not None and x.dtype == torch.bfloat16 and rows_of(x) <= self.small_rows:
            return linear(x, self.small, self.out_features, self.bias32)
        return self._fallback(x)

    def _fallback(self, x: Tensor) -> Tensor:
        raise NotImplementedError
