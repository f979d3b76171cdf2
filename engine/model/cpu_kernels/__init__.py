"""CPU kernels for the decode and verify shapes, compiled on the machine at first use (build.py, kernels.c) and
called through ctypes (ops.py); torch's kernels run where they cannot be built."""
