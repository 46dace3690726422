"""Native CPU kernels (``_kernels.c``), compiled on first use and loaded with ctypes.

The block codecs spend their time in element-wise passes; torch runs each operation of the
quantizer as its own pass over memory (divide, clamp, compare x7, pack...), where one C loop does
it in one. On a CPU tensor these kernels give the same bytes and values as the torch code
(``tests/test_native.py``); GPU tensors, stochastic rounding and fp8 encoding stay in torch.

Building: the first process that needs them runs the C compiler (``$CC``, else ``cc``, ``gcc``
or ``clang``; ``-O3 -march=native``, never fast-math) on ``_kernels.c`` into
``$ODS_CACHE_DIR`` (default ``~/.cache/opendiloco-stream``), under a name that hashes the source,
the flags, the compiler and this CPU's feature flags, so a cache shared between different
machines never loads code built for another CPU. The write is atomic (a temporary file renamed),
so concurrent first uses are safe. Without a compiler, or with ``ODS_NATIVE=0``, everything runs
in torch as before (``native.available()`` is False and ``native.why_not()`` says why).

What runs here: the 4-bit and int8 encoders (``blockwise.quantize``), the 4- and 8-bit decoders
(``blockwise.dequantize``), the sparse codecs' top-k selection (``sparse.quantize``), the
reducer's weighted mean (``transport/reduce.py``). ``empty_huge`` (the fresh tensors a round
decodes into, backed by huge pages) needs no compiler. ctypes releases the GIL during a call, so
the averaging service's codec threads run these kernels in parallel with each other and the trainer.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Iterator, Optional

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_kernels.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared"]

_why_not: Optional[str] = None
_I64 = ctypes.c_int64
_SIGNATURES = {
    "ods_block_absmax": (ctypes.c_int, [ctypes.c_void_p, _I64, _I64, ctypes.c_void_p]),
    "ods_quantize4": (None, [ctypes.c_void_p, _I64, _I64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
                             ctypes.c_void_p]),
    "ods_quantize_int8": (None, [ctypes.c_void_p, _I64, _I64, ctypes.c_void_p, ctypes.c_void_p]),
    "ods_dequantize4": (None, [ctypes.c_void_p, _I64, _I64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]),
    "ods_dequantize8": (ctypes.c_int, [ctypes.c_void_p, _I64, _I64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                       ctypes.c_int, ctypes.c_void_p]),
    "ods_topk_indices": (None, [ctypes.c_void_p, _I64, _I64, _I64, ctypes.c_void_p]),
    "ods_weighted_mean": (None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, _I64, ctypes.c_float,
                                 ctypes.c_void_p]),
}


def cache_dir() -> Path:
    return Path(os.environ.get("ODS_CACHE_DIR") or Path.home() / ".cache" / "opendiloco-stream")


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    """This CPU's feature flags (Linux), part of the build's name: -march=native code is per CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _build(cc: str) -> Path:
    source = SOURCE.read_bytes()
    # the compiler is named by its path, size and mtime: no process to start when the build exists
    stat = os.stat(cc)
    compiler = f"{os.path.realpath(cc)} {stat.st_size} {stat.st_mtime_ns}"
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), compiler.encode(),
                                     platform.machine().encode(), _cpu_flags().encode()])).hexdigest()[:20]
    target = cache_dir() / f"kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".kernels-", suffix=".so")
    os.close(fd)
    try:
        for flags in (FLAGS, [f for f in FLAGS if f != "-march=native"]):  # some compilers lack -march=native
            done = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                                  timeout=120)
            if done.returncode == 0:
                break
        else:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep the other users of a shared cache out
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_lock = threading.Lock()
_off = False  # inside ``disabled()``


def _fresh_lock_in_child() -> None:
    # a fork while another thread held the lock would leave it held forever in the child (e.g. a
    # DHT process forked by hivemind), and its first kernel call would hang: the child starts with a free one
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


def _library() -> Optional[ctypes.CDLL]:
    """The loaded kernels, built and loaded once per process (thread-safe); None while ``disabled``."""
    with _lock:
        return None if _off else _load()


@functools.lru_cache(maxsize=None)
def _load() -> Optional[ctypes.CDLL]:
    global _why_not
    _why_not = None
    if os.environ.get("ODS_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        _why_not = "disabled by ODS_NATIVE=0"
        return None
    cc = _compiler()
    if cc is None:
        _why_not = "no C compiler found ($CC, cc, gcc, clang)"
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _why_not = f"could not build or load {SOURCE.name}: {e}"
        logger.warning("native codec kernels unavailable, using torch: %s", _why_not)
        return None
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block, this process runs the torch code instead of the kernels (benchmarks and
    tests compare the two). Not for use while other threads encode."""
    global _off
    with _lock:
        before, _off = _off, True
    try:
        yield
    finally:
        with _lock:
            _off = before


def available() -> bool:
    """Whether the kernels are built and loaded (builds them on the first call)."""
    return _library() is not None


def why_not() -> Optional[str]:
    """Why ``available()`` is False (None while it is True)."""
    if _off:
        return "disabled in this block (native.disabled())"
    _library()
    return _why_not


def usable(*tensors: torch.Tensor) -> bool:
    """The kernels apply: loaded, and every tensor a contiguous CPU tensor."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and available()


# ---------------------------------------------------------------------------------------- kernels
# Callers check ``usable`` and dtypes: fp32 values, uint8 codes, fp32 steps.

def block_absmax(x: torch.Tensor, block: int) -> tuple[torch.Tensor, bool]:
    """(per-block max |x| as fp32, whether x is all finite)."""
    n_blocks = -(-x.numel() // block)
    amax = torch.empty(n_blocks, dtype=torch.float32)
    bad = _library().ods_block_absmax(x.data_ptr(), x.numel(), block, amax.data_ptr())
    return amax, not bad


def quantize4(x: torch.Tensor, block: int, step: torch.Tensor, mids: torch.Tensor, top: float) -> torch.Tensor:
    out = torch.empty((x.numel() + 1) // 2, dtype=torch.uint8)
    _library().ods_quantize4(x.data_ptr(), x.numel(), block, step.data_ptr(), mids.data_ptr(), top, out.data_ptr())
    return out


def quantize_int8(x: torch.Tensor, block: int, step: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.numel(), dtype=torch.uint8)
    _library().ods_quantize_int8(x.data_ptr(), x.numel(), block, step.data_ptr(), out.data_ptr())
    return out


def dequantize(codes: torch.Tensor, numel: int, block: int, step: torch.Tensor, lut: torch.Tensor,
               out: torch.Tensor, forbidden: tuple[int, int] = (0, 1)) -> bool:
    """Decode 4-bit (``lut`` of 16) or 8-bit (``lut`` of 256) codes into ``out`` (fp32, numel).
    Returns False if an 8-bit code ``c`` with ``c & mask == value`` (``forbidden = (mask, value)``)
    occurs: bytes no encoder writes."""
    four = lut.numel() == 16
    # the C loop trusts these sizes: check them here (the codes come off the network)
    if (codes.dtype != torch.uint8 or codes.numel() < ((numel + 1) // 2 if four else numel)
            or step.dtype != torch.float32 or step.numel() < -(-numel // block) or out.dtype != torch.float32
            or out.numel() < numel or not step.is_contiguous() or lut.dtype != torch.float32):
        raise ValueError(f"native decode: {codes.numel()} code bytes, {step.numel()} steps and {out.numel()} "
                         f"outputs do not fit {numel} values in blocks of {block}")
    if four:
        _library().ods_dequantize4(codes.data_ptr(), numel, block, step.data_ptr(), lut.data_ptr(), out.data_ptr())
        return True
    mask, value = forbidden
    return not _library().ods_dequantize8(codes.data_ptr(), numel, block, step.data_ptr(), lut.data_ptr(), mask, value,
                                          out.data_ptr())


def weighted_mean(values: list[torch.Tensor], weights: list[float], total: float) -> torch.Tensor:
    """``reduce.weighted_mean`` in one pass (same rounding: fp32 weights and total, separate
    products and sums). ``values``: contiguous fp32 CPU tensors of one size."""
    n = values[0].numel()
    if any(v.numel() != n or v.dtype != torch.float32 for v in values) or len(weights) != len(values):
        raise ValueError("native weighted_mean: tensors of different sizes or dtypes")
    out = torch.empty(n, dtype=torch.float32)
    pointers = (ctypes.c_void_p * len(values))(*(v.data_ptr() for v in values))
    factors = (ctypes.c_float * len(weights))(*weights)
    _library().ods_weighted_mean(pointers, factors, len(values), n, total, out.data_ptr())
    return out


def topk_indices(x: torch.Tensor, block: int, k: int) -> torch.Tensor:
    """Per chunk of ``block`` values of flat fp32 ``x`` (finite), the ascending in-chunk indices of
    its ``k`` largest magnitudes, ties to the lower index: an int64 tensor (chunks, k), a short last
    chunk padded as ``sparse.quantize`` pads it (indices 0..k-1)."""
    if not 1 <= k <= block <= 4096 or x.dtype != torch.float32:
        raise ValueError(f"native top-k: k={k}, block={block}, dtype {x.dtype}")
    out = torch.empty(-(-x.numel() // block), k, dtype=torch.int64)
    _library().ods_topk_indices(x.data_ptr(), x.numel(), block, k, out.data_ptr())
    return out


# ---------------------------------------------------------------------------------------- host memory
_HUGE = 2 << 20  # x86-64 / arm64 transparent huge page
_MADV_HUGEPAGE = 14


@functools.lru_cache(maxsize=None)
def _libc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def touched_huge(numel: int) -> torch.Tensor:
    """``empty_huge(numel)`` with every page already faulted in (zeroed): a caller that has idle time
    before it writes the tensor (a round's matchmaking) pays the page faults there. A fresh 40 MB
    tensor's first write took 5-50 ms of faults here, more than decoding into it."""
    out = empty_huge(numel)
    out.zero_()
    return out


def empty_huge(numel: int) -> torch.Tensor:
    """``torch.empty(numel)`` (fp32, CPU) in memory asked to be backed by transparent huge pages
    (``madvise``, Linux): a fresh 40 MB tensor otherwise costs 10k page faults when first written,
    more than the writing itself (10M fp32: 10 ms -> 4 ms here). Elsewhere, or small: plain empty."""
    out = torch.empty(int(numel), dtype=torch.float32)
    libc, nbytes = _libc(), out.numel() * 4
    if libc is None or nbytes < 4 * _HUGE:
        return out
    start = (out.data_ptr() + _HUGE - 1) & ~(_HUGE - 1)
    end = (out.data_ptr() + nbytes) & ~(_HUGE - 1)
    if end > start:
        libc.madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: a refusal changes nothing
    return out
