"""The undone extra step never runs a forward past a table the model's forward reads by position.

GPT-2's `wpe` (n_positions) and OPT's `embed_positions` (max_position_embeddings, ids offset by 2) have one row per
position: stock stops on EOS made at the table's last position and returns, where a forward one position further
raises IndexError (on CUDA a device-side assert that kills the context). The flag must read that verdict before it.
The same holds for tables found only from what the forward reads (`undo/position_reads.py`): GPT-J's and CodeGen's
sin/cos buffer, CTRL's encoding buffer, MPT's alibi (a shape error past `max_seq_len`), and for calls without a cache.
"""

import unittest
from unittest import mock

import torch
import transformers as T
from parameterized import parameterized
from transformers import StoppingCriteria, StoppingCriteriaList

import transformers_async_stop as tas
from models import TRANSFORMERS_VERSION, stock
from transformers_async_stop.undo import position_reads

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


# -- tables found from what the forward reads (issue 43 item 6) -------------------------------------------------------
# tiny models whose tables end early: 24 positions (GPT-J, CodeGen, CTRL, GPT-2, OPT, GPT-Neo, GPT-BigCode), 32 (MPT)
_SMALL = {
    "gptj": lambda: T.GPTJForCausalLM(T.GPTJConfig(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=24,
                                                   vocab_size=64)),
    "codegen": lambda: T.CodeGenForCausalLM(T.CodeGenConfig(n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                                            n_positions=24, n_ctx=24, vocab_size=64)),
    "mpt": lambda: T.MptForCausalLM(T.MptConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=32, vocab_size=64)),
    "ctrl": lambda: T.CTRLLMHeadModel(T.CTRLConfig(n_embd=32, n_layer=2, n_head=4, dff=64, n_positions=24,
                                                   vocab_size=64)),
    "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=24, vocab_size=64)),
    "opt": lambda: T.OPTForCausalLM(T.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                ffn_dim=64, max_position_embeddings=24, vocab_size=64,
                                                word_embed_proj_dim=32)),
    "gpt_neo": lambda: T.GPTNeoForCausalLM(T.GPTNeoConfig(hidden_size=32, num_layers=2, num_heads=4,
                                                          attention_types=[[["global", "local"], 1]],
                                                          max_position_embeddings=24, vocab_size=64, window_size=8)),
    "gpt_bigcode": lambda: T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(n_embd=32, n_layer=2, n_head=4, n_positions=24,
                                                                      vocab_size=64)),
    # alibi without a table: its bias is built from the mask, as long as the key
    "bloom": lambda: T.BloomForCausalLM(T.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=64)),
    "falcon_alibi": lambda: T.FalconForCausalLM(T.FalconConfig(hidden_size=32, num_hidden_layers=2,
                                                               num_attention_heads=4, vocab_size=64, alibi=True,
                                                               new_decoder_architecture=False, multi_query=True,
                                                               max_position_embeddings=24)),
}


def small(family):
    torch.manual_seed(0)
    return _SMALL[family]().eval()


class StopsAtLength(StoppingCriteria):
    """Every row is finished once the sequence is `length` long: stock's last step is the one making that token."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool,
                          device=input_ids.device)


def run_both(model, length, batch=1, seed=0, mask=None, context=None, **kwargs):
    """(stock's result or exception type, the flag's, the flag's path): prompt of 8, up to 40 new tokens."""
    ids = torch.randint(3, 64, (batch, 8), generator=torch.Generator().manual_seed(seed))
    if mask is not None:
        kwargs["attention_mask"] = mask
    kw = dict(max_new_tokens=40, do_sample=False, pad_token_id=0,
              stopping_criteria=StoppingCriteriaList([StopsAtLength(length)]), **kwargs)
    results = []
    for flag in (False, True):
        torch.manual_seed(seed)
        try:
            if flag:
                with context() if context is not None else torch.no_grad():
                    out = model.generate(ids, async_stopping_criteria=True, **kw)
            else:
                with stock(), context() if context is not None else torch.no_grad():
                    out = model.generate(ids, **kw)
        except (IndexError, RuntimeError) as exc:
            out = type(exc)
        results.append(out)
    return results[0], results[1], tas.last_path().describe()


class ExtraStepStaysInsideObservedTables(unittest.TestCase):
    """Stock stops at the table's last position and returns; the flag returns the same, reading that verdict at once.
    One position further, stock's own next forward raises, and so does the flag's."""

    def _returns_as_stock(self, want, got, described, positions):
        self.assertIsInstance(want, torch.Tensor, "stock returns at the table's last position")
        self.assertIsInstance(got, torch.Tensor, f"the flag raised {got} where stock returns ({described})")
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        if not described.startswith("stock"):  # a release whose module keeps state on itself runs stock's loop
            self.assertIn(f"position table holds {positions} positions", described)

    def _raises_as_stock(self, want, got):
        self.assertTrue(isinstance(want, type) and issubclass(want, Exception), "stock raises one position further")
        self.assertIs(got, want)

    def test_stop_at_gptj_sin_cos_table_end_returns_as_stock(self):
        model = small("gptj")  # `embed_positions`: a sin/cos buffer of 24 rows, indexed by position ids
        self._returns_as_stock(*run_both(model, 25), positions=24)
        want, got, _ = run_both(model, 26)
        self._raises_as_stock(want, got)  # IndexError: index 24 is out of bounds for dimension 0 with size 24

    def test_stop_at_codegen_sin_cos_table_end_returns_as_stock(self):
        self._returns_as_stock(*run_both(small("codegen"), 25), positions=24)

    def test_stop_at_ctrl_encoding_buffer_end_returns_as_stock(self):
        self._returns_as_stock(*run_both(small("ctrl"), 25), positions=24)  # `pos_encoding`, a buffer

    @parameterized.expand([("model_default_no_cache", None), ("cache", True)])
    def test_stop_at_mpt_alibi_end_returns_as_stock(self, _, use_cache):
        """MPT builds its alibi to `max_seq_len` and cuts it to the key length: one key longer fails to broadcast."""
        model = small("mpt")
        kw = {} if use_cache is None else dict(use_cache=use_cache)
        self._returns_as_stock(*run_both(model, 33, **kw), positions=32)
        want, got, _ = run_both(model, 34, **kw)
        self._raises_as_stock(want, got)  # RuntimeError: The size of tensor a (33) must match ... (32)

    @parameterized.expand([("gpt2",), ("opt",), ("gpt_neo",), ("gpt_bigcode",)])
    def test_stop_at_table_end_without_cache_returns_as_stock(self, family):
        """`use_cache=False`: every forward runs over the whole sequence, its positions counted from it."""
        self._returns_as_stock(*run_both(small(family), 25, use_cache=False), positions=24)

    @parameterized.expand([("gptj",), ("mpt",)])
    def test_left_padded_batch_stops_at_table_end_as_stock(self, family):
        """The attention mask, read by position in every padded forward, is no table; the model's own is."""
        mask = torch.ones(2, 8, dtype=torch.long)
        mask[0, :3] = 0
        length, positions = (33, 32) if family == "mpt" else (25, 24)
        self._returns_as_stock(*run_both(small(family), length, batch=2, mask=mask), positions=positions)

    @parameterized.expand([("gptj",), ("mpt",)])
    def test_table_found_inside_inference_mode_returns_as_stock(self, family):
        length, positions = (33, 32) if family == "mpt" else (25, 24)
        self._returns_as_stock(*run_both(small(family), length, context=torch.inference_mode), positions=positions)

    def test_changed_alibi_length_is_observed_again(self):
        """A model changed between calls (MPT's `max_seq_len` edited: its alibi is built from it) is observed again
        at its next call; one unchanged is not observed at all."""
        model = small("mpt")
        self._returns_as_stock(*run_both(model, 33), positions=32)
        model.config.max_seq_len = 24
        self._returns_as_stock(*run_both(model, 25), positions=24)
        with mock.patch.object(position_reads.PositionReads, "__torch_function__", autospec=True,
                               side_effect=AssertionError("a known model was observed")):
            self._returns_as_stock(*run_both(model, 25, seed=1), positions=24)

    def test_prompt_filling_the_alibi_then_a_shorter_one_stops_as_stock(self):
        """A first call whose prompt fills MPT's alibi exactly cuts nothing, so it shows no table: that observation
        stays provisional (the longest length is the size of a tensor the forward used), and the next call, shorter,
        is observed again and finds it."""
        model = small("mpt")
        full = torch.randint(3, 64, (1, 32), generator=torch.Generator().manual_seed(0))
        model.generate(full, max_new_tokens=1, do_sample=False, pad_token_id=0, async_stopping_criteria=True)
        self._returns_as_stock(*run_both(model, 33), positions=32)

    @parameterized.expand([("bloom",), ("falcon_alibi",)])
    def test_alibi_built_from_the_mask_is_no_table(self, family):
        """BLOOM's and Falcon's alibi is as long as the key: nothing stops the extra step (a guard: no false table)."""
        want, got, described = run_both(small(family), 40)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        self.assertNotIn("position table", described)
        self.assertTrue(described.startswith("deferred"), described)


class PositionsWithAFixedFill(unittest.TestCase):
    """4.57's input preparation fills the padded rows' positions with 1 (`position_ids.masked_fill_(attention_mask ==
    0, 1)`): a value that does not grow is no nearer a table's end one forward later, so the table keeps all its
    positions (it was one short: the verdict at the last position was read a step early)."""

    def test_a_fixed_fill_of_the_positions_adds_no_offset(self):
        table = torch.randn(12, 4)
        mask = torch.ones(1, 6, dtype=torch.long)
        with position_reads.PositionReads([table], [(mask, position_reads.MASK)]) as reads:
            positions = mask.cumsum(-1) - 1
            positions.masked_fill_(mask == 0, 1)
            torch.nn.functional.embedding(positions, table)
        self.assertIsNone(reads.failed)
        self.assertEqual(reads.index_reads, [(12, 0)])

    def test_a_growing_offset_still_counts(self):
        table = torch.randn(12, 4)
        mask = torch.ones(1, 6, dtype=torch.long)
        with position_reads.PositionReads([table], [(mask, position_reads.MASK)]) as reads:
            positions = (mask.cumsum(-1) + 1).masked_fill(mask == 0, 1)  # OPT's offset of 2 from a count
            torch.nn.functional.embedding(positions, table)
        self.assertEqual(reads.index_reads, [(12, 2)])


if __name__ == "__main__":
    unittest.main()
