"""tornchat: a low-latency, single-user, OpenAI-compatible chat-completion server.

torch is pinned to the exact release so that pip on a CPU machine takes the
local CPU wheel instead of fetching a multi-GB CUDA build. A GPU user installs
the CUDA build of the same release first (see README); the pin is then
already satisfied.

The lean forward's fused CPU ops (tornchat/engine/csrc) and the GGUF block
decoder (tornchat/engine/csrc/ggml.cpp) build against that torch, so install with
``--no-build-isolation`` (the README's commands do): an isolated build would
fetch another torch. The build is optional: without a compiler, or without
torch at build time, tornchat installs all the same (its GPU forward uses
none of it); but on a CPU the lean forward's matrices need the block kernels, so a
start there says what is missing (tornchat/build.py) and only
``--model-impl hf`` (transformers' modules) runs.
"""

from setuptools import setup

# GCC's default, -ffp-contract=fast, fuses a product into the sum that follows it wherever it sees the pair, and
# whether it does differs between targets (x86-64's baseline has no fused multiply-add, its AVX2 path and aarch64
# do) and can differ between a loop's inlined copies (one row's call, many rows' threads): a row's bits would
# depend on the CPU and the row count. Off, the kernels' fused multiply-adds are the ones their code writes out
# (csrc/vec.h's fmadd, the block kernels' intrinsics and std::fma), the same on every path and architecture.
# tests/test_portability.py compiles with these.
NO_CONTRACTION = ["-ffp-contract=off"]


def extensions() -> dict:
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        return {}
    # No -march=native: the wheel must run on any CPU of its architecture. -fopenmp: ATen's parallel_for is
    # a header template that runs its loop on one thread unless the including code is built with OpenMP
    # (the library it then links is torch's own libgomp, loaded once under its soname).
    options = {"extra_compile_args": ["-O3", "-fopenmp", *NO_CONTRACTION], "extra_link_args": ["-fopenmp"], "optional": True}
    blocks = [f"tornchat/engine/csrc/blocks/{name}" for name in ("dispatch.cpp", "generic.cpp", "layouts.cpp", "x86.cpp", "arm.cpp")]
    modules = [
        CppExtension("tornchat.engine._fused", ["tornchat/engine/csrc/fused.cpp", "tornchat/engine/csrc/attention.cpp", *blocks], **options),
        CppExtension("tornchat.engine._ggml", ["tornchat/engine/csrc/ggml.cpp"], **options),
    ]
    return {"ext_modules": modules, "cmdclass": {"build_ext": BuildExtension.with_options(use_ninja=False)}}


setup(
    name="tornchat",
    version="0.1.0",
    description="Low-latency OpenAI-compatible chat-completion server with its own decode loop",
    python_requires=">=3.11",  # transformers 5.23 and tornado 6.6 need it (tests/test_install.py)
    packages=["tornchat", "tornchat.engine", "tornchat.server", "tornchat.toolcalls", "tornchat.weights", "tornchat.kernels"],
    package_dir={"tornchat.kernels": "kernels"},
    package_data={"tornchat": ["web/*.html", "web/*.js", "web/*.css", "web/*.svg"]},  # the chat page at GET /
    install_requires=[
        "torch==2.13.0",
        "transformers==5.23.0",
        "gguf==0.19.0",
        "accelerate==1.15.0",  # transformers needs it to load GGUF files
        "safetensors",
        "tornado==6.6.1",
        "orjson>=3.10",
        # The triton that torch 2.13.0's builds on PyPI (Linux x86-64 and aarch64, CUDA builds) pin: any other makes
        # pip refuse the install wherever torch is not a CPU wheel (tests/test_install.py). Linux only, as theirs
        # (macOS has no triton); the CPU server never imports it (kernels/dispatch.py).
        'triton==3.7.1; platform_system == "Linux"',
        "pyyaml>=6",
        "prometheus-client>=0.20",
        "llguidance==1.9.1",  # grammar-constrained decoding (structured outputs, function calls)
        "tokenizers",  # a GGUF's tokenizer (weights/gguf_tokenizer.py); transformers pins its range
        "jinja2>=3.1.6",  # chat templates (prompt.py); older releases have known sandbox escapes
    ],
    extras_require={
        # playwright drives the system Chromium (apt-get install chromium) in tests/test_web*.py.
        "test": ["pytest>=8", "openai>=1.54", "hypothesis>=6", "jsonschema>=4.18", "psutil>=5", "playwright==1.65.2", "anthropic>=0.40"],
        # transformers[serving] brings fastapi and uvicorn for the `transformers serve` row of bench/e2e.py;
        # openai 1.54 added the `prediction` field bench/speculate.py sends.
        "bench": ["matplotlib>=3.8", "openai>=1.54", "psutil>=5", "transformers[serving]==5.23.0"],
        "llamacpp": ["llama-cpp-python[server]==0.3.36"],
    },
    entry_points={"console_scripts": ["tornchat=tornchat.cli:main"]},
    **extensions(),
)
