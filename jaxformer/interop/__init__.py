"""Checkpoints of other libraries in and out (today: Hugging Face ``transformers``). See :mod:`jaxformer.interop.hf`."""

from jaxformer.interop.hf import load_pretrained, save_pretrained
from jaxformer.interop.rules import HFConfigError, HFWeightsError
from jaxformer.interop.tokenizer import HFTokenizer, load_tokenizer

__all__ = ["HFConfigError", "HFTokenizer", "HFWeightsError", "load_pretrained", "load_tokenizer", "save_pretrained"]
