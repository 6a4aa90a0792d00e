"""The flag under the SDPA backend settings a user may choose against cold attention lengths (README, "Slow calls at
prompt lengths the process has not met"): with cuDNN's SDPA turned off for both sides, or on, the flag's tokens and
logits equal flag-off's in the same process and settings. CUDA only (the CPU has no cuDNN attention); a bf16 model
whose heads are 64 wide, the shape cuDNN's SDPA takes, greedy, over prompt lengths the process meets for the first
time and again."""

from __future__ import annotations

import unittest

import torch
from parameterized import parameterized
from transformers import LlamaConfig, LlamaForCausalLM

import transformers_async_stop as tas
from models import TRANSFORMERS_VERSION, stock

CUDA = torch.cuda.is_available() and (5, 17) <= TRANSFORMERS_VERSION


def _model():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, initializer_range=0.5)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


def _run(model, length, flag):
    ids = (torch.arange(length, device="cuda") * 37 % 500 + 3)[None]
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                  pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    if flag:
        kwargs["async_stopping_criteria"] = True
    out = model.generate(ids, **kwargs)
    return out.sequences, torch.stack(out.logits)


@unittest.skipUnless(CUDA, "needs CUDA and transformers 5.17+")
class FlagUnderAttentionBackendSettingsCuda(unittest.TestCase):
    @parameterized.expand([("cudnn_sdp_off", False), ("cudnn_sdp_on", True)])
    def test_the_flag_equals_flag_off_under_the_setting(self, _, cudnn):
        was = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        try:
            model = _model()
            for length in (37, 53, 37):  # new lengths, then lengths met before
                with stock():
                    ref = _run(model, length, False)
                out = _run(model, length, True)
                self.assertTrue(torch.equal(ref[0], out[0]), f"length {length}: sequences differ")
                self.assertTrue(torch.equal(ref[1], out[1]), f"length {length}: logits differ")
            self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(was)


if __name__ == "__main__":
    unittest.main()
