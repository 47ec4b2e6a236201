"""PDD: prefill/decode disaggregation across datacenters."""

from pdd import _bare_names

__version__ = "0.1.0"

_bare_names.install()  # before anything imports transformers (which imports the PyPI package `kernels`)
