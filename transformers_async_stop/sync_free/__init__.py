"""Stock pieces of a decode step, replaced by ones with no blocking device read (or fewer kernels), same values.

- `inputs.py`: `_cache_dependant_input_preparation` without reading `cache_position[-1]` (4.57-5.2);
- `masking.py`: the SDPA mask-skip checks answered on the host during `generate()`;
- `padding_check.py`: the padding warning of a decode step checked without a blocking read;
- `kwargs_update.py`: `_update_model_kwargs_for_generation` of a decode step with fewer kernels (flag on);
- `static_mask.py`: a static cache's decode-step attention mask in two kernels (flag on).
"""
