"""Real peft LoRA adapters for the usage fuzzer's `user_module: peft` (usage_modules.py): LoRA on the attention's
query / value projections (and the MLP's), lora_B random and non-zero (`init_lora_weights=False`), one adapter ("a")
or two ("a", "b"), and the changes a user makes between calls or mid-call from a criterion or processor:
`set_adapter`, `add_adapter` / `delete_adapter`, `merge` / `unmerge` (`merge_adapter` / `unmerge_adapter`), `scale` /
`unscale` (each LoRA layer's `scale_layer` / `unscale_layer`), `disable_layers` / `enable_layers`; around a call,
`disable_adapter()` (usage_modules.User.around)."""

from __future__ import annotations

# (the last ones: found families' names, tried after every hand-read family's: GPT-NeoX's fused projection and MLP,
# Phi's and GPT-J's MLPs; an MoE family's experts, one parameter per projection, take no LoRA: attention only; the
# latent-attention families' query up-projection and the one decompressing the cached latents, in their `expand_kv`)
_ATTN = (("q_proj", "v_proj"), ("qkv_proj",), ("c_attn",), ("query_key_value",), ("q_b_proj", "kv_b_proj"))
_MLP = (("up_proj", "down_proj"), ("gate_up_proj", "down_proj"), ("c_fc",), ("dense_h_to_4h", "dense_4h_to_h"),
        ("fc1", "fc2"), ("fc_in", "fc_out"))

# the latent-attention families with routed experts (usage_dimensions.LATENT_FAMILIES but MiniCPM3): peft converts
# transformers' fused experts (`gate_up_proj`) only with both `gate_proj` and `up_proj` targeted, and their dense and
# shared-experts MLPs have both: LoRA on all three projections there, experts included
_MLP_GATED = {"deepseek_v3", "deepseek_v2", "glm4_moe_lite"}


def _mlp_names(model):
    if getattr(model.config, "model_type", None) in _MLP_GATED:
        return ["gate_proj", "up_proj", "down_proj"]
    return _names(model, _MLP)


def _names(model, table):
    leaves = {name.rpartition(".")[2] for name, _ in model.named_modules()}
    for names in table:
        if set(names) <= leaves:
            return list(names)
    return []


class Adapters:
    def __init__(self, spec, model):
        from peft import LoraConfig, get_peft_model

        targets = _names(model, _ATTN) + (_mlp_names(model) if spec.get("targets") == "attn_mlp" else [])
        conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())
        self.config = lambda: LoraConfig(r=2, lora_alpha=4, target_modules=list(targets), lora_dropout=0.0,
                                         init_lora_weights=False, fan_in_fan_out=conv1d)
        self.model = get_peft_model(model, self.config(), adapter_name="a")
        if spec.get("second"):
            self.model.add_adapter("b", self.config())
        self.model.eval()

    def layers(self):
        from peft.tuners.lora import LoraLayer

        return [m for m in self.model.modules() if isinstance(m, LoraLayer)]

    def apply(self, op):
        what, value, model = op["op"], op.get("value"), self.model
        if what == "set_adapter":
            model.set_adapter(value)
        elif what == "add_adapter":
            model.add_adapter(value, self.config())
            model.eval()
        elif what == "delete_adapter":
            model.delete_adapter(value)
        elif what == "merge":
            model.merge_adapter()
        elif what == "unmerge":
            model.unmerge_adapter()
        elif what == "scale":
            for layer in self.layers():
                layer.scale_layer(value)
        elif what == "unscale":
            for layer in self.layers():
                layer.unscale_layer(value)
        elif what == "disable_layers":
            model.base_model.disable_adapter_layers()
        elif what == "enable_layers":
            model.base_model.enable_adapter_layers()
        else:
            raise ValueError(what)
        return "done"

    def observe(self):
        layers = self.layers()
        return {"adapters": sorted(self.model.peft_config), "active": list(self.model.active_adapters),
                "merged": [list(layer.merged_adapters) for layer in layers],
                "disabled": [bool(layer.disable_adapters) for layer in layers],
                "scaling": [sorted(layer.scaling.items()) for layer in layers]}
