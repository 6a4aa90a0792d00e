"""A model split over two GPUs by accelerate (`device_map`): flag on equals stock, and no decode step blocks.

The controller's side stream, events and pinned buffers belong to the device that holds `input_ids` and
`unfinished_sequences`, which need not be the current device: in the `embed_on_1` layout the inputs live on cuda:1
while cuda:0 stays current. An event recorded on the current device's stream there would "complete" at once and
hide nothing (the bug upstream's reviewers caught). Skipped without two CUDA devices.
"""

from __future__ import annotations

import unittest
from unittest import mock

import torch
from parameterized import parameterized

from models import PAD, TRANSFORMERS_VERSION, build, prompt, stock

TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2

# tiny Llama: embeddings and first layer on one GPU, second layer, norm and head on the other
LAYOUTS = {
    "embed_on_0": {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1,
                   "model.norm": 1, "lm_head": 1},
    "embed_on_1": {"model.embed_tokens": 1, "model.rotary_emb": 1, "model.layers.0": 1, "model.layers.1": 0,
                   "model.norm": 0, "lm_head": 0},
}


def split(layout: str):
    from accelerate import dispatch_model

    model = build("llama")
    device_map = LAYOUTS[layout]
    model = dispatch_model(model, device_map=device_map)
    model.hf_device_map = device_map  # what `from_pretrained(device_map=...)` sets; static caches place layers by it
    return model, torch.device("cuda", device_map["model.embed_tokens"])


@unittest.skipUnless(TWO_GPUS, "needs two CUDA devices")
class DeviceMapFlagOnEqualsStock(unittest.TestCase):
    def setUp(self):
        torch.cuda.set_device(0)

    @parameterized.expand([
        (layout, sampling, padded, cache)
        for layout in LAYOUTS
        for sampling in (False, True)
        for padded in (False, True)
        for cache in ("dynamic", "static")
    ])
    def test_outputs_match_stock(self, layout, sampling, padded, cache):
        from test_cuda import check_decode_matches_stock

        model, device = split(layout)
        check_decode_matches_stock(self, model, device, sampling, padded, cache)

    @parameterized.expand([(layout,) for layout in LAYOUTS])
    def test_no_blocking_sync_per_step(self, layout):
        from test_cuda import syncs_per_step

        model, device = split(layout)
        ids, mask = prompt(batch=2, left_pad=True, device=device)
        with stock():
            stock_syncs = syncs_per_step(model, ids, mask)
        on_syncs = syncs_per_step(model, ids, mask, async_stopping_criteria=True)
        print(f"\nSYNCS transformers={'.'.join(map(str, TRANSFORMERS_VERSION))} case=device_map_{layout} "
              f"stock={stock_syncs:.2f} flag_on={on_syncs:.2f}")
        self.assertEqual(on_syncs, 0.0)
        self.assertGreaterEqual(stock_syncs, 1.0)

    @parameterized.expand([(layout,) for layout in LAYOUTS])
    def test_controller_lives_on_the_input_device(self, layout):
        from transformers_async_stop.control import controller as stop_check

        model, device = split(layout)
        ids, mask = prompt(batch=2, device=device)
        seen = []
        real_init = stop_check.AsyncStop.__init__

        def spy(self, *args, **kwargs):
            real_init(self, *args, **kwargs)
            seen.append(self)

        with mock.patch.object(stop_check.AsyncStop, "__init__", spy):
            model.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=PAD, eos_token_id=None,
                           async_stopping_criteria=True)
        self.assertEqual(len(seen), 1)
        ctl = seen[0]
        self.assertEqual(ctl.device, device)
        self.assertEqual(ctl.main.device, device)
        self.assertEqual(ctl.side.device, device)
        self.assertEqual(torch.cuda.current_device(), 0, "generate() changed the caller's current device")
        self.assertEqual(torch.cuda.current_stream(device), ctl.main, "the input device's stream was not given back")


if __name__ == "__main__":
    unittest.main()
