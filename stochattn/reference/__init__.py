"""NumPy reference implementations of every estimator (float64 where it decides correctness).

These functions take already-validated NumPy arrays; the public functions in
:mod:`stochattn` check their input and call them.
"""
