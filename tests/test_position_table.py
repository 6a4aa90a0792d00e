"""The undone extra step never runs a forward past the model's learned absolute position table.

GPT-2's `wpe` (n_positions) and OPT's `embed_positions` (max_position_embeddings, ids offset by 2) have one row per
position: stock stops on EOS made at the table's last position and returns, where a forward one position further
raises IndexError (on CUDA a device-side assert that kills the context). The flag must read that verdict before it.
"""

import unittest

import torch
import transformers as T
from parameterized import parameterized

import transformers_async_stop as tas
from models import TRANSFORMERS_VERSION, stock

TABLE = 12
PROMPT = 6


def gpt2():
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_embd=16, n_layer=2, n_head=2, n_positions=TABLE, initializer_range=0.5, vocab_size=48,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    return T.GPT2LMHeadModel(cfg).eval()


def opt():
    torch.manual_seed(0)
    cfg = T.OPTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32,
                      max_position_embeddings=TABLE, vocab_size=48, word_embed_proj_dim=16, init_std=0.5,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "sdpa"
    return T.OPTForCausalLM(cfg).eval()


# "deferred": transformers' own loop (hidden states keep a call off the package's loops)
CASES = [(f"{fam}_{mode}_{'sample' if s else 'greedy'}", fam, mode, s)
         for fam in ("gpt2", "opt") for mode in ("static", "dynamic", "deferred") for s in (False, True)]


class ExtraStepStaysInsidePositionTable(unittest.TestCase):
    def _eos_at_last_position(self, model, cache, sample):
        """A prompt, seed and EOS id such that stock makes EOS first at the table's last position."""
        for seed in range(1, 40):
            ids = torch.randint(3, 48, (1, PROMPT), generator=torch.Generator().manual_seed(seed))
            kw = dict(do_sample=sample, pad_token_id=0, eos_token_id=None, cache_implementation=cache)
            with stock():
                torch.manual_seed(seed)
                base = model.generate(ids, max_length=TABLE + 1, **kw)
            eos = int(base[0, -1])
            if eos not in base[0, :-1].tolist():
                return ids, eos, seed
        self.skipTest("no prompt makes a fresh token at the table's last position")

    @parameterized.expand(CASES)
    def test_eos_at_last_position_returns_as_stock(self, _, family, mode, sample):
        model = gpt2() if family == "gpt2" else opt()
        cache = "static" if mode == "static" else None
        ids, eos, seed = self._eos_at_last_position(model, cache, sample)
        kw = dict(max_new_tokens=20, do_sample=sample, pad_token_id=0, eos_token_id=eos, cache_implementation=cache,
                  return_dict_in_generate=True, output_scores=True, output_hidden_states=mode == "deferred")
        with stock():
            torch.manual_seed(seed)
            want = model.generate(ids, **kw)
            want_rng = torch.rand(3)
        self.assertEqual(want.sequences.shape[1], TABLE + 1)
        torch.manual_seed(seed)
        got = model.generate(ids, async_stopping_criteria=True, **kw)
        got_rng = torch.rand(3)
        described = tas.last_path().describe()
        # before 5.17 there is no static-cache loop: a static cache takes the deferred path, which reads it at once
        if mode == "static" and TRANSFORMERS_VERSION >= (5, 17):
            self.assertIn("static loop", described)
        else:  # the verdict before the forward past the table was read at once, and the report says why
            self.assertIn("position table holds 12 positions", described)
        torch.testing.assert_close(got.sequences, want.sequences, rtol=0, atol=0)
        self.assertEqual(len(got.scores), len(want.scores))
        for a, b in zip(got.scores, want.scores):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(got_rng, want_rng, rtol=0, atol=0)

    @parameterized.expand([("gpt2",), ("opt",)])
    def test_reused_cache_fed_new_tokens_counts_positions_from_cache(self, family):
        """Positions come from the cache: a second turn's input is shorter than the positions it reaches."""
        model = gpt2() if family == "gpt2" else opt()
        for seed in range(1, 40):
            ids = torch.randint(3, 48, (1, 4), generator=torch.Generator().manual_seed(seed))
            with stock():
                first = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None,
                                       return_dict_in_generate=True)
                full = model.generate(ids, max_length=TABLE + 1, do_sample=False, pad_token_id=0, eos_token_id=None)
            eos = int(full[0, -1])
            if eos not in full[0, :-1].tolist():
                break
        else:
            self.skipTest("no prompt makes a fresh token at the table's last position")
        cache_len = first.past_key_values.get_seq_length()
        results = []
        for flag in (False, True):
            import copy
            cache = copy.deepcopy(first.past_key_values)
            kw = dict(past_key_values=cache, max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=eos)
            if flag:
                results.append(model.generate(first.sequences, async_stopping_criteria=True, **kw))
            else:
                with stock():
                    results.append(model.generate(first.sequences, **kw))
        self.assertEqual(cache_len, 6)
        torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


if __name__ == "__main__":
    unittest.main()
