"""Test-only helpers. The package never imports this subpackage: importing the package, or any module it imports at
run time, leaves it unloaded (`tests/test_layout.py` checks), so nothing here is in the shipped import surface.

- `emulation.py`: the package's CUDA graphs on the CPU (`with emulated():`), for CI without a GPU.
"""
