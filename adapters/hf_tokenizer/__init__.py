"""The Tokenizer port over Hugging Face tokenizers."""

from adapters.hf_tokenizer.tokenizer import HFTokenizer

__all__ = ["HFTokenizer"]
