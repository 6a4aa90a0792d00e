"""The decoding loops the flag runs, each stepping aside to stock's where it cannot be exact.

- `static_loop/`: greedy/sample with a static cache (5.17+), the step's tail replayed from CUDA graphs;
- `dynamic_loop/`: greedy/sample with a DynamicCache (5.17+), the decode forward replayed piecewise (`graphs/`);
- `assisted/`: assisted decoding and prompt lookup, the verify loop ported per release;
- `beam.py`: beam search, stock's loop with the "are all beams done?" verdict read one step late.
"""
