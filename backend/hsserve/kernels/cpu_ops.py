"""The CPU's compiled kernels (kernels/cpu/*.cpp) for the float32 path: paged decode attention
straight from the cache blocks (no gather, no mask), rotary + the cache writes in one pass, add +
RMSNorm, SiLU-and-mul, and the linears' product on weights packed for it (gemm.cpp). Their torch
references (paged_attention_ref, apply_rotary + write_kv, add_rmsnorm_ref, silu_mul_ref, F.linear)
stay the oracle and the path where the library cannot be built.

The library is plain C++ (no torch headers: it builds in about a second) compiled with g++ for
this machine (-march=native) into the cache dir, keyed by the source, the compiler flags and the
CPU's flags, and called through ctypes with the tensors' pointers. It links the same OpenMP
runtime torch has loaded (libgomp.so.1), so both share one pool of threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import torch

log = logging.getLogger(__name__)

_DIR = os.path.join(os.path.dirname(__file__), "cpu")
SOURCES = [os.path.join(_DIR, name) for name in ("attention.cpp", "elementwise.cpp", "gemm.cpp")]
HEADERS = [os.path.join(_DIR, "common.h")]
PANEL = 48  # NOTE: gemm.cpp's NR: a packed weight's panel width
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "hs_decode_attention": [_P, _L, _P, _L, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _I, _F, _I],
    "hs_rotary_store": [_P, _I, _I, _I, _I, _P, _P, _P, _L, _P, _I],
    "hs_silu_mul": [_P, _P, _I, _I, _I],
    "hs_mask_logits": [_P, _P, _P, _I, _I, _I, _I],
    "hs_add_rmsnorm": [_P, _P, _P, _P, _P, _I, _I, _F, _I],
    "hs_gemm_pack": [_P, _P, _I, _I, _I],
    "hs_gemm": [_P, _L, _P, _P, _P, _L, _I, _I, _I, _I],
}


def _cpu_key() -> str:
    """The CPU's feature flags (a library built for one CPU may not run on another)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return ""


def library_path(cache_dir: str = "", extra_flags: tuple[str, ...] = ()) -> str:
    from hsserve.models.default_model import default_cache_dir

    key = hashlib.sha256(" ".join(FLAGS + list(extra_flags)).encode() + _cpu_key().encode())
    for source in SOURCES + HEADERS:
        with open(source, "rb") as f:
            key.update(f.read())
    return os.path.join(cache_dir or default_cache_dir(), "cpu_ops",
                        f"ops-{key.hexdigest()[:16]}.so")


def build(cache_dir: str = "", extra_flags: tuple[str, ...] = ()) -> str:
    """Compile the library once (an atomic rename: concurrent builders do not collide).
    extra_flags: e.g. -mno-avx512f, the narrower vector paths (tests)."""
    path = library_path(cache_dir, extra_flags)
    if os.path.exists(path):
        return path
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++): apt-get install g++")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        subprocess.run([cxx, *FLAGS, *extra_flags, "-o", tmp, *SOURCES], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, path)
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"building {SOURCES} failed: {e.stderr[-2000:]}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def library() -> ctypes.CDLL | None:
    """The loaded library, built on first use; None (logged once) where it cannot be built or
    HSSERVE_CPU_KERNELS=0: the torch path then runs."""
    global _lib, _tried
    if _tried:  # NOTE: the hot path (every layer's call), without the lock
        return _lib
    with _lock:
        if not _tried and os.environ.get("HSSERVE_CPU_KERNELS", "1") != "0":
            try:
                _lib = load(build())
            except (OSError, RuntimeError) as e:
                log.warning("CPU kernels unavailable, using the torch path: %s", e)
        _tried = True  # NOTE: last: a reader without the lock sees the final _lib
        return _lib


def load(path: str) -> ctypes.CDLL:
    """A built library, its functions typed."""
    lib = ctypes.CDLL(path)
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = None
    return lib


def supports(dtype: torch.dtype, num_heads: int, head_dim: int) -> bool:
    """The kernels' shapes: float32, <= 64 query heads, head_dim even and <= 256."""
    return (dtype == torch.float32 and num_heads <= 64 and head_dim <= 256
            and head_dim % 2 == 0 and library() is not None)


def _threads() -> int:
    return torch.get_num_threads()


def decode_attention(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                     scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """q [B, H, D] (heads contiguous), one layer's kv [2, blocks, BS, KVH, D], tables [B, n]
    int32, lens [B] int32 -> [B, H, D]: each row attends to its keys 0..len-1 (the last
    `window` of them where the layer slides)."""
    b, h, d = q.shape
    _, _, bs, kvh, _ = kv.shape
    assert q.stride(2) == 1 and q.stride(1) == d and kv.is_contiguous()
    assert tables.dtype == torch.int32 and lens.dtype == torch.int32 and tables.is_contiguous()
    out = torch.empty(b, h, d, dtype=q.dtype)
    library().hs_decode_attention(
        q.data_ptr(), q.stride(0), kv.data_ptr(), kv[0].numel(), tables.data_ptr(),
        tables.shape[1], lens.data_ptr(), out.data_ptr(), b, h, kvh, d, bs, scale, window or 0,
        softcap or 0.0, _threads())
    return out


def rotary_store_(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor,
                  sin: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
    """qkv [T, H + 2 KVH, D] contiguous: q and k rotated in place (cos / sin [T, D], the
    rotate-half layout of models/rope.py), k and v written into kv at slots (int64)."""
    t, _, d = qkv.shape
    assert qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    assert slots.dtype == torch.int64 and kv.is_contiguous()
    library().hs_rotary_store(qkv.data_ptr(), t, num_heads, num_kv_heads, d, cos.data_ptr(),
                              sin.data_ptr(), kv.data_ptr(), kv[0].numel(), slots.data_ptr(),
                              _threads())


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, N] (+ residual [T, N]), contiguous -> (RMSNorm of the sum, the sum), as
    elementwise.add_rmsnorm_ref."""
    t, n = x.shape
    assert x.is_contiguous() and weight.is_contiguous()
    assert residual is None or residual.is_contiguous()
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else x
    library().hs_add_rmsnorm(x.data_ptr(), residual.data_ptr() if residual is not None else None,
                             weight.data_ptr(), out.data_ptr(), total.data_ptr(), t, n, eps,
                             _threads())
    return out, total


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2N] contiguous -> silu(gate) * up [T, N]."""
    t, two_n = gate_up.shape
    assert gate_up.is_contiguous()
    out = torch.empty(t, two_n // 2, dtype=gate_up.dtype)
    library().hs_silu_mul(gate_up.data_ptr(), out.data_ptr(), t, two_n // 2, _threads())
    return out


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [R, V] float32 with the tokens int32 bitmask [R, W] forbids at -inf (a new
    tensor; kernels/bitmask.py's bitmask_ref is the reference)."""
    r, v = logits.shape
    assert logits.is_contiguous() and bitmask.is_contiguous() and bitmask.shape[1] * 32 >= v
    out = torch.empty_like(logits)
    library().hs_mask_logits(logits.data_ptr(), bitmask.data_ptr(), out.data_ptr(), r, v,
                             bitmask.shape[1], _threads())
    return out


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] float32 -> gemm's packed copy (panels of PANEL columns, zero-padded)."""
    n, k = w.shape
    w = w.contiguous()
    packed = torch.empty(-(-n // PANEL) * k * PANEL, dtype=torch.float32)
    library().hs_gemm_pack(w.data_ptr(), packed.data_ptr(), n, k, _threads())
    return packed


def gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 -> x W^T (+ bias) [..., n], W packed by pack_weight."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        library().hs_gemm(x2.data_ptr(), x2.stride(0), packed.data_ptr(),
                          bias.data_ptr() if bias is not None else None, y.data_ptr(), n, m, n, k,
                          _threads())
    return y.view(*x.shape[:-1], n)
