"""What is benchmarked: the cases (a model and its workload), their runs, and the generate() kwargs of a run.

A case builds one model (random weights from a config, no hub download; or a local checkpoint) and owns several
runs (mode x batch x decode), all measured on that one model. `generate_kwargs` is the one place where a run turns
into `generate()` keyword arguments: a case's own extras (user criteria and processors today; an assistant model
for assisted decoding later) come in through `Case.extra` there.

Named cases of what users run (opt-in: `--cases issue-43089,chat-tiny,chat-llama-1b`), each with a static-cache and
a dynamic-cache run:
- `issue-43089`: transformers #43089's script, its processor and criterion as written there (nothing declared
  `graph_safe`), greedy, batch 1;
- `chat-tiny`, `chat-llama-1b`: the generation config many chat checkpoints ship (sampling, temperature 0.7,
  top_p 0.9, top_k 50, repetition_penalty 1.1), on the tiny Llama and on a Llama-1B-shaped bf16 model, batch 1.
`llama-1b-lora` is the Llama-1B-shaped bf16 model with a peft LoRA adapter (r=16 on every projection, random non-zero
B), greedy, batch 1, DynamicCache: the path and speed a LoRA user gets (needs peft: `pip install peft`).
`tiny-llama` stays what the docs' tables measured: the same tiny model with a plain second softmax declared
`graph_safe`. Which path each variant took, and whether its tail was captured, is the report's `path` column
(`transformers_async_stop.last_path()`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from ..loops.static_loop import graph_safe

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MODES = ("eager", "static")
BEAMS = 4
QUICK_NEW_TOKENS = 16
REFERENCE_CASE = "tiny-llama"  # its stock eager b1 ms/token is each run's host-speed reference


# --- the workload of transformers issue #43089 --------------------------------------------------------------------
# Two cases run it. `issue-43089` is the issue's script as its users run it: its processor and criterion as written
# there, nothing declared. `tiny-llama` (the docs' tables, and each run's host-speed reference) is the package's
# earlier rendering of it: a plain second softmax, declared `graph_safe` as the README asks.
class AlwaysPassStoppingCriteria(StoppingCriteria):
    """transformers #43089's criterion, as written there: never stops (the stop flag is still read every step)."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class ExtraSoftmaxLogitsProcessor(LogitsProcessor):
    """transformers #43089's processor, as written there: log-probabilities through one more softmax. Not declared
    `graph_safe`: the issue's user does not know about the declaration."""

    def __call__(self, input_ids, scores):
        return torch.log(F.softmax(scores, dim=-1) + 1e-10)


def issue_43089_as_written(run: "Run", model) -> dict:
    return {"stopping_criteria": StoppingCriteriaList([AlwaysPassStoppingCriteria()]),
            "logits_processor": LogitsProcessorList([ExtraSoftmaxLogitsProcessor()])}


class NeverStop(StoppingCriteria):
    """A user criterion that never fires: the stop flag still has to be read every step."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@graph_safe
class ExtraSoftmax(LogitsProcessor):
    """A user logits processor that applies a second softmax: one more small kernel per step. A pure function of
    the scores, so declared `graph_safe` (as its user would, following the README): with the flag the static-cache
    loop may capture it (stock ignores the declaration)."""

    def __call__(self, input_ids, scores):
        return scores.softmax(-1)


def issue_43089_extras(run: "Run", model) -> dict:
    return {"stopping_criteria": StoppingCriteriaList([NeverStop()]),
            "logits_processor": LogitsProcessorList([ExtraSoftmax()])}


# --- the generation config many chat checkpoints ship -------------------------------------------------------------
CHAT_CONFIG = dict(temperature=0.7, top_p=0.9, top_k=50, repetition_penalty=1.1)  # with do_sample=True (the runs'
# decode is "sample"): temperature, top-k and top-p are capturable warpers, `repetition_penalty` reads `input_ids`
CHAT_RUNS = (("eager", "sample"), ("static", "sample"))


def chat_config(run: "Run", model) -> dict:
    return dict(CHAT_CONFIG)


# --- cases and runs -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[torch.device, torch.dtype], torch.nn.Module]
    batches: tuple[int, ...]
    new_tokens: int
    prompt_len: int
    dtype: str  # default on CUDA; CPU runs in fp32 unless --dtype says otherwise
    pad_token_id: int | None = None  # None: taken from the model's generation config
    tiny: bool = False  # cheap enough for CPU and --quick
    # extra generate() kwargs of every run of the case: (run, model) -> dict. Stopping criteria and logits
    # processors given here are the user's own; an assistant model (assisted decoding) would come in here too.
    extra: Callable[["Run", torch.nn.Module], dict] | None = None
    # the case's own (mode, decode) runs instead of every mode plus the extras (assisted decoding: eager only)
    plan: tuple[tuple[str, str], ...] | None = None
    opt_in: bool = False  # run only when named in --cases
    about: str = ""  # one line on what the case runs (`--help` lists it)
    # a workload (`workloads/`: "stream", "padded" or "chat"): a sequence of calls timed as whole passes, cold and
    # warm, in fresh threads, instead of the per-step difference of one call
    workload: str | None = None
    # a case whose model takes other inputs than token ids (a speech encoder's features): (run, model, device) ->
    # the generate() inputs of its runs; None: `make_inputs`' prompt of token ids
    inputs: Callable[["Run", torch.nn.Module, torch.device], dict] | None = None


@dataclasses.dataclass(frozen=True)
class Run:
    """One measured configuration of a case: every variant runs on it."""

    case: Case
    mode: str  # "eager" (DynamicCache) or "static" (StaticCache, auto-compiled into CUDA graphs on CUDA)
    batch: int
    decode: str  # "greedy", "sample", "padded" (greedy, left-padded batch) or "beam" (BEAMS beams, greedy)
    new_tokens: int
    dtype: str

    @property
    def label(self) -> str:
        if self.case.workload:  # its batch sizes and lengths are the workload's own (`workloads/cases.py`)
            return f"{self.case.name} {self.mode}"
        extra = "" if self.decode == "greedy" else f" {self.decode}"
        return f"{self.case.name} {self.mode} b{self.batch}{extra}"


def _from_config(config) -> Callable[[torch.device, torch.dtype], torch.nn.Module]:
    def build(device, dtype):
        torch.manual_seed(0)
        # built directly on the device: initialising 1B parameters on the CPU first takes longer than the benchmark
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.eval()

    return build


def _from_checkpoint(path: str) -> Callable[[torch.device, torch.dtype], torch.nn.Module]:
    def build(device, dtype):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
        return model.to(device).eval()

    return build


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK = 16


def _with_lora(config) -> Callable[[torch.device, torch.dtype], torch.nn.Module]:
    """A peft model (`get_peft_model`, peft's defaults otherwise) over the model of `config`: a LoRA adapter of rank
    LORA_RANK on every projection, B drawn like the model's own weights (peft's default B is zero: a no-op adapter).
    Llama-1B-shaped on CUDA; on the CPU the tiny Llama, so that the case runs there too."""
    def build(device, dtype):
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as exc:
            raise RuntimeError("the LoRA case needs peft: pip install peft") from exc
        model = _from_config(config if device.type == "cuda" else tiny_llama_config())(device, dtype)
        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK,
                                                 target_modules=list(LORA_TARGETS)))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=model.config.initializer_range)
        return model.eval()

    return build


def tiny_llama_config() -> LlamaConfig:
    """The tiny Llama of transformers issue #43089."""
    return LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=1, num_key_value_heads=1)


def llama_1b_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256)


def plain_cases() -> dict[str, Case]:
    """The built-in cases but assisted decoding's (`catalog.builtin_cases` adds those)."""
    tiny, llama_1b = tiny_llama_config(), llama_1b_config()
    return {
        "tiny-llama": Case("tiny-llama", _from_config(tiny), (1,), 64, 8, "fp32", pad_token_id=0, tiny=True,
                           extra=issue_43089_extras,
                           about="the 1-layer Llama of #43089, greedy b1, a never-firing criterion and a graph_safe "
                                 "softmax (the docs' tables)"),
        # the cases users run (opt-in: name them in --cases); each has a static and a dynamic-cache run
        "issue-43089": Case("issue-43089", _from_config(tiny), (1,), 64, 8, "fp32", pad_token_id=0, tiny=True,
                            extra=issue_43089_as_written, opt_in=True,
                            about="transformers #43089's script as written (its processor and criterion, nothing "
                                  "declared graph_safe), greedy b1"),
        "chat-tiny": Case("chat-tiny", _from_config(tiny), (1,), 64, 8, "fp32", pad_token_id=0, tiny=True,
                          extra=chat_config, plan=CHAT_RUNS, opt_in=True,
                          about="a chat checkpoint's sampling config (temperature 0.7, top-p 0.9, top-k 50, "
                                "repetition penalty 1.1) on the tiny Llama, b1"),
        "chat-llama-1b": Case("chat-llama-1b", _from_config(llama_1b), (1,), 128, 32, "bf16", pad_token_id=0,
                              extra=chat_config, plan=CHAT_RUNS, opt_in=True,
                              about="the same chat sampling config on a Llama-1B-shaped bf16 model, b1"),
        "gpt2": Case("gpt2", _from_config(GPT2Config()), (1, 32), 100, 32, "fp32", pad_token_id=50256,
                     about="GPT-2 (124M shape), greedy b1 and b32"),
        "llama-1b": Case("llama-1b", _from_config(llama_1b), (1, 32), 128, 32, "bf16", pad_token_id=0,
                         about="a Llama-1B-shaped bf16 model, greedy b1 and b32 (CUDA with 8 GiB)"),
        "llama-1b-lora": Case("llama-1b-lora", _with_lora(llama_1b), (1,), 128, 32, "bf16", pad_token_id=0,
                              plan=(("eager", "greedy"),), opt_in=True,
                              about="the Llama-1B-shaped bf16 model with a peft LoRA adapter (r=16 on every "
                                    "projection), greedy b1 DynamicCache (tiny on CPU; needs peft)"),
    }


def model_case(path: str) -> Case:
    name = "model:" + os.path.basename(os.path.normpath(path))
    return Case(name, _from_checkpoint(path), (1,), 128, 32, "bf16")


def _names(text: str | None) -> list[str]:
    return [n.strip() for n in (text or "").split(",") if n.strip()]


def plan_runs(args, device: torch.device, cases: dict[str, Case]) -> list[tuple[Case, list[Run]]]:
    """The cases to run, each with its runs; a case's runs share one model."""
    if args.cases:
        names = _names(args.cases)
        unknown = [n for n in names if n not in cases]
        if unknown:
            raise SystemExit(f"unknown case(s) {unknown}; known: {', '.join(cases)}")
    elif args.quick or device.type != "cuda":
        names = [n for n, c in cases.items() if c.tiny and not c.opt_in]
    else:
        names = [n for n, c in cases.items() if not c.opt_in and (n != "llama-1b" or _gpu_gib(device) >= 8)]
    selected = [cases[n] for n in names]
    if args.model:
        selected.append(model_case(args.model))

    # the sampling, left-padded (static and dynamic cache) and beam-search runs go to the largest built-in case
    # selected (tiny on CPU)
    extras_to = next((n for n in ("llama-1b", "tiny-llama") if n in names), None)
    modes = _names(args.modes) or list(MODES)
    plan = []
    for case in selected:
        if case.plan is not None:
            # a workload's batches are its own (`workloads/cases.py`): --batch does not apply
            batches = case.batches if case.workload else (args.batch or case.batches)
            plan.append((case, [run_of(case, args, device, mode, b, decode) for mode, decode in case.plan
                                if mode in modes for b in batches]))
            continue
        runs = [run_of(case, args, device, mode, b) for mode in modes for b in (args.batch or case.batches)]
        if case.name == extras_to and "static" in modes:
            first = args.batch[0] if args.batch else None
            runs.append(run_of(case, args, device, "static", first or 1, "sample"))
            runs.append(run_of(case, args, device, "static", first or 8, "padded"))
            runs.append(run_of(case, args, device, "static", first or 1, "beam"))
        if case.name == extras_to and "eager" in modes:
            # the default DynamicCache's left-padded batch (issue 27's `llama-1b` eager padded b8 row): the graphed
            # forward replays with the loop's grown 4D mask there
            first = args.batch[0] if args.batch else None
            runs.append(run_of(case, args, device, "eager", first or 8, "padded"))
        plan.append((case, runs))
    return plan


def run_of(case: Case, args, device: torch.device, mode: str, batch: int, decode: str = "greedy") -> Run:
    new_tokens = args.new_tokens or (QUICK_NEW_TOKENS if args.quick else case.new_tokens)
    dtype = args.dtype or (case.dtype if device.type == "cuda" else "fp32")
    return Run(case, mode, batch, decode, new_tokens, dtype)


def _gpu_gib(device: torch.device) -> float:
    return torch.cuda.get_device_properties(device).total_memory / 2**30


# --- inputs and generate() kwargs ---------------------------------------------------------------------------------
def make_inputs(run: Run, model, device: torch.device) -> dict:
    if run.case.inputs is not None:
        return run.case.inputs(run, model, device)
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(1)
    # ids 3..vocab-2: clear of the usual special tokens (bos/eos/pad at the ends of the vocabulary)
    ids = torch.randint(3, vocab - 1, (run.batch, run.case.prompt_len), generator=gen)
    mask = torch.ones_like(ids)
    if run.decode == "padded":
        step = max(1, run.case.prompt_len // 8)
        for row in range(run.batch):
            pad = ((row + 1) % 4) * step  # rows 3, 7, ... unpadded; the others 1-3 eighths of the prompt
            mask[row, :pad] = 0
            ids[row, :pad] = pad_token_id(run.case, model)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def pad_token_id(case: Case, model) -> int:
    if case.pad_token_id is not None:
        return case.pad_token_id
    config = model.generation_config
    for candidate in (config.pad_token_id, config.eos_token_id):
        if isinstance(candidate, (list, tuple)):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def generate_kwargs(run: Run, model, inputs: dict, new_tokens: int) -> dict:
    """The generate() kwargs of a run, the same for every variant (a variant adds only its flag, if any)."""
    kwargs = dict(
        inputs,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # eos is masked until the budget is spent: every variant does the same work
        do_sample=run.decode == "sample",
        num_beams=BEAMS if run.decode == "beam" else 1,
        pad_token_id=pad_token_id(run.case, model),
    )
    if run.mode == "static":
        kwargs["cache_implementation"] = "static"
    if run.case.extra is not None:
        kwargs.update(run.case.extra(run, model))
    return kwargs
