"""The shortcuts: stock computations a flag-on call makes itself, each with the digests of the upstream sources it
was read against (the second half of the table `targets` is; `patches.py` is the other)."""

from __future__ import annotations

from dataclasses import dataclass

from .patches import _GEN, _MASK


@dataclass(frozen=True)
class Shortcut:
    """A piece of stock code that a flag-on call computes itself, once per call where stock does it every step.

    It is taken only where every upstream source it replicates has one of the digests below (`verified.py`); the
    digests map to the releases they were read in. Elsewhere the stock code runs.
    """

    name: str
    sources: tuple[str, ...]  # "module:Qual.name" of each upstream object whose behaviour it reproduces
    digests: dict  # source -> {digest: releases}
    used_by: str
    why: str
    present: str = "4.57+"  # the releases it is taken on (the drift test checks the digests there)


_LP = "transformers.generation.logits_process"
_SC = "transformers.generation.stopping_criteria"
_CU = "transformers.cache_utils"
_CG = "transformers.generation.candidate_generator"

# sources several shortcuts read
_UPDATE_KWARGS = {"9d022aaeb64d": "5.5.4-5.23.0", "25beab9f9d29": "5.24.0"}  # 5.24: the cache is copied as `cache`
_TEMPERATURE = {"275ebb389db2": "4.57.6-5.22.2", "d3ca7666874e": "5.23.0-5.24.0"}


# The verify loop of assisted decoding, ported per release (`assisted/loop.py` PORTS, one port per row): the port's
# name, then the digests of `_assisted_decoding`, `_speculative_sampling` and the assistant's
# `_update_past_and_masks` it was read against, and the releases it is taken on.
_SPEC_OLD = {"f51c59e9372d": "4.57.6-5.13.1"}
_PAST_OLD, _PAST_MID, _PAST_NEW = ({"984a60ce5cd1": "4.57.6-5.1.0"}, {"8fbfdda00362": "5.2.0-5.14.1"},
                                   {"eb47726dea03": "5.16.1-5.23.0"})
# 5.24 renames the assistant's cache `cache` (`assistant_kwargs["cache"]`): the same crop and masks
_PAST_524 = {"3cc1f2b2f2f0": "5.24.0"}
_ASSISTED_LOOP_ROWS = (
    ("4.57", {"6227f5c094f8": "4.57.6"}, _SPEC_OLD, _PAST_OLD, "4.57-4.57"),
    ("5.0-5.1", {"9eeeb5007e6d": "5.0.0-5.1.0"}, _SPEC_OLD, _PAST_OLD, "5.0-5.1"),
    ("5.2", {"4786665e55c5": "5.2.0"}, _SPEC_OLD, _PAST_MID, "5.2-5.2"),
    ("5.3", {"b3dfb4e24c35": "5.3.0"}, _SPEC_OLD, _PAST_MID, "5.3-5.3"),
    ("5.4", {"e12140a3c41b": "5.4.0"}, _SPEC_OLD, _PAST_MID, "5.4-5.4"),
    # 5.8 adds only the branches of generators that need the target's outputs (MTP), which run stock
    ("5.5-5.13", {"59e195d258ad": "5.5.4-5.7.0", "e1b14346aee8": "5.8.1-5.13.1"}, _SPEC_OLD, _PAST_MID, "5.5-5.13"),
    ("5.14", {"9475d1c4bcc0": "5.14.1"}, {"ad6f066d0688": "5.14.1"}, _PAST_MID, "5.14-5.14"),
    # 5.15 crops the assistant's cache by a relative count, 5.16+ to an absolute length: the same cut where the
    # draft loop leaves stock's cache length, which the deferred draft does (its extra token is undone)
    ("5.15-5.17", {"d627364536c0": "5.15.1-5.17.0"}, {"b082a94a87a4": "5.15.1-5.17.0"},
     {"9211559f01ef": "5.15.1", **_PAST_NEW}, "5.15-5.17"),
    # 5.18.0-5.22.2 differ from 5.23.0 only in the annotation and docstring of `inputs_tensor`
    ("5.18-5.23", {"0f204ece31d0": "5.18.0-5.22.2", "34ef66021aba": "5.23.0"}, {"51a96b7a06b5": "5.18.0-5.24.0"},
     _PAST_NEW, "5.18-5.23"),
    # 5.24: no static-cache refusal (nor `use_cache` check), rounds after the first through the compiled forward
    # under `_optimize_model_for_decode`, a croppable-cache check after the prefill, the cache named `cache`
    ("5.24", {"8d8b8e148a13": "5.24.0"}, {"51a96b7a06b5": "5.18.0-5.24.0"}, _PAST_524, "5.24+"),
)
_ASSISTED_LOOPS = tuple(
    Shortcut(
        f"assisted decoding loop ({name})",
        (f"{_GEN}:GenerationMixin._assisted_decoding", f"{_GEN}:_speculative_sampling",
         f"{_CG}:AssistedCandidateGenerator._update_past_and_masks"),
        {f"{_GEN}:GenerationMixin._assisted_decoding": loop, f"{_GEN}:_speculative_sampling": speculative,
         f"{_CG}:AssistedCandidateGenerator._update_past_and_masks": past},
        "assisted.loop.run", present=present,
        why="the verify loop, ported: acceptance on the device, one read per round",
    )
    for name, loop, speculative, past, present in _ASSISTED_LOOP_ROWS
)

# the mask functions and cache sizes a decode step's 4D mask is built from, read for both decode-mask shortcuts
_DECODE_MASK_DIGESTS = {
    f"{_MASK}:create_causal_mask": {
        "08e44eae3326": "5.17.0-5.19.0", "bd4450cc85d6": "5.20.2-5.22.2", "341ee68974b1": "5.23.0",
        "143e39d36ae2": "5.24.0"},
    f"{_MASK}:_preprocess_mask_arguments": {"df23eb733c6e": "5.14.1-5.23.0", "606823244fa4": "5.24.0"},
    f"{_MASK}:sdpa_mask": {
        "acbbdd247878": "5.15.1-5.18.0", "2a073d7981cd": "5.19.0", "a30991b130d8": "5.20.2-5.24.0"},
    f"{_MASK}:prepare_padding_mask": {"ad0de58050a9": "5.0.0-5.24.0"},
    f"{_MASK}:padding_mask_function": {"5682e7f76fc8": "4.57.6-5.24.0"},
    f"{_MASK}:causal_mask_function": {"e8566f1e2978": "4.57.6-5.24.0"},
    f"{_MASK}:and_masks": {"789b132c21d8": "4.57.6-5.24.0"},
    f"{_MASK}:_non_vmap_expansion_sdpa": {"5a75af9fba8f": "5.0.0-5.24.0"},
    f"{_CU}:Cache.get_mask_sizes": {"6c372f7d47d1": "5.5.4-5.22.2", "979ed43a0b27": "5.23.0"},
    f"{_CU}:Cache.get_query_offset": {"0890a0e73381": "5.14.1-5.23.0"},
    f"{_CU}:Cache.get_seq_length": {"f0db0f879ef6": "5.5.4-5.22.2", "744955eaa379": "5.23.0"},
}
_STATIC_MASK_DIGESTS = {
    f"{_MASK}:create_masks_for_generate": {"89a12bcbea32": "5.15.1-5.23.0", "e82179b671a2": "5.24.0"},
    **_DECODE_MASK_DIGESTS,
    f"{_CU}:StaticLayer.get_mask_sizes": {"5e6bf16b2055": "5.4.0-5.23.0"},
    f"{_CU}:StaticLayer.get_seq_length": {"0a7f87bee680": "5.4.0-5.23.0"},
}
# a padded batch's decode mask with a dynamic cache (`dynamic_loop/wide_mask.py`): these sources, plus the forwards of
# each model family read (their digests alone also match releases before the loop, so each family's shortcut holds
# both)
_DYNAMIC_MASK_DIGESTS = {
    **_DECODE_MASK_DIGESTS,
    f"{_CU}:DynamicLayer.get_mask_sizes": {"07994c0bd296": "5.17.0-5.23.0"},
    f"{_CU}:DynamicLayer.get_seq_length": {"a134511137c7": "5.17.0-5.23.0"},
}

_GROWN_MASK_ROWS = (  # family, modeling module, base model and causal LM with the digests of their `forward`s
    ("llama", "transformers.models.llama.modeling_llama",
     "LlamaModel", {"aa5e80868d38": "5.17.0-5.22.2", "3bc97b32d434": "5.23.0", "6ad906eadeb4": "5.24.0"},
     "LlamaForCausalLM", {"70b8a70f207c": "5.17.0-5.20.2", "88ab78d8a65e": "5.21.1-5.22.2", "c1729a1872c8": "5.23.0",
                          "7c3c3983abb9": "5.24.0"}),
    ("mistral", "transformers.models.mistral.modeling_mistral",
     "MistralModel", {"b237e110b64c": "5.17.0-5.22.2", "dc333785d7df": "5.23.0", "0a953917a1d6": "5.24.0"},
     "MistralForCausalLM",
     {"cb3ef7d01ef6": "5.17.0-5.20.2", "17d5053f7fe8": "5.21.1-5.22.2", "d212cdaee547": "5.23.0",
      "ed35883a09a5": "5.24.0"}),
    ("qwen2", "transformers.models.qwen2.modeling_qwen2",
     "Qwen2Model", {"040ee3766c9f": "5.17.0-5.22.2", "af291875cf36": "5.23.0", "4098825e5a45": "5.24.0"},
     "Qwen2ForCausalLM", {"10095c638162": "5.17.0-5.20.2", "67993adf9efd": "5.21.1-5.22.2", "da4cda5e6f6d": "5.23.0",
                          "d57926925356": "5.24.0"}),
)
_GROWN_MASKS = tuple(
    Shortcut(
        f"dynamic decode mask ({family})",
        (*_DYNAMIC_MASK_DIGESTS, f"{module}:{base}.forward", f"{module}:{lm}.forward"),
        {**_DYNAMIC_MASK_DIGESTS, f"{module}:{base}.forward": base_digests, f"{module}:{lm}.forward": lm_digests},
        "dynamic_loop.wide_mask", present="5.17+",
        why="with a padded batch, the model rebuilds its 4D mask inside every forward (about ten kernels and a long "
            "Python chain): the decode-step mask is grown by one column instead",
    )
    for family, module, base, base_digests, lm, lm_digests in _GROWN_MASK_ROWS
)


# Phi-3's `prepare_inputs_for_generation` (PhiMoE's is the same text) passes no cache to a forward whose input is
# longer than `original_max_position_embeddings` while the cache holds no more than that (4.57: only with a
# `rope_scaling` set; 4.57-5.3 take the cache's length from `cache_position[0]`, 5.4+ from `get_seq_length()`; 5.20+
# also ask the generic preparation for the whole sequence): never one whose input is shorter, on every release read.
# The flag reads each verdict at once from that length on (`input_drops.drop_length`); elsewhere from the first step.
_ROPE_SWITCH = {"55b680a533c6": "4.57.6", "0f2bac97b3ab": "5.0.0-5.3.0", "d0d891a916ce": "5.4.0-5.14.1",
                "28dba0791656": "5.15.1-5.19.0", "ca5a947f41e7": "5.20.2-5.23.0", "0fc3c62aa7ef": "5.24.0"}
_INPUT_DROPS = tuple(
    Shortcut(
        f"rope switch drops the cache ({family} inputs)", (source,), {source: _ROPE_SWITCH},
        "input_drops.drop_length",
        why="the forward past the rope switch refills a new cache, which no undone extra step may be: verdicts are "
            "read at once from that length on only, not for the whole call",
    )
    for family, source in (
        ("phi3", "transformers.models.phi3.modeling_phi3:Phi3ForCausalLM.prepare_inputs_for_generation"),
        ("phimoe", "transformers.models.phimoe.modeling_phimoe:PhimoeForCausalLM.prepare_inputs_for_generation"),
    )
)

SHORTCUTS: tuple[Shortcut, ...] = (
    Shortcut(
        "LogitsProcessorList.__call__", (f"{_LP}:LogitsProcessorList.__call__",),
        {f"{_LP}:LogitsProcessorList.__call__": {"9377c455a80f": "4.57.6-5.22.2", "9bc8e809ae87": "5.23.0-5.24.0"}},
        "step_lists.JoiningLogitsProcessors",
        why="`inspect.signature` of every processor, every step: read once per call",
    ),
    Shortcut(
        "MinLengthLogitsProcessor.__call__", (f"{_LP}:MinLengthLogitsProcessor.__call__",),
        {f"{_LP}:MinLengthLogitsProcessor.__call__": {
            "d8029a61eea0": "4.57.6-5.0.0", "f539cd849301": "5.1.0-5.22.2", "8bc3322c0a8c": "5.23.0-5.24.0"}},
        "step_lists._EosMask",
        why="`isin(arange(vocab), eos)` and a clone every step: the mask only inside the minimum, no clone there",
    ),
    Shortcut(
        "MinNewTokensLengthLogitsProcessor.__call__", (f"{_LP}:MinNewTokensLengthLogitsProcessor.__call__",),
        {f"{_LP}:MinNewTokensLengthLogitsProcessor.__call__": {
            "636e3e5e1ab9": "4.57.6-5.0.0", "15ac7ac2ec8c": "5.1.0-5.22.2", "c58757f0afa5": "5.23.0-5.24.0"}},
        "step_lists._EosMask",
        why="`isin(arange(vocab), eos)` and a clone every step: the mask only inside the minimum, no clone there",
    ),
    Shortcut(
        "StoppingCriteriaList.__call__", (f"{_SC}:StoppingCriteriaList.__call__",),
        {f"{_SC}:StoppingCriteriaList.__call__": {
            "5dbfae3bb6bb": "4.57.6-5.15.1", "04d256aa2c92": "5.16.1-5.22.2", "871bf47c8f66": "5.23.0-5.24.0"}},
        "step_lists.SideStreamCriteria",
        why="a `torch.full` seed and an `|` per criterion, every step: the first bool result seeds the reduction",
    ),
    Shortcut(
        "MaxLengthCriteria.__call__", (f"{_SC}:MaxLengthCriteria.__call__",),
        {f"{_SC}:MaxLengthCriteria.__call__": {
            "ff081c1ab0de": "4.57.6-5.15.1", "79e95a46228e": "5.16.1-5.22.2", "2e4da3c25d0b": "5.23.0-5.24.0"}},
        "step_lists.SideStreamCriteria",
        why="a `torch.full` of a host-known answer every step: skipped while it can only say 'not yet'",
    ),
    Shortcut(
        "EosTokenCriteria.__call__", (f"{_SC}:EosTokenCriteria.__call__",),
        {f"{_SC}:EosTokenCriteria.__call__": {
            "80ff2d727a29": "4.57.6-5.0.0", "0b9091e41241": "5.1.0-5.10.4", "b829c47f0672": "5.11.0-5.15.1",
            "5d2aad95ed11": "5.16.1-5.22.2", "63d0b210fbfb": "5.23.0-5.24.0"}},
        "step_lists._last_tokens_are_eos",
        why="with 10 or more ids `torch.isin` sorts, and its `unique` reads a device count: a sync every step",
    ),
    Shortcut(
        "static decode mask", tuple(_STATIC_MASK_DIGESTS), _STATIC_MASK_DIGESTS,
        "static_mask.MaskPlan",
        why="about twenty kernels and a long Python chain per decode step build a mask that is "
            "`(arange(cache length) <= offset) & padding`: two kernels",
        present="5.17+",
    ),
    Shortcut(
        "update model kwargs", (f"{_GEN}:GenerationMixin._update_model_kwargs_for_generation",),
        {f"{_GEN}:GenerationMixin._update_model_kwargs_for_generation": _UPDATE_KWARGS},
        "kwargs_update.KwargsUpdate",
        why="per step, `arange(1).view(...) + last + 1` and `new_ones` for one new position: `last + 1` and a "
            "column of ones made once per call",
        present="5.5+",
    ),
    # 5.24 (both loops): `_sample`, `prepare_inputs_for_generation` and `_update_model_kwargs_for_generation` name the
    # cache `cache` (read and written through `cache_kwarg.py`); `prepare_inputs_for_generation` also skips the 4D
    # mask for an all-linear-attention cache and passes a flex `BlockMask` through uncopied: neither is on these
    # loops' paths (full-attention static or dynamic layers, tensor masks)
    Shortcut(
        "static decode loop",
        (f"{_GEN}:GenerationMixin._sample", f"{_GEN}:GenerationMixin.prepare_inputs_for_generation",
         f"{_GEN}:GenerationMixin._update_model_kwargs_for_generation", f"{_CU}:StaticLayer.update",
         *(f"{_LP}:{name}.__call__" for name in (
             "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper"))),
        {
            f"{_GEN}:GenerationMixin._sample": {"61160ef8c121": "5.17.0-5.23.0", "9e153ccbcefb": "5.24.0"},
            f"{_GEN}:GenerationMixin.prepare_inputs_for_generation": {
                "13748caf50e9": "5.17.0", "81541ac5a2c2": "5.18.0-5.19.0", "4a63a45d2e0e": "5.20.2-5.22.2",
                "378c9d0cf4aa": "5.23.0", "4043fda523a5": "5.24.0"},
            f"{_GEN}:GenerationMixin._update_model_kwargs_for_generation": _UPDATE_KWARGS,
            f"{_CU}:StaticLayer.update": {"ee4886d3398e": "5.16.1-5.23.0"},
            # graph safety of the built-in processors the tail captures: no host read, no host-built tensor
            f"{_LP}:TemperatureLogitsWarper.__call__": _TEMPERATURE,
            f"{_LP}:TopKLogitsWarper.__call__": {"2b8bab48a54a": "4.57.6-5.22.2", "3f901d10cbf2": "5.23.0-5.24.0"},
            f"{_LP}:TopPLogitsWarper.__call__": {"6561bf719576": "4.57.6-5.22.2", "66d37a2701b0": "5.23.0-5.24.0"},
            f"{_LP}:MinPLogitsWarper.__call__": {
                "ea84c2487a64": "4.57.6", "dc52619ba3d1": "5.0.0-5.22.2", "3896514acde0": "5.23.0-5.24.0"},
        },
        "static_loop.loop.run",
        why="with a static cache, everything around the compiled forward is eager Python every step: the inputs "
            "are advanced in place and the rest of the step is one CUDA graph replay",
        present="5.17+",
    ),
    Shortcut(
        "dynamic decode loop",
        (f"{_GEN}:GenerationMixin._sample", f"{_GEN}:GenerationMixin.prepare_inputs_for_generation",
         f"{_GEN}:GenerationMixin._update_model_kwargs_for_generation"),
        {
            f"{_GEN}:GenerationMixin._sample": {"61160ef8c121": "5.17.0-5.23.0", "9e153ccbcefb": "5.24.0"},
            f"{_GEN}:GenerationMixin.prepare_inputs_for_generation": {
                "13748caf50e9": "5.17.0", "81541ac5a2c2": "5.18.0-5.19.0", "4a63a45d2e0e": "5.20.2-5.22.2",
                "378c9d0cf4aa": "5.23.0", "4043fda523a5": "5.24.0"},
            f"{_GEN}:GenerationMixin._update_model_kwargs_for_generation": _UPDATE_KWARGS,
        },
        "dynamic_loop.loop.run",
        why="with a dynamic cache, each step prepares its inputs and updates its kwargs through generic code: "
            "the next token, position and mask are made from the previous step's",
        present="5.17+",
    ),
    *_GROWN_MASKS,
    # --- processors the static-cache loop captures beyond "static decode loop" (static_loop/processors/) ---
    Shortcut(
        "static loop repetition penalty", (f"{_LP}:RepetitionPenaltyLogitsProcessor.__call__",),
        # the three sources are three variants of `processors.forms.RepetitionPenalty` (`_REPETITION`)
        {f"{_LP}:RepetitionPenaltyLogitsProcessor.__call__": {
            "35dcc5fc15b0": "4.57.6-5.17.0", "4f13000c1f61": "5.18.0-5.22.2", "0bf3c6d07642": "5.23.0-5.24.0"}},
        "static_loop.processors.forms.RepetitionPenalty",
        why="a gather and a scatter over the whole growing sequence every step, which no CUDA graph can replay: a "
            "device 'tokens seen' state updated by the tail",
        present="4.57+",  # the source is 4.57.6's until 5.17 (the static loop that uses it runs from 5.17)
    ),
    Shortcut(
        "static loop encoder repetition penalty", (f"{_LP}:EncoderRepetitionPenaltyLogitsProcessor.__call__",),
        {f"{_LP}:EncoderRepetitionPenaltyLogitsProcessor.__call__": {
            "689734137f7d": "4.57.6-5.18.0", "89292f2761ee": "5.19.0-5.22.2", "4fb22b9fe793": "5.23.0-5.24.0"}},
        "static_loop.eligibility._builtin_graph_safe",
        why="reads only its own ids and penalty: captured as it is, under a guard",
        present="4.57+",  # the source is 4.57.6's until 5.18
    ),
    Shortcut(
        "static loop no repeat ngram", (f"{_LP}:NoRepeatNGramLogitsProcessor.__call__",),
        # two variants of `processors.forms.NoRepeatNGram` (`_NGRAM`): 5.18+ clamp ids past the vocabulary
        {f"{_LP}:NoRepeatNGramLogitsProcessor.__call__": {
            "9bfab15ed81f": "5.15.1-5.17.0", "9a61f49a39f4": "5.18.0-5.22.2", "dd416ba08a20": "5.23.0-5.24.0"}},
        "static_loop.processors.forms.NoRepeatNGram",
        why="windows over the whole growing sequence every step: the same windows over the sequence buffer, "
            "counted up to the device-side length",
        present="5.15+",  # 5.15.1's source (the static loop that uses it runs from 5.17)
    ),
    Shortcut(
        "static loop sequence bias", (f"{_LP}:SequenceBiasLogitsProcessor.__call__",),
        # 5.17-5.22 build tensors from host lists at every step (`torch.tensor(sequence_ids)`): not capturable
        {f"{_LP}:SequenceBiasLogitsProcessor.__call__": {"661c3b65b180": "5.23.0-5.24.0"}},
        "static_loop.processors.forms.LastTokens",
        why="reads the last tokens of a growing sequence: a window of the sequence buffer at the device length",
        present="5.23+",
    ),
    # --- assisted decoding and prompt lookup (assisted/) -----------------------------------------------------
    *_ASSISTED_LOOPS,
    Shortcut(
        "MaxTimeCriteria.__call__", (f"{_SC}:MaxTimeCriteria.__call__",),
        {f"{_SC}:MaxTimeCriteria.__call__": {
            "a7d9e18db6ef": "4.57.6-5.15.1", "3e0887a238f5": "5.16.1-5.22.2", "feecb4dd2011": "5.23.0-5.24.0"}},
        "assisted.loop.FoldedCriteria",
        why="a host clock wrapped in a device bool: decided on the host in the round's verdict",
    ),
    Shortcut(
        "assistant confidence on the device", (f"{_SC}:ConfidenceCriteria.__call__",),
        {f"{_SC}:ConfidenceCriteria.__call__": {
            "4078221af7a9": "4.57.6-5.15.1", "b8a38e104c56": "5.16.1-5.22.2", "99ef45ddf886": "5.23.0-5.24.0"}},
        "assisted.draft.DeviceConfidence",
        why="`.item()` of the drafted token's probability after every drafted token",
    ),
    Shortcut(
        "assistant special tokens once per call", (f"{_GEN}:GenerationMixin._prepare_special_tokens",),
        {f"{_GEN}:GenerationMixin._prepare_special_tokens": {
            "539f781d2589": "4.57.6", "3487cfb12e7a": "5.0.0", "8020f3434a9d": "5.1.0-5.3.0",
            "dad62a7f66d6": "5.4.0-5.12.1", "a0570398eeff": "5.13.1-5.24.0"}},
        "assisted.draft.patched_prepare_special_tokens",
        why="three blocking H2D copies and two reads in every round's assistant generate(), same tensors each time",
    ),
    Shortcut(
        "draft probabilities in the round's copy",
        (f"{_CG}:AssistedCandidateGenerator._generate_candidates",),
        {f"{_CG}:AssistedCandidateGenerator._generate_candidates": {
            "09ade19b3e20": "4.57.6", "031a65e6368b": "5.0.0-5.2.0", "b0ce23063e6b": "5.3.0-5.22.2",
            "a211c46eaae7": "5.23.0", "2906eff882fe": "5.24.0"}},
        "assisted.draft._generate_candidates",
        why="with scikit-learn, a CPU-indexed gather (an H2D copy) and `p.tolist()` every round",
    ),
    Shortcut(
        "draft logits processors without the encoder-ids check", (f"{_GEN}:GenerationMixin._get_logits_processor",),
        {f"{_GEN}:GenerationMixin._get_logits_processor": {
            "1cd36a560e01": "5.21.1-5.22.2", "aecfcb65c619": "5.23.0", "6527aa8c6c5a": "5.24.0"}},
        "assisted.draft.patched_get_logits_processor", present="5.21+",
        why="`(encoder_input_ids < 0).any()` read in every round's assistant generate(), for processors it lacks",
    ),
    Shortcut(
        "draft attention mask on the host",
        (f"{_GEN}:GenerationMixin.generate", f"{_GEN}:GenerationMixin._prepare_attention_mask_for_generation"),
        # 5.18-5.20 drop the mask for flash attention too (`_builds_ones` leaves flash attention to stock) and
        # refuse CPU input ids (the mask is the only CPU tensor handed over)
        {f"{_GEN}:GenerationMixin.generate": {"6c78fb8d9056": "5.18.0-5.19.0", "4b50e18e202d": "5.20.2",
                                              "b899fecda276": "5.21.1-5.23.0", "3f956ba85838": "5.24.0"},
         f"{_GEN}:GenerationMixin._prepare_attention_mask_for_generation": {"f9e2a05f5d00": "5.1.0-5.24.0"}},
        "assisted.draft.DraftRun.host_mask", present="5.18+",
        why="every round's assistant generate() builds an all-ones mask, reads `(mask == 1).all()` and drops it",
    ),
    # 5.24 makes static layers croppable (`crop` is new there): before it, no release has these three sources
    Shortcut(
        "static sliding layer counters",
        (f"{_CU}:StaticSlidingWindowLayer.update", f"{_CU}:StaticSlidingWindowLayer.crop", f"{_CU}:StaticLayer.crop"),
        {f"{_CU}:StaticSlidingWindowLayer.update": {"e292f922e791": "5.17.0-5.18.0, 5.24.0"},
         f"{_CU}:StaticSlidingWindowLayer.crop": {"08845cd2cd66": "5.24.0"},
         f"{_CU}:StaticLayer.crop": {"3765188a4ed3": "5.24.0"}},
        "assisted.room.Room", present="5.24+",
        why="where a sliding static layer writes is a device counter that its slides leave behind and its crops "
            "move; the assisted loop follows it on the host to raise before a forward that indexes out of bounds",
    ),
    Shortcut(
        "prompt lookup on the host mirror",
        (f"{_CG}:PromptLookupCandidateGenerator.get_candidates",) + tuple(
            f"{_LP}:{name}.__call__" for name in (
                "TemperatureLogitsWarper", "TopKLogitsWarper", "RepetitionPenaltyLogitsProcessor", "MinPLogitsWarper")),
        {
            f"{_CG}:PromptLookupCandidateGenerator.get_candidates": {
                "c004f18d8fb1": "4.57.6", "30617195f295": "5.0.0", "a0fc6d546923": "5.1.0-5.2.0",
                "3975d4c4dc35": "5.3.0", "79460d8a27fc": "5.4.0-5.7.0", "655474704547": "5.8.1-5.12.1",
                "d598a60d2ee6": "5.13.1-5.22.2", "f5649648285e": "5.23.0"},
            f"{_LP}:TemperatureLogitsWarper.__call__": _TEMPERATURE,
            f"{_LP}:TopKLogitsWarper.__call__": {"2b8bab48a54a": "4.57.6-5.22.2", "3f901d10cbf2": "5.23.0-5.24.0"},
            f"{_LP}:RepetitionPenaltyLogitsProcessor.__call__": {
                "35dcc5fc15b0": "4.57.6-5.17.0", "4f13000c1f61": "5.18.0-5.22.2", "0bf3c6d07642": "5.23.0-5.24.0"},
            f"{_LP}:MinPLogitsWarper.__call__": {
                "ea84c2487a64": "4.57.6", "dc52619ba3d1": "5.0.0-5.22.2", "3896514acde0": "5.23.0-5.24.0"},
        },
        "assisted.lookup.HostLookup",
        why="the n-gram search reads the device for every match and candidate; it is integer work on the host "
            "copy, and these processors cannot forbid a candidate on all-ones logits",
    ),
    # --- models whose own input preparation drops the cache (input_drops.py) ----------------------------------
    *_INPUT_DROPS,
)
