"""The int4 kernels' library and its interface: where it is, its functions' types, and
the check at load that it was built from the header (``int4_kernel.h``) this module
mirrors: its constants and omni_layer's layout, asked of the library itself. A library
that disagrees raises ``KernelAbiError`` instead of corrupting memory.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# int4_kernel.h's OMNI_* constants and omni_layer (checked against the library at load).
ABI_VERSION = 2
GROUP = 32  # weights per scale along the input dimension
BLOCK = 16  # output columns the kernel computes together (one AVX512 register)
MAX_HD = 128  # the attention's largest head dimension
MAX_GROUP = 8  # the attention's most query heads per KV head
MAX_TOPK = 1024


class KernelAbiError(RuntimeError):
    """The library disagrees with this module about its interface."""


@dataclass(frozen=True)
class Variant:
    """One ISA's build of the kernels in the library: ``number`` is int4_kernel.h's, its
    functions are named ``prefix`` + what they do; ``fused``: it has the whole decode
    step in one call (every variant has its parts)."""

    name: str  # as the ``int4_kernel`` engine arg names it
    number: int
    prefix: str
    fused: bool

    @property
    def label(self) -> str:
        """What a replica reports it runs on, e.g. "int4-avx512vnni"."""
        return "int4-" + self.name.replace("-", "")


# Best first: ``load`` takes the first the CPU can run.
VARIANTS = (
    Variant("avx512-vnni", 0, "omni_avx512_", fused=True),
    Variant("avx2", 1, "omni_avx2_", fused=False),
)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_LAYERS = (_P, _P, _I, _I, _P, _P, _P, *(_I,) * 6, _F, _P, _P, _I)
_MATMUL = (_P, _P, _I, _I, _P, _P, _P, _I, _P, _I, _I, _I)
_ATTENTION = (_P, _P, _I, _I, _I, _I, _P, _P, _P, _P, _I, _P)
_RMS_NORM = (_P, _I, _I, _P, _F, _P)
_SILU_MUL = (_P, _I, _I, _P)
_TOPK = (_P, _I, _I, _I, _P)
_Q8_DOTS = (_P, _P, _I, _P, _P, _I, _I, _P)
# int4_kernel.h's functions: (result, arguments), pointers as void * (a test reads the
# header and checks each against this).
SIGNATURES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "omni_abi": (ctypes.c_long, (_I,)),
    "omni_cpu_lacks": (_I, (_I, ctypes.c_char_p, _I)),
    "omni_ctx_new": (_P, ()),
    "omni_ctx_free": (None, (_P,)),
    "omni_avx512_matmul": (_I, _MATMUL),
    "omni_avx512_rms_norm": (None, _RMS_NORM),
    "omni_avx512_silu_mul": (None, _SILU_MUL),
    "omni_avx512_topk": (_I, _TOPK),
    "omni_avx512_q8_dots": (None, _Q8_DOTS),
    "omni_avx512_decode_attention": (_I, _ATTENTION),
    "omni_avx512_decode_layers": (_I, _LAYERS),
    "omni_avx512_prefill_layers": (_I, _LAYERS),
    "omni_avx2_matmul": (_I, _MATMUL),
    "omni_avx2_rms_norm": (None, _RMS_NORM),
    "omni_avx2_silu_mul": (None, _SILU_MUL),
    "omni_avx2_topk": (_I, _TOPK),
    "omni_avx2_q8_dots": (None, _Q8_DOTS),
    "omni_avx2_decode_attention": (_I, _ATTENTION),
    "omni_avx2_prefill_attention": (_I, _ATTENTION),
}


class OmniLayer(ctypes.Structure):
    """int4_kernel.h's omni_layer."""

    _fields_ = [
        ("attn_norm", ctypes.c_void_p),
        ("mlp_norm", ctypes.c_void_p),
        ("w", ctypes.c_void_p * 4),
        ("scale", ctypes.c_void_p * 4),
        ("lo", ctypes.c_void_p * 4),
    ]


# omni_abi's questions (int4_kernel.h's OMNI_ABI_*_Q) and this module's answers.
ABI_ANSWERS = {
    "OMNI_ABI_VERSION": (0, ABI_VERSION),
    "OMNI_GROUP": (1, GROUP),
    "OMNI_BLOCK": (2, BLOCK),
    "OMNI_MAX_HD": (3, MAX_HD),
    "OMNI_MAX_GROUP": (4, MAX_GROUP),
    "OMNI_MAX_TOPK": (5, MAX_TOPK),
    "sizeof(omni_layer)": (6, ctypes.sizeof(OmniLayer)),
    **{
        f"offsetof(omni_layer, {name})": (7 + i, getattr(OmniLayer, name).offset)
        for i, name in enumerate(("attn_norm", "mlp_norm", "w", "scale", "lo"))
    },
}

_HERE = Path(__file__).parent
_LIBRARY = "_int4_kernel"


def library_path() -> Path | None:
    """The built library beside this module (None: not built)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = _HERE / (_LIBRARY + suffix)
        if path.exists():
            return path
    return None


@functools.cache
def library() -> ctypes.CDLL | str:
    """The library, its functions typed, or why there is none; ``KernelAbiError`` for
    one that disagrees with this module."""
    path = library_path()
    if path is None:
        machine = platform.machine()
        if machine.lower() not in ("x86_64", "amd64"):
            return f"the kernels are written for x86-64 CPUs, not {machine}"
        return (
            f"{_LIBRARY} is not built in {_HERE} (installing the package "
            "builds it where a C compiler is found: pip install -e .)"
        )
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return f"{path.name} does not load: {exc}"
    for name, (result, arguments) in SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise KernelAbiError(_rebuild(path, f"it has no {name}")) from None
        fn.restype, fn.argtypes = result, list(arguments)
    check_abi(lib, path)
    return lib


def check_abi(lib: Any, path: Path) -> None:
    """Raise ``KernelAbiError`` where the library's constants or omni_layer differ from
    this module's."""
    wrong = [
        f"{name} {lib.omni_abi(question)} (here {ours})"
        for name, (question, ours) in ABI_ANSWERS.items()
        if lib.omni_abi(question) != ours
    ]
    if wrong:
        raise KernelAbiError(_rebuild(path, ", ".join(wrong)))


def _rebuild(path: Path, what: str) -> str:
    return (
        f"{path} was built from other sources than this omnistage ({what}): "
        "rebuild it (pip install -e .)"
    )


def cpu_lacks(variant: Variant) -> str:
    """The CPU features the variant needs and this CPU lacks, comma-separated ("" for
    none), as the library's CPU feature detection says."""
    lib = library()
    if isinstance(lib, str):
        return ""
    out = ctypes.create_string_buffer(256)
    lib.omni_cpu_lacks(variant.number, out, len(out))
    return out.value.decode()
