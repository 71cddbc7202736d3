"""Quantization formats, one module each behind ``base.QuantizationFormat``, listed in ``registry.FORMATS``:
methods applied at load (``int8.py``, ``int4.py``) and checkpoints quantized elsewhere (``awq.py``, ``gptq.py``,
``compressed_tensors.py``, ``fp8.py``, ``gguf.py``), loaded as stored by ``loading.py``."""
