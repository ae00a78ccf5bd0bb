"""The build of omnistage's one compiled part: the thinker's int4 kernels.

Everything else is in pyproject.toml. The kernels (omnistage/engines/llm/int4_kernel*.c,
interface in int4_kernel.h) become one shared library beside int4_kernel.py, loaded
through ctypes: each ISA variant's file compiled with its own -m flags, the file that
picks between them at run time with none. ``pip install -e .`` builds it in place.

Optional: without a C compiler, or on a CPU architecture the kernels are not written
for, the install goes on without it (the build says why) and the thinker runs on torch's
int4 kernel, as its start-up then warns.
"""

from __future__ import annotations

import platform
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

KERNEL = "omnistage.engines.llm._int4_kernel"
_DIR = "omnistage/engines/llm"
_COMMON = ["-O3", "-fPIC", "-pthread", "-fvisibility=hidden"]
# Each source's own flags: the variants may use their instructions anywhere in their
# file, as they are only called where the CPU has them (omni_cpu_lacks).
_FLAGS = {
    f"{_DIR}/int4_kernel_team.c": [],
    f"{_DIR}/int4_kernel_avx512.c": [
        *("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"),
        *("-mf16c", "-mfma"),
    ],
    f"{_DIR}/int4_kernel_avx2.c": ["-mavx2", "-mfma", "-mf16c"],
}


class BuildKernel(build_ext):
    """build_ext with a compile per source, each with its own flags (an Extension gives
    all its sources the same ones)."""

    def build_extension(self, ext: Extension) -> None:
        if ext.name != KERNEL:
            super().build_extension(ext)
            return
        objects = []
        for source in ext.sources:
            objects += self.compiler.compile(
                [source],
                output_dir=self.build_temp,
                extra_postargs=[*_COMMON, *_FLAGS[source]],
                depends=ext.depends,
            )
        self.compiler.link_shared_object(
            objects,
            self.get_ext_fullpath(ext.name),
            libraries=["m"],
            extra_postargs=["-pthread"],
            target_lang="c",
        )


def _kernels() -> list[Extension]:
    """The kernels where they are written for the CPU (x86-64) and the build has a Unix
    C compiler; none elsewhere."""
    if platform.machine().lower() not in ("x86_64", "amd64") or sys.platform == "win32":
        return []
    return [
        Extension(
            KERNEL,
            sources=list(_FLAGS),
            depends=[f"{_DIR}/int4_kernel{h}.h" for h in ("", "_team", "_scalar")],
            # A failed compile is a warning, not a failed install.
            optional=True,
        )
    ]


setup(ext_modules=_kernels(), cmdclass={"build_ext": BuildKernel})
