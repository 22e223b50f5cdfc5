# Sourced by run.sh and serve.sh: the tools they need, and what an emulated aarch64 machine shows a program under
# qemu-user.

# need TOOL...: stops the script where one is missing, saying what installs them.
need() {
  local tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null || { echo "no $tool: apt-get install g++-aarch64-linux-gnu qemu-user" >&2; exit 2; }
  done
}

# qemu_machine ROOT [CPU]: 2 CPUs in ROOT/proc and ROOT/sys, which torch's CPU probes read at start (the host's x86
# files crash them), described as qemu's -cpu CPU is (neoverse-n1, the default, or cortex-a72); qemu-user, given
# -L ROOT, looks absolute paths up under ROOT first. The kernels choose their path from the auxiliary vector, which
# qemu sets per -cpu, not from these files: they name the CPU in tornchat's log.
qemu_machine() {
  local root="$1" cpu d i f part=0xd0c midr=0x00000000413fd0c1 variant=0x3 revision=1
  local features="fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
  if [ "${2:-neoverse-n1}" = cortex-a72 ]; then
    part=0xd08 midr=0x00000000410fd083 variant=0x0 revision=3 features="fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid"
  fi
  mkdir -p "$root/proc" "$root/sys/devices/system/cpu"
  : > "$root/proc/cpuinfo"
  for cpu in 0 1; do
    printf 'processor\t: %s\nFeatures\t: %s\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: %s\nCPU part\t: %s\nCPU revision\t: %s\n\n' \
      "$cpu" "$features" "$variant" "$part" "$revision" >> "$root/proc/cpuinfo"
    d="$root/sys/devices/system/cpu/cpu$cpu"
    mkdir -p "$d/topology" "$d/regs/identification" "$d/cache/index0" "$d/cache/index1" "$d/cache/index2"
    echo "$midr" > "$d/regs/identification/midr_el1"
    echo "$cpu" > "$d/topology/core_id"; echo 0 > "$d/topology/physical_package_id"
    echo "$cpu" > "$d/topology/thread_siblings_list"; echo 0-1 > "$d/topology/core_siblings_list"
    for i in 0 1 2; do echo "$cpu" > "$d/cache/index$i/shared_cpu_list"; done
  done
  for f in possible present online; do echo 0-1 > "$root/sys/devices/system/cpu/$f"; done
}
