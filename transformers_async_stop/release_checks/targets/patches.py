"""The patch targets: every object this package replaces, the releases it is in, the parameters its replacement
relies on (the first half of the table `targets` is; `shortcuts.py` is the other)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """One attribute of one transformers object that this package replaces."""

    name: str  # "module:Owner.attr" or "module:attr", for logs and tests
    module: str
    owner: str | None  # class name inside `module`, or None for a module-level function
    attr: str
    factory: str  # "submodule:function" in this package that builds the replacement from the original
    # parameter names the replacement relies on (checked by the drift test); "a|b": either name (a rename)
    params: tuple[str, ...] = ()
    present: str = "4.57+"  # releases it exists in: "4.57+", "4.57-5.2", "5.17+" (release = major.minor)
    required: bool = True  # missing while expected -> logged as a warning (else: info)
    why: str = ""

    def resolve_owner(self):
        mod = importlib.import_module(self.module)
        return getattr(mod, self.owner) if self.owner else mod


_GEN = "transformers.generation.utils"
_MASK = "transformers.masking_utils"
_CFG = "transformers.generation.configuration_utils"

TARGETS: tuple[Target, ...] = (
    # --- the flag --------------------------------------------------------------------------------------------
    Target(
        "GenerationConfig.__init__", _CFG, "GenerationConfig", "__init__", "config:patched_init",
        why="accept and store `async_stopping_criteria`",
    ),
    Target(
        "GenerationConfig.validate", _CFG, "GenerationConfig", "validate", "config:patched_validate",
        why="reject a non-bool flag with an error that names the value",
    ),
    Target(
        "GenerationConfig._get_default_generation_params", _CFG, "GenerationConfig",
        "_get_default_generation_params", "config:patched_defaults", present="5.0+",
        why="5.x resolves unset (None) fields from this table; ours resolves to False",
    ),
    Target(
        "GenerationConfig.async_stopping_criteria", _CFG, "GenerationConfig", "async_stopping_criteria",
        "config:class_default", present="new", required=False,
        why="class-level default so configs built before import still accept the generate() keyword",
    ),
    # --- the decode loop -------------------------------------------------------------------------------------
    Target(
        "GenerationMixin.generate", _GEN, "GenerationMixin", "generate", "generation:patched_generate",
        why="scope for the sync-free input preparation; warning for custom_generate",
    ),
    Target(
        "GenerationMixin._sample", _GEN, "GenerationMixin", "_sample", "generation:patched_sample",
        params=("input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus", "streamer"),
        why="runs the loop with the side-stream criteria, the lagged verdict, and undoes the extra step",
    ),
    Target(
        "GenerationMixin._has_unfinished_sequences", _GEN, "GenerationMixin", "_has_unfinished_sequences",
        "generation:patched_has_unfinished_sequences", params=("this_peer_finished", "synced_gpus", "device"),
        why="4.57-5.16 pass a device tensor here and read it each step; we read the previous step's verdict. "
            "With synced_gpus (5.17+) the peers' all-reduce is deferred here too",
    ),
    Target(
        "generation.utils.DeferredStopCheck", _GEN, None, "DeferredStopCheck",
        "control.stop_check:patched_deferred_class",
        present="5.17+", required=False,
        params=("input_ids", "max_length", "cache", "cache_is_returned", "streamer"),
        why="5.17+ builds its stop check from this module global; ours is sync-free on CUDA, not MPS-only",
    ),
    Target(
        "GenerationMixin._cache_dependant_input_preparation", _GEN, "GenerationMixin",
        "_cache_dependant_input_preparation", "sync_free.inputs:patched_cache_dependant_input_preparation",
        present="4.57-5.2", required=False, params=("input_ids", "inputs_embeds", "cache_position"),
        why="`cache_position[-1] >= input_ids.shape[1]` reads a device tensor every step",
    ),
    Target(
        "GenerationMixin._update_model_kwargs_for_generation", _GEN, "GenerationMixin",
        "_update_model_kwargs_for_generation", "sync_free.masking:patched_update_model_kwargs",
        params=("outputs", "model_kwargs"),
        why="tags each grown attention mask with a host-side summary of its padding; shows the deferred loop its "
            "cache after the first forward (4.57-5.16 create it there)",
    ),
    Target(
        "GenerationMixin._beam_search", _GEN, "GenerationMixin", "_beam_search", "loops.beam:patched_beam_search",
        params=("input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus"),
        why="runs beam search with the lagged verdict; undoes the extra step in what it returns",
    ),
    Target(
        "GenerationMixin._beam_search_has_unfinished_sequences", _GEN, "GenerationMixin",
        "_beam_search_has_unfinished_sequences", "loops.beam:patched_beam_verdict",
        params=("is_early_stop_heuristic_unsatisfied", "is_sent_finished", "next_token_hits_stopping_criteria"),
        why="its device verdict is read by `not` every step; we answer from the previous step's",
    ),
    Target(
        "GenerationMixin._update_finished_beams", _GEN, "GenerationMixin", "_update_finished_beams",
        "loops.beam:patched_update_finished_beams",
        params=("sequences", "topk_running_sequences", "beam_scores", "topk_log_probs", "beam_indices"),
        why="keeps the finished beams of the step the flag-off run stopped at, through the extra step",
    ),
    Target(
        "PreTrainedModel.warn_if_padding_and_no_attention_mask", "transformers.modeling_utils", "PreTrainedModel",
        "warn_if_padding_and_no_attention_mask", "generation:patched_padding_warning",
        params=("input_ids", "attention_mask"),
        why="`pad_token_id in input_ids[:, [-1, 0]]` reads a device tensor each decode step once 5.18+ drops an "
            "all-ones mask (GPT-2 and others); with the flag a decode step's check runs on a host copy at the "
            "next verdict read (padding_check.py)",
    ),
    Target(
        "CacheLayerMixin.reorder_cache", "transformers.cache_utils", "CacheLayerMixin", "reorder_cache",
        "loops.beam:patched_reorder_cache", params=("beam_idx",),
        why="`if self.get_seq_length() > 0` reads a static layer's device counter once per layer per beam step",
    ),
    Target(
        "generation.utils.create_masks_for_generate", _GEN, None, "create_masks_for_generate",
        "sync_free.static_mask:patched_create_masks_for_generate", present="4.57+", required=False,
        params=("config", "attention_mask", "past_key_values|cache"),  # 5.24 renames it `cache`
        why="with a static cache, ~20 kernels and a long Python chain build the same decode-step mask every step; "
            "with the flag (5.17+) a per-call plan builds it in two (`SHORTCUTS`: 'static decode mask')",
    ),
    # --- the SDPA mask-skip check ----------------------------------------------------------------------------
    Target(
        "masking_utils._preprocess_mask_arguments", _MASK, None, "_preprocess_mask_arguments",
        "sync_free.masking:patched_preprocess_mask_arguments", params=("config", "attention_mask"),
        why="carries the padding summary across the `.to(torch.bool)` copy",
    ),
    Target(
        "masking_utils.prepare_padding_mask", _MASK, None, "prepare_padding_mask",
        "sync_free.masking:patched_prepare_padding_mask", params=("attention_mask", "kv_length", "kv_offset"),
        why="carries the padding summary across the right-padding to kv_length",
    ),
    Target(
        "masking_utils._ignore_causal_mask_sdpa", _MASK, None, "_ignore_causal_mask_sdpa",
        "sync_free.masking:patched_ignore_mask", params=("padding_mask",),
        why="`padding_mask.all()` / `fast_all(padding_mask)` reads a device tensor every decode step",
    ),
    Target(
        "masking_utils._ignore_bidirectional_mask_sdpa", _MASK, None, "_ignore_bidirectional_mask_sdpa",
        "sync_free.masking:patched_ignore_mask", present="5.0+", params=("padding_mask",),
        why="same read, for bidirectional masks built from a tagged mask",
    ),
    # --- assisted decoding and prompt lookup (assisted/) -----------------------------------------------------
    Target(
        "GenerationMixin._assisted_decoding", _GEN, "GenerationMixin", "_assisted_decoding",
        "loops.assisted:patched_assisted_decoding",
        params=("input_ids", "logits_processor", "stopping_criteria", "generation_config", "synced_gpus", "streamer"),
        why="the verify loop reads the device several times per round; ours reads once per round "
            "(ported per release: `SHORTCUTS` 'assisted decoding loop (...)')",
    ),
    Target(
        "GenerationMixin._get_candidate_generator", _GEN, "GenerationMixin", "_get_candidate_generator",
        "loops.assisted:patched_get_candidate_generator",
        params=("generation_config", "input_ids", "inputs_tensor", "logits_processor", "model_kwargs"),
        why="hands the stock loop the candidate generator the deferred path already built (its constructor runs once)",
    ),
    Target(
        "GenerationMixin._prepare_special_tokens", _GEN, "GenerationMixin", "_prepare_special_tokens",
        "loops.assisted.draft:patched_prepare_special_tokens",
        params=("generation_config", "kwargs_has_attention_mask", "device"),
        why="three blocking H2D copies and two reads in every round's assistant generate(); made once per call there",
    ),
    Target(
        "GenerationMixin._get_logits_processor", _GEN, "GenerationMixin", "_get_logits_processor",
        "loops.assisted.draft:patched_get_logits_processor", params=("generation_config", "encoder_input_ids"),
        why="5.21+ reads `(encoder_input_ids < 0).any()` in every round's assistant generate(), to gate encoder "
            "processors the draft does not use",
    ),
)


def present_in(target: Target, version: tuple[int, int]) -> bool | None:
    """Whether the table expects `target` in release `version` (None: the table makes no claim)."""
    spec = target.present
    if spec == "new":
        return None
    lo, _, hi = spec.partition("-")
    lo_v = tuple(int(x) for x in lo.rstrip("+").split("."))
    if spec.endswith("+"):
        return version >= lo_v
    hi_v = tuple(int(x) for x in hi.split("."))
    return lo_v <= version <= hi_v
