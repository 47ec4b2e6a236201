"""The torch engine backend (``model.backend: torch``, the embedded default): Llama-family weights and exact CPU
math (pdd.kernels) over the paged engine every backend shares. ``engine.py``: ``TorchEngine``; ``model.py``,
``loader.py``, ``config.py``: the model and its checkpoints; ``sampling.py``: the sampler; ``dtype_probe.py``:
``dtype: auto`` by measurement; ``tiny.py``: the seeded test checkpoint; ``settings.py``/``plugin.py``: its
config keys and entry point; ``build.py``: the engine from a config."""
