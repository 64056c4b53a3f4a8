"""Build the C++ CPU kernels ahead of the first server or test (`make install` runs this)."""
from engine.kernels.cpu_ext import main

if __name__ == "__main__":
    raise SystemExit(main())
