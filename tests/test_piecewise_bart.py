"""The graphed decoder forward of BART and its modular copies (mBART, Marian, Pegasus), read by hand
(`graphs/piecewise/proof/family.py` FAMILIES, the digests of "piecewise forward (bart)" and the others in
`targets/piecewise_bart_rows.py`, 5.17.0-5.24.0).

A decode step runs two attention sites per layer (the self-attention's cache update, then the cross-attention over
the cross-attention cache's keys and values), as Whisper's. Two things differ from Whisper's decoder, and are what
these tests pin down:
- **positions**: the decoder takes no `position_ids`; it makes them from the cache's host length and hands them to
  its position table's call. The recording hands that call the positions buffer instead, which each replay fills from
  the same host length: a continued cache, a stop at the table's last row, a table class replaced (before or during
  the call) must all equal stock;
- **the cross-attention mask**: made from the encoder's `attention_mask` by `create_bidirectional_mask` at every step
  in stock; every replay makes it again with stock's function from the step's own mask, so a padded encoder batch, a
  mask of ones, no mask, and a mask edited in place mid-call by user code all equal stock.

Each case against unpatched transformers (sequences, scores, logits, the returned cache, the RNG state after the
call), two calls each (the second replays the first's recording); on CUDA (skipped without it) and on the CPU with
the graphs emulated.
"""

from __future__ import annotations

import os
import unittest
from unittest import mock

import torch
from parameterized import parameterized
from transformers import StoppingCriteria, StoppingCriteriaList

import transformers_async_stop as tas
from encoder_decoder_steps import assert_steps_equal_stock
from models import TRANSFORMERS_VERSION, assert_same, stock
from test_dynamic_loop_encoder_decoder import build
from transformers_async_stop.graphs.piecewise import forward, proof
from transformers_async_stop.release_checks import cache_kwarg
from transformers_async_stop.release_checks.verified import matches

ON = {proof.PIECEWISE_ENV: "1"}
FAMILY_NAMES = ("bart", "mbart", "marian", "pegasus", "blenderbot", "blenderbot_small")
READ = (5, 17) <= TRANSFORMERS_VERSION[:2] <= (5, 24) and all(
    matches(f"piecewise forward ({name})") for name in FAMILY_NAMES)
TAKEN = READ and matches("dynamic decode loop")
CUDA = torch.cuda.is_available() and TAKEN
NEW = 8  # new tokens per call
PIECES = "graphed (5 pieces)"  # two decoder layers, two attention sites each


def model_of(family, device="cpu", dtype=torch.float32):
    return build(family).to(device=device, dtype=dtype)


def source(batch: int, device="cpu"):
    return torch.randint(3, 30, (batch, 7), generator=torch.Generator().manual_seed(1)).to(device)


# the encoder's attention_mask: none, all ones (stock's SDPA skip check drops it: None), left-padded (a 4D bool mask)
MASKS = {"no_mask": None, "ones": "ones", "padded": "padded"}


def encoder_mask(kind, ids):
    if kind is None:
        return None
    mask = torch.ones_like(ids)
    if kind == "padded":
        mask[0, :3] = 0
    return mask


def _generate(model, ids, flag, seed, new=NEW, mask=None, **kwargs):
    torch.manual_seed(seed)
    flag_kwargs = {} if flag is None else dict(async_stopping_criteria=flag)
    if mask is not None:
        kwargs["attention_mask"] = mask
    out = model.generate(ids, max_new_tokens=new, return_dict_in_generate=True, output_scores=True,
                         output_logits=True, **kwargs, **flag_kwargs)
    return out, torch.rand(4, device=ids.device)


def check_against_stock(test, model, ids, seed=7, **kwargs):
    with stock():
        ref, ref_after = _generate(model, ids, None, seed, **kwargs)
    out, after = _generate(model, ids, True, seed, **kwargs)
    assert_same(test, ref, out)
    test.assertIsNotNone(cache_kwarg.of_output(out))
    test.assertTrue(torch.equal(ref_after, after), "RNG state after generate() differs")
    return out


CASES = [(f"{family}_{name}", family, batch, mask, extra)
         for family in FAMILY_NAMES
         for name, batch, mask, extra in (
             ("b1_greedy", 1, None, {}),
             ("b2_greedy_ones", 2, "ones", {}),
             ("b2_sample_padded", 2, "padded", dict(do_sample=True, top_k=10)),
         )]


class _BartCases:
    """Each case on a device: CUDA, and the CPU with the graphs emulated."""

    DEVICE = "cuda"
    DTYPES = (("fp32", torch.float32),)

    @parameterized.expand(CASES)
    def test_two_calls_equal_stock_and_replay(self, _, family, batch, mask, extra):
        for dtype_name, dtype in self.DTYPES:
            model = model_of(family, self.DEVICE, dtype)
            ids = source(batch, self.DEVICE)
            for call in range(2):  # the second call replays the first call's recording
                # every row generates its whole budget (a sampled EOS would end the call before its steps replay)
                check_against_stock(self, model, ids, mask=encoder_mask(mask, ids), min_new_tokens=NEW, **extra)
                path = tas.last_path()
                self.assertTrue(path.describe().startswith("deferred, dynamic loop, forward graphed"),
                                (dtype_name, call, path.describe()))
                self.assertEqual(path.forward, f"{PIECES}: {NEW - 1} decode steps", (dtype_name, call))

    def test_a_continued_cache_gets_its_positions_from_the_cache(self):
        # the second call's decode steps start past the first call's tokens: positions from the cache's length
        model = model_of("bart", self.DEVICE)
        ids = source(2, self.DEVICE)
        mask = encoder_mask("padded", ids)

        def run(flag):
            flag_kwargs = {} if flag is None else dict(async_stopping_criteria=flag)
            first = model.generate(ids, attention_mask=mask, max_new_tokens=5, return_dict_in_generate=True,
                                   **flag_kwargs)
            second = model.generate(ids, attention_mask=mask, decoder_input_ids=first.sequences, max_new_tokens=6,
                                    return_dict_in_generate=True, output_scores=True,
                                    **{cache_kwarg.name(): cache_kwarg.of_output(first)}, **flag_kwargs)
            return first, second

        with stock():
            torch.manual_seed(7)
            ref = run(None)
        torch.manual_seed(7)
        out = run(True)
        assert_same(self, ref, out)
        self.assertEqual(tas.last_path().forward, f"{PIECES}: 5 decode steps")

    def test_one_recording_serves_every_source_length(self):
        # no piece reads the encoder's length (the cross-attentions and their mask run eagerly on the step's own
        # tensors): a call with a longer source replays the first call's recording (T5's bakes it: its own test)
        model = model_of("bart", self.DEVICE)
        for length in (7, 11, 4):
            ids = torch.randint(3, 30, (2, length), generator=torch.Generator().manual_seed(length)).to(self.DEVICE)
            check_against_stock(self, model, ids, mask=encoder_mask("padded", ids), min_new_tokens=NEW)
            self.assertEqual(tas.last_path().forward, f"{PIECES}: {NEW - 1} decode steps")
            self.assertEqual(len(forward.graphs_of(model).recordings), 1, length)

    def test_a_call_up_to_the_position_tables_last_row_equals_stock(self):
        # BART's learned table holds max_position_embeddings (64) rows past its offset of 2: a call of 64 decoder
        # positions ends at the last one (the extra step after a stop there is the controller's to refuse)
        model = model_of("bart", self.DEVICE)
        self.assertEqual(model.model.decoder.embed_positions.weight.shape[0], 66)
        for _ in range(2):
            out = check_against_stock(self, model, source(2, self.DEVICE), new=63)
            self.assertEqual(out.sequences.shape[1], 64)
            self.assertEqual(tas.last_path().forward, f"{PIECES}: 62 decode steps")

    def test_an_encoder_mask_edited_in_place_mid_call_equals_stock(self):
        # stock's decoder makes the cross-attention mask from the caller's tensor at every step; a criterion that
        # masks a source position after step 3 changes the rest of the call in both runs alike
        model = model_of("marian", self.DEVICE)
        ids = source(2, self.DEVICE)

        class MaskAfter(StoppingCriteria):
            def __init__(self, mask):
                self.mask, self.calls = mask, 0

            def __call__(self, input_ids, scores, **kwargs):
                self.calls += 1
                if self.calls == 3:
                    self.mask[1, :4] = 0
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        def run(flag):
            mask = torch.ones_like(ids)
            return _generate(model, ids, flag, 7, mask=mask, stopping_criteria=StoppingCriteriaList([MaskAfter(mask)]))

        with stock():
            ref, ref_after = run(None)
        out, after = run(True)
        assert_same(self, ref, out)
        self.assertTrue(torch.equal(ref_after, after))
        self.assertTrue(tas.last_path().forward.startswith(f"{PIECES}: "), tas.last_path().forward)
        # the edit changed stock's outputs: the test can fail
        with stock():
            plain, _ = _generate(model, ids, None, 7, mask=torch.ones_like(ids))
        self.assertFalse(all(torch.equal(a, b) for a, b in zip(plain.logits, ref.logits)))

    def test_a_user_module_in_the_decoder_keeps_it_eager_named(self):
        model = model_of("pegasus", self.DEVICE)

        class MyLinear(torch.nn.Linear):
            pass

        fc1 = model.model.decoder.layers[1].fc1
        mine = MyLinear(fc1.in_features, fc1.out_features, device=self.DEVICE).eval()
        mine.load_state_dict(fc1.state_dict())
        model.model.decoder.layers[1].fc1 = mine
        check_against_stock(self, model, source(2, self.DEVICE))
        forward_path = tas.last_path().forward
        self.assertTrue(forward_path.startswith("eager: model.decoder.layers.1.fc1 ("), forward_path)
        self.assertIn("MyLinear", forward_path)

    def test_a_user_module_in_the_encoder_does_not_keep_the_decoder_eager(self):
        model = model_of("bart", self.DEVICE)

        class MyLinear(torch.nn.Linear):
            pass

        fc1 = model.model.encoder.layers[0].fc1
        mine = MyLinear(fc1.in_features, fc1.out_features, device=self.DEVICE).eval()
        mine.load_state_dict(fc1.state_dict())
        model.model.encoder.layers[0].fc1 = mine
        for _ in range(2):
            check_against_stock(self, model, source(2, self.DEVICE))
            self.assertTrue(tas.last_path().forward.startswith(f"{PIECES}: "), tas.last_path().forward)

    def test_a_position_table_forward_replaced_before_the_call_keeps_it_eager_named(self):
        model = model_of("bart", self.DEVICE)
        table = type(model.model.decoder.embed_positions)
        original = table.forward

        def shifted(self, input_ids, cache_length=0, position_ids=None):  # a user's table: one row further
            return original(self, input_ids, cache_length + 1,
                            position_ids=None if position_ids is None else position_ids + 1)

        with mock.patch.object(table, "forward", shifted):
            check_against_stock(self, model, source(2, self.DEVICE))
        forward_path = tas.last_path().forward
        self.assertTrue(forward_path.startswith("eager: "), forward_path)
        # named by the digest of the family's sources (the class's `forward` is one of them) or, where an earlier call
        # in the process saw the class's own, as a rebound name
        self.assertTrue("BartLearnedPositionalEmbedding" in forward_path
                        or forward_path == "eager: transformers' bart sources are not the ones read", forward_path)

    def test_a_position_table_forward_replaced_mid_call_equals_stock(self):
        model = model_of("bart", self.DEVICE)
        table = type(model.model.decoder.embed_positions)
        original = table.forward

        def shifted(self, input_ids, cache_length=0, position_ids=None):
            return original(self, input_ids, cache_length + 1,
                            position_ids=None if position_ids is None else position_ids + 1)

        class ReplaceAt(StoppingCriteria):
            def __init__(self):
                self.calls = 0

            def __call__(self, input_ids, scores, **kwargs):
                self.calls += 1
                if self.calls == 3:
                    table.forward = shifted
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        ids = source(2, self.DEVICE)
        try:
            with stock():
                ref, ref_after = _generate(model, ids, None, 7, stopping_criteria=StoppingCriteriaList([ReplaceAt()]))
            table.forward = original
            check_against_stock(self, model, ids)  # recorded with the original table
            out, after = _generate(model, ids, True, 7, stopping_criteria=StoppingCriteriaList([ReplaceAt()]))
        finally:
            table.forward = original
        assert_same(self, ref, out)
        self.assertTrue(torch.equal(ref_after, after))
        self.assertIn("eager", tas.last_path().forward)

    def test_the_forward_carries_the_encoder_outputs_and_equals_stock_step_by_step(self):
        model = model_of("mbart", self.DEVICE)
        ids = source(2, self.DEVICE)
        mask = encoder_mask("padded", ids)
        with torch.no_grad():
            encoder = model.model.encoder(input_ids=ids, attention_mask=mask)
        prompt = torch.tensor([[2, 5, 6], [2, 7, 8]], device=self.DEVICE)
        assert_steps_equal_stock(self, model, encoder, prompt, PIECES, extra={"attention_mask": mask})

@unittest.skipUnless(CUDA, "needs a CUDA device and transformers 5.17-5.24")
@mock.patch.dict(os.environ, ON)
class BartOnCuda(_BartCases, unittest.TestCase):
    DEVICE = "cuda"
    DTYPES = (("fp32", torch.float32), ("bf16", torch.bfloat16))

    def test_a_graphed_decode_step_blocks_on_no_sync_but_stocks_encoder_mask_check(self):
        # torch's sync debug mode over a 16-token call minus a 1-token call, warm: without an encoder mask no step
        # waits on the device; with one, each step keeps stock's own check of it (`_ignore_bidirectional_mask_sdpa`).
        # One sync a call besides is allowed: GPU call 2 of 2026-11-29 (session 4) counted one in 15 steps here, not
        # in `encdec_syncs.py` (0 in 15), as Whisper's tiny model there counts one a call (0.07 a step)
        from models import count_syncs

        model = model_of("bart", self.DEVICE)
        ids = source(1, self.DEVICE)
        for mask, per_step in ((None, 0), (torch.ones_like(ids), 1)):
            kwargs = {} if mask is None else dict(attention_mask=mask)

            def run(n):
                return model.generate(ids, max_new_tokens=n, min_new_tokens=n, async_stopping_criteria=True, **kwargs)

            run(16), run(1)
            steps = count_syncs(lambda: run(16)) - count_syncs(lambda: run(1))
            self.assertIn(steps, (15 * per_step, 15 * per_step + 1), mask is not None)
            run(16)
            self.assertEqual(tas.last_path().forward, f"{PIECES}: 15 decode steps")


@unittest.skipUnless(TAKEN, "the BART rows' releases (5.17-5.24)")
@mock.patch.dict(os.environ, ON)
class BartEmulatedOnCpu(_BartCases, unittest.TestCase):
    """The same cases on the CPU, each CUDA graph emulated by its piece's recorded ATen ops."""

    DEVICE = "cpu"

    def setUp(self):
        from transformers_async_stop.testing.emulation import emulated

        self.enterContext(emulated())


@mock.patch.dict(os.environ, ON)
class BartFamilies(unittest.TestCase):
    """Where BART and its copies are read, and what the rest keep (on the CPU every reason but the device's is told)."""

    @parameterized.expand([(name,) for name in FAMILY_NAMES])
    @unittest.skipUnless(READ, "the BART rows' releases (5.17-5.24)")
    def test_each_is_a_read_family_refused_on_the_cpu_only_for_the_device(self, name):
        model = build(name)
        family, why = proof.family.find(model)
        self.assertIsNone(why)
        self.assertEqual((family.name, family.auto), (name, False))
        decoder = model.model.decoder
        self.assertEqual(family.attentions(model.model, model.config),
                         [decoder.layers[0].self_attn, decoder.layers[0].encoder_attn,
                          decoder.layers[1].self_attn, decoder.layers[1].encoder_attn])
        self.assertIs(model.get_submodule(family.position_table), decoder.embed_positions)
        with torch.no_grad():
            self.assertEqual(proof.why_not_model(model, model.__call__), "not CUDA (cpu)")

    @unittest.skipUnless(TAKEN, "the BART rows' releases (5.17-5.24)")
    def test_a_rebound_cross_mask_function_mid_call_equals_stock(self):
        # the modeling module's `create_bidirectional_mask` is looked up by every replay, and watched: a user's
        # function set by a criterion reaches the rest of the call in both runs alike
        import transformers.models.bart.modeling_bart as modeling

        from transformers_async_stop.testing.emulation import emulated

        model = build("bart")
        ids = source(2)
        original = modeling.create_bidirectional_mask
        seen = []

        def everything_masked_but_the_first(**kwargs):  # a user's mask: only the first source position visible
            seen.append(1)
            made = torch.zeros((ids.shape[0], 1, 1, ids.shape[1]), dtype=torch.bool)
            made[..., 0] = True
            return made

        class RebindAt(StoppingCriteria):
            def __init__(self):
                self.calls = 0

            def __call__(self, input_ids, scores, **kwargs):
                self.calls += 1
                if self.calls == 3:
                    modeling.create_bidirectional_mask = everything_masked_but_the_first
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        try:
            with stock():
                ref, ref_after = _generate(model, ids, None, 7, mask=torch.ones_like(ids),
                                           stopping_criteria=StoppingCriteriaList([RebindAt()]))
            modeling.create_bidirectional_mask = original
            stock_calls, seen[:] = len(seen), []
            with emulated():
                out, after = _generate(model, ids, True, 7, mask=torch.ones_like(ids),
                                       stopping_criteria=StoppingCriteriaList([RebindAt()]))
        finally:
            modeling.create_bidirectional_mask = original
        assert_same(self, ref, out)
        self.assertTrue(torch.equal(ref_after, after))
        self.assertTrue(stock_calls)
        self.assertTrue(seen)
        self.assertTrue(tas.last_path().forward.startswith("graphed"), tas.last_path().forward)


class EncoderDecoderBenchCases(unittest.TestCase):
    def test_the_bart_case_is_opt_in_bart_base_shaped_and_runs_tiny_on_cpu_equal_to_stock(self):
        from test_bench import run_bench
        from transformers_async_stop.bench import catalog

        builtin = catalog.builtin_cases()
        from transformers_async_stop.bench.encoder_decoder_cases import bart_config

        self.assertTrue(builtin["bart-base"].opt_in)
        base = bart_config()  # what CUDA builds (not built here: 140M parameters)
        self.assertEqual((base.d_model, base.encoder_layers, base.decoder_layers, base.vocab_size,
                          base.max_position_embeddings), (768, 6, 6, 50265, 1024))
        code, result, _, _ = run_bench(["--cases", "bart-base", "--variants", "stock,async", "--reps", "1",
                                        "--new-tokens", "6"], builtin)
        self.assertEqual(code, 0)
        (run,) = [r for r in result["runs"] if r["case"] == "bart-base"]
        self.assertEqual(run["label"], "bart-base eager b1")
        self.assertIsNone(run["error"])
        self.assertIs(run["variants"]["async"]["exact"], True)
        if TAKEN:
            self.assertIn("dynamic loop", run["variants"]["async"]["path"])

    def test_the_t5_case_is_opt_in_t5_base_shaped_and_runs_tiny_on_cpu_equal_to_stock(self):
        from test_bench import run_bench
        from transformers_async_stop.bench import catalog
        from transformers_async_stop.bench.encoder_decoder_cases import t5_config

        builtin = catalog.builtin_cases()
        self.assertTrue(builtin["t5-base"].opt_in)
        base = t5_config()  # what CUDA builds (not built here: 220M parameters)
        self.assertEqual((base.d_model, base.num_layers, base.num_decoder_layers, base.num_heads, base.vocab_size),
                         (768, 12, 12, 12, 32128))
        code, result, _, _ = run_bench(["--cases", "t5-base", "--variants", "stock,async", "--reps", "1",
                                        "--new-tokens", "6"], builtin)
        self.assertEqual(code, 0)
        (run,) = [r for r in result["runs"] if r["case"] == "t5-base"]
        self.assertIsNone(run["error"])
        self.assertIs(run["variants"]["async"]["exact"], True)


if __name__ == "__main__":
    unittest.main()
