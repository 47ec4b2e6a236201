"""The router: OpenAI-compatible API, fleet registry, pipeline choice, in-order token emission."""
