"""The torch backend's entry point (``pdd.engines``: ``torch``): its settings, and where its code is."""

from pdd.engine.torch_backend.settings import TorchSettings
from pdd.shared.engines import EnginePlugin

PLUGIN = EnginePlugin(name="torch", model_settings=TorchSettings,
                      build="pdd.engine.torch_backend.build:build_engine",
                      preflight="pdd.engine.torch_backend.build:preflight")
