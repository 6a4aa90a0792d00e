"""The eager decode forward of a dynamic cache, replayed from CUDA graphs piece by piece (flag on, 5.17+, CUDA).

With the default `DynamicCache` every decode step runs the model's eager forward: hundreds of kernel launches, each
behind Python, so the GPU of a small or mid-sized model mostly waits for the host. Only two parts of a decode step
change shape with the length: the cache append (`Cache.update`, a `torch.cat`) and the attention over the cache.
Everything between them (the embedding, each layer's norms, projections, rotary embedding, residuals and MLP, the
final norm and the LM head) has fixed shapes for a given batch. Those pieces are captured into CUDA graphs from the
model's own eager kernels (no compiler, no kernel change), and each step replays them with the cache append and the
attention run eagerly between them, exactly as the model runs them (`graphs.py`). A CUDA graph replays the launches
it captured, so every value is the eager forward's.

- `proof/`: the proof that a recording may be replayed, one pipeline of four stages (find the family and admit the
  call, watch the recording, give the verdict, hand over the set of things to watch: `proof/__init__.py`); every
  other model steps aside, with the reason in `last_path().forward`;
- `graphs.py`, `masks.py`: the recording (the model's forward run once with the split points intercepted) and the
  replay;
- `forward.py`: the per-call forward the dynamic-cache loop calls: per step the hand-over's checks, the step's
  inputs (`steps.py`) and the recording key (`settings.py`: the torch settings a kernel was chosen under), then a
  replay, or a recording run through the proof;
- `staleness.py`: the per-model store of recordings (freed with the model) and the snapshot of the model they were
  made from, compared before each replay.

`forward_for` is the loop's one entry point. `TRANSFORMERS_ASYNC_STOP_PIECEWISE=0` turns it off.
"""

from __future__ import annotations

from ... import path_report
from .forward import PiecewiseForward, graphs_of, tell
from .proof import PIECEWISE_ENV, why_not_again, why_not_model

__all__ = ["PIECEWISE_ENV", "forward_for"]

# the assistant's draft steps of assisted decoding take the path too (False: they keep their eager forward; a switch
# that removes the draft's use alone, should it fail where the dynamic loop's own does not)
DRAFT_ON = True
# assisted decoding's verify forward (the target's K = candidates + 1 tokens) takes it too (False: it stays eager)
VERIFY_ON = True


def forward_for(model, model_forward, generation_config, verify=False):
    """The forward the dynamic-cache loop calls for its decode steps, or None where it keeps `model_forward` (the
    reason goes to `last_path().forward`).

    An assistant's draft loop inside a deferred assisted call (`assisted/draft.py`) takes it too: each draft step is
    a one-token decode forward of the assistant with its `DynamicCache`, at batch 1 (assisted decoding's only batch;
    any other steps aside per step), and each round's two-token prefill. The draft reports nothing of its own, so its
    forward is told in the assisted call's `last_path().forward`, prefixed "draft " (the last round's count of
    replayed steps).

    `verify=True`: the forward of assisted decoding's verify rounds after the first (`assisted/loop.py`), K tokens
    wide, told in `last_path().verify`."""
    role = "verify" if verify else "draft" if getattr(generation_config, "is_assistant", False) else "decode"
    if (role == "draft" and not DRAFT_ON) or (role == "verify" and not VERIFY_ON):
        return None
    report = path_report._current()
    graphs = graphs_of(model)
    # a model recorded and unchanged since (its snapshot compared, as before every replay) was proven then: only what
    # a call can change is asked again (an assistant's draft is a call per round)
    if graphs.recordings and graphs.registrations_changed():
        graphs.clear()  # a kernel registered in place of another since: every recording may hold the old one
        graphs.first_runs.clear()
    unchanged = bool(graphs.recordings) and not graphs.changed()
    why = why_not_again(model, model_forward, graphs) if unchanged else why_not_model(model, model_forward)
    if why is not None:
        if report is not None:
            tell(report, role, f"eager: {why}")
        return None
    return PiecewiseForward(model, model_forward, report, role=role, watched=graphs.watched if unchanged else None)
