"""The usage fuzzer's fixed-seed slice: whole usage scenarios (usage_scenarios.py) run on stock transformers and with
`async_stopping_criteria=True` (usage_runner.py), everything the caller observes compared bit for bit.

A scenario where stock itself raises counts as passed when the flag raises the same (type and message). A failing
seed is reported with its scenario; `python scripts/usage_fuzz.py --only <seed>` replays it and shrinks it.

Environment:
- `TAS_USAGE_DRAWS`: number of scenarios (default 80: about 1 s of CPU each on 2 cores, some 2 minutes);
- `TAS_USAGE_SEED`: the first scenario's seed (default 0; scenario i uses seed TAS_USAGE_SEED + i);
- `TAS_USAGE_ONLY`: a comma-separated list of seeds to replay instead;
- `TAS_USAGE_DEVICE`: where the models run (default cpu; `cuda` on a GPU machine).
"""

from __future__ import annotations

import collections
import os
import threading
import unittest
from unittest import mock

from parameterized import parameterized
from transformers import GenerationConfig

from models import TRANSFORMERS_VERSION, stock

import usage_assisted_draws
import usage_dimensions
import usage_module_draws
import usage_runner
from usage_runner import check
import usage_scenarios
from usage_scenarios import CACHES, CRITERIA, PROCESSORS, draw, dumps

DEVICE = os.environ.get("TAS_USAGE_DEVICE", "cpu")
CHUNK = 10


def _seeds() -> list[int]:
    only = os.environ.get("TAS_USAGE_ONLY", "").strip()
    if only:
        return [int(s) for s in only.split(",") if s.strip()]
    first = int(os.environ.get("TAS_USAGE_SEED", "0"))
    return list(range(first, first + int(os.environ.get("TAS_USAGE_DRAWS", "80"))))


def _user_module_seeds(after: int) -> list[int]:
    """Issue 31: per user-module form, the first seed after `after` drawing it on the graphed forward (emulated on the
    CPU), where a recording would bake the user's module in."""
    wanted, out, seed = set(usage_module_draws.FORMS), [], after + 1
    while wanted and seed < after + 5000:
        sc = draw(seed, DEVICE)
        form = sc.get("user_module", {}).get("form")
        if form in wanted and sc.get("graphed") in ("emulated", "natural"):
            wanted.discard(form)
            out.append(seed)
        seed += 1
    return out


def _topped_up(seeds: list[int]) -> list[int]:
    """The default slice, plus the first later seed reaching each of issue 25's (and 31's) dimension values that the
    slice's seeds miss (a few seeds: the slice reaches every value whatever the draw rates), plus one graphed seed per
    user-module form."""
    if os.environ.get("TAS_USAGE_ONLY", "").strip() or not seeds:
        return seeds
    seeds = seeds + [s for s in _user_module_seeds(seeds[-1]) if s not in seeds]
    every = usage_dimensions.every_value(DEVICE) | usage_module_draws.every_value()
    missing = every.difference(*(usage_dimensions.reached(draw(s, DEVICE)) for s in seeds))
    extra, seed = [], seeds[-1] + 1
    while missing and seed < seeds[-1] + 5000:
        got = usage_dimensions.reached(draw(seed, DEVICE)) & missing
        if got:
            extra.append(seed)
            missing -= got
        seed += 1
    return seeds + extra


SEEDS = _topped_up(_seeds())
CHUNKS = [SEEDS[i:i + CHUNK] for i in range(0, len(SEEDS), CHUNK)] or [[]]  # TAS_USAGE_DRAWS=0: coverage only


class UsageFuzz(unittest.TestCase):
    @parameterized.expand([(f"seeds_{c[0]}_to_{c[-1]}" if c else "no_seeds", c) for c in CHUNKS])
    def test_flag_on_equals_stock(self, _, seeds):
        failures = []
        for seed in seeds:
            sc = draw(seed, DEVICE)
            try:
                status, detail = check(sc, DEVICE)
            except Exception as exc:  # noqa: BLE001 - a crash outside generate() is a failure of the seed too
                status, detail = "fail", f"{type(exc).__name__} outside generate(): {exc}"
            if status == "fail":
                failures.append(f"seed {seed}: {detail}\n    {dumps(sc)}")
        self.assertEqual(failures, [], f"{len(failures)} of {len(seeds)} scenarios differ from stock (shrink with "
                                       f"`python scripts/usage_fuzz.py --only <seed>`):\n" + "\n".join(failures))


class DrawsCoverUsage(unittest.TestCase):
    """The draws reach every dimension (so the slice cannot silently shrink to easy cases)."""

    def test_every_dimension_is_drawn(self):
        cases = [draw(seed, DEVICE) for seed in range(400)]
        turns = [t for c in cases for t in c["turns"]]
        self.assertEqual({c["cache"] for c in cases}, set(CACHES))
        self.assertEqual({c["family"] for c in cases}, {"llama", "qwen2", "gpt2", "mistral", "phi3"})
        self.assertEqual({c["attn"] for c in cases}, {"sdpa", "eager"})
        self.assertEqual({len(c["turns"]) for c in cases}, {1, 2, 3, 4})
        rooms = collections.Counter(c.get("room") for c in cases if c["cache"] == "user_static")
        self.assertTrue({"roomy", 0, 1} <= set(rooms), rooms)
        self.assertEqual({t["feed"] for t in turns}, {"full", "new"})
        for key in ("embeds", "streamer", "return_dict", "output_scores", "output_logits", "left_pad"):
            self.assertTrue(any(t.get(key) for t in turns) and not all(t.get(key) for t in turns), key)
        for key in ("min_new_tokens", "num_return_sequences", "stale_cache", "restart", "pad_omitted", "use_cache",
                    "max_length_extra", "config_procs", "mask_omitted", "in_thread", "prefill_chunk_size",
                    "output_hidden_states", "output_attentions", "streamer_raises"):
            self.assertTrue(any(key in t for t in turns), key)
        self.assertTrue(any(t.get("max_length_extra", 1) <= 0 for t in turns))
        new_procs = set(usage_dimensions.NEW_PROCESSORS) | {"builtin"}
        self.assertEqual({p["kind"] for t in turns for p in t["processors"]} - {"graph_safe_liar", "module_op"},
                         set(PROCESSORS) | new_procs)
        self.assertEqual({c["kind"] for t in turns for c in t["criteria"]} - {"module_op"},
                         set(CRITERIA) | set(usage_dimensions.NEW_CRITERIA))
        raises = [c for t in turns for c in t["processors"] + t["criteria"] if c["kind"] == "raise"]
        self.assertEqual({bool(c.get("interrupt")) for c in raises}, {True, False}, "no KeyboardInterrupt drawn")
        self.assertEqual({c["threads"]["mode"] for c in cases if "threads" in c}, {"one_model", "two_models"})
        self.assertEqual({bool(c["threads"].get("hammer")) for c in cases if "threads" in c}, {True, False})
        self.assertEqual({c.get("flag_via") for c in cases}, {None, "generation_config", "model_config"})
        self.assertTrue(any(c.get("dtype") == "bfloat16" for c in cases))
        self.assertTrue(any(c["do_sample"] for c in cases) and not all(c["do_sample"] for c in cases))
        self.assertTrue(any(isinstance(t["eos"], list) and len(t["eos"]) > 1 for t in turns))
        self.assertTrue({None, "config"} <= {t["eos"] if not isinstance(t["eos"], list) else 0 for t in turns})
        batches = [[t["batch"] for t in c["turns"]] for c in cases]
        self.assertTrue(any(len(set(b)) > 1 for b in batches), "no batch change between turns")

    def test_every_issue25_dimension_value_is_drawn_several_times(self):
        # each value of the autograd contexts, rope types, verdict shapes and dtypes, widths, mutations, in-place id
        # edits and hidden states: at least 3 times in 400 draws (a value never drawn fails here)
        # (a found family, one of 23: FoundFamiliesAreDrawn counts them in 2000 draws; a latent-attention family:
        # LatentFamiliesAreDrawn; an encoder-decoder's values: EncoderDecodersAreDrawn)
        counts = collections.Counter(v for seed in range(400) for v in usage_dimensions.reached(draw(seed, DEVICE)))
        rare = {v: counts[v] for v in usage_dimensions.every_value(DEVICE)
                if counts[v] < 3 and not v.startswith(("found_family:", "latent_family:", "encoder_decoder"))}
        self.assertEqual(rare, {}, "issue-25 dimension values drawn fewer than 3 times in 400 draws")

    def test_the_ci_slice_reaches_every_issue25_dimension_value(self):
        if os.environ.get("TAS_USAGE_ONLY", "").strip() or os.environ.get("TAS_USAGE_DRAWS", "80") != "80":
            self.skipTest("a custom slice")
        reached = set().union(*(usage_dimensions.reached(draw(s, DEVICE)) for s in SEEDS))
        self.assertEqual(usage_dimensions.every_value(DEVICE) - reached, set())

    def test_old_fields_of_a_seed_are_drawn_as_before(self):
        # the new dimensions come from their own random streams: the fields drawn before them are the same as the
        # base draw's (seeds replayed from earlier runs keep their scenario)
        for seed in range(200):
            base, full = usage_scenarios._draw(seed, DEVICE), draw(seed, DEVICE)
            self.assertEqual(len(base["turns"]), len(full["turns"]), seed)
            for key in ("attn", "cache", "do_sample", "flag_via", "room", "dtype"):
                self.assertEqual(base.get(key), full.get(key), (seed, key))
            # issue 32: an assisted scenario runs batch 1, without inputs_embeds for an assistant at times, and a
            # `bare` prompt lookup without the processors that keep it on stock's loop (usage_assisted_draws.add)
            assisted = full.get("assisted", {})
            changed = {"batch", "embeds"} if assisted else set()
            for old, new in zip(base["turns"], full["turns"]):
                for key in ("batch", "prompt_len", "feed", "embeds", "max_new_tokens", "streamer", "return_dict"):
                    if key not in changed:
                        self.assertEqual(old.get(key), new.get(key), (seed, key))
                if assisted:
                    self.assertEqual(new["batch"], 1, seed)
                    self.assertTrue(new["embeds"] <= old["embeds"], seed)
                if assisted.get("bare") and assisted["kind"] == "lookup":
                    continue
                kinds = [p["kind"] for p in new["processors"]
                         if p["kind"] not in usage_dimensions.NEW_PROCESSORS and p["kind"] not in ("builtin", "module_op")]
                self.assertEqual([p["kind"] for p in old["processors"]], kinds, seed)

    def test_draws_are_reproducible(self):
        self.assertEqual(draw(12345, DEVICE), draw(12345, DEVICE))


class UserModulesAreDrawn(unittest.TestCase):
    """Issue 31's `user_module` dimension: every form, store and change is drawn, as plain data."""

    CASES = [draw(seed, DEVICE) for seed in range(2000)]

    def test_every_user_module_value_is_drawn_several_times(self):
        counts = collections.Counter(v for sc in self.CASES for v in usage_module_draws.reached(sc))
        rare = {v: counts[v] for v in usage_module_draws.every_value() if counts[v] < 3}
        self.assertEqual(rare, {}, "user-module values drawn fewer than 3 times in 2000 draws")

    def test_every_change_of_every_form_is_drawn_between_and_during_calls(self):
        reached = set().union(*(usage_module_draws.ops_reached(sc) for sc in self.CASES))
        self.assertEqual(usage_module_draws.every_op() - reached, set())

    def test_the_ci_slice_runs_every_form_on_the_graphed_forward(self):
        if os.environ.get("TAS_USAGE_ONLY", "").strip():
            self.skipTest("a custom slice")
        graphed = {draw(s, DEVICE)["user_module"]["form"] for s in SEEDS
                   if "user_module" in draw(s, DEVICE) and draw(s, DEVICE).get("graphed") in ("emulated", "natural")}
        self.assertEqual(set(usage_module_draws.FORMS) - graphed, set())

    def test_user_module_scenarios_are_plain_data(self):
        import json

        for sc in self.CASES:
            if "user_module" in sc:
                self.assertEqual(json.loads(dumps(sc)), sc)


class Issue25DimensionsTakeEffect(unittest.TestCase):
    """A drawn dimension value does what it is drawn for in stock's run (a scenario that never got there would pass
    vacuously): the rotary module crosses its original length within a call, hooks and a class-level forward see
    model calls after they are installed, the calls run in inference mode, the aliasing probe sees stock's aliases."""

    def _first(self, wanted, effect, limit=60):
        tried = 0
        for seed in range(3000):
            sc = draw(seed, "cpu")
            if wanted not in usage_dimensions.reached(sc):
                continue
            with stock():
                result = usage_runner.run_scenario(sc, False, "cpu", usage_runner._rooms(sc, "cpu"))
            if effect(sc, result.trace):
                return
            tried += 1
            if tried >= limit:
                break
        self.fail(f"no drawn scenario with {wanted} shows its effect in stock's run ({tried} tried)")

    def test_a_dynamic_rope_grows_past_its_length_within_a_call(self):
        def grew(sc, trace):
            return any(k.endswith("max_seq_len_cached") and int(v) > sc["rope"]["max_pos"]
                       for e in trace for k, v in e["modules"].items())
        self._first("rope:dynamic", grew)

    def test_a_longrope_switches_to_its_long_factors_within_a_call(self):
        def switched(sc, trace):
            return any(k.endswith("long_inv_freq") for e in trace for k in e["modules"])
        self._first("rope:longrope", switched)

    def test_hooks_and_class_forwards_installed_mid_call_see_later_model_calls(self):
        def seen(what):
            def effect(sc, trace):
                return any(cb[0] == "mutator" and cb[1] == what and cb[3] for e in trace for cb in e["callbacks"])
            return effect
        for what in ("forward_hook", "forward_pre_hook", "class_forward"):
            with self.subTest(what):
                self._first("mutation:" + what, seen(what))

    def test_inference_mode_calls_return_inference_tensors(self):
        self._first("grad:inference_mode", lambda sc, trace: any(f[0] for e in trace for f in e["flags"]))

    def test_the_aliasing_probe_sees_scores_that_are_the_logits(self):
        def aliased(sc, trace):
            return any(a[0].startswith("logits") and (a[1] or "").startswith("scores")
                       for e in trace for a in e.get("alias", ()))
        self._first("turn:alias_probe", aliased)


    @unittest.skipUnless((5, 17) <= TRANSFORMERS_VERSION <= (5, 24), "the piecewise forward's releases (5.17-5.24)")
    def test_emulated_scenarios_take_the_graphed_forward_in_the_flag_run(self):
        # issue 27: `graphed: emulated` runs the flag run's calls under the CPU emulation of CUDA graphs; most such
        # scenarios must replay decode steps from the graphs (a scenario the path stepped aside from for every call,
        # or an emulation that never engaged, would pass vacuously)
        took, tried = [], 0
        for seed in range(3000):
            sc = draw(seed, "cpu")
            if sc.get("graphed") != "emulated" or "assisted" in sc:  # (issue 32's: AssistedIsDrawn)
                continue
            result = usage_runner.run_scenario(sc, True, "cpu", usage_runner._rooms(sc, "cpu"))
            took.append(any((path or "").startswith("graphed") for path in result.forward))
            tried += 1
            if sum(took) == 5 or tried == 16:
                break
        self.assertGreaterEqual(sum(took), 5, f"{sum(took)} of {tried} emulated scenarios took the graphed forward")

    @unittest.skipUnless((5, 17) <= TRANSFORMERS_VERSION <= (5, 24), "the piecewise forward's releases (5.17-5.24)")
    def test_off_scenarios_turn_the_graphed_forward_off(self):
        # `graphed: off` (on CUDA: the natural path's opposite) turns the path off by its environment switch: shown
        # with the emulation on around the run, where the path would be taken otherwise
        from transformers_async_stop.testing.emulation import emulated

        sc = next(c for c in (draw(seed, "cpu") for seed in range(3000))
                  if c.get("graphed") == "off" and len(c["turns"]) == 1 and not c["turns"][0]["processors"]
                  and not c["turns"][0]["criteria"] and c["turns"][0].get("max_new_tokens", 0) > 2)
        with emulated():
            result = usage_runner.run_scenario(sc, True, "cpu", usage_runner._rooms(sc, "cpu"))
            on = usage_runner.run_scenario({**sc, "graphed": "emulated"}, True, "cpu", usage_runner._rooms(sc, "cpu"))
        self.assertEqual(result.forward, ["eager: TRANSFORMERS_ASYNC_STOP_PIECEWISE=0"])
        self.assertTrue(on.forward[0].startswith("graphed"), on.forward)


class AssistedIsDrawn(unittest.TestCase):
    """Issue 32's `assisted` dimension (usage_assisted_draws.py): assisted decoding with a draft model or a copy of
    the target, and prompt lookup, on the dynamic-cache loop's caches, as plain data; the graphed verify forward is
    reached."""

    CASES = [draw(seed, DEVICE) for seed in range(400)]

    @unittest.skipUnless(usage_assisted_draws.SUPPORTED, "drawn on transformers 5.x")
    def test_assisted_scenarios_are_batch_1_on_a_dynamic_cache_and_plain_data(self):
        import json

        drawn = [sc for sc in self.CASES if "assisted" in sc]
        self.assertGreater(len(drawn), 20)
        for sc in drawn:
            self.assertIn(sc["cache"], usage_assisted_draws.CACHES)
            self.assertEqual({t["batch"] for t in sc["turns"]}, {1})
            self.assertEqual(json.loads(dumps(sc)), sc)

    @unittest.skipUnless((5, 17) <= TRANSFORMERS_VERSION <= (5, 24), "the piecewise forward's releases (5.17-5.24)")
    def test_assisted_scenarios_replay_the_verify_forward_in_the_flag_run(self):
        # under `graphed: emulated`, the verify forward of a `bare` scenario (no user criterion: the package's own
        # loop) must replay from the graphs in some: a verify forward that never replayed would pass vacuously
        took, tried = 0, 0
        for sc in (draw(seed, "cpu") for seed in range(3000)):
            if sc.get("graphed") != "emulated" or not sc.get("assisted", {}).get("bare") or sc["attn"] != "sdpa":
                continue
            result = usage_runner.run_scenario(sc, True, "cpu", usage_runner._rooms(sc, "cpu"))
            took += any((path or "").startswith("graphed") for path in result.verify)
            tried += 1
            if took == 2 or tried == 10:
                break
        self.assertEqual(took, 2, f"{took} of {tried} assisted scenarios replayed the verify forward")


class FoundFamiliesAreDrawn(unittest.TestCase):
    """The `found_family` dimension (usage_dimensions._found_family): a family the piecewise proof graphs from the
    model, its tiny model (tests/family_models.py) built by the runner, drawn from its own random stream where the
    scenario's other draws make sense for it; every earlier seed draws as before."""

    CASES = UserModulesAreDrawn.CASES

    def test_a_seed_draws_as_before_but_for_the_family(self):
        # with the dimension not drawn, each seed's scenario is the one it drew before it existed: the dimension adds
        # its one key and changes no other field (`latent_family`, drawn where it is not, left out of both)
        with mock.patch.object(usage_dimensions, "_found_family", lambda sc: None), \
                mock.patch.object(usage_dimensions, "_latent_family", lambda sc: None), \
                mock.patch.object(usage_dimensions, "_encoder_decoder", lambda sc, device: None):
            before = [draw(seed, DEVICE) for seed in range(300)]
        for seed, old in enumerate(before):
            new = dict(self.CASES[seed])
            new.pop("found_family", None)
            new.pop("latent_family", None)
            new.pop("encoder_decoder", None)
            self.assertEqual(new, old, seed)

    def test_found_families_are_drawn_only_where_the_other_draws_fit(self):
        drawn = [sc for sc in self.CASES if "found_family" in sc]
        if not usage_dimensions.FOUND_RELEASES:
            self.assertEqual(drawn, [], "found families drawn before 5.17")
            return
        self.assertGreater(len(drawn), 200)
        for sc in drawn:
            self.assertIn(sc["found_family"], usage_dimensions.found_available())
            self.assertIn(sc["cache"], usage_dimensions.GRAPHED_CACHES, sc["seed"])
            self.assertFalse({"rope", "window", "threads"} & set(sc), sc["seed"])
            target = sc.get("user_module", {}).get("target")
            self.assertNotIn((sc["found_family"], target), usage_dimensions.FOUND_UNPLACED, sc["seed"])

    @unittest.skipUnless(usage_dimensions.FOUND_RELEASES, "drawn on transformers 5.17+")
    def test_every_found_family_is_drawn_several_times(self):
        counts = collections.Counter(sc.get("found_family") for sc in self.CASES)
        rare = {f: counts[f] for f in usage_dimensions.found_available() if counts[f] < 5}
        self.assertEqual(rare, {}, "found families drawn fewer than 5 times in 2000 draws")
        self.assertEqual(set(usage_dimensions.found_available()), set(usage_dimensions.FOUND_FAMILIES),
                         "a found family missing on a release the dimension draws on")

    @unittest.skipUnless(usage_dimensions.FOUND_RELEASES, "drawn on transformers 5.17+")
    def test_the_runner_builds_the_drawn_family_with_its_attention(self):
        import family_models

        for attn in ("sdpa", "eager"):
            sc = next(c for c in self.CASES if c.get("found_family") and c["attn"] == attn)
            model = usage_runner._model(sc, "cpu", 0)
            self.assertEqual(model.config.model_type, sc["found_family"])
            supported = attn == "eager" or family_models.sdpa_supported(sc["found_family"])
            self.assertEqual(model.config._attn_implementation, attn if supported else "eager")
            self.assertTrue(model._usage_own)  # (built for the run: a mutation cannot carry into the next one)
            again = usage_runner._model(sc, "cpu", 0)
            self.assertIsNot(again, model)
            for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
                self.assertTrue(bool((a == b).all()), name)  # (the scenario's seed: both runs get the same weights)

    @unittest.skipUnless(usage_dimensions.FOUND_RELEASES, "drawn on transformers 5.17+")
    def test_each_found_family_has_a_place_for_the_user_modules_drawn_with_it(self):
        # usage_modules.place and usage_peft's names reach every found family's modules (their names tried after the
        # hand-read families' ones), except the pairs FOUND_UNPLACED keeps out of the draw, which indeed have none
        import family_models
        import usage_modules
        import usage_peft

        targets = set(usage_module_draws.TARGETS) | {"act", "proj"}
        for family in usage_dimensions.found_available():
            model = family_models.build_family(family, attn="eager")
            for target in sorted(targets):
                with self.subTest(family=family, target=target):
                    if (family, target) in usage_dimensions.FOUND_UNPLACED:
                        self.assertRaises(LookupError, usage_modules.place, model, target, 0)
                    else:
                        usage_modules.place(model, target, 1)
            self.assertTrue(usage_peft._names(model, usage_peft._ATTN), family)


class LatentFamiliesAreDrawn(unittest.TestCase):
    """The `latent_family` dimension (usage_dimensions._latent_family): a multi-head latent attention family (issue 45:
    DeepSeek-V3, DeepSeek-V2, GLM-4-MoE-lite, MiniCPM3), its tiny model (tests/latent_models.py) built by the runner,
    drawn from its own random stream where `found_family` could have been drawn and was not; every earlier seed draws
    as before, `found_family` included."""

    CASES = UserModulesAreDrawn.CASES

    def test_every_earlier_seed_draws_as_before_on_seeds_0_1999(self):
        # with the dimension not drawn, each seed's scenario is the one it drew before it existed (every other
        # dimension's fields, `found_family` among them): the dimension adds its one key and changes nothing else
        # (`encoder_decoder`, drawn where it is not, left out of both)
        with mock.patch.object(usage_dimensions, "_latent_family", lambda sc: None), \
                mock.patch.object(usage_dimensions, "_encoder_decoder", lambda sc, device: None):
            before = [draw(seed, DEVICE) for seed in range(2000)]
        for seed, old in enumerate(before):
            new = dict(self.CASES[seed])
            new.pop("latent_family", None)
            new.pop("encoder_decoder", None)
            self.assertEqual(new, old, seed)

    def test_latent_families_are_drawn_only_where_a_found_family_could_have_been_and_was_not(self):
        drawn = [sc for sc in self.CASES if "latent_family" in sc]
        if not usage_dimensions.LATENT_RELEASES:
            self.assertEqual(drawn, [], "latent families drawn before 5.17")
            return
        self.assertGreater(len(drawn), 40)
        for sc in drawn:
            self.assertIn(sc["latent_family"], usage_dimensions.latent_available())
            self.assertNotIn("found_family", sc, sc["seed"])
            self.assertIn(sc["cache"], usage_dimensions.GRAPHED_CACHES, sc["seed"])
            self.assertFalse({"rope", "window", "threads"} & set(sc), sc["seed"])
            target = sc.get("user_module", {}).get("target")
            self.assertNotIn((sc["latent_family"], target), usage_dimensions.LATENT_UNPLACED, sc["seed"])
        # some of them on the graphed forward (emulated on the CPU), where the latents' derivation is recorded
        self.assertGreater(sum(sc.get("graphed") in ("emulated", "natural") for sc in drawn), 10)

    @unittest.skipUnless(usage_dimensions.LATENT_RELEASES, "drawn on transformers 5.17+")
    def test_every_latent_family_is_drawn_several_times(self):
        counts = collections.Counter(sc.get("latent_family") for sc in self.CASES)
        rare = {f: counts[f] for f in usage_dimensions.latent_available() if counts[f] < 5}
        self.assertEqual(rare, {}, "latent families drawn fewer than 5 times in 2000 draws")
        self.assertEqual(set(usage_dimensions.latent_available()), set(usage_dimensions.LATENT_FAMILIES),
                         "a latent family missing on a release the dimension draws on")

    @unittest.skipUnless(usage_dimensions.LATENT_RELEASES, "drawn on transformers 5.17+")
    def test_the_runner_builds_the_drawn_family_with_its_attention(self):
        for attn in ("sdpa", "eager"):
            sc = next(c for c in self.CASES if c.get("latent_family") and c["attn"] == attn)
            model = usage_runner._model(sc, "cpu", 0)
            self.assertEqual(model.config.model_type, sc["latent_family"])
            self.assertEqual(model.config._attn_implementation, attn)
            self.assertEqual(model.config.num_key_value_heads, model.config.num_attention_heads)
            self.assertTrue(model._usage_own)  # (built for the run: a mutation cannot carry into the next one)
            again = usage_runner._model(sc, "cpu", 0)
            self.assertIsNot(again, model)
            for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
                self.assertTrue(bool((a == b).all()), name)  # (the scenario's seed: both runs get the same weights)

    @unittest.skipUnless(usage_dimensions.LATENT_RELEASES, "drawn on transformers 5.17+")
    def test_each_latent_family_has_a_place_for_the_user_modules_drawn_with_it(self):
        # usage_modules.place and usage_peft's names reach every latent family's modules in both layers (the hand-LoRA
        # `proj` and peft's attention LoRA on the projection decompressing the cached latents), except the pairs
        # LATENT_UNPLACED keeps out of the draw, which indeed have none in the routed-experts layer
        import latent_models
        import usage_modules
        import usage_peft

        targets = set(usage_module_draws.TARGETS) | {"act", "proj"}
        for family in usage_dimensions.latent_available():
            model = latent_models.build_latent(family, attn="eager")
            for target in sorted(targets):
                for layer in (0, 1):
                    with self.subTest(family=family, target=target, layer=layer):
                        if (family, target) in usage_dimensions.LATENT_UNPLACED and layer == 1:
                            self.assertRaises(LookupError, usage_modules.place, model, target, layer)
                        else:
                            usage_modules.place(model, target, layer)
            self.assertEqual(usage_modules.place(model, "proj", 1)[1], "kv_b_proj")
            self.assertEqual(usage_peft._names(model, usage_peft._ATTN), ["q_b_proj", "kv_b_proj"], family)
            mlp = ["gate_proj", "up_proj", "down_proj"] if family in usage_peft._MLP_GATED else ["up_proj", "down_proj"]
            self.assertEqual(usage_peft._mlp_names(model), mlp, family)
            for lora in ("attn", "attn_mlp"):  # (peft takes them: routed experts' fused projections included)
                usage_peft.Adapters({"targets": lora, "second": True}, latent_models.build_latent(family))


class EncoderDecodersAreDrawn(unittest.TestCase):
    """The `encoder_decoder` dimension (usage_dimensions._encoder_decoder, tests/usage_encoder_decoder.py): on 5.17+ an
    encoder-decoder sub-scenario (BART and its copies, T5, Whisper on the dynamic-cache loop) in place of the
    decoder-only one, drawn from its own random stream where no other dimension replaced or wrapped the model; every
    earlier seed draws as before, and the scenarios run against stock on the CPU (the graphs emulated)."""

    CASES = UserModulesAreDrawn.CASES

    def test_every_earlier_seed_draws_as_before_on_seeds_0_1999(self):
        # with the dimension not drawn, each seed's scenario is the one it drew before it existed (every other
        # dimension's fields): the dimension adds its one key and changes nothing else
        with mock.patch.object(usage_dimensions, "_encoder_decoder", lambda sc, device: None):
            before = [draw(seed, DEVICE) for seed in range(2000)]
        for seed, old in enumerate(before):
            new = dict(self.CASES[seed])
            new.pop("encoder_decoder", None)
            self.assertEqual(new, old, seed)

    def test_drawn_on_5_17_and_later_only_where_no_other_dimension_replaced_the_model(self):
        import json

        drawn = [sc for sc in self.CASES if "encoder_decoder" in sc]
        if not usage_dimensions.ENCDEC_RELEASES:
            self.assertEqual(drawn, [], "encoder-decoders drawn before 5.17")
            return
        self.assertGreater(len(drawn), 150)
        for sc in drawn:
            self.assertFalse({"found_family", "latent_family", "assisted", "user_module", "threads"} & set(sc),
                             sc["seed"])
            self.assertEqual(json.loads(dumps(sc)), sc)  # (plain data: printed and replayed)
        self.assertGreater(sum(sc["encoder_decoder"]["graphed"] in ("emulated", "natural") for sc in drawn), 80)

    @unittest.skipUnless(usage_dimensions.ENCDEC_RELEASES, "drawn on transformers 5.17+")
    def test_every_encoder_decoder_value_is_drawn_several_times(self):
        import usage_encoder_decoder

        counts = collections.Counter(v for sc in self.CASES if "encoder_decoder" in sc
                                     for v in usage_encoder_decoder.reached(sc))
        rare = {v: counts[v] for v in usage_encoder_decoder.every_value(DEVICE) if counts[v] < 5}
        self.assertEqual(rare, {}, "encoder-decoder values drawn fewer than 5 times in 2000 draws")
        whisper = [sc["encoder_decoder"]["whisper"] for sc in self.CASES
                   if sc.get("encoder_decoder", {}).get("family") == "whisper"]
        self.assertEqual({w["language"] for w in whisper} | {w["task"] for w in whisper},
                         {None, "en", "fr", "transcribe", "translate"})
        self.assertEqual({w["timestamps"] for w in whisper}, {True, False})

    @unittest.skipUnless(usage_dimensions.ENCDEC_RELEASES and DEVICE == "cpu", "drawn on transformers 5.17+")
    def test_a_handful_of_scenarios_equal_stock_and_replay_the_graphed_decoder(self):
        # per family the first emulated scenario (the later ones: the first continuing its cache, the first editing
        # its encoder mask mid-call): each passes, and the text families' and Whisper's decoders replay
        wanted, seeds = set(usage_encoder_decoder_families()), []
        for sc in self.CASES:
            ed = sc.get("encoder_decoder")
            if ed and ed["graphed"] == "emulated" and ed["attn"] == "sdpa" and ed["family"] in wanted:
                wanted.discard(ed["family"])
                seeds.append(sc["seed"])
        graphed, failures = set(), []
        for seed in seeds:
            sc = self.CASES[seed]
            status, detail = check(sc, DEVICE)
            if status == "fail":
                failures.append(f"seed {seed}: {detail}")
            if any((path or "").startswith("graphed") for path in usage_runner.LAST_FORWARD):
                graphed.add(sc["encoder_decoder"]["family"])
        self.assertEqual(failures, [])
        self.assertGreaterEqual(len(graphed), 4, graphed)

    @unittest.skipUnless(usage_dimensions.ENCDEC_RELEASES and DEVICE == "cpu", "drawn on transformers 5.17+")
    def test_a_criterion_edits_the_encoder_mask_mid_call_and_a_second_call_continues_the_cache(self):
        # the edit takes effect in stock's run (the mask after the call differs from the one passed), and the second
        # call continues from the first's sequences and returned cache: the flag run equals stock's
        import usage_encoder_decoder

        ed = {"family": "bart", "batch": 2, "attn": "sdpa", "do_sample": False, "grad": "inference_mode",
              "graphed": "emulated", "cache": "returned", "flag_via": "kwarg", "src_len": 6,
              "mask": {"kind": "left_pad", "pads": [0, 2]},
              "turns": [{"max_new_tokens": 6, "return_dict": True, "eos": None, "output_scores": True,
                         "processors": [], "criteria": [{"kind": "mask_edit", "at": 2, "edit": "zero_prefix",
                                                         "row": 0, "col": 2}]},
                        {"max_new_tokens": 4, "return_dict": True, "eos": None, "output_logits": True,
                         "processors": [], "criteria": [], "decoder_mask": False, "mask": "same"}]}
        sc = {"seed": 5, "encoder_decoder": ed}
        with stock():
            ref = usage_encoder_decoder.run(sc, False)
        self.assertEqual(ref.trace[0]["encoder_mask"].tolist(), [[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
        self.assertEqual(ref.trace[1]["output"]["sequences"].shape, (2, 1 + 6 + 4))
        self.assertEqual(check(sc, DEVICE), ("pass", ""))
        self.assertTrue(all(path.startswith("graphed") for path in usage_runner.LAST_FORWARD),
                        usage_runner.LAST_FORWARD)


def usage_encoder_decoder_families():
    import usage_encoder_decoder

    return usage_encoder_decoder.FAMILIES


class ThreadScenariosAreFair(unittest.TestCase):
    def test_the_flag_run_sets_no_attribute_of_a_shared_config_while_both_threads_run(self):
        # Set and deleted around each call, the flag changed the shared model's config while the other thread's
        # generate() copied it (`to_dict()`): "dictionary changed size during iteration" in the flag run only,
        # which the stock run, setting nothing, never risks (seed 101 on an H100 under load)
        sc = next(c for c in (draw(seed, "cpu") for seed in range(3000))
                  if c.get("threads", {}).get("mode") == "one_model"
                  and "model_config" in (c.get("flag_via"), c["threads"]["other"].get("flag_via")))
        shared = usage_runner.model_of(sc["family"], sc["attn"], 0, "cpu", sc.get("dtype", "float32")).generation_config
        in_workers, real_set = [], GenerationConfig.__setattr__

        def from_a_worker(config, name):
            return (config is shared and name == "async_stopping_criteria"
                    and threading.current_thread() is not threading.main_thread())

        def spy_set(config, name, value):
            if from_a_worker(config, name):
                in_workers.append(("set", threading.current_thread().name))
            real_set(config, name, value)

        def spy_del(config, name):
            if from_a_worker(config, name):
                in_workers.append(("del", threading.current_thread().name))
            object.__delattr__(config, name)

        with mock.patch.object(GenerationConfig, "__setattr__", spy_set), \
                mock.patch.object(GenerationConfig, "__delattr__", spy_del, create=True):
            status, detail = usage_runner.check(sc, "cpu")
        self.assertEqual(status if status != "stock_err" else "pass", "pass", detail)
        self.assertEqual(in_workers, [], "the harness changed the shared config from a thread")


if __name__ == "__main__":
    unittest.main()


class TheDiffComparesNaNsAsEqual(unittest.TestCase):
    """A host read of a NaN on both sides is no difference (seed 10761 on 5.23.0: a user module's `.item()` of a NaN
    norm, reported as "stock nan vs flag nan"); a NaN on one side is."""

    def test_two_nan_floats_are_the_same(self):
        self.assertIsNone(usage_runner.diff([1.0, float("nan")], [1.0, float("nan")]))

    def test_a_nan_against_a_number_differs(self):
        self.assertIn("stock nan vs flag 1.0", usage_runner.diff({"v": [float("nan")]}, {"v": [1.0]}))

    def test_nan_tensors_stay_compared_as_before(self):
        import torch

        nan = torch.tensor([float("nan"), 2.0])
        self.assertIsNone(usage_runner.diff(nan, nan.clone()))
        self.assertIsNotNone(usage_runner.diff(nan, torch.tensor([1.0, 2.0])))
