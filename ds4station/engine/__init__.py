"""The model-file layer and the DS4 model: GGUF I/O, quant formats, tokenizer, chat format, reference model."""
