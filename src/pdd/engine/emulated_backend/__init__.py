"""The emulated engine backend (``model.backend: emulated``): no weights, step times from the cost model of a
scenario's chips, oracle tokens, the real paged KV pool and radix cache. ``engine.py``: ``EmulatedEngine``;
``profile.py``: a role's chips, cost model and KV shape from the config's ``emulation`` section, and the engine
built from them; ``settings.py``/``plugin.py``: its config keys and entry point."""
