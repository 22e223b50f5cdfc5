"""Which vector operations share the pipes of the kernels' integer dot products, on this CPU.

The block kernels' tiles (csrc/blocks/) are bound by their arithmetic once several rows share a read of
the weights: each row's integer dots (VPDPBUSD on the AVX-512 VNNI path, VPMADDUBSW + VPMADDWD on AVX2),
its fp32 scaling (a multiply and two fused multiply-adds a group and column pair) and each column's unpacking
(ANDs, shifts, inserts, permutes, converts); and the integer multiplies a scale could take instead. What one
of them costs beside the dots depends on which execution pipes the CPU gives it. This times, in a loop of inline assembly with no dependences between
iterations, 16 dot instructions alone and then beside 8 and 16 of each other operation, in core cycles
(the clock measured by a chain of dependent adds, one a cycle): an operation whose 8 add about 8 cycles
shares the dots' pipes; one whose 8 add none runs beside them.

    python -m bench.pipes

Needs a C compiler (``cc``) and an x86-64 CPU with AVX2; the AVX-512 table where the CPU has AVX-512 VNNI.
Prints a markdown table; the CPU it ran on comes first.
"""
import os
import subprocess
import tempfile
import textwrap
from pathlib import Path

from tornchat.engine.cpu import describe

LOOPS = 20_000_000
# What each path's tile does beside its dots, as (name, AT&T instruction writing register {i}); the dots write
# registers 0-15 (zmm) or 0-7 (ymm) from 24 and 25 (zmm) or 13-15 (ymm), the others read 24 and 26 or 12 and 13.
ZMM = {
    "vfmadd231ps (fp32 multiply-add)": "vfmadd231ps %%zmm24, %%zmm26, %%zmm{i}",
    "vmulps (fp32 multiply)": "vmulps %%zmm24, %%zmm26, %%zmm{i}",
    "vpmulld (int32 multiply)": "vpmulld %%zmm24, %%zmm26, %%zmm{i}",
    "vpmaddwd (int16 multiply, pairs added)": "vpmaddwd %%zmm24, %%zmm26, %%zmm{i}",
    "vcvtdq2ps (int32 to fp32)": "vcvtdq2ps %%zmm26, %%zmm{i}",
    "vpaddd (int32 add)": "vpaddd %%zmm24, %%zmm26, %%zmm{i}",
    "vpandd (and)": "vpandd %%zmm24, %%zmm26, %%zmm{i}",
    "vpsrlw (shift)": "vpsrlw $4, %%zmm26, %%zmm{i}",
    "vinserti64x4 (join halves)": "vinserti64x4 $1, %%ymm26, %%zmm24, %%zmm{i}",
    "vpermq (permute)": "vpermq %%zmm26, %%zmm24, %%zmm{i}",
    "vbroadcasti64x4 (load, both halves)": "vbroadcasti64x4 (%1), %%zmm{i}",
}
YMM = {
    "vfmadd231ps (fp32 multiply-add)": "vfmadd231ps %%ymm12, %%ymm13, %%ymm{i}",
    "vmulps (fp32 multiply)": "vmulps %%ymm12, %%ymm13, %%ymm{i}",
    "vpmulld (int32 multiply)": "vpmulld %%ymm12, %%ymm13, %%ymm{i}",
    "vpmaddwd (int16 multiply, pairs added)": "vpmaddwd %%ymm12, %%ymm13, %%ymm{i}",
    "vcvtdq2ps (int32 to fp32)": "vcvtdq2ps %%ymm13, %%ymm{i}",
    "vpaddd (int32 add)": "vpaddd %%ymm12, %%ymm13, %%ymm{i}",
    "vpand (and)": "vpand %%ymm12, %%ymm13, %%ymm{i}",
    "vpsrlw (shift)": "vpsrlw $4, %%ymm13, %%ymm{i}",
    "vinserti128 (join halves)": "vinserti128 $1, %%xmm13, %%ymm12, %%ymm{i}",
    "vpermq (permute)": "vpermq $0x4e, %%ymm13, %%ymm{i}",
    "vbroadcasti128 (load, both halves)": "vbroadcasti128 (%1), %%ymm{i}",
}
PATHS = {  # name: (the dots of one loop, what they are, the other operations, their first register, how many,
    #                 vector registers in use, the compiler's flags)
    "avx512vnni": ("".join(f"vpdpbusd %%zmm24, %%zmm25, %%zmm{i}\\n" for i in range(16)), "16 VPDPBUSD (zmm)", ZMM, 16, 8,
                   32, ["-mavx512f"]),
    "avx2": ("".join(f"vpmaddubsw %%ymm14, %%ymm15, %%ymm{i}\\n vpmaddwd %%ymm13, %%ymm{i}, %%ymm{i}\\n" for i in range(8)),
             "8 VPMADDUBSW + 8 VPMADDWD (ymm)", YMM, 8, 4, 16, ["-mavx2"]),
}


def program(isa: str) -> str:
    """C source timing the path's dots alone, then beside 8 and 16 of each other operation."""
    dots, _, ops, first, registers, used, _ = PATHS[isa]
    runs = [("nothing", 0, "")] + [(name, count, "".join(op.format(i=first + j % registers) + "\\n" for j in range(count)))
                                   for name, op in ops.items() for count in (8, 16)]
    # every register zeroed first (no denormal or NaN operand to slow an fp32 operation), all declared clobbered
    zero = "".join(f"vpxor %%xmm{i}, %%xmm{i}, %%xmm{i}\\n" if i < 16 else f"vpxord %%zmm{i}, %%zmm{i}, %%zmm{i}\\n"
                   for i in range(used))
    clobbers = ", ".join(f'"xmm{i}"' for i in range(used))
    body = "".join(f'  run("{name}", {count}, ({{ long n = LOOPS; double t = now(); __asm__ volatile("{zero}1:\\n{dots}'
                   f'{extra}dec %0\\n jnz 1b\\n" : "+r"(n) : "r"(buf) : "memory", {clobbers}); now() - t; }}));\n'
                   for name, count, extra in runs)
    return textwrap.dedent(f"""\
        #include <stdio.h>
        #include <time.h>
        #define LOOPS {LOOPS}L
        static double now(void) {{ struct timespec a; clock_gettime(CLOCK_MONOTONIC, &a); return a.tv_sec + 1e-9 * a.tv_nsec; }}
        static char buf[64] __attribute__((aligned(64)));
        static double hz;
        static void run(const char* name, int count, double seconds) {{ printf("%s\\t%d\\t%.2f\\n", name, count, seconds / LOOPS * hz); }}
        int main(void) {{
          long n = LOOPS; double t = now();
          __asm__ volatile("1:\\n add $1, %%rax\\n add $1, %%rax\\n add $1, %%rax\\n add $1, %%rax\\n dec %0\\n jnz 1b\\n"
                           : "+r"(n) :: "rax");
          hz = 4.0 * LOOPS / (now() - t);
          printf("clock\\t0\\t%.3f\\n", hz / 1e9);
        """) + body + "}\n"


def measure(isa: str) -> tuple[float, list[tuple[str, int, float]]]:
    """The clock in GHz, and (operation, how many beside the dots, cycles a loop) for each run."""
    source = program(isa)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "pipes.c")
        path.write_text(source)
        subprocess.run(["cc", "-O2", *PATHS[isa][6], "-o", str(path.with_suffix("")), str(path)], check=True)
        lines = subprocess.run([str(path.with_suffix(""))], check=True, capture_output=True, text=True).stdout
    rows = [(name, int(count), float(cycles)) for name, count, cycles in (line.split("\t") for line in lines.splitlines())]
    return rows[0][2], rows[1:]


def main():
    flags = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else set()
    print(describe())
    if "avx2" not in flags:
        raise SystemExit("bench.pipes times x86-64 AVX2 and AVX-512 instructions: this CPU has no AVX2 (or no /proc/cpuinfo)")
    for isa in ("avx512vnni", "avx2"):
        if isa == "avx512vnni" and "avx512_vnni" not in flags:
            continue
        clock, rows = measure(isa)
        print(f"\n{isa}: {PATHS[isa][1]} a loop, clock {clock:.2f} GHz (dependent adds)\n")
        print("| beside the dots | cycles a loop | added by 8 | added by 16 |")
        print("|---|---|---|---|")
        alone = rows[0][2]
        print(f"| nothing | {alone:.1f} | | |")
        for i in range(1, len(rows), 2):
            name, _, with8 = rows[i]
            with16 = rows[i + 1][2]
            print(f"| {name} | {with8:.1f} / {with16:.1f} | {with8 - alone:+.1f} | {with16 - alone:+.1f} |")


if __name__ == "__main__":
    main()
