"""Hugging Face checkpoints in and out of Megatron-Core's GPT (docs/hf.md).

``config`` reads a ``config.json`` as the manifest's ``model`` section (and writes one back),
``mapping`` says which rows of which Hugging Face tensors make each parameter on a TP rank,
``checkpoint`` reads the directory's files, ``load`` imports into a rank's model, ``export``
writes a whole model out, ``verify`` compares logits with transformers, and ``manifest`` is
``fp8ops manifest from-hf``. The modules import torch and safetensors only where they need them;
nothing is imported here.
"""
