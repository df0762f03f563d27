"""The launch runtime of the CUDA backend, shared by every estimator's host module.

- :mod:`.arrays`: CuPy arrays, PyTorch tensors and other DLPack producers behind one small
  interface (metadata, pointers, allocation on the caller's framework and stream);
- :mod:`.inputs`: q, k, v gathered and validated once per configuration, the plan cache;
- :mod:`.launch`: one compiled module per kernel family, device and config; launchers and
  packed launches (arguments from each kernel's declaration, :mod:`..kernels.abi`), the
  split of the token axis and the chunk merge;
- :mod:`.pdl`: programmatic dependent launch through ``cuLaunchKernelEx``.

Nothing here imports CuPy at import time.
"""
