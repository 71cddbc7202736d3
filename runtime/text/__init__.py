"""Text in and out: tokenizer and chat templates, detokenizer, tool-call parsing."""
