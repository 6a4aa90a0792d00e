"""The automatic proof of a model family for the graphed decode forward (issue 36, docs/design/family-proof.md).

The hand-read families (`eligibility.FAMILIES`, digests in `targets/piecewise_rows.py`) keep their proof. Any other
transformers causal LM is taken by discovery and proof, not by a hand read:
- `discover.py`: the family's layout (its layers, their attention modules) found from the model itself;
- `run_watch.py`: what a recording's run of the forward executed (transformers lines, foreign code, ATen ops);
- `normal_form.py`: transformers' modular copies recognised as the read code they copy;
- `rules.py`: what an unread function that ran may not have done (read the cache's length, keep state, log, read
  the host);
- `proof.py`: the verdict on one recording, and the comparison of two recordings at different positions.
"""
