from .tokenizer import Tokenizer

__all__ = ["Tokenizer"]
