"""Builds r3's extension (r3._r3) and the `r3` command with CMake + Ninja, then lets setuptools
package them with python/r3/*.py. pyproject.toml holds the metadata.

Environment:
  R3_CMAKE_BUILD_DIR  reuse an existing CMake build folder (e.g. build) instead of a fresh one
  R3_NATIVE=1         compile the non-kernel code for the build machine's CPU too (default for a
                      fresh build: off, so the package runs on any x86-64; the kernels are built
                      for every instruction set and chosen at run time either way); a reused
                      build folder keeps its own setting unless R3_NATIVE is given
  R3_JOBS             parallel build jobs (default 2)
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build = Path(os.environ.get("R3_CMAKE_BUILD_DIR") or (Path(self.build_temp).resolve() / "cmake"))
        if not build.is_absolute():
            build = ROOT / build
        args = ["cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                # The interpreter a venv was made from: the venv may be gone by the next build.
                f"-DPYTHON_EXECUTABLE={getattr(sys, '_base_executable', sys.executable)}"]
        native = os.environ.get("R3_NATIVE")
        if native is not None or not (build / "CMakeCache.txt").exists():
            args.append(f"-DR3_NATIVE={'ON' if native not in (None, '0') else 'OFF'}")
        subprocess.check_call(args)
        subprocess.check_call(["cmake", "--build", str(build), "-j", os.environ.get("R3_JOBS", "2"),
                               "--target", "r3_py", "r3", "r3_py_package"])
        built = next((build / "python" / "r3").glob("_r3*.so"))
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, target)
        # The `r3` command ships inside the package; r3.cli runs it.
        bin_dir = target.parent / "bin"
        bin_dir.mkdir(exist_ok=True)
        shutil.copy2(build / "r3", bin_dir / "r3")


setup(ext_modules=[Extension("r3._r3", sources=[])], cmdclass={"build_ext": CMakeBuild})
