"""Builds rd2h's native module with CMake and installs the `rd2h` Python package.

    pip install --no-build-isolation .            # or --target DIR

The native part is the project's own CMake build (a static librd2h linked into the module),
in build/python under this directory unless RD2H_BUILD_DIR names another; it is
incremental, so a second install rebuilds only what changed. CMAKE_BUILD_PARALLEL_LEVEL
sets the build's parallelism; RD2H_CMAKE_ARGS adds configure arguments and
RD2H_BUILD_TARGETS builds more targets (the test suite builds the rd2h binary its tests run, with
warnings as errors this way).
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def project_version() -> str:
    text = (ROOT / "CMakeLists.txt").read_text()
    m = re.search(r"project\(rd2h\s+VERSION\s+([0-9.]+)", text)
    if not m:
        raise RuntimeError("CMakeLists.txt declares no project(rd2h VERSION ...)")
    return m.group(1)


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        build_dir = Path(os.environ.get("RD2H_BUILD_DIR", ROOT / "build" / "python"))
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DBUILD_SHARED_LIBS=OFF",
            "-DRD2H_BUILD_TESTS=OFF",
            "-DRD2H_BUILD_APPS=OFF",
            "-DRD2H_INSTALL=OFF",
            "-DRD2H_PYTHON=ON",
            f"-DPYTHON_EXECUTABLE={sys.executable}",
            *shlex.split(os.environ.get("RD2H_CMAKE_ARGS", "")),
        ]
        if shutil.which("ninja") and not (build_dir / "Makefile").exists():
            configure += ["-G", "Ninja"]
        subprocess.run(configure, check=True)
        targets = ["_native", *shlex.split(os.environ.get("RD2H_BUILD_TARGETS", ""))]
        subprocess.run(["cmake", "--build", str(build_dir), "--target", *targets], check=True)
        built = list((build_dir / "python" / "rd2h").glob("_native*.so"))
        if len(built) != 1:
            raise RuntimeError(f"expected one _native module in {build_dir}/python/rd2h, found {built}")
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[0], dest)


setup(
    version=project_version(),
    ext_modules=[CMakeExtension("rd2h._native")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
