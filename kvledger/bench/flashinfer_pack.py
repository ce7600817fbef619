"""Repack FlashInfer's paged decode for the GPU machine: `python -m kvledger.bench.flashinfer_pack`.

FlashInfer (`flashinfer-python` 0.7.2.post1, a benchmark-only peer of kvledger's decode kernels)
is a 62 MB wheel that unpacks to 426 MB, most of it CUDA sources for other kernels, and it
JIT-compiles each kernel with nvcc at first use (minutes per module). The GPU machine can reach no
package index and takes 64 MiB per call, so this script, run on a development box that has CUDA's
compiler (no GPU needed):

1. unpacks the wheel's `flashinfer/` package;
2. compiles the paged-decode modules of `BatchDecodeWithPagedKVCacheWrapper`'s CUDA-core kernel
   that the side by side uses (bf16 query and output; bf16 or FP8 e4m3 KV; head dim 128) through
   FlashInfer's own JIT specs, for sm_90a, and installs each as an AOT module
   (`flashinfer/data/aot/<name>/<name>.so`, the place FlashInfer loads prebuilt modules from before
   it would compile);
3. writes `flashinfer.tar.xz`: the Python package, the AOT modules, and the headers and top-level
   sources a JIT build of the decode and FA2 modules needs, without the rest of `data/` (CUTLASS
   and the other kernels' sources, 300 MB). The FA2 tensor-core modules (`use_tensor_cores=True`,
   the path vLLM's FlashInfer backend decodes with) build from these on the device, in under 30 s
   each on its 16 cores with MAX_JOBS=16;
4. copies the `apache-tvm-ffi` wheel given (FlashInfer's binding layer, a compiled library:
   the device's Python is 3.12, so its cp312 manylinux wheel) and, if given, compresses
   FlashAttention-3's library for the `fa3` comparison.

The build runs FlashInfer under this box's Python in a subprocess whose PYTHONPATH is the
unpacked package plus `--build-path` (this Python's `apache-tvm-ffi` of the same version and
`nvidia-ml-py`, which FlashInfer imports; e.g. `pip install --no-deps --target DIR`). FlashInfer
links its modules with `-lcuda`; on a box without NVIDIA's driver `--stub-libcuda` links against
an empty library with libcuda.so.1's soname, so the module resolves the driver on the device,
where it is loaded. Nothing here is imported by kvledger's engine or tests.
"""

from __future__ import annotations

import argparse
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

# what a JIT build of the decode and FA2 modules includes from the wheel's data/ (checked against
# the dependency files nvcc wrote for the decode modules); the rest of data/ is left behind
JIT_DATA = ("include", "spdlog", "cccl/cub", "cccl/thrust", "cccl/libcudacxx/include")
HEAD_DIM = 128


def build_specs() -> None:
    """In the build subprocess: compile the side by side's decode modules with FlashInfer's JIT
    specs and print each module's name and library path."""
    import torch
    from flashinfer.jit.attention.modules import gen_batch_decode_module

    specs = [
        gen_batch_decode_module(torch.bfloat16, kv, torch.bfloat16, torch.int32, HEAD_DIM, HEAD_DIM, 0, False, False)
        for kv in (torch.bfloat16, torch.float8_e4m3fn)
    ]
    for spec in specs:
        spec.build(verbose=False)
        print(f"BUILT {spec.name} {spec.jit_library_path}", flush=True)


def stub_cuda_home(staging: Path) -> Path:
    """A CUDA_HOME whose bin/include/lib64 are this box's toolkit and whose lib64/stubs holds an
    empty libcuda.so (soname libcuda.so.1): enough to link, resolved against the driver on load."""
    real = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")).resolve()
    home = staging / "cuda-home"
    (home / "lib64" / "stubs").mkdir(parents=True, exist_ok=True)
    for name in ("bin", "include", "nvvm"):
        if not (home / name).exists() and (real / name).exists():
            (home / name).symlink_to(real / name)
    for lib in (real / "lib64").glob("libcudart.so*"):
        if not (home / "lib64" / lib.name).exists():
            (home / "lib64" / lib.name).symlink_to(lib)
    empty = staging / "empty.c"
    empty.write_text("")
    subprocess.run(
        ["cc", "-shared", "-o", str(home / "lib64/stubs/libcuda.so"), "-Wl,-soname,libcuda.so.1", str(empty)],
        check=True,
    )
    return home


def build_modules(package_root: Path, staging: Path, workspace: Path, build_path: str, stub: bool) -> list[Path]:
    """Compile the modules in a subprocess (FlashInfer's JIT cache under `workspace`: a rerun
    rebuilds nothing); install each as an AOT module of the unpacked package."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(package_root), build_path])
    env["FLASHINFER_CUDA_ARCH_LIST"] = "9.0a"
    env["FLASHINFER_WORKSPACE_BASE"] = str(workspace)
    env.setdefault("MAX_JOBS", "1")
    if stub:
        env["CUDA_HOME"] = str(stub_cuda_home(staging))
    cmd = [sys.executable, "-m", "kvledger.bench.flashinfer_pack", "--build-only"]
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    installed = []
    for line in done.stdout.splitlines():
        if line.startswith("BUILT "):
            name, path = line.split()[1:3]
            target = package_root / "flashinfer" / "data" / "aot" / name / f"{name}.so"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
            installed.append(target)
    return installed


def keep(package_root: Path, member: Path) -> bool:
    """Whether a file of the unpacked package goes into the archive."""
    rel = member.relative_to(package_root / "flashinfer")
    if rel.parts[0] != "data":
        return True
    data = rel.relative_to("data")
    if data.parts[0] == "aot":
        return True
    if data.parts[0] == "csrc":
        return len(data.parts) == 2  # the top-level sources and templates, not the other kernels' folders
    return any(data.as_posix().startswith(prefix + "/") for prefix in JIT_DATA)


def write_archive(package_root: Path, out: Path) -> Path:
    archive = out / "flashinfer.tar.xz"
    with tarfile.open(archive, "w:xz", preset=6) as tar:
        for member in sorted((package_root / "flashinfer").rglob("*")):
            if member.is_file() and "__pycache__" not in member.parts and keep(package_root, member):
                tar.add(member, arcname=member.relative_to(package_root).as_posix())
    return archive


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvledger.bench.flashinfer_pack", description=__doc__.splitlines()[0])
    p.add_argument("--wheel", help="flashinfer_python-0.7.2.post1-py3-none-any.whl")
    p.add_argument("--tvm-ffi-wheel", help="the device's apache_tvm_ffi wheel (cp312, manylinux x86_64)")
    p.add_argument("--fa3-library", default=None, help="a vLLM wheel's _vllm_fa3_C.abi3.so, compressed alongside")
    p.add_argument("--out", default=".device/peers", help="where the archives go (an ignored folder)")
    p.add_argument("--staging", default="/tmp/flashinfer-pack", help="where the wheel is unpacked and built")
    p.add_argument("--workspace", default=None, help="FlashInfer's JIT cache (default: STAGING/workspace)")
    p.add_argument("--build-path", default="", help="PYTHONPATH entries for the build: tvm_ffi, pynvml")
    p.add_argument("--stub-libcuda", action="store_true", help="link against an empty libcuda.so (no driver here)")
    p.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.build_only:
        build_specs()
        return 0
    if not args.wheel or not args.tvm_ffi_wheel:
        p.error("--wheel and --tvm-ffi-wheel are required")
    staging, out = Path(args.staging).resolve(), Path(args.out).resolve()
    package_root = staging / "package"
    if not (package_root / "flashinfer").exists():
        with zipfile.ZipFile(args.wheel) as wheel:
            wheel.extractall(package_root, [n for n in wheel.namelist() if n.startswith("flashinfer/")])
    workspace = Path(args.workspace).resolve() if args.workspace else staging / "workspace"
    modules = build_modules(package_root, staging, workspace, args.build_path, args.stub_libcuda)
    out.mkdir(parents=True, exist_ok=True)
    written = [write_archive(package_root, out), Path(shutil.copy2(args.tvm_ffi_wheel, out))]
    if args.fa3_library:
        written.append(out / "fa3.so.xz")
        with open(args.fa3_library, "rb") as src, lzma.open(written[-1], "wb", preset=2) as dst:
            shutil.copyfileobj(src, dst, 1 << 24)
    for path in modules:
        print(f"AOT module {path.parent.name}")
    for path in written:
        print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
