"""Triton kernels of the offload path; each file holds a kernel, its launcher, and the
plain-torch reference it must match. CPU tests run them with TRITON_INTERPRET=1."""
