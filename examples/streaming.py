"""Streaming with the flag: tokens reach the streamer one step late, every token exactly once, never the extra one.

    python examples/streaming.py
Uses a tiny word-level tokenizer built offline and a random-weight model, so the text is gibberish by design.
"""

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TextStreamer

import transformers_async_stop  # noqa: F401


def tiny_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5)
    model = LlamaForCausalLM(config).to(device).eval()
    tokenizer = tiny_tokenizer(64)
    inputs = tokenizer("w5 w9 w17 w33", return_tensors="pt").to(device)
    streamer = TextStreamer(tokenizer, skip_prompt=True)
    out = model.generate(**inputs, max_new_tokens=20, pad_token_id=0, streamer=streamer,
                         async_stopping_criteria=True)
    print("decoded:", tokenizer.decode(out[0, inputs.input_ids.shape[1]:]))


if __name__ == "__main__":
    main()
