from .chat_template import ChatTemplate
from .detokenizer import IncrementalDetokenizer
from .tokenizer import Tokenizer

__all__ = ["ChatTemplate", "IncrementalDetokenizer", "Tokenizer"]
