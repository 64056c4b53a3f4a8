"""Build the C++ CPU kernels ahead of the first server or test (`make kernels` runs this)."""
from engine.kernels.extension_build import main

if __name__ == "__main__":
    raise SystemExit(main())
