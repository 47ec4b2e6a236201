"""The emulated backend's entry point (``pdd.engines``: ``emulated``): its settings, and where its code is."""

from pdd.engine.emulated_backend.settings import EmulatedModelSettings, EmulationSettings
from pdd.shared.engines import EnginePlugin

PLUGIN = EnginePlugin(name="emulated", model_settings=EmulatedModelSettings, section="emulation",
                      section_settings=EmulationSettings,
                      build="pdd.engine.emulated_backend.profile:build_engine",
                      preflight="pdd.engine.emulated_backend.profile:preflight")
