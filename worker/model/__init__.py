"""The model families: their decoder definitions, weight loading (HF folders and GGUF) and tokenizers."""
