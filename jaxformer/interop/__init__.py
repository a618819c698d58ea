"""Checkpoints of other libraries in and out: Hugging Face ``transformers`` (:mod:`jaxformer.interop.hf`) and
llama.cpp's GGUF files, read (:mod:`jaxformer.interop.gguf`, through the same ``load_pretrained``)."""

from jaxformer.interop.hf import load_pretrained, save_pretrained
from jaxformer.interop.rules import HFConfigError, HFWeightsError
from jaxformer.interop.tokenizer import HFTokenizer, load_tokenizer

__all__ = ["HFConfigError", "HFTokenizer", "HFWeightsError", "load_pretrained", "load_tokenizer", "save_pretrained"]
