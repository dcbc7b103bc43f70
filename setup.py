"""Builds the C++ cores of infinity: ``infinity._aio``, ``infinity._cpu_adam`` and
``infinity._quant`` (ZeRO++ blockwise quantization).

No torch headers anywhere: the extensions take raw pointers, byte counts and
file offsets. The io_uring engine is compiled only where liburing's headers
are present; otherwise the POSIX engine alone is built and we say so loudly.

Per-file ISA flags: a source named ``*_avx2.cpp`` is compiled with AVX2+FMA
flags, ``*_avx512.cpp`` with AVX-512 flags; everything else is compiled for the
baseline ISA so that run-time dispatch (CPUID) is safe on any x86-64 CPU.

Set ``INFINITY_BUILD_ONLY=_aio`` (or ``_cpu_adam``, ``_quant``) to build one extension.
"""
import glob
import os
import shutil
import subprocess
import sys
import tempfile

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
ISA_FLAGS = {
    "_avx2.cpp": ["-mavx2", "-mfma", "-mf16c"],
    "_avx512.cpp": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
}
COMMON = ["-O3", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"]


def _rel(pattern):
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern)))


def have_liburing():
    """True when <liburing.h> can be compiled and -luring linked."""
    if os.environ.get("INFINITY_NO_URING"):
        print("infinity: INFINITY_NO_URING set: building the POSIX I/O engine only", file=sys.stderr)
        return False
    cc = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.cpp")
        with open(src, "w") as f:
            f.write("#include <liburing.h>\nint main(){struct io_uring r; (void)r; return io_uring_queue_init(1,&r,0) ? 0 : 0;}\n")
        try:
            r = subprocess.run([cc, src, "-o", os.path.join(d, "t"), "-luring"],
                               capture_output=True, text=True)
        except OSError as e:
            print(f"infinity: cannot run the C++ compiler {cc!r} to probe liburing: {e}", file=sys.stderr)
            return False
    if r.returncode != 0:
        print("=" * 78, file=sys.stderr)
        print("infinity: liburing headers/library NOT found: building the POSIX I/O engine only.", file=sys.stderr)
        print("infinity: install them with `apt-get install liburing-dev` and rebuild to get io_uring.", file=sys.stderr)
        print("=" * 78, file=sys.stderr)
        return False
    return True


class BuildExt(build_ext):
    def run(self):
        only = os.environ.get("INFINITY_BUILD_ONLY")
        if only:
            skipped = [e.name for e in self.extensions if not e.name.endswith(only)]
            if skipped:
                print(f"infinity: INFINITY_BUILD_ONLY={only}: skipping {', '.join(skipped)}", file=sys.stderr)
            self.extensions = [e for e in self.extensions if e.name.endswith(only)]
        super().run()

    def build_extension(self, ext):
        compiler = self.compiler
        orig = compiler._compile

        def _compile(obj, src, ext_, cc_args, extra_postargs, pp_opts):
            extra = list(extra_postargs)
            for suffix, flags in ISA_FLAGS.items():
                if src.endswith(suffix):
                    extra += flags
            return orig(obj, src, ext_, cc_args, extra, pp_opts)

        compiler._compile = _compile
        try:
            super().build_extension(ext)
        finally:
            compiler._compile = orig


def extensions():
    aio_sources = _rel("csrc/aio/*.cpp")
    aio_macros, aio_libs = [], []
    if have_liburing():
        aio_macros.append(("INFINITY_HAVE_LIBURING", "1"))
        aio_libs.append("uring")
    exts = []
    if aio_sources:
        exts.append(Pybind11Extension(
            "infinity._aio", aio_sources,
            depends=_rel("csrc/aio/*.h"),
            define_macros=aio_macros, libraries=aio_libs,
            extra_compile_args=COMMON + ["-pthread"], extra_link_args=["-pthread"],
            cxx_std=17))
    adam_sources = _rel("csrc/cpu_adam/*.cpp")
    if adam_sources:
        exts.append(Pybind11Extension(
            "infinity._cpu_adam", adam_sources,
            depends=_rel("csrc/cpu_adam/*.h"),
            extra_compile_args=COMMON + ["-pthread"], extra_link_args=["-pthread"],
            cxx_std=17))
    quant_sources = _rel("csrc/quant/*.cpp")
    if quant_sources:
        exts.append(Pybind11Extension(
            "infinity._quant", quant_sources,
            extra_compile_args=COMMON, cxx_std=17))
    return exts


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
