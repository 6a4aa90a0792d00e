"""Tiny random-weight models built from configs (no hub access), and helpers to compare generate() outputs."""

from __future__ import annotations

import contextlib
import warnings

import torch
import transformers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import transformers_async_stop as tas

VOCAB = 48
PAD = 0
PROMPT_LEN = 6
TRANSFORMERS_VERSION = tuple(int(x) for x in transformers.__version__.split(".")[:2])


def build(family: str, seed: int = 0, dtype=torch.float32, device="cpu", attn="sdpa", config_kwargs=None,
          **overrides):
    """`config_kwargs`: passed to the config's constructor (settings it validates or derives from, such as a rope
    scaling); `overrides`: set on the config after it is built."""
    torch.manual_seed(seed)
    # a wide init keeps greedy decoding of a 16-wide model from repeating one token, so EOS can be placed per row
    common = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=1, eos_token_id=2, initializer_range=0.5,
                  **(config_kwargs or {}))
    if family == "llama":
        config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, **{"max_position_embeddings": 128, **common})
        cls = LlamaForCausalLM
    elif family == "gpt2":
        config = GPT2Config(n_embd=16, n_layer=2, n_head=2, n_positions=128, **common)
        cls = GPT2LMHeadModel
    elif family == "qwen2":
        config = Qwen2Config(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, **{"max_position_embeddings": 128, **common})
        cls = Qwen2ForCausalLM
    elif family == "mistral":
        config = MistralConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1,
                               **{"max_position_embeddings": 128, "sliding_window": None, **common})
        cls = MistralForCausalLM
    elif family == "phi3":
        config = Phi3Config(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, **{"max_position_embeddings": 128, **common})
        cls = Phi3ForCausalLM
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    config._attn_implementation = attn
    return cls(config).to(device=device, dtype=dtype).eval()


def prompt(batch: int = 3, left_pad: bool = False, seed: int = 1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, PROMPT_LEN), generator=g)
    mask = torch.ones_like(ids)
    if left_pad:
        for row in range(batch):
            pad = row % 3  # 0, 1, 2 pads
            ids[row, :pad] = PAD
            mask[row, :pad] = 0
    return ids.to(device), mask.to(device)


def eos_ids_finishing_at(model, ids, mask, steps_per_row, max_new_tokens=16):
    """EOS ids that make row r stop at (about) step steps_per_row[r] of a greedy run; None = never."""
    with stock():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=PAD, eos_token_id=None)
    return pick_eos(out[:, ids.shape[1]:].tolist(), steps_per_row) or [VOCAB - 1]


def pick_eos(generated, steps_per_row) -> list[int]:
    """From the tokens each row generated (a run without EOS), EOS ids that stop row r at (about) step
    steps_per_row[r] (None: never): the first token at or after that step not seen before in the row (else the
    nearest one before it), leaving out every token of the rows that must not stop. May be empty."""
    chosen = []
    for tokens, step in zip(generated, steps_per_row):
        if step is None:
            continue
        firsts = [k for k in range(len(tokens)) if tokens[k] not in tokens[:k] and tokens[k] != PAD]
        later = [k for k in firsts if k >= step]
        if later or firsts:
            chosen.append(tokens[later[0] if later else firsts[-1]])
    never = {t for tokens, step in zip(generated, steps_per_row) if step is None for t in tokens}
    return [t for t in dict.fromkeys(chosen) if t not in never]


@contextlib.contextmanager
def stock():
    """Run stock transformers: every patch removed, restored afterwards."""
    was = tas.is_patched()
    tas.unpatch()
    try:
        yield
    finally:
        if was:
            tas.apply()


class CountForwards:
    """Counts model forward calls (the deferred path makes one more when a stop is reported one step late)."""

    def __init__(self, model):
        self.count = 0
        # passive: it must see the flag's extra forward (the tests count it), and keeps no tensor
        self._handle = model.register_forward_hook(tas.passive_hook(self._hook))

    def _hook(self, *args):
        self.count += 1

    def close(self):
        self._handle.remove()


def assert_same(test, a, b, path="output"):
    """Exact, recursive equality of generate() outputs (tensors, tuples, caches)."""
    if isinstance(a, torch.Tensor):
        test.assertIsInstance(b, torch.Tensor, path)
        test.assertEqual(a.shape, b.shape, path)
        test.assertEqual(a.dtype, b.dtype, path)
        test.assertTrue(torch.equal(a, b), f"{path} differs")
    elif isinstance(a, (tuple, list)):
        test.assertEqual(len(a), len(b), f"{path} length")
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(test, x, y, f"{path}[{i}]")
    elif hasattr(a, "layers") or hasattr(a, "self_attention_cache"):
        assert_same_cache(test, a, b, path)
    elif hasattr(a, "keys") and callable(getattr(a, "keys")) and hasattr(a, "__getitem__"):
        test.assertEqual(set(a.keys()), set(b.keys()), path)
        for key in a.keys():
            assert_same(test, a[key], b[key], f"{path}.{key}")
    else:
        test.assertEqual(a, b, path)


def assert_same_cache(test, a, b, path="cache"):
    test.assertIs(type(a), type(b), path)
    if hasattr(a, "self_attention_cache"):  # EncoderDecoderCache: the decoder's cache and the cross-attention one
        assert_same_cache(test, a.self_attention_cache, b.self_attention_cache, f"{path}.self_attention_cache")
        assert_same_cache(test, a.cross_attention_cache, b.cross_attention_cache, f"{path}.cross_attention_cache")
        return
    test.assertEqual(int(a.get_seq_length()), int(b.get_seq_length()), f"{path} length")
    for i, (x, y) in enumerate(zip(a.layers, b.layers)):
        for name in ("keys", "values"):
            tx, ty = getattr(x, name, None), getattr(y, name, None)
            if isinstance(tx, torch.Tensor):
                test.assertTrue(torch.equal(tx, ty), f"{path}.layers[{i}].{name} differs")
        cx, cy = getattr(x, "cumulative_length", None), getattr(y, "cumulative_length", None)
        if cx is not None:
            test.assertEqual(int(cx), int(cy), f"{path}.layers[{i}].cumulative_length")


def generate_and_draw(model, ids, mask, flag, seed=123, **kwargs):
    """generate() with `async_stopping_criteria=flag` (None: leave it out, for stock), then one draw from the RNG
    (the extra step must not have consumed any). Returns (output, the draw, forward calls)."""
    counter = CountForwards(model)
    try:
        torch.manual_seed(seed)
        if flag is not None:
            kwargs["async_stopping_criteria"] = flag
        out = model.generate(ids, attention_mask=mask, pad_token_id=PAD, **kwargs)
        after = torch.rand(4)
    finally:
        counter.close()
    return out, after, counter.count


def count_syncs(fn) -> int:
    """Blocking syncs of `fn()` on CUDA, counted by torch's sync debug mode."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


def assert_flag_matches_stock(test, model, ids, mask, device, seed=3, **kwargs):
    """generate() with the flag returns stock transformers' output and leaves `device`'s RNG in the same state."""
    def run(**extra):
        torch.manual_seed(seed)
        out = model.generate(ids, attention_mask=mask, **kwargs, **extra)
        return out, torch.rand(4, device=device)

    with stock():
        ref, ref_after = run()
    on, on_after = run(async_stopping_criteria=True)
    assert_same(test, ref, on)
    test.assertTrue(torch.equal(ref_after, on_after), f"RNG state of {device} after generate() differs")
