"""Checkpoints of other libraries in and out: Hugging Face ``transformers`` (:mod:`jaxformer.interop.hf`),
llama.cpp's GGUF files, read (:mod:`jaxformer.interop.gguf`, through the same ``load_pretrained``), and
``peft`` LoRA adapters, in and out (:mod:`jaxformer.interop.peft`)."""

from jaxformer.interop.hf import load_pretrained, save_pretrained
from jaxformer.interop.peft import PeftAdapterError, apply_adapter, load_adapter, merge_lora, save_adapter
from jaxformer.interop.rules import HFConfigError, HFWeightsError
from jaxformer.interop.tokenizer import HFTokenizer, load_tokenizer

__all__ = ["HFConfigError", "HFTokenizer", "HFWeightsError", "PeftAdapterError", "apply_adapter", "load_adapter",
           "load_pretrained", "load_tokenizer", "merge_lora", "save_adapter", "save_pretrained"]
