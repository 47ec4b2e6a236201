"""What every engine backend shares, in one implementation so backends cannot drift: the paged KV pool and
block allocator (``kv_pool``), per-request block bookkeeping (``blocks``), the radix prefix cache
(``radix_cache``), the continuous-batching scheduler (``scheduler``), the request table and the paged engine
the torch and emulated backends build on (``paged_engine``), the request and step output types (``request``),
sampling parameters (``sampling_params``), input validation (``validation``), the serving dtype (``dtypes``),
errors, and the settings fields several backends declare (``settings``)."""
