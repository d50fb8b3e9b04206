"""Compiling :class:`~kda_backend.kernels.skinny_gemm.SkinnyGemm` once per key and launching it through TVM-FFI.

Kernels are compiled against fake tensors with a symbolic token count M (one binary serves every M up to the
tactic's grid) and the TVM-FFI calling convention, which takes torch tensors directly and launches on torch's
current stream, so a call costs microseconds and works inside CUDA-graph capture. Compiling inside a capture is
refused: :meth:`CompiledGemms.get` must have run for the key beforehand (``KDAProjection.prepare``).

Compiled kernels are cached in memory and, in a folder the caller passes (the provider's: ``<cache dir>/kernels``),
on disk as ``<code version>/kda_gemm_<fingerprint>.o``, exported object files that load in milliseconds instead of
compiling in seconds. The code version (:data:`CODE_VERSION`) and the fingerprint cover the kernel source and the
toolchain versions as this process imported them, the fingerprint the key too, so a changed kernel or toolchain
never loads a stale binary, and a process serving on while the package is upgraded under it never stores its
binaries under the new code's name. The files are shared by every TP rank and user of the machine
(:mod:`kda_backend.cache_files`); a folder this process may not read or write costs a compile. The first use of a
folder in a process marks its code version used and removes the versions no process marked for 30 days
(:func:`~kda_backend.cache_files.remove_unused_versions`).

On a machine without a GPU, ``CUTE_DSL_ARCH`` (``sm_90a``, ``sm_100a``) selects the target, so CI compiles each
kernel for the architectures it serves (the mma.sync kernels for both, the wgmma ones for SM 9.x).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from kda_backend.cache_files import mark_used, publish, remove_stale_temps, remove_unused_versions
from kda_backend.kernels import (
    arrival_counters,
    cluster_smem,
    l2_cache_policy,
    side_chain_gemm,
    skinny_gemm,
    wgmma_gemm,
    wgmma_stage,
)
from kda_backend.kernels.arrival_counters import CHAIN_COUNTERS
from kda_backend.kernels.side_chain_gemm import SideChainGemm, StageGemm
from kda_backend.kernels.skinny_gemm import NO_LINK, Link, SkinnyGemm, Tactic
from kda_backend.kernels.wgmma_gemm import WgmmaGemm, WgmmaTactic
from kda_backend.log import warn_once


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """What makes two compiled binaries different."""

    tactic: Tactic | WgmmaTactic
    n: int
    k: int
    x_row_stride: int
    w_row_stride: int
    arch: str
    link: Link = NO_LINK


@dataclasses.dataclass(frozen=True)
class SideChainKey:
    """What makes two compiled one-launch side chains (:class:`~kda_backend.kernels.side_chain_gemm.SideChainGemm`)
    different: F_A/beta's key (its ``n``, ``k`` and row strides) and F_B's tactic, rows, ``D`` and weight row
    stride."""

    fab: KernelKey
    fb: Tactic
    fb_n: int
    d: int
    w_fb_row_stride: int


@dataclasses.dataclass(frozen=True)
class StageKey:
    """What makes two compiled one-launch stages (:class:`~kda_backend.kernels.side_chain_gemm.StageGemm`)
    different: the side chain's key and QKVG's tactic, rows and weight row stride."""

    side_chain: SideChainKey
    qkvg: Tactic
    qkvg_n: int
    w_qkvg_row_stride: int


@dataclasses.dataclass(frozen=True)
class FusedStageKey:
    """What makes two compiled fused stages (:class:`~kda_backend.kernels.wgmma_stage.WgmmaStage`) different: QKVG's
    tactic, the three GEMMs' rows, the hidden size, F_B's K and the SMs the launch divides (all contiguous)."""

    qkvg: WgmmaTactic
    qkvg_n: int
    fab_n: int
    fb_n: int
    k: int
    d: int
    sms: int
    arch: str


def kernel_key(
    tactic: Tactic | WgmmaTactic,
    n: int,
    k: int,
    x_row_stride: int,
    w_row_stride: int,
    device: torch.device,
    link: Link = NO_LINK,
) -> KernelKey:
    """The key of the kernel computing ``x[M, K] @ w[N, K].T`` with these row strides on ``device``."""
    return KernelKey(tactic, n, k, x_row_stride, w_row_stride, target_arch(device), link)


def target_arch(device: torch.device | None = None) -> str:
    """``sm_XYa`` of ``device`` (or of ``CUTE_DSL_ARCH`` when set, e.g. for CPU-only compile checks)."""
    forced = os.environ.get("CUTE_DSL_ARCH")
    if forced:
        return forced
    if device is None or device.type != "cuda":
        raise ValueError("no CUDA device to compile for; set CUTE_DSL_ARCH (sm_90a, sm_100a) to cross-compile")
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}a"


# Percent of each SM's unified L1/shared storage the kernels ask to be shared memory. Left to itself the driver
# sizes the split for the launching kernel's own occupancy (3 x 64 KB QKVG CTAs -> 196 KB), and an SM split that
# way has no room for the side chain's CTAs, so the overlapped stage serializes (measured on H200: 31.9 us instead
# of 23.2 us at M = 1). Weights bypass L1 (cp.async.cg), so the smaller L1 costs the kernels nothing measurable.
SMEM_CARVEOUT_PERCENT = 100
_compile_lock = threading.Lock()


@contextlib.contextmanager
def _launches_prefer_max_smem():
    """While compiling, add the preferred-carveout attribute to every launch the DSL emits.

    The DSL's ``launch(preferred_smem_carveout=...)`` reaches only its own module loader, not TVM-FFI functions,
    but its CUDA dialect has the launch attribute; each launch config gets it just before the launch op. Yields a
    one-element list counting the launches tagged.
    """
    import cutlass
    from cutlass._mlir.dialects import cuda as cuda_dialect

    original = cuda_dialect.launch_ex
    count = [0]

    def launch_ex(callee, launch_cfg, inputs, **kwargs):
        loc, ip = kwargs.get("loc"), kwargs.get("ip")
        percent = cutlass.Int32(SMEM_CARVEOUT_PERCENT).ir_value(loc=loc, ip=ip)
        cuda_dialect.launch_cfg_shared_mem_carveout(launch_cfg, percent, loc=loc, ip=ip)
        count[0] += 1
        return original(callee, launch_cfg, inputs, **kwargs)

    with _compile_lock:
        cuda_dialect.launch_ex = launch_ex
        try:
            yield count
        finally:
            cuda_dialect.launch_ex = original


def compile_gemm(key: KernelKey) -> Any:
    """Compile one kernel for ``key.arch`` and return the TVM-FFI callable
    ``f(x, w, out, work, arrivals, chain, expected)`` (see :meth:`SkinnyGemm.__call__`): ``x [M, K]``,
    ``w [N, K]``, ``out [M, N]`` as torch holds them; each optional operand a tensor (or int) where the key's tactic
    and link use it, else ``None``."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    if isinstance(key, (SideChainKey, StageKey)):
        return _compile_side_chain(key)
    if isinstance(key, FusedStageKey):
        stage = wgmma_stage.WgmmaStage(key.qkvg, key.qkvg_n, key.fab_n, key.fb_n, key.k, key.d, key.sms)
        return wgmma_stage.compile_stage(stage, key.arch)
    kernel_class = WgmmaGemm if isinstance(key.tactic, WgmmaTactic) else SkinnyGemm
    gemm = kernel_class(key.tactic, key.n, key.k, key.x_row_stride, key.w_row_stride, key.link)
    m = cute.sym_int32(symbol="M")
    x = make_fake_tensor(cutlass.BFloat16, (m, key.k), (key.x_row_stride, 1), assumed_align=16)
    w = make_fake_tensor(cutlass.BFloat16, (key.n, key.k), (key.w_row_stride, 1), assumed_align=16)
    out = make_fake_tensor(cutlass.BFloat16, (m, key.n), (key.n, 1), assumed_align=16)
    tactic, link = key.tactic, key.link
    work = arrivals = chain = expected = None
    if tactic.uses_workspace:
        shape = tactic.workspace_shape(m, key.n)  # [split_k, M, N]
        stride = (cute.sym_int64(), shape[2], 1)
        work = make_fake_tensor(cutlass.Float32, shape, stride, assumed_align=16)
        arrivals = make_fake_tensor(cutlass.Int32, (cute.sym_int32(symbol="tiles"),), (1,), assumed_align=4)
    if link.signals or link.waits:
        chain = make_fake_tensor(cutlass.Int32, (CHAIN_COUNTERS,), (1,), assumed_align=4)
    if link.waits:
        expected = cutlass.Int32(0)
    return _compile_tagged(gemm, (x, w, out, work, arrivals, chain, expected), key.arch)


def _compile_tagged(gemm: Any, operands: tuple, arch: str) -> Any:
    """``gemm`` compiled for ``arch`` over ``operands`` and torch's current stream, its launch tagged with the
    shared-memory carveout (one warning if the DSL emitted no launch, or more than one, to tag)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    with _launches_prefer_max_smem() as launches:
        kernel = cute.compile(gemm, *operands, stream, options=f"--enable-tvm-ffi --gpu-arch {arch}")
    if launches[0] != 1:
        warn_once("carveout", f"expected one kernel launch to tag with the shared-memory carveout, saw {launches[0]}; "
                  "without it the overlapped stage may serialize (measured on H200: 31.9 instead of 23.2 us at M = 1)")
    return kernel


def _compile_side_chain(key: SideChainKey | StageKey) -> Any:
    """The TVM-FFI callable ``f(x, w_fab, fab, w_fb, g1, work, arrivals, chain)`` of one side chain launch (see
    :meth:`~kda_backend.kernels.side_chain_gemm.SideChainGemm.__call__`), or for a :class:`StageKey`
    ``f(x, w_qkvg, qkvg, w_fab, fab, w_fb, g1, work, arrivals, chain)`` of the whole stage (see
    :meth:`~kda_backend.kernels.side_chain_gemm.StageGemm.__call__`)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    chain_key = key.side_chain if isinstance(key, StageKey) else key
    fab = chain_key.fab
    chain_args = (chain_key.fb, fab.n, fab.k, fab.x_row_stride, fab.w_row_stride, chain_key.fb_n, chain_key.d,
                  chain_key.w_fb_row_stride)
    m = cute.sym_int32(symbol="M")

    def bf16(shape, stride):
        return make_fake_tensor(cutlass.BFloat16, shape, stride, assumed_align=16)

    work = arrivals = None
    if fab.tactic.uses_workspace:
        work = make_fake_tensor(cutlass.Float32, (fab.tactic.split_k, m, fab.n), (cute.sym_int64(), fab.n, 1),
                                assumed_align=16)
        arrivals = make_fake_tensor(cutlass.Int32, (cute.sym_int32(symbol="tiles"),), (1,), assumed_align=4)
    chain = make_fake_tensor(cutlass.Int32, (CHAIN_COUNTERS,), (1,), assumed_align=4)
    x = bf16((m, fab.k), (fab.x_row_stride, 1))
    side_chain = (bf16((fab.n, fab.k), (fab.w_row_stride, 1)), bf16((m, fab.n), (fab.n, 1)),
                  bf16((chain_key.fb_n, chain_key.d), (chain_key.w_fb_row_stride, 1)),
                  bf16((m, chain_key.fb_n), (chain_key.fb_n, 1)), work, arrivals, chain)
    if isinstance(key, StageKey):
        gemm = StageGemm(key.qkvg, key.qkvg_n, key.w_qkvg_row_stride, fab.tactic, *chain_args)
        qkvg = (bf16((key.qkvg_n, fab.k), (key.w_qkvg_row_stride, 1)), bf16((m, key.qkvg_n), (key.qkvg_n, 1)))
        return _compile_tagged(gemm, (x, *qkvg, *side_chain), fab.arch)
    return _compile_tagged(SideChainGemm(fab.tactic, *chain_args), (x, *side_chain), fab.arch)


TOOLCHAIN_PACKAGES = ("nvidia-cutlass-dsl", "apache-tvm-ffi")
# Every file whose code or constants are traced into a compiled kernel, and this one (how it compiles).
KERNEL_SOURCES = (skinny_gemm.__file__, wgmma_gemm.__file__, side_chain_gemm.__file__, wgmma_stage.__file__,
                  l2_cache_policy.__file__, cluster_smem.__file__, arrival_counters.__file__, __file__)


def _code_digest() -> bytes:
    """The kernel and compile sources and the toolchain versions, read once, at import: a process that goes on
    serving while the package is upgraded under it compiles the code it imported, and must name its binaries so."""
    digest = hashlib.sha256()
    for source in KERNEL_SOURCES:
        digest.update(Path(source).read_bytes())
    for package in TOOLCHAIN_PACKAGES:
        try:
            digest.update(f"{package}=={importlib.metadata.version(package)}".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"{package} (no metadata)".encode())
    return digest.digest()


CODE_DIGEST = _code_digest()
CODE_VERSION = CODE_DIGEST.hex()[:16]
"""The folder of this code's object files inside a kernel folder."""
_VERSION_NAME = "[0-9a-f]{16}"
_OBJECT_FILES = ("kda_gemm_*.o", ".tmp-*.o")  # what a version folder holds: exports and their temp files


def fingerprint(key: KernelKey) -> str:
    """Name of ``key``'s binary on disk: a hash of the code this process imported (:data:`CODE_DIGEST`) and the
    key."""
    return hashlib.sha256(CODE_DIGEST + repr(key).encode()).hexdigest()[:32]


def load_exported(path: Path, symbol: str) -> Any:
    """The TVM-FFI function ``symbol`` of an exported object file."""
    import cutlass.cute as cute

    return cute.runtime.load_module(str(path), enable_tvm_ffi=True)[symbol]


def export(kernel: Any, path: Path, symbol: str) -> None:
    """Write ``kernel`` as an object file at ``path`` atomically (concurrent ranks may export the same key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path.parent, ".tmp-*.o")  # of exports killed midway
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".o")  # the DSL picks the format by suffix
    os.close(fd)
    try:
        kernel.export_to_c(tmp, function_name=symbol)
        publish(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class CompiledGemms:
    """Process-wide cache of compiled kernels: memory, then the object files in a folder, then the compiler."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kernels: dict[KernelKey, Any] = {}
        self._compiled: dict[KernelKey, Any] = {}  # the compiler's objects (what exports), for kernels compiled here
        self._stored: set[tuple[KernelKey, Path]] = set()
        self._claimed: set[Path] = set()  # folders whose code version this process marked used

    def get(self, key: KernelKey, folder: Path | None = None) -> Any:
        """``key``'s kernel, ``f(x, w, out, work, arrivals, chain, expected)`` (see :func:`compile_gemm`): from
        memory, else loaded from ``folder``, else compiled (never inside a CUDA-graph capture). With ``folder`` a
        kernel compiled in this process is stored there as an object file (``None``: memory only)."""
        with self._lock:
            kernel = self._kernels.get(key)
            if kernel is not None and (folder is None or (key, folder) in self._stored):
                return kernel
            claim = folder is not None and folder not in self._claimed
            if claim:
                self._claimed.add(folder)
        if claim:
            mark_used(folder / CODE_VERSION)
            remove_unused_versions(folder, CODE_VERSION, _VERSION_NAME, _OBJECT_FILES)
        if kernel is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"kernel {key} was not compiled before CUDA-graph capture; call prepare() first")
            kernel = self._load_or_compile(key, folder)
        elif key in self._compiled:  # compiled before without a folder
            self._store(key, folder, replace=False)
        with self._lock:
            if folder is not None:
                self._stored.add((key, folder))
            return self._kernels.setdefault(key, kernel)

    def _load_or_compile(self, key: KernelKey, folder: Path | None) -> Any:
        if folder is not None:
            path = _object_file(key, folder)
            try:
                if path.exists():  # raises where the folder cannot be searched
                    return load_exported(path, path.stem)
            except Exception as exc:  # a truncated or foreign file, a folder we may not read: compile instead
                warn_once(f"kernel-load:{path}", f"ignoring unreadable compiled kernel {path}: {exc}")
        compiled = compile_gemm(key)
        with self._lock:
            self._compiled.setdefault(key, compiled)
        if folder is not None:
            self._store(key, folder, replace=True)
        # The TVM-FFI function itself takes positional arguments, as one loaded from disk does; the compiled object's
        # own call passes them through a Python keyword-argument wrapper first. Without an execution engine (a
        # kernel for another architecture than this machine's) there is none, and the object's call says why.
        function = compiled.__tvm_ffi_object__()
        return compiled if function is None else function

    def _store(self, key: KernelKey, folder: Path, replace: bool) -> None:
        path = _object_file(key, folder)
        try:
            if path.exists() and not replace:
                return
            export(self._compiled[key], path, path.stem)
        except Exception as exc:  # a read-only cache only costs the next process a compile
            warn_once(f"kernel-export:{folder}", f"cannot write compiled kernels to {folder}: {exc}")


def _object_file(key: KernelKey, folder: Path) -> Path:
    return folder / CODE_VERSION / f"kda_gemm_{fingerprint(key)}.o"


compiled_gemms = CompiledGemms()
