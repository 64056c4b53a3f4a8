"""Build the kernels ahead of the first server or test (`make kernels` runs this): the C++ CPU kernels, and the numba
KV page quantisers into numba's on-disk cache (a cold compile costs each process several seconds at its first fp8
or fp4 page otherwise)."""
from engine.kernels.extension_build import main as build_extension
from engine.kernels.kv_quant import compile_cpu_kernels


def main() -> int:
    status = build_extension()
    compile_cpu_kernels()
    print("KV page quantisers compiled")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
