"""Compile the decode megakernel with NVRTC (through cuda.core) and keep the cubins on disk.

A cache entry is keyed by the hash of every kernel source file (the C++ files of the source folder
and its subfolders, all that the kernels may include), the target arch, the kernel's name expression
(which carries the model shape and the timing flag), the compiler options, cuda.core's version
(whose defaults fill in the rest of NVRTC's command line), the NVRTC version and the CUDA headers.
It holds the cubin and a small JSON record with the mangled symbol and the cubin's own hash, so
that a truncated or corrupt entry is detected and rebuilt rather than loaded. A cache folder that
cannot be written (a read-only, prebuilt one) still gives every kernel, compiled afresh.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import re
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import cuda.core
import cuda.pathfinder
from cuda.bindings import nvrtc
from cuda.core import ObjectCode, Program, ProgramOptions

from .shape import KernelShape

SOURCE_DIR = Path(__file__).resolve().parent
MAIN_SOURCE = "decode_step.cu"
BARRIER_PROBE_SOURCE = "barrier_probe.cu"
BARRIER_PROBE_NAME = "megakernel::barrier_probe"
CODE_PROBE_TEMPLATE = "megakernel::barrier_after_code<{steps}>"
STREAM_PROBE_NAME = "megakernel::stream_stages"
STREAM_RING_PROBE_TEMPLATE = "megakernel::stream_stages_ring<{slots}>"
SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".hpp", ".inc", ".inl")  # the files a kernel may include
CXX_STANDARD = "c++17"
# NVRTC's options but the target and the include path (which differ per build and per machine).
COMPILE_OPTIONS = {"std": CXX_STANDARD}
# The ELF64 header fields elf_section_size reads (the System V ABI's offsets).
ELF_MAGIC = b"\x7fELF"
ELF_CLASS_OFFSET, ELF_CLASS_64 = 4, 2
ELF64_SECTION_TABLE_OFFSET = 0x28  # e_shoff
ELF64_SECTION_ENTRY_SIZE_OFFSET = 0x3A  # e_shentsize, then e_shnum and e_shstrndx
CACHE_FORMAT = 2  # bump when the layout of an entry changes (2: cubins named by their content)
CUBIN_NAME_DIGITS = 16  # of a cubin's SHA-256 in its file name
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
PTXAS_SHARED = re.compile(r"(\d+) bytes smem")
PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


log = logging.getLogger(__name__)


class KernelBuildError(RuntimeError):
    """NVRTC refused the kernel source, or the target is not supported."""


@dataclass(frozen=True)
class CompiledKernel:
    """One kernel instantiation (decode_step for a shape, or barrier_probe), ready to load on `arch`."""

    cubin: bytes
    name_expression: str  # e.g. megakernel::decode_step<megakernel::ModelShape<...>, false>
    symbol: str  # its mangled name in the cubin
    arch: str
    from_cache: bool

    def object_code(self) -> ObjectCode:
        return ObjectCode.from_cubin(self.cubin, symbol_mapping={self.name_expression: self.symbol.encode()})

    @property
    def code_bytes(self) -> int:
        """The size of the kernel's machine code (its .text section in the cubin)."""
        return elf_section_size(self.cubin, f".text.{self.symbol}")


def elf_section_size(elf: bytes, name: str) -> int:
    """The size of section `name` of a little-endian ELF64 image (a cubin)."""
    if elf[: len(ELF_MAGIC)] != ELF_MAGIC or elf[ELF_CLASS_OFFSET] != ELF_CLASS_64:
        raise KernelBuildError("not an ELF64 image")
    (section_table,) = struct.unpack_from("<Q", elf, ELF64_SECTION_TABLE_OFFSET)
    entry_size, count, names_index = struct.unpack_from("<HHH", elf, ELF64_SECTION_ENTRY_SIZE_OFFSET)

    def header(index: int) -> tuple[int, int, int]:  # sh_name, sh_offset, sh_size
        name_offset, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", elf, section_table + index * entry_size)
        return name_offset, offset, size

    names = header(names_index)[1]
    for index in range(count):
        name_offset, _, size = header(index)
        end = elf.index(b"\0", names + name_offset)
        if elf[names + name_offset:end].decode() == name:
            return size
    raise KernelBuildError(f"the image has no section {name}")


def nvrtc_version() -> str:
    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise KernelBuildError(f"nvrtcVersion failed: {err}")
    return f"{major}.{minor}"


@functools.cache
def nvrtc_fingerprint() -> str:
    """NVRTC's version and the library files it runs from (path, size, modification time):
    nvrtcVersion gives major.minor only, and a patch release (13.0.48 -> 13.0.88, say) may compile
    the same source differently."""
    try:
        library = cuda.pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path  # what cuda.bindings loaded
    except cuda.pathfinder.DynamicLibNotFoundError:  # loaded from where the finder does not look
        library = None
    if library is None:  # the version is all there is to go by
        return nvrtc_version()
    files = sorted([Path(library), *Path(library).parent.glob("libnvrtc-builtins*")])
    return "\0".join([nvrtc_version(), *(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)])


def supported_archs() -> tuple[str, ...]:
    """The sm_XY targets this NVRTC can compile for (the 'a' variants exist for sm_90 and up)."""
    err, count = nvrtc.nvrtcGetNumSupportedArchs()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise KernelBuildError(f"nvrtcGetNumSupportedArchs failed: {err}")
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise KernelBuildError(f"nvrtcGetSupportedArchs failed: {err}")
    return tuple(f"sm_{arch}" for arch in archs[:count])


MIN_COMPUTE_CAPABILITY = (9, 0)  # the kernel uses Hopper's bulk async copies and arch-specific targets


def arch_for(compute_capability: tuple[int, int]) -> str:
    """The arch-specific target of a device: sm_90a on Hopper, sm_100a / sm_103a on Blackwell."""
    major, minor = compute_capability
    if (major, minor) < MIN_COMPUTE_CAPABILITY:
        raise KernelBuildError(f"the megakernel needs a Hopper or newer GPU (sm_90+); this one is sm_{major}{minor}")
    return f"sm_{major}{minor}a"


def source_files(source_dir: Path = SOURCE_DIR) -> dict[str, str]:
    """The kernel sources in `source_dir` (this package's own by default) and its subfolders, by
    path relative to it: every file a kernel may include."""
    return {
        path.relative_to(source_dir).as_posix(): path.read_text()
        for path in sorted(source_dir.rglob("*"))
        if path.suffix in SOURCE_SUFFIXES and path.is_file()
    }


@dataclass(frozen=True)
class ResourceUsage:
    """What ptxas reports for one kernel: registers per thread, stack frame, spills and static shared
    memory per CTA (bytes)."""

    registers: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int


def resource_usage(
    shape: KernelShape, arch: str, timing: bool = False, source_dir: Path = SOURCE_DIR
) -> ResourceUsage:
    """ptxas's resource report for decode_step of `shape` on `arch` (a compile of its own, with
    `-v`, not cached): spills or a register count at the launch bound show up here first."""
    program = Program(source_files(source_dir)[MAIN_SOURCE], code_type="c++",
                      options=_options(arch, source_dir, ptxas_verbose=True))
    log = io.StringIO()
    _compile(program, shape.kernel_name(timing), arch, logs=log)
    report = log.getvalue()
    registers, frame, shared = (pattern.search(report) for pattern in (PTXAS_REGISTERS, PTXAS_FRAME, PTXAS_SHARED))
    if registers is None or frame is None or shared is None:
        raise KernelBuildError(f"ptxas printed no resource usage for {shape.kernel_name(timing)}:\n{report}")
    stack, stores, loads = (int(group) for group in frame.groups())
    return ResourceUsage(int(registers.group(1)), stack, stores, loads, int(shared.group(1)))


# Per header library the kernels include from, the files that identify its version: the headers
# the sources include themselves and the library's version header. (cudart and cccl upgrade apart
# from NVRTC, and a cubin compiled against other headers must not be reused.)
VERSIONED_HEADERS = {
    "cudart": ("cuda_runtime_api.h", "cuda_bf16.h", "cuda_bf16.hpp"),
    "cccl": ("cuda/std/__cccl/version.h", "cuda/std/limits"),
}


@functools.cache
def _include_dirs() -> tuple[str, ...]:
    include_dirs = [cuda.pathfinder.find_nvidia_header_directory(lib) for lib in VERSIONED_HEADERS]
    missing = [lib for lib, path in zip(VERSIONED_HEADERS, include_dirs, strict=True) if path is None]
    if missing:
        raise KernelBuildError(f"CUDA headers not found for {missing}: install cuda-toolkit[cudart,cccl]")
    return tuple(include_dirs)


@functools.cache
def headers_fingerprint() -> str:
    """A digest of where the CUDA headers are and of their versioned files (VERSIONED_HEADERS)."""
    digest = hashlib.sha256()
    for directory, files in zip(_include_dirs(), VERSIONED_HEADERS.values(), strict=True):
        digest.update(directory.encode() + b"\0")
        for name in files:
            path = Path(directory) / name
            digest.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"(none)") + b"\0")
    return digest.hexdigest()


def _options(arch: str, source_dir: Path, ptxas_verbose: bool = False) -> ProgramOptions:
    return ProgramOptions(arch=arch, include_path=[str(source_dir), *_include_dirs()],
                          ptxas_options=["-v"] if ptxas_verbose else None, **COMPILE_OPTIONS)


def cache_key(sources: dict[str, str], arch: str, name_expression: str) -> str:
    digest = hashlib.sha256()
    for name, text in sorted(sources.items()):
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    options = json.dumps(COMPILE_OPTIONS, sort_keys=True)
    for part in (arch, name_expression, options, cuda.core.__version__, nvrtc_fingerprint(), headers_fingerprint(),
                 str(CACHE_FORMAT)):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()


class KernelCache:
    """Compiled kernels (the decode step per shape, the barrier probe) in `directory` (created on first
    use), built from the sources in `source_dir`: this package's own, or another copy of them (an
    edited variant that `megaserve bench --kernel-sources` times beside it). Entries are keyed by
    the sources' hash, so variants can share a directory."""

    def __init__(self, directory: str | Path, source_dir: str | Path = SOURCE_DIR) -> None:
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise KernelBuildError(f"the kernel cache {self.directory} is not a folder")
        self.source_dir = Path(source_dir).resolve()
        missing = [name for name in (MAIN_SOURCE, BARRIER_PROBE_SOURCE) if not (self.source_dir / name).is_file()]
        if missing:
            raise KernelBuildError(
                f"{self.source_dir} is not a folder of kernel sources: it has no {', '.join(missing)}"
            )

    def decode_step(self, shape: KernelShape, arch: str, timing: bool = False) -> CompiledKernel:
        """The cubin of decode_step for `shape` on `arch`, from the cache or freshly compiled."""
        return self._kernel(MAIN_SOURCE, shape.kernel_name(timing), arch)

    def barrier_probe(self, arch: str) -> CompiledKernel:
        """The cubin of barrier_probe (the grid barrier alone) on `arch`."""
        return self._kernel(BARRIER_PROBE_SOURCE, BARRIER_PROBE_NAME, arch)

    def code_probe(self, arch: str, steps: int) -> CompiledKernel:
        """The cubin of barrier_after_code<steps> (a grid barrier, then `steps` steps of straight-line
        code) on `arch`."""
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        return self._kernel(BARRIER_PROBE_SOURCE, CODE_PROBE_TEMPLATE.format(steps=steps), arch)

    def stream_probe(self, arch: str) -> CompiledKernel:
        """The cubin of stream_stages (the step's bytes streamed in stages, with grid barriers, group
        counts or cluster barriers between them) on `arch`."""
        return self._kernel(BARRIER_PROBE_SOURCE, STREAM_PROBE_NAME, arch)

    def stream_ring_probe(self, arch: str, slots: int) -> CompiledKernel:
        """The cubin of stream_stages_ring<slots> (the same stages, loaded by a loader warp into a ring
        of `slots` slots of shared memory, off the grid barriers) on `arch`."""
        if slots < 2:
            raise ValueError(f"the ring needs at least 2 slots, got {slots}")
        return self._kernel(BARRIER_PROBE_SOURCE, STREAM_RING_PROBE_TEMPLATE.format(slots=slots), arch)

    def _kernel(self, source_name: str, name_expression: str, arch: str) -> CompiledKernel:
        if arch not in supported_archs() and arch.rstrip("a") not in supported_archs():
            raise KernelBuildError(
                f"NVRTC {nvrtc_version()} cannot compile for {arch}; it supports {supported_archs()}"
            )
        sources = source_files(self.source_dir)
        key = cache_key(sources, arch, name_expression)
        cached = self._read(key, name_expression, arch)
        if cached is not None:
            return cached
        compiled = compile_source(sources[source_name], arch, name_expression, self.source_dir)
        try:
            self._write(key, compiled)
        except OSError as error:  # a read-only (prebuilt, shared) cache: compiled again next time
            log.warning("kernel cache %s: cannot store %s (%s); using it uncached", self.directory,
                        name_expression, error)
        return compiled

    def _record_path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def _cubin_path(self, key: str, sha256: str) -> Path:
        """A cubin is named by its content: NVRTC's output differs from run to run (an embedded
        module id), so two processes that compile one key at once write two different files, and
        whichever record lands last names a cubin that is there."""
        return self.directory / f"{key}.{sha256[:CUBIN_NAME_DIGITS]}.cubin"

    def _read(self, key: str, name_expression: str, arch: str) -> CompiledKernel | None:
        try:
            record = json.loads(self._record_path(key).read_text())
        except (OSError, ValueError):
            return None
        digest = record.get("sha256") if isinstance(record, dict) else None
        if not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest):
            return None  # corrupt or foreign record: rebuild over it
        try:
            cubin = self._cubin_path(key, digest).read_bytes()
        except OSError:
            return None
        if (
            digest != hashlib.sha256(cubin).hexdigest()
            or record.get("name_expression") != name_expression
            or not isinstance(record.get("symbol"), str)
        ):
            return None  # corrupt or foreign entry: rebuild over it
        return CompiledKernel(cubin, name_expression, record["symbol"], arch, from_cache=True)

    def _write(self, key: str, compiled: CompiledKernel) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        record = {
            "name_expression": compiled.name_expression,
            "symbol": compiled.symbol,
            "arch": compiled.arch,
            "sha256": hashlib.sha256(compiled.cubin).hexdigest(),
        }
        # The cubin goes first and the record last, each by an atomic rename: a reader never sees
        # a record whose cubin is incomplete, and the record's rename is the one commit point.
        _write_atomic(self._cubin_path(key, record["sha256"]), compiled.cubin)
        _write_atomic(self._record_path(key), json.dumps(record).encode())


def _compile(program: Program, name_expression: str, arch: str, **options) -> ObjectCode:
    """`program`'s cubin with `name_expression` instantiated; NVRTC's refusal as KernelBuildError."""
    try:
        return program.compile("cubin", name_expressions=(name_expression,), **options)
    except Exception as error:  # cuda.core raises its NVRTCError with the compiler log
        raise KernelBuildError(f"NVRTC failed to compile {name_expression} for {arch}:\n{error}") from error
    finally:
        program.close()


def compile_source(source: str, arch: str, name_expression: str, source_dir: Path = SOURCE_DIR) -> CompiledKernel:
    """Run NVRTC on `source` for `arch` and instantiate `name_expression`; its includes come from
    `source_dir`."""
    object_code = _compile(Program(source, code_type="c++", options=_options(arch, source_dir)), name_expression, arch)
    symbol = object_code.symbol_mapping[name_expression]
    return CompiledKernel(
        cubin=bytes(object_code.code),
        name_expression=name_expression,
        symbol=symbol.decode() if isinstance(symbol, bytes) else symbol,
        arch=arch,
        from_cache=False,
    )


CACHE_FILE_MODE = 0o644  # readable by every user of a shared or prebuilt cache (mkstemp makes 0600)


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.chmod(tmp, CACHE_FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
