"""The vLLM engine backend (``model.backend: vllm``): vLLM embedded in a PDD role, KV moved by PDD's connector.

``engine.py``: ``VllmEngine``, the engine interface over vLLM; ``connector.py``: ``PDDConnector``, vLLM's
``KVConnectorBase_V1`` between vLLM's paged cache and PDD's staging pool. Needs vLLM (``bash
scripts/install_vllm.sh``); nothing else of PDD imports this package. See docs/BACKENDS.md.
"""
