"""wikitext2_local scores pages exactly as lm-eval's ``wikitext`` task does:
its detokenizer makes the text, its process_results counts words and bytes on
the original page. Copied next to the rendered YAML by quantlab."""
from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer

__all__ = ["process_results", "wikitext_detokenizer"]
