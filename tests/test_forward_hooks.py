"""Forward hooks see exactly the forwards stock runs (the usage fuzzer's NEW-3, seeds 75, 109, 299, 1023, 1039).

A forward hook or pre-hook (a counter, a logger, an interpretability tool saving activations) is user code that runs
at every forward. The flag's extra step runs one forward more than stock when the call stops early, or when a
streamer raises after the next forward was queued; the undo puts back the cache, the sequences and the RNG, but
not what a hook did. So while a hook is on the model (registered before the call or mid-call, on any module, or
globally), each verdict is read before the next forward is queued (`module_state.HookWatch`): the hook sees stock's
forwards, with stock's inputs. Before the fix the hook saw one call more in every case below.
"""

from __future__ import annotations

import unittest

import torch
from parameterized import parameterized
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import transformers_async_stop as tas
from models import PAD, build, stock

PROMPT = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])


class Log:
    """A hook that records the shape of every input it sees and the position ids / cache position it got."""

    def __init__(self):
        self.calls = []

    def forward_hook(self, module, args, output):
        self.calls.append(("post", type(module).__name__, tuple(a.shape for a in args if torch.is_tensor(a))))

    def pre_hook(self, module, args, kwargs):
        seen = {k: v.clone() for k, v in kwargs.items() if torch.is_tensor(v) and k != "past_key_values"}
        self.calls.append(("pre", type(module).__name__, sorted(seen), [v.tolist() for v in seen.values()
                                                                        if v.dtype == torch.long]))


class HookAt(StoppingCriteria):
    """A criterion that registers a forward hook on the model at step `at` and never stops the call."""

    def __init__(self, model, log, at, handle=True):
        self.model, self.log, self.at, self.step, self.handle = model, log, at, 0, handle

    def __call__(self, input_ids, scores, **kwargs):
        self.step += 1
        if self.step == self.at and self.handle:
            self.model.model.layers[0].register_forward_hook(self.log.forward_hook)
        elif self.step == self.at:
            # straight into the module's table, without a handle (torch's handle counter does not move)
            self.model.model.layers[0]._forward_hooks[10**6] = self.log.forward_hook
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class RaisingStreamer(BaseStreamer):
    def __init__(self, at):
        self.at, self.puts = at, 0

    def put(self, value):
        self.puts += 1
        if self.puts - 1 == self.at:
            raise RuntimeError("the consumer went away")

    def end(self):
        pass


def stop_ids(cache, steps=3):
    """EOS ids that stop both rows at about `steps` of a greedy run."""
    with stock():
        free = build("llama").generate(PROMPT, max_new_tokens=10, do_sample=False, eos_token_id=None,
                                       pad_token_id=PAD, cache_implementation=cache)
    return sorted(set(free[:, 4 + steps - 1].tolist()))


def run(flag, where, cache, do_sample=False, streamer_at=None):
    model = build("llama")
    log = Log()
    handles = []
    extra = {}
    if where == "model":
        handles.append(model.register_forward_hook(log.forward_hook))
    elif where == "layer pre-hook":
        handles.append(model.model.layers[1].register_forward_pre_hook(log.pre_hook, with_kwargs=True))
    elif where == "global":
        handles.append(torch.nn.modules.module.register_module_forward_hook(
            lambda m, a, o: log.calls.append(type(m).__name__) if m is model else None))
    elif where == "mid-call":
        extra["stopping_criteria"] = StoppingCriteriaList([HookAt(model, log, at=2)])
    elif where == "mid-call, no handle":
        extra["stopping_criteria"] = StoppingCriteriaList([HookAt(model, log, at=2, handle=False)])
    if streamer_at is not None:
        extra["streamer"] = RaisingStreamer(streamer_at)
        ids = PROMPT[:1]
    else:
        ids = PROMPT
    flag_kw = {"async_stopping_criteria": True} if flag else {}
    torch.manual_seed(7)
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=do_sample,
                             eos_token_id=stop_ids(cache), pad_token_id=PAD, cache_implementation=cache,
                             **flag_kw, **extra)
        result = out.tolist()
    except RuntimeError as error:
        result = str(error)
    finally:
        for handle in handles:
            handle.remove()
    return result, log.calls, torch.rand(2).tolist(), tas.last_path() if flag else None


class ForwardHooksSeeStocksForwards(unittest.TestCase):
    def compare(self, *args, **kwargs):
        with stock():
            plain = run(False, *args, **kwargs)
        fast = run(True, *args, **kwargs)
        self.assertEqual(plain[0], fast[0], "sequences (or the exception)")
        self.assertEqual(len(plain[1]), len(fast[1]), "how many forwards the hook saw")
        self.assertEqual(plain[1], fast[1], "what the hook saw")
        self.assertEqual(plain[2], fast[2], "the RNG state after the call")
        return fast[3]

    @parameterized.expand([(w, c, s) for w in ("model", "layer pre-hook", "global", "mid-call", "mid-call, no handle")
                           for c in (None, "static") for s in (False, True)])
    def test_a_call_that_stops_on_eos(self, where, cache, do_sample):
        path = self.compare(where, cache, do_sample)
        self.assertIn("hook", path.describe())  # the call says why it reads at once or left its plan

    @parameterized.expand([(c,) for c in (None, "static")])
    def test_a_streamer_that_raises_after_the_next_forward_was_queued(self, cache):
        self.compare("model", cache, streamer_at=3)

    def test_no_hook_keeps_the_deferred_path(self):
        path = self.compare(None, None)
        self.assertEqual(path.path, "deferred")

    def test_beam_search_with_a_hook(self):
        def beam(flag):
            model = build("llama")
            calls = []
            handle = model.register_forward_hook(lambda m, a, o: calls.append(o.logits.shape))
            kw = {"async_stopping_criteria": True} if flag else {}
            out = model.generate(PROMPT[:1], max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=PAD,
                                 eos_token_id=stop_ids(None), **kw)
            handle.remove()
            return out.tolist(), calls

        with stock():
            plain = beam(False)
        self.assertEqual(plain, beam(True))


class TransformersOwnHooksKeepTheDeferredPath(unittest.TestCase):
    """transformers installs its output-capturing hooks once attentions or hidden states are asked for, and leaves
    them on the modules (5.x). They record only while that forward's collector is active, so they are not user code
    watching every forward: later calls on the model keep the deferred path (red team, f06)."""

    @parameterized.expand([(c,) for c in (None, "static")])
    def test_a_call_after_one_that_asked_for_attentions(self, cache):
        model = build("llama")
        ids = PROMPT[:1]
        model.generate(ids, max_new_tokens=3, output_attentions=True, return_dict_in_generate=True,
                       pad_token_id=PAD, async_stopping_criteria=True)
        eos = stop_ids(cache)
        with stock():
            plain = model.generate(ids, max_new_tokens=8, pad_token_id=PAD, eos_token_id=eos,
                                   cache_implementation=cache)
        fast = model.generate(ids, max_new_tokens=8, pad_token_id=PAD, eos_token_id=eos, cache_implementation=cache,
                              async_stopping_criteria=True)
        self.assertTrue(torch.equal(plain, fast))
        self.assertNotEqual(tas.last_path().path, "immediate", tas.last_path().describe())
        # the path's reason blames no hook (the dynamic loop's forward may: the piecewise forward refuses these hooks,
        # `last_path().forward` "eager: a hook on LlamaDecoderLayer")
        self.assertNotIn("hook", tas.last_path().reason or "", tas.last_path().describe())


class PassiveHooksKeepTheFastPath(unittest.TestCase):
    """A hook declared `passive_hook()` (a counter) keeps the deferred path and sees the extra forward, as declared."""

    def test_a_passive_counter_sees_the_extra_forward(self):
        def count(flag):
            model = build("llama")
            calls = []
            hook = tas.passive_hook(lambda m, a, o: calls.append(1))
            handle = model.register_forward_hook(hook)
            kw = {"async_stopping_criteria": True} if flag else {}
            out = model.generate(PROMPT, max_new_tokens=10, do_sample=False, pad_token_id=PAD,
                                 eos_token_id=stop_ids(None), **kw)
            handle.remove()
            return out, len(calls)

        with stock():
            plain = count(False)
        fast = count(True)
        self.assertTrue(torch.equal(plain[0], fast[0]))
        self.assertEqual(fast[1], plain[1] + 1)
        self.assertEqual(tas.last_path().path, "deferred")
