"""Runs the model: the engine (engine.py) over stages (stage.py) on their backends (gpu.py: the kernel stage;
model.py: the fp32 reference), the scheduler, experts, tokenizer, chat format, sampler and benchmark."""
