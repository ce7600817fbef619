"""FP8 decode attention below Triton: `cuda_fp8_decode.cu`, compiled at run time, launched by hand.

The kernel is CUDA C++ because what it needs is not expressible in Triton 3.6: every thread copies
its own K/V chunks into shared memory with `cp.async` several tiles ahead and consumes only them,
so the bytes in flight per multiprocessor are set by the pipeline's depth, not by the register
file (the Triton FP8 kernel's limit: docs/attention-kernels.md).

Compiling uses NVRTC, which every CUDA build of PyTorch ships (`nvidia-cuda-nvrtc`), found through
ctypes; loading and launching use the CUDA driver API the same way (`cuModuleLoadData`,
`cuLaunchKernel` on PyTorch's current stream, so a CUDA graph captures the launch). No
compiler toolchain, CUDA header or extra package is needed: the kernel includes no header. Where
NVRTC or the driver is missing, `available()` says why and the engine keeps the Triton kernel.

The split's partial outputs use the Triton kernels' layout (`DecodeWorkspace`), so the Triton
merge kernel merges them.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cuda_fp8_decode.cu")
KERNEL = b"fp8_decode_split"
MAX_GROUP = 4  # query heads per KV head the kernel keeps in registers (q and the output: 32 floats each)


@dataclass(frozen=True)
class CudaDecodeLaunch:
    """One compiled variant: warps per block, tokens per tile, tiles in flight (cp.async stages),
    and LOADS_ONLY (copy the rows, skip the arithmetic: the access pattern's own bandwidth)."""

    warps: int = 4
    tile: int = 64
    stages: int = 3
    loads_only: bool = False

    def label(self) -> str:
        extra = ", loads only" if self.loads_only else ""
        return f"CUDA {self.warps} warps, {self.tile}-token tiles, {self.stages} stages{extra}"

    def shared_bytes(self, head_dim: int, group: int) -> int:
        """Dynamic shared memory: the pipeline's buffers, or the final reduction if larger."""
        pipeline = self.stages * 2 * self.tile * head_dim
        reduction = self.warps * group * (head_dim + 2) * 4
        return max(pipeline, reduction)


# 95-97 us at 256 x 600 (results/gpu/round4/cuda-fp8-lab-landed.txt): 3 stages of 64-token tiles
# fit four blocks per multiprocessor; 4 stages, 32-token tiles, 2 or 8 warps were slower
DEFAULT_LAUNCH = CudaDecodeLaunch()


# --- NVRTC and the driver, through ctypes ------------------------------------------------------


def _library_candidates(stem: str) -> List[str]:
    """Where `stem` may be: the driver (libcuda) only through the loader; NVRTC (libnvrtc) in a
    CUDA build of PyTorch's own lib folder (possibly renamed `libnvrtc-<hash>`), the nvidia-*
    wheels beside it, CUDA_HOME, then the loader's search path."""
    loader = [f"{stem}.so.13", f"{stem}.so.12", f"{stem}.so.1", f"{stem}.so"]  # LD_LIBRARY_PATH, ld.so.cache
    if stem == "libcuda":
        return loader[2:]
    torch_dir = Path(torch.__file__).parent
    found = sorted(glob.glob(str(torch_dir / "lib" / f"{stem}.so*")))
    found += sorted(glob.glob(str(torch_dir / "lib" / f"{stem}-*.so*")))
    found += sorted(glob.glob(str(torch_dir.parent / "nvidia" / "*" / "lib" / f"{stem}.so*")))
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    found += sorted(glob.glob(os.path.join(cuda_home, "lib64", f"{stem}.so*")))
    return [f for f in found if "builtins" not in f and ".alt." not in f] + loader


def _load_library(stem: str) -> ctypes.CDLL:
    errors = []
    for candidate in _library_candidates(stem):
        try:
            return ctypes.CDLL(candidate)
        except OSError as e:
            errors.append(f"{candidate}: {e}")
    raise OSError(f"no {stem} could be loaded ({'; '.join(errors[-3:])})")


class _Nvrtc:
    def __init__(self) -> None:
        self.lib = _load_library("libnvrtc")
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"NVRTC {what}: {self.lib.nvrtcGetErrorString(status).decode()}")

    def compile(self, source: str, name: str, options: List[str]) -> bytes:
        """The CUBIN of `source` for the options' architecture (`--gpu-architecture=sm_XX`)."""
        prog = ctypes.c_void_p()
        self.check(
            self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
            "create program",
        )
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            if status != 0:
                size = ctypes.c_size_t()
                self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                buf = ctypes.create_string_buffer(size.value)
                self.lib.nvrtcGetProgramLog(prog, buf)
                raise RuntimeError(f"NVRTC could not compile {name}:\n{buf.value.decode(errors='replace')}")
            size = ctypes.c_size_t()
            self.check(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "CUBIN size")
            cubin = ctypes.create_string_buffer(size.value)
            self.check(self.lib.nvrtcGetCUBIN(prog, cubin), "CUBIN")
            return cubin.raw
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


class _Driver:
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8

    def __init__(self) -> None:
        self.lib = _load_library("libcuda")

    def check(self, status: int, what: str) -> None:
        if status != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(status, ctypes.byref(text))
            raise RuntimeError(f"CUDA driver {what}: {text.value.decode() if text.value else status}")

    def load(self, cubin: bytes, name: bytes, shared_bytes: int) -> ctypes.c_void_p:
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(function), module, name), "cuModuleGetFunction")
        self.check(
            self.lib.cuFuncSetAttribute(
                function, self.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(shared_bytes)
            ),
            "cuFuncSetAttribute",
        )
        return function

    def launch(self, function, grid: Tuple[int, int, int], block: int, shared: int, stream: int, args) -> None:
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        self.check(
            self.lib.cuLaunchKernel(function, *grid, block, 1, 1, shared, ctypes.c_void_p(stream), params, None),
            "cuLaunchKernel",
        )


@functools.lru_cache(maxsize=1)
def _toolchain() -> Tuple[_Nvrtc, _Driver]:
    return _Nvrtc(), _Driver()


def available(device: torch.device | str | None = None) -> Optional[str]:
    """None when the kernel can run on `device` (default: the current CUDA device); else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"e4m3 conversions need sm_89 or later (this device: sm_{major}{minor})"
    try:
        _toolchain()
    except OSError as e:
        return str(e)
    return None


# --- compiled variants, per device ---------------------------------------------------------------

_lock = threading.Lock()
_functions: Dict[Tuple[int, int, int, bool, CudaDecodeLaunch, bool], ctypes.c_void_p] = {}


def compile_options(
    head_dim: int, group: int, bf16: bool, launch: CudaDecodeLaunch, arch: str, seq_i64: bool = False
) -> List[str]:
    return [
        f"--gpu-architecture={arch}",
        "--std=c++17",
        "-default-device",
        f"-DHEAD_DIM={head_dim}",
        f"-DGROUP={group}",
        f"-DWARPS={launch.warps}",
        f"-DTILE={launch.tile}",
        f"-DSTAGES={launch.stages}",
        f"-DOUT_BF16={int(bf16)}",
        f"-DLOADS_ONLY={int(launch.loads_only)}",
        f"-DSEQ_T={'long long' if seq_i64 else 'int'}",
    ]


def _function(
    device: int, head_dim: int, group: int, bf16: bool, launch: CudaDecodeLaunch, seq_i64: bool
) -> ctypes.c_void_p:
    key = (device, head_dim, group, bf16, launch, seq_i64)
    with _lock:
        if key not in _functions:
            nvrtc, driver = _toolchain()
            major, minor = torch.cuda.get_device_capability(device)
            arch = f"sm_{major}{minor}" + ("a" if major == 9 else "")
            options = compile_options(head_dim, group, bf16, launch, arch, seq_i64)
            cubin = nvrtc.compile(SOURCE.read_text(), SOURCE.name, options)
            with torch.cuda.device(device):
                _functions[key] = driver.load(cubin, KERNEL, launch.shared_bytes(head_dim, group))
            log.info("compiled %s for %s (%s)", SOURCE.name, arch, " ".join(options[3:]))
        return _functions[key]


def supports(q: torch.Tensor, k_cache: torch.Tensor, token_dim: int) -> bool:
    """Whether the kernel handles the call: an e4m3 head-major pool, a bf16/fp16 CUDA query with
    head dim 64, 128 or 256, and at most MAX_GROUP query heads per KV head."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1 - token_dim]
    return (
        k_cache.dtype == torch.float8_e4m3fn
        and token_dim == 1
        and q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and head_dim in (64, 128, 256)
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUP
    )


def fp8_decode_split(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    out: torch.Tensor,
    num_splits: int,
    sm_scale: float,
    v_scale: float,
    order: torch.Tensor | None,
    launch: CudaDecodeLaunch = DEFAULT_LAUNCH,
    start: torch.Tensor | None = None,
    prefix_splits: int = 0,
) -> None:
    """Stage 1 of split decode over a head-major e4m3 pool (`supports`): with one slot the output
    itself, else each split's normalized partial and log-sum-exp in part_o/part_lse. With shared
    prefixes (`prefix_splits` > 0, cascade attention) a row's own keys start at start[b] (int32)
    and the prefix kernel fills the next `prefix_splits` slots."""
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    if not supports(q, k_cache, 1):
        raise ValueError(f"the CUDA decode kernel cannot take q {tuple(q.shape)} {q.dtype} over a {k_cache.dtype} pool")
    if q.stride(2) != 1 or q.data_ptr() % 16 or q.stride(1) % 8 or q.stride(0) % 8:
        q = q.contiguous()  # the kernel reads its query slice as 16-byte vectors
    if k_cache.stride(2) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("the FP8 CUDA decode kernel needs K and V pools of one contiguous-row layout")
    if table.dtype != torch.int32 or rows.dtype != torch.int64 or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError("table must be int32, rows int64, seq_lens int32 or int64")
    if order is not None and order.dtype != torch.int32:
        raise ValueError("order must be int32")
    if prefix_splits and (start is None or start.dtype != torch.int32):
        raise ValueError("shared prefixes need each row's int32 start")
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    function = _function(device, head_dim, group, q.dtype == torch.bfloat16, launch, seq_lens.dtype == torch.int64)
    i64, i32, f32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
    args = [
        ptr(q.data_ptr()),
        ptr(k_cache.data_ptr()),
        ptr(v_cache.data_ptr()),
        ptr(table.data_ptr()),
        ptr(rows.data_ptr()),
        ptr(seq_lens.data_ptr()),
        ptr(order.data_ptr() if order is not None else seq_lens.data_ptr()),
        ptr(start.data_ptr() if start is not None else seq_lens.data_ptr()),
        ptr(part_o.data_ptr()),
        ptr(part_lse.data_ptr()),
        ptr(out.data_ptr()),
        *(i64(s) for s in (q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(0), table.stride(0))),
        *(i64(s) for s in (part_o.stride(0), part_o.stride(1), part_o.stride(2))),
        *(i64(s) for s in (part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1))),
        f32(sm_scale),
        f32(v_scale),
        i32(num_splits),
        i32(order is not None),
        i32(prefix_splits),
    ]
    _, driver = _toolchain()
    stream = torch.cuda.current_stream(q.device).cuda_stream
    driver.launch(
        function, (kv_heads, batch, num_splits), launch.warps * 32, launch.shared_bytes(head_dim, group), stream, args
    )
