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

import usage_runner
from usage_runner import check
from usage_scenarios import CACHES, CRITERIA, PROCESSORS, draw, dumps

DEVICE = os.environ.get("TAS_USAGE_DEVICE", "cpu")
CHUNK = 10


def _seeds() -> list[int]:
    only = os.environ.get("TAS_USAGE_ONLY", "").strip()
    if only:
        return [int(s) for s in only.split(",") if s.strip()]
    first = int(os.environ.get("TAS_USAGE_SEED", "0"))
    return list(range(first, first + int(os.environ.get("TAS_USAGE_DRAWS", "80"))))


SEEDS = _seeds()
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
        self.assertEqual({c["family"] for c in cases}, {"llama", "qwen2", "gpt2", "mistral"})
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
        self.assertEqual({p["kind"] for t in turns for p in t["processors"]} - {"graph_safe_liar"}, set(PROCESSORS))
        self.assertEqual({c["kind"] for t in turns for c in t["criteria"]}, set(CRITERIA))
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

    def test_draws_are_reproducible(self):
        self.assertEqual(draw(12345, DEVICE), draw(12345, DEVICE))


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
