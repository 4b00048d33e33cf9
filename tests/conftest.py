import os

# Triton kernels must be defined under the interpreter to run on CPU; set before any import.
os.environ.setdefault("TRITON_INTERPRET", "1")
