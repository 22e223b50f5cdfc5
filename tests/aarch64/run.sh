#!/usr/bin/env bash
# The kernels on aarch64, run: harness.cpp (beside this file) built with setup.py's flags against PyPI's
# aarch64 torch and run under qemu-user, since no ARM machine is at hand, on a CPU with the dot product (the dotprod
# and neon paths against the generic one) and one without (neon and generic), and attention's outputs there
# against x86's (same_as_x86.py, run natively with X86_PYTHON, default the checkout's .venv). Not part of the test
# suite: it downloads torch's aarch64 wheel (about 430 MB, its CUDA build: the CUDA runtime it links is stubbed,
# never called). Needs Debian's g++-aarch64-linux-gnu and qemu-user (apt-get install ...), and python3 with pip.
#
#   bash tests/aarch64/run.sh [work folder, default ~/.cache/tornchat-aarch64]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
work="${1:-$HOME/.cache/tornchat-aarch64}"
source "$here/machine.sh"
need aarch64-linux-gnu-g++ qemu-aarch64
mkdir -p "$work"
cd "$work"

# torch for aarch64: its headers and libraries
if [ ! -d torch/lib ]; then
  python3 -m pip download torch==2.13.0 --platform manylinux_2_28_aarch64 --only-binary=:all: \
    --python-version 311 --implementation cp --no-deps -d wheels
  python3 - <<'PY'  # its headers and the CPU libraries (not the CUDA ones: 0.5 GB more)
import glob, re, zipfile
wheel = zipfile.ZipFile(glob.glob("wheels/torch-2.13.0-*aarch64.whl")[0])
wheel.extractall(".", [name for name in wheel.namelist() if name.startswith(("torch/lib/", "torch/include/"))
                       and not re.search(r"cuda|nvshmem|nvrtc|torch_python", name)])
PY
fi
lib="$work/torch/lib"
py_include="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
includes=(-I"$work/torch/include" -I"$work/torch/include/torch/csrc/api/include" -I"$py_include")
flags=(-std=c++20 -O3 -fopenmp -fPIC -w $(python3 -c "
import ast
for node in ast.parse(open('$repo/setup.py').read()).body:
    if isinstance(node, ast.Assign) and any(getattr(t, 'id', None) == 'NO_CONTRACTION' for t in node.targets):
        print(' '.join(ast.literal_eval(node.value)))"))

# The kernels and the harness
csrc="$repo/tornchat/engine/csrc"
mkdir -p build stubs
for source in attention.cpp blocks/dispatch.cpp blocks/generic.cpp blocks/layouts.cpp blocks/arm.cpp "$here/harness.cpp"; do
  [ -f "$source" ] || source="$csrc/$source"
  echo "aarch64-linux-gnu-g++ ${flags[*]} ${includes[*]} -I$csrc -c $source -o build/$(basename "$source" .cpp).o"
done | xargs -P "$(nproc)" -I{} sh -c "{}"

# Stubs: the CUDA runtime libtorch_cpu links (never called here), and the Python API the bindings name (never
# called: the harness calls the kernels directly)
for soname in libcudart.so.13 libcupti.so.13; do
  aarch64-linux-gnu-readelf --dyn-syms -W "$lib/libtorch_cpu.so" "$lib/libc10.so" | awk '$7 == "UND" {print $8}' \
    | sed -n "s/@$soname.*//p" | sort -u | awk '{print "int " $1 "(void) { return 999; }"}' > "stubs/$soname.c"
  printf '%s { global: *; };\n' "$soname" > "stubs/$soname.map"
  aarch64-linux-gnu-gcc -shared -fPIC -o "stubs/$soname" "stubs/$soname.c" -Wl,--version-script="stubs/$soname.map" \
    -Wl,-soname,"$soname"
done
aarch64-linux-gnu-nm -u build/*.o | awk '{print $NF}' | grep -E '^_?Py' | sort -u \
  | awk '/_Type$|^PyExc_|^_Py_.*Struct$/ {print "char " $1 "[512];"; next} {print "void " $1 "(void) {}"}' > stubs/python.c
cat > stubs/casters.cpp <<'CPP'
#include <torch/csrc/utils/pybind.h>
namespace pybind11::detail {
bool type_caster<at::Tensor, void>::load(handle, bool) { return false; }
handle type_caster<at::Tensor, void>::cast(const at::Tensor&, return_value_policy, handle) { return handle(); }
}
CPP
aarch64-linux-gnu-gcc -c -fPIC -w stubs/python.c -o stubs/python.o
aarch64-linux-gnu-g++ -std=c++20 -O1 -fPIC -w "${includes[@]}" -c stubs/casters.cpp -o stubs/casters.o
aarch64-linux-gnu-g++ -shared -o stubs/libpython_stub.so stubs/python.o stubs/casters.o -L"$lib" -lc10
aarch64-linux-gnu-g++ -fopenmp -o build/harness build/*.o -L"$lib" -L"$work/stubs" -ltorch_cpu -lc10 -lpython_stub \
  -Wl,--allow-shlib-undefined

# A machine for qemu to show the program (machine.sh), its libraries the cross-compiler's
root="$work/root"
mkdir -p "$root"
ln -sfn /usr/aarch64-linux-gnu/lib "$root/lib"

# Neoverse N1 has the dot product (the dotprod and neon paths, checked against the generic one), Cortex-A72 has not
# (neon and generic: the detection must not offer dotprod).
status=0
for cpu in neoverse-n1:"dotprod neon generic" cortex-a72:"neon generic"; do
  echo "== qemu -cpu ${cpu%%:*}"
  qemu_machine "$root" "${cpu%%:*}"
  out="$(qemu-aarch64 -cpu "${cpu%%:*}" -L "$root" -E LD_LIBRARY_PATH="$lib:$work/stubs" build/harness \
    "attention-${cpu%%:*}.bin")" || status=1
  echo "$out"
  grep -qx "block_mm paths: ${cpu#*:}" <<<"$out" || { echo "expected the paths ${cpu#*:}" >&2; status=1; }
  # and x86's attention (this checkout's build, natively) the same bits
  PYTHONPATH="$repo" "${X86_PYTHON:-$repo/.venv/bin/python}" "$here/same_as_x86.py" "attention-${cpu%%:*}.bin" || status=1
done
exit $status
