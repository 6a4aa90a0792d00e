"""The benchmark command works end to end in its quick CPU mode (the GPU figures need a GPU run).

No assertion here is about time: CPU timings say nothing about the flag, and a loaded CI host says nothing at all.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import json
import os
import tempfile
import unittest
from unittest import mock

import torch
from transformers.generation.logits_process import LogitsProcessor

from transformers_async_stop import bench, is_patched
from transformers_async_stop import FORCE_ENV
from transformers_async_stop.bench import cases, catalog, cli, gpu, measure, report, variants

LOOP_RELEASES = tuple(int(x) for x in __import__("transformers").__version__.split(".")[:2]) >= (5, 17)


class RecordPatched(LogitsProcessor):
    """A user processor that notes, at every decode step, which variant is set up and whether the package is applied."""

    def __init__(self, seen: list):
        self.seen = seen

    def __call__(self, input_ids, scores):
        self.seen.append((variants.active(), is_patched()))
        return scores


def recording_cases(seen: list) -> dict:
    builtin = catalog.builtin_cases()
    tiny = builtin["tiny-llama"]

    def extra(run, model):
        kwargs = tiny.extra(run, model)
        kwargs["logits_processor"].append(RecordPatched(seen))
        return kwargs

    return dict(builtin, **{"tiny-llama": dataclasses.replace(tiny, extra=extra)})


def run_bench(argv: list[str], bench_cases: dict) -> tuple[int, dict, str, str]:
    """main() with JSON and Markdown output; returns (exit code, JSON, Markdown, stdout)."""
    with tempfile.TemporaryDirectory() as tmp:
        json_path, md_path = os.path.join(tmp, "b.json"), os.path.join(tmp, "b.md")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = bench.main(argv + ["--device", "cpu", "--json", json_path, "--markdown", md_path],
                              cases=bench_cases)
        with open(json_path) as f:
            result = json.load(f)
        with open(md_path) as f:
            markdown = f.read()
    return code, result, markdown, out.getvalue()


class QuickBenchmark(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.seen = []
        # 8 tokens instead of 16: the beam and padded runs dominate the time
        cls.code, cls.result, cls.markdown, cls.stdout = run_bench(["--quick", "--new-tokens", "8"],
                                                                   recording_cases(cls.seen))
        cls.patched_after = is_patched()
        cls.expected = ["stock", "imported", "async"] + (["upstream"] if variants.upstream_available() else [])

    def test_quick_mode_writes_json_and_markdown(self):
        self.assertEqual(self.code, 0)
        header = self.result["header"]
        self.assertEqual(header["transformers"], __import__("transformers").__version__)
        self.assertEqual(header["variants"], self.expected)  # no floor without CUDA
        self.assertIn("| case |", self.markdown)
        decodes = {r["decode"] for r in self.result["runs"]}
        self.assertEqual(decodes, {"greedy", "sample", "padded", "beam"})
        # a left-padded batch on both caches (the dynamic one is issue 27's eager padded row)
        self.assertEqual({r["mode"] for r in self.result["runs"] if r["decode"] == "padded"}, {"eager", "static"})
        for run in self.result["runs"]:
            self.assertIsNone(run["error"], run["label"])
            self.assertEqual(list(run["variants"]), self.expected)
            for m in run["variants"].values():
                self.assertEqual(len(m["ms_per_token_reps"]), header["reps"])
                self.assertIsNone(m["syncs_per_step"])  # no CUDA, no sync figures
        ref = header["host_reference"]
        self.assertIsNotNone(ref["ms_per_token"])
        self.assertIn("this run's", ref["source"])
        self.assertIn("host reference", self.stdout)

    def test_every_variant_equals_stock(self):
        for run in self.result["runs"]:
            self.assertTrue(run["stock_repeatable"], run["label"])
            self.assertIs(run["exact"], True, run["label"])
            for v in self.expected[1:]:
                self.assertIs(run["variants"][v]["exact"], True, f"{run['label']} {v}")

    def test_no_ratio_columns_on_cpu(self):
        for text in (self.stdout, self.markdown):
            self.assertNotIn("vs stock", text)
            self.assertNotIn("vs upstream", text)
            self.assertNotIn("async/stock", text)
            self.assertEqual(text.count(report.NO_RATIO_MESSAGE), 1)
        for run in self.result["runs"]:
            self.assertIsNone(run["ratios"])
            for m in run["variants"].values():
                self.assertIsNone(m["speedup"])

    def test_each_variant_reports_the_path_its_generate_took(self):
        for run in self.result["runs"]:
            paths = {v: m["path"] for v, m in run["variants"].items()}
            self.assertEqual(paths["stock"], "transformers as shipped", run["label"])
            self.assertEqual(paths["imported"], "stock: flag off", run["label"])
            # the CPU suite forces the deferred path (conftest), and so does the CPU benchmark by default
            beam = run["decode"] == "beam"
            if not LOOP_RELEASES or beam:
                expected = "deferred"
            elif run["mode"] == "static":
                expected = "deferred, static loop, tail eager"
            else:
                expected = "deferred, dynamic loop, forward eager: not CUDA (cpu)"  # no graphs on the CPU
            self.assertEqual(paths["async"], expected, run["label"])
        self.assertIn("deferred", self.stdout.split("path")[1])

    def test_the_last_line_says_that_speed_needs_a_gpu(self):
        self.assertEqual(self.stdout.rstrip().splitlines()[-1], report.NO_RATIO_MESSAGE)

    def test_the_chart_shows_time_relative_to_stock_with_versions_and_the_cpu_note(self):
        runs, series = report.chart_series(self.result)
        self.assertEqual(len(runs), len(self.result["runs"]))
        self.assertNotIn("stock", series)  # stock is the line at 1
        for name, values in series.items():
            for run, (ratio, low, high) in zip(runs, values):
                m = run["variants"][name]
                self.assertAlmostEqual(ratio, m["ms_per_token"] / run["variants"]["stock"]["ms_per_token"])
                self.assertLessEqual(low, ratio)
                self.assertGreaterEqual(high, ratio)
        titles = []
        real_title = __import__("matplotlib.axes", fromlist=["Axes"]).Axes.set_title
        with tempfile.TemporaryDirectory() as tmp, mock.patch(
                "matplotlib.axes.Axes.set_title", lambda ax, text, *a, **k: titles.append(text) or
                real_title(ax, text, *a, **k)):
            path = os.path.join(tmp, "chart.png")
            report.write_png(self.result, path)
            with open(path, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
        (title,) = titles
        header = self.result["header"]
        for part in (f"torch {header['torch']}", f"transformers {header['transformers']}", report.CPU_CHART_NOTE):
            self.assertIn(part, title)

    def test_stock_and_upstream_run_unpatched_and_the_package_is_applied_again(self):
        self.assertTrue(self.patched_after)
        self.assertIsNone(variants.active())
        by_variant = {}
        for name, patched in self.seen:
            by_variant.setdefault(name, set()).add(patched)
        self.assertEqual(set(by_variant), set(self.expected))  # every generate() ran inside a variant's set-up
        self.assertEqual(by_variant["stock"], {False})
        self.assertEqual(by_variant["imported"], {True})
        self.assertEqual(by_variant["async"], {True})
        if "upstream" in by_variant:
            self.assertEqual(by_variant["upstream"], {False})

    def test_interleaved_order_covers_every_variant(self):
        reps = self.result["header"]["reps"]
        for run in self.result["runs"]:
            self.assertEqual(run["order"], variants.rep_orders(self.expected, reps))
            for order in run["order"]:
                self.assertEqual(sorted(order), sorted(self.expected))
        names = list(variants.TIMED)
        orders = variants.rep_orders(names, 2 * len(names))
        for position in range(len(names)):  # over k reps, each variant takes each position once
            self.assertEqual(sorted(o[position] for o in orders[:len(names)]), sorted(names))
        self.assertEqual(orders[len(names):], orders[:len(names)])


class Help(unittest.TestCase):
    def test_help_lists_every_case_with_what_it_runs(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), self.assertRaises(SystemExit) as exited:
            bench.main(["--help"])
        self.assertEqual(exited.exception.code, 0)
        lines = out.getvalue().splitlines()
        for name, case in catalog.builtin_cases().items():
            self.assertTrue(case.about, f"{name} has no description")
            opt_in = "(opt-in) " if case.opt_in else ""
            listed = [line for line in lines if line.split()[:1] == [name]]
            self.assertEqual(len(listed), 1, name)
            self.assertTrue(listed[0].endswith(f"  {opt_in}{case.about}"), listed[0])


class Pieces(unittest.TestCase):
    def test_png_without_matplotlib_stops_before_the_run_naming_the_install_command(self):
        err = io.StringIO()
        with mock.patch.object(report, "can_chart", lambda: False), mock.patch.object(
                cli, "_main", side_effect=AssertionError("the benchmark ran")), contextlib.redirect_stderr(err):
            with self.assertRaises(SystemExit) as stop:
                bench.main(["--quick", "--device", "cpu", "--png", "chart.png"])
        self.assertEqual(stop.exception.code, 2)
        self.assertIn("pip install 'transformers_async_stop[bench]'", err.getvalue())

    def test_cpu_runs_force_the_deferred_path_unless_the_caller_set_the_switch(self):
        seen = []
        with mock.patch.object(cli, "_main", lambda *a: seen.append(os.environ.get(FORCE_ENV)) or 0):
            with mock.patch.dict(os.environ):
                os.environ.pop(FORCE_ENV, None)
                bench.main(["--device", "cpu"])
                self.assertNotIn(FORCE_ENV, os.environ)
                os.environ[FORCE_ENV] = "0"
                bench.main(["--device", "cpu"])
        self.assertEqual(seen, ["1", "0"])

    def test_cuda_path_with_the_gpu_calls_faked(self):
        """measure_run's CUDA branch (floor, syncs and memory, ratios) and the CUDA table, on CPU: the device calls
        are replaced by fakes, so this checks the bookkeeping and formatting, not any GPU figure."""
        timed = ["stock", "imported", "async"] + (["upstream"] if variants.upstream_available() else [])

        def count_syncs(model, kwargs, flag, device):  # stock: one sync per step; async: none after prefill
            return (1 if flag.get("async_stopping_criteria") else kwargs["max_new_tokens"]), 42.0

        def gpu_timeline(model, kwargs, flag, device):
            n = kwargs["max_new_tokens"]
            return {"busy": 0.25 * n, "launch_gaps": 0.01 * n, "starved": 0.1 * n}

        def timed_ms(model, kwargs, flag, device):  # no clock: 1 ms per token, 0.5 with the flag
            return (0.5 if flag.get("async_stopping_criteria") else 1.0) * kwargs["max_new_tokens"]

        tiny = catalog.builtin_cases()["tiny-llama"]
        device = torch.device("cpu")
        model = tiny.build(device, torch.float32)
        run = cases.Run(tiny, "eager", 1, "greedy", 6, "fp32")
        with mock.patch.object(gpu, "count_syncs", count_syncs), mock.patch.object(gpu, "gpu_timeline", gpu_timeline), \
                mock.patch.object(measure, "timed_ms", timed_ms), \
                mock.patch.object(measure.Ctx, "cuda", new=property(lambda self: True)):
            record = measure.measure_run(model, run, variants.Selection(timed, True, []), 2, device,
                                         lambda *a, **k: None)
        self.assertTrue(is_patched())
        self.assertAlmostEqual(record["floor_ms_per_token"], 0.25)
        self.assertAlmostEqual(record["async_gaps_ms"]["launch_gaps"], 0.01)
        self.assertAlmostEqual(record["async_gaps_ms"]["starved"], 0.1)
        self.assertEqual(record["variants"]["async"]["syncs_per_step"], 0)
        self.assertEqual(record["variants"]["stock"]["syncs_per_step"], 1)
        self.assertEqual(record["variants"]["async"]["peak_mem_mib"], 42.0)
        self.assertIsNone(record["variants"]["stock"]["speedup"])
        self.assertAlmostEqual(record["variants"]["async"]["speedup"], 2.0)
        self.assertAlmostEqual(record["variants"]["imported"]["speedup"], 1.0)
        self.assertAlmostEqual(record["variants"]["async"]["gpu_busy"], 0.5)
        self.assertIs(record["ratios"]["imported_vs_stock"]["within_tolerance"], True)
        if "upstream" in timed:
            self.assertAlmostEqual(record["variants"]["async"]["vs_upstream"], 2.0)
        self.assertEqual(set(record["ratios"]), {"async_vs_stock", "imported_vs_stock"} | (
            {"async_vs_upstream", "upstream_vs_stock"} if "upstream" in timed else set()))

        args = argparse.Namespace(reps=2, quick=True)
        reference = {"ms_per_token": 1.0, "new_tokens": 6, "iqr_pct": 1.0, "source": "test"}
        result = {"header": report.header(device, "cmd", args, timed, True, [], reference), "runs": [record]}
        result["header"]["gpu_figures"] = True
        text = report.text_report(result)
        for title in ("vs stock", "vs upstream", "syncs/step", "GPU-busy", "async/stock", "imported/stock (±2%)"):
            self.assertIn(title, text)
        self.assertIn("| floor |", report.markdown(result))

    @unittest.skipUnless(variants.upstream_available(), "no DeferredStopCheck in this transformers release")
    def test_upstream_gate_opens_for_cuda_only_and_is_put_back(self):
        cls = importlib.import_module("transformers.generation.utils").DeferredStopCheck
        stored = vars(cls)["is_supported"]
        with variants.variant("upstream") as flag:
            self.assertEqual(flag, {})
            self.assertFalse(is_patched())
            self.assertTrue(cls.is_supported(torch.device("cuda"), None, False, False))
            self.assertFalse(cls.is_supported(torch.device("cuda"), None, False, True))  # an assistant's loop
            self.assertFalse(cls.is_supported(torch.device("cpu"), None, False, False))
        self.assertIs(vars(cls)["is_supported"], stored)
        self.assertTrue(is_patched())

    def test_ratios(self):
        found = measure.ratios({"stock": [2.0, 2.0, 2.2], "async": [1.0, 1.0, 1.1], "upstream": [1.5, 1.5, 1.5],
                                "imported": [2.02, 2.0, 2.2]})
        self.assertAlmostEqual(found["async_vs_stock"]["value"], 2.0)
        self.assertAlmostEqual(found["async_vs_upstream"]["value"], 1.5)
        self.assertAlmostEqual(found["upstream_vs_stock"]["value"], 2.0 / 1.5)
        self.assertEqual(found["async_vs_stock"]["paired"]["min"], 2.0)
        self.assertTrue(found["imported_vs_stock"]["within_tolerance"])
        self.assertFalse(measure.ratios({"stock": [1.0], "imported": [1.1]})["imported_vs_stock"]["within_tolerance"])
        self.assertEqual(measure.ratios({"async": [1.0]}), {})

    def test_variant_subset_without_stock_and_separate_host_reference(self):
        tiny = catalog.builtin_cases()["tiny-llama"]
        own = {"tiny-copy": dataclasses.replace(tiny, name="tiny-copy", tiny=False)}
        with tempfile.TemporaryDirectory() as traces:
            code, result, _, _ = run_bench(["--quick", "--cases", "tiny-copy", "--modes", "static", "--variants",
                                            "async,floor", "--reps", "2", "--new-tokens", "4", "--trace", traces], own)
            self.assertEqual(os.listdir(traces), ["tiny-copy-static-b1-async.json"])  # stock was not selected
        self.assertEqual(code, 0)
        self.assertEqual(result["header"]["variants"], ["async"])
        self.assertTrue(any("floor skipped" in n for n in result["header"]["notes"]))
        (run,) = result["runs"]
        self.assertEqual(list(run["variants"]), ["async"])
        self.assertIs(run["variants"]["async"]["exact"], True)  # against a stock call made for the purpose
        ref = result["header"]["host_reference"]
        self.assertIsNotNone(ref["ms_per_token"])
        self.assertIn("separately", ref["source"])
        self.assertTrue(is_patched())



def _peft_imports() -> bool:
    try:
        import peft  # noqa: F401
    except Exception:  # noqa: BLE001 (missing, or a release that does not import with this torch/transformers)
        return False
    return True


@unittest.skipUnless(_peft_imports(), "needs peft (the [test] extra)")
class LoraCase(unittest.TestCase):
    def test_the_lora_case_is_opt_in_and_runs_tiny_on_cpu_equal_to_stock(self):
        builtin = catalog.builtin_cases()
        self.assertTrue(builtin["llama-1b-lora"].opt_in)
        model = builtin["llama-1b-lora"].build(torch.device("cpu"), torch.float32)
        self.assertEqual(model.config.hidden_size, cases.tiny_llama_config().hidden_size)  # tiny on the CPU
        lora_b = [p for name, p in model.named_parameters() if "lora_B" in name]
        self.assertEqual(len(lora_b), len(cases.LORA_TARGETS))  # every projection of its one layer
        self.assertTrue(all(bool(p.abs().sum()) for p in lora_b), "a zero B is a no-op adapter")
        del model
        code, result, _, _ = run_bench(["--cases", "llama-1b-lora", "--variants", "stock,async", "--reps", "1",
                                        "--new-tokens", "6"], builtin)
        self.assertEqual(code, 0)
        (run,) = [r for r in result["runs"] if r["case"] == "llama-1b-lora"]
        self.assertEqual(run["label"], "llama-1b-lora eager b1")
        self.assertIsNone(run["error"])
        self.assertIs(run["variants"]["async"]["exact"], True)
        # a peft layer is code the package has not read: each verdict is read at once (module_state.foreign_module)
        self.assertIn("lora", run["variants"]["async"]["path"].lower())


if __name__ == "__main__":
    unittest.main()
