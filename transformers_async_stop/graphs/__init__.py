"""The CUDA graphs: the DynamicCache loop's decode forward replayed piece by piece (`piecewise/`).

The static-cache loop's tail graphs are captured by that loop (`loops/static_loop/tail.py`).
"""
