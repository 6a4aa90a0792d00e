"""What the caller gets back has stock's memory layout, not only its values (red team, dynamic loop: f01, f05).

After the extra step is undone, transformers' own loop returned `sequences` as a view of the extra step's ids
without their last column, and a cropped `DynamicLayer` held slices of one position more: non-contiguous, so
`out.view(-1)` / `keys.view(-1)` raised with the flag only and `torch.save` wrote the undone position. Stock returns
its last `input_ids` itself (contiguous, the tensor its criteria were handed) and a cache of contiguous `torch.cat`
results. Compared with unpatched stock: strides, contiguity, the bytes `torch.save` writes, identity with what a
criterion kept.
"""

from __future__ import annotations

import io
import unittest

import torch
from parameterized import parameterized
from transformers import StoppingCriteriaList

from models import PAD, build, eos_ids_finishing_at, prompt, stock
from test_scores_aliasing import KeepIds as Keep

SETUPS = {  # name: (generate kwargs, attention implementation)
    "dynamic loop": ({}, "sdpa"),
    "own loop, attentions": ({"output_attentions": True}, "eager"),
    "own loop, hidden states": ({"output_hidden_states": True}, "sdpa"),
    "own loop, no cache": ({"use_cache": False}, "sdpa"),
}


def saved_size(tensor) -> int:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return len(buffer.getvalue())


def layout(tensor):
    return tensor.shape, tensor.stride(), tensor.is_contiguous(), saved_size(tensor)


class ReturnedTensorsHaveStocksLayout(unittest.TestCase):
    @parameterized.expand([(name, s) for name in SETUPS for s in (False, True)])
    def test_sequences_and_cache_after_an_early_stop(self, name, do_sample):
        extra, attn = SETUPS[name]
        ids, mask = prompt(3)

        def run(flag):
            model = build("llama", attn=attn)
            eos = eos_ids_finishing_at(model, ids, mask, [3, 5, 4])
            keep = Keep()
            kw = {"async_stopping_criteria": True} if flag else {}
            torch.manual_seed(3)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos, pad_token_id=PAD,
                                 do_sample=do_sample, return_dict_in_generate=True,
                                 stopping_criteria=StoppingCriteriaList([keep]), **extra, **kw)
            seq = out.sequences
            cache = out.past_key_values if extra.get("use_cache", True) else None
            layers = [] if cache is None else [(layout(l.keys), layout(l.values)) for l in cache.layers]
            return seq.tolist(), layout(seq), [k is seq for k in keep.kept], layers

        with stock():
            plain = run(False)
        fast = run(True)
        self.assertEqual(plain[0], fast[0])
        self.assertEqual(plain[1], fast[1], "the returned sequences' shape, strides, contiguity, saved size")
        self.assertEqual(plain[2], fast[2], "which kept ids are the returned sequences")
        self.assertEqual(plain[3], fast[3], "the returned cache's tensors: shape, strides, contiguity, saved size")
