"""Build script: the pure-Python package always; the CUDA extension ``hf_attention_backends._C``
when a CUDA build of torch and a CUDA toolkit are present.

``HFAB_BUILD_CUDA=1`` forces the extension (and fails loudly if it cannot be built),
``HFAB_BUILD_CUDA=0`` skips it. Unset: build it when torch has CUDA and CUDA_HOME is found.
``HFAB_CUDA_ARCHS`` overrides the target list of every source (default "80;90a", and the exact kernels,
CUDA cores only, also "75"; see csrc/README.md). "90a" is Hopper with its architecture-specific instructions
(wgmma): its cubin runs on every compute capability 9.0 GPU, as an sm_90 one does.
``HFAB_BACKENDS`` (kernel development only, e.g. "exact" or "race,stieltjes") builds the kernels of those backends
alone, a shorter build on a GPU machine; the others then have no CUDA kernel.
"""
import glob
import os

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _want_cuda():
    flag = os.environ.get("HFAB_BUILD_CUDA", "").strip().lower()
    if flag in ("0", "false", "no", "off"):
        return False
    forced = flag in ("1", "true", "yes", "on")
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        if forced:
            raise RuntimeError("HFAB_BUILD_CUDA=1 but torch is not importable at build time")
        return False
    usable = torch.version.cuda is not None and CUDA_HOME is not None
    if forced and not usable:
        raise RuntimeError(
            f"HFAB_BUILD_CUDA=1 but torch.version.cuda={torch.version.cuda!r}, CUDA_HOME={CUDA_HOME!r}; "
            "install a CUDA build of torch and set CUDA_HOME to the toolkit root")
    return usable and bool(_cuda_sources())


def _selected(sources):
    """The sources of the backends named in HFAB_BACKENDS (all when unset), and everything outside backend folders."""
    names = [b.strip() for b in os.environ.get("HFAB_BACKENDS", "").split(",") if b.strip()]
    if not names:
        return sources
    folders = sorted(d for d in os.listdir("csrc") if os.path.isdir(os.path.join("csrc", d)) and d != "common")
    unknown = sorted(set(names) - set(folders))
    if unknown:
        raise RuntimeError(f"HFAB_BACKENDS={os.environ['HFAB_BACKENDS']!r}: unknown {unknown}; supported: {folders}")
    return [s for s in sources
            if os.path.normpath(s).split(os.sep)[1] not in folders or os.path.normpath(s).split(os.sep)[1] in names]


def _cuda_sources():
    return _selected(sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True)))


def _host_sources():
    """csrc/extension.cpp and the C++ beside the kernels (autograd registrations), compiled by the host compiler."""
    return _selected(sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True)))


DEFAULT_ARCHS = ["80", "90a"]
# extra default targets per source folder: the exact kernels use CUDA cores only and also run on Turing
EXTRA_ARCHS = {os.path.join("csrc", "exact"): ["75"]}


def _archs_for(source):
    override = os.environ.get("HFAB_CUDA_ARCHS")
    if override is not None:
        return [a.strip() for a in override.split(";") if a.strip()]
    extra = [a for folder, archs in EXTRA_ARCHS.items() if os.path.normpath(source).startswith(folder + os.sep)
             for a in archs]
    return sorted(set(DEFAULT_ARCHS + extra), key=_arch_number)


def _arch_number(arch):
    """75, 80, 90 from "75", "80", "90a": the order of the targets."""
    return int(arch.rstrip("af"))


def _gencode_flags(archs):
    return [f"-gencode=arch=compute_{arch},code=sm_{arch}" for arch in archs]


def _abi_flag():
    """The C++ string ABI torch was built with: a mismatch crashes when a TORCH_CHECK message crosses over."""
    import torch
    return f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def _check_cxx_links_libstdcxx_dynamically():
    """A g++ without libstdc++.so links a private static copy into _C.so; with torch's shared libstdc++ in the
    same process its stream and locale code then crashes (seen on the first TORCH_CHECK message)."""
    import shlex
    import subprocess
    import sysconfig
    cxx = os.environ.get("CXX") or (sysconfig.get_config_var("CXX") or "c++")
    cxx = shlex.split(cxx)[0]
    try:
        found = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return
    if os.sep not in found:
        raise RuntimeError(f"the C++ compiler CXX={cxx} has no libstdc++.so and would link libstdc++ statically "
                           "into hf_attention_backends._C, which crashes next to torch's shared libstdc++; set CXX "
                           "(and CC) to a compiler that links it dynamically, e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc")


def _extensions():
    if not _want_cuda():
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    class BuildExtensionPerArch(BuildExtension):
        """Compiles the sources in groups that share a CUDA target list (per-file -gencode flags)."""

        def build_extension(self, ext):
            _check_cxx_links_libstdcxx_dynamically()
            compile_all = self.compiler.compile

            def compile_by_arch(sources, *args, extra_postargs=None, **kwargs):
                groups = {}
                for source in sources:
                    groups.setdefault(tuple(_archs_for(source)), []).append(source)
                objects = []
                for archs, group in groups.items():
                    post = dict(extra_postargs or {})
                    post["nvcc"] = list(post.get("nvcc", [])) + _gencode_flags(archs)
                    objects += compile_all(group, *args, extra_postargs=post, **kwargs)
                return objects

            self.compiler.compile = compile_by_arch
            try:
                super().build_extension(ext)
            finally:
                self.compiler.compile = compile_all

    ext = CUDAExtension(
        name="hf_attention_backends._C",
        sources=_host_sources() + _cuda_sources(),
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={
            "cxx": ["-O3", _abi_flag()],
            "nvcc": ["-O3", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr", _abi_flag(),
                     "-Xptxas=-v" if os.environ.get("HFAB_PTXAS_VERBOSE") else "-Xptxas=-O3"],
        },
    )
    return [ext], {"build_ext": BuildExtensionPerArch.with_options(no_python_abi_suffix=True)}


ext_modules, cmdclass = _extensions()

setup(
    name="hf_attention_backends",
    version="0.1.0",
    description="Fast Nyström, Stieltjes, RACE and exact attention kernels behind transformers' AttentionInterface",
    packages=find_packages(include=["hf_attention_backends", "hf_attention_backends.*"])
    + ["hf_attention_backends.integrations", "hf_attention_backends.model_tests", "hf_attention_backends.finetune",
       "hf_attention_backends.configs.finetune", "hf_attention_backends.configs.accelerate"],
    package_dir={"hf_attention_backends.integrations": "integrations",
                 "hf_attention_backends.model_tests": "model_tests",
                 "hf_attention_backends.finetune": "finetune",
                 "hf_attention_backends.configs.finetune": "configs/finetune",  # the recipes, by name: hfab finetune
                 "hf_attention_backends.configs.accelerate": "configs/accelerate"},
    package_data={"hf_attention_backends.integrations": ["*.yaml"],
                  "hf_attention_backends.configs.finetune": ["*.yaml"],
                  "hf_attention_backends.configs.accelerate": ["*.yaml", "README.md"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.4", "transformers>=5.0", "safetensors", "tqdm", "pyyaml", "numpy"],
    extras_require={
        "test": ["pytest", "pytest-timeout", "hypothesis", "accelerate", "gguf", "matplotlib"],
        "finetune": ["accelerate", "peft", "matplotlib"],
        "bench": ["matplotlib"],
    },
    entry_points={"console_scripts": ["hfab=hf_attention_backends.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
