"""How many dot-product and FMA instructions this CPU's cores issue per second: the compute ceiling
under a many-row (prefill) call, as benchmarks.bandwidth's read bandwidth is the floor under decode.

    python -m benchmarks.issue_rate [--seconds 1] [--repeats 3]

A few lines of C (inline assembly: 16 independent accumulators, so latency never binds) are compiled
with the system's C compiler and run on one core, then on every core at once. Prints per instruction the
median G instructions/s per core, and the multiply-adds/s they imply for all cores together. With
AVX-512 VNNI: vpdpwssd (int16 pairs, what mxspd's MXMatMul multiplies with: 32 multiply-adds), vpdpbusd
(int8 quads, llama.cpp's Q8 activations: 64) and vfmadd231ps (float32: 16). On an AVX2 CPU their 256-bit
counterparts: vpmaddwd (16, plus an add), vpmaddubsw (32, plus a widening), vfmadd231ps (8).

`mx block` (AVX-512): the vpdpbusd rate of MXMatMul's many-row arithmetic itself, the ceiling of that path
(kernels/mx_matmul.cc, gemm_pass): per block and accumulator 8 vpdpbusd into a sum started afresh, then the
exact float step (vcvtdq2ps, vmulps, vfmadd231ps) that shares their pipes, on 12 accumulators as a pass of
6 rows x 2 column groups keeps. On a Zen 5 it issued 0.77 of plain vpdpbusd's rate (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks.bandwidth import cpu_name

# instruction -> multiply-adds per instruction; the register width each is timed at
AVX512 = {"vpdpwssd": 32, "vpdpbusd": 64, "vfmadd231ps": 16, "mx block": 64}
AVX2 = {"vpmaddwd": 16, "vpmaddubsw": 32, "vfmadd231ps": 8}

SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char** argv) {
  double seconds = atof(argv[1]);
  long n = 1000000, done = 0;
  double t0 = now();
  while (now() - t0 < seconds) {
    long i = n;
    __asm__ volatile("1:\n\t" BODY "dec %0\n\tjnz 1b" : "+r"(i) :: "memory" CLOBBERS);
    done += n;
  }
  printf("%.4f\n", done * COUNT.0 / (now() - t0) / 1e9);
  return 0;
}
"""


def _program(instruction: str, reg: str, chains: int = 16) -> str:
    """SOURCE timing 16 `instruction`s per loop on `chains` accumulators (registers 0 .. chains - 1, at
    most 16, 12 for AVX2) from two sources (registers 16 and 17; 14 and 15 for AVX2, whose registers
    stop at 15). One chain times the instruction's latency instead of its issue rate."""
    if instruction == "mx block":
        return _block_program()
    chains = min(chains, 16 if reg == "zmm" else 12)
    sources = (16, 17) if reg == "zmm" else (14, 15)
    body = "".join(f'"{instruction} %%{reg}{sources[0]}, %%{reg}{sources[1]}, %%{reg}{i % chains}\\n\\t"'
                   for i in range(16))
    clobbers = "".join(f', "{"x" if reg == "ymm" else "z"}mm{i}"' for i in range(16))
    return SOURCE.replace("BODY", body).replace("CLOBBERS", clobbers).replace("COUNT", "16")


def _block_program() -> str:
    """SOURCE timing `mx block`: 12 integer sums (zmm0-11) started from zmm30, 8 vpdpbusd each, then each
    converted, its scale product formed (zmm24-25) and added into its float accumulator (zmm12-23)."""
    sums = range(12)
    lines = [f"vmovdqa64 %%zmm30, %%zmm{i}" for i in sums]
    lines += [f"vpdpbusd %%zmm28, %%zmm29, %%zmm{i}" for _ in range(8) for i in sums]
    for i in sums:
        lines += [f"vcvtdq2ps %%zmm{i}, %%zmm{i}", f"vmulps %%zmm26, %%zmm27, %%zmm{24 + i % 2}",
                  f"vfmadd231ps %%zmm{i}, %%zmm{24 + i % 2}, %%zmm{12 + i}"]
    body = "".join(f'"{line}\\n\\t"' for line in lines)
    clobbers = "".join(f', "zmm{i}"' for i in range(16))  # (zmm16-31: unknown to a build without AVX-512)
    return SOURCE.replace("BODY", body).replace("CLOBBERS", clobbers).replace("COUNT", str(8 * len(sums)))


def _compile(instruction: str, reg: str, folder: Path, chains: int = 16) -> Path:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        raise SystemExit("issue_rate needs a C compiler (cc or gcc, or $CC)")
    name = instruction.replace(" ", "_")
    src, exe = folder / f"{name}_{chains}.c", folder / f"{name}_{chains}"
    src.write_text(_program(instruction, reg, chains))
    subprocess.run([cc, "-O1", "-o", str(exe), str(src)], check=True)
    return exe


def _rates(exe: Path, seconds: float, cores: list[int]) -> list[float]:
    """G instructions/s of `exe` on each of `cores`, all at once (one process pinned to each)."""
    procs = [subprocess.Popen([str(exe), str(seconds)], stdout=subprocess.PIPE, text=True,
                              preexec_fn=lambda c=c: os.sched_setaffinity(0, {c})) for c in cores]
    return [float(p.communicate()[0]) for p in procs]


def instructions() -> tuple[dict[str, int], str]:
    """The instructions to time on this CPU (AVX512 or AVX2) and their register width."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return (AVX512, "zmm") if "avx512_vnni" in flags or "avx512vnni" in flags else (AVX2, "ymm")


def measure(seconds: float, repeats: int) -> dict:
    table, reg = instructions()
    cores = sorted(os.sched_getaffinity(0))
    out: dict = {"cpu": cpu_name(), "registers": reg, "cores": len(cores), "instructions": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for instruction, macs in table.items():
            exe = _compile(instruction, reg, Path(tmp))
            alone = [_rates(exe, seconds, cores[:1])[0] for _ in range(repeats)]
            together = [statistics.mean(_rates(exe, seconds, cores)) for _ in range(repeats)]
            out["instructions"][instruction] = {
                "multiply_adds_each": macs,
                "G_per_s_one_core": round(statistics.median(alone), 2),
                "G_per_s_per_core_all_cores": round(statistics.median(together), 2),
                "G_multiply_adds_per_s_all_cores": round(statistics.median(together) * macs * len(cores), 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=1.0, help="per timing")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.repeats < 1:
        ap.error("--seconds must be positive and --repeats at least 1")
    print(json.dumps(measure(args.seconds, args.repeats), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
