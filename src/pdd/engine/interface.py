"""The engine interface, stated once: what the prefill, relay and main-decode roles may ask of an engine.

The roles (pdd.roles: engine_service.py and the roles on it) hold an ``EngineBackend`` and touch nothing
else of the engine but the core's types (engine/core); tests/engine/test_engine_interface.py checks both that
the backends satisfy this Protocol and that the roles reach no attribute outside it. A backend is one folder
that provides a class with these members (structural typing: no base class to inherit) and one entry point
of the ``pdd.engines`` group (shared/engines.py: its settings and its ``build``):

- ``torch``: ``TorchEngine`` (engine/torch_backend/), the embedded default;
- ``emulated``: ``EmulatedEngine`` (engine/emulated_backend/): no weights, cost-model step times, oracle
  tokens, the real KV pool and radix cache; the config's ``emulation`` section says which chips it times;
- ``vllm``: ``VllmEngine`` (engine/vllm_backend/): vLLM embedded in the role's process, a staging pool beside
  it that PDD's connector fills and reads (docs/BACKENDS.md).

The torch and emulated engines share the paged engine of engine/core/paged_engine.py; every backend shares
the core's validation, block bookkeeping and types.

One fleet runs one backend and one KV layout (``layout``): engines refuse to join a fleet of another.

Threading: an engine is not thread-safe. Every call comes from one worker thread
(roles/engine_runner.py), so control calls (abort, extend, stop, import) land between two steps.

Errors: input a client or a peer sent that the engine refuses raises ``EngineInputError`` or one of its
subclasses (engine/core/errors.py: ``UnknownRequestError``, ``DuplicateRequestError``, ``EmptyPromptError``,
``PromptTooLongError``, ``InvalidSamplingParamsError``); a pool too full to take a transfer raises
``OutOfBlocks``. Any other exception is a bug in the backend.

Style after mini-sglang's ``kvcache/base.py``: each member says what it changes and what it raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pdd.engine.core.dtypes import DtypeChoice
from pdd.engine.core.radix_cache import CacheEvent
from pdd.engine.core.request import ImportReservation, StepOutput
from pdd.engine.core.sampling_params import SamplingParams
from pdd.shared.config import PDDConfig
from pdd.shared.engines import engine_plugin
from pdd.shared.kv_layout import KVLayout

if TYPE_CHECKING:
    import torch


@runtime_checkable
class EngineBackend(Protocol):
    """One model, one paged KV pool, one prefix cache, one scheduler: the request API the roles drive."""

    # ---- what the engine is (fixed once constructed; read-only) --------------------------------
    @property
    def layout(self) -> KVLayout:
        """The KV pool's layout (layers, block size, KV heads, head dim, dtype): what a transfer between two
        engines must agree on, and what the fleet check compares. Changes nothing."""
        ...

    @property
    def block_size(self) -> int:
        """Tokens per KV block (``layout.block_size``). Changes nothing."""
        ...

    @property
    def max_context(self) -> int:
        """The most tokens (prompt plus outputs) one request may hold. Changes nothing."""
        ...

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end a request (unless its sampling ignores EOS). Changes nothing."""
        ...

    @property
    def dtype_choice(self) -> DtypeChoice:
        """The weights and KV dtypes in use, and why they were picked. Changes nothing."""
        ...

    @property
    def linear_kernel(self) -> str:
        """A name for the kernels that compute the projections (logged at startup). Changes nothing."""
        ...

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams | None = None,
                    max_new_tokens: int = 16, hold_kv: bool = False,
                    known_outputs: list[int] | None = None) -> None:
        """Queue a new request: the following steps prefill it (reusing a cached prefix) and decode it.

        ``hold_kv``: when it finishes, its KV stays pinned for export until ``release``.
        ``known_outputs``: outputs another engine produced; recomputed with the prompt, sampling continues
        after them. Raises ``DuplicateRequestError`` (id in use), ``EmptyPromptError``, ``PromptTooLongError``,
        ``InvalidSamplingParamsError`` or ``EngineInputError`` (bad token ids, bad ``max_new_tokens``,
        known outputs that already finish it); nothing is queued then."""
        ...

    def abort(self, rid: str) -> None:
        """Drop a request in any state and free its KV blocks without caching them. No output follows.
        Unknown ids are a no-op; raises nothing."""
        ...

    def has_request(self, rid: str) -> bool:
        """Whether the engine still holds ``rid`` (queued, running, importing, or finished but held for
        export). Changes nothing."""
        ...

    def has_work(self) -> bool:
        """Whether ``step`` would do anything (a request to compute or an output to hand back); paused
        requests with nothing left to extend do not count. Changes nothing."""
        ...

    def step(self) -> list[StepOutput]:
        """Run one batch: prefill/extend/decode the scheduled requests and return their new tokens and
        finishes (a finished request leaves the engine unless held with ``hold_kv``; its KV goes to the
        prefix cache when the engine caches finished requests, else is freed). May preempt requests when
        the pool runs out. Raises nothing for request input (checked when it was given)."""
        ...

    def finish_to_cache(self, rid: str) -> None:
        """Finish ``rid`` now, storing its computed KV in the prefix cache, then free it. No output follows.
        Raises ``UnknownRequestError``."""
        ...

    # ---- KV export (P side) --------------------------------------------------------------------
    def request_blocks(self, rid: str) -> list[int]:
        """The pool block ids that hold ``rid``'s prompt KV, in order (read these to export). Changes
        nothing. Raises ``UnknownRequestError``, or ``EngineInputError`` before its prefill is done."""
        ...

    def computed_prompt_blocks(self, rid: str) -> list[int]:
        """The leading blocks of ``rid``'s prompt whose KV is final (read these to stream an export while later
        prefill chunks compute): every full block computed so far, a cached prefix included, and all of them
        once the prefill is done; ``[]`` while queued. A backend that cannot tell returns ``[]`` until the prefill
        is done. Changes nothing. Raises ``UnknownRequestError``."""
        ...

    def release(self, rid: str) -> None:
        """Unpin a request held with ``hold_kv`` (export done or abandoned): its KV goes to the prefix cache
        when the engine caches finished requests, else is freed; ``rid`` leaves the engine.
        Raises ``UnknownRequestError``."""
        ...

    def kv_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The pool's K and V memory, one tensor per layer, shaped as ``layout`` says (blocks first): what a
        transport registers to read and write blocks in place. The same tensors for the engine's lifetime.
        Changes nothing itself; writers must hold a reservation (``prepare_import``)."""
        ...

    # ---- KV import (RLD / MD side) ----------------------------------------------------------------
    def prepare_import(self, rid: str, prompt_ids: list[int], use_cache: bool = True) -> ImportReservation:
        """Reserve blocks for an incoming prompt KV transfer: reuse and lock the cached prefix (when
        ``use_cache``), allocate the rest (evicting cache if needed); ``rid`` is held, awaiting
        ``commit_import`` or ``abort``. Raises ``OutOfBlocks`` (nothing reserved), or what ``add_request``
        raises for a bad id or prompt."""
        ...

    def commit_import(self, rid: str, prompt_ids: list[int], output_ids_so_far: list[int],
                      params: SamplingParams | None = None, max_new_tokens: int = 16) -> None:
        """The prompt's KV has landed in the reserved blocks: run ``rid`` from output position
        ``len(output_ids_so_far)`` (those outputs are extended at the next step, then decoding continues).
        Raises ``UnknownRequestError``, or ``EngineInputError`` (not awaiting an import, another prompt,
        no first token, bad token ids or sampling); ``rid`` stays reserved then."""
        ...

    # ---- handoff: extend, pause, stop ---------------------------------------------------------------
    def extend_known(self, rid: str, token_ids: list[int], start_position: int | None = None) -> None:
        """Append known output tokens; the next step computes their KV in one pass. ``start_position``:
        output index of ``token_ids[0]`` (outputs from there on are replaced). Raises
        ``UnknownRequestError``, ``EngineInputError`` (not running, bad token ids, a gap) or
        ``PromptTooLongError`` (past ``max_context``)."""
        ...

    def pause(self, rid: str) -> None:
        """Keep extending known tokens for ``rid`` but sample nothing until ``resume``.
        Raises ``UnknownRequestError``."""
        ...

    def resume(self, rid: str) -> None:
        """Sample again from the next output position (no-op when not paused). Raises ``UnknownRequestError``."""
        ...

    def stop_at(self, rid: str, position: int) -> None:
        """Produce only outputs with index < ``position``, then finish with reason "length".
        Raises ``UnknownRequestError``."""
        ...

    # ---- prefix cache --------------------------------------------------------------------------------
    def cached_prefix_len(self, token_ids: list[int]) -> int:
        """Leading tokens of ``token_ids`` the prefix cache holds (block aligned; 0 when caching is off).
        Changes nothing (no lock, no LRU touch). Raises nothing."""
        ...

    def drain_cache_events(self) -> list[CacheEvent]:
        """The prefix cache's block stored/removed events since the last call (for the router's prefix
        index), oldest first; empties the queue. Raises nothing."""
        ...

    # ---- stats (health, heartbeat, metrics) -------------------------------------------------------
    def num_free_blocks(self) -> int:
        """KV blocks neither in use nor cached. Changes nothing."""
        ...

    def num_total_blocks(self) -> int:
        """KV blocks in the pool. Changes nothing."""
        ...

    def describe(self) -> dict[str, Any]:
        """What the startup log says of this engine beyond the interface's fields: a backend's own block (the
        emulated engine's ``emulated``: chips, KV scale, dilation, capacity), or nothing. Changes nothing."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters for health and metrics: ``running``, ``waiting``, ``free_blocks``, ``total_blocks``,
        ``cached_blocks``, ``evictable_blocks``, ``cache_queries``, ``cache_hit_tokens``,
        ``cache_query_tokens``, ``cache_hit_rate``, ``preemptions``. Changes nothing."""
        ...


def load_engine(config: PDDConfig, role: str, cache_finished: bool) -> EngineBackend:
    """Build the engine of ``config.model.backend`` for ``role`` (the one place the roles get a concrete engine):
    the backend's entry point builds it from the config's common ``model.*`` keys and its own settings.
    ``cache_finished``: whether finished requests' KV goes to the prefix cache (P and MD; the relay keeps none).
    Raises ``ValueError`` for a backend no entry point names; what loading raises otherwise (a missing
    checkpoint, an unsupported architecture, a backend's missing package)."""
    return engine_plugin(config.model.backend).call("build", config, role, cache_finished)
